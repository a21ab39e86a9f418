"""Between two live runs of a benchmark: nothing of the previous run may still be alive.

A router, a simulated fleet or a child of either that outlives its run competes for the cores and may still hold
its ports (a KV-event publisher, a worker a later fleet is assigned the same port as), so the next run would
measure two runs at once. `assert_clean` waits a little for the previous run's processes to exit and its ports to
free, then raises naming what is left.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path


def descendants(pid: int | None = None) -> dict[int, str]:
    """Every live descendant of `pid` (default: this process), pid -> command line, from /proc."""
    root = os.getpid() if pid is None else pid
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            # the command name may hold spaces and parentheses: the fields after the last ")" are fixed
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z":   # a zombie holds no port and no CPU; its parent has not reaped it yet
                continue
            parent[int(d.name)] = int(fields[1])
            cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, par in parent.items():
            if par == p and child not in out:
                out[child] = cmd.get(child, "")
                frontier.append(child)
    return out


def port_in_use(port: int) -> bool:
    """Something listens on (or holds) `port` on any local address."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a closed connection's TIME_WAIT is not a holder
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def assert_clean(ports: Iterable[int], wait_s: float = 15.0, ignore: Iterable[int] = ()) -> None:
    """Raise unless, within `wait_s`, this process has no live descendant (but `ignore`) and every port in `ports`
    is free."""
    ports, skip = sorted(set(ports)), set(ignore)
    deadline = time.monotonic() + wait_s
    while True:
        kids = {p: c for p, c in descendants().items() if p not in skip}
        busy = [p for p in ports if port_in_use(p)]
        if not kids and not busy:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the previous run left "
                               + "; ".join([f"process {p} ({c[:120]})" for p, c in kids.items()]
                                           + [f"port {p} in use" for p in busy]))
        time.sleep(0.2)
