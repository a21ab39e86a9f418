"""The open-file limit the gateway runs with, checked against the connections it promises to hold.

Every stream the gateway relays holds two descriptors: the client's connection and the worker's. With
`server.max_connections` streams in flight it needs 2 x max_connections descriptors, plus headroom for the
listening socket, Redis, health checks and metric scrapes, and log files. A soft `RLIMIT_NOFILE` below that does
not fail loudly: accept() and connect() fail with EMFILE, uvicorn retries, and the requests wait. Measured before
this check, an outside probe measured: at `ulimit -n 1024`, 1,500 streams were silently queued, TTFT max 14.3 s against 9.4 s.

So at start the gateway raises its soft limit to the hard one (an unprivileged process may; systemd and
Kubernetes usually set a high hard limit and a low soft one), logs the limit it runs with, and warns when that
cannot hold `server.max_connections` streams, saying how many it can.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

try:
    import resource
except ImportError:  # pragma: no cover - not on POSIX
    resource = None  # type: ignore[assignment]

log = logging.getLogger("fleetgate")

FDS_PER_STREAM = 2          # the client's connection and the worker's
HEADROOM_FDS = 256          # listening socket, Redis pool, health checks and scrapes, log files, the event loop
NR_OPEN = "/proc/sys/fs/nr_open"  # Linux: the largest soft limit a process may set when the hard one is unlimited


@dataclass(frozen=True, slots=True)
class FdLimit:
    """The limit before and after raising it, and what `max_connections` streams need."""

    before: int
    soft: int
    hard: int              # -1: unlimited
    needed: int

    @property
    def streams(self) -> int:
        """Streams the soft limit can hold with the headroom kept."""
        return max(0, (self.soft - HEADROOM_FDS) // FDS_PER_STREAM)

    @property
    def enough(self) -> bool:
        return self.soft >= self.needed


def descriptors_needed(max_connections: int) -> int:
    return FDS_PER_STREAM * max_connections + HEADROOM_FDS


def _target(hard: int) -> int:
    if hard != resource.RLIM_INFINITY:
        return hard
    try:
        with open(NR_OPEN, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def raise_fd_limit(max_connections: int) -> FdLimit | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit; None where there is no such limit (not POSIX)."""
    if resource is None:
        return None
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = before
    target = _target(hard)
    if before != resource.RLIM_INFINITY and before < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", before, target, e)
    infinite = 1 << 62
    return FdLimit(infinite if before == resource.RLIM_INFINITY else before,
                   infinite if soft == resource.RLIM_INFINITY else soft,
                   -1 if hard == resource.RLIM_INFINITY else hard, descriptors_needed(max_connections))


def check_fd_limit(max_connections: int) -> FdLimit | None:
    """raise_fd_limit, then one log line: the limit in use (INFO), or a WARNING when it is too low."""
    lim = raise_fd_limit(max_connections)
    if lim is None:
        return None
    raised = f" (raised from {lim.before})" if lim.soft != lim.before else ""
    hard = "unlimited" if lim.hard < 0 else str(lim.hard)
    if lim.enough:
        log.info("open-file limit %d%s, hard %s: enough for server.max_connections=%d streams (%d descriptors)",
                 lim.soft, raised, hard, max_connections, lim.needed,
                 extra={"fields": {"nofile": lim.soft, "nofile_hard": lim.hard}})
    else:
        log.warning("open-file limit %d%s, hard %s: too low for server.max_connections=%d (2 descriptors per "
                    "stream plus %d: %d); about %d streams can be held at once, the rest wait for a descriptor. "
                    "Raise the hard limit (ulimit -Hn, LimitNOFILE=, the container's nofile ulimit) or lower "
                    "server.max_connections.", lim.soft, raised, hard, max_connections, HEADROOM_FDS, lim.needed,
                    lim.streams, extra={"fields": {"nofile": lim.soft, "nofile_hard": lim.hard}})
    return lim
