"""The `Gateway`: all the parts of one gateway process, wired together.

The ASGI application (gateway/app.py) and its routers (admin, batch API, passthrough, status page) read the
parts through a `Gateway`; this module imports none of them, so the routers depend on it and not on the app.
"""

from __future__ import annotations

from typing import Any

from engine_adapters.base import EngineAdapter
from engine_adapters.vllm import VllmAdapter
from gateway.batch.runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.control.autoscaler import Autoscaler
from gateway.control.pooling import SwapController
from gateway.fleet.discovery import DnsDiscovery
from gateway.fleet.kv_events import KvEventsService
from gateway.fleet.registry import Registry
from gateway.ops.access_log import AccessLog
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.status_history import StatusHistory
from gateway.ops.tracing import Tracing
from gateway.pipeline.dispatch import Dispatcher
from gateway.pipeline.drain import Drain
from gateway.pipeline.learning import Learner
from gateway.pipeline.observer import RequestObserver
from gateway.pipeline.rebalancer import Rebalancer
from gateway.pipeline.relay import Relay, make_upstream_pool
from gateway.pipeline.slo import SloBook
from gateway.state.base import StateStore
from gateway.state.factory import make_store
from gateway.tenancy.auth import Authenticator
from gateway.wire.upstream import UpstreamPool
from policies.pace import FleetPace


class Gateway:
    """All the parts of one gateway process, wired together; `start()` / `stop()` bracket its life."""

    def __init__(self, config: GatewayConfig, store: StateStore | None = None,
                 adapter: EngineAdapter | None = None) -> None:
        self.config = config
        if store is None:
            opts: dict[str, Any] = ({"key_prefix": config.redis_key_prefix, "lease_block": config.redis_lease_block}
                                    if config.redis_url else {})
            store = make_store(config.redis_url, config.replica_id, **opts)
        self.store = store
        self.shared_state = bool(config.redis_url)
        self.adapter = adapter or VllmAdapter()
        self.metrics = GatewayMetrics()
        self.auth = Authenticator(config, self.store)
        self.registry = Registry(config, self.store, self.adapter, self.metrics)
        self.slo = SloBook(config, self.metrics.registry)
        self.learner = Learner(config, self.store, self.registry, self.metrics.registry)
        self.batch = BatchRunner(config, self.store, self.registry, self.metrics)  # Batch API work
        self.autoscaler = Autoscaler(config, self.store, self.registry, self.metrics, self.batch)
        self.upstream: UpstreamPool | None = None  # the one client to workers (gateway/wire/upstream.py)
        self.access_log = AccessLog() if config.logging.access_log else None
        self.tracing: Tracing | None = Tracing(config.tracing) if config.tracing.enabled else None
        self.kv_events = KvEventsService(config, self.registry, self.metrics.registry)  # exact prefix-cache view
        self.pooling = SwapController(config, self.registry, self.store, self.metrics, self.learner)  # shared hosts
        self.status_history = StatusHistory(config.status, self.metrics, self.registry, self._queue_depths)
        self.relay: Relay | None = None
        self.dispatcher: Dispatcher | None = None
        self.drain = Drain()   # SIGTERM's graceful drain (gateway/pipeline/drain.py, driven by gateway/server.py)
        self.rebalancer = Rebalancer(config, self.metrics.registry) if Rebalancer.wanted(config) else None
        self.dns_discovery = DnsDiscovery(self.registry, config.worker_discovery) if config.worker_discovery else None

    async def start(self) -> None:
        if self.dispatcher is not None:
            return  # already started (idempotent: lifespan and an embedding server may both call it)
        await self.store.start()
        self.store.on_restore(self.auth.republish)
        await self.auth.start()
        self.upstream = make_upstream_pool(self.config)
        pace = (FleetPace(self.config.resume.pace(), self.config.turns_workers())
                if self.config.resume.hung_detection else None)
        self.relay = Relay(self.adapter, self.config.timeouts, self.upstream, pace)
        self.registry.on_eject(self.relay.abort_worker)
        pooling = self.pooling if self.pooling.enabled else None
        self.dispatcher = Dispatcher(
            self.config, self.store, self.registry, self.relay, self.adapter, self.metrics, slo=self.slo,
            learner=self.learner, auth=self.auth, shared_state=self.shared_state,
            observer=RequestObserver.make(self.access_log, self.tracing), kv_events=self.kv_events,
            pooling=pooling, no_room=self.batch.router.no_room, rebalancer=self.rebalancer, hooks=[self.batch.router],
            drain=self.drain)
        # A new engine report can change an SLO-aware policy's answer: the waiting requests try again.
        self.registry.on_scraped(lambda d=self.dispatcher: [d.kick(m) for m in list(d.runtimes)])
        if self.rebalancer is not None:
            await self.rebalancer.start(self.dispatcher)
        await self.registry.start(self.upstream)
        if self.dns_discovery is not None:
            await self.dns_discovery.start()
        if pooling is not None:
            self.pooling.waiting = lambda d=self.dispatcher: {m for m, rt in d.runtimes.items() if len(rt.queue)}
            self.pooling.on_unservable = self.dispatcher.kick
            await self.pooling.start(self.upstream)
        await self.kv_events.start(self.upstream)
        await self.learner.start()
        await self.batch.start(self.dispatcher)
        await self.autoscaler.start(self.dispatcher)
        await self.status_history.start()

    async def stop(self) -> None:
        """Stop loops, close the upstream pool and the store; safe on a partly started gateway."""
        await self.status_history.stop()
        await self.batch.stop()
        await self.autoscaler.stop()
        await self.kv_events.stop()
        await self.learner.stop()
        if self.rebalancer is not None:
            await self.rebalancer.stop()
        await self.pooling.stop()
        if self.dns_discovery is not None:
            await self.dns_discovery.stop()
        await self.registry.stop()
        await self.auth.stop()
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.close()  # keep-alive connections to the workers
        self.dispatcher = None
        await self.store.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def _queue_depths(self) -> dict[str, int]:
        """Requests waiting in this replica's admission queue, per model."""
        d = self.dispatcher
        return {m: len(rt.queue) for m, rt in d.runtimes.items()} if d is not None else {}
