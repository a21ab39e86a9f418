"""`fleetgate demo`: one command brings up simulated workers and the gateway; Ctrl-C stops both."""

from __future__ import annotations

import signal

import openai

from tests.helpers import MODEL, CliProcess, free_port_range, refused


def test_demo_serves_requests_and_ctrl_c_stops_everything() -> None:
    base = free_port_range(3)
    gw_port, sim_port = base, base + 1
    with CliProcess("demo", "--port", str(gw_port), "--workers", "2", "--base-port", str(sim_port),
                    "--time-scale", "20", "--policy", "round_robin", merge_stderr=True) as demo:
        line = demo.wait_for("fleetgate listening on", timeout=60)
        text = "\n".join(demo.stdout)
        assert line.startswith(f"fleetgate listening on http://127.0.0.1:{gw_port}"), text
        assert "curl -s" in text and "from openai import OpenAI" in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="x", max_retries=0, timeout=20)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0
        assert refused(gw_port) and refused(sim_port) and refused(sim_port + 1)

# --pd: tests/test_gateway_pd.py; --autoscale: tests/test_gateway_autoscale.py
