"""The `aladdin` policy: each constraint on hand-computed cases, best-fit packing, no_fit and the shortfall,
tail mode, re-prediction (appendix C), the ledger's bookkeeping and Algorithm 2's rebalancing."""

from __future__ import annotations

import pytest

from policies.aladdin import (
    C_ATGT,
    C_KV,
    C_SLACK,
    C_TTFT,
    AladdinPolicy,
    Move,
    WorkerError,
    error_distance,
    propose_moves,
)
from policies.aladdin.rebalancing import (
    MoveBudget,
    observed_error,
    observed_ratio,
    slow_workers,
    still_queued,
)
from policies.base import make_policy, policy_names
from policies.length_predictor import LengthPredictor
from policies.perf_model import PerfModel
from policies.slo_targets import SloAttainment, SloTarget, atgt, check_slo, target_for
from policies.tail import cantelli_factor, normal_factor, split_budget, tail_factor
from policies.types import RequestFeatures, WorkerView

# eq. 4 with T = 30 ms: l_d(b) = (0.03 − 0.001·b − 0.01) / 1e-6 = 20 000 − 1000·b tokens.
SIMPLE = PerfModel(k1=1e-5, c1=0.001, k2=1e-6, c2=1e-3, c3=0.01, h=1 / 16, j=1, kv_capacity=1e5, max_batch=256)
# Decode step ≈ 10 ms whatever the batch; prefill 1 ms per token; KV: 1 block per token.
CLOCK = PerfModel(k1=1e-3, c1=0.0, k2=1e-9, c2=0.0, c3=0.01, h=1.0, j=0.0, kv_capacity=1e6, max_batch=256)


def req(i: int | str, l_in: int = 100, lp: float = 100, **kw) -> RequestFeatures:
    return RequestFeatures(request_id=f"r{i}", model="m", prompt_tokens=l_in, predicted_output_tokens=lp, **kw)


def views(n: int, profile: str = "p", **kw) -> list[WorkerView]:
    return [WorkerView(id=f"w{i}", profile=profile, **kw) for i in range(n)]


def policy(model: PerfModel = SIMPLE, **kw) -> AladdinPolicy:
    """Algorithm 1 as printed (fit: best) unless a test asks for another rule."""
    kw.setdefault("theta", 1.0)
    kw.setdefault("fit", "best")
    return AladdinPolicy(perf_models={"p": model}, **kw)


def place(p: AladdinPolicy, r: RequestFeatures, ws: list[WorkerView], now: float) -> str | None:
    d = p.choose(r, ws, now)
    if d.worker_id is not None:
        p.on_dispatch(r, d.worker_id, now)
    return d.worker_id


def fill_count(p: AladdinPolicy, ws: list[WorkerView], limit: int = 100, **kw) -> int:
    """How many identical requests one worker takes at t = 0 before the first no_fit."""
    for i in range(limit):
        if place(p, req(i, **kw), ws, 0.0) is None:
            return i
    return limit


# --- registration and parameters --------------------------------------------------------------------
def test_registered_with_defaults_and_parameters():
    assert {"aladdin", "hetero"} <= set(policy_names())
    p = make_policy("aladdin")
    assert isinstance(p, AladdinPolicy) and p.slo.ttft_s == 0.6 and p.slo.atgt_s == 0.03
    d = p.choose(req(0), [WorkerView(id="a")], 0.0)  # unknown profile: the default prior
    assert d.worker_id == "a"
    q = make_policy("aladdin", perf_models={"p": {"k1": 2e-4, "num_gpu_blocks": 100}}, gamma=0.3, theta=0.7,
                    tail="cantelli", delta=0.1)
    assert q.model_for("p").kv_capacity == 100 and q.tail == "cantelli" and q.gamma == 0.3
    for bad in ({"gamma": 1.5}, {"theta": 0}, {"tail": "gauss"}, {"delta": 1.0}, {"slack": "x"}):
        with pytest.raises(ValueError):
            make_policy("aladdin", **bad)
    assert p.choose(req(1), [], 0.0) == type(d)(None, "no_workers")


