"""Sanity checks straight against the real servers: what the rest of the suite relies on is true."""

from __future__ import annotations

import random
import time

import httpx

from tests_vllm.conftest import ALIASES, MODEL, direct_client, engine_metric, wait_until


def test_servers_serve_the_tiny_model(vllm_fleet) -> None:  # noqa: ANN001
    for name, server in vllm_fleet.servers.items():
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        models = httpx.get(server.url + "/v1/models", timeout=5).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 1024), (ALIASES[name], 1024)]
        # Each server keeps its scratch files (ZMQ sockets) in its own TMPDIR inside the run dir.
        assert server.tmpdir.is_relative_to(vllm_fleet.run_dir)


def test_fcfs_server_accepts_and_ignores_priority(plain_server) -> None:  # noqa: ANN001
    resp = direct_client(plain_server.url).completions.create(
        model=MODEL, prompt="p", max_tokens=3, extra_body={"priority": 5, "ignore_eos": True})
    assert resp.usage.completion_tokens == 3


def test_generation_counter_counts_tokens(plain_server) -> None:  # noqa: ANN001
    before = engine_metric(plain_server.url, "vllm:generation_tokens_total")
    direct_client(plain_server.url).completions.create(
        model=MODEL, prompt="count", max_tokens=7, extra_body={"ignore_eos": True})
    wait_until(lambda: engine_metric(plain_server.url, "vllm:generation_tokens_total") == before + 7, 5,
               "generation_tokens_total to grow by exactly 7")


def test_step_trace_logs_each_engine_step_with_its_batch(plain_server, step_trace_dir) -> None:  # noqa: ANN001
    """bench/fidelity/vllm_hook on the plain server: one 77-token prompt with 5 output tokens is one prefill step and
    four decode steps, each with the context it decoded over (what bench.fidelity.step_trace sets beside a profile)."""
    from bench.fidelity.step_trace import load_steps

    prompt = [random.Random(time.time_ns()).randrange(16, 4000) for _ in range(77)]   # no prefix-cache hit
    began = time.time()
    direct_client(plain_server.url).completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                                       extra_body={"ignore_eos": True})
    wait_until(lambda: len([s for s in load_steps(step_trace_dir) if s.t0 >= began]) >= 5, 5,
               "five steps in the trace")
    steps = [s for s in load_steps(step_trace_dir) if s.t0 >= began]
    assert [(s.pre_n, s.pre_tok, s.dec, s.ctx) for s in steps] == [
        (1, 77, 0, 0), (0, 0, 1, 77), (0, 0, 1, 78), (0, 0, 1, 79), (0, 0, 1, 80)]
    assert steps[0].pairs == 77 * 77 / 2 and all(s.period_s > 0 for s in steps[:-1])
