"""LoRA adapters in the gateway: which worker serves which adapter, and loading one where it is needed.

- Names: a request whose `model` is a configured adapter (`models.<base>.adapters`) is a request of its base
  model, routed among the base model's workers; the body keeps the adapter's name, so vLLM runs the adapter.
- Residency, per worker: the adapters its last scraped `vllm:lora_requests_info` showed running or waiting,
  the adapter cards (`parent` set) of its /v1/models, and the adapters this gateway loaded there (forgotten
  when the worker is ejected: a restarted engine has lost them).
- The choice of worker is the placement step's (policies/adapters.py); here the views get the residency.
- Before a request is relayed to a worker without its adapter, `ensure` loads it through vLLM's runtime API
  (`POST /v1/load_lora_adapter`, docs/reference/vllm-interface.md §6.2), at most one load in flight per
  (worker, adapter): concurrent requests wait on the same load. A failed load is the adapter's failure, not the
  worker's: it raises UpstreamFailure of kind LORA_LOAD, which does not count toward the worker's outlier
  ejection (gateway/pipeline/legs.py), and the adapter is remembered bad on that worker for `BAD_ADAPTER_HOLD_S`: no load
  is tried there meanwhile (a request there fails at once, kind LORA_BAD) and the placement step is not offered that worker
  while another can try. The attempt loop then places the request on another worker, or a fallback model, or
  answers an OpenAI-style 502 that names the adapter. A worker that cannot be reached for the load is the
  worker's failure (kind "connect") as for any leg.
- With `models.<base>.max_adapters_per_worker`, loading one more adapter on a worker first unloads
  (`POST /v1/unload_lora_adapter`) the least recently used one the gateway loaded there that no request is using.
  An adapter the gateway unloaded is not resident, whatever the lagging metrics still say, until loaded again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from gateway.config import GatewayConfig
from gateway.fleet.registry import Registry, WorkerState
from gateway.wire.results import UpstreamFailure
from policies.types import RequestFeatures, WorkerView

__all__ = ["AdapterRouter"]

log = logging.getLogger("fleetgate.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
LOAD_TIMEOUT_S = 60.0   # a load reads the adapter from the worker's disk; vLLM answers once it is registered
BAD_ADAPTER_HOLD_S = 60.0   # how long a failed load keeps an adapter marked bad on that worker
LORA_LOAD = "lora_load"     # UpstreamFailure.kind of a failed load: the adapter's failure, not the worker's
LORA_BAD = "lora_bad"       # ... of a request for an adapter remembered bad on the worker (no load tried)
_JSON = b"Content-Type: application/json\r\nAccept: */*\r\n"


class AdapterRouter:
    """Adapter names, residency and on-demand loads (module docstring)."""

    def __init__(self, config: GatewayConfig, registry: Registry, fetch: Callable[..., Any],
                 metrics: CollectorRegistry) -> None:
        self.parents = config.adapter_parents()
        self.limits = config.adapter_limits()
        self.registry = registry
        self._fetch = fetch     # gateway/wire/upstream.py UpstreamPool.fetch
        self._loaded: dict[str, set[str]] = {}              # worker id -> adapters this gateway loaded there
        self._loading: dict[tuple[str, str], asyncio.Task] = {}
        self._unloaded: dict[str, set[str]] = {}            # worker id -> adapters this gateway unloaded there
        self._active: dict[tuple[str, str], int] = {}       # (worker, adapter) -> requests relayed with it
        self._used: dict[tuple[str, str], float] = {}       # (worker, adapter) -> last request (monotonic)
        self._bad: dict[tuple[str, str], tuple[float, str]] = {}   # (worker, adapter) -> (bad until, why)
        labels = ["model", "adapter"]
        self.loads = Counter("fleetgate_lora_loads", "LoRA adapters the gateway loaded on a worker.", labels,
                             registry=metrics)
        self.unloads = Counter("fleetgate_lora_unloads", "LoRA adapters the gateway unloaded from a worker.",
                               labels, registry=metrics)
        self.hits = Counter("fleetgate_lora_hits", "Requests placed on a worker that served their adapter "
                            "already.", labels, registry=metrics)
        registry.on_eject(self._forget)

    # --- names ---------------------------------------------------------------------------------------
    def base_of(self, name: str | None) -> str | None:
        """The base model of a configured adapter; None for any other name."""
        entry = self.parents.get(name) if name else None
        return entry[0] if entry is not None else None

    def adapter_of(self, model: str, requested: Any) -> str | None:
        """The adapter a request of `model` names (its body's `model`), if it names one of the model's."""
        return requested if isinstance(requested, str) and self.base_of(requested) == model else None

    def cards(self, cards: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The gateway's /v1/models cards plus one per configured adapter of a served model, loaded or not,
        with `parent` its base model (vLLM's card for an adapter)."""
        out = [c for c in cards if c.get("id") not in self.parents]
        served = {c.get("id") for c in out}
        for name, (base, path) in sorted(self.parents.items()):
            if base in served:
                out.append({"id": name, "object": "model", "created": 0, "owned_by": "fleetgate", "root": path,
                            "parent": base})
        return out

    # --- residency -----------------------------------------------------------------------------------
    def resident(self, ws: WorkerState) -> frozenset[str]:
        """The adapters `ws` serves, or will once the load in flight there ends (requests placed meanwhile wait
        on that load rather than start another elsewhere)."""
        m = ws.metrics
        names = {*m.lora_running, *m.lora_waiting, *self._loaded.get(ws.id, ())}
        names.update(c["id"] for c in ws.cards if c.get("parent") not in (None, c.get("id")))
        names.difference_update(self._unloaded.get(ws.id, ()))
        names.update(a for w, a in self._loading if w == ws.id)
        return frozenset(names)

    def annotate(self, feats: RequestFeatures, views: list[WorkerView]) -> list[WorkerView]:
        """The candidates with the adapters each serves, for a request that names one (else unchanged)."""
        if feats.adapter is None:
            return views
        workers = self.registry.workers
        usable = [v for v in views if self._bad_reason(v.id, feats.adapter) is None]
        if usable:   # a worker where the adapter failed to load lately is offered only when no other is
            views = usable
        out = []
        for v in views:
            ws = workers.get(v.id)
            out.append(v if ws is None else
                       dataclasses.replace(v, adapters=self.resident(ws), max_loras=ws.metrics.max_lora))
        return out

    def _forget(self, worker_id: str, _suspected: bool) -> None:
        self._loaded.pop(worker_id, None)
        self._unloaded.pop(worker_id, None)

    # --- loads ---------------------------------------------------------------------------------------
    async def ensure(self, feats: RequestFeatures, ws: WorkerState) -> None:
        """Make `ws` serve the request's adapter before the request goes there (no-op for a base request).
        Every call is paired with `done` once the request left the worker, whether this raised or not."""
        adapter = feats.adapter
        if adapter is None:
            return
        key = (ws.id, adapter)
        self._active[key] = self._active.get(key, 0) + 1
        self._used[key] = time.monotonic()
        bad = self._bad_reason(ws.id, adapter)
        if bad is not None:
            raise UpstreamFailure(LORA_BAD, f"{bad} (not tried again for {BAD_ADAPTER_HOLD_S:g} s)")
        task = self._loading.get(key)
        if task is None:
            if adapter in self.resident(ws):
                self.hits.labels(feats.model, adapter).inc()
                return
            task = asyncio.get_running_loop().create_task(self._load(ws, feats.model, adapter))
            self._loading[key] = task
            task.add_done_callback(lambda _t: self._loading.pop(key, None))
        await asyncio.shield(task)   # a client that leaves does not cancel the load others wait on

    def _bad_reason(self, worker_id: str, adapter: str) -> str | None:
        """Why `adapter` failed to load on the worker lately (None: it did not, or long enough ago)."""
        entry = self._bad.get((worker_id, adapter))
        if entry is None:
            return None
        if time.monotonic() >= entry[0]:
            del self._bad[(worker_id, adapter)]
            return None
        return entry[1]

    def _failed_load(self, ws: WorkerState, adapter: str, detail: str) -> UpstreamFailure:
        self._bad[(ws.id, adapter)] = (time.monotonic() + BAD_ADAPTER_HOLD_S, detail)
        return UpstreamFailure(LORA_LOAD, detail)

    def done(self, feats: RequestFeatures, ws: WorkerState) -> None:
        """The request `ensure` prepared on `ws` is over there."""
        if feats.adapter is None:
            return
        key = (ws.id, feats.adapter)
        n = self._active.get(key, 0) - 1
        if n > 0:
            self._active[key] = n
        else:
            self._active.pop(key, None)

    async def _make_room(self, ws: WorkerState, model: str) -> None:
        """Unload the least recently used idle adapter of `model` this gateway loaded on `ws`, when it keeps
        max_adapters_per_worker there already."""
        limit = self.limits.get(model)
        mine = [a for a in self._loaded.get(ws.id, ()) if self.parents.get(a, ("",))[0] == model]
        if limit is None or len(mine) < limit:
            return
        idle = [a for a in mine if not self._active.get((ws.id, a)) and (ws.id, a) not in self._loading]
        if idle:
            await self.unload(ws, model, min(idle, key=lambda a: self._used.get((ws.id, a), 0.0)))

    async def _load(self, ws: WorkerState, model: str, adapter: str) -> None:
        await self._make_room(ws, model)
        body = orjson.dumps({"lora_name": adapter, "lora_path": self.parents[adapter][1]})
        try:
            r = await self._fetch(ws.rec.url + LOAD_PATH, LOAD_TIMEOUT_S, b"POST", body, _JSON)
        except TimeoutError:
            raise self._failed_load(ws, adapter, f"{ws.id} could not load adapter {adapter} in time") from None
        except OSError as e:
            raise UpstreamFailure("connect", f"loading adapter {adapter} on {ws.id}: {e}") from None
        if r.status != 200 and not _already_loaded(r.status, r.body):
            detail = r.body.decode("utf-8", "replace")[:300]
            log.warning("worker %s refused to load adapter %s (%d): %s", ws.id, adapter, r.status, detail)
            raise self._failed_load(ws, adapter, f"{ws.id} could not load adapter {adapter} ({r.status}): {detail}")
        self._loaded.setdefault(ws.id, set()).add(adapter)
        self._unloaded.get(ws.id, set()).discard(adapter)
        if r.status == 200:
            self.loads.labels(model, adapter).inc()
            log.info("loaded adapter %s on %s", adapter, ws.id)

    async def unload(self, ws: WorkerState, model: str, adapter: str) -> bool:
        """Unload `adapter` from `ws` (vLLM's runtime API); True when the worker no longer serves it."""
        body = orjson.dumps({"lora_name": adapter})
        try:
            r = await self._fetch(ws.rec.url + UNLOAD_PATH, LOAD_TIMEOUT_S, b"POST", body, _JSON)
        except (TimeoutError, OSError):
            return False
        if r.status != 200:
            return False
        self._loaded.get(ws.id, set()).discard(adapter)
        self._unloaded.setdefault(ws.id, set()).add(adapter)
        self.unloads.labels(model, adapter).inc()
        log.info("unloaded adapter %s from %s", adapter, ws.id)
        return True


def _already_loaded(status: int, body: bytes) -> bool:
    """vLLM's 400 for a name it serves already (serving_models.py): the adapter is there."""
    return status == 400 and b"has already been loaded" in body
