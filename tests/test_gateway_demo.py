"""`fleetgate demo`: one command brings up simulated workers and the gateway; Ctrl-C stops both."""

from __future__ import annotations

import json
import signal

import openai
import pytest

from tests.helpers import MODEL, CliProcess, free_port_range, poll_sync, refused


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
        example = next(demo.stdout[i + 1] for i, t in enumerate(demo.stdout) if "/v1/responses" in t)
        body = json.loads(example.split("-d '", 1)[1].rstrip("'"))   # the banner's Responses example, as printed
        assert client.responses.create(**body).output_text
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0
        assert refused(gw_port) and refused(sim_port) and refused(sim_port + 1)

# --pd: tests/test_gateway_pd.py; --autoscale: tests/test_gateway_autoscale.py


def test_busy_port_is_one_line_before_anything_starts() -> None:
    import socket

    from tests.helpers import run_cli

    base = free_port_range(4)
    for taken, what in ((base, "gateway"), (base + 2, "simulated worker")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", taken))
            s.listen()
            r = run_cli("demo", "--port", str(base), "--workers", "2", "--time-scale", "20", timeout=30)
        assert r.returncode == 2
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and f"port {taken} for the {what}" in err[0] and "not free" in err[0], r.stderr
        assert "starting" not in r.stdout and "Traceback" not in r.stderr
        assert refused(base + 1) and refused(base + 3)  # no worker was started


def test_make_demo_takes_a_port() -> None:
    import subprocess

    from tests.helpers import ROOT

    r = subprocess.run(["make", "-n", "demo", "PORT=9123"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "fleetgate demo --workers 4 --port 9123" in r.stdout, r.stdout + r.stderr


def test_plain_demo_exports_slo_attainment() -> None:
    import httpx

    base = free_port_range(2)
    with CliProcess("demo", "--port", str(base), "--workers", "1", "--time-scale", "20", merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        r = httpx.post(f"http://127.0.0.1:{base}/v1/chat/completions", timeout=20,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200
        text = httpx.get(f"http://127.0.0.1:{base}/metrics", timeout=5).text
        demo.proc.send_signal(signal.SIGINT)
        out = demo.read_to_end(timeout=20)
    assert f'fleetgate_slo_attainment_ratio{{class="interactive",model="{MODEL}"}} 1.0' in text
    assert "fleetgate.access: request request_id=" in out  # the access log is on in the demo


def test_killed_demo_takes_its_workers_with_it() -> None:
    base = free_port_range(3)
    with CliProcess("demo", "--port", str(base), "--workers", "2", "--time-scale", "20", merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        assert not refused(base + 1)
        demo.proc.kill()  # SIGKILL: no cleanup code runs in the demo
        demo.proc.wait(10)
    poll_sync(lambda: refused(base + 1) and refused(base + 2), 10, "the simulated workers to exit")


@pytest.mark.parametrize(("mode", "prefix", "when"), [
    (("--pd", "1:1"), "fleetgate-pd-", "fleetgate listening on"),
    (("--num-models", "2", "--workers", "1"), "fleetgate-pooled-", "fleetgate listening on"),
    (("--num-models", "2", "--workers", "1"), "fleetgate-pooled-", "starting "),      # while the fleet starts
])
def test_sigterm_removes_the_demos_temporary_files(tmp_path, mode: tuple[str, ...], prefix: str, when: str) -> None:
    base = free_port_range(3)
    with CliProcess("demo", "--port", str(base), "--base-port", str(base + 1), "--time-scale", "20", *mode,
                    env={"TMPDIR": str(tmp_path)}, merge_stderr=True) as demo:
        demo.wait_for(when, timeout=60)
        made = [p.name for p in tmp_path.iterdir()]
        assert len(made) == 1 and made[0].startswith(prefix), made     # the demo's fleet file, in its TMPDIR
        assert demo.send_signal(signal.SIGTERM, timeout=20) == 0
        assert "demo stopped" in demo.read_to_end()
    assert list(tmp_path.iterdir()) == []
    poll_sync(lambda: all(refused(base + i) for i in range(3)), 10, "the gateway and the workers to exit")
