"""Every registered routing policy, end to end through the gateway: requests spread or stick as it says."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager

import httpx
import pytest

from gateway.server import GatewayServer
from policies.base import policy_names
from tests.helpers import MODEL, running_gateway


def gateway(urls: list[str], policy: str) -> AbstractAsyncContextManager[GatewayServer]:
    # The simulated workers' profile: SLO-aware policies place by each worker's own performance model.
    workers = [{"id": f"w{i}", "url": u, "profile": "llama3-8b-h100"} for i, u in enumerate(urls)]
    return running_gateway(workers=workers, default_policy=policy)


async def served(http: httpx.AsyncClient, urls: list[str]) -> list[int]:
    states = await asyncio.gather(*(http.get(u + "/sim/state") for u in urls))
    return [sum(s.json()["stats"]["finished"].values()) for s in states]


def chat(content: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


async def sequential(http, gw, bodies, headers=None) -> None:  # noqa: ANN001
    for i, body in enumerate(bodies):
        h = headers[i] if headers else {}
        r = await http.post(gw.url + "/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 200, r.text


def spread(before: list[int], after: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


async def check_round_robin(http, gw, urls) -> None:  # noqa: ANN001
    before = await served(http, urls)
    await sequential(http, gw, [chat(f"q{i}") for i in range(9)])
    assert spread(before, await served(http, urls)) == [3, 3, 3]


async def check_least_requests(http, gw, urls) -> None:  # noqa: ANN001
    before = await served(http, urls)
    long = {**chat("x"), "max_tokens": 40}
    rs = await asyncio.gather(*(http.post(gw.url + "/v1/chat/completions", json=long,
                                          headers={"x-sim-output-tokens": "40"}) for _ in range(6)))
    assert all(r.status_code == 200 for r in rs)
    assert spread(before, await served(http, urls)) == [2, 2, 2]  # each new request joins the shortest queue


async def check_spreads(http, gw, urls) -> None:  # noqa: ANN001
    before = await served(http, urls)
    await sequential(http, gw, [chat(f"q{i}") for i in range(12)])
    counts = spread(before, await served(http, urls))
    assert sum(counts) == 12 and sum(1 for c in counts if c) >= 2


async def check_power_of_two(http, gw, urls) -> None:  # noqa: ANN001
    before = await served(http, urls)
    long = {**chat("x"), "max_tokens": 30}
    rs = await asyncio.gather(*(http.post(gw.url + "/v1/chat/completions", json=long,
                                          headers={"x-sim-output-tokens": "30"}) for _ in range(9)))
    assert all(r.status_code == 200 for r in rs)
    counts = spread(before, await served(http, urls))
    assert sum(counts) == 9 and max(counts) <= 5 and sum(1 for c in counts if c) >= 2


async def check_session_affinity(http, gw, urls) -> None:  # noqa: ANN001
    before = await served(http, urls)
    await sequential(http, gw, [chat(f"turn {i}") for i in range(6)], [{"x-session-id": "alice"}] * 6)
    counts = spread(before, await served(http, urls))
    assert sorted(counts) == [0, 0, 6]  # one session, one worker
    before = await served(http, urls)
    await sequential(http, gw, [chat("hi")] * 12, [{"x-session-id": f"user-{i}"} for i in range(12)])
    assert sum(1 for c in spread(before, await served(http, urls)) if c) >= 2


async def check_prefix_affinity(http, gw, urls) -> None:  # noqa: ANN001
    shared = "You are a helpful assistant with a long shared system prompt. " * 20
    before = await served(http, urls)
    await sequential(http, gw, [chat(shared + f"question {i}") for i in range(6)])
    assert sorted(spread(before, await served(http, urls))) == [0, 0, 6]  # same prefix, same worker
    before = await served(http, urls)
    await sequential(http, gw, [chat(f"{i} unrelated prompt " * 30) for i in range(9)])
    assert sum(1 for c in spread(before, await served(http, urls)) if c) >= 2


async def check_served(http, gw, urls) -> None:  # noqa: ANN001
    """Non-baseline policies (bin packing, SLO-aware...) may legitimately pack: only require service."""
    before = await served(http, urls)
    await sequential(http, gw, [chat(f"q{i}") for i in range(6)])
    assert sum(spread(before, await served(http, urls))) == 6


CHECKS = {
    "round_robin": check_round_robin,
    "least_requests": check_least_requests,
    "least_kv": check_spreads,
    "random": check_spreads,
    "power_of_two": check_power_of_two,
    "session_affinity": check_session_affinity,
    "prefix_affinity": check_prefix_affinity,
}


@pytest.mark.parametrize("policy", policy_names())
async def test_policy_end_to_end(sim_fleet, policy: str) -> None:
    fleet = sim_fleet(3, time_scale=50)
    check = CHECKS.get(policy, check_served)  # policies beyond the baselines are at least exercised
    async with gateway(fleet.urls, policy) as gw, httpx.AsyncClient(timeout=20) as http:
        await check(http, gw, fleet.urls)
        metrics = (await http.get(gw.url + "/metrics")).text
        assert f'policy="{policy}"' in metrics


@pytest.mark.parametrize("policy", ["least_tokens", "least_requests"])
async def test_least_tokens_keeps_short_requests_off_the_worker_holding_a_long_prompt(sim_fleet, policy) -> None:
    """Three workers with one request in flight each, one of them a long prompt: least_requests sees three equal
    loads and rotates over all three; least_tokens (the default) sends the next short requests to the two
    workers holding fewer tokens."""
    fleet = sim_fleet(3, time_scale=1)   # real time: the held streams stay open while the short requests run
    held = {**chat("x"), "max_tokens": 2000, "stream": True}
    big = {**held, "messages": [{"role": "user", "content": "long context " * 3000}]}
    hold = {"x-sim-output-tokens": "2000"}
    async with gateway(fleet.urls, policy) as gw, httpx.AsyncClient(timeout=60) as http:
        url = gw.url + "/v1/chat/completions"
        async with http.stream("POST", url, json=big, headers=hold) as r0:
            chunks = [r0.aiter_bytes()]   # kept: a dropped iterator closes its stream
            await chunks[0].__anext__()   # placed (on w0: every worker idle, the first id)
            async with http.stream("POST", url, json=held, headers=hold) as r1, \
                    http.stream("POST", url, json=held, headers=hold) as r2:
                chunks += [r1.aiter_bytes(), r2.aiter_bytes()]
                await chunks[1].__anext__()
                await chunks[2].__anext__()
                inflight = gw.gateway.store.inflight()
                assert [inflight[w].requests for w in ("w0", "w1", "w2")] == [1, 1, 1]
                assert inflight["w0"].tokens > 10 * inflight["w1"].tokens
                before = await served(http, fleet.urls)
                await sequential(http, gw, [chat(f"q{i}") for i in range(4)])
                counts = spread(before, await served(http, fleet.urls))
    assert sum(counts) == 4
    if policy == "least_tokens":
        assert counts == [0, 2, 2]
    else:
        assert counts[0] >= 1
