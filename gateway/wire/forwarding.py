"""What the gateway tells a worker about the client: X-Forwarded-For, and which headers are not passed on.

- X-Forwarded-For: the client's address is appended. An X-Forwarded-For the client sent is kept (the
  address appended after it) only when the client is a configured proxy (`server.trusted_proxies`: addresses
  or networks); from anyone else it is dropped, so a client cannot make up the chain (the de-facto header's
  usual rule, as nginx's realip module and Envoy's xff_num_trusted_hops apply it).
- Headers named in the request's Connection header are hop-by-hop for that request (RFC 9110 section 7.6.1)
  and are dropped along with Connection itself (gateway/request/parse.py read_headers).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

# Connection tokens that name no header to drop.
_PLAIN_TOKENS = frozenset({b"keep-alive", b"close", b""})


def connection_named(value: bytes) -> frozenset[bytes]:
    """Header names (lower case) a Connection header value lists, besides keep-alive and close."""
    names = {t.strip().lower() for t in value.split(b",")}
    return frozenset(names - _PLAIN_TOKENS)


class ForwardedFor:
    """Builds the `X-Forwarded-For` line for the worker from the ASGI scope's client address."""

    def __init__(self, trusted_proxies: Sequence[str] = ()) -> None:
        self._nets = [ipaddress.ip_network(n, strict=False) for n in trusted_proxies]
        self._trusted: dict[str, bool] = {}

    def trusted(self, host: str) -> bool:
        hit = self._trusted.get(host)
        if hit is None:
            try:
                addr = ipaddress.ip_address(host)
            except ValueError:
                hit = False
            else:
                hit = any(addr in n for n in self._nets)
            if len(self._trusted) > 4096:
                self._trusted.clear()
            self._trusted[host] = hit
        return hit

    def line(self, scope: dict, incoming: bytes | None) -> bytes:
        """`X-Forwarded-For: ...\\r\\n`, or b"" when the scope has no client (the batch runner's requests)."""
        client = scope.get("client")
        if not client:
            return b""
        host = client[0]
        addr = host.encode("latin-1", "replace")
        if incoming and self._nets and self.trusted(host) and b"\r" not in incoming and b"\n" not in incoming:
            addr = incoming + b", " + addr
        return b"X-Forwarded-For: " + addr + b"\r\n"
