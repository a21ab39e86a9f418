"""The gateway and the virtual-time simulator move the same requests to the same workers: 210 streamed requests
on three workers whose engines queue, one of them observed slow for a stretch of the run.

Rebalancing moves a request that waits in a worker's engine queue (no first token) off a worker observed slower
than its performance model by more than `slow_ratio`, within the model's budget of moves per second
(policies/rebalance.py: `queued_legs`, `propose_moves`, `move_exclusions`; the placement step's
`rebalance`). The gateway's rebalancer (gateway/pipeline/rebalancer.py) interrupts the leg and its attempt loop
places the request again (gateway/pipeline/attempts.py `place_again`, MOVE); the simulator's
(simulator/rebalance_sim.py) aborts it on its engine and places it again through the same placement step.

What each side observes, and how the comparison is made honest:
- the one input that cannot be equal is a measured step time: the gateway times its streams' tokens on the wall
  clock, the simulator on its virtual clock, and a loaded test machine makes the wall clock's ratios wander
  (healthy workers were measured up to 2.2x, see RebalanceConfig.slow_ratio). So the observation is an input of
  the rule on both sides (`Rebalancer.tick(now, observed)`, `SimRebalancer.look(now, observed)`): the harness
  gives both the same step ratios, w0 slowed by a known factor (SLOWDOWN) from request SLOW_FROM to SLOW_UNTIL and
  every worker at its model's speed otherwise, and calls both looks at the same instants (the gateway's
  perf_counter clock, the simulator's virtual clock, both counted from the first arrival, so the move budget
  refills alike). The measurement itself is tested on each side on its own (tests/test_gateway_rebalance.py,
  tests/test_policies_rebalance.py, tests/test_pipeline_core.py).
- everything else is each side's own view: which requests have no first token, which of them are still queued
  (the worker's engine queue: the gateway's scraped /metrics, the simulator's engines read exactly), the
  reservations, the order the worker got them, the budget, the candidates, and where the moved request lands
  (the proposed destination if it still has room, else any worker it has not tried; no worker: refused).
- the engines run two sequences at a time (max_num_seqs 2) under a cap of 6, so up to four requests per worker
  wait in its queue; every request keeps generating for the whole run (max_tokens far beyond it), clients close
  the oldest streams by a seeded schedule (replayed in the simulator with `simulator/client_abort.py`), and the
  harness waits before each request and each look until the gateway's last scrape of every engine agrees with
  the requests it holds there (running = min(held, 2), waiting = the rest), as the simulator's view is exact.
- hung-leg detection is off: a request waits in an engine queue for many seconds by design here, and the stall
  rule would place it again (a retry, not a move).

Compared: each request's first worker (or its refusal, 429), and every look's moves: (request, from, proposed
destination, where it landed).

The policy is least_tokens (the default), whose rebalancing is the move off slow workers. Not compared: aladdin's
Algorithm 2. Its ledger advances each request's predicted progress with the policies' clock (wall time live,
virtual time simulated), so even its placements part in this harness after about 20 requests (tried with the
same SLOs and the same performance models on both sides), before any move; the moves it proposes are covered by
the rule's own tests (tests/test_policies_aladdin.py, tests/test_pipeline_core.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict
from typing import Any

import httpx

from simulator.client_abort import abort_request
from simulator.cluster import ClusterSim
from simulator.profiles import load_profile, profile_from_dict
from simulator.rebalance_sim import SimRebalancer
from simulator.tokenizer import count_tokens, render_chat, synthetic_text
from simulator.workload import WorkloadRequest
from tests.helpers import MODEL, poll, running_gateway

PROFILE = "llama3-8b-h100"
SEQS = 2                    # each engine runs this many sequences; the rest of its requests wait in its queue
CAP = 6
WORKERS = 3
N = 210
SLOW, SLOWDOWN = "w0", 5.0  # the worker observed slow, and by how much (over its performance model's step)
SLOW_FROM, SLOW_UNTIL = 40, 180
LOOK_EVERY = 2              # a look after every second request
MAX_MOVES_PER_S = 2.0       # the budget binds: at most two moves a look, refilled at 2 per second
SLOW_RATIO = 3.0
MAX_TOKENS = 30000
RNG = random.Random(3801)
PROMPTS = [RNG.choice((100, 300, 800, 1500)) for _ in range(N)]
CLOSES = [RNG.choice((0, 0, 1, 1, 2)) for _ in range(N)]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": synthetic_text(PROMPTS[i], f"move-parity-{i}")}]


def observed(i: int) -> dict[str, float]:
    """The step ratios both sides judge after request i: w0 slowed by SLOWDOWN in [SLOW_FROM, SLOW_UNTIL)."""
    slow = SLOWDOWN if SLOW_FROM <= i < SLOW_UNTIL else 1.0
    return {f"w{k}": slow if f"w{k}" == SLOW else 1.0 for k in range(WORKERS)}


def _held(gw: Any) -> dict[str, int]:
    return {w: f.requests for w, f in gw.gateway.store.inflight().items() if f.requests}


def _scraped_agrees(gw: Any) -> bool:
    """Every worker's last scrape shows the requests the gateway holds on it, split as its engine splits them."""
    held = _held(gw)
    for ws in gw.gateway.registry.candidates(MODEL):
        n = held.get(ws.id, 0)
        if (ws.metrics.running, ws.metrics.waiting) != (min(n, SEQS), max(0, n - SEQS)):
            return False
    return True


