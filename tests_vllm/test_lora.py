"""A real LoRA adapter through the gateway: the tiny model's adapter made in the test (tests_vllm/lora_adapter.py),
loaded on demand by the gateway into the plain server (`--enable-lora --max-loras 1 --max-lora-rank 8`, runtime
LoRA updating on) through vLLM's `POST /v1/load_lora_adapter`, then served from there.

What vLLM does here is recorded in docs/reference/vllm-cpu.md §4 "LoRA"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.vllm_servers import VllmFleet
from tests_vllm.conftest import (
    MODEL,
    Gateway,
    direct_client,
    engine_metric,
    metric_samples,
    metric_sum,
    run_gateway,
)
from tests_vllm.lora_adapter import RANK, make_adapter

ADAPTER = "tiny-lora"
PROMPT = "def main():"


def served(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


@pytest.fixture
def lora_gateway(vllm_fleet: VllmFleet, tmp_path: Path) -> Iterator[tuple[Gateway, str, Path]]:
    """A gateway in front of the plain server with ADAPTER configured for the model (not loaded yet); the server
    forgets the adapter afterwards (the server is shared by the whole session)."""
    server = vllm_fleet["plain"]
    assert ADAPTER not in served(server.url)
    adapter = make_adapter(tmp_path / ADAPTER, vllm_fleet.model_dir, rank=RANK)
    cfg = {"workers": [{"id": "plain", "url": server.url}], "scrape_interval_s": 0.2,
           "models": {MODEL: {"adapters": [{"name": ADAPTER, "path": str(adapter)}]}}}
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(cfg))     # JSON is YAML
    try:
        with run_gateway([], config=path) as gw:
            yield gw, server.url, adapter
    finally:
        httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=30)


def lora_counter(gw: Gateway, name: str) -> float:
    return metric_sum(gw.metrics(), name, model=MODEL, adapter=ADAPTER)


def test_the_gateway_loads_a_real_adapter_on_demand_then_hits_it(lora_gateway: tuple[Gateway, str, Path]) -> None:
    gw, server, adapter = lora_gateway
    client = gw.client()
    cards = {m.id: m for m in client.models.list().data}
    assert cards[ADAPTER].parent == MODEL and cards[MODEL].parent is None   # listed before it is loaded anywhere

    first = client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.model == ADAPTER and first.usage.completion_tokens == 8
    card = served(server)[ADAPTER]                  # the gateway's POST /v1/load_lora_adapter registered it
    assert (card["parent"], card["root"]) == (MODEL, str(adapter))
    assert (lora_counter(gw, "fleetgate_lora_loads_total"), lora_counter(gw, "fleetgate_lora_hits_total")) == (1, 0)

    second = client.chat.completions.create(model=ADAPTER, max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "hello"}])
    assert second.model == ADAPTER and second.usage.completion_tokens >= 1
    assert lora_counter(gw, "fleetgate_lora_loads_total") == 1
    assert lora_counter(gw, "fleetgate_lora_hits_total") >= 1
    listed = [m for m in client.models.list().data if m.id == ADAPTER]   # once, though the worker lists it too now
    assert len(listed) == 1 and listed[0].parent == MODEL

    # the adapter really runs: greedy text differs from the base model's for the same prompt
    base = direct_client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True})
    assert base.choices[0].text != first.choices[0].text
    # the engine saw it: its newest vllm:lora_requests_info series names the adapter's one slot
    infos = metric_samples(httpx.get(server + "/metrics", timeout=10).text, "vllm:lora_requests_info")
    assert {labels["max_lora"] for labels, _ in infos} == {"1"}
    assert any(ADAPTER in labels["running_lora_adapters"].split(",") for labels, _ in infos)
    assert engine_metric(server, "vllm:request_success_total") >= 2


def test_an_adapter_vllm_cannot_load_is_an_openai_error(vllm_fleet: VllmFleet, tmp_path: Path) -> None:
    """Rank 16 over the server's --max-lora-rank 8: the worker's load fails (vLLM answers 500), the gateway answers
    the request with an OpenAI-style error, and the server keeps serving."""
    server = vllm_fleet["plain"]
    adapter = make_adapter(tmp_path / "too-big", vllm_fleet.model_dir, rank=2 * RANK)
    cfg = {"workers": [{"id": "plain", "url": server.url}],
           "models": {MODEL: {"adapters": [{"name": "too-big", "path": str(adapter)}]}}}
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(cfg))
    with run_gateway([], config=path) as gw:
        r = httpx.post(gw.url + "/v1/completions", json={"model": "too-big", "prompt": "a", "max_tokens": 2},
                       timeout=60)
        assert r.status_code >= 500 and r.headers["content-type"].startswith("application/json"), r.text
        assert "too-big" in r.json()["error"]["message"]
        assert "too-big" not in served(server.url)
        ok = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
