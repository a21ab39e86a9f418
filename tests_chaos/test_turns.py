"""A turns host loses the engine whose turn it is, with real processes: 2 hosts x 3 models, every engine a
`fleetgate sim` process of its own on gpu0 (gpu1's three share one), the gateway `fleetgate serve`, its turns
driver (gateway/control/turns.py) switching between the models with requests.

`kill -9` (or SIGSTOP) of gpu0's running engine: the engine loses its turn (its pause is never answered, so it
is taken for dead or hung and out of rotation), gpu0's other two engines go on taking turns, and the lost
model's streams resume on gpu1's engine of the same model. No client sees a failure, and the other models'
streams finish within twice their time in the same run without the fault (measured first, on the same
processes).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gateway.control.turns import PAUSE_FLOOR_S
from tests.helpers import poll

pytestmark = pytest.mark.timeout(300)

MODELS = ("pool/model-a", "pool/model-b", "pool/model-c")
STREAMS_PER_MODEL = 2          # one per host, least requests
MAX_TOKENS = 150
TIME_SCALE = 2.0
HEALTH_TIMEOUT_S = 2.0


@dataclass
class Result:
    model: str
    took_s: float = 0.0
    error: str | None = None


async def stream(oa: openai.AsyncOpenAI, model: str, started: list[int], i: int) -> Result:
    """One streamed completion through the official client with no retries: its time from send to the end of the
    stream with exactly MAX_TOKENS tokens, or what went wrong (an error event raises in the client)."""
    res = Result(model)
    t0 = time.monotonic()
    tokens = None
    try:
        chunks = await oa.completions.create(model=model, prompt=f"turns chaos {i}", max_tokens=MAX_TOKENS,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        async for chunk in chunks:
            started[i] += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.took_s = time.monotonic() - t0
    if tokens != MAX_TOKENS:
        res.error = f"{tokens} tokens"
    return res


def write_config(tmp_path: Path, urls: dict[str, dict[str, str]]) -> Path:
    hosts = [{"id": hid, "max_awake": 1, "scheduling": "turns", "q_max_s": 0.3,
              "engines": {m: {"url": u, "load_s": 0.05, "offload_s": 0.05} for m, u in engines.items()}}
             for hid, engines in urls.items()]
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({"shared_hosts": hosts, "slo": {"tpot_ms": 100}, "scrape_interval_s": 0.05,
                               "health": {"interval_s": 1.0, "timeout_s": HEALTH_TIMEOUT_S},
                               "limits": {"queue_timeout_s": 60}}))
    return cfg


async def gpu0(http: httpx.AsyncClient, url: str) -> dict:
    hosts = (await http.get(url + "/ui/status.json")).json()["shared_hosts"]
    return next(h for h in hosts if h["id"] == "gpu0")


async def run_load(oa: openai.AsyncOpenAI, http: httpx.AsyncClient, url: str, kill: dict[str, object] | None = None,
                   sig: int = signal.SIGKILL) -> tuple[list[Result], str | None]:
    """Every model's streams at once; with `kill` (model -> its gpu0 process), `sig` to the engine gpu0 runs once
    every stream is under way. Returns the results and the model whose engine got it."""
    n = len(MODELS) * STREAMS_PER_MODEL
    started = [0] * n
    tasks = [asyncio.create_task(stream(oa, MODELS[i % len(MODELS)], started, i)) for i in range(n)]
    victim = None
    if kill is not None:
        await poll(lambda: min(started) >= 2 or any(t.done() for t in tasks), 60, "every stream under way")
        assert not any(t.done() for t in tasks), "streams ended before the kill: make them longer"

        async def running() -> str | None:
            return (await gpu0(http, url))["running"]

        victim = await poll(running, 10, "an engine of gpu0 running")
        proc = kill[victim]
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait(10)
    return list(await asyncio.gather(*tasks)), victim


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
async def test_the_running_engine_of_a_turns_host_dies_or_hangs(sim_fleet_process, gateway_process, make_client,
                                                                tmp_path, sig: int) -> None:
    """kill -9: the pause meets a closed port; SIGSTOP (a hung engine): the pause gets no answer within
    `pause_timeout_s` (2 s here), nor its /is_sleeping asked then within the health timeout (2 s), which the
    other models wait on top of twice their time. Either way the engine loses its turn and its streams resume on
    gpu1."""
    own = {m: sim_fleet_process(1, model=m, time_scale=TIME_SCALE, seed=i) for i, m in enumerate(MODELS)}
    fleet_file = tmp_path / "gpu1.yaml"
    fleet_file.write_text(json.dumps({"servers": [{"name": f"gpu1-{i}", "model": m} for i, m in enumerate(MODELS)]}))
    shared = sim_fleet_process(fleet_file=fleet_file, time_scale=TIME_SCALE, seed=9)
    urls = {"gpu0": {m: p.urls[0] for m, p in own.items()}, "gpu1": dict(zip(MODELS, shared.urls, strict=True))}
    gw = gateway_process(write_config(tmp_path, urls))
    url = gw.listening_url(timeout=120)
    oa = make_client(url, max_retries=0, timeout=120)
    async with httpx.AsyncClient(timeout=10) as http:
        base, _ = await run_load(oa, http, url)
        assert [r.error for r in base if r.error] == []
        t_kill = time.monotonic()
        try:
            after, victim = await run_load(oa, http, url, kill={m: p.proc for m, p in own.items()}, sig=sig)
            took = time.monotonic() - t_kill
            host = await gpu0(http, url)
        finally:
            for p in own.values():
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGCONT)
    assert victim is not None
    failed = [(r.model, r.error) for r in after if r.error]
    normal = {m: max(r.took_s for r in base if r.model == m) for m in MODELS}
    worst = {m: max(r.took_s for r in after if r.model == m) for m in MODELS}
    print(f"killed {victim}; normal {normal}; with the kill {worst}; run {took:.1f}s; gpu0 now {host['running']}, "
          f"{host['switches']} switches")
    assert failed == [], (failed, [line for line in gw.stderr + gw.stdout if 'stream broke' in line or 'engine' in line])
    # a hung engine is known only once its pause has gone unanswered for pause_timeout_s (its floor here) and
    # the /is_sleeping asked then for the health timeout (a live engine answering late is not taken for dead)
    grace = PAUSE_FLOOR_S + HEALTH_TIMEOUT_S if sig == signal.SIGSTOP else 0.0
    for m in MODELS:
        if m != victim:
            assert worst[m] <= 2 * normal[m] + grace, (m, worst[m], normal[m])
    assert host["running"] != victim
