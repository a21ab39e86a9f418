"""Dashboards and alerts checked by a real Prometheus (Debian's `prometheus` package, missing = failure).

A gateway process (Redis-shared state, autoscaler exporting, a P/D model beside a mixed one) in front of a
simulated fleet in its own process, under traffic that trips every alert: a worker that never comes up, a
worker answering 5xx (retries, upstream errors), per-worker caps that fill the admission queue while users
keep arriving, TTFT targets few requests meet, and at the end the Redis server killed. Prometheus scrapes the
gateway and the workers every second and loads deploy/prometheus/alerts.yml; then every Grafana panel query
(deploy/grafana/dashboards/fleetgate.json) and every alert expression must return samples through the
HTTP API, and every rule must evaluate without error."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from openai import AsyncOpenAI

from simulator.fleet import FleetProcess
from tests.helpers import MODEL, free_port, poll, poll_sync, require_command

ROOT = Path(__file__).resolve().parents[1]
PD_MODEL = "pd-llama"
POOLED = ("pooled-a", "pooled-b")   # two models sharing one host, max_awake 1: every other request swaps
TURNS = ("turns-a", "turns-b")      # two models sharing a `scheduling: turns` host: decode turns (fleetgate_turns_total)


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads((ROOT / "deploy/grafana/dashboards/fleetgate.json").read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", ())]


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_accepts_the_rules() -> None:
    r = subprocess.run([require_command("promtool", "prometheus"), "check", "rules", str(ROOT / "deploy/prometheus/alerts.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


@pytest.mark.slow  # a fleet, a gateway, Redis and Prometheus, ~1 minute
async def test_every_panel_and_alert_returns_data_from_a_real_prometheus(tmp_path, gateway_process) -> None:
    prometheus = require_command("prometheus")
    redis_port, prom_port = free_port(), free_port()
    redis_proc = subprocess.Popen(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump({"defaults": {"time_scale": 10}, "servers": [
        {"name": "m0", "model": MODEL}, {"name": "m1", "model": MODEL},
        {"name": "p0", "model": PD_MODEL, "role": "kv_producer"},
        {"name": "d0", "model": PD_MODEL, "role": "kv_consumer"},
        {"name": "s0", "model": POOLED[0]}, {"name": "s1", "model": POOLED[1]},
        {"name": "t0", "model": TURNS[0]}, {"name": "t1", "model": TURNS[1]}]}))
    fleet = FleetProcess(fleet_file=fleet_file)
    prom: subprocess.Popen | None = None
    try:
        urls = fleet.start()
        cfg = tmp_path / "gateway.yaml"
        cfg.write_text(yaml.safe_dump({
            "redis_url": f"redis://127.0.0.1:{redis_port}/0",
            "workers": [{"id": "w0", "url": urls[0], "cap": 2}, {"id": "w1", "url": urls[1], "cap": 2},
                        {"id": "prefill-0", "url": urls[2], "role": "prefill"},
                        {"id": "decode-0", "url": urls[3], "role": "decode"},
                        {"id": "ghost", "url": f"http://127.0.0.1:{free_port()}", "models": [MODEL]}],
            "shared_hosts": [{"id": "gpu-shared", "max_awake": 1,
                              "engines": {POOLED[0]: urls[4], POOLED[1]: urls[5]}},
                             {"id": "gpu-turns", "max_awake": 1, "scheduling": "turns", "tbt_ms": 50,
                              "engines": {TURNS[0]: urls[6], TURNS[1]: urls[7]}}],
            # Queued requests (waits of 0.1-1 s) miss the TTFT target as well as w0's the TPOT one: the burn
            # alert fires whatever share of the traffic the slow w0 gets on a faster or slower machine.
            "slo": {"ttft_ms": 300, "tpot_ms": 10},
            "pd": {"local_prefill_tokens": 0},
            "limits": {"queue_timeout_s": 60, "queue_poll_s": 0.02},
            "health": {"interval_s": 0.5, "timeout_s": 0.3},
            # w1 fails half its requests on purpose: keep it in rotation (5 failures in a row would eject it)
            # so requests keep being retried and streams resumed on w0.
            "resume": {"eject_after_errors": 0},
            "autoscale": {"enabled": True, "interval_s": 0.5, "sample_s": 0.1, "local_interval_s": 0.5,
                          "lease_ttl_s": 3, "local_caps": False,
                          "scaler": {"stabilization_s": 1, "cooldown_in_s": 1, "cooldown_out_s": 0}},
        }))
        gw = gateway_process(cfg, "--log-format", "logfmt")
        url = gw.listening_url()
        prom_cfg = tmp_path / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "deploy/prometheus/alerts.yml")],
            "scrape_configs": [
                {"job_name": "fleetgate", "static_configs": [{"targets": [url.removeprefix("http://")]}]},
                {"job_name": "vllm", "static_configs": [{"targets": [u.removeprefix("http://") for u in urls]}]}]}))
        prom = subprocess.Popen([prometheus, f"--config.file={prom_cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        api = f"http://127.0.0.1:{prom_port}"
        poll_sync(lambda: _ready(api), 30, "Prometheus ready", every=0.2)

        async with httpx.AsyncClient(timeout=10) as http:
            # w0 runs 30x slower (its answers miss the TPOT target), w1 fails half its requests (retries) and
            # drops the others after 5 tokens (broken streams, resumed elsewhere).
            await http.post(urls[0] + "/sim/faults", json={"slowdown": 30})
            await http.post(urls[1] + "/sim/faults", json={"error_status": 500, "error_rate": 0.5,
                                                           "drop_after_tokens": 5})   # its streams break: resumed
            fired: set[str] = set()  # alert expressions that returned samples at some point of the run

            async def watch_alerts() -> None:
                while True:
                    for rule in alert_rules():
                        if rule["alert"] not in fired and await _query(http, api, rule["expr"]):
                            fired.add(rule["alert"])
                    await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch_alerts())
            try:
                await _traffic(url)
                # The batch queue's depth is read from Redis by the batch sweep: on a loaded machine its first
                # sample can lag the traffic; let Prometheus see it before the store goes away.
                await poll(lambda: _query(http, api, 'fleetgate_queue_depth{class="batch"}'), 20,
                           "Prometheus to scrape the batch queue depth", every=0.5)
                redis_proc.kill()  # the store goes away: fleetgate_state_store_up{store="redis"} drops to 0
                redis_proc.wait(5)
                await poll(lambda: _value(http, api, 'min(fleetgate_state_store_up{store="redis"})', 0.0), 20,
                           "Prometheus to see Redis down")
                await poll(lambda: len(fired) == len(alert_rules()), 10, "every alert expression to return samples")
            except AssertionError:
                pass  # reported below with the rest
            finally:
                watcher.cancel()

            empty = []
            for title, expr in dashboard_queries():
                if not await _query(http, api, expr):
                    empty.append(f"panel {title!r}: {expr}")
            for rule in alert_rules():
                if rule["alert"] not in fired:
                    empty.append(f"alert {rule['alert']} never fired: {rule['expr']}")
            if empty:
                targets = (await http.get(api + "/api/v1/targets")).json()["data"]["activeTargets"]
                down = [(t["scrapeUrl"], t["lastError"]) for t in targets if t["health"] != "up"]
                metrics = (await http.get(url + "/metrics")).text
                pytest.fail("queries that returned nothing:\n" + "\n".join(empty) + f"\ntargets not up: {down}\n"
                            + "\n".join(x for x in metrics.splitlines() if "queue" in x and not x.startswith("#")))
            rules = (await http.get(api + "/api/v1/rules")).json()["data"]["groups"]
            loaded = {r["name"]: r for g in rules for r in g["rules"]}
            assert set(loaded) == {r["alert"] for r in alert_rules()}
            assert all(r["health"] == "ok" for r in loaded.values()), loaded
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        fleet.stop()
        if redis_proc.poll() is None:
            redis_proc.kill()
            redis_proc.wait(5)


def _ready(api: str) -> bool:
    try:
        return httpx.get(api + "/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


async def _query(http: httpx.AsyncClient, api: str, expr: str) -> list:
    r = await http.get(api + "/api/v1/query", params={"query": expr})
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


async def _value(http: httpx.AsyncClient, api: str, expr: str, want: float) -> bool:
    res = await _query(http, api, expr)
    return bool(res) and float(res[0]["value"][1]) == want


async def _traffic(url: str) -> None:
    """~20 s: mixed-model users arriving one every 0.4 s (caps of 2 fill, the queue grows), streamed and
    whole answers, and P/D requests with long prompts (prefill legs)."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=90)
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "max_tokens": 20,
                                         "messages": [{"role": "user", "content": f"batch {i}"}]}}) + "\n"
                    for i in range(120))  # more than the run can finish: the batch queue stays non-empty
    upload = await client.files.create(file=("b.jsonl", lines.encode()), purpose="batch")
    await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    stop = asyncio.Event()
    counts = {"ok": 0, "refused": 0}

    async def user(model: str, prompt: str, stream: bool) -> None:
        while not stop.is_set():
            try:
                await one(model, prompt, stream)
                counts["ok"] += 1
            except openai.APIStatusError:
                counts["refused"] += 1

    async def one(model: str, prompt: str, stream: bool) -> None:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            async for _ in await client.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                                                stream=True):
                pass
        else:
            await client.chat.completions.create(model=model, messages=messages, max_tokens=40)

    tasks = [asyncio.create_task(user(PD_MODEL, "long prompt " * 200, i % 2 == 0)) for i in range(2)]
    tasks += [asyncio.create_task(user(m, "swap me", False)) for m in POOLED]   # the shared host swaps per request
    tasks += [asyncio.create_task(user(m, "take turns", True)) for m in TURNS]   # the turns host runs decode turns
    deadline = time.monotonic() + 20
    i = 0
    while time.monotonic() < deadline:
        tasks.append(asyncio.create_task(user(MODEL, f"hello {i}", i % 2 == 0)))
        i += 1
        await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    assert counts["ok"] > 20, counts
