"""The autoscale test's timeline (containers, requests in flight, desired workers) as JSON, a PNG plot and the
Markdown page bench/results/compose.md."""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sample:
    t: float            # seconds since the burst started
    containers: int     # running containers of the sim service (docker ps)
    inflight: int       # the test's requests in flight
    desired: int        # fleetgate_desired_workers, interactive + mixed (the gateway's autoscaler)
    current: int        # fleetgate_current_workers, interactive + mixed (taking traffic or starting)


def direction_changes(values: list[int]) -> int:
    """How often a series turns from rising to falling or back (flat stretches ignored)."""
    steps = [b - a for a, b in zip(values, values[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if (a > 0) != (b > 0))


def write(samples: list[Sample], out: Path, *, burst_s: float, users: int, failures: int, answered: int,
          command: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out.mkdir(parents=True, exist_ok=True)
    (out / "compose_timeline.json").write_text(json.dumps([asdict(s) for s in samples], indent=0))
    t = [s.t for s in samples]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.step(t, [s.containers for s in samples], where="post", label="sim containers")
    ax.step(t, [s.desired for s in samples], where="post", linestyle="--", label="desired workers")
    ax.set_xlabel("seconds since the burst started")
    ax.set_ylabel("workers")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.axvspan(0, burst_s, alpha=0.1, color="tab:orange", label=f"burst ({users} users)")
    ax2 = ax.twinx()
    ax2.plot(t, [s.inflight for s in samples], color="tab:gray", linewidth=0.8, label="requests in flight")
    ax2.set_ylabel("requests in flight")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax.set_title("docker-compose --profile autoscale: the gateway scales the sim service")
    fig.tight_layout()
    fig.savefig(out / "compose.png", dpi=100)
    plt.close(fig)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    docker = subprocess.run(["docker", "version", "-f", "{{.Server.Version}}"], capture_output=True,
                            text=True).stdout.strip()
    peak = max(s.containers for s in samples)
    grown = next((s.t for s in samples if s.containers > 1), None)
    back = next((s.t for s in samples if s.t > burst_s and s.containers == 1), None)
    rows = "\n".join(f"| {s.t:.0f} | {s.containers} | {s.inflight} | {s.desired} | {s.current} |"
                     for i, s in enumerate(samples) if i % 5 == 0 or i == len(samples) - 1)
    md = f"""# docker compose: the gateway scales real containers

`make test-compose` (tests_compose/test_stack.py, the autoscale test): the stack of docker-compose.yml with
`--profile autoscale --scale sim=1` (deploy/compose/fleetgate-autoscale.yaml: actuator `docker`, the sim
containers found by DNS). {users} users send requests back to back (max_tokens 256) for {burst_s:.0f} s, then
nothing; the test samples every second the running sim containers (`docker ps`), its own requests in flight and
the gateway's `fleetgate_desired_workers`.

Command: `{command}`; commit {commit}; machine: {platform.machine()}, {_cpus()} cores shared with other jobs,
Linux {platform.release()}, Docker Engine {docker}, docker-compose 1.29 (Debian).

| | |
|---|---|
| requests answered / failed | {answered} / {failures} |
| sim containers: start, peak, end | 1, {peak}, {samples[-1].containers} |
| first added container running | {_s(grown)} after the burst started |
| back to 1 container | {_s(back)} after the burst started |
| direction changes (containers / desired) | {direction_changes([s.containers for s in samples])} / {direction_changes([s.desired for s in samples])} |

![timeline](compose.png)

Timeline (every 5th sample; the whole series is in compose_timeline.json):

| t (s) | sim containers | in flight | desired | current |
|---|---|---|---|---|
{rows}
"""
    (out / "compose.md").write_text(md)
    return out / "compose.md"


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.0f} s"


def _cpus() -> int:
    import os

    return os.cpu_count() or 0