# --- (b) ATGT via eq. 4 -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gamma", "theta", "expected"),
    [
        # b·(100 + γ·100) <= θ·(20 000 − 1000·b): largest integer b
        (0.5, 1.0, 17),   # 150b <= 20 000 − 1000b   -> b <= 17.39
        (0.5, 0.5, 15),   # 150b <= 10 000 − 500b    -> b <= 15.38
        (1.0, 1.0, 16),   # 200b <= 20 000 − 1000b   -> b <= 16.67
        (0.0, 1.0, 18),   # 100b <= 20 000 − 1000b   -> b <= 18.18
    ],
)
def test_atgt_constraint_by_hand(gamma, theta, expected):
    p = policy(gamma=gamma, theta=theta)
    ws = views(1)
    assert fill_count(p, ws) == expected
    assert p.last_rejections[C_ATGT] == 1


def test_per_request_atgt_slo_and_strictest_request_rules():
    # T = 15 ms: l_d(b) = 5000 − 1000b; 150b <= 5000 − 1000b -> 4 requests.
    p = policy()
    assert fill_count(p, views(1), slo_tpot_s=0.015) == 4
    # Ten loose requests on a worker: a strict one does not fit (l_d(11) at 15 ms is negative)...
    p = policy()
    ws = views(1)
    for i in range(10):
        assert place(p, req(i), ws, 0.0) == "w0"
    assert place(p, req("strict", slo_tpot_s=0.015), ws, 0.0) is None
    # ...and four strict ones keep a loose newcomer out: the batch must stay within the strictest SLO.
    p = policy()
    for i in range(4):
        assert place(p, req(i, slo_tpot_s=0.015), ws, 0.0) == "w0"
    assert place(p, req("loose"), ws, 0.0) is None


def test_engine_reported_load_counts_against_atgt():
    p = policy()
    # 16 running requests the ledger does not know (another replica's): 17th fits, with 17 it does not.
    assert p.choose(req(0), views(1, running=16), 0.0).worker_id == "w0"
    assert p.choose(req(0), views(1, running=17), 0.0).worker_id is None



# --- cache pricing (price_cache: only the uncached prompt is prefill work) -------------------------------
def test_cache_pricing_is_on_by_default_and_asks_for_the_kv_view():
    assert AladdinPolicy().needs_kv_blocks is True      # chats are half cached prompt tokens
    assert make_policy("aladdin", price_cache=False).needs_kv_blocks is False


def test_cache_pricing_counts_only_uncached_prefill_in_ttft_and_the_queue():
    ws = views(2)
    hit = {"w1": 500}                       # w1's prefix cache holds 500 of the prompt's 700 tokens
    plain = policy(CLOCK, slack="off", price_cache=False)      # 1 ms per prompt token, TTFT target 0.6 s
    # Without pricing (the view ignored even when given): 0.7 s everywhere, nobody fits.
    assert plain.choose(req(0, l_in=700, cached_prefix_tokens=hit), ws, 0.0).reason == "best_effort"
    priced = policy(CLOCK, slack="off", price_cache=True)
    # With it: 0.2 s on w1, 0.7 s on w0, so w1, whichever way the fit rule ranks the two.
    assert place(priced, req(0, l_in=700, cached_prefix_tokens=hit), ws, 0.0) == "w1"
    assert priced.worker_load("w1")["pending_prefill_tokens"] == pytest.approx(200)
    # A second hit queues behind 200 tokens, not 700: 0.4 s on w1, still within the TTFT.
    assert place(priced, req(1, l_in=700, cached_prefix_tokens=hit), ws, 0.0) == "w1"
    # A miss of 500 tokens: w1 would take 0.4 + 0.5 s, w0 is idle (0.5 s): w0.
    assert place(priced, req(2, l_in=500), ws, 0.0) == "w0"
    # A view larger than the prompt is clamped to it (a stale or foreign index must not make work negative).
    over = policy(CLOCK, slack="off", price_cache=True)
    assert place(over, req(3, l_in=100, cached_prefix_tokens={"w0": 10_000}), ws, 0.0) == "w0"
    assert over.worker_load("w0")["pending_prefill_tokens"] == pytest.approx(0)


