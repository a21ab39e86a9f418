"""Clients that break the rules, with real processes: 10,000 fuzzed requests against a `fleetgate serve` gateway
(0 5xx, 0 hangs past the timeouts, RSS back within 10%), and one key driven at 3x its requests-per-minute
limit through two gateway replicas sharing Redis (overshoot <= 5%).

FLEETGATE_CHAOS_FUZZ_N sets the number of fuzzed requests (default 2,000 here; the report run uses 10,000);
FLEETGATE_CHAOS_RATE_S the length of the rate-limit drive (default 40 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import pytest

from bench.chaos_procs import RedisServer, proc_stats, record
from tests.helpers import MODEL, poll, require_command

pytestmark = pytest.mark.timeout(600)

FUZZ_N = int(os.environ.get("FLEETGATE_CHAOS_FUZZ_N", "2000"))
RATE_S = float(os.environ.get("FLEETGATE_CHAOS_RATE_S", "40"))
SERVER = {"header_timeout_s": 5.0, "body_timeout_s": 5.0, "keepalive_s": 5.0}
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files", "/v1/batches", "/admin/workers",
         "/metrics", "/v1/chat/completions/x", "/%00", "/v1/files/file-abc/content", "/v1/batches/batch_x/cancel"]
METHODS = ["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]


def junk(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**63), 10**30, 7])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e-300, 3.0])
    if kind == 4:
        return "".join(rng.choice("ab\u00e9\u4e2d\U0001f600 \\\"\n\t\x00") for _ in range(rng.randrange(30)))
    if kind == 5:
        return "x" * rng.choice([0, 1, 1000, 100_000])
    if kind == 6:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(["model", "messages", "prompt", "max_tokens", "stream", "role", "content", "n", "x"]):
            junk(rng, depth + 1) for _ in range(rng.randrange(5))}


def valid_chat(rng: random.Random) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "fuzz " * rng.randrange(1, 20)}],
            "max_tokens": rng.randrange(1, 8), "stream": rng.random() < 0.3}


def mutate(rng: random.Random, body: dict) -> dict:
    body = dict(body)
    key = rng.choice(["model", "messages", "max_tokens", "stream", "stream_options", "priority", "prompt",
                      "max_completion_tokens", "temperature", "n", "logprobs", "tools"])
    body[key] = junk(rng)
    return body


def fuzz_request(rng: random.Random) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers, body) of one fuzzed request."""
    headers = {"content-type": rng.choice(["application/json", "application/json", "text/plain", "", "multipart/"
                                           "form-data; boundary=x", "application/json; charset=utf-16"])}
    roll = rng.random()
    if roll < 0.15:
        body = valid_chat(rng)
        raw = json.dumps(body).encode()
    elif roll < 0.55:
        raw = json.dumps(mutate(rng, valid_chat(rng)), ensure_ascii=rng.random() < 0.5).encode()
    elif roll < 0.7:
        raw = json.dumps(junk(rng)).encode()
    elif roll < 0.8:
        raw = json.dumps(valid_chat(rng)).encode()
        raw = raw[:rng.randrange(len(raw))]  # truncated JSON
    elif roll < 0.88:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000)))
    elif roll < 0.92:
        raw = b"[" * 5000 + b"]" * 5000  # deep nesting
    else:
        raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "y" * rng.choice(
            [10_000, 1_000_000, 3_000_000])}], "max_tokens": 1}).encode()
    for _ in range(rng.randrange(4)):
        name = rng.choice(["x-request-id", "x-slo-ttft-ms", "x-slo-tpot-ms", "x-session-id", "x-request-class",
                           "authorization", "x-forwarded-for", "connection", "x-api-key", "accept",
                           "x-" + "h" * rng.randrange(1, 200)])
        headers[name] = rng.choice(["", "batch", "-1", "1e309", "nan", "abc", "Bearer", "close", "upgrade, x-a",
                                    "v" * rng.choice([1, 100, 8000]), "\u00e9".encode().decode("latin-1")])
    if rng.random() < 0.85:
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        method = "POST"
    else:
        path, method = rng.choice(PATHS), rng.choice(METHODS)
    return method, path, headers, raw


