"""SIGTERM drains the gateway (gateway/pipeline/drain.py), with real processes: `fleetgate serve` gateways in front of
`fleetgate sim --workers 1` workers.

- SIGTERM with 20 streams of 10-20 s in flight: every stream completes with `[DONE]`, its text continuous and
  complete; meanwhile `/ready` answers 503, `/health` 200, and a new request a 503 with `Retry-After`; the
  process exits 0 once the streams are done.
- A stream still running when `server.drain_timeout_s` is up ends with an error event and `[DONE]`, and has its
  access-log line; the process exits 0.
- A rolling restart of two replicas sharing Redis behind a client that retries on connection refused and 503:
  0 failed of N.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from bench.chaos_procs import RedisServer, free_port, record
from tests.helpers import MODEL, poll
from tests_chaos.test_workers import stream_chat, write_config

pytestmark = pytest.mark.timeout(300)

LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=64)


async def status_of(http: httpx.AsyncClient, url: str) -> int:
    return (await http.get(url)).status_code


async def ready_is(http: httpx.AsyncClient, url: str, want: int) -> bool:
    return await status_of(http, url + "/ready") == want


def exit_code(gw, timeout: float) -> int:  # noqa: ANN001 - GatewayProcess
    deadline = time.monotonic() + timeout
    while gw.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.proc.poll() is not None, f"still running {timeout:g} s after SIGTERM: {gw.describe()}"
    return gw.proc.returncode


async def test_sigterm_lets_20_streams_in_flight_finish(sim_fleet_process, gateway_process, tmp_path) -> None:
    fleet = [sim_fleet_process(1, time_scale=0.25, seed=i) for i in range(2)]
    # generous drain time: 10-20 s streams take longer on a loaded 2-core machine; the default is 30 s
    gw = gateway_process(write_config(tmp_path, [f.urls[0] for f in fleet], server={"drain_timeout_s": 120}))
    url = gw.listening_url(timeout=120)
    progress = [0] * 20
    lengths = [200 + 10 * i for i in range(20)]  # ~10-20 s each at time_scale 0.25
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0, connect=10.0), limits=LIMITS) as http:
        tasks = [asyncio.create_task(stream_chat(http, url, n, progress, i)) for i, n in enumerate(lengths)]
        await poll(lambda: min(progress) >= 3 or any(t.done() for t in tasks), 60, "every stream under way")
        assert not any(t.done() for t in tasks), "streams ended before SIGTERM: make them longer"
        t_term = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        await poll(lambda: ready_is(http, url, 503), 10, "/ready failing once SIGTERM came")
        health = await status_of(http, url + "/health")
        late = await http.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "late"}], "max_tokens": 4})
        in_flight_at_refusal = sum(not t.done() for t in tasks)
        streams = await asyncio.gather(*tasks)
    code = await asyncio.to_thread(exit_code, gw, 60)
    t_exit = time.monotonic() - t_term
    failed = [s.error for s in streams if s.error is not None]
    record("sigterm_drain", streams=20, failed=len(failed), ready_while_draining=503, health_while_draining=health,
           late_request=late.status_code, retry_after=late.headers.get("retry-after"), exit_code=code,
           last_done_after_sigterm_s=round(max(s.done_at for s in streams) - t_term, 2),
           exit_after_sigterm_s=round(t_exit, 2))
    assert failed == [], failed[:5]
    assert health == 200  # the liveness probe does not kill the drain
    assert in_flight_at_refusal > 0 and late.status_code == 503, late.text
    assert late.headers.get("retry-after") and late.json()["error"]["code"] == "shutting_down"
    assert code == 0


async def test_stream_still_running_at_drain_timeout_ends_with_an_error_event(sim_fleet_process, gateway_process,
                                                                              tmp_path) -> None:
    fleet = sim_fleet_process(1, time_scale=1.0)
    gw = gateway_process(write_config(tmp_path, [fleet.urls[0]], server={"drain_timeout_s": 2}),
                         "--log-format", "json")
    url = gw.listening_url(timeout=120)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long one"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    chunks: list[bytes] = []
    t_term = None
    async with (httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as http,
                http.stream("POST", url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": "drain-cut-1"}) as r):
        assert r.status_code == 200
        async for chunk in r.aiter_raw():
            chunks.append(chunk)
            if t_term is None and len(chunks) >= 3:
                gw.proc.send_signal(signal.SIGTERM)
                t_term = time.monotonic()
        ended_after = time.monotonic() - t_term
    code = await asyncio.to_thread(exit_code, gw, 30)
    events = [e for e in b"".join(chunks).split(b"\n\n") if e]
    errors = [json.loads(e[6:])["error"] for e in events[:-1] if b'"error"' in e]
    access = [json.loads(line) for line in gw.stderr if '"fleetgate.access"' in line]
    mine = [a for a in access if a.get("request_id") == "drain-cut-1"]
    record("drain_timeout_cut", drain_timeout_s=2, ended_after_sigterm_s=round(ended_after, 2),
           error_code=errors[0].get("code") if errors else None, access_log_lines=len(mine), exit_code=code)
    assert events[-1] == b"data: [DONE]"
    assert errors and errors[-1]["code"] == "shutting_down", events[-3:]
    assert 1.5 < ended_after < 20
    assert len(mine) == 1 and mine[0]["status"] == 503, access[-3:]
    assert code == 0


async def retrying_stream(http: httpx.AsyncClient, urls: list[str], i: int, tries: int = 40) -> str | None:
    """One short stream through whichever replica answers: a refused connection or a 503 moves the client to the
    other replica (what a load balancer or a retrying client does); None when it completed with [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"rolling {i}"}], "max_tokens": 24,
            "ignore_eos": True, "stream": True}
    last = "no try"
    for attempt in range(tries):
        url = urls[(i + attempt) % len(urls)]
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code == 503:
                    last = "503"
                    await asyncio.sleep(0.05 * random.random())
                    continue
                if r.status_code != 200:
                    return f"status {r.status_code}"
                data = b"".join([c async for c in r.aiter_raw()])
        except httpx.ConnectError:
            last = "connection refused"
            await asyncio.sleep(0.1)
            continue
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        if not data.rstrip().endswith(b"data: [DONE]") or b'"error"' in data:
            return f"broken stream: {data[-200:]!r}"
        return None
    return f"gave up after {tries} tries ({last})"