def test_without_kv_events_a_turn_is_priced_where_its_conversation_ran():
    """No KV-event view: the conversation's last turn left its prompt and answer in that worker's prefix cache
    (policies/aladdin/affinity.py), so the next turn's prefill there is only the new part; elsewhere, the whole."""
    ws = views(2)
    p = policy(CLOCK, slack="off")                  # 1 ms per prompt token, TTFT target 0.6 s
    first = req("t0", l_in=300, session_id="c1")
    w = place(p, first, ws, 0.0)
    p.observe_completion(first, 100, 1.0)
    p.on_complete(first, w, 1.0)
    # 900 tokens: 0.9 s anywhere uncached; on w the conversation's 400 are cached, 0.5 s: w.
    second = req("t1", l_in=900, session_id="c1")
    assert p.constraints.prefix_view(second) == {w: 400}
    assert place(p, second, ws, 2.0) == w
    assert p.worker_load(w)["pending_prefill_tokens"] == pytest.approx(500)
    # Another conversation of the same length has nothing cached: no worker meets its TTFT.
    assert p.choose(req("u0", l_in=900, session_id="c2"), ws, 2.0).reason == "best_effort"
    # A KV-event view, where the caller has one, is the truth (here: nothing cached): no guess.
    assert p.constraints.prefix_view(req("t2", l_in=900, session_id="c1", cached_prefix_tokens={})) == {}
    assert policy(CLOCK, price_cache=False).constraints.sessions is None


# --- (c) TTFT via eq. 2 -----------------------------------------------------------------------------
def test_ttft_constraint_by_hand():
    p = policy(CLOCK, slack="off")
    ws = views(1)
    # 0.601 s > 0.6 s even on an empty worker: waiting cannot help, so a best effort.
    assert p.choose(req(0, l_in=601), ws, 0.0).reason == "best_effort"
    assert p.last_rejections[C_TTFT] == 1
    assert p.choose(req(0, l_in=601, slo_ttft_s=1.0), ws, 0.0).worker_id == "w0"  # its own SLO
    assert place(p, req(1, l_in=500), ws, 0.0) == "w0"                 # 0.5 s
    # Queued behind 500 prefill tokens: 1 ms × (500 + 200) = 0.7 s > 0.6 s.
    assert p.choose(req(2, l_in=200), ws, 0.0).reason == "no_fit"
    assert p.last_rejections[C_TTFT] == 1
    # 0.4 s later 400 of them are done: 1 ms × (100 + 200) = 0.3 s.
    assert p.choose(req(2, l_in=200), ws, 0.4).worker_id == "w0"
    assert p.worker_load("w0")["pending_prefill_tokens"] == pytest.approx(100)


# --- (d) prefill against the slack of ongoing decodes --------------------------------------------
def test_prefill_slack_constraint_by_hand():
    ws = views(1)
    for mode, fits, too_big in (("paper", 400, 450), ("lifetime", 3900, 4100)):
        p = policy(CLOCK, slack=mode)
        assert place(p, req(0, l_in=100, lp=200), ws, 0.0) == "w0"
        # Prefill of r0 ends at 0.1 s; then 10 ms steps: at 0.3 s it has 21 tokens, 0.2 s of decoding.
        # paper: slack = T·l_out − t_dec = 0.03·21 − 0.2 = 0.43 s.
        # lifetime: + (199 − 20) remaining steps × (30 − 10) ms = 3.58 s -> 4.01 s.
        big_ttft = {"slo_ttft_s": 10.0}
        assert p.choose(req(1, l_in=fits, **big_ttft), ws, 0.3).worker_id == "w0", mode
        assert p.choose(req(2, l_in=too_big, **big_ttft), ws, 0.3).worker_id is None, mode
        assert p.last_rejections[C_SLACK] == 1
        assert p.generated("r0") == pytest.approx(21, abs=0.01)
    # Without (d) the large prompt is placed.
    p = policy(CLOCK, slack="off")
    place(p, req(0, l_in=100, lp=200), ws, 0.0)
    assert p.choose(req(2, l_in=4100, slo_ttft_s=10.0), ws, 0.3).worker_id == "w0"


# --- (e) KV over the request's predicted lifetime (the vector w) -----------------------------------
@pytest.mark.parametrize(("capacity", "fits"), [(1000, True), (999, False)])
def test_kv_constraint_by_hand(capacity, fits):
    model = PerfModel(k1=1e-6, c1=0.0, k2=1e-9, c2=0.0, c3=0.01, h=1.0, j=0.0, kv_capacity=capacity)
    p = policy(model, bucket_steps=1)
    ws = views(1)
    assert place(p, req(0, l_in=400, lp=300), ws, 0.0) == "w0"
    # kv(g) = l_in + g + 1 while alive; peak at g = 199 (the new request's last step): 600 + 400 = 1000.
    assert (p.choose(req(1, l_in=200, lp=200), ws, 0.0).worker_id == "w0") is fits
    if not fits:
        assert p.last_rejections[C_KV] == 1


