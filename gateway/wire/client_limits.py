"""Bounds on what a client connection can make the gateway hold: time, header bytes, connections.

uvicorn's httptools protocol (the one the gateway serves with) closes a connection only when it has been
idle `timeout_keep_alive` seconds after a response; it has no bound on how long a client may take to send its
headers or its body, none on a connection that never sends a byte, none on header size or count (llhttp
buffers whatever comes; uvicorn's `h11_max_incomplete_event_size` applies to its h11 protocol only), and
`limit_concurrency` answers 503 to requests but still accepts connections. `LimitedHttpToolsProtocol` adds
those bounds to it, per connection:

- a new connection that sends nothing for `keepalive_s` is closed (as uvicorn closes one idle after a response);
- a request's line and headers must arrive within `header_timeout_s` of its first byte, however slowly they
  drip (slowloris): else 408 and close;
- a request's body may pause at most `body_timeout_s` between two pieces (a stalled body): else 408 (or a
  plain close once a response has started) and the application sees the client as gone;
- request line plus headers at most `max_header_bytes`, at most `max_headers` header lines: else 431 and close,
  before the application sees anything;
- at most `max_connections` open client connections: a connection beyond is closed at once.

Everything else (parsing, pipelining, flow control, the keep-alive timer between requests) stays uvicorn's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("fleetgate.clients")

_IDLE, _HEAD, _BODY, _APP, _REJECTED = range(5)
LINGER_S = 2.0  # after a 4xx the gateway reads (and drops) what the client still sends, then closes
LATE_S = 0.5  # a timer this late means the event loop was blocked, not that the client was idle


@dataclass(frozen=True, slots=True)
class ClientLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_s: float = 5.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_connections: int = 4096


class _TooLarge(Exception):
    pass


def _plain_response(status: bytes, message: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(message) + message)


_431 = _plain_response(b"431 Request Header Fields Too Large",
                       b'{"error":{"message":"Request header fields too large.","type":"invalid_request_error",'
                       b'"param":null,"code":"headers_too_large"}}')
_408 = _plain_response(b"408 Request Timeout",
                       b'{"error":{"message":"The request was not received in time.","type":"invalid_request_error",'
                       b'"param":null,"code":"request_timeout"}}')


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol with the bounds of the module docstring. Built by `protocol_factory`."""

    limits = ClientLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._head_bytes = 0     # bytes received while the headers were not complete
        self._parsed_bytes = 0   # bytes of the request line and headers the parser handed over
        self._header_count = 0

    # --- connection ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.abort()  # over the limit: nothing held for it
            return
        self._arm(self.limits.keepalive_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == _REJECTED:
            return  # lingering: the rest of the refused request is read and dropped
        self._unset_keepalive_if_required()
        if self._phase == _IDLE:  # the first byte of a request (CRLFs before one count too)
            self._begin_head()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _TooLarge) or self._over_header_limit():
                self._reject(_431)
                return
            self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserError:
            self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._phase == _HEAD:
            self._head_bytes += len(data)
            if self._over_header_limit():
                self._reject(_431)
        elif self._phase == _BODY:
            self._arm(self.limits.body_timeout_s)

    # --- parser callbacks ------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase != _HEAD:
            self._begin_head()
        self._header_count = self._parsed_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        if self._over_header_limit():
            raise _TooLarge
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._parsed_bytes += len(name) + len(value) + 4
        if self._header_count > self.limits.max_headers or self._over_header_limit():
            raise _TooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._phase = _BODY
        self._arm(self.limits.body_timeout_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        if self.cycle is not None and self.cycle.response_complete:
            # answered before the body ended (an early 4xx): idle now; the timer uvicorn armed was cancelled
            # when the rest of the body arrived
            self._phase = _IDLE
            self._arm(self.limits.keepalive_s)
        else:
            self._phase = _APP

    def on_response_complete(self) -> None:
        self._phase = _IDLE
        self._disarm()
        super().on_response_complete()  # arms uvicorn's keep-alive timer (timeout_keep_alive = keepalive_s)

    # --- timers ----------------------------------------------------------------------------------------
    def _begin_head(self) -> None:
        self._phase = _HEAD
        self._head_bytes = 0
        self._arm(self.limits.header_timeout_s)

    def _over_header_limit(self) -> bool:
        return max(self._head_bytes, self._parsed_bytes) > self.limits.max_header_bytes

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._due = self.loop.time() + seconds
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing() or self._phase == _REJECTED:
            return
        if self.loop.time() - self._due > LATE_S:
            # The loop was blocked and this timer ran late: the client's bytes may be waiting behind it (uvloop
            # runs due timers before reading sockets). Look again after one round of I/O.
            self._arm(0.05)
            return
        if self._phase == _BODY and self.flow is not None and self.flow.read_paused:
            self._arm(self.limits.body_timeout_s)  # the application is behind, not the client
            return
        cycle = self.cycle
        if self._phase == _HEAD and (cycle is None or cycle.response_complete):
            self._reject(_408)  # lingering: a client still dripping headers would otherwise get a reset, not the 408
            return
        if self._phase in (_HEAD, _BODY) and (cycle is None or not cycle.response_started):
            self.transport.write(_408)  # the application has the request: it sees the client gone at the close
        self.transport.close()

    def _reject(self, response: bytes) -> None:
        """Answer and close without a reset: stop parsing, send the answer, end our side, drop what the client
        still sends for LINGER_S (closing with unread data would reset the connection and lose the answer)."""
        self._disarm()
        if self.transport.is_closing():
            return
        self._phase = _REJECTED
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)


def protocol_factory(limits: ClientLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for uvicorn's `http=` with these limits."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
