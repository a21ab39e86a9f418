"""Aegaeon's decode turns enforced live on a shared host (`shared_hosts[].scheduling: turns`, gateway/control/turns.py;
turn rules in policies/pooling/turns.py, quotas from policies/pooling/aegaeon.py eq. 2-3). Real HTTP, simulated
vLLM servers with sleep mode (they keep requests that arrive while asleep and run them after the wake-up), the
official openai client; the engines' own /is_sleeping says which one runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, load_config
from policies.pooling.aegaeon import Q_MAX_S, decode_quotas
from policies.pooling.turns import LOST, PAUSED, REFUSED, HostTurns, pause_outcome
from simulator.fleet import SimFleet
from tests.helpers import metric, redis_prefix
from tests.helpers import running_gateway as gateway

A, B, C = "pool/model-a", "pool/model-b", "pool/model-c"
QUOTA_S = 0.3
MIN_SAMPLES = 20    # /is_sleeping polls of both engines in a run: 30-50 on two busy cores, hundreds on a quiet one


def _turns_host(urls: dict[str, str], **host: object) -> dict:
    engines = {m: {"url": u, "load_s": 0.05, "offload_s": 0.05} for m, u in urls.items()}
    return {"shared_hosts": [{"id": "gpu0", "max_awake": 1, "scheduling": "turns", "q_max_s": QUOTA_S,
                              "engines": engines, **host}],
            "slo": {"tpot_ms": 100}, "scrape_interval_s": 0.05, "limits": {"queue_timeout_s": 30}}


async def _stream(oa, model: str, max_tokens: int) -> tuple[list[float], str | None, int]:
    """Chunk arrival times, finish reason and completion tokens of one streamed completion."""
    times: list[float] = []
    finish, tokens = None, 0
    stream = await oa.completions.create(model=model, prompt="tell me a long story", max_tokens=max_tokens,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic())
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return times, finish, tokens


class _AwakeWatch:
    """Samples the engines' sleep state (the simulators run in this process, so one sample reads both at one
    instant; two GET /is_sleeping answered 0.5 s apart on a loaded machine once saw A before its pause and B after
    its wake-up, both "awake"): how often both were awake at once."""

    def __init__(self, fleet: SimFleet) -> None:
        self.drivers = [s.driver for s in fleet.servers]
        self.both = 0
        self.samples = 0

    async def run(self) -> None:
        while True:
            awake = [not d.is_sleeping for d in self.drivers]
            self.samples += 1
            self.both += sum(awake) > 1
            await asyncio.sleep(0.005)


def _runs(times: dict[str, list[float]]) -> list[tuple[str, float, float]]:
    """The merged chunk timeline as runs of one model: (model, first, last)."""
    events = sorted((t, m) for m, ts in times.items() for t in ts)
    runs: list[tuple[str, float, float]] = []
    for t, m in events:
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], t)
        else:
            runs.append((m, t, t))
    return runs


async def test_two_models_decode_in_turns_one_engine_awake_at_a_time(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
    url_a, url_b = fleet.urls
    async with gateway(**_turns_host({A: url_a, B: url_b})) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=60)
        watch = _AwakeWatch(fleet)
        # both engines started awake: the gateway paused one before it began serving (TurnDriver.settle)
        assert [d.is_sleeping for d in watch.drivers].count(False) == 1
        watcher = asyncio.create_task(watch.run())
        t0 = time.monotonic()
        (ta, fa, na), (tb, fb, nb) = await asyncio.gather(_stream(oa, A, 400), _stream(oa, B, 400))
        took = time.monotonic() - t0
        watcher.cancel()
        assert (fa, na, fb, nb) == ("length", 400, "length", 400)
        assert watch.samples >= MIN_SAMPLES and watch.both == 0, (watch.both, watch.samples)   # never both awake
        runs = _runs({A: ta, B: tb})
        # the streams interleave in turns: A pauses while B advances and back, many times over
        assert len(runs) >= 6, [(m[-1], round(b - a, 2)) for m, a, b in runs]
        inner = runs[1:-1]
        assert all(b - a < 3 * QUOTA_S for _, a, b in inner), [(m[-1], round(b - a, 2)) for m, a, b in runs]
        async with httpx.AsyncClient() as c:
            text = (await c.get(gw.url + "/metrics")).text
            host = (await c.get(gw.url + "/ui/status.json")).json()["shared_hosts"][0]
        ins = sum(metric(text, "fleetgate_model_swaps_total", {"model": m, "direction": "in"}) or 0 for m in (A, B))
        turns = sum(metric(text, "fleetgate_turns_total", {"host": "gpu0", "model": m}) or 0 for m in (A, B))
        # both models busy for most of the run: about one switch per quota (plus the switch itself)
        expect = took / (QUOTA_S + host["switch_s"])
        print(f"took {took:.2f}s, switches in {ins}, expected ~{expect:.1f}, switch_s {host['switch_s']}, "
              f"runs {[(m[-1], round(b - a, 2)) for m, a, b in runs]}")
        assert 0.5 * expect <= ins <= 1.5 * expect + 2, (ins, expect, took)
        assert turns >= ins - 1
        assert host["scheduling"] == "turns" and host["level"] == 1     # max_awake 1 < 2 engines: weights out
        plan = host["round"]        # eq. 2-3 with c = both switches (offload + load each way, or measured if longer)
        assert plan["switch_s"] >= 2 * (0.05 + 0.05)
        assert plan["quotas_s"] == pytest.approx(decode_quotas([0.1, 0.1], 0.1, plan["switch_s"], QUOTA_S))
        assert metric(text, "fleetgate_swap_seconds_count", {"host": "gpu0"}) == host["switches"]
        paused = [metric(text, "fleetgate_engine_state", {"model": m, "state": "weights_offloaded"}) for m in (A, B)]
        assert sorted(paused) == [0, 1], paused    # the engine whose turn ended last is paused (level 1)
        # stock vLLM at level 1 drops the paused requests' KV: they recompute after the wake-up (Aegaeon would keep
        # it in host memory: simulator only)
        assert all(httpx.get(u + "/sim/state").json()["stats"]["preemptions"] >= 2 for u in (url_a, url_b))


async def test_quotas_come_from_the_learned_step_times_and_the_derived_swap_costs(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
    engines = {m: {"url": u, "profile": "llama3-8b-h100", "weight_gb": 16} for m, u in zip((A, B), fleet.urls,
                                                                                            strict=True)}
    host = {"id": "gpu0", "max_awake": 1, "scheduling": "turns", "q_max_s": 1.0, "link_gb_per_s": 25,
            "engines": engines, "recompute_quota": True}
    async with gateway(shared_hosts=[host], slo={"tpot_ms": 100}, scrape_interval_s=0.05) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=60)
        results = await asyncio.gather(_stream(oa, A, 300), _stream(oa, B, 300), _stream(oa, B, 300))
        assert [(f, n) for _, f, n in results] == [("length", 300)] * 3
        async with httpx.AsyncClient() as c:
            plan = (await c.get(gw.url + "/ui/status.json")).json()["shared_hosts"][0]["round"]
        learner = gw.gateway.learner
        await learner.tick()    # ingest the finished streams now
        # their gaps include the other model's turns: no timing of a turns engine teaches the perf model
        assert learner.traffic[A][0] == 1 and learner.traffic[B][0] == 2          # their lengths still count
        prof = learner._profiles["llama3-8b-h100"]
        assert not prof.decode and not prof.prefill, (list(prof.decode), list(prof.prefill))
    # c: both switches, each the weights out and the other's in over the link (16 GB / 25 GB/s each way), plus,
    # with recompute_quota (level 1: the KV was dropped), the prefill estimate of each batch's tokens in flight
    weights = 2 * (16 / 25 + 16 / 25)
    assert weights + 0.001 < plan["switch_s"] < weights + 1.0, plan
    steps = plan["step_s"]
    assert all(0 < t < 0.1 for t in steps) and len(set(steps)) == 2     # the profile's decode steps, by batch size
    assert plan["quotas_s"] == pytest.approx(decode_quotas(steps, 0.1, plan["switch_s"], 1.0))
    assert all(0 < q < 1.0 for q in plan["quotas_s"])                     # eq. 3's alpha floor binds: not Q_MAX


async def test_a_model_alone_never_switches(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
    url_a, url_b = fleet.urls
    async with gateway(**_turns_host({A: url_a, B: url_b})) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=60)
        results = await asyncio.gather(*(_stream(oa, B, 400) for _ in range(3)))
        assert [(f, n) for _, f, n in results] == [("length", 400)] * 3
        assert results[0][0][-1] - results[0][0][0] > 3 * QUOTA_S      # longer than a quota, yet no switch
        async with httpx.AsyncClient() as c:
            text = (await c.get(gw.url + "/metrics")).text
        # B was asleep at start (max_awake 1): one switch to it, none after
        assert metric(text, "fleetgate_model_swaps_total", {"model": B, "direction": "in"}) == 1
        assert (metric(text, "fleetgate_model_swaps_total", {"model": A, "direction": "in"}) or 0) == 0
        assert httpx.get(url_b + "/is_sleeping").json()["is_sleeping"] is False


def test_turns_config() -> None:
    eng = {A: "http://127.0.0.1:9001", B: "http://127.0.0.1:9002"}
    with pytest.raises(ConfigError) as e:
        load_config(None, shared_hosts=[{"id": "g", "engines": eng, "scheduling": "turns"}])
    assert "shared_hosts[0].scheduling: turns needs a TBT target" in "\n".join(e.value.problems)
    with pytest.raises(ConfigError) as e:
        load_config(None, shared_hosts=[{"id": "g", "engines": eng, "scheduling": "tokens"}])
    assert "shared_hosts[0].scheduling" in "\n".join(e.value.problems)
    cfg = load_config(None, slo={"tpot_ms": 80}, shared_hosts=[{"id": "g", "engines": eng, "scheduling": "turns"}])
    h = cfg.shared_hosts[0]
    assert (h.q_max_s, cfg.turn_tbt_s(h)) == (Q_MAX_S, 0.08)
    cfg = load_config(None, slo={"tpot_ms": 80}, models={B: {"slo": {"tpot_ms": 40}}},
                      shared_hosts=[{"id": "g", "engines": eng, "scheduling": "turns"}])
    assert cfg.turn_tbt_s(cfg.shared_hosts[0]) == 0.04                     # the tightest of its models
    cfg = load_config(None, shared_hosts=[{"id": "g", "engines": eng, "scheduling": "turns", "tbt_ms": 50}])
    assert cfg.turn_tbt_s(cfg.shared_hosts[0]) == 0.05
    assert load_config(None, shared_hosts=[{"id": "g", "engines": eng}]).shared_hosts[0].scheduling == "request"
    # the stock quota (recomputation not counted) starves turns that drop the KV: refused with the reason
    with pytest.raises(ConfigError) as e:
        load_config(None, shared_hosts=[{"id": "g", "engines": eng, "scheduling": "turns", "tbt_ms": 50,
                                         "recompute_quota": False}])
    problems = "\n".join(e.value.problems)
    assert "shared_hosts[0].recompute_quota" in problems and "starve" in problems, problems


# --- the pure turn keeper ---------------------------------------------------------------------------------------
STEP = {A: 0.01, B: 0.02, C: 0.04}


def _step(model: str, n: int) -> float:
    return STEP[model]


def _cost(a: str, b: str) -> float:
    return 0.5


def test_keeper_quotas_follow_eq_2_3_and_rounds_go_round_robin() -> None:
    k = HostTurns("h", tbt_s=0.1, q_max_s=4.0)
    d = k.decide(0.0, {A: 2, B: 1, C: 3}, _step, _cost)
    assert d.new_turn and d.model is not None
    order = [d.model] + [t.model for t in k.pending]
    assert sorted(order) == [A, B, C]
    expect = dict(zip([A, B, C], decode_quotas([STEP[m] for m in (A, B, C)], 0.1, 3 * 0.5, 4.0), strict=True))
    assert d.quota_s == pytest.approx(expect[d.model])
    assert [t.quota_s for t in k.pending] == pytest.approx([expect[m] for m in order[1:]])
    assert k.last_round.switch_s == 1.5
    k.switched(1.0)                          # the switch took 1 s: the quota counts from then
    assert k.decide(1.0 + d.quota_s - 1e-3, {A: 2, B: 1, C: 3}, _step, _cost).model == order[0]
    now = 1.0 + d.quota_s
    seen = [order[0]]
    for _ in range(5):                       # the next turns: the round's order, then the next round the same
        d = k.decide(now, {A: 2, B: 1, C: 3}, _step, _cost)
        assert d.new_turn
        k.switched(now)
        seen.append(d.model)
        now += d.quota_s
    assert seen == order * 2
    assert k.rounds == 2


def test_keeper_ends_a_turn_early_skips_empty_batches_and_runs_a_lone_model_without_switching() -> None:
    k = HostTurns("h", tbt_s=0.1, q_max_s=4.0)
    d = k.decide(0.0, {A: 1}, _step, _cost)
    assert (d.model, d.quota_s, d.new_turn) == (A, None, True)          # alone: no quota
    k.switched(0.0)
    for t in (1.0, 10.0, 100.0):
        assert k.decide(t, {A: 3}, _step, _cost) == type(d)(A, None, False)   # never switches
    d = k.decide(101.0, {A: 3, B: 1, C: 1}, _step, _cost)
    # A ran alone for 101 s, longer than its turn's quota (counted from when it started): the newcomers go now,
    # A's turn was the round's first.
    assert d.model in (B, C) and d.quota_s is not None and d.new_turn
    assert k.order[0] == A and len(k.pending) == 1
    k.switched(101.5)                                                 # the switch took 0.5 s: the quota from then
    assert k.turn_end == pytest.approx(101.5 + d.quota_s)
    first, other = d.model, ({B, C} - {d.model}).pop()
    assert k.pending[0].model == other
    d = k.decide(101.6, {A: 3, B: 1, C: 1} | {first: 0}, _step, _cost)  # its work ended: its turn ends early
    assert d.model == other and d.new_turn
    k.switched(101.7)
    d = k.decide(101.8, {A: 3, B: 0, C: 0}, _step, _cost)             # other emptied too: A alone again
    assert (d.model, d.quota_s, d.new_turn) == (A, None, True)
    d = k.decide(101.9, {A: 0, B: 1, C: 1}, _step, _cost)
    assert d.model in (B, C) and d.new_turn
    other = ({B, C} - {d.model}).pop()
    k.switched(101.9)
    d = k.decide(102.0, {d.model: 0, other: 1}, _step, _cost)
    assert d.model == other
    k.switched(102.0)
    d = k.decide(102.1, {other: 1}, _step, _cost)                      # alone again: no round
    assert (d.model, d.quota_s, d.new_turn) == (other, None, False)
    assert k.decide(103.0, {}, _step, _cost).model == other            # no work: the last stays, no switch


def test_keeper_lets_a_model_just_switched_in_run_its_quota_before_newcomers() -> None:
    k = HostTurns("h", tbt_s=0.1, q_max_s=4.0)
    assert k.decide(0.0, {A: 1}, _step, _cost).model == A
    k.switched(0.6)                                                   # its switch took 0.6 s
    d = k.decide(0.7, {A: 1, B: 1}, _step, _cost)                      # B gets work 0.1 s later
    quota = k.last_round.quotas[k.order.index(A)]
    assert (d.model, d.new_turn) == (A, False) and k.order[0] == A      # A's run goes on as the round's first turn
    assert k.turn_end == pytest.approx(0.6 + quota)                     # its quota counted from when it started
    assert k.decide(0.6 + quota - 1e-3, {A: 1, B: 1}, _step, _cost).model == A
    d = k.decide(0.6 + quota, {A: 1, B: 1}, _step, _cost)
    assert (d.model, d.new_turn) == (B, True)


def test_keeper_new_work_joins_the_next_round() -> None:
    k = HostTurns("h", tbt_s=0.1, q_max_s=4.0)
    d = k.decide(0.0, {A: 1, B: 1}, _step, _cost)
    k.switched(0.0)
    first = d.model
    d2 = k.decide(d.quota_s, {A: 1, B: 1, C: 1}, _step, _cost)         # C arrives during the round
    assert d2.model != C and d2.model != first
    k.switched(d.quota_s)
    d3 = k.decide(d.quota_s + d2.quota_s, {A: 1, B: 1, C: 1}, _step, _cost)
    assert k.rounds == 2 and C in k.order                               # the next round has C
    assert d3.model == k.order[0]


async def test_engines_that_all_fit_are_only_paused_between_turns(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
    url_a, url_b = fleet.urls
    async with gateway(**_turns_host({A: url_a, B: url_b}, max_awake=2)) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=60)
        watch = _AwakeWatch(fleet)
        watcher = asyncio.create_task(watch.run())
        (ta, fa, na), (tb, fb, nb) = await asyncio.gather(_stream(oa, A, 300), _stream(oa, B, 300))
        watcher.cancel()
        assert (fa, na, fb, nb) == ("length", 300, "length", 300)
        assert watch.samples >= MIN_SAMPLES and watch.both == 0                # memory for both, yet one runs at a time
        assert len(_runs({A: ta, B: tb})) >= 4
        async with httpx.AsyncClient() as c:
            text = (await c.get(gw.url + "/metrics")).text
            host = (await c.get(gw.url + "/ui/status.json")).json()["shared_hosts"][0]
        # level 0: a pause, nothing moves. A switch is then two HTTP round trips, a wake from level 1 the profile's
        # wake_up_s (1 s, 0.5 s at time_scale 2): the measured switch stays below that on a loaded machine (0.11 s
        # seen, 0.19 s with a second test process), while a level-1 switch could not
        assert host["level"] == 0 and host["switch_s"] < 1.0 / 2, host
        paused = [metric(text, "fleetgate_engine_state", {"model": m, "state": "paused"}) for m in (A, B)]
        assert sorted(paused) == [0, 1], paused
        for url in (url_a, url_b):           # level 0 keeps the KV: nothing was recomputed after a wake-up
            assert httpx.get(url + "/sim/state").json()["stats"]["preemptions"] == 0


def test_a_pause_unanswered_is_decided_by_the_engines_own_sleep_state() -> None:
    assert pause_outcome(200, None) == PAUSED
    assert pause_outcome(500, None) == REFUSED and pause_outcome(400, True) == REFUSED   # it answered: it runs on
    assert pause_outcome(None, True) == PAUSED       # slow answer, yet asleep: the next engine may wake
    assert pause_outcome(None, False) == REFUSED     # alive and awake: waking the next would put two on the host
    assert pause_outcome(None, None) == LOST         # answers nothing at all: dead or hung, the next one wakes


async def test_a_slow_pause_is_not_taken_for_a_dead_engine(sim_fleet, make_client) -> None:
    """The first pause reaches its engine only after the driver stopped waiting for it (a loaded machine); the
    second is carried out at once but answered too late. Neither engine is taken for dead, and the next engine
    never wakes while the old one is awake: it is asked /is_sleeping first."""
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
    url_a, url_b = fleet.urls
    async with gateway(**_turns_host({A: url_a, B: url_b})) as gw:
        ctl = gw.gateway.pooling
        driver = ctl.turns["gpu0"]
        driver.pause_timeout_s = lambda model: 0.3
        real_post, faults, late = ctl.post_status, ["sleeps_late", "answers_late"], []

        async def post_status(url: str, timeout_s: float) -> int | None:
            if "/sleep" not in url or not faults:
                return await real_post(url, timeout_s)
            fault = faults.pop(0)
            if fault == "sleeps_late":      # the pause lands after the driver gave up on it, the engine awake till then
                late.append(asyncio.create_task(_later(timeout_s + 0.3, real_post(url, timeout_s))))
            else:                           # the engine pauses now; its answer comes after the driver gave up
                await real_post(url, timeout_s)
            await asyncio.sleep(timeout_s)
            return None

        ctl.post_status = post_status
        oa = make_client(gw.url, max_retries=0, timeout=60)
        watch = _AwakeWatch(fleet)
        watcher = asyncio.create_task(watch.run())
        (_, fa, na), (_, fb, nb) = await asyncio.gather(_stream(oa, A, 400), _stream(oa, B, 400))
        watcher.cancel()
        await asyncio.gather(*late)
        assert (fa, na, fb, nb) == ("length", 400, "length", 400)
        assert faults == [] and driver.switches >= 3
        assert watch.samples >= MIN_SAMPLES and watch.both == 0, (watch.both, watch.samples)
        assert driver.lost == set()
        for m in (A, B):
            ws = gw.gateway.registry.workers[f"gpu0:{m.replace('/', '_')}"]
            assert ws.healthy and ws.active, m


async def _later(delay_s: float, aw: Any) -> Any:
    await asyncio.sleep(delay_s)
    return await aw


async def test_a_dead_engine_on_a_turns_host_is_a_503_and_the_other_model_goes_on(sim_fleet, make_client) -> None:
    import openai

    fleet_a = sim_fleet(fleet={"servers": [{"model": A}]}, time_scale=2)
    fleet_b = sim_fleet(fleet={"servers": [{"model": B}]}, time_scale=2)
    async with gateway(**_turns_host({A: fleet_a.urls[0], B: fleet_b.urls[0]}), health={"interval_s": 30}) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=30)
        fleet_b.stop()
        t = time.monotonic()
        with pytest.raises(openai.APIStatusError) as exc:
            await oa.completions.create(model=B, prompt="hi", max_tokens=2)
        assert exc.value.status_code in (502, 503) and exc.value.body["message"]
        assert time.monotonic() - t < 10
        times, finish, n = await _stream(oa, A, 50)
        assert (finish, n) == ("length", 50)


POOL_REDIS_URL = "redis://127.0.0.1:6379/12"     # the pooling tests' Redis DB (test_pooling_live.py's too)


async def test_two_replicas_one_drives_the_turns(sim_fleet, make_client) -> None:
    with redis_prefix(POOL_REDIS_URL, "turns") as prefix:
        fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
        url_a, url_b = fleet.urls
        cfg = {**_turns_host({A: url_a, B: url_b}), "redis_url": POOL_REDIS_URL, "redis_key_prefix": prefix}
        async with gateway(**cfg, replica_id="r1") as g1, gateway(**cfg, replica_id="r2") as g2:
            watch = _AwakeWatch(fleet)
            watcher = asyncio.create_task(watch.run())
            c1, c2 = (make_client(g.url, max_retries=0, timeout=60) for g in (g1, g2))
            # A through one replica, B through the other: the driver sees both in the shared in-flight view
            (ta, fa, na), (tb, fb, nb) = await asyncio.gather(_stream(c1, A, 300), _stream(c2, B, 300))
            watcher.cancel()
            assert (fa, na, fb, nb) == ("length", 300, "length", 300)
            assert watch.samples >= MIN_SAMPLES and watch.both == 0
            assert len(_runs({A: ta, B: tb})) >= 4
            async with httpx.AsyncClient() as c:
                hosts = [(await c.get(g.url + "/ui/status.json")).json()["shared_hosts"][0] for g in (g1, g2)]
            assert sorted(h["driving"] for h in hosts) == [False, True]       # one replica drives the host
            assert [h["switches"] for h in hosts if not h["driving"]] == [0]


def test_a_vllm_without_level_0_is_paused_at_level_1() -> None:
    from engine_adapters.vllm.adapter import VllmAdapter

    a = VllmAdapter()
    assert a.sleep_path(0, "keep") == "/sleep?level=0&mode=keep"
    assert a.sleep_fallback(0, 400) == 1
    assert a.sleep_fallback(1, 400) is None and a.sleep_fallback(0, 500) is None


@pytest.mark.slow  # two gateway processes, one killed
async def test_when_the_driving_replica_dies_the_other_drives_within_seconds(sim_fleet, make_client, gateway_process,
                                                                              tmp_path) -> None:
    """The host lease is short (gateway/control/turns.py: max(3 s, 2 x the longest switch)), so when the replica driving
    the turns is killed (SIGKILL: it releases nothing) the other one takes the host over within seconds and the
    streams of both models, sent through the survivor, finish."""
    import signal

    import yaml
    with redis_prefix(POOL_REDIS_URL, "turns") as prefix:
        fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
        url_a, url_b = fleet.urls
        procs, urls = {}, {}
        for rid in ("r1", "r2"):
            cfg = tmp_path / f"{rid}.yaml"
            cfg.write_text(yaml.safe_dump({**_turns_host({A: url_a, B: url_b}), "redis_url": POOL_REDIS_URL,
                                           "redis_key_prefix": prefix, "replica_id": rid}))
            procs[rid] = gateway_process(cfg)
            urls[rid] = procs[rid].listening_url()

        async def hosts(c: httpx.AsyncClient, rids: list[str]) -> dict[str, dict]:
            return {rid: (await c.get(urls[rid] + "/ui/status.json")).json()["shared_hosts"][0] for rid in rids}

        async with httpx.AsyncClient(timeout=5) as c:
            driver = None
            for _ in range(100):
                driving = [rid for rid, h in (await hosts(c, ["r1", "r2"])).items() if h["driving"]]
                if len(driving) == 1:
                    driver = driving[0]
                    break
                await asyncio.sleep(0.1)
            assert driver is not None, "no single replica drives the host"
            other = "r2" if driver == "r1" else "r1"
            ttl = (await hosts(c, [driver]))[driver]["lease_ttl_s"]
            assert 0 < ttl <= 5.0, ttl

            oa = make_client(urls[other], max_retries=0, timeout=60)
            streams = asyncio.gather(_stream(oa, A, 300), _stream(oa, B, 300))
            await asyncio.sleep(1.0)                   # both streams under way, turns driven by `driver`
            procs[driver].proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            took = None
            while time.monotonic() - killed < 15:
                if (await hosts(c, [other]))[other]["driving"]:
                    took = time.monotonic() - killed
                    break
                await asyncio.sleep(0.1)
            assert took is not None and took <= ttl + 1.5, took   # within the lease TTL (plus a poll), not minutes
            (ta, fa, na), (tb, fb, nb) = await streams
            assert (fa, na, fb, nb) == ("length", 300, "length", 300)
            assert (await hosts(c, [other]))[other]["switches"] >= 1   # the survivor went on switching


async def test_a_stream_paused_between_turns_is_not_taken_for_a_hung_worker(sim_fleet, make_client) -> None:
    """Hung detection (policies/pace.py) with a gap bound far below a turn: a stream waiting out the other model's
    turn is silent longer than the bound, yet no worker is suspected and no stream breaks (turns engines are
    unpaced; the fixed timeouts still apply)."""
    fleet = sim_fleet(fleet={"servers": [{"model": A}, {"model": B}]}, time_scale=2)
    url_a, url_b = fleet.urls
    resume = {"gap_floor_s": 0.05, "cold_gap_s": 0.1, "first_token_floor_s": 0.05, "cold_first_token_s": 0.1}
    async with gateway(**_turns_host({A: url_a, B: url_b}), resume=resume) as gw:
        oa = make_client(gw.url, max_retries=0, timeout=60)
        (ta, fa, na), (tb, fb, nb) = await asyncio.gather(_stream(oa, A, 300), _stream(oa, B, 300))
        assert (fa, na, fb, nb) == ("length", 300, "length", 300)
        gaps = [b - a for ts in (ta, tb) for a, b in zip(ts, ts[1:], strict=False)]
        assert max(gaps) > 2 * resume["cold_gap_s"], max(gaps)     # silences longer than the pace allows
        async with httpx.AsyncClient() as c:
            text = (await c.get(gw.url + "/metrics")).text
        breaks = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("fleetgate_stream_breaks_total{"))
        assert breaks == 0, [line for line in text.splitlines() if line.startswith("fleetgate_stream_breaks")]
        ws = gw.gateway.registry.workers[f"gpu0:{A.replace('/', '_')}"]
        assert ws.healthy and ws.active
