"""The live autoscaler under `fleetgate demo --autoscale`'s steady burst: every scale action, and every worker
stopped with a request on it.

    python -m bench.autoscale_live --time-scale 10 --burst-s 8        # ~40 s; prints one JSON line

The gateway runs in this process with the demo's own `autoscale:` settings (gateway/demo.py
`autoscale_demo_settings`) and its `sim` actuator; `users` closed-loop clients (the demo's burst: 32 users,
256-token answers, no client retries) run for `burst_s` wall seconds, then the fleet is left alone until it is
back at its minimum. Reported:
- `actions`: every scale action the leader took (time from the burst's start, pool, signed count, reason), and
  `direction_changes`: how often the sign of the fleet's change flipped (one burst, done right: one flip,
  grow then shrink after it);
- `stopped_busy`: workers whose engine still held a request when the actuator stopped them, from the
  actuator's own warning (gateway/control/actuators.py `release`), and `worker_errors`: error log records of the
  simulated workers and the gateway's retries / stream breaks, which a client never sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from openai import APIError, AsyncOpenAI

from gateway.config import load_config
from gateway.demo import autoscale_demo_settings
from gateway.server import GatewayServer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SLO = {"ttft_ms": 1000.0, "tpot_ms": 50.0}     # the demo's defaults (--slo-ttft-ms / --slo-tpot-ms)


@dataclass
class BurstResult:
    time_scale: float
    users: int
    burst_s: float
    initial_workers: int
    actions: list[dict[str, Any]] = field(default_factory=list)
    direction_changes: int = 0
    peak_workers: int = 0
    final_workers: int = 0
    requests: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)   # client-visible errors by kind (no client retries)
    stopped_busy: list[str] = field(default_factory=list)
    worker_errors: list[str] = field(default_factory=list)
    retries: float = 0.0
    stream_breaks: float = 0.0
    wall_s: float = 0.0


class _Records(logging.Handler):
    """Keeps the log records this run cares about (records are read, never filtered out of other handlers)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def direction_changes(signed: list[int]) -> int:
    """How often consecutive non-zero changes of the fleet size differ in sign."""
    signs = [1 if c > 0 else -1 for c in signed if c]
    return sum(1 for a, b in zip(signs, signs[1:], strict=False) if a != b)


def _metric_total(gw: GatewayServer, name: str) -> float:
    total = 0.0
    for fam in gw.gateway.metrics.registry.collect():
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


async def run_burst(*, time_scale: float = 10.0, users: int = 32, burst_s: float = 8.0, workers: int = 1,
                    max_tokens: int = 256, settle_s: float | None = None, base_port: int = 0) -> BurstResult:
    """One burst against the demo's autoscaler; returns what happened (see the module docstring)."""
    res = BurstResult(time_scale, users, burst_s, workers)
    settings = autoscale_demo_settings(workers, "llama3-8b-h100", MODEL, time_scale, base_port, SLO)
    cfg = load_config(None, listen={"host": "127.0.0.1", "port": 0}, default_policy="least_requests", slo=SLO,
                      autoscale=settings, logging={"access_log": False})
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    t0 = time.monotonic()
    try:
        async with GatewayServer(cfg) as gw:
            scaler = gw.gateway.autoscaler
            client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            seen_actions = 0

            def fleet_size() -> int:
                st = scaler.state or {}
                return sum(st.get("current", {}).values())

            async def watch(stop: asyncio.Event) -> None:
                nonlocal seen_actions
                while not stop.is_set():
                    res.peak_workers = max(res.peak_workers, fleet_size())
                    await asyncio.sleep(0.05)

            async def user(end: float) -> None:
                while time.monotonic() < end:
                    res.requests += 1
                    try:
                        await client.chat.completions.create(
                            model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": "Hello!"}])
                    except APIError as e:
                        res.failed += 1
                        why = f"{type(e).__name__} {getattr(e, 'status_code', '')}".strip()
                        res.failures[why] = res.failures.get(why, 0) + 1

            # the fleet at its start size and the scaler's first decisions made, as a user would find the demo
            await asyncio.sleep(3 * cfg.autoscale.interval_s)
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            t_burst = time.monotonic()
            end = t_burst + burst_s
            await asyncio.gather(*(user(end) for _ in range(users)))
            limit = time.monotonic() + (settle_s if settle_s is not None else 120.0 / time_scale + 30.0)
            minimum = cfg.autoscale.scaler.get("min_interactive", 1)
            while time.monotonic() < limit:
                draining = scaler.actuator.draining()
                if fleet_size() <= minimum and not draining and len(gw.gateway.registry.workers) <= minimum:
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await watcher
            await client.close()
            res.final_workers = len(gw.gateway.registry.workers)
            t_wall = time.time() - (time.monotonic() - t_burst)   # the burst's start on the wall clock
            for a in scaler.recent_actions:
                if a["t"] >= t_wall - 1e-6:
                    res.actions.append({"t": round(a["t"] - t_wall, 2), "pool": a["pool"], "reason": a["reason"],
                                        "change": a["count"] if a["direction"] == "up" else -a["count"]})
            res.retries = _metric_total(gw, "fleetgate_retries_total")
            res.stream_breaks = _metric_total(gw, "fleetgate_stream_breaks_total")
    finally:
        root.removeHandler(records)
    res.direction_changes = direction_changes([a["change"] for a in res.actions])
    for r in records.records:
        msg = r.getMessage()
        if r.name == "fleetgate.actuators" and "still running" in msg:
            res.stopped_busy.append(msg)
        elif r.levelno >= logging.ERROR and r.name.startswith(("fleetgate", "simulator", "uvicorn")) \
                and not r.name.startswith("fleetgate.actuators"):   # the gateway's and the workers' own loggers
            res.worker_errors.append(f"{r.name}: {msg}" + (f" ({r.exc_info[1]!r})" if r.exc_info else ""))
    res.wall_s = round(time.monotonic() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--burst-s", type=float, default=8.0, help="wall seconds of the burst")
    ap.add_argument("--workers", type=int, default=1, help="workers the demo starts with")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("fleetgate.autoscaler").setLevel(logging.INFO)
    for _ in range(args.runs):
        r = asyncio.run(run_burst(time_scale=args.time_scale, users=args.users, burst_s=args.burst_s,
                                  workers=args.workers))
        print(json.dumps(asdict(r)), flush=True)


if __name__ == "__main__":
    main()