def test_kv_profile_uses_time_not_final_sizes():
    model = PerfModel(k1=1e-6, c1=0.0, k2=1e-9, c2=0.0, c3=0.01, h=1.0, j=0.0, kv_capacity=1000)
    p = policy(model, bucket_steps=1)
    ws = views(1)
    place(p, req(0, l_in=400, lp=100), ws, 0.0)  # ends at step 99 holding 500
    # Final sizes add up to 500 + 700 > 1000, but r0 is gone before the newcomer peaks: max is 800.
    assert p.choose(req(1, l_in=200, lp=500), ws, 0.0).worker_id == "w0"
    # The engine reporting 90 % in use (traffic the ledger does not see) closes the worker.
    assert p.choose(req(1, l_in=200, lp=500), views(1, kv_usage=0.9), 0.0).worker_id is None


def test_engine_kv_report_takes_shared_prefix_blocks_off_the_ledger_but_not_later_placements():
    """The ledger counts each request's whole context; the engine holds a prefix that running requests
    share once. Its report corrects the ledger down as well as up, compared with the ledger's level when the
    report was first seen, so requests placed after that report still count in full."""
    model = PerfModel(k1=1e-6, c1=0.0, k2=1e-9, c2=0.0, c3=0.01, h=1.0, j=0.0, kv_capacity=1000)
    p = policy(model, bucket_steps=1)
    assert place(p, req(0, l_in=400, lp=100), views(1), 0.0) == "w0"
    # Ledger alone: 401 + 601 now, 500 + 700 at the end: no room (an unscraped engine, kv_usage 0, changes nothing).
    assert p.choose(req(1, l_in=600, lp=100), views(1), 0.0).worker_id is None
    # The engine holds 200 blocks where the ledger counts 401 (a shared prefix): 1200 - 201 fits.
    shared = views(1, kv_usage=0.2)
    assert place(p, req(1, l_in=600, lp=100), shared, 0.0) == "w0"
    # The same (stale) report: r1 is not in it, so it counts whole. 410 + 610 + 310 - 201 > 1000.
    assert p.choose(req(2, l_in=300, lp=10), shared, 0.0).worker_id is None
    assert p.last_rejections[C_KV] == 1


def test_prefill_chunk_follows_the_engine_and_d_stalls_by_the_chunk_compute_only():
    """(c) counts the decodes batched with each prefill chunk of the worker's own engine (PerfModel.chunk_tokens,
    vLLM's max_num_batched_tokens); (d)'s stall is k1 per prefill token, c1 (server overhead) stalls no decode."""
    prof = {"c_step_s": 0.002, "t_weights_s": 0.005, "c_decode_s": 2e-5, "max_num_seqs": 256, "k_prefill_s": 2e-5,
            "k_ctx_s": 4e-8, "num_gpu_blocks": 1000, "max_num_batched_tokens": 8192}
    m = PerfModel.from_step_profile(prof)
    assert m.chunk_tokens == 8192 and PerfModel.from_dict(m.to_dict()).chunk_tokens == 8192
    assert PerfModel.from_prior(prof).chunk_tokens == 8192 and PerfModel().chunk_tokens == 0
    for pol, chunk in ((policy(m), 8192), (policy(SIMPLE, prefill_chunk_tokens=512), 512)):   # model silent: the knob
        assert pol.constraints.chunks(pol.ledger.rows_for_views(views(1)))[0] == chunk
    # (d) as printed: a decode that saved 0.55 s of slack. The new prompt's chunks stall it 0.1 s; its 0.5 s of
    # server overhead stalls no decode, so it fits (eq. 2 whole, 0.6 s, would not).
    slow_api = PerfModel(k1=1e-3, c1=0.5, k2=1e-9, c2=0.0, c3=0.01, h=1 / 16, j=1, kv_capacity=1e6, max_batch=256)
    p = policy(slow_api, slack="paper", slo_ttft_s=10.0, slo_atgt_s=0.1)
    assert place(p, req(0, l_in=10, lp=1000), views(1), 0.0) == "w0"
    p.report_progress("r0", 1, 0.01)
    assert place(p, req(1, l_in=100, lp=10), views(1), 0.06) == "w0"


