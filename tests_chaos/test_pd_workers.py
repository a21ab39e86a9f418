"""P/D legs that survive their workers, and a zombie worker, with real processes: each worker a `fleetgate sim`
process of its own (roles kv_producer / kv_consumer), the gateway `fleetgate serve`.

- P/D, 2 prefill + 2 decode workers, streams arriving over a few seconds: `kill -9` or `SIGSTOP` of a decode
  worker mid-stream, or of a prefill worker while prompts are being prefilled. 0 client-visible failures: every
  stream ends with `[DONE]`, its text continuous and complete, its usage exact; the decode worker's streams are
  resumed on the other decode worker; nothing waits out a fixed 60 s timeout (the slowest stream bounds it).
- A zombie worker (`hang`: takes generation requests, never answers, /health 200) among 3: 0 failed streams, each
  well within its time; the zombie stays out of rotation while it hangs though its /health answers, and returns
  once a probe generation succeeds.

Separate processes cannot pass KV (the simulator reaches producers in its own process only), so the decode legs
prefill locally after the prefill leg; the legs and their failures are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable
from pathlib import Path

import httpx
import pytest
import yaml

from bench.chaos_procs import record
from simulator.tokenizer import synthetic_text
from tests.helpers import poll
from tests_chaos.test_workers import Stream, gateway_metric, gw_healthy, stream_chat

pytestmark = pytest.mark.timeout(240)


def long_stream(http: httpx.AsyncClient, url: str, max_tokens: int, i: int, progress: list[int]) -> Awaitable[Stream]:
    """One streamed chat with a ~1,000-token prompt (so the P/D profile disaggregates it)."""
    return stream_chat(http, url, max_tokens, progress, i, synthetic_text(1000, f"pd-chaos-{i}"))


def role_fleet(tmp_path: Path, role: str, i: int) -> Path:
    path = tmp_path / f"{role}-{i}.yaml"
    path.write_text(yaml.safe_dump({"servers": [{"name": f"{role}-{i}", "role": role}]}))
    return path


def gateway_config(tmp_path: Path, workers: list[dict], **extra: object) -> Path:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({"workers": workers, "health": {"interval_s": 0.5, "timeout_s": 0.5}, **extra}))
    return cfg


@pytest.mark.parametrize("victim, sig", [("d0", signal.SIGKILL), ("d0", signal.SIGSTOP),
                                         ("p0", signal.SIGKILL), ("p0", signal.SIGSTOP)],
                         ids=["decode-kill-9", "decode-sigstop", "prefill-kill-9", "prefill-sigstop"])
async def test_pd_worker_killed_or_frozen(sim_fleet_process, gateway_process, tmp_path, victim: str,
                                          sig: signal.Signals) -> None:
    procs, workers = {}, []
    for role, name in (("kv_producer", "p0"), ("kv_producer", "p1"), ("kv_consumer", "d0"), ("kv_consumer", "d1")):
        fp = sim_fleet_process(fleet_file=role_fleet(tmp_path, role, len(procs)), seed=len(procs))
        procs[name] = fp
        workers.append({"id": name, "url": fp.urls[0], "profile": "llama3-8b-h100",
                        "role": "prefill" if name[0] == "p" else "decode"})
    gw = gateway_process(gateway_config(tmp_path, workers))
    url = gw.listening_url(timeout=120)
    await poll(lambda: all(gw_healthy(url, w["id"]) for w in workers), 30, "all four workers in rotation")
    n, max_tokens = 48, 300
    progress = [0] * n
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    proc = procs[victim].proc
    stopped = False
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0), limits=limits) as http:
            tasks = []
            for i in range(n):  # arrivals over ~5 s: prompts are being prefilled when the victim goes
                tasks.append(asyncio.create_task(long_stream(http, url, max_tokens, i, progress)))
                await asyncio.sleep(0.1)
                if i == n // 2:
                    if victim[0] == "d":  # mid-stream on the decode worker
                        await poll(lambda: sum(p >= 3 for p in progress) >= 8, 30, "streams under way")
                    proc.send_signal(sig)
                    stopped = sig == signal.SIGSTOP
                    t_fault = time.monotonic()
            streams = await asyncio.gather(*tasks)
    finally:
        if stopped:
            proc.send_signal(signal.SIGCONT)
    failed = [s.error for s in streams if s.error is not None]
    resumed = await gateway_metric(url, "fleetgate_stream_breaks_total", outcome="resumed")
    broken = await gateway_metric(url, "fleetgate_requests_total", status="502")
    prefill_retries = await gateway_metric(url, "fleetgate_pd_decisions_total", decision="prefill_retry")
    slowest = max(s.done_at - s.sent_at for s in streams)
    record(f"pd_{victim[0]}_{sig.name.lower()}", streams=n, failed=len(failed), resumed=int(resumed),
           prefill_retries=int(prefill_retries),
           slowest_stream_s=round(slowest, 2), last_done_after_fault_s=round(max(s.done_at for s in streams)
                                                                           - t_fault, 2))
    assert failed == [], failed[:10]
    assert broken == 0
    assert slowest < 40.0  # no leg waited out a fixed 60 s timeout
    if victim[0] == "d":
        assert resumed >= 1  # the decode worker's streams went on elsewhere
    else:
        assert prefill_retries >= 1  # prefill legs on the victim were placed again


async def test_zombie_worker_is_ejected_until_it_generates(sim_fleet_process, gateway_process, tmp_path) -> None:
    fleet = sim_fleet_process(3, seed=7)
    workers = [{"id": f"w{i}", "url": u, "profile": "llama3-8b-h100"} for i, u in enumerate(fleet.urls)]
    gw = gateway_process(gateway_config(tmp_path, workers, resume={"ejection_base_s": 5.0, "probe_timeout_s": 2.0},
                                        default_policy="round_robin"))
    url = gw.listening_url(timeout=120)
    await poll(lambda: all(gw_healthy(url, w["id"]) for w in workers), 30, "all three workers in rotation")
    zombie = fleet.urls[1]
    async with httpx.AsyncClient(timeout=httpx.Timeout(90.0, connect=10.0)) as http:
        (await http.post(zombie + "/sim/faults", json={"hang": True})).raise_for_status()
        n, max_tokens = 24, 100
        progress = [0] * n
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(long_stream(http, url, max_tokens, i, progress)))
            await asyncio.sleep(0.25)
        streams = await asyncio.gather(*tasks)
        assert (await http.get(zombie + "/health")).status_code == 200  # a zombie: its /health answers
        out_while_hanging = not gw_healthy(url, "w1")
        await asyncio.sleep(6.0)  # past its first ejection time: the probe generation hangs too
        still_out = not gw_healthy(url, "w1")
        (await http.delete(zombie + "/sim/faults")).raise_for_status()
        t0 = time.monotonic()
        await poll(lambda: gw_healthy(url, "w1"), 40, "the zombie back in rotation once it generates")
        back_after = time.monotonic() - t0
    failed = [s.error for s in streams if s.error is not None]
    slowest = max(s.done_at - s.sent_at for s in streams)
    record("zombie_worker", streams=n, failed=len(failed), slowest_stream_s=round(slowest, 2),
           back_after_fault_cleared_s=round(back_after, 2))
    assert failed == [], failed[:10]
    assert slowest < 20.0  # a stream on the zombie was retried after its stall limit, not after 60 s
    assert out_while_hanging and still_out
