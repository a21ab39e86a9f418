"""The attempt loop: a request's life from admission to its answer, as one explicit state machine.

    admitted   the model's placement step (policies/placement.py) places it, with its reservations in the state
               store; no room: the model's admission queue (gateway/request/admission.py over policies/admission.py)
    placed     one worker, or for the P/D profile a decode worker and perhaps a prefill worker
    legs       each exchange with a worker is a leg and runs through the one leg runner (gateway/pipeline/legs.py: pace,
               stalls, ejection, learning, adapters, service order): a plain leg, or a P/D prefill leg then a
               decode leg (what they send: gateway/pipeline/pd_legs.py), or the continuation of a broken stream
    outcome    every leg ends in a value, `LegOutcome` (`Step`): DONE (answer), RESUME (a started stream broke:
               continue it elsewhere, gateway/wire/resume.py), RETRY (it failed or stalled before the client saw a
               byte), MOVE (rebalancing asked for another worker before its first token: the rebalancer,
               gateway/pipeline/rebalancer.py, only interrupts the leg and says where), PREFILL_AGAIN / PREFILL_LOCAL (a
               P/D prefill leg failed: another prefill worker, or the decode worker prefills locally)
    next       this module alone decides what follows, and every re-placement goes through `place_again`, by an
               ordered reason (PLACE_AGAIN): RETRY, MOVE, FALL_BACK (the model's fallbacks), REPLACE_PREFILL
               (P/D); a P/D request's RETRY or MOVE re-places its decode leg, through the same placement,
               reservations, hooks and admission queue as any request
    finish     the reservations given back, the placement step and the hooks told (`release`)

This module is the only writer of the request's placement state in its context (gateway/request/context.py): `worker`,
`prefill`, `pd`, `decision`, `tried`, `moved_to`, `payload`, `refusal_fails`. The dispatcher
(gateway/pipeline/dispatch.py) reads the request and hands it here; the leg runner reports, it does not decide.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from engine_adapters.base import Usage
from engine_adapters.vllm.kv_transfer import prefill_body
from gateway.ops import observe
from gateway.pipeline.legs import DECODE, PLAIN, PREFILL, REFUSED
from gateway.pipeline.pd_legs import DECODE_RETRY, PREFILL_FALLBACK, PREFILL_RETRY
from gateway.pipeline.rebalancer import MoveAsked
from gateway.request.parse import CHAT, ParsedRequest
from gateway.state.ratelimit import RateLimited
from gateway.wire import errors
from gateway.wire.errors import GatewayError
from gateway.wire.results import TOO_LONG as WORKER_TOO_LONG
from gateway.wire.results import RelayResult, UpstreamFailure
from gateway.wire.resume import StreamResume, continuation_body, resumable, text_tokenize_body, tokenize_body
from policies.fallbacks import CONTEXT_WINDOW, NO_WORKER, failure_reason, fallback_targets, refusal_reason
from policies.placement import TOO_LONG, context_limit, has_room, reserved_tokens, too_long_message
from policies.rebalance import move_exclusions
from policies.shedding import WILL_MISS
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, RequestFeatures, WorkerView

if TYPE_CHECKING:
    from gateway.fleet.registry import WorkerState
    from gateway.pipeline.pd_legs import PdPlan
    from gateway.request.context import ModelRuntime, RequestContext
    from gateway.request.parse import ClientHeaders, Route

log = logging.getLogger("fleetgate.attempts")

MOVED = "moved by rebalancing before its first token"
TOKENIZE_TIMEOUT_S = 2.0
SERVED_MODEL = b"x-served-model"    # response header: the model that served the request

# Why a request that has not started is placed again (`Attempts.place_again`), in the order the rules act.
RETRY = "retry"          # its leg failed or stalled before the first token
MOVE = "move"            # rebalancing: a better worker for a request still queued (gateway/pipeline/rebalancer.py)
FALL_BACK = "fall_back"  # model fallbacks: the next of its model's fallbacks serves it
REPLACE_PREFILL = "replace_prefill"  # P/D: its prefill leg failed; another prefill worker (none: local prefill)
PLACE_AGAIN = (RETRY, MOVE, FALL_BACK, REPLACE_PREFILL)


class Step(Enum):
    """What a leg's end asks for (the loop decides what follows)."""

    DONE = "done"                    # the answer ended (a stream that ended with an error event included)
    RESUME = "resume"                # a started stream broke: continue it on another worker
    RETRY = "retry"                  # the leg failed or stalled before the client saw a byte of it
    MOVE = "move"                    # rebalancing interrupted it before its first token
    PREFILL_AGAIN = "prefill_again"  # a P/D prefill leg failed or stalled: another prefill worker may take it
    PREFILL_LOCAL = "prefill_local"  # a P/D prefill leg was refused (4xx): the decode worker prefills locally


