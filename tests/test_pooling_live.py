"""Pooled serving in the live gateway: models sharing a host through vLLM sleep mode, woken by the
gateway's swap controller (gateway/control/pooling.py, decisions in policies/pooling/swapping.py). Real HTTP, simulated
vLLM servers with sleep mode, the official openai client; the engines' own counters say whether a request ever
reached a sleeping engine."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from gateway.config import ConfigError, load_config
from gateway.control.pooling import swap_costs
from gateway.state.outage import stop_task
from policies.pooling.swapping import EngineView, HostView, RequestLevelSwaps, SwapStep
from tests.helpers import metric, redis_prefix
from tests.helpers import running_gateway as gateway

A, B = "pool/model-a", "pool/model-b"


def _state(url: str) -> dict:
    return httpx.get(url + "/sim/state").json()


def _shared(urls: dict[str, str], **host: object) -> dict:
    return {"shared_hosts": [{"id": "gpu0", "max_awake": 1, "engines": urls, **host}], "scrape_interval_s": 0.05}


async def _metrics(gw_url: str) -> str:
    async with httpx.AsyncClient() as c:
        return (await c.get(gw_url + "/metrics")).text


async def test_two_models_on_one_host_take_turns(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=20)
    url_a, url_b = fleet.urls
    async with gateway(**_shared({A: url_a, B: url_b})) as gw:
        # at start the controller keeps the first engine awake and puts the second to sleep (max_awake 1)
        assert httpx.get(url_b + "/is_sleeping").json()["is_sleeping"] is True
        assert httpx.get(url_a + "/is_sleeping").json()["is_sleeping"] is False
        oa = make_client(gw.url, max_retries=0, timeout=30)
        for model in (A, B, A, B, A, B):
            r = await oa.completions.create(model=model, prompt="hello there", max_tokens=4)
            assert r.model == model and r.usage.completion_tokens == 4
        text = await _metrics(gw.url)
        swaps = {(m, d): metric(text, "fleetgate_model_swaps_total", {"model": m, "direction": d})
                 for m in (A, B) for d in ("in", "out")}
        # B out at start; then every request for the other model swapped: B, A, B, A, B in
        assert swaps == {(A, "in"): 2, (A, "out"): 3, (B, "in"): 3, (B, "out"): 3}, swaps
        assert metric(text, "fleetgate_swap_seconds_count", {"host": "gpu0"}) == 5
        assert metric(text, "fleetgate_engine_state", {"worker": "gpu0:pool_model-b", "model": B,
                                                       "state": "awake"}) == 1
        assert metric(text, "fleetgate_engine_state", {"worker": "gpu0:pool_model-a", "model": A,
                                                       "state": "weights_offloaded"}) == 1
        assert httpx.get(url_a + "/is_sleeping").json()["is_sleeping"] is True
        async with httpx.AsyncClient() as c:
            hosts = (await c.get(gw.url + "/ui/status.json")).json()["shared_hosts"]
        assert [(h["id"], h["engines"][A]["awake"], h["engines"][B]["awake"]) for h in hosts] == [("gpu0", False, True)]
        for url in (url_a, url_b):
            st = _state(url)
            assert st["submitted_asleep"] == 0, st         # nothing ever reached a sleeping engine
            assert st["stats"]["finished"].get("length", 0) == 3


async def test_concurrent_mixed_requests_all_succeed_and_never_reach_a_sleeping_engine(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=20)
    url_a, url_b = fleet.urls
    async with gateway(**_shared({A: url_a, B: url_b}), limits={"queue_timeout_s": 30}) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=60)

        async def one(i: int) -> int:
            await asyncio.sleep(0.01 * i)
            r = await oa.chat.completions.create(model=(A, B)[i % 2], max_tokens=8,
                                                 messages=[{"role": "user", "content": f"question {i}"}])
            return r.usage.completion_tokens

        assert await asyncio.gather(*(one(i) for i in range(16))) == [8] * 16
        assert _state(url_a)["submitted_asleep"] == 0
        assert _state(url_b)["submitted_asleep"] == 0
        text = await _metrics(gw.url)
        ins = sum(metric(text, "fleetgate_model_swaps_total", {"model": m, "direction": "in"}) or 0 for m in (A, B))
        assert 1 <= ins <= 16     # requests of one model batched behind a swap: not one swap per request


async def test_a_wake_that_fails_is_an_openai_503_not_a_hang(sim_fleet, make_client) -> None:
    fleet_a = sim_fleet(fleet={"servers": [{"model": A}]}, time_scale=20)
    fleet_b = sim_fleet(fleet={"servers": [{"model": B}]}, time_scale=20)
    async with gateway(**_shared({A: fleet_a.urls[0], B: fleet_b.urls[0]}),
                       health={"interval_s": 30}) as gw:   # the health checks must not see it first
        oa = make_client(gw.url, max_retries=0, timeout=30)
        fleet_b.stop()                                     # B's engine dies while asleep
        t = time.monotonic()
        with pytest.raises(openai.APIStatusError) as exc:
            await oa.completions.create(model=B, prompt="hi", max_tokens=2)
        assert exc.value.status_code == 503
        assert exc.value.body["message"] and exc.value.body["type"]   # OpenAI's error object
        assert time.monotonic() - t < 10
        # A (put to sleep for B) is woken again for its own request
        r = await oa.completions.create(model=A, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert _state(fleet_a.urls[0])["submitted_asleep"] == 0


async def test_a_model_on_two_hosts_fails_over_when_one_wake_fails(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": A}, {"model": B}]}, time_scale=20)
    dead = sim_fleet(fleet={"servers": [{"model": B}]}, time_scale=20)
    a0, a1, b1 = fleet.urls
    # A stays awake on both hosts at start; B sleeps on both; h0's B is tried first (ties go to the first host)
    hosts = [{"id": "h0", "engines": {A: a0, B: dead.urls[0]}},
             {"id": "h1", "engines": {A: {"url": a1, "id": "h1-a"}, B: b1}}]
    async with gateway(shared_hosts=hosts, scrape_interval_s=0.05, health={"interval_s": 30}) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=30)
        dead.stop()
        r = await oa.completions.create(model=B, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert _state(b1)["stats"]["finished"].get("length", 0) == 1    # served by h1 after h0's wake failed
        text = await _metrics(gw.url)
        assert metric(text, "fleetgate_model_swaps_total", {"model": A, "direction": "out"}) == 2   # both hosts tried
        assert metric(text, "fleetgate_model_swaps_total", {"model": B, "direction": "in"}) == 1
        assert _state(a0)["submitted_asleep"] == _state(a1)["submitted_asleep"] == _state(b1)["submitted_asleep"] == 0


def test_shared_hosts_config_errors() -> None:
    def problems(**cfg: object) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(None, **cfg)
        return "\n".join(e.value.problems)

    eng = {A: "http://127.0.0.1:9001", B: "http://127.0.0.1:9002"}
    assert "shared_hosts[0].max_awake" in problems(shared_hosts=[{"id": "g", "engines": eng, "max_awake": 0}])
    assert "duplicate shared host id 'g'" in problems(shared_hosts=[{"id": "g", "engines": eng},
                                                                   {"id": "g", "engines": eng}])
    assert "already taken" in problems(workers=[{"id": "g:pool_model-a", "url": "http://127.0.0.1:9"}],
                                       shared_hosts=[{"id": "g", "engines": eng}])
    assert "http://" in problems(shared_hosts=[{"id": "g", "engines": {A: "ftp://x"}}])
    assert "engines" in problems(shared_hosts=[{"id": "g", "engines": {}}])
    assert "unknown field" in problems(shared_hosts=[{"id": "g", "engines": eng, "max_wake": 2}])
    assert "sleep_level" in problems(shared_hosts=[{"id": "g", "engines": eng, "sleep_level": 3}])
    cfg = load_config(None, shared_hosts=[{"id": "g", "engines": eng}])
    assert [w.id for w in cfg.all_workers()] == ["g:pool_model-a", "g:pool_model-b"]
    assert cfg.all_workers()[0].labels == {"shared_host": "g"}


def test_swap_costs_come_from_weights_and_link_unless_overridden() -> None:
    cfg = load_config(None, shared_hosts=[{"id": "g", "link_gb_per_s": 25, "wake_overhead_s": 0.5, "engines": {
        A: {"url": "http://127.0.0.1:9001", "weight_gb": 16},
        B: {"url": "http://127.0.0.1:9002", "weight_gb": 16, "load_s": 2.0}}}])
    costs = swap_costs(cfg.shared_hosts[0])
    assert costs[A].offload_s == pytest.approx(16 / 25)              # vLLM sleep level 1: a plain copy out
    assert costs[A].load_s == pytest.approx(16 / 25 + 0.5)           # and back, plus the wake overhead
    assert costs[B].load_s == 2.0 and costs[B].offload_s == pytest.approx(16 / 25)


def test_planner_is_fcfs_and_drains_the_least_busy_engine() -> None:
    p = RequestLevelSwaps()
    engines = {A: EngineView(True, busy=2), B: EngineView(False)}
    p.want(B, 1.0)
    assert p.plan({"h": HostView(1, engines, drain_after_s=None)}, now=99.0) == []   # A busy: B waits for it
    patient = HostView(1, engines, drain_after_s=2.0)
    assert p.plan({"h": patient}, now=2.0) == []                                    # waited 1 s of 2
    assert p.plan({"h": patient}, now=3.0) == [SwapStep("h", B, (A,))]   # A drained (no new requests), then out
    busy = HostView(1, engines, drain_after_s=0.0)                                  # drain at once
    two = {"h0": busy, "h1": HostView(1, {A: EngineView(True, busy=1, idle_since=5.0), B: EngineView(False)},
                                      drain_after_s=0.0)}
    assert p.plan(two, now=1.0) == [SwapStep("h1", B, (A,))]                        # the engine with fewer in flight
    idle = HostView(1, {A: EngineView(True), B: EngineView(False)})
    assert p.plan({"h": idle}, waiting={A}, now=5.0) == []             # A has requests queued: kept
    assert p.plan({"h": idle}) == [SwapStep("h", B, (A,))]
    room = HostView(2, {A: EngineView(True, busy=1), B: EngineView(False)})
    assert p.plan({"h": room}) == [SwapStep("h", B)]                   # room: nothing swapped out
    assert p.plan({"h": HostView(1, {A: EngineView(True)}, switching=True)}) == []
    # FCFS: the older demand takes the host even if the younger one was asked first in this call
    q = RequestLevelSwaps()
    c = "pool/model-c"
    three = HostView(1, {A: EngineView(True), B: EngineView(False), c: EngineView(False)})
    q.want(c, 2.0)
    q.want(B, 1.0)
    assert q.plan({"h": three}) == [SwapStep("h", B, (A,))]
    # demand already met anywhere is dropped; an unusable engine is never woken
    assert q.plan({"h": HostView(1, {B: EngineView(True), c: EngineView(False, usable=False)})}) == []
    assert q.demand == {c: 2.0}


POOL_REDIS_URL = "redis://127.0.0.1:6379/12"     # this module's own Redis DB


@contextlib.asynccontextmanager
async def _two_replicas(sim_fleet) -> AsyncIterator[tuple[Any, Any, str, str]]:  # noqa: ANN001
    """Two gateway replicas r1, r2 on one Redis prefix in front of one shared host (models A and B, max_awake 1);
    yields them and the engines' URLs."""
    with redis_prefix(POOL_REDIS_URL, "pool") as prefix:
        fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=20)
        url_a, url_b = fleet.urls
        cfg = {**_shared({A: url_a, B: url_b}), "redis_url": POOL_REDIS_URL, "redis_key_prefix": prefix,
               "limits": {"queue_timeout_s": 30}}
        async with gateway(**cfg, replica_id="r1") as g1, gateway(**cfg, replica_id="r2") as g2:
            yield g1, g2, url_a, url_b


