"""vLLM dev-mode sleep/wake (VLLM_SERVER_DEV_MODE=1): the protocol works on CPU, though no memory is freed.

Reference: docs/reference/vllm-cpu.md §4 "Sleep / wake": /sleep?level=1 -> {"status":"sleeping"}, /is_sleeping, the
engine_sleep_state gauge; a request sent while asleep blocks (not fails) and finishes after /wake_up.
"""

from __future__ import annotations

import httpx

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


def test_request_blocks_while_asleep_and_finishes_after_wake_up(plain_server) -> None:  # noqa: ANN001
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
            call = Background(completion_call(gw.client(), 8, prompt="wake"))
            # The gateway has reserved and forwarded it ...
            wait_until(lambda: sum(v for _, v in metric_samples(gw.metrics(), "fleetgate_worker_inflight")) == 1,
                       10, "the gateway to forward the request")
            # ... and the sleeping engine holds it rather than failing it.
            assert not call.done.wait(1.5), f"the request ended while the engine slept: {call.error or call.result}"
        finally:
            wake = httpx.post(url + "/wake_up", timeout=30)
        assert wake.status_code == 200, wake.text
        assert wake.json().get("status") == "awake"
        assert is_sleeping(url) is False
        resp = call.wait(60)

    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    wait_until(lambda: _sleep_state(url, "awake") == 1, 5, "engine_sleep_state to say awake")