@dataclass(frozen=True, slots=True)
class LegOutcome:
    """How one leg ended, as a value."""

    step: Step
    result: RelayResult | None = None        # DONE, RESUME: what the leg relayed
    failure: UpstreamFailure | None = None   # RETRY, PREFILL_*: why it failed
    detail: str | None = None                # RESUME: why the stream broke; MOVE: the proposed destination
    answer: tuple[int, bytes, bytes] | None = None   # DONE of a passthrough leg: (status, body, content type)


class Front(Protocol):
    """What the loop uses of the dispatcher (gateway/pipeline/dispatch.py): the models' runtimes and a request's
    reading for another model (a fallback)."""

    runtimes: dict[str, ModelRuntime]

    def runtime(self, model: str) -> ModelRuntime: ...

    def features(self, req: ParsedRequest, route: Route, rt: ModelRuntime, rid: str,
                 hdrs: ClientHeaders) -> RequestFeatures: ...


class Attempts:
    """The attempt loop (module docstring). Built by the dispatcher with the collaborators it shares."""

    def __init__(self, front: Front, d: Any) -> None:
        self.front = front
        self.config = d.config
        self.store = d.store
        self.registry = d.registry
        self.relay = d.relay
        self.adapter = d.adapter
        self.metrics = d.metrics
        self.slo = d.slo
        self.hooks = d.hooks
        self.legs = d.legs
        self.pd = d.pd
        self.adapters = d.adapters
        self.rebalancer = d.rebalancer
        self.pooling = d.pooling
        self.no_room = d.no_room
        self.retry_after_s = d.retry_after_s
        self.shield_release = d.shield_release
        self.attempts = self.config.limits.retries + 1
        self.max_resumes = self.config.resume.max_attempts

    # --- the loop ------------------------------------------------------------------------------------------------
    async def run(self, ctx: RequestContext) -> RelayResult:
        """Admit the request, then run its legs until one ends the request (module docstring)."""
        try:
            await self.admit(ctx)
        except GatewayError as e:   # the model cannot take it: the next of its fallbacks may
            why = _admission_fallback_reason(e)
            if why is None or not await self.place_again(ctx, FALL_BACK, why):
                raise
        plan = self.pd.plan(ctx) if ctx.pd else None
        resume = self._resumable(ctx)
        failure: UpstreamFailure | None = None
        retries = 0
        out, met = 0, None
        try:
            while True:
                ws = ctx.worker
                kind, payload, remote_kv = PLAIN, ctx.payload, False
                if plan is not None:
                    kind = DECODE
                    payload, remote_kv = await self._decode_payload(ctx, plan)
                t0 = time.perf_counter()
                fallback = not ctx.state.started and bool(self._fallbacks(ctx, NO_WORKER)
                                                          or self._fallbacks(ctx, CONTEXT_WINDOW))
                ctx.refusal_fails = fallback
                o = await self._generate(ctx, ws, kind, payload, resume, retries + 1 < self.attempts or fallback,
                                         remote_kv, plan is None and (resume is not None or not ctx.stream))
                step, broken, again = o.step, None, RETRY
                if plan is not None and o.result is not None:
                    self.pd.observe_decode(ctx.rt.model, remote_kv, t0, o.result)
                if step is Step.DONE or step is Step.RESUME:
                    result = o.result
                    if result.midstream_error is not None and resume is None:  # ended with an error event
                        self.metrics.count_stream_break(ctx.rt.model, "not_resumable")
                    if step is Step.DONE:
                        if resume is not None and resume.legs:
                            _join_legs(result, resume, ctx.state.tokens)
                        if result.status == 200 and result.midstream_error is None:
                            out = result.output_tokens
                        met = self.slo.judge(ctx.feats, ctx.stream, ctx.t0, result, time.perf_counter())
                        return result
                    broken = o.detail   # the relay left the stream open: continue it elsewhere
                    if resume.first_token_at is None:
                        resume.first_token_at = result.first_token_at
                elif step is Step.MOVE:   # no first token yet: placed again, or (response started) continued
                    ctx.moved_to = o.detail
                    if ctx.state.started:
                        broken, again = MOVED, MOVE
                    elif await self.place_again(ctx, MOVE):
                        continue
                    else:
                        failure = UpstreamFailure("moved", f"{MOVED}; no worker took it")
                else:   # Step.RETRY
                    failure = o.failure
                    if ctx.state.started:  # a continuation leg failed before its first byte
                        broken = failure.detail
                    else:
                        retries += 1
                    log.debug("request %s failed on %s (%s); %s", ctx.feats.request_id, ws.id, failure.detail,
                              "retrying" if broken is not None or retries < self.attempts else "giving up")
                if broken is not None:
                    ended = await self._continue(ctx, resume, broken, again)
                    if ended is not None:
                        return ended
                    continue  # placed on another worker, ctx.payload is the continuation
                if (retries < self.attempts and failure.kind != WORKER_TOO_LONG
                        and await self.place_again(ctx, RETRY)):
                    self.metrics.count_retry(ctx.rt.model)
                    continue
                # out of retries, or nobody else to try: the last step, another model
                why = _failure_fallback_reason(failure)
                if why is None or ctx.state.started or not await self.place_again(ctx, FALL_BACK, why):
                    break
                retries = 0
                plan = self.pd.plan(ctx) if ctx.pd else None
        finally:
            if ctx.prefill is not None:   # the client left during a prefill leg
                pre, ctx.prefill = ctx.prefill, None
                await self.release(ctx, pre, feedback=False)
            if ctx.worker is not None:
                ws, ctx.worker = ctx.worker, None
                await self.release(ctx, ws, out, slo_met=met)
            if ctx.moved_to is not None and self.rebalancer is not None:
                self.rebalancer.finished(ctx.rt.model, met)
        if failure is None:
            raise errors.no_worker(ctx.rt.model, self.retry_after_s)
        return await self.answer_failure(ctx, failure)

    async def _generate(self, ctx: RequestContext, ws: WorkerState, kind: str, payload: bytes,
                        resume: StreamResume | None, retry_5xx: bool, remote_kv: bool, movable: bool) -> LegOutcome:
        """A generating leg (plain or decode) through the leg runner, where the rebalancer can interrupt it."""
        leg = self.legs.run(ctx, ws, kind, payload, resume, retry_5xx, remote_kv)
        try:
            if self.rebalancer is None:
                result = await leg
            else:
                result = await self.rebalancer.run_leg(ctx, ws, leg, movable)
                if isinstance(result, MoveAsked):
                    ctx.tried.append(ws.id)
                    return LegOutcome(Step.MOVE, detail=result.dst)
        except UpstreamFailure as f:
            ctx.tried.append(ws.id)
            return LegOutcome(Step.RETRY, failure=f)
        if result.midstream_error is None or ctx.state.ended:
            return LegOutcome(Step.DONE, result)
        ctx.tried.append(ws.id)
        return LegOutcome(Step.RESUME, result, detail=result.midstream_error)

    async def passthrough(self, candidates: list[WorkerState], path: str, payload: bytes,
                          headers: bytes) -> tuple[int, bytes, bytes]:
        """A passthrough call (gateway/api/passthrough.py: no reservation, an answer relayed whole) on the first of
        `candidates` that answers, each try a leg of the leg runner (outlier ejection, health reports), at most
        `limits.retries` + 1 of them; a 5xx from the last is its answer. Raises UpstreamFailure when none
        answered."""
        failure: UpstreamFailure | None = None
        tries = candidates[: self.attempts]
        for i, ws in enumerate(tries):
            try:
                o = LegOutcome(Step.DONE, answer=await self.legs.whole(ws, path, payload, headers,
                                                                      self.relay.first_byte_s, i + 1 < len(tries)))
            except UpstreamFailure as f:
                o = LegOutcome(Step.RETRY, failure=f)
            if o.step is Step.DONE:
                return o.answer
            failure = o.failure
        raise failure if failure is not None else UpstreamFailure("connect", "no worker to try")

    # --- the P/D plan's prefill legs ------------------------------------------------------------------------------
    async def _decode_payload(self, ctx: RequestContext, plan: PdPlan) -> tuple[bytes, bool]:
        """The body of the next decode leg and whether it carries the producer's KV: the first runs the prefill
        leg (if planned); a later one (another decode worker, a continuation) prefills locally, `ctx.payload`."""
        if plan.started:
            return ctx.payload, False
        plan.started = True
        body = orjson.loads(ctx.payload)
        params = await self._prefill(ctx, body, plan) if ctx.prefill is not None else None
        return self.pd.decode_body(ctx, body, params, plan)

    async def _prefill(self, ctx: RequestContext, body: dict[str, Any], plan: PdPlan) -> dict[str, Any] | None:
        """Run the prefill leg, placed again on another prefill worker when it fails or stalls (REPLACE_PREFILL);
        the params, or None for a local prefill. Each prefill reservation is released as its leg ends."""
        leg = prefill_body(body)
        tried: list[str] = []
        for attempt in range(self.attempts):
            ws = ctx.prefill
            if ws is None:
                break
            if attempt:
                self.pd.decision(ctx.rt.model, PREFILL_RETRY)
            t0 = time.perf_counter()
            try:
                o = LegOutcome(Step.DONE, await self.legs.run(ctx, ws, PREFILL, leg))
            except UpstreamFailure as f:
                o = LegOutcome(Step.PREFILL_LOCAL if f.kind == REFUSED else Step.PREFILL_AGAIN, failure=f)
            ctx.prefill = None
            await self.release(ctx, ws, feedback=False)
            if o.step is Step.DONE:
                return self.pd.prefilled(ctx.rt.model, plan, o.result, t0)
            log.debug("prefill leg of %s failed on %s: %s", ctx.feats.request_id, ws.id, o.failure.detail)
            tried.append(ws.id)   # a prefill worker's failure says nothing of the decode legs: not in ctx.tried
            if (o.step is Step.PREFILL_LOCAL or attempt + 1 == self.attempts
                    or not await self.place_again(ctx, REPLACE_PREFILL, exclude=tried)):
                break
        self.pd.decision(ctx.rt.model, PREFILL_FALLBACK)
        return None

    # --- what follows a leg ----------------------------------------------------------------------------------------
    def _resumable(self, ctx: RequestContext) -> StreamResume | None:
        """A stream that could be continued elsewhere should its worker fail mid-stream (gateway/wire/resume.py)."""
        if not ctx.stream or self.max_resumes == 0 or not resumable(ctx.req.body, ctx.route is CHAT):
            return None
        opts = ctx.req.body.get("stream_options")
        continuous = isinstance(opts, dict) and opts.get("continuous_usage_stats") is True
        resume = StreamResume(ctx.route is CHAT, not ctx.strip_usage, continuous)
        resume.elsewhere = functools.partial(self._elsewhere, ctx)   # the relay's stall judge asks it
        return resume

    async def _continue(self, ctx: RequestContext, resume: StreamResume | None, why: str,
                        reason: str = RETRY) -> RelayResult | None:
        """The stream broke after the client got bytes: place its continuation on another worker (None), or end
        the stream (the result: the usage and [DONE] when nothing remained to generate, else an error event).
        `reason`: RETRY (its worker failed), or MOVE (rebalancing took it off before its first token; a move
        does not use up a resume attempt)."""
        model = ctx.rt.model
        delivered = resume.broke(ctx.state.tokens) if resume is not None else None
        if delivered is None or (delivered.tool_calls and delivered.finish_reason is None):
            self.metrics.count_stream_break(model, "not_resumable")
            await self.relay.end_stream(ctx.send, ctx.state, error=why)
            return RelayResult(status=200, midstream_error=why)
        chat = ctx.route is CHAT
        if delivered.finish_reason is not None or continuation_body(ctx.req.body, chat, "", ctx.state.tokens) is None:
            return await self._close_locally(ctx, resume)
        attempts = self.max_resumes + (ctx.moved_to is not None)
        if resume.legs >= attempts or not await self.place_again(ctx, reason):
            self.metrics.count_stream_break(model, "ended")
            log.info("request %s: stream broke (%s); not resumed (%s)", ctx.feats.request_id, why,
                     "no other worker" if resume.legs < attempts else "out of resume attempts")
            await self.relay.end_stream(ctx.send, ctx.state, error=why)
            return RelayResult(status=200, midstream_error=why)
        # Exact counts from the new worker's tokenizer: an event may carry several tokens (vLLM merges the
        # outputs of a slow consumer), so the events relayed only bound the tokens sent from below.
        ws = ctx.worker
        want_prompt = resume.client_usage and resume.prompt_tokens is None
        sent, prompt = await asyncio.gather(
            self._count_tokens(ws, text_tokenize_body(delivered.text, ctx.req.body.get("model")))
            if delivered.text else _none(),
            self._count_tokens(ws, tokenize_body(ctx.req.body, chat)) if want_prompt else _none())
        if prompt is not None:
            resume.prompt_tokens = prompt
        if sent is not None and sent > ctx.state.tokens:
            resume.tokens_before = ctx.state.tokens = sent
        body = continuation_body(ctx.req.body, chat, delivered.text, resume.tokens_before)
        if body is None:  # the exact count says nothing remains
            ctx.worker = None
            await self.release(ctx, ws)
            return await self._close_locally(ctx, resume)
        if reason == RETRY:
            self.metrics.count_stream_break(model, "resumed")
        observe.note_resume(ctx.record)
        resume.legs += 1
        ctx.payload = orjson.dumps(body)
        log.info("request %s: stream broke after %d tokens (%s); resuming on %s", ctx.feats.request_id,
                 ctx.state.tokens, why, ws.id)
        return None

    async def _close_locally(self, ctx: RequestContext, resume: StreamResume) -> RelayResult:
        """Everything was delivered but the end: the usage (if asked) and [DONE] from here."""
        self.metrics.count_stream_break(ctx.rt.model, "completed")
        await self.relay.end_stream(ctx.send, ctx.state, resume.closing_events())
        return RelayResult(status=200, tokens=ctx.state.tokens, first_token_at=resume.first_token_at,
                           usage=Usage(resume.prompt_tokens or ctx.feats.prompt_tokens, ctx.state.tokens))

    async def _count_tokens(self, ws: WorkerState, body: bytes) -> int | None:
        """A token count from the worker's POST /tokenize (None if it cannot tell)."""
        try:
            r = await self.relay.upstream.fetch(ws.rec.url + "/tokenize", TOKENIZE_TIMEOUT_S, b"POST", body,
                                                b"Content-Type: application/json\r\nAccept: */*\r\n")
            count = orjson.loads(r.body).get("count") if r.status == 200 else None
        except (OSError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return None
        return count if isinstance(count, int) else None

    async def answer_failure(self, ctx: RequestContext, failure: UpstreamFailure) -> RelayResult:
        """Every worker tried failed before the client saw a byte: the last one's own error answer, unchanged,
        or a 502."""
        if failure.status is not None:
            ctx.state.started = ctx.state.ended = True
            await ctx.send({"type": "http.response.start", "status": failure.status,
                            "headers": [(b"content-type", failure.content_type), *ctx.client_headers]})
            await ctx.send({"type": "http.response.body", "more_body": False,
                            "body": self.adapter.openai_error(failure.status, failure.body)})
            return RelayResult(status=failure.status)
        raise errors.upstream_failed(failure.detail)

    # --- placing again ---------------------------------------------------------------------------------------------
    async def place_again(self, ctx: RequestContext, reason: str, why: str = "",
                          exclude: Collection[str] = ()) -> bool:
        """Cancel the placement of a request that has not started on its worker (or of a broken stream, whose
        continuation goes next) and place it again, without the workers it already tried; False when no other
        worker takes it (the request keeps nothing then).

        The one step behind every rule that moves a request with no first token yet. `reason` is one of
        PLACE_AGAIN, in the order the rules act when several apply at once: RETRY (its leg failed or stalled;
        the first), then MOVE (rebalancing), then FALL_BACK (the next of the model's fallbacks, `why` says what
        failed: a reason of policies/fallbacks.py); REPLACE_PREFILL: a P/D request's prefill leg, on a prefill
        worker not in `exclude` (none: the decode worker prefills locally). A P/D request's RETRY or MOVE
        re-places its decode leg: another decode-capable worker, which prefills locally. Each new rule adds its
        reason there and its case here, not a copy of this step."""
        if reason not in PLACE_AGAIN:
            raise ValueError(f"unknown reason to place a request again: {reason!r}")
        if reason == FALL_BACK:
            return await self._fall_back(ctx, why)
        if reason == REPLACE_PREFILL:
            ctx.prefill = await self._another_prefill(ctx, exclude)
            return ctx.prefill is not None
        old, ctx.worker = ctx.worker, None
        if old is not None:
            if ctx.pd:   # the placement step hears the move once the decode leg has its new worker (`_place`)
                ctx.replacing = old.id
                await self.release(ctx, old, feedback=False, hooks=True)
            else:
                await self.release(ctx, old)
        placed = await self._place_again(ctx, reason)
        if not placed and ctx.replacing is not None:   # no new decode worker: the step forgets the request
            ctx.rt.placement.finished(ctx.feats, ctx.replacing, 0, time.time(), None)
            ctx.replacing, ctx.pd = None, False
        return placed

    async def _place_again(self, ctx: RequestContext, reason: str) -> bool:
        if self._all_tried(ctx):   # waiting would not help: the next step (a fallback model) may
            return False
        # a move: the destination rebalancing proposed, if it still fits, then any other (policies/rebalance.py)
        dst = ctx.moved_to if reason == MOVE else None
        for exclude in move_exclusions(dst, (ws.id for ws in self.registry.candidates(ctx.rt.model)), ctx.tried):
            if await self._place(ctx, exclude):
                return True
        # Nobody else can take it now (the others at their caps, or the policy would queue it): it waits in the
        # admission queue as a new request would, within its own queue budget, rather than failing.
        try:
            await self._wait_for_slot(ctx, ctx.decision.retry_at if ctx.decision is not None else None)
        except GatewayError:
            return False
        return ctx.worker is not None

    async def _another_prefill(self, ctx: RequestContext, exclude: Collection[str]) -> WorkerState | None:
        views, by_id = self.views(ctx.rt.model, exclude, (ROLE_PREFILL,))
        while views:
            wid = ctx.rt.placement.retry_prefill(ctx.feats, views)
            ws = by_id.get(wid) if wid is not None else None
            if ws is None:
                return None
            if await self.reserve(ctx, ws, ctx.feats.prompt_tokens):
                return ws
            views = [v for v in views if v.id != ws.id]
        return None

    def _all_tried(self, ctx: RequestContext) -> bool:
        """Every worker that could answer the model has failed the request (a sleeping engine on a shared host
        may still wake: not all tried then)."""
        model = ctx.rt.model
        if self.pooling is not None and self.pooling.handles(model):
            return False
        return not self._elsewhere(ctx)

    def _elsewhere(self, ctx: RequestContext, resume: StreamResume | None = None) -> list[str]:
        """The workers the request (a broken stream's continuation, `resume`) could go to now."""
        if resume is not None and resume.legs >= self.max_resumes + (ctx.moved_to is not None):
            return []
        here = ctx.worker.id if resume is not None and ctx.worker is not None else None
        return [ws.id for ws in self.registry.candidates(ctx.rt.model)
                if ws.id not in ctx.tried and ws.id != here and ws.rec.role != ROLE_PREFILL]

    def _fallbacks(self, ctx: RequestContext, why: str) -> list[str]:
        """The models the request may still fall back to for `why`, in order (policies/fallbacks.py)."""
        mc = self.config.models.get(ctx.models[0]) if ctx.models else None
        if mc is None:
            return []
        return fallback_targets(mc.fallbacks, mc.context_window_fallbacks, why, self.config.aliases, ctx.models,
                                ctx.tenant.may_use if ctx.tenant is not None else None)

    async def _fall_back(self, ctx: RequestContext, why: str) -> bool:
        """FALL_BACK: the request, which has not started, leaves its model for the first of the remaining
        fallbacks that places it (admission queue included). False, the request as it was, when none does."""
        if ctx.state.started:
            return False
        targets = self._fallbacks(ctx, why)
        if not targets:
            return False
        for ws, feedback in ((ctx.worker, True), (ctx.prefill, False)):
            if ws is not None:
                await self.release(ctx, ws, feedback=feedback)
        ctx.worker = ctx.prefill = None
        before = (ctx.rt, ctx.feats, ctx.payload, ctx.strip_usage, ctx.decision, list(ctx.tried), len(ctx.models))
        source = ctx.rt.model
        for target in targets:
            self._switch_model(ctx, target)
            self.metrics.count_fallback(source, target, why)
            log.info("request %s: %s (%s); falling back to %s", ctx.feats.request_id, source, why, target)
            try:
                await self.admit(ctx)
                return True
            except GatewayError as e:
                log.info("request %s: fallback %s cannot take it either (%s)", ctx.feats.request_id, target,
                         e.message)
        ctx.rt, ctx.feats, ctx.payload, ctx.strip_usage, ctx.decision, ctx.tried, n = before
        del ctx.models[n:]
        served_header(ctx)
        return False

    def _switch_model(self, ctx: RequestContext, model: str) -> None:
        """Make `model` the request's model: its runtime, features and body (`model` rewritten) afresh."""
        rt = self.front.runtime(model)
        body = {**ctx.req.body, "model": model}
        shaped = self.adapter.shape_request(b"", body, ctx.req.stream, True)
        ctx.rt, ctx.payload, ctx.strip_usage = rt, shaped.body, shaped.strip_usage
        ctx.feats = self.front.features(ParsedRequest(body, model, ctx.req.stream, ctx.req.max_tokens,
                                                      ctx.req.priority), ctx.route, rt, ctx.feats.request_id, ctx.hdrs)
        ctx.decision, ctx.tried = None, []
        ctx.models.append(model)
        served_header(ctx)

    # --- admission: the placement step plus reservations; the admission queue when nothing fits -------------------
    async def admit(self, ctx: RequestContext) -> None:
        rt = ctx.rt
        q = rt.queue
        retry_at = None
        if q.queue.admits_directly():
            placed, retry_at = await self._place_or_retry(ctx)
            if placed:
                return
        if self.no_room is not None:  # may evict batch work, or refuse a batch-runner request at once
            await self.no_room(rt, ctx.feats)
        await self._wait_for_slot(ctx, retry_at)

    async def _wait_for_slot(self, ctx: RequestContext, retry_at: float | None) -> None:
        """Queue the request until a drain places it (ctx.worker set) or refuses it (a 429 GatewayError); a
        GatewayError too when no worker serves its model or the queue is full."""
        rt = ctx.rt
        q = rt.queue
        self._check_serving(rt.model)
        if q.queue.full():
            raise errors.overloaded(rt.model, self.retry_after_s, "admission queue full")
        t = time.perf_counter()
        swap_s = self.pooling.wake_s(rt.model) if self.pooling is not None else 0.0   # its model asleep: a swap
        ctx.swap_s = max(ctx.swap_s, swap_s)   # the admission rule counts it as the queue budget does
        # its queue budget ends its predicted prefill before its TTFT target (policies/shedding.py)
        prefill_s = rt.placement.queue_prefill_s(ctx.feats, self.views(rt.model)[0]) if ctx.feats.slo_ttft_s else 0.0
        await q.wait(ctx, ctx.feats, retry_at, swap_s, prefill_s)
        self.metrics.observe_queue_wait(rt.model, time.perf_counter() - t)
        observe.note_queue(ctx.record, time.perf_counter() - t)

    async def place_queued(self, ctx: RequestContext) -> tuple[bool, float | None]:
        """The admission queue's drain tries a waiting request (gateway/request/admission.py)."""
        self._check_serving(ctx.rt.model)
        return await self._place_or_retry(ctx)

    def _check_serving(self, model: str) -> None:
        """Waiting helps only while some healthy worker can answer the model (prefill workers alone cannot),
        or a sleeping engine of it on a shared host can be woken (gateway/control/pooling.py: asked to)."""
        if not any(ws.rec.role != ROLE_PREFILL for ws in self.registry.candidates(model)):
            pooling = self.pooling
            if pooling is not None and pooling.handles(model) and pooling.servable(model):
                pooling.demand(model)
                return
            raise errors.no_worker(model, self.retry_after_s)

    async def _place_or_retry(self, ctx: RequestContext) -> tuple[bool, float | None]:
        placed = await self._place(ctx, ctx.tried)   # a request waiting again after a failed leg: not there again
        return placed, (None if placed or ctx.decision is None else ctx.decision.retry_at)

    def views(self, model: str, exclude: Collection[str] = (),
              roles: Collection[str] | None = None) -> tuple[list[WorkerView], dict[str, WorkerState]]:
        """The candidates: healthy workers serving `model` (of `roles`, any by default) under their cap."""
        inflight = self.store.inflight()
        views: list[WorkerView] = []
        by_id: dict[str, WorkerState] = {}
        for ws in self.registry.candidates(model):
            wid = ws.rec.id
            if (exclude and wid in exclude) or (roles is not None and ws.rec.role not in roles):
                continue
            f = inflight.get(wid)
            if f is None:
                n = tokens_in = 0
            else:
                n, tokens_in = f.requests, f.tokens
            if not has_room(n, ws.rec.cap):
                continue
            views.append(ws.view(n, tokens_in))
            by_id[wid] = ws
        return views, by_id

    async def _place(self, ctx: RequestContext, exclude: Collection[str]) -> bool:
        """Ask the placement step and reserve what it chose (both workers for a P/D pair); a worker another
        replica filled meanwhile is dropped from the candidates and the step asked again. Sets ctx.decision
        (the last answer), and ctx.worker / ctx.prefill / ctx.pd when placed; the hooks hear it `placed`.
        A P/D request whose decode leg is re-placed (`ctx.replacing`) gets another decode-capable worker."""
        t = time.perf_counter()
        rt, feats = ctx.rt, ctx.feats
        if ctx.replacing is not None:
            return await self._place_decode(ctx, exclude)
        views, by_id = self.views(rt.model, exclude)
        views = self.adapters.annotate(feats, views)
        store, rid = self.store, feats.request_id
        placed = False
        try:
            while True:
                d = rt.placement.place(feats, views, time.time(), ctx.swap_s)
                ctx.decision = d
                ws = by_id.get(d.worker_id) if d.worker_id is not None else None
                if ws is None:
                    if d.reason == TOO_LONG:
                        raise errors.context_too_long(too_long_message(feats, context_limit(views)))
                    if d.reason == WILL_MISS and rt.placement.last_shed is not None:
                        shed = rt.placement.last_shed
                        raise errors.will_miss(rt.model, shed.retry_after_s, shed.message)
                    return False
                if not await store.try_reserve(ws.id, rid, ws.rec.cap, reserved_tokens(feats)):
                    views = [v for v in views if v.id != ws.id]
                    continue
                pre = by_id.get(d.prefill_worker_id) if d.prefill_worker_id is not None else None
                if pre is not None and not await store.try_reserve(pre.id, rid, pre.rec.cap, feats.prompt_tokens):
                    await store.release(ws.id, rid)
                    views = [v for v in views if v.id != pre.id]
                    continue
                ctx.pd = rt.placement.dispatched(feats, d, time.time())
                ctx.worker, ctx.prefill = ws, pre
                ctx.routing_s = time.perf_counter() - t
                self.hooks.placed(ctx, ws)
                placed = True
                return True
        finally:
            if placed or ctx.decision is None or ctx.decision.reason != TOO_LONG:
                self.metrics.observe_routing(rt.model, time.perf_counter() - t)

    async def _place_decode(self, ctx: RequestContext, exclude: Collection[str]) -> bool:
        """The decode leg of a P/D request elsewhere: the P/D policy's choice among the decode-capable workers
        not tried (it prefills locally); the placement step hears the move, the hooks `placed`."""
        rt, feats = ctx.rt, ctx.feats
        views, by_id = self.views(rt.model, exclude, (ROLE_DECODE, ROLE_MIXED))
        while views:
            wid = rt.placement.retry_decode(feats, views, time.time())
            ws = by_id.get(wid) if wid is not None else None
            if ws is None:
                return False
            if await self.reserve(ctx, ws, reserved_tokens(feats)):
                self.pd.decision(rt.model, DECODE_RETRY)
                rt.placement.moved(feats, ctx.replacing, ws.id, time.time())
                ctx.worker, ctx.replacing = ws, None
                self.hooks.placed(ctx, ws)
                return True
            views = [v for v in views if v.id != ws.id]
        return False

    async def reserve(self, ctx: RequestContext, ws: WorkerState, tokens: int) -> bool:
        return await self.store.try_reserve(ws.id, ctx.feats.request_id, ws.rec.cap, tokens)

    async def release(self, ctx: RequestContext, ws: WorkerState, output_tokens: int = 0, feedback: bool = True,
                      slo_met: bool | None = None, hooks: bool | None = None) -> None:
        """Give back the request's reservation on `ws`; with `feedback`, the placement step hears that the
        request ended there (with `output_tokens` when it completed, and whether it met its SLO); with `hooks`
        (default: `feedback`) the hooks hear it `released`. Wakes the queues the worker serves."""
        rt, feats = ctx.rt, ctx.feats
        try:
            if not self.store.release_nowait(ws.id, feats.request_id):  # no I/O needed: a leased slot, memory
                release = self.store.release(ws.id, feats.request_id)
                # a networked store: a cancelled client must not leak the slot
                await (asyncio.shield(release) if self.shield_release else release)
        finally:
            if feedback if hooks is None else hooks:
                self.hooks.released(ctx, ws)
            if feedback:
                rt.placement.finished(feats, ws.id, output_tokens, time.time(), slo_met)
                ctx.pd = False   # the placement step forgot it: placed again, it is decided afresh
            for m in ws.models:
                other = self.front.runtimes.get(m)
                if other is not None:
                    other.queue.kick()


def served_header(ctx: RequestContext) -> None:
    """The response names the model that serves the request (X-Served-Model)."""
    ctx.client_headers[:] = [(k, v) for k, v in ctx.client_headers if k != SERVED_MODEL]
    ctx.client_headers.append((SERVED_MODEL, ctx.rt.model.encode()))


def _admission_fallback_reason(e: GatewayError) -> str | None:
    """Why a request the model's placement refused may fall back to another model (None: it may not; the
    caller's own rate limit never moves it)."""
    if isinstance(e, RateLimited):
        return None
    return refusal_reason(e.status, isinstance(e, errors.ContextTooLong))


def _failure_fallback_reason(failure: UpstreamFailure | None) -> str | None:
    """Why a request whose workers all failed before its first byte may fall back (None: it may not)."""
    if failure is None:
        return NO_WORKER
    return failure_reason(failure.status, failure.kind == "timeout", failure.kind == WORKER_TOO_LONG)


async def _none() -> None:
    return None


def _join_legs(result: RelayResult, resume: StreamResume, tokens: int) -> None:
    """The last leg's result as the whole stream's: first token, all tokens delivered, the original usage."""
    result.first_token_at = resume.first_token_at or result.first_token_at
    result.tokens = tokens
    result.usage = resume.total_usage() or result.usage
