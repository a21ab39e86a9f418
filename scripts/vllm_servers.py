"""Start and stop real vLLM (CPU build) servers serving the tiny local model: a Python API and a CLI.

Standard library only, so it runs under any interpreter (the project's .venv in tests_vllm/).

    python scripts/vllm_servers.py venv                 # create/reuse the vLLM venv, print its path
    python scripts/vllm_servers.py model                # build/reuse the tiny model, print its path
    python scripts/vllm_servers.py up -n 2 [--priority] [--dev-mode] [--max-num-seqs N]   # serve until Ctrl-C
    python scripts/vllm_servers.py check                # start 2 servers, one request each, stop

Every server gets a free 127.0.0.1 port, `--enforce-eager --dtype float32 --max-model-len 1024`, a 256 MiB KV
cache, one OMP core, its own TMPDIR and VLLM_CACHE_ROOT inside a per-run directory that is deleted on stop
(vllm leaves ZMQ socket files in TMPDIR even after a clean exit). Facts: docs/reference/vllm-cpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV_SCRIPT = REPO / "scripts" / "vllm_env.sh"
MODEL_SCRIPT = REPO / "scripts" / "make_tiny_model.py"
VLLM_VERSION = "0.32.0"
DEFAULT_VENV = Path.home() / ".cache" / "fleetgate" / f"vllm-cpu-{VLLM_VERSION}"
VENV_STAMP = ".fleetgate-ready"
SERVED_MODEL = "tiny"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = float(os.environ.get("FLEETGATE_VLLM_STARTUP_S", "180"))  # raise it on a crowded machine
# Marks every process of a run (children inherit the environment) so leftovers can be found by run.
RUN_ENV_MARK = "FLEETGATE_VLLM_RUN"


def log(msg: str) -> None:
    print(f"vllm_servers: {msg}", file=sys.stderr, flush=True)


# --- environment and model ---------------------------------------------------------------------------

def venv_path() -> Path:
    return Path(os.environ.get("FLEETGATE_VLLM_VENV") or DEFAULT_VENV)


def ensure_venv() -> Path:
    """The vLLM venv; runs scripts/vllm_env.sh (2-3 min) unless its stamp says it is complete."""
    venv = venv_path()
    if (venv / VENV_STAMP).is_file() and (venv / "bin" / "vllm").exists():
        return venv
    out = subprocess.run(["bash", str(ENV_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def model_cache_dir(venv: Path) -> Path:
    """Next to the venv, keyed by the model script's hash: a changed script builds a new model."""
    digest = hashlib.sha256(MODEL_SCRIPT.read_bytes()).hexdigest()[:16]
    return venv.parent / f"tiny-model-{digest}"


def build_model(venv: Path, outdir: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    subprocess.run([str(venv / "bin" / "python"), str(MODEL_SCRIPT), str(outdir)], check=True, env=env)


def ensure_model(venv: Path | None = None) -> Path:
    """The cached tiny model dir; built into a scratch dir and renamed into place (atomic) when missing."""
    venv = venv or ensure_venv()
    target = model_cache_dir(venv)
    if (target / "model.safetensors").is_file():
        return target
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
    try:
        build_model(venv, scratch)
        try:
            scratch.rename(target)
        except OSError:  # another run finished first; its files are identical
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"tiny model built in {time.monotonic() - started:.1f} s: {target}")
    return target


# --- servers -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session=True), SIGKILL it after `grace_s`."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class ServerSpec:
    """How to start one server. `cpu`: the one core the whole server (API server, EngineCore, Worker) runs on
    and its OMP thread binds to; None leaves placement to vLLM ("auto" binds every server to core 0)."""

    name: str
    cpu: int | None = None
    priority_scheduling: bool = False
    dev_mode: bool = False
    max_num_seqs: int | None = None
    # more names the server answers to (--served-model-name tiny ALIAS...): distinct models on one server process
    aliases: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)   # added to the server's environment


@dataclass
class VllmServer:
    spec: ServerSpec
    port: int
    log_path: Path
    tmpdir: Path
    proc: subprocess.Popen | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole process group at once (API server, EngineCore, Worker): a crashed machine."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after `grace_s`."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session=True: the server leads its own group
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(pgid):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.1)
        if _group_alive(pgid):
            log(f"{self.spec.name}: still alive {grace_s:.0f} s after SIGTERM, sending SIGKILL")
            _signal_group(pgid, signal.SIGKILL)
        self.proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # The leader may be a zombie we have not reaped yet; a zombie-only group is gone for our purposes.
    return any(_pgid_of(pid) == pgid and not _is_zombie(pid) for pid in _all_pids())