async def test_rolling_restart_of_two_replicas_loses_nothing(sim_fleet_process, gateway_process,
                                                             tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        fleet = [sim_fleet_process(1, time_scale=0.5, seed=i) for i in range(2)]
        cfg = write_config(tmp_path, [f.urls[0] for f in fleet], redis_url=redis.url)
        ports = [free_port(), free_port()]
        replicas = [gateway_process(cfg, "--port", str(p)) for p in ports]
        urls = [r.listening_url(timeout=120) for r in replicas]
        results: list[str | None] = []
        stop = asyncio.Event()

        async def client(c: int) -> None:
            n = 0
            while not stop.is_set():
                results.append(await retrying_stream(http, urls, c * 1000 + n))
                n += 1

        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=LIMITS) as http:
            clients = [asyncio.create_task(client(c)) for c in range(8)]
            await poll(lambda: len(results) >= 16, 60, "traffic through both replicas")
            for k in range(2):  # one replica after the other, as a rolling update does
                code = await asyncio.to_thread(_term, replicas[k])
                assert code == 0, replicas[k].describe()
                replicas[k] = gateway_process(cfg, "--port", str(ports[k]))
                await asyncio.to_thread(replicas[k].listening_url, 120)
                before = len(results)
                await poll(lambda b=before: len(results) >= b + 16, 60, "traffic after the restart")
            stop.set()
            await asyncio.gather(*clients)
    finally:
        redis.kill()
    failed = [r for r in results if r is not None]
    record("rolling_restart", replicas=2, requests=len(results), failed=len(failed))
    assert failed == [], failed[:5]
    assert len(results) >= 48


def _term(gw) -> int:  # noqa: ANN001 - GatewayProcess
    gw.proc.send_signal(signal.SIGTERM)
    return exit_code(gw, 60)
