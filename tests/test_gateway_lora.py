"""LoRA adapters through the gateway, over real HTTP on loopback: simulated vLLM workers with runtime LoRA
updating, the gateway loading adapters where it routes them, the official `openai` client, and the demo's
`--lora-adapters` in real processes with plain httpx."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import httpx
import openai

from engine_adapters.vllm.metrics_parser import parse_vllm_metrics
from tests.helpers import ADMIN, MODEL, CliProcess, free_port_range, metric, running_gateway

LORA = {"enable_lora": True, "allow_runtime_lora_updating": True, "max_loras": 2, "time_scale": 20}
ADAPTERS = {MODEL: {"adapters": [{"name": "sql", "path": "/adapters/sql"}, {"name": "math", "path": "/adapters/math"}]}}


def served_by(urls: list[str], adapter: str) -> list[str]:
    """The workers whose own /v1/models lists `adapter`."""
    return [u for u in urls if adapter in {c["id"] for c in httpx.get(u + "/v1/models").json()["data"]}]


async def lora_metric(http: httpx.AsyncClient, name: str, adapter: str) -> float:
    return metric((await http.get("/metrics")).text, name, {"model": MODEL, "adapter": adapter}) or 0.0


async def test_adapter_is_loaded_once_then_hit(sim_fleet: Callable[..., Any]) -> None:
    fleet = sim_fleet(2, **LORA)
    async with running_gateway(fleet.urls, models=ADAPTERS) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        cards = {m.id: m for m in (await client.models.list()).data}
        assert (cards["sql"].parent, cards["math"].parent) == (MODEL, MODEL)   # listed before any load
        assert cards[MODEL].parent is None
        first = await client.chat.completions.create(model="sql", max_tokens=4,
                                                     messages=[{"role": "user", "content": "hi"}])
        assert first.model == "sql" and first.usage.completion_tokens >= 1
        holders = served_by(fleet.urls, "sql")
        assert len(holders) == 1 and served_by(fleet.urls, "math") == []
        assert (await lora_metric(http, "fleetgate_lora_loads_total", "sql"),
                await lora_metric(http, "fleetgate_lora_hits_total", "sql")) == (1.0, 0.0)
        second = await http.post("/v1/completions", json={"model": "sql", "prompt": "hello", "max_tokens": 4})
        assert second.status_code == 200 and second.json()["model"] == "sql"
        assert served_by(fleet.urls, "sql") == holders
        assert (await lora_metric(http, "fleetgate_lora_loads_total", "sql"),
                await lora_metric(http, "fleetgate_lora_hits_total", "sql")) == (1.0, 1.0)
        base = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert base.status_code == 200 and base.json()["model"] == MODEL


async def test_concurrent_first_requests_share_one_load(sim_fleet: Callable[..., Any]) -> None:
    fleet = sim_fleet(2, **LORA)
    async with running_gateway(fleet.urls, models=ADAPTERS) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        body = {"model": "math", "prompt": "1+1", "max_tokens": 4}
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))
        assert [r.status_code for r in answers] == [200] * 8
        assert {r.json()["model"] for r in answers} == {"math"}
        assert await lora_metric(http, "fleetgate_lora_loads_total", "math") == 1.0
        assert len(served_by(fleet.urls, "math")) == 1


async def test_a_worker_that_cannot_load_is_skipped_and_none_is_a_502(sim_fleet: Callable[..., Any]) -> None:
    # one worker without runtime LoRA updating (vLLM then has no /v1/load_lora_adapter route), one with it
    fleet = sim_fleet(fleet={"servers": [{"enable_lora": True}, {**LORA, "time_scale": 20}]}, time_scale=20)
    async with running_gateway(fleet.urls, models=ADAPTERS, default_policy="round_robin") as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        for _ in range(4):
            r = await http.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "sql"
        assert served_by(fleet.urls, "sql") == [fleet.urls[1]]
    lone = sim_fleet(1, time_scale=20)   # LoRA off altogether
    async with running_gateway(lone.urls, models=ADAPTERS) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 502
        err = r.json()["error"]
        assert "could not load adapter sql" in err["message"] and err["type"] == "upstream_error"
        assert await lora_metric(http, "fleetgate_lora_loads_total", "sql") == 0.0


def test_lora_demo_loads_each_adapter_once() -> None:
    base = free_port_range(3)
    with CliProcess("demo", "--lora-adapters", "4", "--workers", "2", "--port", str(base), "--base-port",
                    str(base + 1), "--time-scale", "20", merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        url = f"http://127.0.0.1:{base}"
        names = [c["id"] for c in httpx.get(url + "/v1/models").json()["data"] if c.get("parent") == MODEL]
        assert len(names) == 4
        with httpx.Client(base_url=url, timeout=30) as http:
            statuses = [http.post("/v1/completions", json={"model": n, "prompt": "Hello", "max_tokens": 8}).status_code
                        for _ in range(2) for n in names]
            text = http.get("/metrics").text
        assert statuses == [200] * 8
        loads = [metric(text, "fleetgate_lora_loads_total", {"adapter": n}) for n in names]
        assert loads == [1.0] * 4   # each adapter loaded once: 0 < total <= 4
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0


async def test_an_adapter_a_worker_serves_already_is_a_hit_without_a_load(sim_fleet: Callable[..., Any]) -> None:
    # workers without configured models: the gateway reads their /v1/models, where vLLM lists served adapters
    fleet = sim_fleet(fleet={"servers": [LORA, {**LORA, "lora_modules": ["sql=/adapters/sql"]}]}, time_scale=20)
    async with running_gateway(fleet.urls, models=ADAPTERS, discovery_interval_s=0.2) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        for _ in range(3):
            r = await http.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "sql"
        assert (await lora_metric(http, "fleetgate_lora_loads_total", "sql"),
                await lora_metric(http, "fleetgate_lora_hits_total", "sql")) == (0.0, 3.0)
        assert served_by(fleet.urls, "sql") == [fleet.urls[1]]


def test_lora_requests_info_newest_series_names_the_adapters() -> None:
    # vLLM keeps one series per label set it has set, valued with the time it was set (vllm/v1/metrics/loggers.py)
    text = "\n".join([
        '# TYPE vllm:lora_requests_info gauge',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1700000000.0',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,math",waiting_lora_adapters="chat"} '
        '1700000005.0',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1700000001.0',
        'vllm:num_requests_running{model_name="m"} 3.0', ""])
    m = parse_vllm_metrics(text)
    assert (m.lora_running, m.lora_waiting, m.max_lora, m.running) == (("sql", "math"), ("chat",), 2, 3.0)
    assert parse_vllm_metrics('vllm:num_requests_running{model_name="m"} 1.0\n').max_lora is None


async def test_max_adapters_per_worker_unloads_the_least_recently_used(sim_fleet: Callable[..., Any]) -> None:
    fleet = sim_fleet(1, **LORA)
    models = {MODEL: {**ADAPTERS[MODEL], "max_adapters_per_worker": 1}}
    async with running_gateway(fleet.urls, models=models) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        for name in ("sql", "math", "sql"):
            r = await http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name
            assert served_by(fleet.urls, name) == fleet.urls     # the worker serves only the adapter just used
            assert served_by(fleet.urls, "math" if name == "sql" else "sql") == []
        counts = [await lora_metric(http, f"fleetgate_lora_{kind}_total", a)
                  for kind in ("loads", "unloads") for a in ("sql", "math")]
        assert counts == [2.0, 1.0, 1.0, 1.0]


async def test_an_adapter_that_fails_to_load_is_its_own_failure_not_the_workers(sim_fleet: Callable[..., Any]) -> None:
    """Three healthy workers that cannot load an adapter (LoRA off: vLLM refuses the load).
    Every request for it gets a clear OpenAI-style error naming the adapter; the load is tried once per worker,
    then the adapter is remembered bad there; no worker leaves rotation, and base requests are all served.
    (Before: each request retried the load everywhere, and the failures ejected healthy workers.)"""
    fleet = sim_fleet(3, time_scale=20)
    async with running_gateway(fleet.urls, models=ADAPTERS) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        bad = {"model": "sql", "prompt": "hi", "max_tokens": 2}
        good = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        statuses: list[int] = []
        for _ in range(10):
            answers = await asyncio.gather(http.post("/v1/completions", json=bad),
                                           *(http.post("/v1/completions", json=good) for _ in range(4)))
            assert all(r.status_code == 200 for r in answers[1:]), [r.text for r in answers[1:]]
            r = answers[0]
            statuses.append(r.status_code)
            err = r.json()["error"]
            assert "could not load adapter sql" in err["message"] and err["type"] == "upstream_error", err
        assert statuses == [502] * 10
        text = (await http.get("/metrics")).text
        loads = [metric(text, "fleetgate_upstream_errors_total", {"worker": f"w{i}", "kind": "lora_load"}) or 0
                 for i in range(3)]
        assert sum(loads) <= 3 and max(loads) <= 1, loads          # one load tried per worker, then remembered
        assert [metric(text, "fleetgate_worker_healthy", {"worker": f"w{i}"}) for i in range(3)] == [1.0] * 3
        workers = (await http.get("/admin/workers", headers=ADMIN)).json()["data"]
        assert all(w["healthy"] for w in workers), workers
