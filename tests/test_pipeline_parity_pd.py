"""The gateway and the virtual-time simulator re-place the same P/D legs alike: 210 streamed requests on two
prefill and three decode workers, a decode worker lost at request 70 and a prefill worker at request 140.

The P/D profile of the placement step (policies/pd.py through policies/placement.py) pairs a prefill worker with
a decode worker, or lets the decode worker prefill (short prompts). When a leg's worker fails before its first
byte the gateway's attempt loop (gateway/pipeline/attempts.py) places that leg again: a decode leg on another
decode worker it has not tried, which prefills locally (RETRY for a P/D request: `place_again` ->
`_place_decode`, the P/D policy's `retry_decode`, the placement step told `moved`); a prefill leg on another
prefill worker (REPLACE_PREFILL: `retry_prefill`), none: the decode worker prefills. The simulator does the same
with the same rules (simulator/worker_faults.py: `decode_leg_fails`, `prefill_leg`, and `fails` for a decode
worker that prefills itself), and both eject a worker after `eject_after_errors` failures in a row.

The stream is decided one request at a time as in tests/test_pipeline_parity_stream.py: each request is sent
after the previous one's first token (its prefill leg done, its decode leg running), every open stream keeps
generating, clients close the oldest streams by a seeded schedule (replayed with `simulator/client_abort.py`),
and before each request the harness waits until the gateway's last scrape of every worker agrees with the
requests it holds there. A lost worker answers 500 to every leg from its loss on (`POST /sim/faults`); the
decode worker's open streams are closed first. Its health checks keep passing: only outlier ejection takes it
out. Prompts differ from their first words on, so no prefix is shared (the P/D policy's cached-prefix rule,
which the gateway feeds from text chunks and the simulator from token blocks, never applies).

Observed on the gateway side as a user of its extension points sees it: a request hook (gateway/request/hooks.py)
hears each decode placement (the first, and the one after a failure) with the prefill worker planned; the
prefill workers' own /metrics say which of them computed the prompt (none: the decode worker prefilled it).

Compared, request by request: the first decode worker and prefill worker planned, the decode worker that
served it, the worker that prefilled it (or its refusal, 429, or failure, 500); and the re-placements:
(request, the decode worker that failed, the next one) and (request, the prefill worker that failed, the next
one or the decode worker prefilling locally).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from policies.pace import EJECT_AFTER_ERRORS
from simulator.client_abort import abort_request
from simulator.cluster import ClusterSim
from simulator.tokenizer import count_tokens, render_chat, synthetic_text
from simulator.worker_faults import LOCAL, WorkerFaults
from simulator.workload import WorkloadRequest
from tests.helpers import MODEL, poll, running_gateway

PROFILE = "llama3-8b-h100"
PREFILL, DECODE = ["w0", "w1"], ["w2", "w3", "w4"]   # the simulator's ids: prefill workers first
CAP = 4
N = 210
LOSE_DECODE_AT, LOST_DECODE = 70, "w2"
LOSE_PREFILL_AT, LOST_PREFILL = 140, "w0"
MAX_TOKENS = 30000
RNG = random.Random(3802)
PROMPTS = [RNG.choice((100, 400, 900, 1500)) for _ in range(N)]    # 100: short, the decode worker prefills it
CLOSES = [RNG.choice((0, 1, 1, 1, 2)) for _ in range(N)]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": synthetic_text(PROMPTS[i], f"pd-parity-{i}")}]


class _Placements:
    """A request hook: every decode placement of each request, with the prefill worker planned beside it."""

    def __init__(self) -> None:
        self.seen: dict[str, list[tuple[str, str | None]]] = {}

    def placed(self, ctx: Any, worker: Any) -> None:
        pre = ctx.prefill.id if ctx.prefill is not None else None
        self.seen.setdefault(ctx.feats.request_id, []).append((worker.id, pre))


def _held(gw: Any) -> dict[str, int]:
    return {w: f.requests for w, f in gw.gateway.store.inflight().items() if f.requests}


def _scraped_agrees(gw: Any) -> bool:
    held = _held(gw)
    return all(ws.metrics.running + ws.metrics.waiting == held.get(ws.id, 0)
               for ws in gw.gateway.registry.candidates(MODEL))


async def _prompt_tokens(http: httpx.AsyncClient, urls: dict[str, str]) -> dict[str, float]:
    async def one(url: str) -> float:
        text = (await http.get(url + "/metrics")).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "vllm:prompt_tokens_total")
    values = await asyncio.gather(*(one(u) for u in urls.values()))
    return dict(zip(urls, values, strict=True))


def _content(line: str) -> str:
    """The text of a streamed chat chunk ("" for the role chunk, sent before the first token)."""
    choices = orjson.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


class _Stream:
    def __init__(self, i: int, worker: str, response: httpx.Response, task: asyncio.Task) -> None:
        self.i, self.worker, self.response, self.task = i, worker, response, task

    async def close(self) -> None:
        self.task.cancel()
        await self.response.aclose()


async def _drain(lines) -> None:  # noqa: ANN001
    async for _ in lines:
        pass


async def gateway_run(urls: list[str]) -> dict[str, Any]:
    ids = PREFILL + DECODE
    workers = [{"id": w, "url": u, "profile": PROFILE, "cap": CAP, "role": "prefill" if w in PREFILL else "decode"}
               for w, u in zip(ids, urls, strict=True)]
    by_id = dict(zip(ids, urls, strict=True))
    prefill_urls = {w: by_id[w] for w in PREFILL}
    out: list[tuple] = []
    prefilled: list[str | None] = []
    arrivals: list[float] = []
    closed: dict[int, float] = {}
    lost: dict[str, float] = {}
    open_: list[_Stream] = []
    hook = _Placements()
    async with (running_gateway(workers=workers, learning={"interval_s": 3600.0}, limits={"queue_size": 0},
                                scrape_interval_s=0.05, slo={"ttft_ms": 600, "tpot_ms": 30}) as gw,
                httpx.AsyncClient(timeout=60) as http):
        gw.gateway.dispatcher.hooks.add(hook)
        t0 = time.time()

        async def close(s: _Stream) -> None:
            before = sum(_held(gw).values())
            closed[s.i] = time.time() - t0
            await s.close()
            open_.remove(s)
            await poll(lambda: sum(_held(gw).values()) < before, timeout=20, what="the closed stream released")

        try:
            for i in range(N):
                for at, w in ((LOSE_DECODE_AT, LOST_DECODE), (LOSE_PREFILL_AT, LOST_PREFILL)):
                    if i == at:
                        for s in [s for s in open_ if s.worker == w]:
                            await close(s)
                        r = await http.post(by_id[w] + "/sim/faults", json={"error_status": 500})
                        assert r.status_code == 200, r.text
                        lost[w] = time.time() - t0
                await poll(lambda: _scraped_agrees(gw), timeout=20, what="the scraped engines agree")
                before, prompts = _held(gw), await _prompt_tokens(http, prefill_urls)
                body = {"model": MODEL, "messages": messages(i), "max_tokens": MAX_TOKENS, "stream": True}
                req = http.build_request("POST", gw.url + "/v1/chat/completions", json=body,
                                         headers={"x-sim-output-tokens": str(MAX_TOKENS), "x-request-id": f"r{i}"})
                arrivals.append(time.time() - t0)
                resp = await http.send(req, stream=True)
                if resp.status_code in (429, 500):
                    await resp.aclose()
                    out.append((str(resp.status_code),))
                    prefilled.append(None)
                else:
                    assert resp.status_code == 200, (i, await resp.aread())
                    lines = resp.aiter_lines()
                    async for line in lines:          # the first token: the prefill leg done, the decode running
                        if line.startswith("data: {") and _content(line):
                            break
                    after = _held(gw)
                    grew = [w for w, n in after.items() if n > before.get(w, 0)]
                    assert len(grew) == 1, (i, before, after)
                    out.append((grew[0],))
                    open_.append(_Stream(i, grew[0], resp, asyncio.create_task(_drain(lines))))
                    now = await _prompt_tokens(http, prefill_urls)
                    computed = [w for w in PREFILL if now[w] > prompts[w]]
                    assert len(computed) <= 1, (i, computed)
                    prefilled.append(computed[0] if computed else None)   # None: its decode worker prefilled it
                for s in open_[:CLOSES[i]]:
                    await close(s)
        finally:
            for s in open_:
                await s.close()
        candidates = {ws.id for ws in gw.gateway.registry.candidates(MODEL)}
        pd = gw.gateway.dispatcher.runtimes[MODEL].placement.pd
        prefill_model = pd.prefill_model_for(PROFILE).to_dict()
    assert LOST_DECODE not in candidates and LOST_PREFILL not in candidates, "a failing worker was not ejected"
    return {"out": out, "prefilled": prefilled, "seen": hook.seen, "arrivals": arrivals, "closed": closed,
            "lost": lost, "prefill_model": prefill_model}


def sim_run(run: dict[str, Any]) -> tuple[dict[str, Any], WorkerFaults]:
    sim = ClusterSim(PROFILE, workers=len(PREFILL) + len(DECODE), prefill_workers=len(PREFILL),
                     policy="least_tokens", cap=CAP, queue_size=0, scrape_interval_s=0.0)
    faults = WorkerFaults.install(sim)
    first: dict[str, tuple[str, str | None]] = {}

    def dispatched(s: ClusterSim, r: WorkloadRequest, wid: str, now: float) -> None:
        if r.request_id not in first:
            first[r.request_id] = (wid, s._decisions[r.request_id].prefill_worker_id)

    sim.on_dispatch.append(dispatched)
    arrivals = run["arrivals"]
    reqs = [WorkloadRequest(f"r{i}", arrivals[i], count_tokens(render_chat(messages(i))), MAX_TOKENS,
                            max_tokens=MAX_TOKENS) for i in range(N)]
    for i, t in run["closed"].items():
        sim.schedule(t, lambda s, now, rid=f"r{i}": abort_request(s, rid, now))
    for w, t in run["lost"].items():
        sim.schedule(t, lambda s, now, w=w: faults.fail(w))
    sim.run(reqs, until=arrivals[-1] + 1e-6)
    out, prefilled = [], []
    for i in range(N):
        res = sim.results[f"r{i}"]
        out.append((str(res.status),) if res.status in (429, 500) else (res.worker_id,))
        prefilled.append(res.prefill_worker_id if res.status not in (429, 500) else None)
    return {"out": out, "prefilled": prefilled, "first": first,
            "prefill_model": sim.placement.pd.prefill_model_for(PROFILE).to_dict()}, faults


def _gateway_replacements(run: dict[str, Any]) -> tuple[list, list, dict[str, tuple[str, str | None]]]:
    """From the hook and the metrics: the decode re-placements, the prefill re-placements, the first placements."""
    decode, prefill, first = [], [], {}
    for i in range(N):
        rid = f"r{i}"
        seen = run["seen"].get(rid, [])
        if not seen:
            continue
        first[rid] = seen[0]
        for (a, _), (b, _) in zip(seen, seen[1:], strict=False):
            decode.append((rid, a, b))
        if run["out"][i][0] == "500":
            decode.append((rid, seen[-1][0], None))   # its last decode worker failed it, nobody else took it
        planned = seen[0][1]
        if planned is not None and planned != run["prefilled"][i]:
            prefill.append((rid, planned, run["prefilled"][i] or LOCAL))
    return decode, prefill, first


@pytest.mark.timeout(400)   # ~50 s alone; each request waits for its prefill leg, slower on a loaded machine
async def test_p_d_legs_are_placed_again_alike_when_a_decode_and_a_prefill_worker_are_lost(sim_fleet) -> None:  # noqa: ANN001
    servers = [{"model": MODEL, "role": "kv_producer"}] * len(PREFILL) + \
        [{"model": MODEL, "role": "kv_consumer"}] * len(DECODE)
    fleet = sim_fleet(fleet={"servers": servers}, time_scale=1.0)
    live = await gateway_run(fleet.urls)
    simulated, faults = sim_run(live)
    # the P/D policy estimates prefill times with the profile's model on both sides (the gateway's learner
    # pushes it; it once kept a default model there, while the simulator used the profile's)
    assert live["prefill_model"] == simulated["prefill_model"]
    diff = [(i, g, s) for i, (g, s) in enumerate(zip(live["out"], simulated["out"], strict=True)) if g != s]
    assert not diff, f"{len(diff)} of {N} decode workers differ (request, gateway, simulator): {diff[:10]}"
    diff = [(i, g, s) for i, (g, s) in enumerate(zip(live["prefilled"], simulated["prefilled"], strict=True))
            if g != s]
    assert not diff, f"{len(diff)} of {N} prefill workers differ (request, gateway, simulator): {diff[:10]}"
    decode, prefill, first = _gateway_replacements(live)
    assert first == simulated["first"]
    assert decode == faults.decode_replacements
    assert prefill == faults.prefill_replacements
    # the run exercises what it claims: disaggregated and local prefills before each loss, both losses re-place
    # legs until the worker is ejected, the lost workers take nothing afterwards, refusals at the caps
    assert len(decode) >= 1 and {a for _, a, _ in decode} == {LOST_DECODE}, decode
    assert len(prefill) >= 1 and {a for _, a, _ in prefill} == {LOST_PREFILL}, prefill
    assert [w for w, _ in faults.ejected] == [LOST_DECODE, LOST_PREFILL]
    assert len(decode) == len(prefill) == EJECT_AFTER_ERRORS   # one re-placement per failure, until ejected
    served = [o[0] for o in live["out"]]
    assert LOST_DECODE not in served[LOSE_DECODE_AT:] and LOST_PREFILL not in live["prefilled"][LOSE_PREFILL_AT:]
    # an idle prefill pool ties, broken by id: w0 prefills until it is lost, then w1
    assert "w0" in live["prefilled"][:LOSE_PREFILL_AT] and "w1" in live["prefilled"][LOSE_PREFILL_AT:]
    assert None in live["prefilled"]   # short prompts: the decode worker prefills
    assert "429" in served and len(served) >= 200
