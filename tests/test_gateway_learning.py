"""Online learning in the live gateway: performance models fitted from traffic, the output-length
predictor, and both shared between gateway processes through Redis; plus unit tests of the pieces."""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
import yaml

from engine_adapters.base import Usage
from gateway.config import ConfigError, load_config
from gateway.config.priors import profile_prior, scale_time
from gateway.pipeline.learning import MIN_DECODE_SHARE, _PrefillLog, _Trace, decode_share, merge_predictors
from gateway.server import GatewayServer
from gateway.wire.results import RelayResult
from policies.length_predictor import LengthPredictor
from policies.perf_model import PerfModel
from policies.types import RequestFeatures
from simulator.fleet import FleetProcess
from simulator.profiles import profile_yaml
from simulator.tokenizer import synthetic_text
from tests.helpers import MODEL, REDIS_URL, metric, poll, running_gateway, worker_entries

FAST = {"interval_s": 0.05, "refit_interval_s": 0.2, "refit_min_new": 8, "sync_interval_s": 0.2}


def true_model(profile: str = "llama3-8b-h100") -> PerfModel:
    """The simulator profile's coefficients in Aladdin's form (model seconds)."""
    return PerfModel.from_step_profile(profile_yaml(profile)[0])


def gateway(urls: list[str], profile: str, **cfg: Any) -> AbstractAsyncContextManager[GatewayServer]:
    return running_gateway(workers=worker_entries(urls, profile=profile), scrape_interval_s=0.1, **cfg)


async def send(http: httpx.AsyncClient, url: str, prompt_tokens: int, tokens: int, key: int, stream: bool = True) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": synthetic_text(prompt_tokens, key)}],
            "max_tokens": tokens + 50, "stream": stream}
    async with http.stream("POST", url + "/v1/chat/completions", json=body,
                           headers={"x-sim-output-tokens": str(tokens)}) as r:
        await r.aread()
        assert r.status_code == 200, r.text