@pytest.fixture
def fleet(sim_fleet_process) -> list[str]:  # noqa: ANN001
    return [sim_fleet_process(1, time_scale=50).urls[0] for _ in range(2)]


async def test_fuzzed_requests_get_no_5xx_and_no_hangs(fleet, gateway_process, tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    # Giant prompts keep the simulated workers busy tokenizing: a slower health check is not what this tests.
    # refit_interval_s 1: the learner's first fit (it imports scipy.optimize, ~40 MB once) falls in the warm-up.
    cfg.write_text(json.dumps({"workers": [{"id": f"w{i}", "url": u} for i, u in enumerate(fleet)],
                               "server": SERVER, "health": {"timeout_s": 5.0, "failures_to_eject": 5},
                               "learning": {"refit_interval_s": 1.0}}))
    gw = gateway_process(cfg)
    url = gw.listening_url(timeout=120)
    pid = gw.proc.pid
    rng = random.Random(18)
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    rss_fresh, _ = proc_stats(pid)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0, pool=None), limits=limits) as http:
        async def send(batch: list[tuple[str, str, dict[str, str], bytes]], on_answer=None) -> None:  # noqa: ANN001
            async def worker() -> None:
                while batch:
                    method, path, headers, raw = batch.pop()
                    t0 = time.monotonic()
                    try:
                        raw_headers = [(k.encode(), v.encode("latin-1", "replace")) for k, v in headers.items()]
                        r = await http.request(method, path, headers=raw_headers, content=raw)
                        if on_answer is not None:
                            on_answer(method, path, r, time.monotonic() - t0)
                    except httpx.HTTPError as e:
                        if on_answer is not None:
                            on_answer(method, path, e, time.monotonic() - t0)
            await asyncio.gather(*(worker() for _ in range(16)))

        # Warm-up with the same mix: the baseline is a gateway that has seen this traffic (and fitted its
        # performance models once), not a fresh one.
        warm_rng, rss0 = random.Random(1), 0.0
        for _ in range(8):  # until RSS holds still (within 1%) from one round to the next
            streams = [("POST", "/v1/chat/completions", {"content-type": "application/json"},
                        json.dumps({**valid_chat(warm_rng), "stream": True, "max_tokens": 8}).encode())
                       for _ in range(50)]
            await send([fuzz_request(warm_rng) for _ in range(300)] + streams)
            await asyncio.sleep(1.5)
            rss, _ = proc_stats(pid)
            if rss0 and abs(rss - rss0) <= 0.01 * rss0:
                break
            rss0 = rss
        rss0, cpu0 = proc_stats(pid)
        statuses: dict[int, int] = {}
        hangs, server_errors, transport = 0, [], 0
        slowest = 0.0

        def answer(method: str, path: str, r: httpx.Response | Exception, took: float) -> None:
            nonlocal hangs, transport, slowest
            slowest = max(slowest, took)
            if isinstance(r, httpx.TimeoutException):
                hangs += 1
            elif isinstance(r, Exception):
                transport += 1  # a connection the gateway closed (a request refused at the parser)
            else:
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code >= 500:
                    server_errors.append((r.status_code, method, path, r.text[:200]))
        t_start = time.monotonic()
        await send([fuzz_request(rng) for _ in range(FUZZ_N)], answer)
        took = time.monotonic() - t_start
        await asyncio.sleep(5)  # settle: keep-alive connections close, buffers go
        rss1, cpu1 = proc_stats(pid)
        assert (await http.post("/v1/chat/completions", json={**valid_chat(rng), "stream": False})).status_code == 200
    record("fuzz", requests=FUZZ_N, seconds=round(took, 1), statuses={str(k): v for k, v in sorted(statuses.items())},
           server_errors=len(server_errors), hangs=hangs, closed_by_gateway=transport,
           slowest_s=round(slowest, 2), rss_fresh_mb=round(rss_fresh, 1), rss_before_mb=round(rss0, 1),
           rss_after_mb=round(rss1, 1),
           rss_change_pct=round(100 * (rss1 - rss0) / rss0, 1), cpu_s=round(cpu1 - cpu0, 1))
    assert server_errors == [], server_errors[:5]
    assert hangs == 0
    assert rss1 <= rss0 * 1.10, (rss0, rss1)


