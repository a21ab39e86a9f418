"""Request hooks (gateway/request/hooks.py): the four points a request passes, who hears them, in which order."""

from __future__ import annotations

import httpx
import openai

from gateway.fleet.registry import WorkerState
from gateway.request.context import Outcome, RequestContext
from gateway.request.hooks import RequestHook, RequestHooks
from tests.helpers import MODEL, running_gateway


class Recorder(RequestHook):
    """Every point it hears, with what the context says there."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple]] = {}   # request id -> the points it passed, in order

    def _note(self, ctx: RequestContext, *call: object) -> None:
        self.calls.setdefault(ctx.rid.decode(), []).append(call)

    def arrived(self, ctx: RequestContext) -> None:
        self._note(ctx, "arrived", ctx.feats.model, ctx.worker)

    def placed(self, ctx: RequestContext, worker: WorkerState) -> None:
        self._note(ctx, "placed", worker.id, ctx.worker is worker, ctx.pd)

    def released(self, ctx: RequestContext, worker: WorkerState) -> None:
        self._note(ctx, "released", worker.id)

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        self._note(ctx, "finished", outcome.status, outcome.model,
                   outcome.feats.request_id if outcome.feats is not None else None)


def test_only_the_points_a_hook_overrides_are_called_in_registration_order() -> None:
    calls: list[str] = []

    class Placed(RequestHook):
        def placed(self, ctx: RequestContext, worker: WorkerState) -> None:
            calls.append("a.placed")

    class Both(RequestHook):
        def placed(self, ctx: RequestContext, worker: WorkerState) -> None:
            calls.append("b.placed")

        def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
            calls.append("b.finished")

    hooks = RequestHooks([Placed(), Both()])
    ctx, ws = object(), object()
    hooks.arrived(ctx)
    hooks.placed(ctx, ws)
    hooks.released(ctx, ws)
    hooks.finished(ctx, object())
    assert calls == ["a.placed", "b.placed", "b.finished"]
    assert RequestHooks().hooks == ()


async def test_a_request_passes_the_four_points_and_a_malformed_one_only_finishes(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=50)
    async with running_gateway(fleet.urls, logging={"access_log": True}) as gw:
        d = gw.gateway.dispatcher
        # Who registers, in order (the service order only while it is on): gateway/request/hooks.py.
        assert [type(h).__name__ for h in d.hooks.hooks] == [
            "ClassRouter", "Tickets", "Learner", "SloBook", "RequestMetrics", "RequestObserver"]
        rec = Recorder()
        d.hooks = RequestHooks([*d.hooks.hooks, rec])
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        r = await client.completions.with_raw_response.create(model=MODEL, prompt="hello there", max_tokens=4)
        rid = r.headers["x-request-id"]
        async with httpx.AsyncClient() as c:
            bad = await c.post(gw.url + "/v1/completions", content=b"{",
                               headers={"content-type": "application/json", "x-request-id": "malformed-1"})
        assert bad.status_code == 400
    assert rec.calls == {
        rid: [("arrived", MODEL, None), ("placed", "w0", True, False), ("released", "w0"), ("finished", 200, MODEL, rid)],
        "malformed-1": [("finished", 400, "_unknown", None)]}