# --- best fit: packing, no_fit, shortfall -------------------------------------------------------------
def test_packs_one_worker_before_opening_the_next():
    p = policy()
    ws = views(3)
    placed = [place(p, req(i), ws, 0.0) for i in range(40)]
    assert placed == ["w0"] * 17 + ["w1"] * 17 + ["w2"] * 6
    # A finished request frees room on w0, which is again the fullest bin that fits.
    p.on_complete(req(3), "w0", 0.0)
    assert place(p, req(100), ws, 0.0) == "w0"


def test_packs_over_time_with_the_default_model():
    p = make_policy("aladdin", fit="best")
    ws = views(4, profile="")
    used = [place(p, req(i, l_in=300, lp=200), ws, 0.25 * i) for i in range(40)]
    assert used.count("w0") > 20 and used.count("w3") == 0 and None not in used


def test_no_fit_exposes_shortfall():
    p = policy(unplaced_ttl_s=10.0)
    ws = views(1)
    assert p.shortfall == 0
    assert fill_count(p, ws) == 17
    assert p.shortfall == 1  # the 18th request
    for i in range(20):
        d = p.choose(req(f"x{i}"), ws, 1.0)
        assert d.worker_id is None and d.reason == "no_fit"
    assert p.shortfall == 2  # 21 requests, at most 17 per fresh worker (constraint (b))
    for i in range(4):  # four found a place elsewhere
        p.on_dispatch(req(f"x{i}"), "elsewhere", 1.0)
    assert p.shortfall == 1
    p.choose(req("late"), ws, 20.0)  # the others were not retried within the TTL
    assert p.shortfall == 1 and p.no_fits == 22


def test_request_that_fits_nowhere_even_alone_is_placed_as_best_effort():
    p = policy(CLOCK, fallback=None)
    ws = views(3)
    place(p, req(0, l_in=300), ws, 0.0)
    place(p, req(1, l_in=200, lp=50, slo_ttft_s=2.0), ws, 0.0)  # both packed onto w0
    d = p.choose(req(2, l_in=700), ws, 0.0)  # prefill 0.7 s > TTFT 0.6 s on any worker
    assert d == type(d)("w1", "best_effort") and p.best_efforts == 1  # the first least-loaded worker by the ledger
    assert p.shortfall == 0  # not a reason to scale out
    # With the default fallback baseline (least_requests) the views' in-flight counts decide.
    p = policy(CLOCK)
    loaded = [WorkerView("w0", profile="p", inflight=2), WorkerView("w1", profile="p", inflight=1),
              WorkerView("w2", profile="p", inflight=0)]
    assert p.choose(req(3, l_in=700), loaded, 0.0) == type(d)("w2", "best_effort")


def test_untrusted_model_hands_placement_to_the_fallback_until_it_recovers():
    p = policy(CLOCK, miss_window=4, max_miss_rate=0.3)
    ws = views(2)
    assert p.choose(req(0), ws, 0.0).reason == "best_fit"
    for i in range(3):   # requests the model placed on both workers missed their SLO: 1 - 0.75^3 = 0.58
        p.observe_outcome(req(f"m{i}"), "w0", False, 0.0)
        p.observe_outcome(req(f"n{i}"), "w1", False, 0.0)
    loaded = [WorkerView("w0", profile="p", inflight=3), WorkerView("w1", profile="p", inflight=1)]
    d = p.choose(req(1), loaded, 0.1)
    assert (d.worker_id, d.reason, p.fallbacks) == ("w1", "fallback", 1)   # least_requests decides
    for i in range(5):   # w1's requests meet their SLO again: 0.58 * 0.75^5 = 0.14 < 0.3, trusted again
        p.observe_outcome(req(f"k{i}"), "w1", True, 0.2)
    assert p.choose(req(2), loaded, 0.3) == type(d)("w1", "best_fit")      # only w1 is trusted
    p.set_perf_model("p", CLOCK)     # a new model resets the trust of its workers
    assert p.choose(req(3), loaded, 0.4).reason == "best_fit"
    with pytest.raises(ValueError):
        policy(CLOCK, max_miss_rate=0.0)


def test_completion_frees_everything():
    p = policy()
    ws = views(1)
    assert fill_count(p, ws) == 17
    for i in range(17):
        p.on_complete(req(i), "w0", 1.0)
    load = p.worker_load("w0")
    assert load["requests"] == 0 and load["context"] == 0 and load["kv_now_blocks"] == pytest.approx(0, abs=1e-9)
    p.on_complete(req(5), "w0", 1.0)  # twice: ignored
    p.on_complete(req(5), "nowhere", 1.0)
    assert fill_count(p, ws) == 17


