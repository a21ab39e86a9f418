"""Chiron's global autoscaler (section 5) with Aladdin's worker-count predictor, as pure functions/objects.

    gs = GlobalAutoscaler(GlobalConfig(theta=0.5))
    plan = gs.update(FleetObservation(...), now)
    plan.desired            # {"interactive": 3, "mixed": 3, "batch": 2}
    plan.actions            # [ScaleAction("batch", "up", 2, "deadline")]  -> scale_actions_total{pool,direction,reason}
    plan.backpressure       # {"ibp": 0.62, "bbp": 1.0, ...}               -> fleetgate_backpressure{kind,pool}

Pools (Chiron section 3): `interactive` workers serve interactive requests, `batch` workers batch ones,
`mixed` workers both (interactive spikes first, spare capacity to batch). The interactive and mixed
workers form one pool sized by interactive backpressure; the batch pool by batch backpressure.

- Interactive backpressure IBP (section 5.1/5.2): the share of interactive + mixed workers busy with
  interactive work, held in the band [theta - delta, theta + delta] (footnote 2). `interactive_busy` is
  measured in workers' worth: sum over those workers of min(1, interactive in flight / cap), the
  fractional form of "instances running interactive requests".
- Aladdin appendix E.2 eq. 7: N = ceil(k5 * rate + c5), k5 and c5 fitted online by least squares over
  observed (interactive rate, busy workers) pairs; it forecasts the busy count from the arrival rate,
  which moves before the busy count does.
- Aladdin's joint placement and scaling (section 4.2's MIP opens a new bin when no worker fits): the
  placement step's shortfall (`placement_shortfall`: how many more empty workers the requests that fit
  nowhere within their SLO need, policies/aladdin/shortfall.py) is demand the busy count cannot show (those
  requests are not running anywhere). It raises the interactive + mixed target to at least the active workers
  plus the shortfall; a scale-out it causes is counted as `placement_shortfall`.
- Batch backpressure BBP (section 5.3, eq. 1-2, Algorithm 2): queued requests are grouped by deadline;
  a group is late if the output of every request up to and including it cannot be generated before its
  deadline; the batch pool gets the fewest extra workers that leave no group late, and goes to zero when
  the queue is empty.
- Scale-in of the interactive + mixed pool (HPA's scale-down stabilisation): the band is applied to the
  largest need of the last `stabilization_s`, so a dip inside a burst removes nothing; the window holds the
  need itself, in workers' worth, because a band target is relative to the pool size it was computed for.
  Nothing is removed while the burst that a scale-out answered goes on (arrival rate within
  `burst_rate_drop` of its peak since, for at most `burst_hold_s`): while new workers start (cold start,
  Chiron section 2.3) and settle, the busy count measures a fleet in transition; one burst, one change of
  direction. The rate forecast is used only while its fitted slope is positive.
- A warm minimum (`warm_min_interactive`, `warm_s`; off by default): the interactive + mixed pool is not scaled
  in below `warm_min_interactive` workers while traffic is recent: interactive arrivals (or the scaler's start,
  the fleet it was given) less than `warm_s` ago. A burst that comes back after a lull finds warm workers instead
  of one worker and a cold start (30-60 s, Chiron section 2.3) it cannot wait for; once idle for `warm_s`, the pool
  may shrink to `min_interactive`. It never scales out by itself.
- A `PoolScaler` per pool turns targets into desired counts: min/max bounds, cooldowns, and (batch pool) an
  HPA-like stabilisation window for scale-in (the largest target of the last `stabilization_s` wins).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.batch_queue import Z_95, RequestGroup, estimate_wait, request_groups

POOL_INTERACTIVE = "interactive"
POOL_MIXED = "mixed"
POOL_BATCH = "batch"
POOLS = (POOL_INTERACTIVE, POOL_MIXED, POOL_BATCH)
UP, DOWN = "up", "down"


# ---- Aladdin appendix E.2: N = ceil(k5 * rate + c5) ----------------------------------------------
class RateWorkerFit:
    """Online weighted least squares of workers-needed on arrival rate, with exponential forgetting.

    Each `observe` multiplies the weight of older samples by `forget` (1.0: plain least squares).
    `predict(rate)` is k5 * rate + c5; `workers(rate)` is its ceiling (Aladdin E.2 eq. 7). Only rates
    above `min_rate` (Aladdin's R: too few requests per heartbeat to be representative) are used.
    """

    def __init__(self, forget: float = 0.995, min_rate: float = 0.0, min_samples: int = 8) -> None:
        if not 0 < forget <= 1:
            raise ValueError("forget must be in (0, 1]")
        if min_samples < 2:
            raise ValueError("min_samples must be >= 2")
        self.forget, self.min_rate, self.min_samples = forget, min_rate, min_samples
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.samples = 0

    def observe(self, rate: float, workers: float) -> None:
        if not (math.isfinite(rate) and math.isfinite(workers)) or rate < 0 or workers < 0:
            raise ValueError("rate and workers must be finite and >= 0")
        if rate <= self.min_rate:
            return
        f = self.forget
        self._w = self._w * f + 1.0
        self._sx = self._sx * f + rate
        self._sy = self._sy * f + workers
        self._sxx = self._sxx * f + rate * rate
        self._sxy = self._sxy * f + rate * workers
        self.samples += 1

    @property
    def coefficients(self) -> tuple[float, float] | None:
        """(k5, c5), or None until enough distinct rates were seen."""
        if self.samples < self.min_samples or self._w <= 0:
            return None
        mx, my = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mx * mx
        if var <= 1e-12 * max(1.0, mx * mx):
            return None
        k5 = (self._sxy / self._w - mx * my) / var
        return k5, my - k5 * mx

    @property
    def ready(self) -> bool:
        return self.coefficients is not None

    def predict(self, rate: float) -> float | None:
        """None until fitted, and while the fitted slope is not positive: more arrivals never need fewer workers,
        so such a fit learned pairs whose rate and busy count were measured at different moments (the rate's
        window still holds a burst the busy count has already seen end) and forecasts nothing."""
        coef = self.coefficients
        if coef is None or rate <= self.min_rate or coef[0] <= 0:
            return None
        return max(0.0, coef[0] * rate + coef[1])

    def workers(self, rate: float) -> int | None:
        p = self.predict(rate)
        return None if p is None else math.ceil(p - 1e-9)


# ---- Chiron section 2.3 / 5.2: over-provisioning level from historic spikes -----------------------
def arrival_spikes(arrivals: Sequence[float], window_s: float) -> list[float]:
    """Chiron section 2.3: ratio of arrival counts in consecutive windows of the model load time."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    if not arrivals:
        return []
    t0 = min(arrivals)
    n = int((max(arrivals) - t0) // window_s) + 1
    counts = [0] * n
    for t in arrivals:
        counts[int((t - t0) // window_s)] += 1
    return [b / a for a, b in zip(counts[:-2], counts[1:-1], strict=True) if a > 0]   # last window is partial


def theta_from_spikes(spikes: Sequence[float], quantile: float = 0.99, lo: float = 0.1, hi: float = 0.9) -> float:
    """Chiron section 5.2: theta = 1 / tail spike ("a tail spike of 3x the mean rate -> theta = 1/3")."""
    if not 0 < quantile <= 1:
        raise ValueError("quantile must be in (0, 1]")
    if not spikes:
        return hi
    s = sorted(spikes)
    tail = s[min(len(s) - 1, max(0, math.ceil(quantile * len(s)) - 1))]
    return min(hi, max(lo, 1.0 / max(1.0, tail)))


# ---- Chiron section 5.2: the interactive band ----------------------------------------------------
def interactive_target(need: float, current: int, theta: float, delta: float) -> tuple[int, str | None]:
    """Target size of the interactive + mixed pool so that need / size sits in [theta - delta, theta + delta].

    Returns (target, reason); inside the band the target is the current size and reason is None.
    """
    if not 0 < theta <= 1 or delta < 0:
        raise ValueError("need 0 < theta <= 1 and delta >= 0")
    want = math.ceil(need / theta - 1e-9) if need > 0 else 0
    if current <= 0:
        return (want, "ibp_high") if want > 0 else (0, None)
    load = need / current
    if load > theta + delta:
        return max(want, current + 1), "ibp_high"
    if load < theta - delta:
        return min(want, current - 1), "ibp_low"
    return current, None


# ---- Chiron section 5.3, Algorithm 2: batch instances -------------------------------------------
def batch_backpressure(groups: Sequence[RequestGroup], now: float, *, inflight: int, mean_tokens: float,
                       std_tokens: float, fleet_tokens_per_s: float, extra_tokens_per_s: float = 0.0,
                       extra_start_s: float = 0.0, margin_s: float = 0.0, z: float = Z_95) -> int:
    """BBP (Chiron eq. 2): how many request groups would miss their deadline.

    Group g needs the output of the `inflight` running batch requests and of every queued request up to
    and including g: q*mu + z*sigma*sqrt(q) tokens (eq. 1 with the normal approximation). The fleet makes
    `fleet_tokens_per_s` now; `extra_tokens_per_s` more from `extra_start_s` seconds on (workers still
    starting). Group g is late when that is not enough by deadline - margin.
    """
    bbp = 0
    for g in groups:
        q = inflight + g.cumulative
        need = q * mean_tokens + z * std_tokens * math.sqrt(q)
        left = g.deadline - now - margin_s
        have = fleet_tokens_per_s * max(0.0, left) + extra_tokens_per_s * max(0.0, left - extra_start_s)
        if need > have:
            bbp += 1
    return bbp


def batch_workers_needed(groups: Sequence[RequestGroup], now: float, *, inflight: int, mean_tokens: float,
                         std_tokens: float, fleet_tokens_per_s: float, worker_tokens_per_s: float, pending: int,
                         cold_start_s: float, margin_s: float, max_new: int, z: float = Z_95) -> tuple[int, int]:
    """Chiron Algorithm 2: the fewest new batch workers (<= max_new) that make BBP zero.

    Returns (new workers, BBP with none added). Workers still starting (`pending`) and new ones count
    from `cold_start_s` on; each adds `worker_tokens_per_s`.
    """
    def bbp(n: int) -> int:
        return batch_backpressure(groups, now, inflight=inflight, mean_tokens=mean_tokens, std_tokens=std_tokens,
                                  fleet_tokens_per_s=fleet_tokens_per_s,
                                  extra_tokens_per_s=(pending + n) * worker_tokens_per_s,
                                  extra_start_s=cold_start_s, margin_s=margin_s, z=z)

    base = bbp(0)
    if base == 0 or worker_tokens_per_s <= 0:
        return 0, base
    lo, hi = 0, max(0, max_new)           # BBP(n) is non-increasing in n: binary search for the first zero
    if bbp(hi) > 0:
        return hi, base
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bbp(mid) == 0:
            hi = mid
        else:
            lo = mid
    return hi, base


# ---- hysteresis, cooldown, bounds -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScaleAction:
    pool: str
    direction: str          # up | down
    count: int
    reason: str


@dataclass(slots=True)
class PoolScaler:
    """Desired size of one pool from a target: bounds, cooldowns and a scale-in stabilisation window.

    Scale-out is immediate (after `cooldown_out_s` since the last scale-out). Scale-in goes to the largest
    target seen in the last `stabilization_s` (Kubernetes HPA's rule), by at most `max_step_in` workers,
    and not within `cooldown_in_s` of any action. Bounds always win (reason "min" / "max").
    """

    min_workers: int = 0
    max_workers: int = 64
    cooldown_out_s: float = 0.0
    cooldown_in_s: float = 60.0
    stabilization_s: float = 300.0
    max_step_in: int = 1
    last_out: float = -math.inf
    last_action: float = -math.inf
    _targets: deque[tuple[float, int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError("need 0 <= min_workers <= max_workers")
        if self.max_step_in < 1:
            raise ValueError("max_step_in must be >= 1")

    def decide(self, current: int, target: int, now: float, reason_up: str, reason_down: str) -> tuple[int, str | None]:
        if current < self.min_workers:
            return self._act(self.min_workers, now, up=True), "min"
        if current > self.max_workers:
            return self._act(self.max_workers, now, up=False), "max"
        target = min(self.max_workers, max(self.min_workers, target))
        hist = self._targets
        if not hist:                    # no history yet: the current size counts as a recent target
            hist.append((now, current))
        hist.append((now, target))
        while hist and hist[0][0] < now - self.stabilization_s:
            hist.popleft()
        if target > current:
            if now - self.last_out < self.cooldown_out_s:
                return current, None
            return self._act(target, now, up=True), reason_up
        stable = max(t for _, t in hist)
        if stable >= current or now - self.last_action < self.cooldown_in_s:
            return current, None
        return self._act(max(stable, current - self.max_step_in), now, up=False), reason_down

    def force_down(self, now: float, target: int) -> int:
        """Scale in to `target` now (scale-to-zero), bypassing stabilisation and cooldown."""
        target = max(self.min_workers, target)
        self._targets.clear()
        return self._act(target, now, up=False)

    def _act(self, n: int, now: float, up: bool) -> int:
        self.last_action = now
        if up:
            self.last_out = now
        return n


# ---- the combiner ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GlobalConfig:
    theta: float = 0.5                 # target IBP (Chiron section 5.2)
    delta: float = 0.1                 # band half-width (footnote 2)
    min_interactive: int = 1           # interactive + mixed pool bounds
    max_interactive: int = 64
    max_batch: int = 64
    max_total: int = 128               # all pools together (e.g. the GPUs one may rent)
    cooldown_out_s: float = 30.0
    cooldown_in_s: float = 60.0
    stabilization_s: float = 300.0
    max_step_in: int = 1
    cold_start_s: float = 60.0         # worst-case time before a new worker takes traffic
    batch_settle_s: float = 180.0      # after the queue fills: warm-up plus one throughput window before adding
    batch_cooldown_s: float = 300.0    # between batch scale-outs: cold start + warm-up + one throughput window
    deadline_margin_s: float = 120.0   # finish this long before the deadline
    group_span_s: float = 300.0        # request groups: deadline spread within a group
    wait_z: float = Z_95               # normal quantile of the waiting-time estimate
    rate_forget: float = 0.995         # Aladdin fit: exponential forgetting per sample
    rate_min: float = 0.0              # Aladdin's R
    rate_min_samples: int = 8
    use_rate_forecast: bool = True
    burst_rate_drop: float = 0.5       # after a scale-out, no scale-in until the rate falls this far below its peak
    burst_hold_s: float = 600.0        # ... or this long after the scale-out
    warm_min_interactive: int = 0      # interactive + mixed workers kept while traffic is recent (0: off)
    warm_s: float = 0.0                # ... that is, interactive arrivals (or the start) less than this long ago

    def __post_init__(self) -> None:
        if not 0 < self.theta <= 1 or not 0 <= self.delta < self.theta:
            raise ValueError("need 0 < theta <= 1 and 0 <= delta < theta")
        if min(self.max_interactive, self.max_batch, self.max_total) < 0 or self.min_interactive < 0:
            raise ValueError("pool bounds must be >= 0")
        if self.warm_min_interactive < 0 or self.warm_s < 0:
            raise ValueError("warm_min_interactive and warm_s must be >= 0")


@dataclass(frozen=True, slots=True)
class FleetObservation:
    """What the global autoscaler sees at one tick (the gateway builds it from its state; so does the sim)."""

    interactive_busy: float                            # workers' worth of interactive+mixed busy with interactive
    workers: Mapping[str, int]                         # active (taking traffic) per pool
    pending: Mapping[str, int] = field(default_factory=dict)   # starting (cold start) per pool
    interactive_rate: float = 0.0                      # interactive arrivals, req/s
    queue: Sequence[tuple[float, int]] = ()            # batch queue: (deadline, requests), BatchQueue.deadline_counts()
    batch_inflight: int = 0                            # batch requests running anywhere
    batch_tokens_per_s: float = 0.0                    # batch output tokens/s the fleet delivers now
    worker_tokens_per_s: float | None = None           # output tokens/s of one worker saturated with batch work
    output_mean: float = 256.0                         # batch output length, tokens (fitted from finished ones)
    output_std: float = 0.0
    placement_shortfall: float = 0.0                   # more workers the unplaceable requests need (aladdin)


@dataclass(slots=True)
class ScalePlan:
    desired: dict[str, int]
    actions: list[ScaleAction]
    backpressure: dict[str, float]


class GlobalAutoscaler:
    def __init__(self, config: GlobalConfig | None = None) -> None:
        self.config = cfg = config or GlobalConfig()
        common = {"cooldown_in_s": cfg.cooldown_in_s, "stabilization_s": cfg.stabilization_s,
                  "max_step_in": cfg.max_step_in}
        # The interactive + mixed pool's scale-in window holds its need (`update`), not its targets: a second
        # window here would only stretch the first one.
        self.im = PoolScaler(cfg.min_interactive, cfg.max_interactive, cfg.cooldown_out_s,
                             **{**common, "stabilization_s": 0.0})
        self.batch = PoolScaler(0, cfg.max_batch, cfg.batch_cooldown_s, **common)
        self.fit = RateWorkerFit(cfg.rate_forget, cfg.rate_min, cfg.rate_min_samples)
        self._queue_since: float | None = None
        self._needs: deque[tuple[float, float]] = deque()   # (time, interactive need): the scale-in window
        self._burst_rate: float | None = None    # highest arrival rate since the last interactive scale-out
        self._burst_t = -math.inf                # that scale-out's time
        self._traffic_t: float | None = None     # the last tick with interactive arrivals (the first tick: start)

    def update(self, obs: FleetObservation, now: float) -> ScalePlan:
        cfg = self.config
        cur = {p: obs.workers.get(p, 0) + obs.pending.get(p, 0) for p in POOLS}
        active_im = obs.workers.get(POOL_INTERACTIVE, 0) + obs.workers.get(POOL_MIXED, 0)
        total_im = cur[POOL_INTERACTIVE] + cur[POOL_MIXED]
        busy = max(0.0, obs.interactive_busy)
        ibp = busy / active_im if active_im else (1.0 if busy > 0 else 0.0)

        # Interactive + mixed (Chiron 5.2), with Aladdin's forecast of the busy count (E.2 eq. 7).
        # Forecast from the fit so far, then learn this tick's pair (the busy count lags the rate).
        forecast = self.fit.predict(obs.interactive_rate) if cfg.use_rate_forecast else None
        if active_im and obs.interactive_rate > 0:
            self.fit.observe(obs.interactive_rate, busy)
        need = max(busy, forecast or 0.0)
        target, why = interactive_target(need, total_im, cfg.theta, cfg.delta)
        needs = self._needs
        needs.append((now, need))
        while needs[0][0] < now - cfg.stabilization_s:
            needs.popleft()
        if why != "ibp_high":
            # Scale-in is judged on the largest need of the stabilisation window (HPA's rule, applied to the demand
            # itself: a band target is relative to the size it was computed for). Not while the burst a scale-out
            # answered goes on: its arrival rate still within `burst_rate_drop` of the highest since then (for at
            # most `burst_hold_s`), whatever the busy count says while the new workers start and settle. Removing
            # a worker the burst then needs again costs a cold start and a second change of direction (Chiron's
            # hysteresis, section 2.3); an overshoot is given back once the load falls.
            held = max(n for _, n in needs)
            target, why = interactive_target(held, total_im, cfg.theta, cfg.delta)
            burst_on = (self._burst_rate is not None and now - self._burst_t < cfg.burst_hold_s
                        and obs.interactive_rate >= (1.0 - cfg.burst_rate_drop) * self._burst_rate)
            if why != "ibp_low" or burst_on:
                target, why = total_im, None
        if self._burst_rate is not None:
            self._burst_rate = max(self._burst_rate, obs.interactive_rate)
        reason_up = "rate_forecast" if forecast is not None and forecast > busy and why == "ibp_high" else "ibp_high"
        short = max(0.0, obs.placement_shortfall)
        if short > 0 and active_im + math.ceil(short) > target:    # joint placement and scaling
            target, reason_up = active_im + math.ceil(short), "placement_shortfall"
        if obs.interactive_rate > 0 or self._traffic_t is None:
            self._traffic_t = now
        if target < total_im and now - self._traffic_t < cfg.warm_s:    # traffic is recent: keep the warm minimum
            target = max(target, min(total_im, cfg.warm_min_interactive))
        room = cfg.max_total - cur[POOL_BATCH]
        target = min(target, max(cfg.min_interactive, room))
        new_im, reason_im = self.im.decide(total_im, target, now, reason_up, "ibp_low")
        if new_im > total_im:
            self._burst_rate, self._burst_t = obs.interactive_rate, now
        elif new_im < total_im:
            self._burst_rate = None
        n_int = min(new_im, max(1 if new_im else 0, math.floor(cfg.theta * new_im + 1e-9)))
        desired = {POOL_INTERACTIVE: n_int, POOL_MIXED: new_im - n_int}

        # Batch (Chiron 5.3, Algorithm 2).
        queued = sum(n for _, n in obs.queue)
        groups = request_groups(obs.queue, cfg.group_span_s)
        bbp = 0
        wait = 0.0
        reason_b: str | None = None
        if queued == 0:
            self._queue_since = None
            if cur[POOL_BATCH]:                 # Algorithm 2, lines 17-19: nothing left, retire them all
                desired[POOL_BATCH] = self.batch.force_down(now, 0)
                reason_b = "queue_empty"
            else:
                desired[POOL_BATCH] = 0
        else:
            if self._queue_since is None:
                self._queue_since = now
            thr = max(0.0, obs.batch_tokens_per_s)
            q_all = obs.batch_inflight + queued
            wait = estimate_wait(q_all, obs.output_mean, obs.output_std, thr, cfg.wait_z)
            per_worker = obs.worker_tokens_per_s or 0.0
            room_b = max(0, min(cfg.max_batch, cfg.max_total - new_im) - cur[POOL_BATCH])
            n_new, bbp = batch_workers_needed(
                groups, now, inflight=obs.batch_inflight, mean_tokens=obs.output_mean, std_tokens=obs.output_std,
                fleet_tokens_per_s=thr, worker_tokens_per_s=per_worker, pending=obs.pending.get(POOL_BATCH, 0),
                cold_start_s=cfg.cold_start_s, margin_s=cfg.deadline_margin_s, max_new=room_b, z=cfg.wait_z)
            settled = now - self._queue_since >= cfg.batch_settle_s and per_worker > 0
            if n_new > 0 and settled:
                desired[POOL_BATCH], reason_b = self.batch.decide(cur[POOL_BATCH], cur[POOL_BATCH] + n_new, now,
                                                                  "deadline", "deadline")
            else:
                desired[POOL_BATCH] = cur[POOL_BATCH]      # hold until the queue is empty (Algorithm 2)

        # Actions: a change of the interactive+mixed total is split over its two pools (a mere relabel
        # between them is no scale action); the batch pool's change is its own.
        actions = []
        left = new_im - total_im
        for pool in (POOL_INTERACTIVE, POOL_MIXED):
            diff = desired[pool] - cur[pool]
            step = max(0, min(diff, left)) if left > 0 else min(0, max(diff, left))
            if step:
                actions.append(ScaleAction(pool, UP if step > 0 else DOWN, abs(step), reason_im or "bounds"))
                left -= step
        if left:        # the split moved the other way: book the rest on the mixed pool
            actions.append(ScaleAction(POOL_MIXED, UP if left > 0 else DOWN, abs(left), reason_im or "bounds"))
        diff = desired[POOL_BATCH] - cur[POOL_BATCH]
        if diff:
            actions.append(ScaleAction(POOL_BATCH, UP if diff > 0 else DOWN, abs(diff), reason_b or "bounds"))
        coef = self.fit.coefficients
        bp = {"ibp": ibp, "bbp": float(bbp), "theta": cfg.theta, "interactive_need": need,
              "batch_wait_s": wait, "batch_groups": float(len(groups)), "placement_shortfall": short}
        if forecast is not None:
            bp["forecast_busy"] = forecast
        if coef is not None:
            bp["k5"], bp["c5"] = coef
        return ScalePlan(desired, actions, bp)
