"""The gateway and the virtual-time simulator decide a long request stream alike: 210 requests, clients that go
away, refusals at the caps, model fallbacks, and a worker lost in the middle.

The gateway's real pipeline (real HTTP on loopback, streamed chat requests, three simulated vLLM workers of the
model with a cap of 4 each and one of its fallback model with a cap of 2, no admission queue) and the simulator
(a ClusterSim per model with the same policy, caps and queue size) get the same stream: request i is sent, then a
seeded number of the oldest streams still open are closed by their clients (cancelled: the engine aborts them,
their reservations are given back; the simulator replays each close at the gateway's time with
`simulator/client_abort.py`). A request no worker of the model has room for falls back to the backup model (the
model's `fallbacks`; policies/fallbacks.py on both sides, `simulator/fallbacks_sim.py` in the simulator), and is
refused with 429 when the backup has no room either. Halfway, worker w2 is lost: its open streams are closed
and it answers every request 500 from then on. The gateway's attempt loop places each request w2 fails again
elsewhere (a retry; nobody free: a fallback, or the 500) and ejects w2 after `eject_after_errors` failures in a
row; the simulator does the same with the same rules (`simulator/worker_faults.py`: the placement step without
the workers tried, `policies/pace.py` `error_streak`). Compared, request by request: the worker that served it
(of either model), or its refusal (429) or failure (500).

Why each decision is deterministic, and what is left out:
- the requests go one at a time, each after the previous one's first token, and every close is awaited until the
  gateway released the reservation; every request still open keeps generating (max_tokens far beyond the run),
  so each placement sees exactly the requests the client holds. least_tokens (the default policy) reads the
  reservations (prompt plus predicted output) and breaks a tie in tokens by load, which counts the scraped
  engine metrics: before each request the test waits until the gateway's last scrape of every worker agrees with
  the requests it holds there, and the simulator reads its engines exactly (scrape interval 0).
- nothing completes, so the output-length predictor keeps its prior on both sides and no performance model is
  refitted; the learning loop's progress reports are off (its interval beyond the run).
- moves and P/D re-placements are compared by their own streams: tests/test_pipeline_parity_moves.py (the
  rebalancer's observations given to both sides alike, since measured step times run on different clocks) and
  tests/test_pipeline_parity_pd.py (a decode and a prefill worker lost).
- w2's health checks keep passing (only its generations fail), so only outlier ejection takes it out, after a
  count of failures, not after a time; the retries are compared through the placements they lead to.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from policies.pace import EJECT_AFTER_ERRORS
from simulator.client_abort import abort_request
from simulator.cluster import ClusterSim
from simulator.fallbacks_sim import run_with_fallbacks
from simulator.tokenizer import count_tokens, render_chat, synthetic_text
from simulator.worker_faults import WorkerFaults
from simulator.workload import WorkloadRequest
from tests.helpers import MODEL, poll, running_gateway

PROFILE = "llama3-8b-h100"
WORKERS = 3
CAP = 4
BACKUP = "backup-model"     # MODEL's fallback, served by one worker of its own
BACKUP_WORKER = "w3"
BACKUP_CAP = 2
N = 210
LOSE_AT = 105               # worker w2 is lost after this many requests
LOST = "w2"
MAX_TOKENS = 30000          # every open stream keeps generating for the whole run
RNG = random.Random(38)
PROMPTS = [RNG.choice((100, 300, 800, 1500, 2500)) for _ in range(N)]
CLOSES = [RNG.choice((0, 0, 1, 1, 1, 2)) for _ in range(N)]   # oldest streams closed after request i


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": synthetic_text(PROMPTS[i], f"stream-parity-{i}")}]


def _held(gw: Any) -> dict[str, int]:
    return {w: f.requests for w, f in gw.gateway.store.inflight().items() if f.requests}


def _scraped_agrees(gw: Any) -> bool:
    """Every candidate's last scraped running + waiting equals the requests the gateway holds on it: least_tokens
    breaks a tie in tokens by load, max(reservations, scraped running + waiting), and the simulator's view is
    exact (its scrape interval 0), so the gateway's must have caught up with the closes too."""
    held = _held(gw)
    return all(ws.metrics.running + ws.metrics.waiting == held.get(ws.id, 0)
               for m in (MODEL, BACKUP) for ws in gw.gateway.registry.candidates(m))


class _Stream:
    def __init__(self, i: int, worker: str, response: httpx.Response, task: asyncio.Task) -> None:
        self.i, self.worker, self.response, self.task = i, worker, response, task

    async def close(self) -> None:
        self.task.cancel()
        await self.response.aclose()


async def _drain(lines) -> None:  # noqa: ANN001
    async for _ in lines:
        pass


