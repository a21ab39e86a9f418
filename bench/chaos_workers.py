"""Run the worker chaos scenarios (tests_chaos/test_workers.py: `kill -9` of one of 4 workers under 200 streams,
`SIGSTOP` of one of 4 under streams and non-streaming requests) and write their section of
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
TEST = "tests_chaos/test_workers.py"


def section(runs: dict[str, dict], commit: str, passed: bool) -> str:
    out = section_head(TITLE, f"`python -m bench.chaos_workers` (pytest {TEST})", commit, passed)
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
    return "\n".join(out) + "\n"


def main() -> None:
    RUN.unlink(missing_ok=True)
    commit = git_commit()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST], cwd=ROOT,
                           env={**os.environ, "FLEETGATE_CHAOS_RESULTS": str(RUN)})
    runs = read_runs(RUN)
    write_section(section(runs, commit, code == 0), TITLE)
    print(f"wrote the section {TITLE!r} of bench/results/chaos.md ({len(runs)} scenario(s))")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
