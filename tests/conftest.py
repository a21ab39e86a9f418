"""Shared test helpers: simulated vLLM fleets on free ports, torn down after the test (also on failure).

    def test_x(sim_fleet):
        fleet = sim_fleet(3, time_scale=20)            # SimFleet.of(...) options; started in a thread
        fleet.urls                                       # ["http://127.0.0.1:PORT", ...]

    def test_y(sim_url):                                 # one default server (time_scale 20)
        httpx.get(sim_url + "/health")

    def test_z(sim_fleet_process):                       # `fleetgate sim` in a child process: its own
        fleet = sim_fleet_process(2, time_scale=5)       # GIL, for timing-sensitive tests and benchmarks
        fleet.urls

Gateways as child processes, OpenAI clients and Redis key prefixes (tests/helpers.py has the rest):

    def test_w(gateway_process, redis_prefix, tmp_path):  # `fleetgate serve` children, stopped at teardown
        url = gateway_process(tmp_path / "gw.yaml", "--redis-url", REDIS_URL).listening_url()

    async def test_v(make_client):                        # AsyncOpenAI clients, closed at teardown
        client = make_client(gw.url, "sk-key")

For a mixed fleet pass a fleet mapping (the YAML format of simulator/fleet.py):
`sim_fleet(fleet={"servers": [{"role": "kv_producer"}, {"role": "kv_consumer"}]}, time_scale=20)`,
or specs: `sim_fleet(specs=[ServerSpec(...), ...])`. Outside pytest, `simulator.fleet.running_fleet(...)`
(a context manager), `SimFleet` and `FleetProcess` do the same.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import AsyncOpenAI

from simulator.fleet import FleetProcess, ServerSpec, SimFleet, fleet_from_dict
from tests.helpers import REDIS_URL, GatewayProcess, require_redis

FAST_TIME_SCALE = 20.0
_FLEET_FILE_OPTIONS = ("profile", "model", "time_scale", "seed")

# --- lanes --------------------------------------------------------------------------------------------------
# `make test` runs the product's tests; `make test-slow` the second lane: the benchmark studies (tests that re-run
# a bench/ study, check its recorded results or drive the peers harness: marker `study`) and the longest
# integration tests (marker `long`); `make test-all` both. The lists live here, not in the files, so a test
# moves lanes with one line. Node ids without parameters; a file pattern takes every test in it.
STUDY = (
    "tests/test_bench_*.py",
    "tests/test_fidelity_tools.py",
)
LONG = (
    "tests/test_gateway_autoscale.py::test_demo_autoscale_scales_out_under_its_burst_and_back_in_after",
    "tests/test_gateway_autoscale.py::test_desired_workers_rise_under_a_burst_and_fall_after_it_without_failed_requests",
    "tests/test_gateway_autoscale.py::test_only_the_leader_acts_and_every_replica_exports_the_same_numbers",
    "tests/test_gateway_demo.py::test_plain_demo_exports_slo_attainment",
    "tests/test_gateway_demo.py::test_killed_demo_takes_its_workers_with_it",
    "tests/test_gateway_learning.py::test_two_gateway_processes_share_fitted_models_through_redis",
    "tests/test_gateway_replan.py::test_a_traffic_step_grows_that_models_group_through_the_actuator_without_failed_requests",
    "tests/test_ops_progress.py::test_a_bench_reports_progress_on_stderr_only",
    "tests/test_ops_prometheus.py::test_every_panel_and_alert_returns_data_from_a_real_prometheus",
    "tests/test_packaging.py::test_wheel_carries_the_simulators_data_and_not_bench",
    "tests/test_packaging.py::test_simulate_runs_from_the_wheel_outside_the_repo",
    "tests/test_plan_cli.py::test_two_models_share_the_gpus_and_throughput_uses_the_budget",
    "tests/test_pooling_turns.py::test_when_the_driving_replica_dies_the_other_drives_within_seconds",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test of the second lane `study` or `long` (see STUDY and LONG); warn about a listed test that its
    collected file no longer has (renamed: it would silently run in the first lane)."""
    for item in items:
        node = item.nodeid.split("[")[0]
        path = node.split("::")[0]
        for marker, patterns in (("study", STUDY), ("long", LONG)):
            if any(node == p or fnmatch(path, p) for p in patterns):
                item.add_marker(marker)
    modules = {item.nodeid.split("::")[0]: item.module for item in items if isinstance(item, pytest.Function)}
    for listed in STUDY + LONG:
        path, _, name = listed.partition("::")
        if name and path in modules and not hasattr(modules[path], name):
            warnings.warn(pytest.PytestConfigWarning(f"tests/conftest.py lists {listed}, which does not exist"),
                          stacklevel=1)


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


@pytest.fixture
def gateway_process() -> Iterator[Callable[..., GatewayProcess]]:
    """Factory fixture: `fleetgate serve --config PATH --port 0 [ARGS]` children (GatewayProcess options);
    SIGTERM (then SIGKILL) at teardown."""
    started: list[GatewayProcess] = []

    def start(config: Path, *args: str, env: dict[str, str] | None = None) -> GatewayProcess:
        started.append(GatewayProcess(config, *args, env=env))
        return started[-1]

    yield start
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., AsyncOpenAI]]:
    """Official OpenAI clients for a gateway URL, closed at teardown."""
    made: list[AsyncOpenAI] = []

    def make(url: str, api_key: str = "unused", **kw: Any) -> AsyncOpenAI:
        made.append(AsyncOpenAI(base_url=url + "/v1", api_key=api_key, **kw))
        return made[-1]

    yield make
    for c in made:
        await c.close()


@pytest.fixture
def redis_url() -> str:
    """FLEETGATE_TEST_REDIS_URL (default db 15 on 127.0.0.1:6379); the test fails, saying what to start, when
    that Redis does not answer."""
    return require_redis(REDIS_URL)


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted at teardown."""
    prefix = f"fgtest:{uuid.uuid4().hex[:12]}:"
    yield prefix
    r = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()
