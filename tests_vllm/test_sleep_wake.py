"""vLLM dev-mode sleep/wake (VLLM_SERVER_DEV_MODE=1): the protocol works on CPU, though no memory is freed.

Reference: docs/reference/vllm-cpu.md §4 "Sleep / wake": /sleep?level=1 -> {"status":"sleeping"}, /is_sleeping, the
engine_sleep_state gauge; a request sent while asleep blocks (not fails) and finishes after /wake_up.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests_vllm.conftest import (
    Background,
    completion_call,
    engine_metric,
    is_sleeping,
    metric_samples,
    run_gateway,
    wait_until,
)


def _sleep_state(url: str, state: str) -> float:
    return engine_metric(url, "vllm:engine_sleep_state", sleep_state=state)


def _gateway_sees(gw, state: str) -> bool:  # noqa: ANN001
    return any(v == 1 for labels, v in metric_samples(gw.metrics(), "fleetgate_engine_state")
               if labels.get("state") == state)


def test_request_blocks_while_asleep_and_finishes_after_wake_up(plain_server) -> None:  # noqa: ANN001
    """Sent straight to the sleeping engine, a request is held and finishes after /wake_up (vLLM's behaviour).
    The gateway routes nothing to a sleeping engine (gateway/fleet/registry.py `awake`): once its scrape has seen its
    only engine asleep, a request gets an OpenAI-style 503 at once (what a client retries, and what a model's
    fallbacks act on), never a hang; once it has seen the engine awake again, requests through it succeed."""
    url = plain_server.url
    with run_gateway([url]) as gw:
        wait_until(lambda: engine_metric(url, "vllm:num_requests_running") == 0, 30, "the server to be idle")
        assert is_sleeping(url) is False

        resp = httpx.post(url + "/sleep", params={"level": 1}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json().get("status") == "sleeping"
        try:
            assert is_sleeping(url) is True
            wait_until(lambda: _sleep_state(url, "weights_offloaded") == 1 and _sleep_state(url, "awake") == 0,
                       5, "engine_sleep_state to say weights_offloaded")
            wait_until(lambda: _gateway_sees(gw, "weights_offloaded"), 30, "the gateway to scrape the sleep state")
            direct = Background(completion_call(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                                              timeout=120), 8, prompt="wake"))
            # the engine holds the request sent to it ...
            assert not direct.done.wait(1.5), f"the request ended while the engine slept: {direct.error or direct.result}"
            # ... and the gateway, with no engine awake, says so at once
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                completion_call(gw.client(), 8, prompt="wake")()
            assert refused.value.status_code == 503 and time.monotonic() - t0 < 30, refused.value
            assert sum(v for _, v in metric_samples(gw.metrics(), "fleetgate_worker_inflight")) == 0
        finally:
            wake = httpx.post(url + "/wake_up", timeout=30)
        assert wake.status_code == 200, wake.text
        assert wake.json().get("status") == "awake"
        assert is_sleeping(url) is False
        held = direct.wait(60)
        assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 8
        wait_until(lambda: _gateway_sees(gw, "awake"), 30, "the gateway to scrape the engine awake")
        resp = completion_call(gw.client(), 8, prompt="wake")()
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 8

    wait_until(lambda: _sleep_state(url, "awake") == 1, 5, "engine_sleep_state to say awake")