def _all_pids() -> Iterable[int]:
    return (int(p) for p in os.listdir("/proc") if p.isdigit())


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def processes_of_run(run_dir: Path) -> list[tuple[int, str]]:
    """Live processes (pid, cmdline) started by a run: `pgrep -if vllm`, narrowed to those carrying the run's mark.

    Case-insensitive because vLLM renames its children "VLLM::EngineCore" and "VLLM::Worker". The narrowing
    matters: `pgrep -f vllm` alone also matches this test process (tests_vllm) and other people's runs.
    """
    out = subprocess.run(["pgrep", "-if", "vllm"], stdout=subprocess.PIPE, text=True).stdout
    mark = f"{RUN_ENV_MARK}={run_dir}".encode()
    found = []
    for pid in (int(p) for p in out.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if mark in environ.split(b"\0") and not _is_zombie(pid):
            found.append((pid, cmdline.strip()))
    return found


class VllmFleet:
    """N real vLLM servers for one run. Use as a context manager: everything is stopped and deleted on exit."""

    def __init__(
        self,
        specs: Sequence[ServerSpec],
        venv: Path | None = None,
        model_dir: Path | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        keep_run_dir: bool = False,
    ) -> None:
        self.venv = venv or ensure_venv()
        self.model_dir = model_dir or ensure_model(self.venv)
        self.startup_timeout_s = startup_timeout_s
        self.keep_run_dir = keep_run_dir or os.environ.get("FLEETGATE_VLLM_KEEP") == "1"
        self.run_dir = Path(tempfile.mkdtemp(prefix="fleetgate-vllm-"))
        self.servers: dict[str, VllmServer] = {}
        for spec in specs:
            tmpdir = self.run_dir / f"tmp-{spec.name}"
            tmpdir.mkdir()
            self.servers[spec.name] = VllmServer(spec, free_port(), self.run_dir / f"{spec.name}.log", tmpdir)

    def __enter__(self) -> VllmFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __getitem__(self, name: str) -> VllmServer:
        return self.servers[name]

    def command(self, server: VllmServer) -> list[str]:
        spec = server.spec
        cmd = [
            str(self.venv / "bin" / "vllm"), "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(server.port),
            "--served-model-name", SERVED_MODEL, *spec.aliases,  # the first name is the one vLLM reports
            "--max-model-len", str(MAX_MODEL_LEN),
            "--dtype", "float32",
            "--enforce-eager",  # about twice as fast to start as torch.compile, no slower here (docs/reference/vllm-cpu.md §3)
            "--kv-cache-memory-bytes", "256M",  # without a bound the CPU backend takes 90% of RAM (gotcha 3)
        ]
        if spec.priority_scheduling:
            cmd += ["--scheduling-policy", "priority"]
        if spec.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(spec.max_num_seqs)]
        return cmd + list(spec.extra_args)

    def environment(self, server: VllmServer) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(
            PATH=f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
            VIRTUAL_ENV=str(self.venv),
            TMPDIR=str(server.tmpdir),
            VLLM_CACHE_ROOT=str(self.run_dir / "cache"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
            **{RUN_ENV_MARK: str(self.run_dir)},
        )
        if server.spec.cpu is not None:
            # With "auto" every server binds its one OMP thread to core 0 (docs/reference/vllm-cpu.md §3): pin them apart.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(server.spec.cpu)
        if server.spec.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep, /wake_up, /is_sleeping (docs/reference/vllm-cpu.md §4, sleep/wake)
        env.update(server.spec.env)
        return env

    def launch(self, server: VllmServer) -> None:
        cmd = self.command(server)
        if server.spec.cpu is not None:
            # The EngineCore busy-polls its Worker (vllm shm_broadcast: spin + sched_yield), so one generating
            # server takes both cores of a 2-core box and starves its own API server (/metrics then answers
            # only after the generation). Start the whole tree on its core; once up, the API server is let
            # loose again (release_api_server) while EngineCore and Worker stay on the core.
            cmd = ["taskset", "-c", str(server.spec.cpu), *cmd]
        with open(server.log_path, "ab") as log_file:
            server.proc = subprocess.Popen(
                cmd, env=self.environment(server), cwd=self.run_dir,
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )
        server.startup_s = None

    def start(self, names: Iterable[str] | None = None) -> None:
        """Launch the servers together and wait until each answers /health; print each startup time."""
        chosen = [self.servers[n] for n in (names or self.servers)]
        started = time.monotonic()
        for server in chosen:
            self.launch(server)
        pending = list(chosen)
        deadline = started + self.startup_timeout_s
        while pending:
            for server in list(pending):
                if not server.alive():
                    self._fail(server, f"exited with code {server.proc.returncode} during startup")
                if _healthy(server.url):
                    server.startup_s = time.monotonic() - started
                    if server.spec.cpu is not None:
                        release_api_server(server.proc.pid)
                    log(f"{server.spec.name} ready at {server.url} after {server.startup_s:.1f} s")
                    pending.remove(server)
            if pending and time.monotonic() > deadline:
                self._fail(pending[0], f"not healthy after {self.startup_timeout_s:.0f} s")
            if pending:
                time.sleep(0.5)

    def restart(self, name: str) -> None:
        """Start a stopped or killed server again on its old port (the gateway knows it by URL)."""
        server = self.servers[name]
        if server.alive():
            server.stop()
        self.start([name])

    def _fail(self, server: VllmServer, why: str) -> None:
        msg = f"{server.spec.name} {why}; log {server.log_path}:\n{server.log_tail()}"
        log(msg)
        raise RuntimeError(msg)

    def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL) and delete the run dir (printing logs if asked to keep it)."""
        for server in self.servers.values():
            try:
                server.stop()
            except Exception as exc:  # keep stopping the others
                log(f"{server.spec.name}: stop failed: {exc!r}")
        if self.keep_run_dir:
            log(f"run dir kept: {self.run_dir}")
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def leftovers(self) -> list[tuple[int, str]]:
        return processes_of_run(self.run_dir)


def release_api_server(pid: int) -> None:
    """Let every thread of the API server process (the group leader) run on any core again."""
    cores = os.sched_getaffinity(0)  # the cores this harness may use itself
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def default_specs(count: int, priority: bool = False, dev_mode: bool = False,
                  max_num_seqs: int | None = None) -> list[ServerSpec]:
    cores = os.cpu_count() or 1
    return [
        ServerSpec(name=f"vllm{i}", cpu=i % cores, priority_scheduling=priority, dev_mode=dev_mode,
                   max_num_seqs=max_num_seqs)
        for i in range(count)
    ]


# --- CLI -------------------------------------------------------------------------------------------------

def _post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _check(fleet: VllmFleet) -> None:
    for server in fleet.servers.values():
        body = {"model": SERVED_MODEL, "prompt": "def hello():", "max_tokens": 16, "ignore_eos": True}
        out = _post_json(server.url + "/v1/completions", body)
        usage, choice = out["usage"], out["choices"][0]
        if usage["completion_tokens"] != 16 or choice["finish_reason"] != "length":
            raise RuntimeError(f"{server.spec.name}: unexpected completion {out}")
        log(f"{server.spec.name}: ok, usage {usage}, text {choice['text']!r}")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("venv", help="create/reuse the vLLM venv and print its path")
    sub.add_parser("model", help="build/reuse the tiny model and print its path")
    for name in ("up", "check"):
        p = sub.add_parser(name)
        p.add_argument("-n", "--count", type=int, default=2)
        p.add_argument("--priority", action="store_true", help="--scheduling-policy priority")
        p.add_argument("--dev-mode", action="store_true", help="VLLM_SERVER_DEV_MODE=1 (/sleep, /wake_up)")
        p.add_argument("--max-num-seqs", type=int, default=None)
        p.add_argument("--keep", action="store_true", help="keep the run dir (logs) after stopping")
    args = parser.parse_args(argv)

    if args.cmd == "venv":
        print(ensure_venv())
        return 0
    if args.cmd == "model":
        print(ensure_model())
        return 0
    if not 1 <= args.count <= 3:
        parser.error("start 1 to 3 servers (each takes ~2.5 GB and the machine has 2 cores)")
    # SIGTERM (e.g. from CI) unwinds like Ctrl-C, so the fleet's cleanup runs.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    specs = default_specs(args.count, args.priority, args.dev_mode, args.max_num_seqs)
    try:
        with VllmFleet(specs, keep_run_dir=args.keep) as fleet:
            if args.cmd == "check":
                _check(fleet)
                return 0
            for server in fleet.servers.values():
                print(server.url, flush=True)
            log("serving; Ctrl-C stops")
            while all(s.alive() for s in fleet.servers.values()):
                time.sleep(1)
            log("a server exited; stopping the others")
            return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
