"""`aladdin` and `hetero` selected per model in the config, working live through the gateway.

aladdin packs requests onto one worker while their SLOs allow, makes a request that fits nowhere wait in
the admission queue (429 + Retry-After when the queue is full or its TTFT budget ran out) and exports the
shortfall; hetero sends more requests to the stronger of two simulated profiles.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx

from gateway.server import GatewayServer
from tests.helpers import MODEL, metric, poll, running_gateway

STRONG, WEAK = "llama3-8b-h100", "llama2-13b-a100"
GENEROUS_SLO = {"ttft_ms": 60000, "tpot_ms": 60000}


def gateway(urls: list[str], policy: str, profiles: list[str] | None = None, params: dict | None = None,
            **cfg: Any) -> AbstractAsyncContextManager[GatewayServer]:
    profiles = profiles or [STRONG] * len(urls)
    workers = [{"id": f"w{i}", "url": u, "profile": p} for i, (u, p) in enumerate(zip(urls, profiles, strict=True))]
    return running_gateway(workers=workers, scrape_interval_s=0.1,
                           models={MODEL: {"policy": policy, "slo": GENEROUS_SLO, "params": params or {}}}, **cfg)


async def served(http: httpx.AsyncClient, urls: list[str]) -> list[int]:
    states = await asyncio.gather(*(http.get(u + "/sim/state") for u in urls))
    return [sum(s.json()["stats"]["finished"].values()) for s in states]


def chat(tokens: int, text: str = "hello") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream(http: httpx.AsyncClient, url: str, tokens: int, headers: dict | None = None) -> httpx.Response:
    """One streamed chat request read to the end; the response (its body consumed)."""
    h = {"x-sim-output-tokens": str(tokens), **(headers or {})}
    async with http.stream("POST", url + "/v1/chat/completions", json=chat(tokens), headers=h) as r:
        await r.aread()
    return r


async def test_aladdin_packs_one_worker_while_slos_allow(sim_fleet) -> None:
    """Algorithm 1 as printed (fit: best); the default (fit: worst) spreads, see the next test."""
    fleet = sim_fleet(3, time_scale=20)
    async with gateway(fleet.urls, "aladdin", params={"fit": "best"}) as gw, httpx.AsyncClient(timeout=30) as http:
        before = await served(http, fleet.urls)
        rs = await asyncio.gather(*(stream(http, gw.url, 40) for _ in range(6)))  # concurrent
        rs += [await stream(http, gw.url, 20) for _ in range(6)]                # one at a time
        assert all(r.status_code == 200 for r in rs)
        counts = [a - b for a, b in zip(await served(http, fleet.urls), before, strict=True)]
        assert sorted(counts) == [0, 0, 12], counts  # best fit: the fullest worker that still fits
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_slo_requests_total", {"model": MODEL, "result": "met"}) == 12
        shortfall = await poll(lambda: _has_metric(http, gw.url, "fleetgate_placement_shortfall_workers",
                                                   {"model": MODEL}))
        assert shortfall == [0.0]  # exported by the learning loop's next tick


async def test_aladdin_by_default_spreads_over_the_workers_that_fit(sim_fleet) -> None:
    """The default packing rule (fit: worst, chosen by the placement study's protocol): the feasible worker with
    the most headroom, so concurrent requests land on every worker."""
    fleet = sim_fleet(3, time_scale=20)
    async with gateway(fleet.urls, "aladdin") as gw, httpx.AsyncClient(timeout=30) as http:
        before = await served(http, fleet.urls)
        rs = await asyncio.gather(*(stream(http, gw.url, 40) for _ in range(6)))
        assert all(r.status_code == 200 for r in rs)
        counts = [a - b for a, b in zip(await served(http, fleet.urls), before, strict=True)]
        assert sorted(counts) == [2, 2, 2], counts


async def test_aladdin_queues_on_no_fit_then_429_and_exports_the_shortfall(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=10)
    # A prior that admits one request per worker (max_batch 1): the third request fits nowhere.
    async with gateway(fleet.urls, "aladdin", profiles=["one-seat"] * 2, limits={"queue_size": 1},
                       learning={"priors": {"one-seat": {"max_batch": 1}}}) as gw, \
            httpx.AsyncClient(timeout=30) as http:
        long = [asyncio.create_task(stream(http, gw.url, 1500)) for _ in range(2)]  # ~1.1 s each
        await poll(lambda: _inflight_is(http, gw.url, 2))
        queued = asyncio.create_task(stream(http, gw.url, 4))
        depth = await poll(lambda: _metric(http, gw.url, "fleetgate_queue_depth", {"model": MODEL}))
        assert depth == 1 and not queued.done()

        full = await http.post(gw.url + "/v1/chat/completions", json=chat(4), headers={"x-sim-output-tokens": "4"})
        assert full.status_code == 429
        assert int(full.headers["retry-after"]) >= 1
        err = full.json()["error"]
        assert err["type"] == "rate_limit_error" and "queue full" in err["message"]

        shortfall = await poll(lambda: _metric(http, gw.url, "fleetgate_placement_shortfall_workers",
                                               {"model": MODEL}))
        assert shortfall >= 1

        assert all(r.status_code == 200 for r in await asyncio.gather(*long))
        assert (await queued).status_code == 200  # placed once a worker freed up
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_slo_requests_total", {"model": MODEL, "result": "missed"}) == 1  # the 429


async def test_aladdin_refuses_at_once_a_request_that_will_miss_its_ttft(sim_fleet) -> None:
    """The one seat is taken by a long stream: the request's predicted TTFT (the wait for the seat, then its
    prefill) misses its 300 ms, so it is refused at entry (policies/shedding.py) with the predicted drain time as
    Retry-After, instead of waiting out its budget first."""
    fleet = sim_fleet(1, time_scale=10)
    async with gateway(fleet.urls, "aladdin", profiles=["one-seat"],
                       learning={"priors": {"one-seat": {"max_batch": 1}}}) as gw, \
            httpx.AsyncClient(timeout=30) as http:
        long = asyncio.create_task(stream(http, gw.url, 1500))
        await poll(lambda: _inflight_is(http, gw.url, 1))
        t0 = time.monotonic()
        r = await http.post(gw.url + "/v1/chat/completions", json=chat(4),
                            headers={"x-sim-output-tokens": "4", "x-slo-ttft-ms": "300"})
        waited = time.monotonic() - t0
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "slo_unattainable"
        assert "target of 300 ms" in r.json()["error"]["message"]
        assert waited < 0.9  # refused at entry, not after the 5 s queue timeout
        assert not long.done()
        assert (await long).status_code == 200


async def test_hetero_sends_more_to_the_stronger_worker(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [{"profile": STRONG, "model": MODEL}, {"profile": WEAK, "model": MODEL}]},
                      time_scale=20)
    async with gateway(fleet.urls, "hetero", profiles=[STRONG, WEAK]) as gw, \
            httpx.AsyncClient(timeout=60) as http:
        before = await served(http, fleet.urls)
        rs = await asyncio.gather(*(stream(http, gw.url, 64) for _ in range(30)))
        assert all(r.status_code == 200 for r in rs)
        strong, weak = (a - b for a, b in zip(await served(http, fleet.urls), before, strict=True))
    assert strong + weak == 30
    assert strong >= 2 * weak, (strong, weak)


HISTORY = "a long conversation so far " * 3000                       # ~20k tokens: ~0.75 s of prefill
TURN1 = {"model": MODEL, "messages": [{"role": "user", "content": HISTORY}], "max_tokens": 4, "stream": True}
TURN2 = {**TURN1, "messages": [*TURN1["messages"], {"role": "assistant", "content": "ok ok ok"},
                               {"role": "user", "content": "and now?"}]}


async def _first_turn_on_w1_then_w0_idle(http: httpx.AsyncClient, url: str, fleet_urls: list[str],
                                         headers: dict[str, str]) -> asyncio.Task:
    """A long answer to a long prompt occupies w0, so the conversation's first turn (TURN1, sent with `headers`)
    goes to the idle w1; then a longer answer occupies w1 (less loaded than w0) and the first one ends: w0 is the
    idle worker. Returns the task of w1's answer."""
    a = asyncio.create_task(_long_answer(http, url, "another document " * 6000, 6000))
    await poll(lambda: _inflight_on(http, url, "w0", 1))
    before = await served(http, fleet_urls)
    r = await http.post(url + "/v1/chat/completions", json=TURN1, headers=headers)
    assert r.status_code == 200
    assert [x - y for x, y in zip(await served(http, fleet_urls), before, strict=True)] == [0, 1]
    await poll(lambda: _inflight_on(http, url, "w1", 0))
    b = asyncio.create_task(stream(http, url, 16000))
    await poll(lambda: _inflight_on(http, url, "w1", 1))
    assert (await a).status_code == 200
    await poll(lambda: _inflight_on(http, url, "w0", 0))
    return b


