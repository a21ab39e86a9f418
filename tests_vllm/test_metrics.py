"""The gateway scrapes the real vLLM /metrics and reports the fleet on its own /metrics and admin API.

Load is made on the "prio" server (`--max-num-seqs 1`): requests queue there one behind the other, which
keeps the engine busy for a predictable while whatever the speed of this shared machine.
"""

from __future__ import annotations

from tests_vllm.conftest import (
    MODEL,
    Background,
    completion_call,
    direct_client,
    engine_metric,
    metric_samples,
    run_gateway,
    wait_until,
)


def _inflight(gw) -> float:  # noqa: ANN001
    return sum(v for _, v in metric_samples(gw.metrics(), "fleetgate_worker_inflight"))


def test_gateway_metrics_show_both_workers_healthy(gateway, vllm_fleet) -> None:  # noqa: ANN001
    healthy = metric_samples(gateway.metrics(), "fleetgate_worker_healthy")
    ids = {w["url"].rstrip("/"): w["id"] for w in gateway.workers()}
    assert set(ids) == {s.url for s in vllm_fleet.servers.values()}
    assert {labels["worker"]: value for labels, value in healthy} == {wid: 1.0 for wid in ids.values()}


def test_gateway_counts_requests_it_relays(gateway) -> None:  # noqa: ANN001
    def answered() -> float:
        return sum(v for labels, v in metric_samples(gateway.metrics(), "fleetgate_requests_total")
                   if labels.get("model") == MODEL and labels.get("status") == "200")

    before = answered()
    completion_call(gateway.client(), 3)()
    # The counter moves when the response is complete, which may be just after the client has it.
    wait_until(lambda: answered() == before + 1, 5, "fleetgate_requests_total to count the request")


def test_scraped_engine_values_move_with_load(gateway, prio_server) -> None:  # noqa: ANN001
    """Requests running and queued on a server show up in the gateway's scraped view of it, then go away."""

    def scraped() -> dict:
        return gateway.worker_for(prio_server.url)["engine"]

    wait_until(lambda: scraped()["running"] == 0, 30, "the prio server to be idle in the gateway's view")
    first_scrape = scraped()["scraped_at"]
    # Sent to the server itself so they surely land there; the gateway only sees them through /metrics.
    client = direct_client(prio_server.url)
    calls = [Background(completion_call(client, 300, prompt=f"load {i}")) for i in range(3)]
    wait_until(lambda: scraped()["running"] == 1 and scraped()["waiting"] >= 1, 30,
               "the gateway's scrape to show one request running and others waiting")
    for call in calls:
        assert call.wait(120).usage.completion_tokens == 300
    wait_until(lambda: scraped()["running"] == 0 and scraped()["waiting"] == 0, 10,
               "the gateway's scrape to show the server idle again")
    assert scraped()["scraped_at"] > first_scrape


def test_gateway_reservations_move_while_a_request_is_in_flight(prio_server) -> None:  # noqa: ANN001
    with run_gateway([prio_server.url]) as gw:
        assert _inflight(gw) == 0
        blocker = Background(completion_call(direct_client(prio_server.url), 300))
        wait_until(lambda: engine_metric(prio_server.url, "vllm:num_requests_running") == 1, 30,
                   "the blocker to occupy the prio server's only slot")
        # Queued behind the blocker in the engine, the gateway's request holds its reservation meanwhile.
        call = Background(completion_call(gw.client(), 8))
        wait_until(lambda: _inflight(gw) == 1, 20, "fleetgate_worker_inflight to count the request")
        assert blocker.wait(120).usage.completion_tokens == 300
        assert call.wait(60).usage.completion_tokens == 8
        wait_until(lambda: _inflight(gw) == 0, 10, "the reservation to be released")