# --- tail mode ----------------------------------------------------------------------------------------
def test_tail_bounds_by_hand():
    assert cantelli_factor(0.025) == pytest.approx((0.975 / 0.025) ** 0.5)
    assert normal_factor(0.025) == pytest.approx(1.959964, rel=1e-5)
    assert split_budget(0.05, 2) == 0.025


def test_tail_mode_is_more_conservative():
    predictor = LengthPredictor()
    for i in range(400):
        predictor.observe("m", 100, 100 + (100 if i % 2 else -100) * 0.99)  # σ ≈ 100 tokens
    counts = {}
    for tail in (None, "normal", "cantelli"):
        p = policy(tail=tail, predictor=predictor)
        counts[tail] = fill_count(p, views(1))
    assert counts["cantelli"] < counts[None]
    assert counts["normal"] <= counts[None]
    assert counts["cantelli"] <= counts["normal"]


# --- re-prediction (appendix C) and progress reports ---------------------------------------------------
def test_outliving_request_is_repredicted_by_conditional_mean():
    predictor = LengthPredictor()
    for x in [5] * 10 + [50] * 10:
        predictor.observe("m", 100, x)
    p = policy(CLOCK, predictor=predictor, learn_lengths=True)
    ws = views(1)
    place(p, req(0, l_in=1, lp=10), ws, 0.0)
    assert p.predicted_length("r0") == 10
    p.choose(req(1), ws, 0.2)  # 1 ms of prefill, then 19.9 steps of 10 ms: it outlived 10 tokens
    assert p.generated("r0") == pytest.approx(20.9, abs=0.01)
    assert p.predicted_length("r0") == pytest.approx(50)  # E[L | L > 20.9] over the samples
    assert p.worker_errors()["w0"] == WorkerError(40, 1)   # Algorithm 2: underestimated by 40, one request
    # With max_tokens the re-prediction stops at the cap.
    place(p, req(2, l_in=1, lp=10, max_tokens=15), ws, 0.3)
    p.choose(req(3), ws, 0.6)
    assert p.predicted_length("r2") == 15


def test_report_progress_corrects_the_ledger_and_teaches_the_predictor():
    predictor = LengthPredictor()
    for x in [5] * 10 + [50] * 10:
        predictor.observe("m", 100, x)
    p = policy(CLOCK, predictor=predictor, learn_lengths=True)
    ws = views(1)
    place(p, req(0, l_in=1, lp=10), ws, 0.0)
    p.report_progress("r0", 5, 0.2)  # slower than the model thought
    assert p.generated("r0") == pytest.approx(5)
    assert p.predicted_length("r0") == 10
    p.report_progress("r0", 12, 0.25)
    assert p.predicted_length("r0") == pytest.approx(50)
    p.report_progress("r0", 33, 0.5)
    p.on_complete(req(0, l_in=1, lp=10), "w0", 0.5)
    assert predictor.count("m") == 21
    p.report_progress("r0", 40, 0.6)  # unknown by now: ignored


def test_pending_request_reported_started():
    p = policy(CLOCK)
    ws = views(1)
    place(p, req(0, l_in=1000, lp=50, slo_ttft_s=2.0), ws, 0.0)  # 1 s of prefill in the model
    assert p.generated("r0") == 0
    p.report_progress("r0", 3, 0.1)  # the engine was faster
    assert p.generated("r0") == pytest.approx(3)
    assert p.worker_load("w0")["pending_prefill_tokens"] == 0


# --- Algorithm 2 ------------------------------------------------------------------------------------
def test_error_distance_by_hand():
    assert error_distance(WorkerError(1, 1), 3, 4) == pytest.approx(7 / 5)


def test_propose_moves_cancels_errors():
    errors = {"w0": WorkerError(100, 1), "w1": WorkerError(-100, -1)}
    coeffs = {"w0": (1.0, 0.0), "w1": (1.0, 0.0)}
    placements = {"j1": ("w0", 100.0), "j2": ("w0", 100.0)}
    assert propose_moves(placements, errors, coeffs) == [Move("j1", "w0", "w1")]
    assert propose_moves(placements, errors, coeffs, feasible=lambda rid, dst: False) == []
    balanced = {"w0": WorkerError(), "w1": WorkerError()}
    assert propose_moves(placements, balanced, coeffs) == []


