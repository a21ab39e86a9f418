"""The gateway's learning loop: online performance models per worker profile and output-length prediction.

What the hot path does (O(1) per request, no I/O): `predict` reads a cached prediction for
RequestFeatures.predicted_output_tokens; `dispatched` / `answered` / `released` note the request
(a deque append, a dict insert for policies that take progress reports).

What the control loop does every `learning.interval_s` (off the request path):
  * samples each worker's scraped `running` into a sample-and-hold integral, so a finished request's decode
    batch size is the time average over its own decode;
  * turns finished requests into observations of their worker's profile (Aladdin section 3):
      prefill  (eq. 2)  prompt tokens l_in, seconds = first token - dispatch (what a TTFT sees: it also
                        holds the server's per-request overhead and the step in flight, so c1 absorbs them;
                        the robust loss discounts requests that queued behind other prefills);
      decode   (eq. 3)  batch b, mean context l_in + n/2, seconds = ATGT = (last - first token) / (n - 1)
                        (streamed requests with n >= 4 tokens), times the share of that time the worker did
                        not spend on prompts batched into its steps (`decode_share`: chunked prefill), which
                        leaves eq. 3's pure decode step;
    and feeds the output-length predictor (per model and input-length bucket) with n;
  * reports generated-token counts of streaming requests to policies that keep a ledger
    (`report_progress`, aladdin): batched once per tick, never per token;
  * exports the placement shortfall of SLO-aware policies (`shortfall`, aladdin) as a scale signal;
  * every `refit_interval_s`, once `refit_min_new` new observations arrived, refits the profile's
    PerfModel (robust least squares, blended with the declared profile; policies/perf_model.py) in a
    thread, pushes it into every policy with `set_perf_model` and exports coefficients and fit errors;
  * every `sync_interval_s`, shares through the state store (so all gateway replicas converge):
      learn:model:<profile>                 the last fitted model (any replica); newer ones are adopted
      learn:samples:<profile>|<replica>     each replica's recent observations; every refit uses all of them
      learn:predictor:<replica>             each replica's own predictor state; the one used is their merge
    and loads all of them at start. Documents older than DOC_MAX_AGE_S are ignored and deleted.

Priors (the model a profile starts from) come from gateway/config/priors.py. Fitted and exported coefficients are
in the gateway's wall seconds; the scraped `num_gpu_blocks` / `block_size` of a profile's workers replace the
prior's KV capacity.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge

from gateway.config.priors import known_profile, profile_prior
from gateway.request.context import InFlight
from gateway.request.hooks import RequestHook
from gateway.state.jobs import StoreUnavailableError
from gateway.state.outage import quiet_loop, stop_task
from policies.base import Policy
from policies.length_predictor import DEFAULT_OUTPUT_TOKENS, LengthPredictor, length_bucket
from policies.perf_model import COMPONENTS, PerfModel, PerfModelFitter, prefill_free_share

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.fleet.registry import Registry, WorkerState
    from gateway.request.context import RequestContext
    from gateway.state.base import StateStore
    from gateway.wire.results import RelayResult
    from policies.types import RequestFeatures

log = logging.getLogger("fleetgate.learning")

DOC_MODEL, DOC_SAMPLES, DOC_PREDICTOR = "learn:model:", "learn:samples:", "learn:predictor:"
DOC_MAX_AGE_S = 86_400.0
MIN_DECODE_TOKENS = 4          # ATGT over fewer tokens is mostly noise
DECODE_SETTLE_MAX_S = 5.0      # a decode observation waits at most this long for its worker's next scrape
MIN_DECODE_SHARE = 0.25        # `decode_share`'s floor (a scrape gap's counter jump must not zero a decode)
PREFILL_SETTLE_MAX_S = 30.0    # a prefill observation waits at most this long for earlier requests to finish
TRACE_KEEP = 2048              # scrape samples kept per worker (trimmed in halves)
_EXPORTED = ("k1", "k1q", "pf", "c1", "k2", "c2", "c3", "h", "j", "kv_capacity", "max_batch")


# --- predictor merging (parallel Welford: Chan et al.) ----------------------------------------------
def _merge_stats(items: list[Mapping[str, Any]], ring_size: int) -> dict[str, Any]:
    n = sum(int(s["n"]) for s in items)
    mean = sum(int(s["n"]) * float(s["mean"]) for s in items) / n if n else 0.0
    m2 = sum(float(s["m2"]) + int(s["n"]) * (float(s["mean"]) - mean) ** 2 for s in items)
    ring: list[float] = []
    for s in items:
        ring.extend(s.get("ring", []))
    ring = ring[-ring_size:]
    return {"n": n, "mean": mean, "m2": m2, "ring": ring, "pos": len(ring) % max(ring_size, 1)}


def merge_predictors(docs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One LengthPredictor state from several replicas' (each holding only its own observations)."""
    base = dict(docs[0])
    ring_size = int(base.get("ring_size", 512))
    buckets: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    models: dict[str, list[Mapping[str, Any]]] = {}
    for d in docs:
        for m, b, st in d.get("buckets", []):
            buckets.setdefault((str(m), int(b)), []).append(st)
        for m, st in d.get("models", {}).items():
            models.setdefault(str(m), []).append(st)
    base["buckets"] = [[m, b, _merge_stats(v, ring_size)] for (m, b), v in buckets.items()]
    base["models"] = {m: _merge_stats(v, ring_size) for m, v in models.items()}
    return base