async def test_two_replicas_share_a_host_through_redis(sim_fleet, make_client) -> None:
    async with _two_replicas(sim_fleet) as (g1, g2, url_a, url_b):
        clients = [make_client(g.url, max_retries=0, timeout=60) for g in (g1, g2)]

        async def one(i: int) -> int:
            await asyncio.sleep(0.02 * i)
            out = await clients[i % 2].completions.create(model=(A, A, B, B)[i % 4], prompt=f"q {i}",
                                                          max_tokens=6)
            return out.usage.completion_tokens

        assert await asyncio.gather(*(one(i) for i in range(16))) == [6] * 16
        assert _state(url_a)["submitted_asleep"] == 0
        assert _state(url_b)["submitted_asleep"] == 0
        asleep = [httpx.get(u + "/is_sleeping").json()["is_sleeping"] for u in (url_a, url_b)]
        assert asleep.count(False) == 1                  # max_awake 1 held across both replicas


async def test_a_lagging_replica_never_sends_a_request_to_an_engine_put_to_sleep(sim_fleet, make_client,
                                                                             monkeypatch) -> None:
    """The replica swapping a host sleeps an engine only once every live replica has acknowledged the hold and
    ended its requests there. Here r2's hold sync runs 1.5 s late each time (a replica on a loaded host) while
    it keeps sending model A's requests; r1 swaps A out for B. Nothing reaches A asleep, nothing fails."""
    async with _two_replicas(sim_fleet) as (g1, g2, url_a, url_b):
        lagging = g2.gateway.pooling
        sync = lagging.sync_holds

        async def late() -> None:
            await asyncio.sleep(1.5)
            await sync()

        monkeypatch.setattr(lagging, "sync_holds", late)
        c1, c2 = (make_client(g.url, max_retries=0, timeout=60) for g in (g1, g2))
        stop = asyncio.Event()

        async def keep_sending_a() -> int:
            n = 0
            while not stop.is_set():
                out = await c2.completions.create(model=A, prompt=f"a {n}", max_tokens=20)
                assert out.usage.completion_tokens == 20
                n += 1
            return n

        sender = asyncio.ensure_future(keep_sending_a())
        await asyncio.sleep(0.3)
        out = await c1.completions.create(model=B, prompt="b", max_tokens=6)    # r1 swaps A out for B
        assert out.usage.completion_tokens == 6
        stop.set()
        assert await sender > 1
        assert _state(url_a)["submitted_asleep"] == 0
        assert _state(url_b)["submitted_asleep"] == 0


