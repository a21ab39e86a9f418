"""Many simulated vLLM servers in one process: `fleetgate sim`, the fleet YAML, and a Python API.

Each server is independent (its own EngineCore, metrics registry, RNG seed = seed + i) and listens on
its own port; all of them run as uvicorn servers (httptools, access log off) on one event loop (uvloop).

Fleet file (YAML):

    defaults:                       # optional, applied to every server (CLI options are the fallback)
      profile: llama3-8b-h100
      model: meta-llama/Llama-3.1-8B-Instruct
      time_scale: 10
    servers:
      - name: prefill-0             # optional (default sim-<i>)
        port: 8101                  # optional (default base_port + i)
        role: kv_producer           # kv_both (default) | kv_producer | kv_consumer
        replicas: 2                 # optional: this entry N times, consecutive ports
      - profile: llama3-8b-a100
        scheduling_policy: priority
        faults: {slowdown: 2.0}     # see simulator/faults.py
      - enable_lora: true           # vLLM's LoRA flags (simulator/lora.py)
        lora_modules: ["sql=/adapters/sql", {name: chat, path: /adapters/chat}]
        max_loras: 2
        allow_runtime_lora_updating: true   # as VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
        profile_overrides: {num_gpu_blocks: 512, max_model_len: 4096}

Python API (tests, `fleetgate demo`):

    with SimFleet.of(3, time_scale=20) as fleet:   # free ports, background thread
        fleet.urls                                 # ["http://127.0.0.1:41234", ...]
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
import yaml

from simulator.profiles import list_profiles as builtin_profiles
from simulator.profiles import load_profile
from simulator.vllm_api import ConfigError, ServerConfig, SimServer

_SERVER_KEYS = {"name", "port", "replicas", "profile", "model", "role", "scheduling_policy", "time_scale",
                "seed", "faults", "profile_overrides", "dev_mode", "kv_lease_s", "side_channel_port",
                "kv_events_config", "kv_events_format", "prefix_caching_hash_algo", "hash_seed", "enable_lora",
                "lora_modules", "max_loras", "max_cpu_loras", "max_lora_rank", "allow_runtime_lora_updating"}
_DEFAULT_KEYS = _SERVER_KEYS - {"name", "port", "replicas"}


@dataclass(slots=True)
class ServerSpec:
    """One server of a fleet: where it listens and what it simulates."""

    name: str
    port: int
    config: ServerConfig


# --- fleet files -------------------------------------------------------------------------------
def specs_from_options(workers: int, base_port: int, profile: str, model: str | None, time_scale: float,
                       seed: int, **extra: Any) -> list[ServerSpec]:
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    return [ServerSpec(f"sim-{i}", base_port + i if base_port else 0,
                       ServerConfig(profile=profile, model=model, time_scale=time_scale, seed=seed + i, **extra))
            for i in range(workers)]


def load_fleet_file(path: str | Path, base_port: int = 0, profile: str = "llama3-8b-h100",
                    model: str | None = None, time_scale: float = 1.0, seed: int = 0) -> list[ServerSpec]:
    """Parse and validate a fleet YAML file; errors say which entry and key is wrong."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    return fleet_from_dict(data, str(path), base_port, profile, model, time_scale, seed)


def fleet_from_dict(data: Any, source: str = "<fleet>", base_port: int = 0, profile: str = "llama3-8b-h100",
                    model: str | None = None, time_scale: float = 1.0, seed: int = 0) -> list[ServerSpec]:
    if not isinstance(data, dict) or not isinstance(data.get("servers"), list) or not data["servers"]:
        raise ConfigError(f"{source}: expected a mapping with a non-empty 'servers' list")
    unknown = sorted(set(data) - {"defaults", "servers"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {unknown}; known: ['defaults', 'servers']")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{source}: 'defaults' must be a mapping")
    bad = sorted(set(defaults) - _DEFAULT_KEYS)
    if bad:
        raise ConfigError(f"{source}: unknown key(s) in defaults: {bad}; known: {sorted(_DEFAULT_KEYS)}")
    base = {"profile": profile, "model": model, "time_scale": time_scale, **defaults}
    specs: list[ServerSpec] = []
    for j, entry in enumerate(data["servers"]):
        where = f"{source}: servers[{j}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be a mapping")
        bad = sorted(set(entry) - _SERVER_KEYS)
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {bad}; known: {sorted(_SERVER_KEYS)}")
        merged = {**base, **entry}
        replicas = merged.pop("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ConfigError(f"{where}: replicas must be an integer >= 1")
        name = merged.pop("name", None)
        port = merged.pop("port", None)
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536):
            raise ConfigError(f"{where}: port must be an integer in [0, 65535]")
        for r in range(replicas):
            i = len(specs)
            cfg_kw = dict(merged)
            # seed: the entry's (+ replica index), else the defaults' or the CLI's + server index
            if "seed" in entry:
                cfg_kw["seed"] = entry["seed"] + r if isinstance(entry["seed"], int) else entry["seed"]
            else:
                first = defaults.get("seed", seed)
                cfg_kw["seed"] = first + i if isinstance(first, int) else first
            try:
                cfg = ServerConfig(**cfg_kw)
                _check_types(cfg)
            except TypeError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            p = (port + r) if port else (base_port + i if base_port else 0)
            n = (f"{name}-{r}" if replicas > 1 else name) if name else f"sim-{i}"
            specs.append(ServerSpec(str(n), p, cfg))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{source}: duplicate server name(s) {dup}")
    ports = [s.port for s in specs if s.port]
    dup_ports = sorted({p for p in ports if ports.count(p) > 1})
    if dup_ports:
        raise ConfigError(f"{source}: duplicate port(s) {dup_ports}")
    return specs


