"""bench/peers_sched.py: the prompts it replays share exactly the prefixes the trace's block keys share, and a
request meets its SLO only when it completed within both targets."""

from __future__ import annotations

from bench.peers_sched import Outcome, meets, prompt_text, trace_window
from simulator.tokenizer import BLOCK_SIZE, count_tokens, encode
from simulator.workload import WorkloadRequest


def test_prompts_have_the_traces_token_counts_and_share_its_prefixes():
    a = WorkloadRequest("a", 0.0, 100, 4, prefix_blocks=(1, 2, 3, 4, 5, 6))
    b = WorkloadRequest("b", 0.0, 70, 4, prefix_blocks=(1, 2, 3, 9))
    c = WorkloadRequest("c", 0.0, 40, 4, prefix_blocks=(7, 8))
    cache: dict[int, str] = {}
    ta, tb, tc = (prompt_text(r, cache) for r in (a, b, c))
    assert [count_tokens(t) for t in (ta, tb, tc)] == [100, 70, 40]
    ea, eb, ec = encode(ta), encode(tb), encode(tc)
    assert ea[: 3 * BLOCK_SIZE] == eb[: 3 * BLOCK_SIZE]          # blocks 1, 2, 3 shared token for token
    assert ea[3 * BLOCK_SIZE: 4 * BLOCK_SIZE] != eb[3 * BLOCK_SIZE: 4 * BLOCK_SIZE]   # then 4 vs 9
    assert ea[:BLOCK_SIZE] != ec[:BLOCK_SIZE]
    assert ta[96 * 4:] != prompt_text(WorkloadRequest("z", 0.0, 100, 4, prefix_blocks=a.prefix_blocks), cache)[96 * 4:]


def test_a_request_meets_its_slo_only_when_done_within_both_targets():
    r = WorkloadRequest("r", 0.0, 100, 8, slo_ttft_s=1.0, slo_tpot_s=0.1)
    assert meets(Outcome(0.9, 0.05, ok=True, status=200), r)
    assert not meets(Outcome(1.1, 0.05, ok=True, status=200), r)
    assert not meets(Outcome(0.9, 0.2, ok=True, status=200), r)
    assert not meets(Outcome(0.9, 0.05, ok=False, status=429), r)
    assert meets(Outcome(0.5, None, ok=True, status=200), WorkloadRequest("one", 0.0, 100, 1, slo_ttft_s=1.0))


def test_the_trace_window_starts_at_zero_with_per_request_slos():
    reqs = trace_window(3000, 50)
    assert len(reqs) == 50 and reqs[0].arrival == 0.0
    assert all(b.arrival >= a.arrival for a, b in zip(reqs, reqs[1:], strict=False))
    assert all(r.slo_ttft_s and r.slo_ttft_s > 0.5 and r.slo_tpot_s == 0.1 for r in reqs)


def test_the_headline_compares_fleetgates_best_arm_with_the_best_peer_by_goodput():
    from bench.peers_sched import ArmRun, headline

    reqs = [WorkloadRequest(str(i), 0.0, 10, 2, slo_ttft_s=1.0, slo_tpot_s=0.1) for i in range(4)]
    good, bad = Outcome(0.5, 0.05, ok=True, status=200), Outcome()
    runs = [ArmRun("fleetgate a", [good, good, bad, bad], 2.0), ArmRun("fleetgate b", [good] * 3 + [bad], 2.0),
            ArmRun("vllm-router c", [good] * 4, 4.0), ArmRun("sglang-router d", [good, bad, bad, bad], 1.0)]
    line = headline(runs, reqs)
    assert line.startswith("Best fleetgate arm by goodput: fleetgate b, 1.500 met req/s = 1.50x")
    assert "(vllm-router c, 1.000)" in line and "75.0% vs 100.0%" in line


# --- the sweeps (bench/peers_sweep.py) -------------------------------------------------------------------
def _curve_runner(need: dict[str, float], calls: list[tuple[str, int, float]]):
    """A probe whose attainment is 1.0 while workers / rate >= need[arm], else 0.9 (monotone, as assumed)."""
    from bench.peers_sweep import Probe

    def run(arm: str, workers: int, rate: float) -> Probe:
        calls.append((arm, workers, rate))
        att = 1.0 if workers / rate >= need[arm] else 0.9
        return Probe(arm, workers, rate, att, goodput=4.0 * rate * att, hit_rate=0.1)

    return run