class _Stream:
    """One client's streamed request, read in a task until the client closes it."""

    def __init__(self, http: httpx.AsyncClient, url: str, i: int) -> None:
        self.i = i
        self.status: int | None = None
        self.task = asyncio.create_task(self._run(http, url))

    async def _run(self, http: httpx.AsyncClient, url: str) -> None:
        body = {"model": MODEL, "messages": messages(self.i), "max_tokens": MAX_TOKENS, "stream": True}
        async with http.stream("POST", url + "/v1/chat/completions", json=body,
                               headers={"x-sim-output-tokens": str(MAX_TOKENS), "x-request-id": f"r{self.i}"}) as r:
            self.status = r.status_code
            async for _ in r.aiter_bytes():
                pass

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def _where(gw: Any, rid: str) -> str | None:
    legs = gw.gateway.rebalancer.legs.get(MODEL, {})
    leg = legs.get(rid)
    return leg.worker if leg is not None else None


async def gateway_run(urls: list[str]) -> dict[str, Any]:
    workers = [{"id": f"w{k}", "url": u, "profile": PROFILE, "cap": CAP} for k, u in enumerate(urls)]
    placed: list[str] = []
    arrivals: list[float] = []
    closed: dict[int, float] = {}
    looks: list[tuple[float, list[tuple[str, str, str, str]], dict[str, float]]] = []
    open_: list[_Stream] = []
    async with (running_gateway(workers=workers, learning={"interval_s": 3600.0}, limits={"queue_size": 0},
                                scrape_interval_s=0.05, resume={"hung_detection": False},
                                rebalance={"enabled": True, "interval_s": 3600.0, "max_moves_per_s": MAX_MOVES_PER_S,
                                           "slow_ratio": SLOW_RATIO}) as gw,
                httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http):
        reb = gw.gateway.rebalancer
        t0 = time.perf_counter()

        async def settled() -> None:
            await poll(lambda: _scraped_agrees(gw), timeout=20, what="the scraped engines agree")

        async def close(s: _Stream) -> None:
            before = sum(_held(gw).values())
            closed[s.i] = time.perf_counter() - t0
            await s.close()
            open_.remove(s)
            await poll(lambda: sum(_held(gw).values()) < before, timeout=20, what="the closed stream released")

        try:
            for i in range(N):
                await settled()
                before = _held(gw)
                arrivals.append(time.perf_counter() - t0)
                s = _Stream(http, gw.url, i)

                def placed_or_refused() -> str | None:
                    after = _held(gw)  # noqa: B023
                    grew = [w for w, n in after.items() if n > before.get(w, 0)]  # noqa: B023
                    if grew:
                        return grew[0]
                    return str(s.status) if s.status is not None and s.status != 200 else None  # noqa: B023

                where = await poll(placed_or_refused, timeout=20, what=f"request {i} placed or refused")
                placed.append(where)
                if where.startswith("w"):
                    open_.append(s)
                    await poll(lambda: _where(gw, f"r{i}") is not None, timeout=20,  # noqa: B023
                               what="its leg under the rebalancer")
                else:
                    await s.close()
                if i % LOOK_EVERY == LOOK_EVERY - 1:
                    await settled()
                    now = time.perf_counter()
                    moves = await reb.tick(now=now, observed=observed(i))
                    rows = []
                    for m in moves:
                        stream = next(x for x in open_ if f"r{x.i}" == m.request_id)

                        def landed(m=m, stream=stream) -> str | None:  # noqa: ANN001
                            w = _where(gw, m.request_id)
                            if w is not None and w != m.src:
                                return w
                            return "lost" if stream.task.done() else None

                        rows.append((m.request_id, m.src, m.dst,
                                     await poll(landed, timeout=20, what=f"{m.request_id} moved")))
                    looks.append((now - t0, rows, observed(i)))
                    for rid, _, _, w in rows:
                        if w == "lost":
                            stream = next(x for x in open_ if f"r{x.i}" == rid)
                            open_.remove(stream)
                            closed[stream.i] = time.perf_counter() - t0   # the gateway ended it: no close later
                for s in open_[:CLOSES[i]]:
                    await close(s)
        finally:
            for s in open_:
                await s.close()
        assert reb.moves.labels(MODEL)._value.get() == sum(len(r) for _, r, _ in looks)   # counted as made
    return {"placed": placed, "arrivals": arrivals, "closed": closed, "looks": looks}


