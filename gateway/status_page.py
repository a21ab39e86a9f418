"""The status page: `GET /` (or `/ui`) is one HTML file with a little JS that polls `GET /ui/status.json`.

The JSON (also for scripts) says, from this replica's point of view:
    fleet       every worker: id, url, role, pool label, state (active/draining), health, in flight, cap,
                engine running / waiting / KV-cache use (last scrape), models
    models      per served model: policy, workers in rotation, SLO attainment per class over the window,
                judged requests (met / missed), admission queue depth
    autoscale   the leader's desired / current workers per pool and its recent scale actions (when on)
    batches     the Batch API's batches with their request counts (latest first, at most 20)
No build step, no external assets: the page is `gateway/static/status.html`.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from gateway.actuators import pool_label
from gateway.auth import tenant_of_request
from policies.types import CLASS_BATCH, CLASS_INTERACTIVE

if TYPE_CHECKING:
    from gateway.app import Gateway

MAX_BATCHES = 20


def _page() -> str:
    return resources.files("gateway").joinpath("static/status.html").read_text(encoding="utf-8")


def _slo(gw: Gateway, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rclass in (CLASS_INTERACTIVE, CLASS_BATCH):
        w = gw.slo._windows.get((model, rclass))  # noqa: SLF001 - read-only view of the SLO book
        if w is None:
            continue
        ttft, tpot = gw.slo.config_targets(model, rclass)
        out[rclass] = {"attainment": gw.slo.attainment(model, rclass), "met": w.total_met,
                       "missed": w.total_missed, "window_s": gw.slo.window_s,
                       "ttft_ms": ttft * 1000 if ttft else None, "tpot_ms": tpot * 1000 if tpot else None}
    return out


async def status(gw: Gateway) -> dict[str, Any]:
    reg = gw.registry
    fleet = []
    for d, ws in zip(reg.describe_all(), sorted(reg.workers.values(), key=lambda w: w.id), strict=True):
        d["pool"] = pool_label(ws) if ws.rec.role == "mixed" else None
        fleet.append(d)
    disp = gw.dispatcher
    models = []
    for m in reg.served_models():
        rt = disp.runtimes.get(m) if disp is not None else None
        policy = rt.policy_name if rt is not None else gw.config.model_settings(m)[0]
        models.append({"id": m, "policy": policy, "workers_in_rotation": len(reg.rotation(m)),
                       "queue": len(rt.queue) if rt is not None else 0, "slo": _slo(gw, m)})
    state = gw.autoscaler.state if gw.config.autoscale.enabled else {}
    autoscale = {"enabled": gw.config.autoscale.enabled, "leader": state.get("leader"),
                 "desired": state.get("desired", {}), "current": state.get("current", {}),
                 "recent_actions": state.get("recent_actions", [])}
    batches: list[dict[str, Any]] = []
    if gw.config.batch.enabled:
        docs = sorted(await gw.store.list_batches(), key=lambda d: d.get("created_at", 0), reverse=True)
        for doc in docs[:MAX_BATCHES]:
            doc = await gw.batch.with_counts(doc)
            batches.append({k: doc.get(k) for k in ("id", "status", "endpoint", "created_at", "request_counts")})
    return {"time": time.time(), "replica": gw.store.replica_id, "fleet": fleet, "models": models,
            "autoscale": autoscale, "batches": batches,
            "shared_hosts": gw.pooling.describe() if gw.pooling.enabled else []}


def status_router() -> APIRouter:
    r = APIRouter()

    @r.get("/", include_in_schema=False)
    @r.get("/ui", include_in_schema=False)
    async def page() -> Response:
        return HTMLResponse(_page(), headers={"cache-control": "no-cache"})

    @r.get("/ui/status.json")
    async def status_json(request: Request) -> Response:
        tenant_of_request(request)
        return JSONResponse(await status(request.app.state.gateway))

    return r
