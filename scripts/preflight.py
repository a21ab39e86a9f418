"""Checks what the test suite needs before it starts, and says exactly what to do when something is missing."""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

REDIS_URL = os.environ.get("FLEETGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def redis_reachable(url: str) -> str | None:
    """Return None when a Redis server answers PING at `url`, else the reason it does not."""
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 6379
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError as exc:
        return f"cannot connect to {host}:{port} ({exc})"
    if not reply.startswith(b"+PONG"):
        return f"{host}:{port} answered {reply!r}, not +PONG (is it Redis?)"
    return None


def main() -> int:
    problem = redis_reachable(REDIS_URL)
    if problem:
        print(
            f"preflight: the tests need a Redis server at {REDIS_URL}: {problem}.\n"
            "Start one, then run the tests again:\n"
            "    redis-server --daemonize yes --port 6379 --save '' --appendonly no\n"
            "or  docker run -d -p 6379:6379 redis:7\n"
            "(or point FLEETGATE_TEST_REDIS_URL at another server; database 15 is used and flushed by key prefix)",
            file=sys.stderr,
        )
        return 1
    print(f"preflight: Redis at {REDIS_URL} answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
