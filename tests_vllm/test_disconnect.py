"""A client that goes away mid-stream: the gateway aborts the upstream request and vLLM stops generating."""

from __future__ import annotations

from tests_vllm.conftest import MODEL, engine_metric, wait_until

MAX_TOKENS = 1000  # 5-10 s of generation at 5-10 ms/token if nobody stopped it


def test_client_disconnect_stops_generation_on_the_server(gateway, vllm_fleet) -> None:  # noqa: ANN001
    urls = [s.url for s in vllm_fleet.servers.values()]

    def fleet_sum(name: str) -> float:
        return sum(engine_metric(url, name) for url in urls)

    wait_until(lambda: fleet_sum("vllm:num_requests_running") == 0, 30, "the servers to be idle")
    generated_before = fleet_sum("vllm:generation_tokens_total")

    stream = gateway.client().completions.create(
        model=MODEL, prompt="while True:", max_tokens=MAX_TOKENS, stream=True, temperature=0,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    stream.close()  # drops the connection to the gateway

    wait_until(lambda: fleet_sum("vllm:num_requests_running") == 0, 10,
               "the server to stop running the abandoned request")
    # The counter is updated by the engine loop; once running is 0 it settles on the tokens made so far.
    last = [fleet_sum("vllm:generation_tokens_total")]

    def settled() -> bool:
        now = fleet_sum("vllm:generation_tokens_total")
        same = now == last[0]
        last[0] = now
        return same

    wait_until(settled, 5, "generation_tokens_total to stop growing", interval=0.3)
    generated = last[0] - generated_before
    assert 5 <= generated < MAX_TOKENS
