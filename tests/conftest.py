"""Shared test helpers: simulated vLLM fleets on free ports, torn down after the test (also on failure).

    def test_x(sim_fleet):
        fleet = sim_fleet(3, time_scale=20)            # SimFleet.of(...) options; started in a thread
        fleet.urls                                       # ["http://127.0.0.1:PORT", ...]

    def test_y(sim_url):                                 # one default server (time_scale 20)
        httpx.get(sim_url + "/health")

    def test_z(sim_fleet_process):                       # `fleetgate sim` in a child process: its own
        fleet = sim_fleet_process(2, time_scale=5)       # GIL, for timing-sensitive tests and benchmarks
        fleet.urls

For a mixed fleet pass a fleet mapping (the YAML format of simulator/fleet.py):
`sim_fleet(fleet={"servers": [{"role": "kv_producer"}, {"role": "kv_consumer"}]}, time_scale=20)`,
or specs: `sim_fleet(specs=[ServerSpec(...), ...])`. Outside pytest, `simulator.fleet.running_fleet(...)`
(a context manager), `SimFleet` and `FleetProcess` do the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from simulator.fleet import FleetProcess, ServerSpec, SimFleet, fleet_from_dict

FAST_TIME_SCALE = 20.0
_FLEET_FILE_OPTIONS = ("profile", "model", "time_scale", "seed")


@pytest.fixture
def sim_fleet() -> Iterator[Callable[..., SimFleet]]:
    """Factory fixture: start simulated fleets (background thread); every one is stopped at teardown."""
    started: list[SimFleet] = []

    def start(workers: int = 1, *, specs: list[ServerSpec] | None = None, fleet: dict | None = None,
              host: str = "127.0.0.1", **options: Any) -> SimFleet:
        if fleet is not None:
            unknown = sorted(set(options) - set(_FLEET_FILE_OPTIONS))
            if unknown:
                raise TypeError(f"with fleet=..., set {unknown} per server in the mapping")
            specs = fleet_from_dict(fleet, "<test fleet>", **options)
        f = SimFleet(specs, host=host) if specs is not None else SimFleet.of(workers, host=host, **options)
        started.append(f)
        f.start()
        return f

    yield start
    for f in reversed(started):
        f.stop()


@pytest.fixture
def sim_url(sim_fleet: Callable[..., SimFleet]) -> str:
    """URL of one simulated llama3-8b-h100 server running 20x faster than real time."""
    return sim_fleet(1, time_scale=FAST_TIME_SCALE).urls[0]


@pytest.fixture
def sim_fleet_process() -> Iterator[Callable[..., FleetProcess]]:
    """Factory fixture: `fleetgate sim` in child processes (FleetProcess options); killed at teardown."""
    started: list[FleetProcess] = []

    def start(workers: int = 1, **options: Any) -> FleetProcess:
        proc = FleetProcess(workers, **options)
        started.append(proc)
        proc.start()
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()
