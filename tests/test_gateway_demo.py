"""`fleetgate demo`: one command brings up simulated workers and the gateway; Ctrl-C stops both."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def free_ports(n: int) -> int:
    """A base port P such that P..P+n-1 are free right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_demo_serves_requests_and_ctrl_c_stops_everything() -> None:
    base = free_ports(3)
    gw_port, sim_port = base, base + 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--port", str(gw_port), "--workers", "2",
         "--base-port", str(sim_port), "--time-scale", "20", "--policy", "round_robin"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    out = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            out.append(line)
            if line.startswith("fleetgate listening on") or (not line and proc.poll() is not None):
                break
        text = "".join(out)
        assert f"fleetgate listening on http://127.0.0.1:{gw_port}" in text, text
        assert "curl -s" in text and "from openai import OpenAI" in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="x", max_retries=0, timeout=20)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        assert refused(gw_port) and refused(sim_port) and refused(sim_port + 1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)

# --pd: tests/test_gateway_pd.py; --autoscale: tests/test_gateway_autoscale.py
