"""One engine, one worker: the address that names a vLLM server, and the check that no server is listed twice.

A worker entry is the gateway's unit of capacity: its in-flight count, its cap, its KV cache and its learned
performance model. The same server under two ids (two `workers` entries with one URL, a URL given twice to
`fleetgate serve -w`, a shared host's engine that is also a plain worker) would be counted twice: the gateway
would place twice the load the engine can take and judge its pace from half its requests. So a duplicate is a
configuration error, reported by `fleetgate config check` and refused by `fleetgate serve`.

Two URLs name the same engine when scheme, host (case-insensitive), port (the scheme's default when absent) and
path prefix (without a trailing slash) agree. Different host names for one address (`localhost` and
`127.0.0.1`) are not resolved: the check catches copies, not aliases.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


def engine_address(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, path prefix) of a worker URL, normalised so copies of one address compare equal."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or DEFAULT_PORTS.get(scheme), parts.path.rstrip("/")


def duplicate_engine_problems(entries: Iterable[tuple[str, str, str]]) -> list[str]:
    """One problem per entry whose URL an earlier entry already names; `entries` are (where, worker id, url)."""
    first: dict[tuple[str, str, int | None, str], tuple[str, str]] = {}
    problems = []
    for where, wid, url in entries:
        key = engine_address(url)
        if key in first:
            other_where, other_id = first[key]
            problems.append(f"{where}: worker {wid!r} names the same engine as {other_where} ({other_id!r}): {url} "
                            "(one engine is one worker; listed twice its capacity would be counted twice)")
        else:
            first[key] = (where, wid)
    return problems