def sim_run(run: dict[str, Any]) -> dict[str, Any]:
    prof = profile_from_dict({**asdict(load_profile(PROFILE)), "max_num_seqs": SEQS}, "parity profile")
    # shed=False: the gateway's requests here carry no TTFT target, so its shedding rule judges none of them;
    # ClusterSim gives every request its default target, which the rule would judge on virtual time.
    sim = ClusterSim(prof, workers=WORKERS, policy="least_tokens", cap=CAP, queue_size=0, scrape_interval_s=0.0,
                     shed=False)
    reb = SimRebalancer(sim, max_moves_per_s=MAX_MOVES_PER_S, slow_ratio=SLOW_RATIO)
    first: dict[str, str] = {}
    sim.on_dispatch.append(lambda s, r, wid, now: first.setdefault(r.request_id, wid))
    arrivals = run["arrivals"]
    reqs = [WorkloadRequest(f"r{i}", arrivals[i], count_tokens(render_chat(messages(i))), MAX_TOKENS,
                            max_tokens=MAX_TOKENS) for i in range(N)]
    for i, t in run["closed"].items():
        sim.schedule(t, lambda s, now, rid=f"r{i}": abort_request(s, rid, now))
    looks: list[tuple[float, list[tuple[str, str, str, str]], dict[str, float]]] = []

    def look(s: ClusterSim, now: float, ratios: dict[str, float]) -> None:
        rows = []
        for m in reb.look(now, observed=ratios):
            res = s.results[m.request_id]
            rows.append((m.request_id, m.src, m.dst, res.worker_id if res.status is None else "lost"))
        looks.append((now, rows, ratios))

    for t, _, ratios in run["looks"]:
        sim.schedule(t, lambda s, now, ratios=ratios: look(s, now, ratios))
    sim.run(reqs, until=max(arrivals[-1], run["looks"][-1][0]) + 1e-6)
    placed = [first.get(f"r{i}") or str(sim.results[f"r{i}"].status) for i in range(N)]
    return {"placed": placed, "looks": looks}


async def test_the_same_requests_move_to_the_same_workers(sim_fleet) -> None:  # noqa: ANN001
    fleet = sim_fleet(fleet={"servers": [{"model": MODEL, "profile_overrides": {"max_num_seqs": SEQS}}] * WORKERS},
                      time_scale=1.0)
    live = await gateway_run(fleet.urls)
    simulated = sim_run(live)
    diff = [(i, g, s) for i, (g, s) in enumerate(zip(live["placed"], simulated["placed"], strict=True)) if g != s]
    assert not diff, f"{len(diff)} of {N} placements differ (request, gateway, simulator): {diff[:10]}"
    moves_live = [rows for _, rows, _ in live["looks"]]
    moves_sim = [rows for _, rows, _ in simulated["looks"]]
    diff = [(k, g, s) for k, (g, s) in enumerate(zip(moves_live, moves_sim, strict=True)) if g != s]
    assert not diff, f"{len(diff)} looks differ (look, gateway, simulator): {diff[:5]}"
    # the run exercises what it claims: moves only off w0 and only while it is observed slow; many of them, the
    # budget binding at times (a look with queued requests on w0 that moved only some), refusals at the caps
    all_moves = [(t, m) for t, rows, ratios in live["looks"] for m in rows]
    assert len(all_moves) >= 10, all_moves
    assert all(m[1] == SLOW and m[3] != SLOW for _, m in all_moves)
    slow_looks = [rows for _, rows, ratios in live["looks"] if ratios[SLOW] > SLOW_RATIO]
    calm_looks = [rows for _, rows, ratios in live["looks"] if ratios[SLOW] <= SLOW_RATIO]
    assert calm_looks and not any(calm_looks), "a move while no worker was observed slow"
    assert max(len(r) for r in slow_looks) == int(MAX_MOVES_PER_S), "the budget never bound a look"
    assert "429" in live["placed"] and len(live["placed"]) >= 200
