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
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import AsyncOpenAI

from simulator.fleet import FleetProcess, ServerSpec, SimFleet, fleet_from_dict
from tests.helpers import REDIS_URL, GatewayProcess, require_redis

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