async def test_one_key_at_3x_its_limit_through_two_replicas(fleet, gateway_process, tmp_path: Path) -> None:
    rpm, drive_rps = 120, 6.0  # 2 requests/s allowed, 6/s sent: 3x
    require_command("redis-server")
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    try:
        shared = await _drive(fleet, gateway_process, tmp_path, rpm, drive_rps, redis_server.url)
        alone = await _drive(fleet, gateway_process, tmp_path, rpm, drive_rps, None) \
            if os.environ.get("FLEETGATE_CHAOS_RESULTS") else None
    finally:
        redis_server.stop()
    allowed = rpm + rpm / 60 * RATE_S  # a full bucket, then the refill
    overshoot = shared["admitted"] / allowed - 1
    fig = {"rpm": rpm, "drive_rps": drive_rps, "seconds": RATE_S, "allowed": allowed, **shared,
           "overshoot_pct": round(100 * overshoot, 2)}
    if alone is not None:
        fig |= {"alone_admitted": alone["admitted"], "alone_overshoot_pct": round(100 * (alone["admitted"] / allowed - 1), 1)}
    record("rate_limit_two_replicas", **fig)
    assert shared["other"] == 0, shared
    assert overshoot <= 0.05, fig
    assert shared["admitted"] >= allowed * 0.9  # and the limit is given, not starved
    assert abs(shared["steady_rps"] - rpm / 60) <= 0.25 * rpm / 60, fig


async def _drive(fleet: list[str], gateway_process, tmp_path: Path, rpm: int, rps: float,  # noqa: ANN001
                 redis_url: str | None) -> dict:
    cfg = tmp_path / f"gw-{'redis' if redis_url else 'alone'}.yaml"
    cfg.write_text(json.dumps({"workers": [{"id": f"w{i}", "url": u} for i, u in enumerate(fleet)],
                               "auth": {"keys": [{"key": "sk-chaos-limited", "rpm": rpm}]}}))
    extra = ("--redis-url", redis_url) if redis_url else ()
    gws = [gateway_process(cfg, *extra), gateway_process(cfg, *extra)]
    urls = [g.listening_url(timeout=120) for g in gws]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    results: list[tuple[float, int]] = []
    async with httpx.AsyncClient(timeout=30, headers={"authorization": "Bearer sk-chaos-limited"}) as http:
        async def one(i: int) -> None:
            t = time.monotonic()
            r = await http.post(urls[i % 2] + "/v1/chat/completions", json=body)
            results.append((t, r.status_code))
        t0 = time.monotonic()
        tasks, i = [], 0
        while (now := time.monotonic()) - t0 < RATE_S:
            due = t0 + i / rps
            if now < due:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(one(i)))
            i += 1
        await asyncio.gather(*tasks)
    for g in gws:
        g.stop()
    await poll(lambda: all(g.proc.poll() is not None for g in gws), 15, "the replicas to stop")
    admitted = sum(1 for _, s in results if s == 200)
    tail = [(t, s) for t, s in results if t - t0 >= RATE_S - 10]
    return {"sent": len(results), "admitted": admitted, "refused": sum(1 for _, s in results if s == 429),
            "other": sum(1 for _, s in results if s not in (200, 429)),
            "steady_rps": round(sum(1 for _, s in tail if s == 200) / 10, 2)}
