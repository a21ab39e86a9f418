"""The one leg runner: every exchange of a request with a worker (a plain request, a P/D prefill leg, a P/D decode
leg, a continuation of a broken stream) goes through `LegRunner.run`, which owns what each leg needs:

    pace       the leg's first-token limit from the stall rule (policies/pace.py `first_token_limit`): its
               predicted time to first token on that worker (the learner's model of the worker's profile: the
               prefill of its prompt behind the prompts still waiting there for their first token), at least
               the worker's own pace; the gap limit from the worker's pace (gateway/pipeline/relay.py)
    stalls     a leg that stalls before its first token or mid-stream: the worker is suspected (ejected,
               gateway/fleet/registry.py), its other exchanges given up
    ejection   every outcome counts for outlier ejection (`note_outcome`), but a refusal of the request itself
               (4xx, 429, too long) or a failed LoRA adapter load (the adapter's failure, gateway/fleet/adapters.py);
               a refused connection for the health checks (`report_failure`)
    learning   plain and decode legs are announced to the learner (`dispatched`: its entry in the request's
               context, whose progress its loop reports to the placement step and so to the decode policy of a
               P/D request) and their timings observed (`answered`)
    services   the service order may rewrite the body of a generating leg (gateway/tenancy/services.py)

The attempt loop (gateway/pipeline/attempts.py) turns the leg's end into an outcome value and decides what follows:
resume a broken stream, place a request that has not started again (`Attempts.place_again`), or answer; it
alone writes the request's placement state (`ctx.tried` included). The runner is given what it uses (the
relay, registry, learner, metrics, service order and LoRA adapters) and the request's context
(gateway/request/context.py); it does not know the loop.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from engine_adapters.vllm.kv_transfer import extract_kv_transfer_params
from gateway.fleet.adapters import LORA_BAD, LORA_LOAD
from gateway.fleet.registry import WorkerState
from gateway.ops import observe
from gateway.pipeline.relay import LegSend
from gateway.wire.results import STATUS_429, TOO_LONG, RelayResult, UpstreamFailure
from gateway.wire.resume import StreamResume
from gateway.wire.upstream import ClientConnectorError

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.fleet.adapters import AdapterRouter
    from gateway.fleet.registry import Registry
    from gateway.ops.metrics import GatewayMetrics
    from gateway.pipeline.learning import Learner
    from gateway.pipeline.relay import Relay
    from gateway.request.context import RequestContext
    from gateway.tenancy.services import ServiceOrder

PLAIN = "upstream"   # the kinds of leg (observe.leg's names)
PREFILL = "prefill"
DECODE = "decode"
REFUSED = "prefill_refused"  # UpstreamFailure.kind of a prefill leg the worker refused (4xx): not retried


class LegRunner:
    """Runs one leg on one worker for the dispatcher (module docstring)."""

    def __init__(self, config: GatewayConfig, relay: Relay, registry: Registry, learner: Learner,
                 metrics: GatewayMetrics, services: ServiceOrder, adapters: AdapterRouter) -> None:
        self.relay = relay
        self.registry = registry
        self.learner = learner
        self.metrics = metrics
        self.services = services
        self.adapters = adapters
        self.pace = relay.pace
        cap = config.pd.prefill_timeout_s
        self.prefill_cap_s = cap if cap is not None else config.timeouts.first_byte_s
        # worker id -> [Σ prompt tokens, Σ prompt tokens²] of legs sent there still without a first token
        self.waiting: dict[str, list[float]] = {}

    def first_limit(self, worker_id: str, prompt_tokens: float, sq: float) -> float | None:
        """The stall rule's first-token limit of a leg on `worker_id` with `prompt_tokens` (Σl, Σl² = `sq`) of
        prompts waiting there, its own included (None: no hung detection, the fixed timeouts only)."""
        if self.pace is None:
            return None
        return self.pace.first_limit(worker_id, self.learner.prefill_s(worker_id, prompt_tokens, sq))

    async def run(self, ctx: RequestContext, ws: WorkerState, kind: str, payload: bytes,
                  resume: StreamResume | None = None, retry_5xx: bool = True,
                  remote_kv: bool = False) -> RelayResult:
        """Run one leg of `ctx` on `ws` (`kind`: PLAIN, PREFILL or DECODE; `remote_kv`: a decode leg given the
        prefill worker's KV). Returns the result (a stream that broke mid-way has `midstream_error`), or raises
        UpstreamFailure when the leg failed before the client saw a byte of it."""
        wid = ws.id
        w = self.waiting.get(wid)
        if w is None:
            w = self.waiting[wid] = [0.0, 0.0]
        n = float(ctx.feats.prompt_tokens)
        w[0] += n
        w[1] += n * n
        waiting = [True]

        def first() -> None:
            if waiting[0]:
                waiting[0] = False
                w[0] -= n
                w[1] -= n * n

        first_s = self.first_limit(wid, w[0], w[1])
        try:
            if kind == PREFILL:
                return await self._prefill(ctx, ws, payload, first_s)
            await self.adapters.ensure(ctx.feats, ws)   # a LoRA adapter the worker lacks: loaded first
            return await self._generate(ctx, ws, kind, payload, resume, retry_5xx, remote_kv, first_s, first)
        except UpstreamFailure as f:
            self._failed(ctx, ws, kind, f)
            raise
        finally:
            first()
            if kind != PREFILL:
                self.adapters.done(ctx.feats, ws)

    async def _generate(self, ctx: RequestContext, ws: WorkerState, kind: str, payload: bytes,
                        resume: StreamResume | None, retry_5xx: bool, remote_kv: bool, first_s: float | None,
                        first: object) -> RelayResult:
        wid = ws.id
        t_sent = self.learner.dispatched(ctx, wid)
        if self.services.enabled:
            payload = self.services.dispatched(ctx.feats, payload)
        result = await self.relay.forward(LegSend(
            ctx.send, getattr(ws, ctx.route.url_attr), payload, observe.leg(ctx.record, kind, wid, ctx.upstream_headers),
            ctx.client_headers, ctx.stream, ctx.strip_usage, retry_5xx, ctx.state, resume, wid,
            first_s if ctx.stream else None, first, ctx.refusal_fails))
        if result.stalled:
            self.registry.suspect(wid, f"stalled mid-stream: {result.midstream_error}")
        self.registry.note_outcome(wid, result.midstream_error is None and result.status < 500)
        if result.midstream_error is not None:
            self.metrics.upstream_error(wid, "midstream")
        # A decode leg given remote KV did not prefill: its first token teaches the learner nothing of prefill.
        t_learn = result.first_token_at if remote_kv and result.first_token_at is not None else t_sent
        self.learner.answered(ctx.feats, wid, t_learn, result)
        return result

    async def _prefill(self, ctx: RequestContext, ws: WorkerState, leg: bytes,
                       first_s: float | None) -> RelayResult:
        """A P/D prefill leg: the whole (max_tokens 1) answer within the stall limit, its kv_transfer_params."""
        wid = ws.id
        limit = min(first_s if first_s is not None else math.inf, self.prefill_cap_s)
        t0 = time.perf_counter()
        try:
            status, body, _ = await self.relay.exchange(getattr(ws, ctx.route.url_attr), leg,
                                                     observe.leg(ctx.record, PREFILL, wid, ctx.upstream_headers), limit, wid)
        except TimeoutError as e:
            raise UpstreamFailure("timeout", f"prefill leg: no answer within {limit:.3g}s ({e or 'stalled'})") \
                from None
        except OSError as e:
            kind = "connect" if isinstance(e, (ClientConnectorError, ConnectionRefusedError)) else "body"
            raise UpstreamFailure(kind, f"prefill leg: {type(e).__name__}: {e}") from None
        if status >= 500:
            raise UpstreamFailure("status_5xx", f"prefill worker answered {status}", status)
        if status != 200:  # the request itself is refused: the decode worker will answer it the same way
            raise UpstreamFailure(REFUSED, f"prefill worker answered {status}", status)
        self.registry.note_outcome(wid, True)
        took = time.perf_counter() - t0
        if self.pace is not None:
            self.pace.of(wid).observe(took, None)
        return RelayResult(status=200, first_token_at=t0 + took, kv_params=extract_kv_transfer_params(body))

    async def whole(self, ws: WorkerState, path: str, payload: bytes, headers: bytes, timeout_s: float,
                    retry_5xx: bool) -> tuple[int, bytes, bytes]:
        """A passthrough leg (gateway/api/passthrough.py: embeddings, tokenize, pooling routes): one whole exchange
        with `ws`, reachable by `abort_worker`, its outcome counted for outlier ejection like any leg's:
        (status, body, content type), or UpstreamFailure (a 5xx too, with `retry_5xx`)."""
        wid = ws.id
        try:
            status, body, ctype = await self.relay.exchange(ws.rec.url + path, payload, headers, timeout_s, wid)
        except TimeoutError as e:
            f = UpstreamFailure("timeout", f"no answer within {timeout_s:.3g}s ({e or type(e).__name__})")
        except OSError as e:
            f = UpstreamFailure("connect" if isinstance(e, (ClientConnectorError, ConnectionRefusedError)) else "body",
                                f"{type(e).__name__}: {e}")
        else:
            self.registry.note_outcome(wid, status < 500)
            if status < 500 or not retry_5xx:
                return status, body, ctype
            self.metrics.upstream_error(wid, "status_5xx")
            raise UpstreamFailure("status_5xx", f"worker answered {status}", status, body, ctype)
        self.metrics.upstream_error(wid, "connect")
        self.registry.note_outcome(wid, False)
        if f.kind == "connect":
            self.registry.report_failure(wid)
        raise f

    def _failed(self, ctx: RequestContext, ws: WorkerState, kind: str, f: UpstreamFailure) -> None:
        wid = ws.id
        label = "pd_prefill" if kind == PREFILL else f.kind
        self.metrics.upstream_error(wid, label)
        observe.leg_failed(ctx.record, label, f.detail)
        if f.kind in (REFUSED, STATUS_429, TOO_LONG, LORA_LOAD, LORA_BAD):   # the request's (or its adapter's)
            return                                                            # failure, not the worker's
        self.registry.note_outcome(wid, False)
        if f.kind == "connect":
            self.registry.report_failure(wid)
        elif f.kind == "timeout" and (ctx.stream or kind == PREFILL):  # no first token within the stall limit
            self.registry.suspect(wid, f"stalled before its first token: {f.detail}")