async def test_aladdin_without_kv_events_or_an_id_infers_the_conversation_from_the_prefix(sim_fleet) -> None:
    """No x-session-id: the second turn's prompt holds the first turn's whole text, so its prefix chain holds the first
    turn's last full chunk (policies/aladdin/affinity.py) and aladdin prices it where that turn ran, as with an id;
    another conversation of the same length, which continues nothing, goes to the idle worker."""
    fleet = sim_fleet(2, time_scale=20)
    turn2 = TURN2
    other = {**turn2, "messages": [{"role": "user", "content": "another talk, as long " * 3000},
                                   *turn2["messages"][1:]]}
    out = {"x-sim-output-tokens": "4"}
    async with gateway(fleet.urls, "aladdin") as gw, httpx.AsyncClient(timeout=60) as http:
        b = await _first_turn_on_w1_then_w0_idle(http, gw.url, fleet.urls, out)
        before = await served(http, fleet.urls)
        r = await http.post(gw.url + "/v1/chat/completions", json=turn2, headers={**out, "x-slo-ttft-ms": "1000"})
        assert r.status_code == 200
        assert [x - y for x, y in zip(await served(http, fleet.urls), before, strict=True)] == [0, 1]
        before = await served(http, fleet.urls)
        r = await http.post(gw.url + "/v1/chat/completions", json=other, headers={**out, "x-slo-ttft-ms": "1000"})
        assert r.status_code == 200
        assert [x - y for x, y in zip(await served(http, fleet.urls), before, strict=True)] == [1, 0]
        assert (await b).status_code == 200