def _check_types(cfg: ServerConfig) -> None:
    if isinstance(cfg.time_scale, bool) or not isinstance(cfg.time_scale, (int, float)) or not cfg.time_scale > 0:
        raise ConfigError(f"time_scale must be a number > 0, got {cfg.time_scale!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ConfigError(f"seed must be an integer, got {cfg.seed!r}")
    if cfg.model is not None and not isinstance(cfg.model, str):
        raise ConfigError(f"model must be a string, got {cfg.model!r}")
    if not isinstance(cfg.profile_overrides, dict):
        raise ConfigError("profile_overrides must be a mapping")
    if cfg.faults is not None and not isinstance(cfg.faults, dict):
        raise ConfigError("faults must be a mapping")


# --- running servers ------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the fleet (many servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


class SimFleet:
    """Starts simulated servers on one event loop, in a background thread (`start`) or the caller's
    loop (`serve`, used by the CLI). Ports of 0 are picked by the OS."""

    def __init__(self, specs: Sequence[ServerSpec], host: str = "127.0.0.1", tls: dict[str, Any] | None = None):
        """`tls`: uvicorn's TLS settings (ssl_certfile, ssl_keyfile, ssl_ca_certs, ssl_cert_reqs, ...): every server
        then speaks https."""
        if not specs:
            raise ConfigError("a fleet needs at least one server")
        self.specs = list(specs)
        self.host = host
        self.tls = dict(tls or {})
        for i, spec in enumerate(self.specs):   # worker i publishes KV events on the endpoint's port + i
            if spec.config.kv_events_offset is None:
                spec.config.kv_events_offset = i
        self.servers: list[SimServer] = [SimServer(s.config, s.name) for s in self.specs]  # validates early
        self.urls: list[str] = []
        self._uvicorns: list[_Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None

    @classmethod
    def of(cls, workers: int = 1, *, host: str = "127.0.0.1", profile: str = "llama3-8b-h100",
           model: str | None = None, time_scale: float = 1.0, seed: int = 0, tls: dict[str, Any] | None = None,
           **config: Any) -> SimFleet:
        """N identical servers on free ports; extra keyword arguments go to every ServerConfig."""
        return cls(specs_from_options(workers, 0, profile, model, time_scale, seed, **config), host=host, tls=tls)

    @property
    def by_name(self) -> dict[str, str]:
        return {s.name: u for s, u in zip(self.specs, self.urls, strict=False)}

    # --- background thread ---------------------------------------------------------------------
    def start(self, timeout: float = 15.0) -> list[str]:
        """Start every server in a daemon thread; return their URLs once all accept connections."""
        if self._thread is not None:
            return self.urls
        self._thread = threading.Thread(target=self._thread_main, name="sim-fleet", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"simulated fleet did not start within {timeout} s")
        if self._error is not None:
            self.stop()
            raise self._error
        return self.urls

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the servers (in-flight requests end) and join the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is not None and self._stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stop.set)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise RuntimeError("simulated fleet thread did not stop")
        self._thread = None

    def __enter__(self) -> SimFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:  # pragma: no cover - uvloop is a dependency
            runner = asyncio.Runner()
        with runner:
            try:
                runner.run(self.serve())
            except BaseException as exc:  # reported to start()
                self._error = exc
                self._ready.set()

    # --- on the caller's loop --------------------------------------------------------------------
    async def serve(self, on_ready: Any = None) -> None:
        """Run until `request_stop()` (or the stop event) is set; calls on_ready(fleet) once listening."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        sockets = [_bind(self.host, s.port) for s in self.specs]
        tasks: list[asyncio.Task] = []
        try:
            scheme = "https" if self.tls else "http"
            self.urls = [_url(self.host, sock.getsockname()[1], scheme) for sock in sockets]
            for server in self.servers:
                await server.start()
            for server, sock in zip(self.servers, sockets, strict=True):
                cfg = uvicorn.Config(server, http="httptools", loop="none", lifespan="off", access_log=False,
                                     log_config=None, log_level="warning", timeout_graceful_shutdown=2,
                                     ws="none", **self.tls)
                uv = _Server(cfg)
                self._uvicorns.append(uv)
                tasks.append(asyncio.ensure_future(uv._serve(sockets=[sock])))
            while not all(uv.started for uv in self._uvicorns):
                failed = [t for t in tasks if t.done()]
                if failed:
                    failed[0].result()  # raises the startup error
                    raise RuntimeError("a simulated server exited during startup")
                await asyncio.sleep(0.005)
            self._ready.set()
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
        finally:
            for server in self.servers:  # ends streams and hung requests first, so uvicorn can drain
                await server.stop()
            for uv in self._uvicorns:
                uv.should_exit = True
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for sock in sockets:
                sock.close()

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class FleetProcess:
    """`fleetgate sim` in a child process: its own interpreter and GIL, so client-side timing in the
    parent is not disturbed (timing tests, benchmarks). Ports are picked by the OS (`--base-port 0`)
    and read back from the ready lines. `wrapper` prefixes the command, e.g. ["taskset", "-c", "1"]."""

    def __init__(self, workers: int = 1, *, profile: str = "llama3-8b-h100", model: str | None = None,
                 time_scale: float = 1.0, seed: int = 0, fleet_file: str | Path | None = None,
                 host: str = "127.0.0.1", wrapper: Sequence[str] = (), extra_args: Sequence[str] = ()):
        args = ["--base-port", "0", "--host", host, "--profile", profile, "--time-scale", str(time_scale),
                "--seed", str(seed), *extra_args]
        if model:
            args += ["--model", model]
        if fleet_file is not None:
            args += ["--fleet", str(fleet_file)]
        else:
            args += ["--workers", str(workers)]
        self.cmd = [*wrapper, sys.executable, "-m", "gateway.cli", "sim", *args]
        self.expected = workers if fleet_file is None else len(load_fleet_file(fleet_file))
        self.urls: list[str] = []
        self.proc: Any = None

    def start(self, timeout: float = 30.0) -> list[str]:
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(self.cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            while len(self.urls) < self.expected:
                left = deadline - time.monotonic()
                line = lines.get(timeout=max(0.01, left)) if left > 0 else None
                if line is None:
                    raise RuntimeError(f"fleetgate sim did not start: {self._stderr()}")
                self.urls.append(line.split()[1])
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=5)[1][-2000:]

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> FleetProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_fleet(workers: int = 1, **kwargs: Any) -> Iterator[SimFleet]:
    """`with running_fleet(2, time_scale=20) as fleet: fleet.urls` (see SimFleet.of for the options)."""
    fleet = SimFleet.of(workers, **kwargs)
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()


# --- CLI -----------------------------------------------------------------------------------------
def run_fleet_cli(workers: int = 1, base_port: int = 8100, profile: str = "llama3-8b-h100",
                  model: str | None = None, time_scale: float = 1.0, fleet: Path | None = None,
                  host: str = "127.0.0.1", seed: int = 0, list_profiles: bool = False,
                  scheduling_policy: str = "fcfs", kv_events_config: str | None = None,
                  kv_events_format: str = "0.11", hash_algo: str = "sha256",
                  lora: dict[str, Any] | None = None) -> None:
    """`fleetgate sim`: serve until SIGINT / SIGTERM. With a fleet file, the options are its defaults."""
    if list_profiles:
        for name in builtin_profiles():
            p = load_profile(name)
            print(f"{name:24s} {p.model:40s} {p.description}")
        return
    try:
        if fleet is not None:
            specs = load_fleet_file(fleet, base_port, profile, model, time_scale, seed)
            for spec in specs:  # the CLI's options apply where the file does not set them
                cfg = spec.config
                if cfg.scheduling_policy == "fcfs":
                    cfg.scheduling_policy = scheduling_policy
                if cfg.kv_events_config is None:
                    cfg.kv_events_config = kv_events_config
                if cfg.kv_events_format == "0.11":
                    cfg.kv_events_format = kv_events_format
                if cfg.prefix_caching_hash_algo == "sha256":
                    cfg.prefix_caching_hash_algo = hash_algo
                if lora and not cfg.enable_lora and not cfg.lora_modules:
                    for key, value in lora.items():
                        setattr(cfg, key, value)
        else:
            specs = specs_from_options(workers, base_port, profile, model, time_scale, seed,
                                       scheduling_policy=scheduling_policy, kv_events_config=kv_events_config,
                                       kv_events_format=kv_events_format, prefix_caching_hash_algo=hash_algo,
                                       **(lora or {}))
        sim = SimFleet(specs, host=host)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    def ready(f: SimFleet) -> None:
        gc.freeze()  # a long-running server: keep start-up objects out of every later collection
        for spec, server, url in zip(f.specs, f.servers, f.urls, strict=True):
            kv = f" kv_events={server.driver.publisher.endpoint}" if server.driver.publisher is not None else ""
            lora = f" loras={','.join(server.adapters) or '-'}" if server.driver.core.max_loras else ""
            print(f"{spec.name} {url} model={server.model} profile={server.profile.name} "
                  f"role={spec.config.role} policy={spec.config.scheduling_policy} "
                  f"time_scale={spec.config.time_scale:g}{kv}{lora}", flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(sim.serve(on_ready=ready))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, sim.request_stop)
        try:
            await task
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover
        runner = asyncio.Runner()
    try:
        with runner:
            runner.run(main())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


__all__ = ["FleetProcess", "ServerSpec", "SimFleet", "fleet_from_dict", "load_fleet_file", "run_fleet_cli", "running_fleet",
           "specs_from_options"]
