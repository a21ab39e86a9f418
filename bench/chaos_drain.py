"""Run the drain and slow-fleet chaos scenarios (tests_chaos/test_drain.py: SIGTERM with streams in flight, a
stream cut at the drain timeout, a rolling restart of two replicas; tests_chaos/test_slow_fleet.py: a fleet
slowed 300x after a normal start, 100x, a burst at 10x) and write their section of bench/results/chaos.md
("Drain, rolling restart and a slow fleet"), with the figures from before the drain and the fleet-relative stall rule beside them; the other
sections are kept.

    python -m bench.chaos_drain [--hogs 2]

`--hogs N` runs the scenarios while N CPU-bound processes (`nice -n 10`) load the cores, as the issue's "done
when" asks; the section says so.
"""

from __future__ import annotations

import argparse
import os

from bench.chaos_state import RESULTS, pytest_under_hogs, read_runs, section_head, write_section
from bench.report import git_commit

RUN = RESULTS / "chaos_drain.jsonl"
TITLE = "## Drain, rolling restart and a slow fleet"
TESTS = ("tests_chaos/test_drain.py", "tests_chaos/test_slow_fleet.py")
# scenario -> (what was done, what must hold, what was measured, before): templates over the scenario's figures
ROWS = {
    "sigterm_drain": (
        "SIGTERM to `fleetgate serve` with {streams} streams of 10-20 s in flight (2 workers, "
        "`server.drain_timeout_s: 120`)",
        "every stream completes with `[DONE]`; `/ready` 503 at once, `/health` 200, a new request 503 with "
        "`Retry-After`; exit 0",
        "{failed} failed of {streams}; the last stream done {last_done_after_sigterm_s} s after SIGTERM, exit "
        "{exit_code} at {exit_after_sigterm_s} s; while draining `/ready` {ready_while_draining}, `/health` "
        "{health_while_draining}, a new request {late_request} (Retry-After {retry_after})",
        "50 of 50 streams cut 5 s after SIGTERM (uvicorn's `timeout_graceful_shutdown=5`), bodies truncated: no "
        "`[DONE]`, no error event, no access-log line"),
    "drain_timeout_cut": (
        "SIGTERM with a 4,000-token stream in flight, `server.drain_timeout_s: {drain_timeout_s}`",
        "the stream ends with an error event and `[DONE]`, one access-log line; exit 0",
        "ended {ended_after_sigterm_s} s after SIGTERM with error code `{error_code}` then `[DONE]`; "
        "{access_log_lines} access-log line (status 503); exit {exit_code}",
        "cut at 5 s, truncated, no access-log line"),
    "rolling_restart": (
        "rolling restart of {replicas} replicas sharing Redis (SIGTERM, wait for exit, start again on the same "
        "port; one, then the other) under 8 clients of short streams that retry on connection refused or 503",
        "0 failed", "{failed} failed of {requests}",
        "an outside probe: 37 failed of 240; this test on the code before: the first replica exited by its SIGTERM (code -15), not 0"),
    "fleet_slowed_300x": (
        "2 workers slowed 300x (`/sim/faults {{\"slowdown\": 300}}`) for ~{slowed_for_s} s after a normal start, "
        "{streams} streams of 200 tokens (12 under way, 4 arriving into the slowdown)",
        "every stream completes, 0 error events",
        "{failed} failed, {ended_with_error} error events; {resumed} moved to the other worker; longest wait "
        "between two chunks at a client {worst_client_gap_s} s",
        "an outside probe: both workers 250x slower, 7 of 8 streams ended in errors; this test on the code before: 16 of 16"),
    "fleet_slowed_100x": (
        "2 workers 100x slower from the start (time_scale {time_scale}), {streams} streams of {max_tokens} tokens "
        "at once", "0 failed", "{failed} failed, {ended_with_error} error events; {took_s} s",
        "an outside probe: 3,000 streams, 3,000 errors; this test on the code before: 17 of 24 failed"),
    "fleet_slowed_10x": (
        "2 workers 10x slower from the start (time_scale {time_scale}), a burst of {streams} streams of "
        "{max_tokens} tokens with {prompt_tokens}-token prompts", "0 failed",
        "{failed} failed, {ended_with_error} error events; {took_s} s",
        "an outside probe: a burst of 3,000, 2,998 \"worker stalled mid-stream\"; this test on the code before: 200 of 200 "
        "failed"),
}


def section(runs: dict[str, dict], commit: str, passed: bool, load: str) -> str:
    out = section_head(TITLE, f"`python -m bench.chaos_drain{load and ' --hogs 2'}` (pytest {' '.join(TESTS)})",
                       commit, passed)
    out.insert(6, f"- load: {load or 'none added (other test suites may share the host)'}")   # after the date
    for key, (scenario, must, measured, before) in ROWS.items():
        r = runs.get(key)
        if r:
            out.append(f"| {scenario.format(**r)} | {must} | {measured.format(**r)} (before: {before}) |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=0, help="CPU-bound processes loading the cores meanwhile")
    args = ap.parse_args()
    RUN.unlink(missing_ok=True)
    commit = git_commit()
    (code,), load = pytest_under_hogs(args.hogs, [(TESTS, {**os.environ, "FLEETGATE_CHAOS_RESULTS": str(RUN)})])
    runs = read_runs(RUN)
    write_section(section(runs, commit, code == 0, load), TITLE)
    print(f"wrote the section {TITLE!r} of bench/results/chaos.md ({len(runs)} scenario(s))")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
