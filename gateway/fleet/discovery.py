"""Workers found by DNS (config `worker_discovery`): each A/AAAA address of a name is a worker.

Every `interval_s` each entry's name is resolved again, off the event loop (the system resolver runs in the
loop's thread pool; with `nameservers`, dnspython's asyncio resolver asks those servers itself):

- an address that appears joins the registry as worker `PREFIX-ADDRESS:PORT` (the same id on every replica and
  after every restart), out of rotation until its health check passes and its /v1/models lists a model
  (gateway/fleet/registry.py `add`: the same probe as any worker);
- an address that disappears is drained (no new requests, on every replica through the state store); once
  nothing is in flight on it (summed over replicas), or after `drain_timeout_s`, it leaves the registry;
  if it comes back meanwhile, the drain is undone;
- a failed resolution, and an answer with no address (NXDOMAIN included: Docker's and Kubernetes' DNS answer
  that for a name with no container or ready pod at the moment), keep the last known set: a name that stops
  resolving is far more often a resolver problem than a fleet gone; workers that really went are taken out
  of rotation by their health checks. One log line when resolution starts failing and one when it works
  again, not one per round.

Several gateway replicas sharing Redis each resolve the name. They act only on changes of what they resolved
themselves (an address new to them, or gone for them), never on the mere absence of a record from the store:
so a replica whose resolver lags does not put back a worker another replica, or an actuator, has just
drained and removed, and two replicas seeing the same change write the same record (same id, same state).
On its first resolution a replica compares with the workers of that entry already in the store (a restart
with Redis kept): those no longer resolved are drained then.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gateway.config import WorkerDiscoveryConfig, parse_nameserver
from gateway.state.base import WORKER_ACTIVE, WORKER_DRAINING, WorkerRecord
from gateway.state.outage import quiet_loop, stop_task

if TYPE_CHECKING:
    from gateway.fleet.registry import Registry

log = logging.getLogger("fleetgate.discovery")

SOURCE = "dns"
DRAIN_POLL_S = 0.05


class ResolveError(Exception):
    """The name could not be resolved (or resolved to nothing)."""


@dataclass
class _Entry:
    cfg: WorkerDiscoveryConfig
    known: set[str] | None = None                    # addresses of the last good resolution (None: none yet)
    failing: str | None = None                        # why resolution fails, while it does
    leaving: dict[str, asyncio.Task] = field(default_factory=dict)  # worker id -> its drain
    lookup: asyncio.Future | None = None              # a system lookup still running in the thread pool


def resolve_timeout(cfg: WorkerDiscoveryConfig) -> float:
    """How long one resolution may take: within its round, and never less than a second."""
    return max(1.0, min(5.0, cfg.interval_s))


async def resolve(entry: _Entry) -> set[str]:
    """The addresses `entry`'s name resolves to now (raises ResolveError)."""
    cfg = entry.cfg
    if cfg.nameservers:
        return await _resolve_dnspython(cfg)
    if entry.lookup is not None and not entry.lookup.done():
        raise ResolveError("the previous lookup has not returned yet")
    loop = asyncio.get_running_loop()
    family = {"ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}.get(cfg.family, socket.AF_UNSPEC)
    entry.lookup = asyncio.ensure_future(loop.getaddrinfo(cfg.dns, cfg.port, family=family, type=socket.SOCK_STREAM))
    entry.lookup.add_done_callback(_consume)   # a lookup given up on may still fail later: nobody awaits it then
    try:
        infos = await asyncio.wait_for(asyncio.shield(entry.lookup), resolve_timeout(cfg))
    except TimeoutError:
        raise ResolveError(f"no answer within {resolve_timeout(cfg):g} s") from None
    except OSError as e:
        raise ResolveError(str(e)) from None
    out = {_canonical(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
    if not out:
        raise ResolveError("no A or AAAA record")
    return out


async def _resolve_dnspython(cfg: WorkerDiscoveryConfig) -> set[str]:
    try:
        import dns.asyncresolver
        import dns.exception
        import dns.nameserver
        import dns.resolver
    except ImportError:  # config check names the extra; here, fail the round loudly once
        raise ResolveError("`nameservers` needs dnspython (pip install 'fleetgate[dns]')") from None
    r = dns.asyncresolver.Resolver(configure=False)
    r.nameservers = [dns.nameserver.Do53Nameserver(*parse_nameserver(ns)) for ns in cfg.nameservers]
    r.lifetime = resolve_timeout(cfg)
    out: set[str] = set()
    errors: list[str] = []
    for rdtype in {"ipv4": ("A",), "ipv6": ("AAAA",)}.get(cfg.family, ("A", "AAAA")):
        try:
            answer = await r.resolve(cfg.dns, rdtype, search=False)
        except dns.resolver.NoAnswer:
            continue
        except dns.exception.DNSException as e:
            errors.append(f"{rdtype}: {e}")
            continue
        out |= {_canonical(rr.address) for rr in answer}
    if errors:   # half an answer (A without AAAA) would drain the other half: keep the set instead
        raise ResolveError("; ".join(errors))
    if not out:
        raise ResolveError("no A or AAAA record")
    return out


def _consume(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


def _canonical(address: str) -> str:
    return str(ipaddress.ip_address(address.split("%")[0]))


class DnsDiscovery:
    """The `worker_discovery` loops of one gateway process (see the module docstring)."""

    def __init__(self, registry: Registry, entries: list[WorkerDiscoveryConfig]) -> None:
        self.registry = registry
        self.entries = [_Entry(cfg) for cfg in entries]
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """One round for every entry (so the gateway starts with the workers it can find), then the loops."""
        await asyncio.gather(*(self.round(e) for e in self.entries))
        self._tasks = [asyncio.create_task(self._loop(e), name=f"fg-dns-{e.cfg.dns}") for e in self.entries]

    async def stop(self) -> None:
        for t in [*self._tasks, *(t for e in self.entries for t in e.leaving.values())]:
            await stop_task(t)
        self._tasks = []

    async def _loop(self, entry: _Entry) -> None:
        await asyncio.sleep(entry.cfg.interval_s)
        await quiet_loop(entry.cfg.interval_s, lambda: self.round(entry), log, f"worker discovery {entry.cfg.dns}")

    async def round(self, entry: _Entry) -> None:
        """Resolve once and apply what changed."""
        cfg = entry.cfg
        try:
            now = await resolve(entry)
        except ResolveError as e:
            if entry.failing is None:
                log.warning("worker discovery: %s does not resolve (%s); keeping its %d known worker(s) until it "
                            "does", cfg.dns, e, len(entry.known or ()))
            entry.failing = str(e)
            return
        if entry.failing is not None:
            log.info("worker discovery: %s resolves again (%d address(es))", cfg.dns, len(now))
            entry.failing = None
        if entry.known is None:   # first answer: compare with what the store already has (a restart)
            entry.known = {self._address(entry, ws.rec.url) for wid, ws in self.registry.workers.items()
                           if ws.rec.source == SOURCE and wid.startswith(cfg.prefix() + "-")} - {None}
        added, gone = now - entry.known, entry.known - now
        entry.known = now
        await asyncio.gather(*(self._join(entry, a) for a in sorted(added)))
        for a in sorted(gone):
            self._leave(entry, a)

    @staticmethod
    def _address(entry: _Entry, url: str) -> str | None:
        """The address of a worker URL this entry would have made, else None."""
        with contextlib.suppress(ValueError, TypeError):
            address = _canonical(urlsplit(url).hostname or "")
            if entry.cfg.worker_url(address) == url:
                return address
        return None

    async def _join(self, entry: _Entry, address: str) -> None:
        cfg = entry.cfg
        wid = cfg.worker_id(address)
        drain = entry.leaving.pop(wid, None)
        if drain is not None:     # it came back while draining: undo the drain
            await stop_task(drain)
            if await self.registry.set_state(wid, WORKER_ACTIVE) is not None:
                log.info("worker %s resolves again: back from draining", wid)
                return
        ws = self.registry.workers.get(wid)
        if ws is not None:
            return                # another replica added it first (same id, same record)
        log.info("worker discovery: %s has a new address %s: worker %s joins after its health check", cfg.dns,
                 address, wid, extra={"fields": {"worker": wid}})
        await self.registry.add(WorkerRecord(id=wid, url=cfg.worker_url(address), role=cfg.role,
                                             labels=dict(cfg.labels), cap=cfg.cap, source=SOURCE))

    def _leave(self, entry: _Entry, address: str) -> None:
        wid = entry.cfg.worker_id(address)
        if wid in entry.leaving or wid not in self.registry.workers:
            return
        entry.leaving[wid] = asyncio.create_task(self._drain(entry, wid), name=f"fg-dns-drain-{wid}")

    async def _drain(self, entry: _Entry, wid: str) -> None:
        reg = self.registry
        try:
            ws = reg.workers.get(wid)
            if ws is None:
                return
            if ws.rec.state != WORKER_DRAINING:
                await reg.drain(wid)
            log.info("worker %s: its address no longer resolves from %s; draining", wid, entry.cfg.dns,
                     extra={"fields": {"worker": wid}})
            deadline = time.monotonic() + entry.cfg.drain_timeout_s
            while self._inflight(wid) > 0 and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            left = self._inflight(wid)
            if left:
                log.warning("worker %s still has %d request(s) in flight after draining %.0f s; removing it",
                            wid, left, entry.cfg.drain_timeout_s)
            await reg.remove(wid)
            log.info("worker %s drained and removed", wid, extra={"fields": {"worker": wid}})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("draining worker %s failed", wid)
        finally:
            if entry.leaving.get(wid) is asyncio.current_task():
                del entry.leaving[wid]

    def _inflight(self, wid: str) -> int:
        f = self.registry.store.inflight().get(wid)
        return f.requests if f is not None else 0
