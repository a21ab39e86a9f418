"""Per-request SLOs: where a request's targets come from, and how each finished request is judged.

Resolution: TTFT and ATGT targets are resolved independently; the first source that sets one wins:
  1. request headers `x-slo-ttft-ms` / `x-slo-tpot-ms` (milliseconds, > 0; anything else is a 400),
  2. `models.<model>.slo_classes.<class>`, 3. `models.<model>.slo`, 4. `slo_classes.<class>`, 5. `slo`.
The class is RequestFeatures.request_class (`X-Request-Class: batch`, else interactive).

Measurement (ATGT = average time per output token after the first, Aladdin appendix G "Metrics"; a
request attains its SLO when both targets hold; a missing target holds trivially):
  * streaming: TTFT = first content token relayed to the client - request arrival at the gateway;
    ATGT = (last token - first token) / (n - 1), n from the usage block (else the tokens counted).
  * non-streaming: the whole answer is the client's first byte, so TTFT and ATGT are not separable;
    the request meets its SLO iff its response time <= ttft_target + tpot_target x (n - 1), i.e. it
    arrived no later than a streamed answer within both targets would have finished.
  * refused for capacity (429 from the admission queue, 503 no worker) after the model resolved:
    missed. A non-200 answer from a worker (e.g. a 400 for a too-long prompt) is not an SLO matter
    and is not counted; a stream that broke mid-way is missed. Requests with no target are not counted.

Series: counters `fleetgate_slo_requests_total{model,class,result="met|missed"}` (since start) and the
gauge `fleetgate_slo_attainment_ratio{model,class}` over a sliding window of the last `slo_window_s`
seconds (at most the last 10,000 judged requests per series), computed when /metrics is scraped; a
series with no request in its window is not exported.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.config import GatewayConfig, SloConfig
from gateway.request.hooks import RequestHook
from gateway.state.ratelimit import RateLimited
from gateway.wire import errors
from gateway.wire.results import RelayResult
from policies.slo_targets import check_slo, whole_answer_met
from policies.types import CLASS_BATCH, CLASS_INTERACTIVE, RequestFeatures

if TYPE_CHECKING:
    from gateway.request.context import Outcome, RequestContext

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
MAX_TARGET_MS = 86_400_000.0  # one day: anything longer is a typo, not an SLO
WINDOW_MAX_REQUESTS = 10_000
_CLASSES = (CLASS_INTERACTIVE, CLASS_BATCH)


def parse_target_ms(raw: bytes | str | None, header: str) -> float | None:
    """A header's SLO target in seconds (None when absent); a clear 400 when it is not a usable number."""
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not (0.0 < ms <= MAX_TARGET_MS):  # also rejects nan and inf
        shown = raw.decode("latin-1") if isinstance(raw, bytes) else raw
        raise errors.bad_request(
            f"`{header}` must be a number of milliseconds in (0, {MAX_TARGET_MS:.0f}], got {shown[:40]!r}.", header)
    return ms / 1000.0


def _first(*values: float | None) -> float | None:
    for v in values:
        if v is not None:
            return v
    return None


def _ms(cfg: SloConfig | None, attr: str) -> float | None:
    v = getattr(cfg, attr) if cfg is not None else None
    return v / 1000.0 if v is not None else None


class _Window:
    """Judged requests of one (model, class) in the last `window_s` seconds (bounded), and the
    met / missed totals since start (the counters)."""

    __slots__ = ("events", "met", "window_s", "total_met", "total_missed")

    def __init__(self, window_s: float) -> None:
        self.events: deque[tuple[float, bool]] = deque()
        self.met = 0
        self.window_s = window_s
        self.total_met = self.total_missed = 0

    def add(self, now: float, met: bool) -> None:
        if len(self.events) >= WINDOW_MAX_REQUESTS:
            self.met -= self.events.popleft()[1]
        self.events.append((now, met))
        if met:
            self.met += 1
            self.total_met += 1
        else:
            self.total_missed += 1

    def prune(self, now: float) -> None:
        ev, cut = self.events, now - self.window_s
        while ev and ev[0][0] < cut:
            self.met -= ev.popleft()[1]

    def ratio(self) -> float | None:
        return self.met / len(self.events) if self.events else None


@dataclass(frozen=True, slots=True)
class SloView:
    """One (model, request class) of the SLO book, read from outside it (the status page)."""

    attainment: float | None   # the windowed ratio (None: no judged request in the window)
    met: int                   # judged requests that met their SLO since start
    missed: int                # ... and that missed it
    window_s: float            # the attainment window
    ttft_s: float | None       # the configured targets (None: none)
    tpot_s: float | None