def test_the_workers_sweep_finds_the_smallest_fleet_and_says_when_it_lies_outside_the_range():
    from bench.peers_sweep import sweep_workers, workers_table, workers_verdict

    calls: list[tuple[str, int, float]] = []
    run = _curve_runner({"fleetgate a": 7, "sglang-router b": 9, "fleetgate c": 20, "vllm-router d": 1}, calls)
    res = [sweep_workers(arm, run, 4, 12) for arm in ("fleetgate a", "sglang-router b", "fleetgate c",
                                                      "vllm-router d")]
    assert [(r.answer, r.bound) for r in res] == [(7, ""), (9, ""), (12, ">"), (4, "<=")]
    assert len({c for c in calls if c[0] == "fleetgate a"}) == len([c for c in calls if c[0] == "fleetgate a"]) <= 4
    rows = workers_table(res, 4, 12)
    assert "| fleetgate c | > 12 |" in rows[4] and "| vllm-router d | <= 4 |" in rows[5]
    verdict = workers_verdict(res, "fleetgate a", 12)
    assert "**missed**" in verdict and "not fewer than: vllm-router d" in verdict
    assert "**met**" in workers_verdict(res[:3], "fleetgate a", 12)


def test_the_rate_sweep_finds_the_largest_rate_at_99_and_compares_goodput_with_the_best_peer():
    from bench.peers_sweep import rate_table, sweep_rate

    calls: list[tuple[str, int, float]] = []
    grid = [0.5, 0.6, 0.8, 1.0, 1.2, 1.5]
    # at 8 workers: ok while rate <= 8 / need
    run = _curve_runner({"fleetgate a": 8 / 1.2, "sglang-router b": 8 / 0.8, "vllm-router c": 8 / 0.4,
                         "fleetgate d": 1}, calls)
    res = [sweep_rate(arm, run, 8, grid) for arm in ("fleetgate a", "sglang-router b", "vllm-router c",
                                                     "fleetgate d")]
    assert [(r.answer, r.bound) for r in res] == [(1.2, ""), (0.8, ""), (0.5, "<"), (1.5, ">")]
    rows, verdict = rate_table(res, grid, base_rate=4.0)
    # goodput at the answer: 4.0 x rate; the best peer is sglang-router b (3.2); vllm-router c never reached 99%:
    # credited with the offered rate at x0.5 (2.0) as an upper bound
    assert "| fleetgate a | 1.2 | 4.800 | 1.50x |" in rows[2]
    assert "| vllm-router c | < 0.5 | < 2.000 | - |" in rows[4]
    assert "**met**" in verdict and "fleetgate d 6.000 met req/s = 1.88x sglang-router b (3.200)" in verdict
    # No peer reaches 99% anywhere on the grid: ratios to the bound are lower bounds
    rows, verdict = rate_table([res[0], res[2]], grid, base_rate=4.0)
    assert "| fleetgate a | 1.2 | 4.800 | >= 2.40x |" in rows[2]
    assert "**met**" in verdict and ">= 2.40x vllm-router c, whose goodput at 99% is below 2.000" in verdict


def test_sweep_modes_run_live_end_to_end(tmp_path):
    """A tiny live run of both sweeps (one fleetgate arm with the KV-event view, a short window at time scale
    20): the report holds both tables, the verdict lines and the plots."""
    import subprocess
    import sys

    from bench.harness import REPO

    out = tmp_path / "sched.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers_sched", "--sweep-workers", "--sweep-rate", "--requests", "12",
         "--time-scale", "20", "--workers", "1", "--workers-range", "0", "2", "--rates", "0.5", "1",
         "--arms", "fleetgate aladdin + KV events", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    # the probes next to the answer ran twice (--repeats 2 by default); every run is listed with its load
    assert "#### The boundary probes, 2 runs each, interleaved across arms" in text
    assert "| fleetgate aladdin + KV events, 1 workers | 2 |" in text or "| fleetgate aladdin + KV events, 2 " \
        "workers | 2 |" in text
    assert "#### Every live run, in order" in text and " -> " in text
    assert "### Workers needed for 99% SLO attainment" in text and "### Goodput at 99% SLO attainment" in text
    assert "| fleetgate aladdin + KV events |" in text
    assert "--sweep-workers --workers-range 0 2 --sweep-rate --rates 0.5 1" in text
    assert (tmp_path / "sched_workers.png").stat().st_size > 1000
    assert (tmp_path / "sched_rate.png").stat().st_size > 1000


def test_the_virtual_time_check_runs_aladdin_with_and_without_cache_pricing():
    from bench.peers_sched import virtual_time_rows

    rows = virtual_time_rows(trace_window(3000, 30), [2])
    assert len(rows) == 3 and rows[2].startswith("| 2 | ")
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert len(cells) == 7 and all(c.endswith("%") for c in (cells[1], cells[2], cells[4], cells[5]))


