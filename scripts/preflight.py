"""Checks the external tools a test lane needs before any test runs, and says how to get each one on Debian.

    python scripts/preflight.py              # the `make test` lane
    python scripts/preflight.py test slow    # `make test-all`: both lanes
    python scripts/preflight.py --list       # every tool, which lanes need it, how to get it

The tests drive these tools for real and fail (never skip) without them, so a missing tool found here saves a
run that would fail minutes later. Every problem is listed at once; the exit status is 1 when any is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

REDIS_URL = os.environ.get("FLEETGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
LANES = ("test", "slow", "chaos")


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


def command(*names: str) -> Callable[[], str | None]:
    """A check that one of `names` is on PATH."""
    def check() -> str | None:
        return None if any(shutil.which(n) for n in names) else f"{' or '.join(names)} is not on PATH"
    return check


@dataclass(frozen=True)
class Tool:
    """An external tool some tests drive, the lanes whose tests need it, and how to get it."""

    name: str
    lanes: frozenset[str]
    used_by: str
    check: Callable[[], str | None]
    how: str


TOOLS: tuple[Tool, ...] = (
    Tool("Redis server", frozenset({"test", "slow"}), "shared state, leases, queues (every redis-marked test)",
         lambda: redis_reachable(REDIS_URL),
         f"a Redis at {REDIS_URL} (FLEETGATE_TEST_REDIS_URL; database 15, keys under a prefix per test):\n"
         "    apt-get install redis-server && redis-server --daemonize yes --port 6379 --save '' --appendonly no\n"
         "    or  docker run -d -p 6379:6379 redis:7"),
    Tool("redis-server", frozenset({"test", "slow", "chaos"}),
         "tests that start, stop and kill their own Redis (test_state_faults, test_state_redis, "
         "test_ops_prometheus, tests_chaos)", command("redis-server"), "apt-get install redis-server"),
    Tool("promtool", frozenset({"test"}), "checks deploy/prometheus and its alert rules (test_ops_deploy_files, "
         "test_ops_prometheus)", command("promtool"), "apt-get install prometheus"),
    Tool("Prometheus", frozenset({"slow"}), "a real Prometheus scrapes a gateway for every dashboard panel and alert "
         "(test_ops_prometheus)", command("prometheus"), "apt-get install prometheus"),
    Tool("Chromium", frozenset({"test"}), "the status page in a headless browser (test_ops_status_page)",
         command("chromium", "chromium-browser"), "apt-get install chromium"),
    Tool("kubectl", frozenset({"test"}), "renders deploy/kubernetes with its built-in kustomize "
         "(test_ops_deploy_files)", command("kubectl"),
         "not in Debian's archive: add the Kubernetes apt repository and `apt-get install kubectl`, or install the "
         "static binary (https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/)"),
    Tool("openssl", frozenset({"test"}), "makes the CAs and certificates of test_upstream_tls", command("openssl"),
         "apt-get install openssl"),
    Tool("git", frozenset({"test"}), "lists the tracked files (test_repo_hygiene)", command("git"),
         "apt-get install git"),
)


def problems(lanes: set[str]) -> list[str]:
    """One message per tool the lanes need that is missing."""
    out = []
    for tool in TOOLS:
        if tool.lanes & lanes:
            why = tool.check()
            if why:
                out.append(f"- {tool.name}: {why}.\n  Used for: {tool.used_by}.\n  Get it: {tool.how}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lanes", nargs="*", metavar="LANE", help=f"the lanes about to run: {', '.join(LANES)} "
                    "(default: test)")
    ap.add_argument("--list", action="store_true", help="list every tool, the lanes that need it and how to get it")
    args = ap.parse_args(argv)
    if args.list:
        for tool in TOOLS:
            print(f"{tool.name} [{', '.join(sorted(tool.lanes))}]: {tool.used_by}\n    {tool.how}")
        return 0
    lanes = set(args.lanes or ["test"])
    if lanes - set(LANES):
        ap.error(f"unknown lane {', '.join(sorted(lanes - set(LANES)))}: choose from {', '.join(LANES)}")
    missing = problems(lanes)
    if missing:
        print(f"preflight ({' '.join(sorted(lanes))}): the tests need tools this machine does not have:\n"
              + "\n".join(missing), file=sys.stderr)
        return 1
    needed = [t.name for t in TOOLS if t.lanes & lanes]
    print(f"preflight ({' '.join(sorted(lanes))}): {', '.join(needed) or 'nothing external'} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
