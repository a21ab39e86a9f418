"""The records RedisStore keeps for the gateway's parts: the worker registry, the scraped engine metrics and
shared documents (fitted models, predictor state, admin-made API keys). Each is cached here too, so reads
serve the last known state while Redis is down; a write made meanwhile is replayed when it is back. Mixed
into RedisStore (gateway/state/redis_store.py), whose connection and outage handling these methods use.
"""

from __future__ import annotations

import dataclasses

import orjson

from gateway.state.base import EngineMetrics, WorkerRecord
from gateway.state.redis_scripts import _DOWN_ERRORS


def _record_from(raw: str | bytes) -> WorkerRecord:
    d = orjson.loads(raw)
    names = {f.name for f in dataclasses.fields(WorkerRecord)}
    return WorkerRecord(**{k: v for k, v in d.items() if k in names})


def _metrics_from(raw: str | bytes) -> EngineMetrics:
    d = orjson.loads(raw)
    names = {f.name for f in dataclasses.fields(EngineMetrics)}
    # JSON has no tuples: the adapter name lists come back as the tuples they were
    return EngineMetrics(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters so a key prefix matches literally (HSCAN MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisRecords:
    # --- registry -------------------------------------------------------------------------------
    async def upsert_worker(self, rec: WorkerRecord) -> None:
        rec = dataclasses.replace(rec, models=list(rec.models), labels=dict(rec.labels))
        self._workers_cache[rec.id] = rec
        if self._ok:
            try:
                await self._client().hset(self._k("workers"), rec.id, orjson.dumps(dataclasses.asdict(rec)))
                return
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        self._pending_registry[rec.id] = rec
    async def remove_worker(self, worker_id: str) -> None:
        self._workers_cache.pop(worker_id, None)
        self._metrics_cache.pop(worker_id, None)
        if self._ok:
            try:
                pipe = self._client().pipeline(transaction=False)
                pipe.hdel(self._k("workers"), worker_id)
                pipe.hdel(self._k("metrics"), worker_id)
                await pipe.execute()
                return
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        self._pending_registry[worker_id] = None
    async def list_workers(self) -> list[WorkerRecord]:
        if self._ok:
            try:
                pipe = self._client().pipeline(transaction=True)
                pipe.get(self._k("alive"))
                pipe.hgetall(self._k("workers"))
                epoch, raw = await pipe.execute()
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            else:
                if self._check_epoch(epoch):  # else: Redis lost its data; serve what we knew, write it back
                    self._workers_cache = {wid: _record_from(v) for wid, v in raw.items()}
        return [dataclasses.replace(r, models=list(r.models), labels=dict(r.labels))
                for r in self._workers_cache.values()]
    # --- scraped engine metrics ------------------------------------------------------------------
    async def put_metrics(self, worker_id: str, metrics: EngineMetrics) -> None:
        self._metrics_cache[worker_id] = dataclasses.replace(metrics)
        if self._ok:
            try:
                await self._client().hset(self._k("metrics"), worker_id, orjson.dumps(dataclasses.asdict(metrics)))
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
    async def get_metrics(self) -> dict[str, EngineMetrics]:
        if self._ok:
            try:
                raw = await self._client().hgetall(self._k("metrics"))
                self._metrics_cache = {wid: _metrics_from(v) for wid, v in raw.items()}
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        return {wid: dataclasses.replace(m) for wid, m in self._metrics_cache.items()}
    # --- shared documents (control loops; a write while Redis is down stays local until re-put) ---
    async def put_doc(self, key: str, doc: dict) -> None:
        raw = orjson.dumps(doc)
        self._docs_cache[key] = raw
        if self._ok:
            try:
                await self._client().hset(self._k("docs"), key, raw)
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
    async def get_doc(self, key: str) -> dict | None:
        if self._ok:
            try:
                raw = await self._client().hget(self._k("docs"), key)
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            else:
                if raw is None:
                    self._docs_cache.pop(key, None)
                else:
                    self._docs_cache[key] = raw
        raw = self._docs_cache.get(key)
        return orjson.loads(raw) if raw is not None else None
    async def get_docs(self, prefix: str) -> dict[str, dict]:
        if self._ok:
            try:
                flat = await self._get_docs_script(keys=[self._k("docs"), self._k("alive")],
                                                   args=[_glob_escape(prefix) + "*"])
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            else:
                if self._check_epoch(flat[0]):
                    found = {flat[i]: flat[i + 1] for i in range(1, len(flat) - 1, 2)}
                    kept = {k: v for k, v in self._docs_cache.items() if not k.startswith(prefix)}
                    self._docs_cache = {**kept, **found}
        return {k: orjson.loads(v) for k, v in self._docs_cache.items() if k.startswith(prefix)}
    async def delete_doc(self, key: str) -> None:
        self._docs_cache.pop(key, None)
        if self._ok:
            try:
                await self._client().hdel(self._k("docs"), key)
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