# --- repeats, failures, hygiene ---------------------------------------------------------------------------
def test_repeats_interleave_the_arms_and_flag_a_spread_over_five_points():
    from bench.peers import Arm
    from bench.peers_sched import interleaved, spread_rows

    a, b, c = (Arm(n, "fleetgate", "least_requests") for n in "abc")
    assert [x.name for x in interleaved([a, b, c], 3)] == list("abccbaabc")
    rows = spread_rows([("a", 0.90), ("b", 0.99), ("a", 0.96), ("b", 0.97)])
    assert rows[2] == "| a | 2 | 90.0%, 96.0% | 6.0 points | **> 5 points** |"
    assert rows[3] == "| b | 2 | 99.0%, 97.0% | 2.0 points |  |"


def test_boundary_probes_rerun_interleaved_and_an_answer_on_both_sides_is_not_confirmed():
    from bench.peers_sched import repeat_boundary
    from bench.peers_sweep import Probe, sweep_workers

    class Runner:   # fleetgate a needs 7 workers every time; b needs 5 in its first run at 5, then 6
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def __call__(self, arm: str, n: int, rate: float) -> Probe:
            return self.live(arm, n, rate)

        def live(self, arm: str, n: int, rate: float) -> Probe:
            self.calls.append((arm, n))
            need = 7 if arm == "a" else (5 if self.calls.count((arm, 5)) == 1 else 6)
            return Probe(arm, n, rate, 1.0 if n >= need else 0.9, 1.0, 0.1)

    run = Runner()
    res = [sweep_workers(arm, run, 2, 10) for arm in ("a", "b")]
    first = len(run.calls)
    rows = repeat_boundary(res, run, 2)
    reruns = run.calls[first:]
    assert reruns == [("b", 4), ("b", 5), ("a", 6), ("a", 7)]   # second pass in reverse arm order
    assert "| a, 7 workers | 2 | 100.0%, 100.0% | 0.0 points |  |" in rows
    assert "| b, 5 workers | 2 | 100.0%, 90.0% | 10.0 points | **> 5 points** |" in rows
    assert rows[-1] == "- b at 5 workers: runs on both sides of 99% (100.0%, 90.0%), so its answer is not confirmed"


def test_every_failure_is_labelled_by_status_code_or_kind_over_real_http():
    """replay against a loopback server answering each request differently: a 429 with Retry-After (the
    gateway's admission), a 503 with an OpenAI error code, a stream cut before [DONE], a dropped connection and
    a complete stream."""
    import asyncio

    from aiohttp import web

    from bench.peers_sched import REJECTED, ArmRun, failure_cells, replay
    from scripts.vllm_servers import free_port

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = body["prompt"]
        if kind == "reject":
            return web.json_response({"error": {"message": "over capacity", "type": "rate_limit_error",
                                                "code": "overloaded"}}, status=429, headers={"Retry-After": "1"})
        if kind == "fail":
            return web.json_response({"error": {"message": "no worker", "type": "server_error",
                                                "code": "no_healthy_worker"}}, status=503)
        if kind == "drop":
            request.transport.close()
            return web.Response()
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        if kind == "ok":
            await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> list:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            kinds = ["reject", "fail", "cut", "drop", "ok"]
            reqs = [WorkloadRequest(k, 0.0, 10, 2, slo_ttft_s=5.0, slo_tpot_s=5.0) for k in kinds]
            outcomes, _ = await replay(f"http://127.0.0.1:{port}", reqs, kinds, 1.0)
            return outcomes
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(main())
    assert [o.error for o in outcomes[:3]] == [REJECTED, "HTTP 503 no_healthy_worker", "stream cut"]
    assert outcomes[3].error.startswith("connection: ") and not outcomes[3].ok
    assert outcomes[4].ok and outcomes[4].error == ""
    run = ArmRun("x", outcomes)
    assert failure_cells(run)[0] == "1"   # rejections apart from the failures
    assert set(failure_cells(run)[1].split(", ")) == {"1 HTTP 503 no_healthy_worker", "1 stream cut",
                                                      f"1 {outcomes[3].error}"}


