"""`fleetgate demo`: N simulated vLLM workers in a child process plus the gateway, one command.

The fleet runs as `python -m gateway.cli sim ...` in its own process (so it does not compete with the
gateway for the gateway's core); the gateway runs here with in-memory state. Ctrl-C stops both.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gateway.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0


def run_demo(port: int = 8000, workers: int = 4, policy: str = "least_requests", profile: str = "llama3-8b-h100",
             model: str = "meta-llama/Llama-3.1-8B-Instruct", time_scale: float = 1.0, base_port: int = 8001,
             pd: str | None = None, autoscale: bool = False) -> None:
    if pd is not None:
        _fail("--pd (prefill/decode pools) is not implemented yet; run the demo without it.")
    if autoscale:
        _fail("--autoscale is not implemented yet; run the demo without it.")
    if workers < 1:
        _fail(f"--workers must be at least 1, got {workers}.")
    if not (base_port > 0 and base_port + workers - 1 < 65536):
        _fail(f"--base-port {base_port} leaves no room for {workers} worker port(s).")
    if port and base_port <= port < base_port + workers:
        _fail(f"the gateway port {port} collides with the simulator ports {base_port}-{base_port + workers - 1}.")
    urls = [f"http://127.0.0.1:{base_port + i}" for i in range(workers)]
    try:
        cfg = load_config(None, listen={"host": "127.0.0.1", "port": port}, default_policy=policy,
                          workers=[{"id": f"sim-{i}", "url": u, "profile": profile} for i, u in enumerate(urls)])
    except ConfigError as e:
        _fail("; ".join(e.problems))
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--workers", str(workers), "--base-port", str(base_port),
           "--profile", profile, "--model", model, "--time-scale", str(time_scale)]
    print(f"starting {workers} simulated vLLM worker(s): {shlex.join(cmd[1:])}", flush=True)
    sim = subprocess.Popen(cmd, cwd=ROOT)
    try:
        _wait_healthy(sim, urls)
        _print_banner(port, model, urls)
        from gateway.server import run

        run(cfg)
    except KeyboardInterrupt:
        pass
    finally:
        _stop(sim)
        print("demo stopped", flush=True)


def _wait_healthy(sim: subprocess.Popen, urls: list[str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(urls)
    while pending:
        if sim.poll() is not None:
            _fail(f"the simulated fleet exited with status {sim.returncode} before it was ready (see above).")
        if time.monotonic() > deadline:
            _fail(f"simulated workers not healthy after {READY_TIMEOUT_S:.0f}s: {', '.join(pending)}")
        pending = [u for u in pending if not _healthy(u)]
        if pending:
            time.sleep(0.1)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _print_banner(port: int, model: str, urls: list[str]) -> None:
    base = f"http://127.0.0.1:{port}" if port else "http://127.0.0.1:<port printed below>"
    print(f"""
fleetgate demo: {len(urls)} simulated worker(s) at {urls[0]} .. {urls[-1]}
gateway: {base}   (metrics: {base}/metrics, workers: {base}/admin/workers)

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=32,
                                              messages=[{{"role": "user", "content": "Hello!"}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  print()
  EOF

Ctrl-C stops the gateway and the workers.
""", flush=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def _fail(message: str) -> None:
    print(f"fleetgate demo: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