def _swallowing_once(reading: asyncio.Event, swallowed: list[str], result: object = None) -> Callable[..., Awaitable]:
    """A store call that is under way until cancelled, and swallows its first cancellation: what redis-py does
    now and then when a cancellation lands while a command reads its reply (the command returns normally)."""
    async def call(key: str = "", *args: object) -> object:
        reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if key in swallowed:
                raise
            swallowed.append(key)
        return result

    return call


async def _stops(stop: Callable[[], Awaitable[None]]) -> bool:
    """Whether `stop()` ends within 10 s by itself (not wait_for: its own cancellation would end it)."""
    stopping = asyncio.get_running_loop().create_task(stop())
    done, _ = await asyncio.wait({stopping}, timeout=10)
    if not done:
        await stop_task(stopping)
    return bool(done)


async def test_shutdown_ends_though_a_redis_call_swallows_its_cancellation(sim_fleet) -> None:
    """redis-py can lose the cancellation of a task whose command is reading its reply; the swap controller's
    hold-sync loop and the registry's sync loop then ran on, and a replica's shutdown waited on them forever
    (the hang of the two-replica test under load). Here their store calls swallow the first cancellation."""
    with redis_prefix(POOL_REDIS_URL, "pool") as prefix:
        fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=20)
        cfg = {**_shared(dict(zip((A, B), fleet.urls, strict=True))), "redis_url": POOL_REDIS_URL,
               "redis_key_prefix": prefix}
        async with gateway(**cfg, replica_id="r1") as gw:
            store, swallowed = gw.gateway.store, []
            holds, workers = asyncio.Event(), asyncio.Event()
            store.get_doc = _swallowing_once(holds, swallowed)
            store.list_workers = _swallowing_once(workers, swallowed, [])
            await asyncio.wait_for(asyncio.gather(holds.wait(), workers.wait()), 10)
            assert await _stops(gw.gateway.pooling.stop), "the controller waited on its hold-sync loop"
            assert await _stops(gw.gateway.registry.stop), "the registry waited on its sync loop"
            assert swallowed == ["pool:host:gpu0", ""], swallowed