async def gateway_run(urls: list[str]) -> tuple[list[str], dict[int, float], list[float], float]:
    """Each request's worker ('429' when refused, '500' when w2 failed it and nobody else had room), when each was
    closed, its arrival, and when w2 was lost (all
    seconds after the first arrival)."""
    workers = [{"id": f"w{i}", "url": u, "profile": PROFILE, "cap": CAP} for i, u in enumerate(urls[:WORKERS])]
    workers.append({"id": BACKUP_WORKER, "url": urls[WORKERS], "profile": PROFILE, "cap": BACKUP_CAP,
                    "models": [BACKUP]})
    placed: list[str] = []
    closed: dict[int, float] = {}
    arrivals: list[float] = []
    lost_at = 0.0
    open_: list[_Stream] = []
    async with (running_gateway(workers=workers, learning={"interval_s": 3600.0}, limits={"queue_size": 0},
                                scrape_interval_s=0.05, models={MODEL: {"fallbacks": [BACKUP]}}) as gw,
                httpx.AsyncClient(timeout=60) as http):
        t0 = time.time()

        async def close(s: _Stream) -> None:
            before = sum(_held(gw).values())
            closed[s.i] = time.time() - t0
            await s.close()
            open_.remove(s)
            await poll(lambda: sum(_held(gw).values()) < before, timeout=20, what="the closed stream released")

        try:
            for i in range(N):
                if i == LOSE_AT:
                    for s in [s for s in open_ if s.worker == LOST]:
                        await close(s)
                    r = await http.post(urls[2] + "/sim/faults", json={"error_status": 500})
                    assert r.status_code == 200, r.text
                    lost_at = time.time() - t0
                await poll(lambda: _scraped_agrees(gw), timeout=20, what="the scraped engines agree")
                before = _held(gw)
                body = {"model": MODEL, "messages": messages(i), "max_tokens": MAX_TOKENS, "stream": True}
                req = http.build_request("POST", gw.url + "/v1/chat/completions", json=body,
                                         headers={"x-sim-output-tokens": str(MAX_TOKENS)})
                arrivals.append(time.time() - t0)
                resp = await http.send(req, stream=True)
                if resp.status_code in (429, 500):   # refused at the caps; failed by w2 with nobody else free
                    await resp.aclose()
                    placed.append(str(resp.status_code))
                else:
                    assert resp.status_code == 200, (i, await resp.aread())
                    lines = resp.aiter_lines()
                    async for line in lines:          # the first token: placed and running
                        if line.startswith("data: ") and '"content"' in line:
                            break
                    after = _held(gw)
                    grew = [w for w, n in after.items() if n > before.get(w, 0)]
                    assert len(grew) == 1, (i, before, after)
                    placed.append(grew[0])
                    open_.append(_Stream(i, grew[0], resp, asyncio.create_task(_drain(lines))))
                for s in open_[:CLOSES[i]]:
                    await close(s)
        finally:
            for s in open_:
                await s.close()
        ejected = LOST not in {ws.id for ws in gw.gateway.registry.candidates(MODEL)}
    assert ejected, "the failing worker was not ejected"
    return placed, closed, arrivals, lost_at


def sim_run(closed: dict[int, float], arrivals: list[float], lost_at: float) -> tuple[list[str], WorkerFaults]:
    sim = ClusterSim(PROFILE, workers=WORKERS, policy="least_tokens", cap=CAP, queue_size=0, scrape_interval_s=0.0)
    backup = ClusterSim(PROFILE, workers=1, policy="least_tokens", cap=BACKUP_CAP, queue_size=0,
                        scrape_interval_s=0.0)
    faults = WorkerFaults.install(sim)
    reqs = [WorkloadRequest(f"r{i}", arrivals[i], count_tokens(render_chat(messages(i))), MAX_TOKENS,
                            max_tokens=MAX_TOKENS) for i in range(N)]
    for i, t in closed.items():        # a close reaches whichever model's simulator holds the request
        for s in (sim, backup):
            s.schedule(t, lambda s, now, rid=f"r{i}": abort_request(s, rid, now))
    sim.schedule(lost_at, lambda s, now: faults.fail(LOST))
    served = run_with_fallbacks({MODEL: sim, BACKUP: backup}, MODEL, [BACKUP], reqs, until=arrivals[-1] + 1e-6)
    out = []
    for i in range(N):
        res = served[f"r{i}"].result
        if res.status in (429, 500):
            out.append(str(res.status))
        else:
            out.append(BACKUP_WORKER if served[f"r{i}"].model == BACKUP else res.worker_id)
    return out, faults


async def test_a_long_stream_with_closes_refusals_and_a_lost_worker_is_decided_alike(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": MODEL}] * WORKERS + [{"model": BACKUP}]}, time_scale=1.0)
    placed, closed, arrivals, lost_at = await gateway_run(fleet.urls)
    simulated, faults = sim_run(closed, arrivals, lost_at)
    diff = [(i, g, s) for i, (g, s) in enumerate(zip(placed, simulated, strict=True)) if g != s]
    assert not diff, f"{len(diff)} of {N} differ (request, gateway, simulator): {diff[:10]}"
    # the stream exercises what it claims: every worker, refusals before and after the loss, none on w2 after it
    assert set(placed[:LOSE_AT]) == {"w0", "w1", "w2", BACKUP_WORKER, "429"}, placed[:LOSE_AT]
    assert {"429", BACKUP_WORKER} <= set(placed[LOSE_AT:]) and LOST not in placed[LOSE_AT:], placed[LOSE_AT:]
    assert len(placed) >= 200
    # the lost worker failed requests until its ejection: each was placed again (a retry) on both sides
    assert len(faults.retries) == EJECT_AFTER_ERRORS and [w for w, _ in faults.ejected] == [LOST], faults
    assert all(int(rid[1:]) >= LOSE_AT for rid, _ in faults.retries)
