"""The status page: `GET /` (or `/ui`) is one HTML file with a little JS that polls `GET /ui/status.json`.

The JSON (also for scripts) says, from this replica's point of view:
    fleet       every worker: id, url, role, pool label, state (active/draining), health, in flight, cap
                (`cap_source`: the gateway's cap, set in the config or by the autoscaler, else the engine's own
                batch limit from its performance model), engine running / waiting / KV-cache use / sleep state
                (last scrape), output tokens per second over the window (`throughput_tokens_s`), models
    models      per served model: policy, workers in rotation, admission queue depth, over the last `window_s`
                the request rate (`request_rate`, requests/s, any status), TTFT and TPOT p50 / p99
                (`ttft_p50_ms`, `ttft_p99_ms`, `tpot_p50_ms`, `tpot_p99_ms`) and `errors` (counts: `4xx` other
                than 429 and client gone, `429`, `5xx`, `client_gone`); SLO attainment per class over the SLO
                window, judged requests (met / missed)
    errors      every error answered over the window, per model, status and reason (the error code the client
                got: model_not_found, invalid_api_key, no_route, rate_limit_exceeded, capacity_exceeded, ...;
                `worker` for a worker's own status relayed), most frequent first; `_unknown` is a request that
                named no served model (or no route)
    unknown_models  the last 10 model names clients sent that the gateway does not serve, with counts
    history     the same per-model numbers and each worker's throughput and in flight, one point per
                `status.sample_s` over the last `status.history_s` (gateway/ops/status_history.py)
    autoscale   the leader's desired / current workers per pool and its recent scale actions (when on)
    batches     the Batch API's batches with their request counts (latest first, at most 20)
Who sees what: the admin key sees every batch and each worker's URL; an inference key (or anyone, on a gateway
without inference keys) sees only the batches it made, as the Batches API does, and the workers without their
URLs (internal addresses are the operator's business).
No build step, no external assets: the page is `gateway/static/status.html`.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from gateway.api.batch import owned
from gateway.control.actuators import pool_label
from gateway.tenancy.auth import Tenant, tenant_of_request
from policies.types import CLASS_BATCH, CLASS_INTERACTIVE

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.registry import WorkerState

MAX_BATCHES = 20


def _page() -> str:
    return resources.files("gateway").joinpath("static/status.html").read_text(encoding="utf-8")


def _slo(gw: Gateway, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rclass in (CLASS_INTERACTIVE, CLASS_BATCH):
        v = gw.slo.view(model, rclass)
        if v is None:
            continue
        out[rclass] = {"attainment": v.attainment, "met": v.met, "missed": v.missed, "window_s": v.window_s,
                       "ttft_ms": v.ttft_s * 1000 if v.ttft_s else None,
                       "tpot_ms": v.tpot_s * 1000 if v.tpot_s else None}
    return out


def _cap(gw: Gateway, ws: WorkerState) -> tuple[int | None, str | None]:
    """(cap, where it comes from): the gateway's (config or autoscaler), else the engine's batch limit."""
    if ws.rec.cap is not None:
        return ws.rec.cap, "gateway"
    model = gw.learner.model_for(ws.rec.profile) if ws.rec.profile else None
    return (model.max_batch, "engine") if model is not None else (None, None)


async def status(gw: Gateway, viewer: Tenant | None = None) -> dict[str, Any]:
    """The status document as `viewer` may see it: None is the admin (everything), a tenant sees its own batches
    and no worker URL."""
    reg = gw.registry
    window_s, figures, throughput, error_rows = gw.status_history.current_with_errors()
    fleet = []
    for d, ws in zip(reg.describe_all(), sorted(reg.workers.values(), key=lambda w: w.id), strict=True):
        d["pool"] = pool_label(ws) if ws.rec.role == "mixed" else None
        d["cap"], d["cap_source"] = _cap(gw, ws)
        d["throughput_tokens_s"] = throughput.get(ws.id)
        if viewer is not None:
            del d["url"]
        fleet.append(d)
    disp = gw.dispatcher
    models = []
    for m in reg.served_models():
        rt = disp.runtimes.get(m) if disp is not None else None
        policy = rt.policy_name if rt is not None else gw.config.model_settings(m)[0]
        f = figures.get(m) or {}
        models.append({"id": m, "policy": policy, "workers_in_rotation": len(reg.rotation(m)),
                       "queue": len(rt.queue) if rt is not None else 0,
                       "request_rate": f.get("request_rate", 0.0),
                       **{k: f.get(k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")},
                       "errors": {"4xx": f.get("errors_4xx", 0), "429": f.get("errors_429", 0),
                                  "5xx": f.get("errors_5xx", 0), "client_gone": f.get("client_gone", 0)},
                       "slo": _slo(gw, m)})
    state = gw.autoscaler.state if gw.config.autoscale.enabled else {}
    autoscale = {"enabled": gw.config.autoscale.enabled, "leader": state.get("leader"),
                 "desired": state.get("desired", {}), "current": state.get("current", {}),
                 "recent_actions": state.get("recent_actions", [])}
    batches: list[dict[str, Any]] = []
    if gw.config.batch.enabled:
        docs = [d for d in await gw.store.list_batches() if viewer is None or owned(d, viewer)]
        docs.sort(key=lambda d: d.get("created_at", 0), reverse=True)
        for doc in docs[:MAX_BATCHES]:
            doc = await gw.batch.with_counts(doc)
            batches.append({k: doc.get(k) for k in ("id", "status", "endpoint", "created_at", "request_counts")})
    # The names clients sent that no model answers to: the admin's to see (on an open gateway, anyone's).
    unknown = gw.metrics.unknown_models.describe() if viewer is None or gw.auth.open else []
    return {"time": time.time(), "replica": gw.store.replica_id, "window_s": window_s, "fleet": fleet,
            "models": models, "errors": error_rows, "unknown_models": unknown,
            "history": gw.status_history.describe(), "autoscale": autoscale, "batches": batches,
            "shared_hosts": gw.pooling.describe() if gw.pooling.enabled else []}


def status_router() -> APIRouter:
    r = APIRouter()

    @r.get("/", include_in_schema=False)
    @r.get("/ui", include_in_schema=False)
    async def page() -> Response:
        return HTMLResponse(_page(), headers={"cache-control": "no-cache"})

    @r.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        """Browsers ask for it with the page: an empty answer, not a 404 counted among the errors."""
        return Response(status_code=204)

    @r.get("/ui/status.json")
    async def status_json(request: Request) -> Response:
        gw = request.app.state.gateway
        admin = gw.auth.is_admin(request.headers.get("authorization"))
        return JSONResponse(await status(gw, None if admin else tenant_of_request(request)))

    return r