def test_a_run_does_not_start_while_the_previous_ones_process_or_port_is_alive():
    import socket
    import subprocess
    import sys

    import pytest

    from bench.run_hygiene import assert_clean
    from scripts.vllm_servers import free_port

    port = free_port()
    code = (f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
            "print('up', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        with pytest.raises(RuntimeError, match=rf"process {proc.pid} .*port {port} in use"):
            assert_clean([port], wait_s=0.5)
    finally:
        proc.kill()
        proc.wait()
    assert_clean([port], wait_s=5.0)        # gone and reaped: the next run may start
    with socket.socket() as s:               # and the port really is free
        s.bind(("127.0.0.1", port))


def test_the_default_holds_on_long_prompts_where_least_requests_does_not_in_virtual_time():
    """Mooncake requests 0-399 (prompts up to ~83k tokens, little reuse) on 6 workers: counting requests puts
    long prefills together and misses 99%; counting tokens in flight (the default) reaches it."""
    from bench.peers_sched import PROFILE
    from bench.peers_sched_virtual import sim_probe
    from gateway.config import GatewayConfig

    reqs = trace_window(0, 400)
    assert max(r.prompt_tokens for r in reqs) > 80_000   # (those over the context are left out)
    default = GatewayConfig.model_fields["default_policy"].default
    assert default == "least_tokens"
    assert sim_probe(reqs, default, 6, 0, PROFILE).attainment >= 0.99
    assert sim_probe(reqs, "least_requests", 6, 0, PROFILE).attainment < 0.95


def test_jittered_arrivals_keep_the_requests_and_their_order_by_arrival():
    from bench.peers_sched_virtual import jittered

    reqs = trace_window(0, 50)
    assert jittered(reqs, 0.05, 0) == reqs
    moved = jittered(reqs, 0.05, 3)
    assert sorted(r.request_id for r in moved) == sorted(r.request_id for r in reqs)
    assert moved != reqs and all(0.0 <= a.arrival <= b.arrival for a, b in zip(moved, moved[1:], strict=False))
    assert max(abs(m.arrival - r.arrival) for m in moved for r in reqs if r.request_id == m.request_id) < 0.5


def test_the_chat_window_holds_every_turn_in_it_and_each_turn_replays_the_previous_one_as_its_prefix():
    """--trace chat: a conversation's turn k+1 prompt starts with turn k's prompt (every full block of it, token for
    token once built as text), and a window from request 200 on holds every turn arriving in it, not only the turns
    of conversations generated so far."""
    from bench.peers_sched import chat_window
    from bench.prefix import conversation_workload

    reqs = chat_window(200, 300, 2.0)
    assert len(reqs) == 300 and reqs[0].arrival == 0.0
    assert all(r.slo_ttft_s and r.slo_tpot_s == 0.1 for r in reqs)
    full = conversation_workload(2.0, 600.0, 1)   # every conversation of that seed that starts in 10 minutes
    t0 = full[200].arrival
    assert [r.request_id for r in reqs] == [r.request_id for r in full[200:500]]
    assert [round(r.arrival, 9) for r in reqs] == [round(r.arrival - t0, 9) for r in full[200:500]]
    turns = {r.request_id: r for r in reqs}
    pairs = [(turns[before], r) for r in reqs for c, k in [r.request_id.rsplit("-t", 1)]
             for before in [f"{c}-t{int(k) - 1}"] if before in turns]
    assert len(pairs) > 20
    cache: dict[int, str] = {}
    for prev, nxt in pairs[:5]:
        assert nxt.prompt_tokens > prev.prompt_tokens
        full_blocks = prev.prompt_tokens // BLOCK_SIZE
        assert nxt.prefix_blocks[:full_blocks] == prev.prefix_blocks[:full_blocks]
        n = full_blocks * BLOCK_SIZE
        assert encode(prompt_text(nxt, cache))[:n] == encode(prompt_text(prev, cache))[:n]


def test_without_ids_the_chat_turns_are_matched_to_their_own_previous_turns_in_virtual_time():
    """bench/peers_sched_infer.py's ids-removed arm on a short chat window: no turn is matched to another
    conversation's turn, and every turn whose previous turn ran in the window is matched to it, but for a first turn
    that ended on a shared system prompt's last block (a message shorter than a block): the first other conversation
    to extend that head is glued to it once, which shows the head is shared, and the real next turn then finds
    nothing. So at most one glue and one miss per system prompt (8)."""
    from bench.peers_sched import chat_window
    from bench.peers_sched_infer import ARMS, INFER, Runner, previous_turns
    from bench.peers_sched_virtual import Window

    w = Window("chat", 0, chat_window(0, 240, 2.0))
    truth = previous_turns(w.reqs)
    assert truth and all(v.split("-t")[0] == k.split("-t")[0] for k, v in truth.items())
    run = Runner()
    arm = next(a for a in ARMS if a.label == INFER)
    cost = run(w, arm, 2)
    m = run.matches[("chat", 2)]
    assert cost.refused == 0 and m.wrong == 0 and m.right + m.none == len(truth) and m.none <= 8
    assert m.others == len(w.reqs) - len(truth) and m.glued <= 8 and m.right >= 80