async def poll_metrics(http: httpx.AsyncClient, url: str, ready, timeout: float = 15.0) -> str:  # noqa: ANN001
    """GET /metrics until `ready(text)` holds; the text."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await http.get(url + "/metrics")).text
        if ready(text):
            return text
        assert time.monotonic() < deadline, "metrics never got there:\n" + "\n".join(
            line for line in text.splitlines() if "perf_model" in line or "output_length" in line)
        await asyncio.sleep(0.05)


def coef(text: str, profile: str, name: str) -> float | None:
    return metric(text, "fleetgate_perf_model_coefficient", {"profile": profile, "name": name})


# --- through the gateway -----------------------------------------------------------------------------
async def test_fitted_coefficients_appear_and_move_toward_the_simulators(tmp_path) -> None:
    """The learner fits TTFTs and inter-token times seen from the gateway, which hold the host's own delays
    (gateway and simulator event loops, loopback): 10-100 ms per request with two busy cores. The fleet runs at the
    profile's own speed (a 2048-token prefill takes 70 ms, a decode step 7 ms) on prompts up to 8192 tokens, so the
    prefill slope spans 250 ms and stands out of that delay; at 5x speed (14 ms per 2048 tokens) it did not, and k1
    came out 0.5-2.7x the truth with the same traffic."""
    k = 1.0  # model seconds per wall second: true wall-time coefficients are the profile's / k
    truth = true_model()
    wrong = {"k1": 3 * truth.k1, "c1": 3 * truth.c1, "k2": 3 * truth.k2, "c2": 3 * truth.c2, "c3": 3 * truth.c3}
    rng = random.Random(7)
    with FleetProcess(2, time_scale=k) as fleet:  # own process: the simulator's timing is not ours
        async with gateway(fleet.urls, "mystery", learning={**FAST, "time_scale": k, "priors": {"mystery": wrong}}) as gw, \
                httpx.AsyncClient(timeout=60) as http:
            text = (await http.get(gw.url + "/metrics")).text
            prior = {n: coef(text, "mystery", n) for n in ("k1", "c1", "k2", "c2", "c3")}
            assert prior["c3"] == pytest.approx(wrong["c3"] / k)  # the declared prior, in wall seconds
            sem = asyncio.Semaphore(4)

            async def one(i: int) -> None:
                async with sem:
                    await send(http, gw.url, rng.choice([64, 256, 512, 1024, 2048, 4096, 8192]), 24, i)

            def enough(t: str) -> bool:
                return all((metric(t, "fleetgate_perf_model_samples", {"profile": "mystery", "phase": phase}) or 0)
                           >= 40 for phase in ("prefill", "decode"))

            await asyncio.gather(*(one(i) for i in range(60)))
            # Decode samples come from the scrapes that catch requests decoding, so how many 60 requests yield
            # depends on how fast a loaded machine runs (22 once): send on, 8 at a time, until both fits have the
            # 40 samples checked below.
            sent = 60
            while not enough(text := (await http.get(gw.url + "/metrics")).text) and sent < 600:
                await asyncio.gather(*(one(i) for i in range(sent, sent + 8)))
                sent += 8
    fit = {n: coef(text, "mystery", n) for n in ("k1", "c1", "k2", "c2", "c3")}
    assert metric(text, "fleetgate_perf_model_samples", {"profile": "mystery", "phase": "decode"}) >= 40
    assert metric(text, "fleetgate_perf_model_fit_error", {"profile": "mystery", "phase": "decode"}) is not None
    for n in ("h", "kv_capacity", "p1", "p8"):
        assert coef(text, "mystery", n) is not None
    assert coef(text, "mystery", "kv_capacity") == 27255  # from the workers' scraped cache_config_info

    def step(m: dict, ctx: float = 700.0) -> float:  # one decode step of one request (eq. 3, b = 1)
        return m["k2"] * ctx + m["c2"] + m["c3"]

    def err(m: dict, scale: float) -> tuple[float, float]:
        t = vars_of(truth)
        return abs(m["k1"] * scale - t["k1"]), abs(step(m) * scale - step(t))

    # The prefill slope and the decode step moved (most of the way) from the 3x-wrong prior to the truth.
    (k1_fit, step_fit), (k1_prior, step_prior) = err(fit, k), err(prior, k)
    assert k1_fit < 0.6 * k1_prior, (fit, prior)
    assert step_fit < 0.6 * step_prior, (fit, prior)
    # The per-request term holds the host's delay besides the engine's: never below the truth (delays only add),
    # 15-30 ms above it with two busy cores (load 7-9), bounded here by 0.15 s.
    assert truth.c1 / k <= fit["c1"] <= truth.c1 / k + 0.15, (fit, prior)


def vars_of(m: PerfModel) -> dict[str, float]:
    return {n: getattr(m, n) for n in ("k1", "c1", "k2", "c2", "c3")}


async def test_predictor_learns_a_fixed_output_length(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=50)
    async with gateway(fleet.urls, "llama3-8b-h100", learning=FAST) as gw, httpx.AsyncClient(timeout=30) as http:
        name = "fleetgate_output_length_prediction_tokens"
        labels = {"model": MODEL, "bucket": "512-1023"}
        assert metric((await http.get(gw.url + "/metrics")).text, name, labels) is None
        for i in range(12):  # streamed and whole answers alike
            await send(http, gw.url, 600, 37, i, stream=i % 2 == 0)
        text = await poll_metrics(http, gw.url, lambda t: metric(t, name, labels) is not None)
    assert metric(text, name, labels) == pytest.approx(37.0)
    # the model-wide mean pulls an unseen bucket the same way (bucket means shrink to it)
    assert gw.gateway.learner.predict(MODEL, 10, None) == pytest.approx(37.0)
    assert gw.gateway.learner.predict(MODEL, 600, 20) == 20.0  # max_tokens bounds it


@pytest.mark.redis
@pytest.mark.slow
async def test_two_gateway_processes_share_fitted_models_through_redis(sim_fleet, redis_prefix, tmp_path,
                                                                       gateway_process) -> None:
    fleet = sim_fleet(1, time_scale=20)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "workers": [{"id": "w0", "url": fleet.urls[0], "profile": "llama3-8b-h100"}],
        "redis_key_prefix": redis_prefix, "scrape_interval_s": 0.1, "health": {"interval_s": 0.5},
        "learning": {**FAST, "time_scale": 20.0},
    }))
    procs = [gateway_process(cfg, "--redis-url", REDIS_URL) for _ in range(2)]  # both start at once
    a, b = (p.listening_url() for p in procs)
    async with httpx.AsyncClient(timeout=60) as http:
        before = coef((await http.get(b + "/metrics")).text, "llama3-8b-h100", "c3")
        for i in range(24):  # traffic through A only
            await send(http, a, 256 + 64 * (i % 8), 12, i)  # above the prefill floor (perf_model pf)
        await poll_metrics(http, a, lambda t: (metric(
            t, "fleetgate_perf_model_samples", {"profile": "llama3-8b-h100", "phase": "prefill"}) or 0) >= 16)

        async def same_fit() -> tuple[float, str] | None:
            text_a, text_b = (await http.get(a + "/metrics")).text, (await http.get(b + "/metrics")).text
            fitted = coef(text_a, "llama3-8b-h100", "c3")
            lengths = metric(text_b, "fleetgate_output_length_prediction_tokens", {"model": MODEL})
            # the fit and the length predictor are published separately: wait for both to reach B
            return (fitted, text_b) if coef(text_b, "llama3-8b-h100", "c3") == fitted and lengths else None

        # B never saw a request, yet adopts A's fit and A's output lengths from the shared store.
        fitted, text_b = await poll(same_fit, 15, "B to adopt A's fitted model and output lengths")
        assert fitted != before
        assert metric(text_b, "fleetgate_output_length_prediction_tokens", {"model": MODEL}) == pytest.approx(12.0)
        # A gateway started now loads the shared models at start, before its first request.
        c = gateway_process(cfg, "--redis-url", REDIS_URL).listening_url()
        fitted = coef((await http.get(a + "/metrics")).text, "llama3-8b-h100", "c3")
        assert coef((await http.get(c + "/metrics")).text, "llama3-8b-h100", "c3") == fitted


# --- units ----------------------------------------------------------------------------------------------
def test_priors_come_from_config_then_simulator_profiles_then_defaults(tmp_path) -> None:
    assert profile_prior("llama3-8b-h100", {}).c3 == pytest.approx(true_model().c3)
    assert profile_prior("llama3-8b-h100", {}, time_scale=10).c3 == pytest.approx(true_model().c3 / 10)
    assert profile_prior("custom", {"custom": {"k1": 1e-4, "max_batch": 8}}).max_batch == 8
    step_like = profile_yaml("llama2-13b-a100")[0]
    assert profile_prior("x", {"x": step_like}).k2 == pytest.approx(true_model("llama2-13b-a100").k2)
    assert profile_prior("no-such-profile", {}).c3 == PerfModel().c3
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump(profile_yaml("llama3-8b-a100")[0]))
    assert profile_prior(str(own), {}).c3 == pytest.approx(true_model("llama3-8b-a100").c3)
    broken = tmp_path / "broken.yaml"
    broken.write_text("c_step_s: [")
    assert profile_prior(str(broken), {}).c3 == PerfModel().c3
    m = scale_time(PerfModel(p=(1, 2, 3, 4, 5, 6, 7, 8)), 2.0)
    assert (m.k1, m.c3, m.p[7], m.h, m.kv_capacity) == (PerfModel().k1 / 2, PerfModel().c3 / 2, 4.0, 1 / 16, 3682.0)


def test_a_bad_prior_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, learning={"priors": {"gpu": {"k1": -1.0}}})
    assert "learning.priors" in str(e.value) and "k1" in str(e.value)


def test_merged_predictor_equals_one_that_saw_everything() -> None:
    rng = random.Random(3)
    parts = [LengthPredictor(), LengthPredictor()]
    whole = LengthPredictor()
    for i in range(400):
        prompt, out = rng.randint(1, 3000), rng.randint(1, 900)
        parts[i % 2].observe("m", prompt, out)
        whole.observe("m", prompt, out)
    merged = LengthPredictor.from_dict(merge_predictors([p.to_dict() for p in parts]))
    for prompt in (5, 100, 1000, 2500):
        assert merged.predict("m", prompt) == pytest.approx(whole.predict("m", prompt))
        assert merged.predict_std("m", prompt) == pytest.approx(whole.predict_std("m", prompt))
    assert merged.count("m") == 400


def test_trace_averages_the_scraped_batch_over_an_interval() -> None:
    tr = _Trace()
    assert tr.average(0.0, 1.0) is None
    tr.add(0.0, 2.0)   # 2 running from t=0
    tr.add(1.0, 4.0)   # 4 running from t=1
    assert tr.average(0.5, 2.0) == pytest.approx((0.5 * 2 + 1.0 * 4) / 1.5)   # 0.5 s at 2, 1 s at 4
    assert tr.average(-1.0, 2.0) is None  # before the first sample: unknown


def test_a_decode_observation_keeps_only_the_share_of_its_time_the_worker_spent_decoding() -> None:
    """The engine's prompt tokens computed (prefix-cache queried less hit, a counter) over a stream's decode: at
    k1 = 1 ms a token, 300 tokens a second took 30% of the worker's time, so 70% of the stream's ATGT is eq. 3's
    decode step (the admission rule stretches that step again by the prefill rate it expects)."""
    model = PerfModel(k1=1e-3)
    tr = _Trace()
    assert decode_share(model, tr, 0.0, 1.0) == 1.0                  # no scrapes yet
    for t, computed in ((0.0, 1000.0), (1.0, 1300.0), (2.0, 1600.0), (3.0, 1900.0)):
        tr.add(t, 10.0, computed)
    assert tr.prefilled_between(0.5, 2.5) == pytest.approx(600.0)     # linear between scrapes
    assert decode_share(model, tr, 0.5, 2.5) == pytest.approx(0.7)
    assert decode_share(model, tr, 0.5, 3.5) == 1.0                  # past the last scrape: not known
    tr.add(4.0, 10.0, 50.0)                                           # the engine restarted: its counters too
    assert tr.prefilled_between(3.0, 4.0) == pytest.approx(50.0)
    assert decode_share(PerfModel(k1=1.0), tr, 0.5, 2.5) == MIN_DECODE_SHARE   # never below the floor
    quiet = _Trace()                                                  # an engine without prefix-cache counters
    quiet.add(0.0, 10.0, 0.0)
    quiet.add(1.0, 10.0, 0.0)
    assert decode_share(model, quiet, 0.0, 1.0) == 1.0


def test_prefill_log_counts_prompts_prefilled_while_a_request_waited() -> None:
    log = _PrefillLog()
    log.add(1.0, 0.0, 100.0)    # A: sent 0.0, first token 1.0
    log.add(1.5, 0.2, 300.0)    # B: sent 0.2, first token 1.5 (prefilled after A)
    log.add(3.0, 2.0, 50.0)     # C: sent after B's first token
    log.add(1.2, 1.1, 70.0)     # D: sent after B yet prefilled before it (one chunked-prefill step)
    assert log.others_between(0.2, 1.5) == (100.0 + 70.0, 100.0**2 + 70.0**2)  # A's and D's prefills fell in B's wait
    assert log.others_between(0.0, 1.0) == (0.0, 0.0)     # A waited for nobody
    assert log.others_between(2.0, 3.0) == (0.0, 0.0)


def test_prefill_log_takes_the_quadratic_work_of_a_partly_cached_prompt() -> None:
    log = _PrefillLog()
    log.add(1.0, 0.0, 100.0, 1000.0**2 - 900.0**2)   # A: 1,000-token prompt, 900 of them cached
    log.add(1.5, 0.2, 300.0)                          # B: nothing cached
    assert log.others_between(0.2, 1.5) == (100.0, 1000.0**2 - 900.0**2)


async def test_a_cached_prefix_is_not_fitted_as_prefill_work(sim_fleet) -> None:
    """With a KV-event view the worker's cached prefix is known at placement: the prefill observation is the
    uncached part (linear and attention terms), so cache hits neither look like a fast GPU nor, when the policy
    prices the cache, get discounted twice (the learner fitted the whole prompt before)."""
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls, "llama3-8b-h100", learning=FAST) as gw:
        learner = gw.gateway.learner
        for p in learner._profiles.values():   # noqa: SLF001 - observe exactly the two requests below
            p.prefill.clear()
        t0 = time.perf_counter()
        for rid, cached in (("hit", {"w0": 896}), ("miss", {})):
            feats = RequestFeatures(request_id=rid, model=MODEL, prompt_tokens=1000, cached_prefix_tokens=cached)
            result = RelayResult(status=200, usage=Usage(prompt_tokens=1000, completion_tokens=8), tokens=8,
                                 first_token_at=t0 + 0.5, last_token_at=t0 + 0.6)
            assert learner.answered(feats, "w0", t0, result) == 8
            t0 += 10.0   # far apart: neither shared the other's prefill
        learner._ingest()   # noqa: SLF001
        learner._settle_prefills()   # noqa: SLF001
        rows = sorted(tuple(r) for p in learner._profiles.values() for r in p.prefill)   # noqa: SLF001
        assert rows == [(104.0, 1000.0**2 - 896.0**2, pytest.approx(0.5)), (1000.0, 1000.0**2, pytest.approx(0.5))]


async def test_a_decode_observation_waits_for_a_scrape_after_its_last_token_and_reads_its_own_context(
        sim_fleet) -> None:
    """A stream's decode sample: the mean batch over its decode, its own mean context (prompt + half its output:
    what the ledger predicts with; a shared prefix the engine holds once is still read by every decode) and its
    ATGT less the share of the time the worker computed prompts meanwhile. It waits for the worker's next scrape
    when none came after its last token."""
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls, "llama3-8b-h100", learning={**FAST, "interval_s": 3600.0}) as gw:
        learner = gw.gateway.learner
        for p in learner._profiles.values():   # noqa: SLF001 - observe exactly the request below
            p.decode.clear()
        prof = next(iter(learner._profiles.values()))   # noqa: SLF001
        k1 = prof.model.k1
        tr = _Trace()
        learner._traces["w0"] = tr   # noqa: SLF001
        t0 = time.perf_counter() - 12.0              # its last token 1 s ago
        tr.add(t0, 4.0, 0.0)
        tr.add(t0 + 10.0, 4.0, 0.25 / k1 * 10.0)     # a quarter of the time on prompts
        feats = RequestFeatures(request_id="r", model=MODEL, prompt_tokens=2000)
        result = RelayResult(status=200, usage=Usage(prompt_tokens=2000, completion_tokens=101), tokens=101,
                             first_token_at=t0 + 1.0, last_token_at=t0 + 11.0)
        assert learner.answered(feats, "w0", t0, result) == 101
        learner._ingest()   # noqa: SLF001
        learner._settle_decodes()   # noqa: SLF001
        assert not prof.decode                        # the last scrape is before its last token: it waits
        tr.add(t0 + 12.0, 4.0, 0.25 / k1 * 12.0)
        learner._settle_decodes()   # noqa: SLF001
        assert list(prof.decode) == [(pytest.approx(4.0), 2050.5, pytest.approx(0.1 * 0.75))]