# --- scraped load over time ---------------------------------------------------------------------------
class _Trace:
    """One worker's scraped batch size (a sample-and-hold integral) and prompt tokens it computed (its prefix
    cache's queried less hit tokens: a counter, linear between scrapes), at perf_counter times."""

    __slots__ = ("t", "cum_b", "b", "prefilled", "_base", "_last_raw", "last_scrape")

    def __init__(self) -> None:
        self.t: list[float] = []
        self.cum_b: list[float] = []
        self.b: list[float] = []
        self.prefilled: list[float] = []
        self._base = 0.0        # what the engine's counters held before it restarted (they start again at 0)
        self._last_raw = 0.0
        self.last_scrape = -1.0

    def add(self, t: float, running: float, prefilled: float = 0.0) -> None:
        if self.t:
            if t <= self.t[-1]:
                return
            cb = self.cum_b[-1] + self.b[-1] * (t - self.t[-1])
        else:
            cb = 0.0
        if prefilled < self._last_raw:
            self._base += self._last_raw
        self._last_raw = prefilled
        self.t.append(t)
        self.cum_b.append(cb)
        self.b.append(running)
        self.prefilled.append(self._base + prefilled)
        if len(self.t) > 2 * TRACE_KEEP:
            for name in ("t", "cum_b", "b", "prefilled"):
                setattr(self, name, getattr(self, name)[-TRACE_KEEP:])

    def _at(self, t: float) -> float | None:
        i = bisect.bisect_right(self.t, t) - 1
        if i < 0:
            return None
        return self.cum_b[i] + self.b[i] * (t - self.t[i])

    def average(self, t0: float, t1: float) -> float | None:
        """The mean batch over [t0, t1], or None without samples that early."""
        if t1 <= t0:
            return None
        a, b = self._at(t0), self._at(t1)
        if a is None or b is None:
            return None
        return (b - a) / (t1 - t0)

    def prefilled_between(self, t0: float, t1: float) -> float | None:
        """Prompt tokens the engine computed over [t0, t1] (None without scrapes on both sides, or when the engine
        reports no prefix-cache counters)."""
        ts = self.t
        if not ts or t0 < ts[0] or t1 > ts[-1] or t1 <= t0 or self.prefilled[-1] <= 0.0:
            return None
        return self._counter(t1) - self._counter(t0)

    def _counter(self, t: float) -> float:
        """The counter at t, linear between the scrapes around it (t within the samples: `prefilled_between`)."""
        i = min(bisect.bisect_right(self.t, t) - 1, len(self.t) - 2)
        t_a, a = self.t[i], self.prefilled[i]
        return a + (self.prefilled[i + 1] - a) * (t - t_a) / (self.t[i + 1] - t_a)


