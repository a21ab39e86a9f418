"""Send one request to one worker and relay the answer to the ASGI client as it arrives.

The request/response exchange with the worker goes through gateway/wire/upstream.py, the gateway's one pooled
HTTP/1.1 client to workers (~12 us CPU per request at concurrency 32 where aiohttp's client took ~72 us, and httpx
3.5-5 ms), built here from the config's `upstream:` and `timeouts:` sections; health checks, scrapes, discovery,
webhooks and the P/D prefill leg (gateway/pipeline/pd_legs.py) use the same pool. Rules:

- nothing has been sent to the client yet -> any failure raises `UpstreamFailure` and the dispatcher
  may retry on another worker (connection refused/reset, timeout to headers, a 5xx status, a body
  cut short);
- the client has seen the response start -> a failure ends the stream with an SSE error event and
  `data: [DONE]` (docs/reference/vllm-interface.md §2), never a hang; except for a resumable stream
  (`StreamResume`, gateway/wire/resume.py): the relay forwards whole events only, keeps the bytes it forwarded
  (tool-call events once the call is complete: a broken leg's held ones are dropped, their tokens not
  delivered), and leaves the stream open for the dispatcher to continue on another worker (or end with
  `end_stream`);
- a continuation leg (`resume.legs > 0`) sends no response start: its events are rewritten into the first
  answer's identity; an answer that is not a 200 stream is an `UpstreamFailure` of kind "continuation";
- a worker is given as long as the stall rule allows (policies/pace.py: the caller's first-token limit, from the
  leg's predicted time to first token, else the worker's own recent pace) to send a stream's first token, and
  its pace for each next one, within the fixed `timeouts:`; a stream silent past those limits is judged
  (`_Watch`, policies/pace.py `FleetPace.judge`): kept while the worker feeds its other streams, while the fleet
  is as slow, or while no worker it could move to is progressing, else given up (`RelayResult.stalled`); the
  tokens a stream gets after a silence near its limit teach the worker's pace in flight (`note_late`); a stall
  before the headers is an `UpstreamFailure` of kind "timeout", and `abort_worker` fails every exchange in
  flight on a worker the gateway suspects (the dispatcher then resumes or retries them elsewhere);
- upstream statuses and bodies other than retried 5xx are passed through unchanged, except that an error
  body is put in OpenAI's shape by the engine adapter (vLLM's `type: BadRequestError, code: 400` ->
  `type: invalid_request_error`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_adapters.base import EngineAdapter
from engine_adapters.openai_errors import sse_error_event
from gateway.config import GatewayConfig, TimeoutsConfig
from gateway.wire.results import STATUS_429, TOO_LONG, RelayResult, ResponseState, UpstreamFailure
from gateway.wire.resume import StreamResume
from gateway.wire.upstream import TlsSettings, UpstreamConnection, UpstreamPool
from policies.pace import FleetPace, WorkerPace

_BODY_END = {"type": "http.response.body", "body": b"", "more_body": False}


@dataclass(slots=True)
class LegSend:
    """One generating leg for `Relay.forward`: where it goes, what it sends, and how its answer is relayed."""

    send: Any                    # ASGI send of the client
    url: str
    payload: bytes
    upstream_headers: bytes      # extra request headers, as encoded lines (gateway/wire/upstream.py encode_headers)
    client_headers: list[tuple[bytes, bytes]]
    stream: bool
    strip_usage: bool
    retry_5xx: bool              # a 5xx answer is a failure the caller places again (UpstreamFailure), not relayed
    state: ResponseState
    resume: StreamResume | None = None   # the stream may be continued elsewhere should this worker fail
    worker_id: str | None = None         # its pace bounds the waits, and `abort_worker` can reach the exchange
    first_s: float | None = None         # the stream's first-token limit (the caller's stall rule; default: pace)
    on_first: Callable[[], object] | None = None   # called at the stream's first token
    retry_429: bool = False      # so is a 429, and the engine's 400 for a request over its context


class _Watch:
    """One stream's stall judge, asked by its connection when the read timeout passes (gateway/wire/upstream.py
    `on_silence`): more time to wait, or None to give the stream up. The fixed `timeouts:` stay the bound."""

    __slots__ = ("relay", "pace", "worker_id", "first_s", "resume", "started")

    def __init__(self, relay: Relay, pace: FleetPace, worker_id: str, first_s: float,
                 resume: StreamResume | None) -> None:
        self.relay = relay
        self.pace = pace
        self.worker_id = worker_id
        self.first_s = first_s
        self.resume = resume
        self.started = False  # its first token came

    def __call__(self, silent_s: float) -> float | None:
        relay = self.relay
        cap = relay.idle_s if self.started else relay.first_byte_s
        if silent_s >= cap:
            return None
        elsewhere = self.resume.elsewhere if self.resume is not None else None
        legs = relay.legs
        peers = [(w, bool(legs.get(w))) for w in elsewhere(self.resume)] if elsewhere is not None else []
        wait = self.pace.judge(self.worker_id, self.started, silent_s, self.first_s, time.perf_counter(), peers)
        return None if wait is None else min(wait, cap - silent_s)


class _NoPace:
    """A stand-in for WorkerPace when hung detection is off: the relay's per-token bookkeeping goes nowhere."""

    __slots__ = ("last_token_at",)

    def __init__(self) -> None:
        self.last_token_at: float | None = None

    def note_late(self, silent_s: float, first: bool, now: float) -> None:
        pass


