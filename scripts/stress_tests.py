"""Run tests N times in a row while CPU-bound processes load the machine, and report how often each passed.

    .venv/bin/python scripts/stress_tests.py tests/test_sim_server.py::test_prefix_cache_hit_lowers_ttft
    .venv/bin/python scripts/stress_tests.py --runs 10 --load 2 -f scripts/timing_tests.txt   # make test-stress
    ... --record bench/results/stress.md     # also append the tally, with commit, machine and load, to a file

A test that asserts on wall time or on sample counts must pass every run here: two busy cores are what a shared
CI machine looks like. The load processes spin in pure Python (one core each) for as long as the runs take and are
stopped on exit, also on Ctrl-C or SIGTERM (both print the tally of the runs that finished). Prefix the whole
command with `nice` on a shared machine: the load processes and the tests then share the lower priority, so the
tests still compete with the load, not just with each other.
Exit status 0 when every test passed every run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True:\n    pass\n"


@dataclass
class Tally:
    """Outcomes of one test over the runs."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    messages: list[str] = field(default_factory=list)


def start_load(n: int) -> list[subprocess.Popen]:
    """`n` processes that each keep one core busy."""
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def node_id(case: ET.Element) -> str:
    """The pytest node id of a junit testcase (classname is the dotted module path, name the test)."""
    module = case.get("classname", "").replace(".", "/") + ".py"
    return f"{module}::{case.get('name', '')}"


def record(xml_path: Path, tallies: dict[str, Tally]) -> None:
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        t = tallies.setdefault(node_id(case), Tally())
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            t.failed += 1
            t.messages.append((bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else "")
        elif case.find("skipped") is not None:
            t.skipped += 1
        else:
            t.passed += 1


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def commit_of_tree() -> str:
    """The checked-out commit, marked when tracked files differ from it (the tests run from the work tree)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=False).stdout.strip()
    return commit + (" (with uncommitted changes)" if dirty else "")


def write_record(path: Path, runs: int, load: int, seconds: float, load_before: str, commit: str,
                 tallies: dict[str, Tally]) -> None:
    """Append this run's tally to `path` (markdown): command, commit, machine, load average before and after."""
    lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {runs} runs under {load} CPU-bound "
             f"processes, {seconds:.0f} s\n",
             f"- command: `{shlex.join(['python', *sys.argv])}`",
             f"- commit: {commit}",
             f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
             f"- load average (1, 5, 15 min) before: {load_before}; after: {load_average()}\n",
             "| passed | test | failures |", "|---|---|---|"]
    for name, t in sorted(tallies.items()):
        why = "; ".join(dict.fromkeys(m.replace("|", "/") for m in t.messages)) if t.failed else ""
        lines.append(f"| {t.passed}/{runs} | `{name}` | {why} |")
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write("# Timing tests under load\n\nEach section: scripts/stress_tests.py runs the listed tests N "
                    "times in a row while CPU-bound processes load the cores (make test-stress).\n")
        f.write("\n".join(lines) + "\n")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def read_tests(args: argparse.Namespace) -> list[str]:
    tests = list(args.tests)
    for f in args.file or []:
        tests += [line.split("#")[0].strip() for line in Path(f).read_text().splitlines()]
    return [t for t in tests if t]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="*", help="pytest node ids or files")
    ap.add_argument("-f", "--file", action="append", help="a file of node ids, one a line (# comments)")
    ap.add_argument("--runs", type=int, default=10, help="how many times to run the tests (default 10)")
    ap.add_argument("--load", type=int, default=2, help="CPU-bound load processes (default 2: both cores)")
    ap.add_argument("--pytest-arg", action="append", default=[], help="an extra pytest argument (repeatable)")
    ap.add_argument("--record", type=Path, help="append the tally (with commit, machine and load) to this file")
    args = ap.parse_args()
    tests = read_tests(args)
    if not tests:
        ap.error("name at least one test")
    tallies: dict[str, Tally] = {}
    # Ctrl-C or SIGTERM stops it with a tally of the runs that finished (a background job ignores SIGINT)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    load_before, commit = load_average(), commit_of_tree()
    load = start_load(args.load)
    started = time.monotonic()
    runs = 0
    try:
        with tempfile.TemporaryDirectory(prefix="fleetgate-stress-") as tmp:
            for run in range(1, args.runs + 1):
                xml = Path(tmp) / f"run{run}.xml"
                t0 = time.monotonic()
                subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                                *args.pytest_arg, *tests], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, check=False)
                before = {k: t.failed for k, t in tallies.items()}
                if xml.exists():
                    record(xml, tallies)
                runs = run
                new = [k for k, t in tallies.items() if t.failed > before.get(k, 0)]
                print(f"stress: run {run}/{args.runs} took {time.monotonic() - t0:.0f} s; failed this run: "
                      f"{', '.join(k + ' (' + tallies[k].messages[-1] + ')' for k in new) or 'none'}", flush=True)
    except KeyboardInterrupt:
        print("stress: interrupted; the tally covers the runs that finished", flush=True)
    finally:
        stop_load(load)
    print(f"\nstress: {runs} runs under {args.load} CPU-bound processes, {time.monotonic() - started:.0f} s")
    for name, t in sorted(tallies.items()):
        note = f"  skipped {t.skipped}" if t.skipped else ""
        print(f"{t.passed:3d}/{runs} passed  {name}{note}")
        for m in dict.fromkeys(t.messages):
            print(f"          failure: {m}")
    missing = [t for t in tests if "::" in t and t not in tallies and not any(k.startswith(t) for k in tallies)]
    for t in missing:
        print(f"  ?/{runs}  {t}: not collected (check the node id)")
    if args.record and runs:
        write_record(args.record, runs, args.load, time.monotonic() - started, load_before, commit, tallies)
    return 0 if runs == args.runs and tallies and not missing and all(
        t.failed == 0 and t.passed == args.runs for t in tallies.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