class SloBook(RequestHook):
    """SLO targets per (model, class) from the config, header parsing, and attainment accounting. A request
    hook (gateway/request/hooks.py): every finished request is judged and counted (`finished`)."""

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.window_s = config.slo_window_s
        self._targets: dict[tuple[str, str], tuple[float | None, float | None]] = {}
        self._windows: dict[tuple[str, str], _Window] = {}
        registry.register(_SloCollector(self))

    # --- resolution (per request) ----------------------------------------------------------------
    def config_targets(self, model: str, request_class: str) -> tuple[float | None, float | None]:
        """(ttft_s, tpot_s) the config gives a model and class (cached; the config does not change)."""
        key = (model, request_class)
        hit = self._targets.get(key)
        if hit is None:
            cfg = self.config
            mc = cfg.models.get(model)
            mcls = mc.slo_classes.get(request_class) if mc is not None else None
            mslo = mc.slo if mc is not None else None
            gcls = cfg.slo_classes.get(request_class)
            sources = (mcls, mslo, gcls, cfg.slo)
            hit = (_first(*(_ms(s, "ttft_ms") for s in sources)), _first(*(_ms(s, "tpot_ms") for s in sources)))
            self._targets[key] = hit
        return hit

    def targets(self, model: str, request_class: str, raw_ttft: bytes | None,
                raw_tpot: bytes | None) -> tuple[float | None, float | None]:
        """The request's (ttft_s, tpot_s): its headers where given, else the config's."""
        ttft, tpot = self.config_targets(model, request_class)
        if raw_ttft is not None:
            ttft = parse_target_ms(raw_ttft, TTFT_HEADER)
        if raw_tpot is not None:
            tpot = parse_target_ms(raw_tpot, TPOT_HEADER)
        return ttft, tpot

    # --- measurement (per finished request) -------------------------------------------------------
    @staticmethod
    def judge(feats: RequestFeatures, stream: bool, t0: float, result: RelayResult, t_end: float) -> bool | None:
        """Did one answered request meet its SLO (module docstring)? None: not an SLO matter (no target, or
        a non-200 answer); t0 / t_end are perf_counter() at arrival and after the last byte."""
        ttft_t, tpot_t = feats.slo_ttft_s, feats.slo_tpot_s
        if (ttft_t is None and tpot_t is None) or result.status != 200:
            return None
        if result.midstream_error is not None:
            return False
        if result.first_token_at is not None:  # streamed
            return check_slo(t0, result.first_token_at, result.last_token_at, result.output_tokens, ttft_t,
                             tpot_t).met
        if not stream and result.usage is not None:  # the whole answer at once
            return whole_answer_met(t0, t_end, result.usage.completion_tokens, ttft_t, tpot_t)
        return False  # a stream without any token

    def record(self, feats: RequestFeatures, stream: bool, t0: float, result: RelayResult, t_end: float) -> None:
        """Judge one answered request and count it."""
        met = self.judge(feats, stream, t0, result, t_end)
        if met is not None:
            self._count(feats, met)

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        """Request hook: an answered request is judged and counted; one the gateway turned away for capacity
        (429 / 503, not the caller's own rate limit) is a miss."""
        err = outcome.error
        if err is None:
            if outcome.result is not None:
                self.record(ctx.feats, ctx.stream, ctx.t0, outcome.result, outcome.t_end)
        elif outcome.feats is not None and err.status in (429, 503) and not isinstance(err, RateLimited):
            self.record_refused(outcome.feats)

    def record_refused(self, feats: RequestFeatures) -> None:
        """The request was turned away for capacity (429 / 503): a miss, if it had a target."""
        if feats.slo_ttft_s is not None or feats.slo_tpot_s is not None:
            self._count(feats, False)

    def _count(self, feats: RequestFeatures, met: bool) -> None:
        key = (feats.model, feats.request_class)
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(self.window_s)
        w.add(time.monotonic(), met)

    def totals(self) -> dict[str, tuple[int, int]]:
        """Per model, requests judged since start over every class: (met, missed)."""
        out: dict[str, tuple[int, int]] = {}
        for (model, _cls), w in list(self._windows.items()):
            met, missed = out.get(model, (0, 0))
            out[model] = (met + w.total_met, missed + w.total_missed)
        return out

    def attainment(self, model: str, request_class: str = CLASS_INTERACTIVE) -> float | None:
        """The windowed ratio (None: no judged request in the window)."""
        w = self._windows.get((model, request_class))
        if w is None:
            return None
        w.prune(time.monotonic())
        return w.ratio()

    def windows(self) -> list[tuple[str, str, float | None, int, int]]:
        """Every (model, class) judged so far: (model, class, the windowed ratio or None, met, missed since
        start)."""
        now = time.monotonic()
        out = []
        for (model, rclass), w in list(self._windows.items()):
            w.prune(now)
            out.append((model, rclass, w.ratio(), w.total_met, w.total_missed))
        return out

    def view(self, model: str, request_class: str) -> SloView | None:
        """What the book knows of one model and class: attainment, totals and targets (None: nothing judged)."""
        w = self._windows.get((model, request_class))
        if w is None:
            return None
        ttft, tpot = self.config_targets(model, request_class)
        return SloView(self.attainment(model, request_class), w.total_met, w.total_missed, self.window_s, ttft, tpot)


class _SloCollector:
    """Builds the SLO series at scrape time from plain counts (the hot path touches no metric object)."""

    RATIO = "fleetgate_slo_attainment_ratio"
    RATIO_DOC = "Fraction of requests that met their SLO over the sliding window (slo_window_s seconds)."
    COUNT = "fleetgate_slo_requests"
    COUNT_DOC = "Requests judged against their SLO, by result."

    def __init__(self, book: SloBook) -> None:
        self.book = book

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.RATIO, self.RATIO_DOC, labels=["model", "class"])
        yield CounterMetricFamily(self.COUNT, self.COUNT_DOC, labels=["model", "class", "result"])

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(self.RATIO, self.RATIO_DOC, labels=["model", "class"])
        c = CounterMetricFamily(self.COUNT, self.COUNT_DOC, labels=["model", "class", "result"])
        for model, rclass, ratio, met, missed in self.book.windows():
            if ratio is not None:
                g.add_metric([model, rclass], ratio)
            c.add_metric([model, rclass, "met"], met)
            c.add_metric([model, rclass, "missed"], missed)
        yield g
        yield c
