"""Fleets: the YAML format, many servers in one process, and `fleetgate sim` as a user runs it."""

from __future__ import annotations

import signal
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.fleet import SimFleet, fleet_from_dict, load_fleet_file
from simulator.vllm_api import ConfigError
from tests.helpers import CliProcess, free_port_range, run_cli


def gen_tokens(client: httpx.Client) -> float:
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name == "vllm:generation_tokens_total":
                return s.value
    raise KeyError


def test_fleet_dict_defaults_replicas_ports_seeds():
    specs = fleet_from_dict({
        "defaults": {"time_scale": 10, "profile": "llama3-8b-a100"},
        "servers": [
            {"name": "pre", "role": "kv_producer", "replicas": 2, "port": 9001},
            {"scheduling_policy": "priority", "faults": {"slowdown": 2}, "seed": 7},
            {"profile": "llama3-8b-h100", "profile_overrides": {"num_gpu_blocks": 128, "max_model_len": 2048}},
        ]}, base_port=8100, seed=3)
    assert [s.name for s in specs] == ["pre-0", "pre-1", "sim-2", "sim-3"]
    assert [s.port for s in specs] == [9001, 9002, 8102, 8103]
    assert [s.config.seed for s in specs] == [3, 4, 7, 6]
    assert [s.config.role for s in specs] == ["kv_producer", "kv_producer", "kv_both", "kv_both"]
    assert specs[2].config.scheduling_policy == "priority" and specs[2].config.faults == {"slowdown": 2}
    assert {s.config.time_scale for s in specs} == {10}
    assert [s.config.profile for s in specs] == ["llama3-8b-a100"] * 3 + ["llama3-8b-h100"]


@pytest.mark.parametrize("data, message", [
    ({}, "non-empty 'servers'"),
    ({"servers": []}, "non-empty 'servers'"),
    ({"servers": [{"rol": "x"}]}, "unknown key"),
    ({"servers": [{}], "extra": 1}, "unknown top-level"),
    ({"defaults": {"port": 1}, "servers": [{}]}, "unknown key"),
    ({"servers": [{"role": "boss"}]}, "role"),
    ({"servers": [{"scheduling_policy": "lifo"}]}, "scheduling_policy"),
    ({"servers": [{"port": "eighty"}]}, "port"),
    ({"servers": [{"time_scale": 0}]}, "time_scale"),
    ({"servers": [{"replicas": 0}]}, "replicas"),
    ({"servers": [{"name": "a"}, {"name": "a"}]}, "duplicate server name"),
    ({"servers": [{"port": 9000}, {"port": 9000}]}, "duplicate port"),
    ({"servers": [{"profile": "no-such-profile"}]}, "unknown profile"),
    ({"servers": [{"profile_overrides": {"num_gpu_blocks": 1}}]}, "max_model_len"),
])
def test_fleet_dict_errors_are_explicit(data, message):
    with pytest.raises(ConfigError, match=message):
        specs = fleet_from_dict(data)
        SimFleet(specs)  # servers are validated when built


def test_fleet_file(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("servers:\n  - name: a\n  - name: b\n    faults: {health_fail: true}\n")
    specs = load_fleet_file(path, base_port=8200)
    assert [(s.name, s.port) for s in specs] == [("a", 8200), ("b", 8201)]
    path.write_text("servers: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_fleet_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_fleet_file(tmp_path / "missing.yaml")


def test_servers_are_independent(sim_fleet):
    fleet = sim_fleet(3, time_scale=20, seed=10)
    assert len(set(fleet.urls)) == 3
    clients = [httpx.Client(base_url=u) for u in fleet.urls]
    try:
        ids = {c.get("/sim/state").json()["engine_id"] for c in clients}
        assert len(ids) == 3
        clients[1].post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "ignore_eos": True})
        assert [gen_tokens(c) for c in clients] == [0, 5, 0]  # one CollectorRegistry per server
    finally:
        for c in clients:
            c.close()


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        specs = fleet_from_dict({"servers": [{"port": port}]})
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            SimFleet(specs).start()


# --- the CLI, as a user runs it ---------------------------------------------------------------------
def test_cli_serves_and_stops_on_sigterm():
    base = free_port_range(2)
    with CliProcess("sim", "--workers", "2", "--base-port", str(base), "--time-scale", "20", "--seed", "5",
                    "--scheduling-policy", "priority") as sim:
        lines = [sim.next_line(), sim.next_line()]
        assert lines[0].startswith(f"sim-0 http://127.0.0.1:{base} model=meta-llama/Llama-3.1-8B-Instruct")
        assert lines[1].startswith(f"sim-1 http://127.0.0.1:{base + 1} ") and "policy=priority" in lines[1]
        for port in (base, base + 1):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
        assert sim.send_signal(signal.SIGTERM, timeout=10) == 0


def test_cli_fleet_file_and_sigint(tmp_path):
    base = free_port_range(2)
    path = tmp_path / "fleet.yaml"
    path.write_text(f"defaults: {{time_scale: 20}}\nservers:\n  - {{name: p, role: kv_producer, port: {base}}}\n"
                    f"  - {{name: d, role: kv_consumer, port: {base + 1}, model: tiny}}\n")
    with CliProcess("sim", "--fleet", str(path)) as sim:
        lines = [sim.next_line(), sim.next_line()]
        assert "role=kv_producer" in lines[0] and "model=tiny" in lines[1]
        assert httpx.get(f"http://127.0.0.1:{base + 1}/v1/models").json()["data"][0]["id"] == "tiny"
        assert sim.send_signal(signal.SIGINT, timeout=10) == 0


def test_cli_list_profiles_and_bad_fleet(tmp_path):
    out = run_cli("sim", "--list-profiles", timeout=30)
    assert out.returncode == 0 and "llama3-8b-h100" in out.stdout and "llama3-8b-a100" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers:\n  - {role: boss}\n")
    out = run_cli("sim", "--fleet", str(bad), timeout=30)
    assert out.returncode == 2 and "error:" in out.stderr and "role" in out.stderr


def test_fleet_process_fixture(sim_fleet_process, tmp_path):
    fleet = sim_fleet_process(2, time_scale=20, model="tiny")
    assert len(fleet.urls) == 2
    for url in fleet.urls:
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
    path = tmp_path / "fleet.yaml"
    path.write_text("servers:\n  - {role: kv_producer}\n  - {role: kv_consumer}\n  - {}\n")
    mixed = sim_fleet_process(fleet_file=path, time_scale=20)
    roles = [httpx.get(u + "/sim/state").json()["role"] for u in mixed.urls]
    assert roles == ["kv_producer", "kv_consumer", "kv_both"]