def test_rebalance_moves_queued_work_off_an_underestimated_worker():
    predictor = LengthPredictor()
    for x in [5] * 10 + [50] * 10:
        predictor.observe("m", 100, x)
    p = policy(CLOCK, predictor=predictor)
    ws = views(2)
    p.on_dispatch(req(0, l_in=1, lp=10), "w0", 0.0)
    p.on_dispatch(req(1, l_in=1, lp=100), "w1", 0.0)
    p.report_progress("r1", 40, 0.1)
    p.on_complete(req(1, l_in=1, lp=100), "w1", 0.1)  # finished 60 tokens early
    p.choose(req(9), ws, 0.2)                           # r0 outlived its 10 tokens
    errors = p.worker_errors()
    assert errors["w0"] == WorkerError(40, 1) and errors["w1"] == WorkerError(-60, -1)
    moves = p.rebalance({"q1": ("w0", req("q1", l_in=10, lp=50))}, ws, 0.2)
    assert moves == [Move("q1", "w0", "w1")]


def test_a_slow_worker_is_no_length_error_so_its_queue_moves_in_the_second_pass():
    """A transfer from a worker with a positive error to a balanced one leaves Σ distance unchanged, so Algorithm
    2 alone keeps the queue of a slow worker; `slow` moves it, each request to the feasible worker left with the
    least distance, never a slow one, within max_moves."""
    errors = {"w0": observed_error(5.0, 0.01, 1e-6, 2.0), "w1": WorkerError(), "w2": WorkerError(50, 0)}
    assert errors["w0"] == WorkerError(pytest.approx(40_000), 0.0)          # (5 − 1)·10 ms / 1e-6 s per token
    coeffs = {w: (1e-6, 1e-3) for w in errors}
    placements = {"j1": ("w0", 100.0), "j2": ("w0", 100.0), "j3": ("w1", 100.0)}
    assert propose_moves(placements, errors, coeffs) == []
    moves = propose_moves(placements, errors, coeffs, slow={"w0"})
    assert moves == [Move("j1", "w0", "w1"), Move("j2", "w0", "w2")]      # w1 holds j1 now: w2 is left lower
    assert propose_moves(placements, errors, coeffs, slow={"w0"}, max_moves=1) == [Move("j1", "w0", "w1")]
    no_w1 = propose_moves(placements, errors, coeffs, slow={"w0"}, feasible=lambda rid, dst: dst != "w1")
    assert no_w1 == [Move("j1", "w0", "w2"), Move("j2", "w0", "w2")]
    assert propose_moves(placements, errors, coeffs, slow={"w0", "w1", "w2"}) == []


def test_observed_error_ignores_noise_and_counts_a_fast_worker_as_overestimated():
    assert observed_error(1.5, 0.01, 1e-6, 2.0) == WorkerError()
    assert observed_error(0.6, 0.01, 1e-6, 2.0) == WorkerError()
    assert observed_error(0.25, 0.01, 1e-6, 2.0).l_err == pytest.approx(-7500)
    assert slow_workers({"a": 2.5, "b": 1.9}, 2.0) == {"a"}
    assert observed_ratio([(0.5, 10), (0.2, 10), (0.3, 10)], 0.01) == pytest.approx(3.0)
    assert observed_ratio([(0.5, 0)], 0.01) is None


def test_only_the_requests_the_engine_still_queues_may_move_within_a_budget():
    assert still_queued(["a", "b", "c"], 2) == ["b", "c"]      # "a" was sent first: it is in prefill
    assert still_queued(["a"], 0) == [] and still_queued(["a"], 5) == ["a"]
    b = MoveBudget(rate=2.0, burst=2.0)
    assert b.available(10.0) == 2
    b.spend(2)
    assert b.available(10.2) == 0 and b.available(10.6) == 1 and b.available(100.0) == 2