async def _metric(http: httpx.AsyncClient, url: str, name: str, labels: dict[str, str]) -> float | None:
    return metric((await http.get(url + "/metrics")).text, name, labels)


async def _inflight_is(http: httpx.AsyncClient, url: str, n: int) -> bool:
    text = (await http.get(url + "/metrics")).text
    total = 0.0
    for w in ("w0", "w1"):
        total += metric(text, "fleetgate_worker_inflight", {"worker": w}) or 0.0
    return total == n


async def _has_metric(http: httpx.AsyncClient, url: str, name: str, labels: dict[str, str]) -> list[float]:
    v = await _metric(http, url, name, labels)
    return [] if v is None else [v]


async def _inflight_on(http: httpx.AsyncClient, url: str, worker: str, n: int) -> bool:
    return (await _metric(http, url, "fleetgate_worker_inflight", {"worker": worker}) or 0.0) == n


async def _long_answer(http: httpx.AsyncClient, url: str, text: str, tokens: int) -> httpx.Response:
    body = {**chat(tokens), "messages": [{"role": "user", "content": text}]}
    async with http.stream("POST", url + "/v1/chat/completions", json=body,
                           headers={"x-sim-output-tokens": str(tokens)}) as r:
        await r.aread()
    return r


async def test_aladdin_without_kv_events_prices_a_turn_where_its_conversation_ran(sim_fleet) -> None:
    """x-session-id: the next turn's prefix is cached where the last turn ran (policies/aladdin/affinity.py), so with
    a TTFT target the prefill there meets easily, aladdin takes that worker over an idler one that would prefill the
    whole conversation again."""
    fleet = sim_fleet(2, time_scale=20)
    turn2 = TURN2
    sid = {"x-session-id": "conv-1", "x-sim-output-tokens": "4"}
    async with gateway(fleet.urls, "aladdin") as gw, httpx.AsyncClient(timeout=60) as http:
        b = await _first_turn_on_w1_then_w0_idle(http, gw.url, fleet.urls, sid)
        # The second turn with a 1 s TTFT target: 0.75 s of prefill on w0, its new tokens only on w1.
        before = await served(http, fleet.urls)
        r = await http.post(gw.url + "/v1/chat/completions", json=turn2, headers={**sid, "x-slo-ttft-ms": "1000"})
        assert r.status_code == 200
        assert [x - y for x, y in zip(await served(http, fleet.urls), before, strict=True)] == [0, 1]
        # The same turn without its conversation id: w1 was sent its prefix (the first turn), so it is priced there
        # too (affinity.py: what each worker was sent), not whole.
        before = await served(http, fleet.urls)
        r = await http.post(gw.url + "/v1/chat/completions", json=turn2,
                            headers={"x-sim-output-tokens": "4", "x-slo-ttft-ms": "1000"})
        assert r.status_code == 200
        assert [x - y for x, y in zip(await served(http, fleet.urls), before, strict=True)] == [0, 1]
        assert (await b).status_code == 200
