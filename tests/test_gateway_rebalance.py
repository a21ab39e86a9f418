"""Rebalancing live (gateway/pipeline/rebalancer.py): a stream still queued on a worker that a fault slowed down moves to
another worker and meets its TTFT target, where without rebalancing (same setup) it misses; the streams already
running there stay; the move is counted.

Two simulated workers that run two requests at a time; aladdin packs (fit: best), so two long streams and then
a short one all go to w0, and the short one waits in w0's engine queue. Then w0 is slowed 5x (POST /sim/faults).
Hung-worker detection is off in both arms, so the stall rule does not rescue the waiting request instead.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import orjson

from tests.helpers import MODEL, metric, poll, running_gateway

TIME_SCALE = 4.0
TTFT_TARGET_S = 2.5
LONG, SHORT = 800, 20
PROFILE = "llama3-8b-h100"


@dataclass
class Outcome:
    ttft_s: float          # the short request's time to first token, seen by the client
    text: str              # its answer's content
    metrics: str
    finished: list[dict]   # per worker: /sim/state finished counts
    prompt_tokens: list[int]   # per worker: prompt tokens its engine computed
    long_ok: bool


def _config(urls: list[str], rebalance: bool) -> dict:
    workers = [{"id": f"w{i}", "url": u, "profile": PROFILE} for i, u in enumerate(urls)]
    return {"workers": workers, "scrape_interval_s": 0.1,
            "learning": {"time_scale": TIME_SCALE},
            "resume": {"hung_detection": False},
            "models": {MODEL: {"policy": "aladdin", "params": {"fit": "best"},
                               "slo": {"ttft_ms": TTFT_TARGET_S * 1000, "tpot_ms": 60000}}},
            "rebalance": {"enabled": rebalance, "interval_s": 0.1, "max_moves_per_s": 10, "slow_ratio": 2.0}}


def _body(tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}


async def _stream(http: httpx.AsyncClient, url: str, tokens: int, started: asyncio.Event | None = None
                  ) -> tuple[float, str, int]:
    """(time to first content token, content, completion tokens) of one streamed chat request."""
    t0 = time.perf_counter()
    first: float | None = None
    text, usage = [], 0
    async with http.stream("POST", url + "/v1/chat/completions", json=_body(tokens),
                           headers={"x-sim-output-tokens": str(tokens)}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = orjson.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]["completion_tokens"]
            for c in ev.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter() - t0
                        if started is not None:
                            started.set()
                    text.append(piece)
    assert first is not None
    return first, "".join(text), usage


async def _waiting(http: httpx.AsyncClient, url: str) -> int:
    return int((await http.get(url + "/sim/state")).json()["waiting"])


async def _run(sim_fleet, rebalance: bool) -> Outcome:  # noqa: ANN001
    fleet = sim_fleet(2, time_scale=TIME_SCALE, profile=PROFILE, profile_overrides={"max_num_seqs": 2})
    async with running_gateway(**_config(fleet.urls, rebalance)) as gw, httpx.AsyncClient(timeout=120) as http:
        s1, s2 = asyncio.Event(), asyncio.Event()
        longs = [asyncio.create_task(_stream(http, gw.url, LONG, s)) for s in (s1, s2)]
        await asyncio.wait_for(asyncio.gather(s1.wait(), s2.wait()), 30)
        short = asyncio.create_task(_stream(http, gw.url, SHORT))
        w0 = fleet.urls[0]
        await poll(lambda: _waiting(http, w0), timeout=20, what="the short request queued on w0")
        r = await http.post(w0 + "/sim/faults", json={"slowdown": 5})
        assert r.status_code == 200, r.text
        ttft, text, n = await short
        done = await asyncio.gather(*longs)
        metrics = (await gw_metrics(http, gw.url))
        stats = [(await http.get(u + "/sim/state")).json()["stats"] for u in fleet.urls]
        return Outcome(ttft, text, metrics, [s["finished"] for s in stats], [s["prompt_tokens"] for s in stats],
                       all(d[2] == LONG for d in done) and n == SHORT)


async def gw_metrics(http: httpx.AsyncClient, url: str) -> str:
    return (await http.get(url + "/metrics")).text


async def test_a_stream_queued_on_a_slowed_worker_moves_and_meets_its_slo(sim_fleet) -> None:  # noqa: ANN001
    off = await _run(sim_fleet, rebalance=False)
    on = await _run(sim_fleet, rebalance=True)
    # Without rebalancing the short request waits for a slowed long one to end; with it, it runs on w1.
    assert off.ttft_s > TTFT_TARGET_S, off
    assert on.ttft_s < TTFT_TARGET_S, on
    assert on.ttft_s < off.ttft_s / 2, (on.ttft_s, off.ttft_s)
    assert on.long_ok and off.long_ok
    assert metric(on.metrics, "fleetgate_rebalance_moves_total", {"model": MODEL}) == 1
    assert metric(on.metrics, "fleetgate_rebalance_moves_met_slo_total", {"model": MODEL}) == 1
    assert metric(off.metrics, "fleetgate_rebalance_moves_total", {"model": MODEL}) is None
    # The started (long) streams stayed on w0 and completed there; the queued one was aborted there (its
    # connection closed) and completed on w1, its answer whole (SHORT tokens, checked in _run).
    assert on.finished[0] == {"stop": 0, "length": 2, "abort": 1}, on.finished
    assert on.finished[1] == {"stop": 0, "length": 1, "abort": 0}, on.finished
    assert off.finished[0] == {"stop": 0, "length": 3, "abort": 0}, off.finished
    assert on.text and off.text   # (the simulated workers word their answers differently)
    # It moved before w0 computed any of its prompt: no prefill wasted there.
    assert on.prompt_tokens[0] * 3 == off.prompt_tokens[0] * 2, (on.prompt_tokens, off.prompt_tokens)
    print(f"short request TTFT: {on.ttft_s:.2f} s moved, {off.ttft_s:.2f} s not moved; prompt tokens computed "
          f"{on.prompt_tokens} moved, {off.prompt_tokens} not moved")


async def test_a_move_before_the_response_started_places_the_request_again(sim_fleet) -> None:  # noqa: ANN001
    """The worker has not even sent the response headers (it hangs): the moved request is placed again, not
    continued, and the client gets one ordinary stream from the other worker (it once got a 500 here)."""
    fleet = sim_fleet(2, time_scale=20, profile=PROFILE)
    hung, ok = fleet.urls
    cfg = _config(fleet.urls, True)
    cfg["models"][MODEL] = {"policy": "round_robin"}
    cfg["rebalance"]["interval_s"] = 3600   # the loop stays out of it: the test makes the move itself
    async with running_gateway(**cfg) as gw, httpx.AsyncClient(timeout=60) as http:
        assert (await http.post(hung + "/sim/faults", json={"hang": True})).status_code == 200
        reb = gw.gateway.rebalancer
        req = asyncio.create_task(_stream(http, gw.url, SHORT))

        async def waiting_on_w0() -> object:
            legs = list(reb.legs.get(MODEL, {}).values())
            return legs[0] if legs and legs[0].worker == "w0" else None

        leg = await poll(waiting_on_w0, timeout=20, what="the request's leg on the hung worker")
        assert not leg.ctx.state.started
        leg.move_to = "w1"
        assert leg.task.cancel()
        _, text, n = await asyncio.wait_for(req, 30)
        assert n == SHORT and text
        state = (await http.get(ok + "/sim/state")).json()["stats"]["finished"]
        assert sum(state.values()) == 1, state


async def _complete(http: httpx.AsyncClient, url: str, tokens: int) -> tuple[float, str, int]:
    """(seconds to the whole answer, content, completion tokens) of one non-streaming chat request."""
    t0 = time.perf_counter()
    r = await http.post(url + "/v1/chat/completions", json={**_body(tokens), "stream": False, "stream_options": None},
                        headers={"x-sim-output-tokens": str(tokens)})
    assert r.status_code == 200, r.text
    body = r.json()
    return time.perf_counter() - t0, body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


async def _state(http: httpx.AsyncClient, url: str) -> dict:
    return (await http.get(url + "/sim/state")).json()


async def _run_unary(sim_fleet, rebalance: bool) -> Outcome:  # noqa: ANN001
    """`_run` with no stream at all: the two long requests and the short one all non-streaming, so neither the
    short request's first token nor any stream's pace is visible to the gateway."""
    fleet = sim_fleet(3, time_scale=TIME_SCALE, profile=PROFILE, profile_overrides={"max_num_seqs": 2})
    cfg = _config(fleet.urls, rebalance)
    async with running_gateway(**cfg) as gw, httpx.AsyncClient(timeout=120) as http:
        w0 = fleet.urls[0]
        longs = [asyncio.create_task(_complete(http, gw.url, LONG)) for _ in range(2)]
        await poll(lambda: _running_on(http, w0, 2), timeout=30, what="both long requests running on w0")
        short = asyncio.create_task(_complete(http, gw.url, SHORT))
        await poll(lambda: _waiting(http, w0), timeout=20, what="the short request queued on w0")
        r = await http.post(w0 + "/sim/faults", json={"slowdown": 5})
        assert r.status_code == 200, r.text
        latency, text, n = await short
        done = await asyncio.gather(*longs)
        metrics = await gw_metrics(http, gw.url)
        stats = [(await _state(http, u))["stats"] for u in fleet.urls]
        return Outcome(latency, text, metrics, [s["finished"] for s in stats], [s["prompt_tokens"] for s in stats],
                       all(d[2] == LONG for d in done) and n == SHORT)


async def _running_on(http: httpx.AsyncClient, url: str, n: int) -> bool:
    return int((await _state(http, url))["running"]) == n


async def test_a_non_streaming_request_queued_on_a_slowed_worker_moves_too(sim_fleet) -> None:  # noqa: ANN001
    """A non-streaming request is as invisible to its client before its answer as a stream
    before its first token, so it moves like one; with no stream on the worker, the slowdown is seen in the
    engine's scraped counters. (It never moved before: 0 moves, the answer after the slowed long ones.)"""
    off = await _run_unary(sim_fleet, rebalance=False)
    on = await _run_unary(sim_fleet, rebalance=True)
    assert on.long_ok and off.long_ok
    # at least one move (on a loaded machine the short request may be moved once more, within the move budget, from
    # a worker whose scraped steps looked slow too); what moved is pinned down by the engines' counts below
    assert metric(on.metrics, "fleetgate_rebalance_moves_total", {"model": MODEL}) >= 1, on.finished
    assert on.ttft_s < off.ttft_s / 2, (on.ttft_s, off.ttft_s)
    # the long ones stayed and completed on w0; the short one was aborted there and completed elsewhere, whole
    assert on.finished[0] == {"stop": 0, "length": 2, "abort": 1}, on.finished
    assert sum(f["length"] for f in on.finished[1:]) == 1, on.finished
    assert off.finished[0] == {"stop": 0, "length": 3, "abort": 0}, off.finished
    print(f"short non-streaming request: answered in {on.ttft_s:.2f} s moved, {off.ttft_s:.2f} s not moved")


def test_a_model_may_override_the_top_level_rebalance() -> None:
    from gateway.config import load_config
    from gateway.pipeline.rebalancer import Rebalancer

    cfg = load_config(None, models={MODEL: {"rebalance": {"enabled": True, "slow_ratio": 4}}, "other": {}})
    assert cfg.rebalance_for(MODEL).enabled and cfg.rebalance_for(MODEL).slow_ratio == 4
    assert not cfg.rebalance_for("other").enabled and not cfg.rebalance.enabled
    assert Rebalancer.wanted(cfg) and not Rebalancer.wanted(load_config(None))