def test_batch_and_per_event_clocks_agree_over_a_long_run():
    """`choose` advances all workers at once (numpy), events advance one (scalars): same ledger, up to
    the decode clock's piecewise integration (the step time is re-evaluated at each advance)."""
    import random

    rng = random.Random(7)
    a, b = policy(CLOCK, slack="off"), policy(CLOCK, slack="off")
    ws = views(3)
    for p in (a, b):
        p.choose(req("init"), ws, 0.0)
    live: list[tuple[RequestFeatures, str]] = []
    now = 0.0
    for i in range(600):
        now += rng.uniform(0.0, 0.05)
        r = req(i, l_in=rng.randint(1, 300), lp=rng.randint(1, 80))
        w = f"w{rng.randrange(3)}"
        a.choose(req("probe"), ws, now)  # only `a` gets the vectorized advance
        for p in (a, b):
            p.on_dispatch(r, w, now)
        live.append((r, w))
        if len(live) > 40:
            done, dw = live.pop(rng.randrange(len(live)))
            for p in (a, b):
                p.on_complete(done, dw, now)
    for w in ("w0", "w1", "w2"):
        la, lb = a.worker_load(w), b.worker_load(w, now)
        for key in la:
            assert la[key] == pytest.approx(lb[key], rel=1e-4, abs=1e-6), (w, key)
    for r, w in live:  # drain: the ledgers return to exactly empty
        a.on_complete(r, w, now + 100)
    assert all(a.worker_load(w)["requests"] == 0 and a.worker_load(w)["kv_now_blocks"] == pytest.approx(0, abs=1e-6)
               for w in ("w0", "w1", "w2"))


# --- SLO helpers and bad input --------------------------------------------------------------------------
def test_slo_checks_by_hand():
    assert atgt(1.0, 2.0, 11) == pytest.approx(0.1)  # (last − first) / (n − 1)
    assert atgt(1.0, 1.0, 1) == 0.0
    target = SloTarget(0.6, 0.03)
    ok = check_slo(0.0, 0.5, 0.5 + 0.029 * 99, 100, target.ttft_s, target.atgt_s)
    assert ok.met and ok.ttft_s == pytest.approx(0.5) and ok.atgt_s == pytest.approx(0.029)
    slow = check_slo(0.0, 0.5, 0.5 + 0.031 * 99, 100, target.ttft_s, target.atgt_s)
    assert slow.ttft_met and not slow.atgt_met and not slow.met
    assert not check_slo(0.0, None, None, 0, target.ttft_s, target.atgt_s).met  # never produced a token
    assert target_for(req(0, slo_ttft_s=2.0), target) == SloTarget(2.0, 0.03)
    assert target_for(req(0), target) is target
    with pytest.raises(ValueError):
        SloTarget(0.0, 0.03)


def test_attainment_counters():
    att = SloAttainment()
    assert att.ratio() == 1.0
    for met in (True, True, False):
        att.record("m", "interactive", met)
    att.record("m", "batch", False)
    att.record("other", "interactive", True)
    assert att.get("m", "interactive").met == 2 and att.get("m", "interactive").missed == 1
    assert att.ratio("m", "interactive") == pytest.approx(2 / 3)
    assert att.ratio("m") == pytest.approx(2 / 4)
    assert att.ratio(request_class="interactive") == pytest.approx(3 / 4)
    assert {"model": "m", "class": "batch", "met": 0, "missed": 1} in att.to_dict()
    with pytest.raises(ValueError):
        tail_factor("gauss", 0.1)
    with pytest.raises(ValueError):
        cantelli_factor(0.0)


def test_bad_request_values_do_not_poison_the_ledger():
    p = policy()
    ws = views(1)
    bad = RequestFeatures(request_id="nan", model="m", prompt_tokens=100, predicted_output_tokens=float("nan"))
    assert place(p, bad, ws, 0.0) == "w0"
    assert p.predicted_length("nan") == 128.0  # the predictor's default instead
    p.on_complete(bad, "w0", 1.0)
    assert p.worker_load("w0")["requests"] == 0
    assert fill_count(p, ws) == 17


def test_memory_stays_bounded_over_many_requests():
    p = policy(CLOCK, slack="off")
    p.choose(req("init"), views(1), 0.0)  # the policy learns w0's profile
    now = 0.0
    for i in range(2000):
        now += 0.01
        r = req(i, l_in=10, lp=20)
        p.on_dispatch(r, "w0", now)
        if i >= 30:
            p.report_progress(f"r{i - 30}", 5, now)
            p.on_complete(req(i - 30, l_in=10, lp=20), "w0", now)
    row = p.ledger.rows[0]
    assert len(row.reqs) == 30
    assert len(row.ends) <= 2 * 30 + 64 + 1 and all(len(h) <= 2 * 30 + 64 + 1 for h in row.heaps.values())
    assert len(row.early) <= row.early.maxlen