def test_pooled_demo_serves_every_model_of_a_shared_host() -> None:
    import signal

    from tests.helpers import CliProcess, free_port_range, refused

    base = free_port_range(5)
    with CliProcess("demo", "--port", str(base), "--workers", "2", "--num-models", "2", "--base-port",
                    str(base + 1), "--time-scale", "20", merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        text = "\n".join(demo.stdout)
        models = ["meta-llama/Llama-3.1-8B-Instruct-0", "meta-llama/Llama-3.1-8B-Instruct-1"]
        assert "2 model(s) sharing 2 host(s)" in text and all(f'"model": "{m}"' in text for m in models), text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{base}/v1", api_key="x", max_retries=0, timeout=30)
        for m in models * 2:
            assert client.completions.create(model=m, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        # each host keeps one model awake: both models are served, by host0's and host1's awake engines
        asleep = [httpx.get(f"http://127.0.0.1:{base + 1 + i}/is_sleeping").json()["is_sleeping"] for i in range(4)]
        assert asleep.count(False) == 2 and asleep[:2].count(False) == 1, asleep
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0
    assert all(refused(base + i) for i in range(5))


def test_pooled_demo_answers_one_request_per_model_sequentially_with_200() -> None:
    """`fleetgate demo --num-models 4 --workers 2` at real time (a swap takes the profile's 1 s wake-up, as long
    as the demo's 1 s TTFT target), then one plain HTTP request per model twice over, no client retries: each
    request to a sleeping model waits for its swap (its swap time counts into its TTFT budget) and gets a 200."""
    import signal

    from tests.helpers import CliProcess, free_port_range

    base = free_port_range(9)
    with CliProcess("demo", "--port", str(base), "--workers", "2", "--num-models", "4", "--base-port",
                    str(base + 1), merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        models = [f"meta-llama/Llama-3.1-8B-Instruct-{j}" for j in range(4)]
        answers = []
        with httpx.Client(base_url=f"http://127.0.0.1:{base}", timeout=60) as http:
            for m in models * 2:
                r = http.post("/v1/completions", json={"model": m, "prompt": "Hello", "max_tokens": 16})
                answers.append((m, r.status_code, r.text[:200] if r.status_code != 200 else ""))
            text = http.get("/metrics").text
        assert [a for a in answers if a[1] != 200] == [], answers
        swaps = sum(metric(text, "fleetgate_model_swaps_total", {"model": m, "direction": "in"}) or 0
                    for m in models)
        assert swaps >= 6, swaps            # the requests did wait for swaps (two hosts: at most 2 models awake)
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0


def test_pooled_demo_answers_concurrent_first_requests_per_model_after_their_swap() -> None:
    """`fleetgate demo --num-models 4 --workers 2` at real time, rounds of 4 concurrent requests per model sent at
    once (16 in flight, two hosts, one model awake on each), no client retries: every request whose model is asleep
    or still waking waits for its swap and gets a 200. Before, a request arriving while its model's wake-up was
    under way counted that swap as done (0 s): its 1 s TTFT budget ran out during the 1.2 s swap and it got a 429.
    """
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers import CliProcess, free_port_range

    base = free_port_range(9)
    with CliProcess("demo", "--port", str(base), "--workers", "2", "--num-models", "4", "--base-port",
                    str(base + 1), merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        models = [f"meta-llama/Llama-3.1-8B-Instruct-{j}" for j in range(4)]
        with httpx.Client(base_url=f"http://127.0.0.1:{base}", timeout=60,
                          limits=httpx.Limits(max_connections=32)) as http:
            def ask(m: str) -> tuple[str, int, str]:
                r = http.post("/v1/completions", json={"model": m, "prompt": "Hello", "max_tokens": 16})
                return m, r.status_code, r.text[:200] if r.status_code != 200 else ""

            answers = []
            with ThreadPoolExecutor(16) as pool:
                for _ in range(4):
                    answers += list(pool.map(ask, [m for m in models for _ in range(4)]))
            text = http.get("/metrics").text
        assert len(answers) == 64 and [a for a in answers if a[1] != 200] == [], answers
        swaps = sum(metric(text, "fleetgate_model_swaps_total", {"model": m, "direction": "in"}) or 0
                    for m in models)
        assert swaps >= 6, swaps            # the requests did wait for swaps
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0


async def test_drain_after_s_serves_a_model_while_another_keeps_its_host_busy(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=5)
    url_a, url_b = fleet.urls
    async with gateway(**_shared({A: url_a, B: url_b}, drain_after_s=0.0), limits={"queue_timeout_s": 30}) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=60)
        stop = time.monotonic() + 4.0
        served_a: list[int] = []

        async def busy_a() -> None:          # two users back to back: A almost never idle on the host
            while time.monotonic() < stop:
                r = await oa.completions.create(model=A, prompt="steady", max_tokens=60)
                served_a.append(r.usage.completion_tokens)

        users = [asyncio.create_task(busy_a()), asyncio.create_task(busy_a())]
        await asyncio.sleep(0.5)
        t = time.monotonic()
        r = await oa.completions.create(model=B, prompt="hello", max_tokens=4)
        waited = time.monotonic() - t
        assert r.usage.completion_tokens == 4
        assert time.monotonic() < stop, f"B waited {waited:.2f}s: until A's traffic stopped"   # A drained for it
        await asyncio.gather(*users)
        assert len(served_a) >= 4 and all(n >= 1 for n in served_a)          # every A request completed
        assert _state(url_a)["submitted_asleep"] == _state(url_b)["submitted_asleep"] == 0


def test_pooled_demo_with_turns_runs_both_models_of_one_host_in_turns() -> None:
    """`fleetgate demo --num-models 2 --workers 1 --scheduling turns`: two streams of the two models sent together
    both finish on the one host, which ran them in turns (fleetgate_turns_total counts both models)."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers import CliProcess, free_port_range, refused

    base = free_port_range(3)
    with CliProcess("demo", "--port", str(base), "--workers", "1", "--num-models", "2", "--scheduling", "turns",
                    "--base-port", str(base + 1), "--time-scale", "20", merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        assert "they run in their model's turns" in "\n".join(demo.stdout)
        models = ["meta-llama/Llama-3.1-8B-Instruct-0", "meta-llama/Llama-3.1-8B-Instruct-1"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{base}/v1", api_key="x", max_retries=0, timeout=60)

        def run(m: str) -> int:
            return client.completions.create(model=m, prompt="hi", max_tokens=600,
                                            extra_body={"ignore_eos": True}).usage.completion_tokens

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(run, models)) == [600, 600]
        text = httpx.get(f"http://127.0.0.1:{base}/metrics").text
        turns = {m: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("fleetgate_turns_total{") and f'model="{m}"' in line) for m in models}
        assert all(n >= 1 for n in turns.values()), turns
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0
    assert all(refused(base + i) for i in range(3))