def make_upstream_pool(config: GatewayConfig) -> UpstreamPool:
    """The one client to workers, as configured (`upstream:`, `timeouts.connect_s`)."""
    u = config.upstream
    return UpstreamPool(config.timeouts.connect_s, u.keepalive_expiry_s, max_connections=u.max_connections,
                        max_connections_per_host=u.max_connections_per_host, pool_timeout_s=u.pool_timeout_s,
                        dns_ttl_s=u.dns_cache_ttl_s, tls=TlsSettings(**u.tls.model_dump()))


class Relay:
    def __init__(self, adapter: EngineAdapter, timeouts: TimeoutsConfig, upstream: UpstreamPool,
                 pace: FleetPace | None = None) -> None:
        self.adapter = adapter
        self.upstream = upstream
        self.first_byte_s = timeouts.first_byte_s
        self.idle_s = timeouts.idle_s
        self.pace = pace  # None: fixed timeouts only
        self.legs: dict[str, set[UpstreamConnection]] = {}  # worker id -> exchanges in flight on it

    def abort_worker(self, worker_id: str, suspected: bool = True) -> int:
        """A worker left rotation: its exchanges in flight are given up (their requests resumed or retried
        elsewhere). Suspected hung (its pace said so): all of them at once. Ejected by failed health checks:
        those silent for the gap floor, now or later (each wait for the worker's next bytes is cut to the floor),
        so a worker slow to answer probes on a crowded host keeps the streams it still feeds; without hung
        detection, none. Returns how many exchanges were touched."""
        legs = list(self.legs.get(worker_id, ()))
        if suspected:
            for conn in legs:
                conn.abort("the worker is suspected hung")
        elif self.pace is not None and worker_id not in self.pace.unpaced:   # a turns engine's silences are planned
            for conn in legs:
                conn.on_silence = None   # silent for the floor: given up, whatever the stall judge would say
                conn.set_read_timeout(self.pace.settings.gap_floor_s)
        return len(legs)

    async def exchange(self, url: str, payload: bytes, headers: bytes, timeout_s: float,
                       worker_id: str) -> tuple[int, bytes, bytes]:
        """One whole non-relayed exchange with a worker (a P/D prefill leg, a passthrough call) within
        `timeout_s`, reachable by `abort_worker`: (status, body, content type). Raises TimeoutError or OSError."""
        track = self.legs.get(worker_id)
        if track is None:
            track = self.legs[worker_id] = set()
        conn: UpstreamConnection | None = None
        clean = False
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self.upstream.request(url, headers, payload, timeout_s, track=track)
                body = await conn.read()
            clean = True
            return conn.status, body, conn.content_type
        finally:
            if conn is not None:
                _end(conn, track, clean)

    async def forward(self, leg: LegSend) -> RelayResult:
        """Send `leg` to its worker and relay the answer to the client (module docstring; fields: `LegSend`)."""
        send, payload, stream, state, resume = leg.send, leg.payload, leg.stream, leg.state, leg.resume
        worker_id, retry_429 = leg.worker_id, leg.retry_429
        track = None
        limits = (self.first_byte_s, self.idle_s)
        watch = None
        if worker_id is not None:
            track = self.legs.get(worker_id)
            if track is None:
                track = self.legs[worker_id] = set()
            if self.pace is not None:
                first, gap = self.pace.limits(worker_id)
                if leg.first_s is not None:
                    first = leg.first_s
                limits = (min(first, self.first_byte_s), min(gap, self.idle_s))
                if stream and worker_id not in self.pace.unpaced:
                    watch = _Watch(self, self.pace, worker_id, first, resume)
        t_sent = time.perf_counter()
        resp = await self._open(leg.url, payload, leg.upstream_headers, stream, limits[0], track)
        clean = False
        try:
            status = resp.status
            ctype = resp.content_type
            if status >= 500 and leg.retry_5xx:
                body = await self._read_all(resp, "status_5xx")
                raise UpstreamFailure("status_5xx", f"worker answered {status}", status, body, ctype)
            if status == 429 and retry_429:
                body = await self._read_all(resp, STATUS_429)
                raise UpstreamFailure(STATUS_429, "worker answered 429", status, body, ctype)
            if resume is not None and resume.legs and (status != 200 or not ctype.startswith(b"text/event-stream")):
                body = await self._read_all(resp, "continuation")
                raise UpstreamFailure("continuation", f"worker answered {status} to a continuation", status, body,
                                      ctype)
            if not (stream and ctype.startswith(b"text/event-stream")):
                body = await self._read_all(resp, "body")
                clean = True
                if retry_429 and self.adapter.context_exceeded(status, body):
                    raise UpstreamFailure(TOO_LONG, "longer than the worker's context", status, body, ctype)
                result = RelayResult(status=status)
                if status == 200:
                    result.usage = self.adapter.parse_usage(body)
                elif status >= 400:
                    body = self.adapter.openai_error(status, body)
                state.started = True
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", ctype), (b"content-length", b"%d" % len(body)),
                                        *leg.client_headers]})
                state.ended = True
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return result
            result = await self._relay_stream(resp, send, ctype, leg.client_headers, leg.strip_usage, state, resume,
                                              limits[1], leg.on_first, watch, t_sent)
            clean = result.midstream_error is None
            if clean and self.pace is not None and worker_id is not None and result.first_token_at is not None:
                self.pace.of(worker_id).observe(result.first_token_at - t_sent, result.max_gap)
            return result
        finally:
            _end(resp, track, clean)

    async def _open(self, url: str, payload: bytes, headers: bytes, stream: bool, first_s: float,
                    track: set[UpstreamConnection] | None) -> UpstreamConnection:
        # A stream's headers come at once (vLLM), then its first token within `first_s` (the worker's pace), then
        # each next one within the gap its pace allows (_relay_stream); a non-streaming answer comes whole,
        # first_byte_s bounds the wait for it.
        try:
            if stream:
                return await self.upstream.request(url, headers, payload, first_s, first_s, True, track=track)
            return await self.upstream.request(url, headers, payload, self.first_byte_s, track=track)
        except TimeoutError as e:
            raise UpstreamFailure("timeout", f"no response headers in time ({type(e).__name__})") from None
        except OSError as e:
            raise UpstreamFailure("connect", f"{type(e).__name__}: {e}") from None

    async def _read_all(self, resp: UpstreamConnection, kind: str) -> bytes:
        try:
            return await resp.read()
        except (TimeoutError, OSError) as e:
            raise UpstreamFailure(kind, f"response body cut short ({type(e).__name__})") from None

    async def _relay_stream(self, resp: UpstreamConnection, send, ctype: bytes,  # noqa: ANN001
                            client_headers: list[tuple[bytes, bytes]], strip_usage: bool,
                            state: ResponseState, resume: StreamResume | None, gap_s: float,
                            on_first: Callable[[], object] | None = None, watch: _Watch | None = None,
                            t_sent: float = 0.0) -> RelayResult:
        result = RelayResult(status=resp.status)
        live: WorkerPace | _NoPace = _NoPace()
        first_s = 0.0
        if watch is not None:
            resp.on_silence = watch
            live = watch.pace.of(watch.worker_id)
            notable = watch.pace.settings.notable   # silences this close to their limit tell the worker's pace
            first_s, late_s = watch.first_s * notable, gap_s * notable
        else:
            late_s = gap_s
        continuation = resume is not None and resume.legs > 0
        # a continuation's usage is rewritten (StreamResume.rewrite), not stripped here
        scanner = self.adapter.new_stream_scanner(strip_usage and not continuation, resume is not None)
        if not continuation:
            state.started = True
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(b"content-type", ctype), *client_headers]})
        tokens = 0
        before = resume.tokens_before if continuation else 0
        feed = scanner.feed
        read_some = resp.read_some
        note = resume.note if resume is not None else None
        rewrite = resume.rewrite if continuation else None
        max_gap = 0.0
        try:
            while chunk := await read_some():
                out = feed(chunk)
                if scanner.tokens != tokens:
                    now = time.perf_counter()
                    if tokens == 0:
                        result.first_token_at = now
                        resp.set_read_timeout(gap_s)  # from now on the pace between tokens
                        if watch is not None:
                            watch.started = True
                            if now - t_sent > first_s:   # near or past its limit, and the worker answered
                                live.note_late(now - t_sent, True, now)
                        if on_first is not None:
                            on_first()
                    else:
                        gap = now - result.last_token_at
                        if gap > max_gap:
                            max_gap = gap
                        if gap > late_s:   # near or past its limit (the judge kept it): slower, not hung
                            live.note_late(gap, False, now)
                    result.last_token_at = live.last_token_at = now
                    tokens = scanner.tokens
                    state.tokens = before + tokens
                if out:
                    if rewrite is not None:
                        out = rewrite(out)
                    if note is not None:
                        out = note(out)   # what of it goes out now (a tool call waits until complete)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
            if not scanner.done:
                result.midstream_error = "the worker closed the stream before [DONE]"
        except TimeoutError as e:
            result.midstream_error = f"the worker stalled mid-stream ({e})"
            result.stalled = True
        except OSError as e:
            result.midstream_error = f"the worker stopped responding mid-stream ({type(e).__name__})"
        result.max_gap = max_gap if tokens > 1 else None
        result.tokens = scanner.tokens
        result.usage = scanner.usage
        if result.midstream_error is not None:
            if resume is not None:
                state.tokens -= resume.drop_held()   # a tool call held back never reached the client
                return result  # the dispatcher continues the stream elsewhere, or ends it (end_stream)
            await send({"type": "http.response.body", "body": scanner.error_event(result.midstream_error),
                        "more_body": True})
        state.ended = True
        await send(_BODY_END)
        return result

    async def end_stream(self, send, state: ResponseState, body: bytes | None = None,  # noqa: ANN001
                         error: str | None = None) -> None:
        """End a stream the relay left open: with `body` (closing events), or an error event and [DONE]."""
        state.ended = True
        await send({"type": "http.response.body", "more_body": False,
                    "body": body if body is not None else sse_error_event(error or "the worker failed")})


def _end(conn: UpstreamConnection, track: set[UpstreamConnection] | None, clean: bool) -> None:
    """An exchange is over: untracked, its connection back to the pool when it ended cleanly, else closed (vLLM
    sees the disconnect and aborts the request)."""
    if track is not None:
        track.discard(conn)
    if clean:
        conn.release()
    else:
        conn.close()