class _PrefillLog:
    """One worker's recent (first token, dispatch, prompt tokens) of streamed requests, sorted by first token."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float]] = []

    def add(self, t_first: float, t_sent: float, l_in: float, l_sq: float | None = None) -> None:
        """l_in: the prompt tokens the worker prefilled; l_sq: their quadratic work (l_in² without a cached prefix,
        l_in² − cached² with one: the new tokens attend to the cached ones)."""
        bisect.insort(self.rows, (t_first, t_sent, l_in, l_in * l_in if l_sq is None else l_sq))
        if len(self.rows) > 2 * TRACE_KEEP:
            del self.rows[:TRACE_KEEP]

    def others_between(self, t_sent: float, t_first: float) -> tuple[float, float]:
        """Prompt tokens (Σl, Σl²) of the other requests prefilled while this one waited: first token in
        (t_sent, t_first] and sent before t_first (Aladdin eq. 2's Σl_in of the prefill it shared)."""
        rows = self.rows
        lo = bisect.bisect_right(rows, (t_sent, math.inf, math.inf, math.inf))
        hi = bisect.bisect_right(rows, (t_first, math.inf, math.inf, math.inf))
        total = sq = 0.0
        me = False
        for tf, ts, l_in, l_sq in rows[lo:hi]:
            if tf == t_first and ts == t_sent and not me:
                me = True  # the request itself
            elif ts < t_first:
                total += l_in
                sq += l_sq
        return total, sq


# --- per-profile state ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Profile:
    name: str
    prior: PerfModel
    model: PerfModel
    prefill: deque = field(default_factory=deque)   # (prompt tokens, seconds); maxlen = learning.max_samples
    decode: deque = field(default_factory=deque)    # (batch, mean context, seconds)
    others: dict[str, dict[str, list]] = field(default_factory=dict)  # replica -> {"prefill": [...], ...}
    new: int = 0
    last_fit: float = float("-inf")   # monotonic
    fitted_at: float = 0.0            # unix time of the model in use (0: the prior)
    dirty: bool = False               # own samples changed since the last publish
    kv_blocks: int | None = None
    block_size: int | None = None
    known: bool = False               # a declared prior (config, simulator profile) or a fit: it predicts


class Learner(RequestHook):
    """Online models for one gateway process; `start` / `stop` bracket its control loop. A request hook
    (gateway/request/hooks.py): a request that left its worker (`released`) is no longer in flight."""

    def __init__(self, config: GatewayConfig, store: StateStore, registry: Registry,
                 metrics_registry: CollectorRegistry) -> None:
        lc = config.learning
        self.cfg = lc
        self.enabled = lc.enabled
        self.store = store
        self.registry = registry
        self.replica_id = store.replica_id
        self._own_predictor = LengthPredictor()  # this replica's observations only (published)
        # What policies and `predict` use: own + other replicas' observations. Until another replica's state is
        # adopted that is exactly the own predictor, so both are one object and each completion is observed once.
        self.predictor = self._own_predictor
        self._pred_cache: dict[tuple[str, int, int | None], float] = {}
        self._profiles: dict[str, _Profile] = {}
        self._traces: dict[str, _Trace] = {}
        self._policies: list[tuple[str, Policy]] = []   # (model, policy): every policy the gateway built
        self._active: dict[str, RequestContext] = {}   # request id -> a request in flight (`ctx.inflight`)
        self._done: deque[tuple] = deque(maxlen=100_000)
        # model -> [finished, prompt tokens, prompt tokens², output tokens] since start (gateway/control/replanner.py)
        self.traffic: dict[str, list[float]] = {}
        self._prefill_logs: dict[str, _PrefillLog] = {}
        self._prefill_wait: list[tuple] = []
        self._decode_wait: list[tuple] = []   # decode observations waiting for a scrape after their last token
        self._shortfall_seen: dict[tuple[str, int], tuple[int, float]] = {}  # (model, policy) -> (no_fits, rise)
        # engines of shared hosts running turns (gateway/control/turns.py): their timings include other models' turns, so
        # they would teach the perf model steps several times too slow; their lengths still count
        self._untimed = config.turns_workers()
        self.shortfall_now: dict[str, int] = {}   # model -> the placement shortfall last exported
        self._buckets_seen: set[tuple[str, int]] = set()
        self._task: asyncio.Task | None = None
        self._fitting = False
        self._own_dirty = False
        self._others_seen: list[tuple[str, Any]] = []
        self._last_sync = float("-inf")
        self._clock_offset = time.time() - time.perf_counter()
        r = metrics_registry
        self.g_coef = Gauge("fleetgate_perf_model_coefficient",
                            "Performance-model coefficient in use per worker profile (seconds, blocks; "
                            "Aladdin eq. 1-3, hetero p1..p8).", ["profile", "name"], registry=r)
        self.g_err = Gauge("fleetgate_perf_model_fit_error",
                           "Median relative error of the fitted model on its observations, by phase.",
                           ["profile", "phase"], registry=r)
        self.g_samples = Gauge("fleetgate_perf_model_samples", "Observations used by the last fit, by phase.",
                               ["profile", "phase"], registry=r)
        self.g_shortfall = Gauge("fleetgate_placement_shortfall_workers",
                                 "More workers the requests that found no SLO-feasible placement need "
                                 "(scale signal of SLO-aware policies).", ["model"], registry=r)
        self.g_length = Gauge("fleetgate_output_length_prediction_tokens",
                              "Predicted output tokens per model and prompt-length bucket (no max_tokens).",
                              ["model", "bucket"], registry=r)

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if not self.enabled or self._task is not None:
            return
        self._clock_offset = time.time() - time.perf_counter()
        self._note_profiles()
        try:
            await self._sync(load_models=True)
        except StoreUnavailableError:
            log.warning("shared models not loaded at start: the state store is unreachable")
        except Exception:  # noqa: BLE001 - shared state is an optimisation: start without it
            log.exception("could not load shared models at start")
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="fg-learning")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        await stop_task(task)     # repeats a cancellation a Redis command in the loop swallowed
        with contextlib.suppress(Exception):
            self._ingest()
            await self._publish()

    # --- hot path ----------------------------------------------------------------------------------
    def attach(self, model: str, policy: Policy) -> None:
        """A policy of `model` was built (its own, or its P/D profile's decode policy): give it the current perf
        models and the shared predictor."""
        self._policies.append((model, policy))
        if not self.enabled:
            return
        if hasattr(policy, "set_perf_model"):
            for prof in self._profiles.values():
                policy.set_perf_model(prof.name, prof.model)
        if isinstance(getattr(policy, "predictor", None), LengthPredictor):
            policy.predictor = self.predictor
            policy.learn_lengths = False  # the gateway observes every completion itself

    def predict(self, model: str, prompt_tokens: int, max_tokens: int | None) -> float:
        """Expected output tokens (bounded by max_tokens); cached per (model, bucket, max_tokens) per tick."""
        if not self.enabled:
            return float(max_tokens) if max_tokens is not None else DEFAULT_OUTPUT_TOKENS
        key = (model, length_bucket(prompt_tokens), max_tokens)
        hit = self._pred_cache.get(key)
        if hit is None:
            if len(self._pred_cache) > 4096:
                self._pred_cache.clear()
            hit = self._pred_cache[key] = self.predictor.predict(model, prompt_tokens, max_tokens)
        return hit

    def dispatched(self, ctx: RequestContext, worker_id: str) -> float:
        """The request was sent to `worker_id`; returns the dispatch time (perf_counter). Its entry is
        `ctx.inflight`; the control loop reports its progress (tokens relayed so far) to the placement step now
        and then."""
        t = time.perf_counter()
        if self.enabled:
            ctx.inflight = InFlight(worker_id, t)
            self._active[ctx.feats.request_id] = ctx
        return t

    def answered(self, feats: RequestFeatures, worker_id: str, t_sent: float, result: RelayResult) -> int:
        """The worker answered (any status): its timings become observations for the control loop. Returns
        the output tokens of a completed answer (0 otherwise), which the placement step then hears."""
        if result.status != 200 or result.midstream_error is not None:
            return 0
        n = result.output_tokens
        if self.enabled and n > 0:
            self._done.append((feats.model, feats.prompt_tokens, n, worker_id, t_sent,
                               result.first_token_at, result.last_token_at,
                               feats.cached_prefix_tokens.get(worker_id, 0)))
        return max(n, 0)

    def observe_length(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        """A completed request's output length (the placement step calls this before its policy hears)."""
        if not self.enabled:
            return
        self._own_predictor.observe(model, prompt_tokens, output_tokens)
        if self.predictor is not self._own_predictor:
            self.predictor.observe(model, prompt_tokens, output_tokens)
        self._own_dirty = True
        self._buckets_seen.add((model, length_bucket(prompt_tokens)))

    def released(self, ctx: RequestContext, worker: WorkerState) -> None:
        """Request hook: the request left its worker; it is no longer in flight."""
        if self._active.pop(ctx.feats.request_id, None) is not None:
            ctx.inflight = None

    # --- the control loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        await quiet_loop(self.cfg.interval_s, self.tick, log, "learning loop")

    async def tick(self) -> None:
        """One round of the control loop (also callable directly, e.g. by tests)."""
        self._note_profiles()
        self._sample_load()
        self._ingest()
        self._settle_prefills()
        self._settle_decodes()
        self._report_progress()
        self._export_shortfall()
        mono = time.monotonic()
        due = [p for p in self._profiles.values()
               if p.new >= self.cfg.refit_min_new and mono - p.last_fit >= self.cfg.refit_interval_s]
        if due and not self._fitting:
            self._fitting = True
            try:
                for p in due:
                    p.last_fit = mono
                    p.new = 0
                    pre, dec = self._all_samples(p)
                    model = await asyncio.to_thread(_fit, p.prior, pre, dec, self.cfg.prior_weight)
                    self._install(p, model, time.time())
                    await self.store.put_doc(DOC_MODEL + p.name, {
                        "model": model.to_dict(), "fitted_at": p.fitted_at, "replica": self.replica_id})
            finally:
                self._fitting = False
        if mono - self._last_sync >= self.cfg.sync_interval_s:
            await self._sync()

    def _note_profiles(self) -> None:
        for ws in self.registry.workers.values():
            name = ws.rec.profile
            prof = self._profiles.get(name)
            if prof is None:
                prior = profile_prior(name, self.cfg.priors, self.cfg.time_scale)
                cap = self.cfg.max_samples
                prof = self._profiles[name] = _Profile(name, prior, prior, deque(maxlen=cap), deque(maxlen=cap))
                prof.known = known_profile(name, self.cfg.priors)
                self._export(prof)
                self._push(prof)
            m = ws.metrics
            if m.num_gpu_blocks and m.block_size and (prof.kv_blocks is None or m.num_gpu_blocks < prof.kv_blocks
                                                      or m.block_size != prof.block_size):
                self._set_kv(prof, int(m.num_gpu_blocks), int(m.block_size))

    def _set_kv(self, prof: _Profile, blocks: int, block_size: int) -> None:
        """The engine told us its KV cache size: M and h of the profile's model come from it."""
        prof.kv_blocks, prof.block_size = blocks, block_size
        for attr in ("prior", "model"):
            m = PerfModel.from_dict(getattr(prof, attr).to_dict())
            m.kv_capacity, m.h = float(blocks), 1.0 / block_size
            setattr(prof, attr, m)
        self._export(prof)
        self._push(prof)

    def _sample_load(self) -> None:
        off = self._clock_offset
        for wid, ws in self.registry.workers.items():
            m = ws.metrics
            if not m.scraped_at:
                continue
            tr = self._traces.get(wid)
            if tr is None:
                tr = self._traces[wid] = _Trace()
            if m.scraped_at == tr.last_scrape:
                continue
            tr.last_scrape = m.scraped_at
            tr.add(m.scraped_at - off, float(m.running), float(m.prefix_cache_queries - m.prefix_cache_hits))

    def _ingest(self) -> None:
        """Turn finished requests into predictor and perf-model observations."""
        done = self._done
        if not done:
            return
        workers = self.registry.workers
        while done:
            model, l_in, n, wid, t_sent, t_first, t_last, cached = done.popleft()
            t = self.traffic.get(model)
            if t is None:
                t = self.traffic[model] = [0.0, 0.0, 0.0, 0.0]
            t[0] += 1
            t[1] += l_in
            t[2] += l_in * l_in
            t[3] += n
            ws = workers.get(wid)
            if ws is None or t_first is None or wid in self._untimed:
                continue
            prof = self._profiles.get(ws.rec.profile)
            if prof is None:
                continue
            if t_first > t_sent:
                log_ = self._prefill_logs.get(wid)
                if log_ is None:
                    log_ = self._prefill_logs[wid] = _PrefillLog()
                # The prefill the worker did: with a KV-event view (policies that price the cache ask for it) the
                # prefix it already held is not prefilled again; fitting the whole prompt would make a cache hit
                # look like a fast GPU and, with cache pricing, discount the cached prefix twice.
                cached = min(max(cached, 0), l_in - 1) if l_in > 0 else 0
                new, new_sq = float(l_in - cached), float(l_in * l_in - cached * cached)
                log_.add(t_first, t_sent, new, new_sq)
                self._prefill_wait.append((wid, prof, t_sent, t_first, new, new_sq))
            if t_last is not None and n >= MIN_DECODE_TOKENS and t_last > t_first:
                self._decode_wait.append((wid, prof, l_in, n, t_first, t_last))
            prof.dirty = True
        self._pred_cache.clear()
        self._export_lengths()

    def _settle_decodes(self) -> None:
        """Decode observations whose worker was scraped after their last token (or that waited DECODE_SETTLE_MAX_S):
        its batch and the prompts it computed meanwhile are then known over the whole decode."""
        if not self._decode_wait:
            return
        now = time.perf_counter()
        keep = []
        for item in self._decode_wait:
            wid, prof, l_in, n, t_first, t_last = item
            tr = self._traces.get(wid)
            if tr is not None and (not tr.t or tr.t[-1] < t_last) and now - t_last <= DECODE_SETTLE_MAX_S:
                keep.append(item)
                continue
            avg = tr.average(t_first, t_last) if tr is not None else None
            batch = max(avg, 1.0) if avg is not None else 1.0
            # The context eq. 3 reads: the request's own mean, prompt + half its output (the ledger predicts with
            # the same, l_in + l_out/2). Not the scraped KV tokens per running request: the engine holds a prefix
            # its requests share once, but every decode reads it, so that mean ran short and the fitted k2 long
            # (x1.7 on multi-turn chats, bench/results/shedding.md).
            ctx = l_in + n / 2.0
            atgt = (t_last - t_first) / (n - 1)
            prof.decode.append((batch, ctx, atgt * decode_share(prof.model, tr, t_first, t_last)))
            prof.new += 1
            prof.dirty = True
        self._decode_wait = keep

    def _export_lengths(self) -> None:
        for model, b in self._buckets_seen:
            self.g_length.labels(model, f"{2 ** b}-{2 ** (b + 1) - 1}").set(self.predictor.predict(model, 2 ** b))

    def _settle_prefills(self) -> None:
        """Prefill observations whose shared prefill work is known: every request sent to the worker
        before the observation's first token has finished (or it waited PREFILL_SETTLE_MAX_S)."""
        if not self._prefill_wait:
            return
        oldest: dict[str, float] = {}
        for ctx in self._active.values():
            a = ctx.inflight
            if a is not None and a.t_sent < oldest.get(a.worker, math.inf):
                oldest[a.worker] = a.t_sent
        now = time.perf_counter()
        keep = []
        for item in self._prefill_wait:
            wid, prof, t_sent, t_first, l_in, l_sq = item
            if t_first < oldest.get(wid, math.inf) or now - t_first > PREFILL_SETTLE_MAX_S:
                shared, shared_sq = self._prefill_logs[wid].others_between(t_sent, t_first)
                prof.prefill.append((l_in + shared, l_sq + shared_sq, t_first - t_sent))
                prof.new += 1
                prof.dirty = True
            else:
                keep.append(item)
        self._prefill_wait = keep

    def _report_progress(self) -> None:
        if not self._active:
            return
        now = time.time()
        for ctx in list(self._active.values()):
            a = ctx.inflight
            n = ctx.state.tokens
            if a is not None and n > a.reported:
                a.reported = n
                ctx.rt.placement.progress(ctx.feats, n, now)

    def _export_shortfall(self) -> None:
        mono = time.monotonic()
        per_model: dict[str, int] = {}
        for model, policy in self._policies:
            if not hasattr(policy, "shortfall"):
                continue
            key = (model, id(policy))
            no_fits = int(getattr(policy, "no_fits", 0))
            seen, at = self._shortfall_seen.get(key, (0, float("-inf")))
            if no_fits != seen:
                seen, at = no_fits, mono
                self._shortfall_seen[key] = (seen, at)
            # The policy forgets unplaced requests only on its next no_fit: without one for its TTL, none is left.
            recent = mono - at <= float(getattr(policy, "unplaced_ttl_s", 30.0))
            per_model[model] = max(per_model.get(model, 0), policy.shortfall if recent else 0)
        for model, n in per_model.items():
            self.g_shortfall.labels(model).set(n)
        self.shortfall_now = per_model

    def shortfall_total(self) -> int:
        """More workers this replica's unplaceable requests need, over all models (the autoscaler's input)."""
        return sum(self.shortfall_now.values())

    # --- models --------------------------------------------------------------------------------------
    def _all_samples(self, p: _Profile) -> tuple[list, list]:
        pre, dec = list(p.prefill), list(p.decode)
        for other in p.others.values():
            pre.extend(tuple(x) for x in other.get("prefill", []))
            dec.extend(tuple(x) for x in other.get("decode", []))
        return pre, dec

    def _install(self, p: _Profile, model: PerfModel, fitted_at: float) -> None:
        if p.kv_blocks and p.block_size:
            model.kv_capacity, model.h = float(p.kv_blocks), 1.0 / p.block_size
        p.model, p.fitted_at = model, fitted_at
        self._export(p)
        self._push(p)

    def _push(self, p: _Profile) -> None:
        for _, policy in self._policies:
            if hasattr(policy, "set_perf_model"):
                policy.set_perf_model(p.name, p.model)

    def _export(self, p: _Profile) -> None:
        label = p.name or "_undeclared"
        m = p.model
        for name in _EXPORTED:
            self.g_coef.labels(label, name).set(float(getattr(m, name)))
        for i, v in enumerate(m.hetero_coeffs(), start=1):
            self.g_coef.labels(label, f"p{i}").set(v)
        for phase in COMPONENTS:
            fit = m.fit.get(phase)
            if fit is not None:
                self.g_err.labels(label, phase).set(fit.rel_err)
                self.g_samples.labels(label, phase).set(fit.n)

    def prefill_s(self, worker_id: str, prompt_tokens: float, sum_sq_tokens: float) -> float | None:
        """Predicted seconds for `worker_id` to prefill prompts of `prompt_tokens` tokens in all (Σl² =
        `sum_sq_tokens`): the first-token time of a request behind the others waiting there. None when the
        learner does not know the worker's profile (no declared prior, no fit) or is off."""
        ws = self.registry.workers.get(worker_id)
        p = self._profiles.get(ws.rec.profile) if ws is not None else None
        if p is None or not (p.known or p.fitted_at) or ws.id in self._untimed:
            return None
        return p.model.prefill_time(prompt_tokens, sum_sq_tokens)

    def model_for(self, profile: str) -> PerfModel | None:
        p = self._profiles.get(profile)
        return p.model if p is not None else None

    # --- shared state ---------------------------------------------------------------------------------
    async def _publish(self) -> None:
        now = time.time()
        for p in self._profiles.values():
            if p.dirty:
                p.dirty = False
                await self.store.put_doc(f"{DOC_SAMPLES}{p.name}|{self.replica_id}", {
                    "prefill": [list(x) for x in p.prefill], "decode": [list(x) for x in p.decode],
                    "updated_at": now})
        if self._own_dirty:
            self._own_dirty = False
            await self.store.put_doc(DOC_PREDICTOR + self.replica_id,
                                     {"predictor": self._own_predictor.to_dict(), "updated_at": now})

    async def _sync(self, load_models: bool = False) -> None:
        """Publish this replica's samples and predictor; adopt other replicas' models, samples, predictors."""
        self._last_sync = time.monotonic()
        await self._publish()
        now = time.time()
        fresh = now - DOC_MAX_AGE_S
        for key, doc in (await self.store.get_docs(DOC_MODEL)).items():
            p = self._profiles.get(key[len(DOC_MODEL):])
            if p is None or doc.get("replica") == self.replica_id and not load_models:
                continue
            at = float(doc.get("fitted_at", 0.0))
            if at > p.fitted_at and at >= fresh:
                try:
                    self._install(p, PerfModel.from_dict(doc["model"]), at)
                except (KeyError, TypeError, ValueError) as e:
                    log.warning("ignoring the shared model %s: %s", key, e)
        for key, doc in (await self.store.get_docs(DOC_SAMPLES)).items():
            name, _, replica = key[len(DOC_SAMPLES):].rpartition("|")
            if float(doc.get("updated_at", 0.0)) < fresh:
                await self.store.delete_doc(key)
                continue
            p = self._profiles.get(name)
            if p is not None and replica != self.replica_id:
                p.others[replica] = doc
        others, seen = [], []
        for key, doc in sorted((await self.store.get_docs(DOC_PREDICTOR)).items()):
            if key[len(DOC_PREDICTOR):] == self.replica_id:
                continue
            if float(doc.get("updated_at", 0.0)) < fresh:
                await self.store.delete_doc(key)
                continue
            if isinstance(doc.get("predictor"), dict):
                others.append(doc["predictor"])
                seen.append((key, doc.get("updated_at")))
        # Own observations already go into the merged predictor: rebuild only when another replica's changed.
        if others and seen != self._others_seen:
            self._others_seen = seen
            self._adopt_predictor(others)

    def _adopt_predictor(self, others: list[dict]) -> None:
        try:
            merged = LengthPredictor.from_dict(merge_predictors([self._own_predictor.to_dict(), *others]))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("ignoring other replicas' predictor state: %s", e)
            return
        self.predictor = merged
        self._pred_cache.clear()
        for other in others:
            self._buckets_seen.update((str(m), int(b)) for m, b, _ in other.get("buckets", []))
        self._export_lengths()
        for _, policy in self._policies:
            if isinstance(getattr(policy, "predictor", None), LengthPredictor):
                policy.predictor = merged


def decode_share(model: PerfModel, trace: _Trace | None, t_first: float, t_last: float) -> float:
    """The share of [t_first, t_last] the worker spent decoding rather than computing the prompts it took in
    meanwhile (chunked prefill batches them into the decode steps): 1 − k1·ρ, ρ the prompt tokens it computed per
    second then (its prefix cache's queried less hit tokens), at least MIN_DECODE_SHARE (policies/perf_model.py
    `prefill_free_share`, the share the rule predicts with). A stream's ATGT times this is eq. 3's pure decode
    step: the admission rule's estimate (policies/aladdin/constraints.py
    `paced_atgt`) stretches that step by 1/(1 − k1·ρ) at the rate it expects, so learning the stretched step
    would count the prefills twice (measured on multi-turn chats: a 1.5x over-estimate, bench/results/shedding.md).
    1 when the engine reports no such counters."""
    done = trace.prefilled_between(t_first, t_last) if trace is not None else None
    if done is None:
        return 1.0
    return float(prefill_free_share(model.k1, done / (t_last - t_first), MIN_DECODE_SHARE))


def _fit(prior: PerfModel, prefill: list, decode: list, prior_weight: float) -> PerfModel:
    """Refit a profile from observations (runs in a worker thread)."""
    fitter = PerfModelFitter(prior=prior, capacity=max(len(prefill), len(decode), 8), prior_weight=prior_weight)
    for row in prefill:  # (Σl, Σl², seconds); replicas of older versions share (Σl, seconds)
        tokens, seconds = row[0], row[-1]
        fitter.add_prefill(tokens, seconds, sum_sq_tokens=row[1] if len(row) == 3 else None)
    for batch, ctx, seconds in decode:
        fitter.add_decode(batch, ctx, seconds)
    return fitter.refit()


__all__ = ["Learner", "merge_predictors"]
