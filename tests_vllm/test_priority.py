"""vLLM's `priority` field reaches the engine through the gateway (docs/reference/vllm-cpu.md §4, priority scheduling).

The "prio" server runs `--scheduling-policy priority --max-num-seqs 1`: a long blocker holds the only slot,
four priority-10 requests queue behind it, then one priority -10 request arrives last and must run first.
The queued requests generate 64 tokens each, so consecutive finishes are ~0.2 s apart on the server: far more
than the jitter of relaying a response to a client thread (16 tokens once let the blocker's 600-token body
arrive after the next request's).
"""

from __future__ import annotations

from tests_vllm.conftest import Background, completion_call, engine_metric, run_gateway, wait_until

QUEUED_TOKENS = 64


def test_lower_priority_value_is_served_first_through_the_gateway(prio_server) -> None:  # noqa: ANN001
    url = prio_server.url

    def count(name: str) -> float:
        return engine_metric(url, name)

    with run_gateway([url]) as gw:
        client = gw.client(timeout=120)
        wait_until(lambda: count("vllm:num_requests_running") == 0 and count("vllm:num_requests_waiting") == 0,
                   30, "the prio server to be idle")
        calls = {"blocker": Background(completion_call(client, 600, prompt="blocker", priority=0))}
        wait_until(lambda: count("vllm:num_requests_running") == 1, 30, "the blocker to take the only slot")
        for i in range(4):
            calls[f"low{i}"] = Background(completion_call(client, QUEUED_TOKENS, prompt=f"low{i}", priority=10))
            wait_until(lambda n=i + 1: count("vllm:num_requests_waiting") == n, 20, f"low{i} to queue")
        calls["high"] = Background(completion_call(client, QUEUED_TOKENS, prompt="high", priority=-10))
        wait_until(lambda: count("vllm:num_requests_waiting") == 5, 20, "the high-priority request to queue")
        # Everything queued while the blocker still ran; otherwise the order below would prove nothing.
        assert not calls["blocker"].done.is_set()
        for call in calls.values():
            assert call.wait(120).choices[0].finish_reason == "length"

    order = sorted(calls, key=lambda name: calls[name].finished_at)
    assert order == ["blocker", "high", "low0", "low1", "low2", "low3"]
