"""Run the worker chaos scenarios (tests_chaos/test_workers.py: `kill -9` of one of 4 workers under 200 streams,
`SIGSTOP` of one of 4 under streams and non-streaming requests; tests_chaos/test_pd_workers.py: `kill -9` and
`SIGSTOP` of a P/D decode and prefill worker, a zombie worker) and write their section of
bench/results/chaos.md ("Workers killed and frozen"); the other sections are kept.

    python -m bench.chaos_workers
"""

from __future__ import annotations

import os
import subprocess
import sys

from bench.chaos_state import RESULTS, ROOT, read_runs, section_head, write_section
from bench.report import git_commit

RUN = RESULTS / "chaos_workers.jsonl"
TITLE = "## Workers killed and frozen"
TESTS = ("tests_chaos/test_workers.py", "tests_chaos/test_pd_workers.py")
_PD = ("P/D, 2 prefill + 2 decode workers (a process each): {what} under {{streams}} streams of 300 tokens with "
       "~1,000-token prompts arriving 0.1 s apart")
_PD_MEASURED = ("{failed} failed; {resumed} streams resumed on the other decode worker; {prefill_retries} prefill legs "
                "placed again; slowest stream {slowest_stream_s} s; the last done {last_done_after_fault_s} s after the "
                "fault")
# scenario -> (what was done, what must hold, what was measured): templates over the scenario's figures
ROWS = {
    **{key: (_PD.format(what=what), "0 client-visible failures, no fixed 60 s wait", _PD_MEASURED)
       for key, what in (("pd_d_sigkill", "`kill -9` of a decode worker"), ("pd_d_sigstop", "`SIGSTOP` of a decode worker"),
                         ("pd_p_sigkill", "`kill -9` of a prefill worker"),
                         ("pd_p_sigstop", "`SIGSTOP` of a prefill worker"))},
    "zombie_worker": ("a zombie (`hang`: takes requests, never answers, /health 200) among 3 workers, {streams} streams "
                      "0.25 s apart", "0 failed; out of rotation while it hangs; back only after a probe generation",
                      "{failed} failed; slowest stream {slowest_stream_s} s; back in rotation "
                      "{back_after_fault_cleared_s} s after the fault was cleared"),
}


def section(runs: dict[str, dict], commit: str, passed: bool) -> str:
    out = section_head(TITLE, f"`python -m bench.chaos_workers` (pytest {' '.join(TESTS)})", commit, passed)
    r = runs.get("worker_kill_9")
    if r:
        out.append(f"| `kill -9` of one of 4 workers (`fleetgate sim --workers 1` each) under {r['streams']} "
                   f"concurrent streams of 300 tokens | 0 client-visible failures, 0 error events, every stream's "
                   f"text continuous | {r['failed']} failed; {r['on_killed_worker']} streams on the killed worker, "
                   f"{r['resumed']} resumed elsewhere, {r['ended']} ended with an error event; every text continuous "
                   f"and complete with one usage chunk; longest wait between two chunks at a client {r['worst_client_gap_s']} s"
                   f" (the host's 2 cores shared) |")
    r = runs.get("worker_sigstop")
    if r:
        out.append(f"| `SIGSTOP` of one of 4 workers under {r['streams']} streams and {r['non_streaming']} "
                   f"non-streaming requests | its requests finish elsewhere within 5 s of the stall | {r['failed']} "
                   f"failed; {r['resumed']} streams resumed; longest wait between two chunks "
                   f"{r['worst_client_gap_s']} s; slowest non-streaming answer {r['worst_non_streaming_s']} s "
                   f"(normally {r['normal_non_streaming_s']} s); the last stream done {r['last_done_after_stop_s']} s "
                   "after the stop; back in rotation after SIGCONT |")
    for key, (scenario, must, measured) in ROWS.items():
        r = runs.get(key)
        if r:
            out.append(f"| {scenario.format(**r)} | {must} | {measured.format(**r)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    RUN.unlink(missing_ok=True)
    commit = git_commit()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                           env={**os.environ, "FLEETGATE_CHAOS_RESULTS": str(RUN)})
    runs = read_runs(RUN)
    write_section(section(runs, commit, code == 0), TITLE)
    print(f"wrote the section {TITLE!r} of bench/results/chaos.md ({len(runs)} scenario(s))")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
