"""Run the state-store, gateway and client chaos scenarios at full size and write their section of
bench/results/chaos.md ("State store, gateway, clients, tenants"), with the 30-minute soak's figures
(bench/soak.py's JSON) when it has run.

    python -m bench.chaos_state                 # 10,000 fuzzed requests, a 30 s freeze, a 90 s rate drive
    python -m bench.chaos_state --report-only   # rewrite the section from the last run's JSON lines

Other sections of chaos.md (other scenarios) are kept as they are; this one is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.report import git_commit, machine_info

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUN = RESULTS / "chaos_state.jsonl"
SOAK = RESULTS / "soak_tenants.json"
CHAOS_MD = RESULTS / "chaos.md"
TITLE = "## State store, gateway, clients, tenants"
COMMAND = "python -m bench.chaos_state"
TESTS = ["tests_chaos/test_state_faults.py", "tests_chaos/test_clients.py"]


def run_scenarios() -> int:
    RUN.unlink(missing_ok=True)
    env = {**os.environ, "FLEETGATE_CHAOS_RESULTS": str(RUN), "FLEETGATE_CHAOS_FUZZ_N": "10000",
           "FLEETGATE_CHAOS_RATE_S": "90", "FLEETGATE_CHAOS_FREEZE_S": "30"}
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                           env=env)


def pytest_under_hogs(hogs: int, runs: list[tuple[list[str], dict[str, str]]]) -> tuple[list[int], str]:
    """Each (pytest arguments, environment) run in turn while `hogs` CPU-bound processes (`nice -n 10`) load the
    cores; their exit codes and the results' load line ("" without hogs)."""
    procs = [subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while 1: pass"]) for _ in range(hogs)]
    try:
        codes = [subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                                 env=env) for args, env in runs]
        load1 = os.getloadavg()[0]
    finally:
        for h in procs:
            h.kill()
            h.wait()
    load = (f"{hogs} CPU-bound processes (`nice -n 10 python -c 'while 1: pass'`) on {os.cpu_count()} cores; "
            f"load average {load1:.1f} at the end") if hogs else ""
    return codes, load


def section_head(title: str, command: str, commit: str, passed: bool) -> list[str]:
    """A chaos.md section's title, run facts and the head of its scenario table."""
    return [title, "", f"- command: {command}", f"- commit: `{commit}`", f"- machine: {machine_info()}",
            f"- date: {soak_date()}", f"- all scenarios passed: {passed}", "",
            "| scenario | must hold | measured |", "|---|---|---|"]


def read_runs(path: Path) -> dict[str, dict]:
    """The scenarios' figures from a FLEETGATE_CHAOS_RESULTS file, by scenario (the last run of each)."""
    runs = {}
    if path.exists():
        for line in path.read_text().splitlines():
            d = json.loads(line)
            runs[d["scenario"]] = d
    return runs


def section(runs: dict[str, dict], soak: dict | None, commit: str, passed: bool) -> str:
    out = section_head(TITLE, f"`{COMMAND}` (pytest {' '.join(TESTS)} at full size)", commit, passed)
    r = runs.get("redis_restarted_empty")
    if r:
        out.append(f"| Redis SIGKILLed, a new empty one on the same port after {r['restart_s']} s, 8 streaming "
                   f"clients | 0 failed requests, fleet intact, reservations rebuilt | {r['requests_failed']} failed "
                   f"of {r['requests_ok'] + r['requests_failed']}; {r['workers_after']}/2 workers healthy; workers, "
                   f"epoch and {r['reservations_rebuilt']} reservations back in Redis {r['rebuilt_s']} s after the "
                   f"kill; {r['log_lines']} warning lines, 0 tracebacks |")
    r = runs.get("redis_frozen")
    if r:
        out.append(f"| Redis frozen {r['freeze_s']:g} s (SIGSTOP), 8 streaming clients | 0 failed requests, fleet "
                   f"intact, bounded log lines | {r['requests_failed']} failed of {r['requests_ok'] + r['requests_failed']}"
                   f" ({r['served_while_frozen']} served while frozen); {r['workers_after']}/2 workers healthy; "
                   f"{r['log_lines']} warning lines, {r['tracebacks']} tracebacks |")
    r = runs.get("gateway_sigkill_batch")
    if r:
        out.append(f"| gateway SIGKILLed with a {r['lines']}-line batch in flight ({r['done_at_kill']} done), "
                   f"restarted | 0 lost, 0 duplicated lines, resumed within 15 s | {r['lost']} lost, "
                   f"{r['duplicated']} duplicated, {r['output_lines']} output lines; new gateway up "
                   f"{r['gateway_up_s']} s after the kill, batch moving again at {r['resumed_after_kill_s']} s |")
    r = runs.get("fuzz")
    if r:
        st = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
        out.append(f"| {r['requests']:,} fuzzed requests (bad JSON, wrong types, fields up to 3 MB, odd headers, "
                   f"other paths and methods), 16 at a time | 0 5xx, 0 hangs, RSS back within 10% | "
                   f"{r['server_errors']} 5xx, {r['hangs']} hangs (slowest {r['slowest_s']} s), {st}; "
                   f"{r['closed_by_gateway']} closed at the parser; RSS {r['rss_before_mb']} -> {r['rss_after_mb']} MB"
                   f" ({r['rss_change_pct']:+} %; fresh process {r['rss_fresh_mb']} MB); {r['cpu_s']} CPU s |")
    r = runs.get("rate_limit_two_replicas")
    if r:
        alone = (f"; the same drive against two replicas without Redis (a bucket each): {r['alone_admitted']} "
                 f"admitted, {r['alone_overshoot_pct']:+} %" if "alone_admitted" in r else "")
        out.append(f"| one key, rpm {r['rpm']}, driven at {r['drive_rps']:g}/s (3x) for {r['seconds']:g} s through "
                   f"two replicas sharing Redis | overshoot <= 5% | {r['admitted']} admitted of {r['sent']} "
                   f"(the bucket allows {r['allowed']:g}: full {r['rpm']} + {r['rpm'] / 60:g}/s), "
                   f"{r['overshoot_pct']:+} %; last 10 s {r['steady_rps']}/s; {r['other']} other statuses{alone} |")
    out += ["", "Overshoot is measured against what a token bucket of the key's limit allows (it starts full: "
            "capacity rpm, refilled at rpm/60 per second; OpenAI's x-ratelimit-reset semantics), so a window that "
            "starts with a full bucket admits up to 2x rpm in its first minute by design."]
    if soak:
        b, lim = soak["batches"], soak["limited_key"]
        rss = "; ".join(f"{s['t_min']} min {s['rss_mb'][0]}/{s['rss_mb'][1]} MB" for s in soak["samples"][::6])
        out += ["", "### 30-minute soak", "", f"- command: `{soak['command']}`", f"- commit: `{soak['commit']}`",
                f"- machine: {soak['machine']}", f"- date: {soak['date']}", "",
                "| what | measured |", "|---|---|",
                f"| duration | {soak['minutes']} min; two replicas, one Redis, four `fleetgate sim --workers 1` |",
                f"| streams (6 closed-loop clients, unlimited key) | {soak['streams_ok']:,} ok, "
                f"{soak['streams_failed']} failed; p50 {soak['stream_p50_s']} s, p99 {soak['stream_p99_s']} s |",
                f"| limited key (300/min, 4 in flight), 8/s sent | {lim['200']:,} admitted ({soak['limited_rps']}/s), "
                f"{lim['429']:,} refused with 429, {lim['other']} other |",
                f"| batches (50 lines each, one a minute) | {b['created']} created, {b['completed']} completed, "
                f"{b['lines']:,} lines, {b['lost']} lost, {b['duplicated']} duplicated |",
                f"| RSS per replica over time | {rss}; end {soak['rss_mb_last'][0]}/{soak['rss_mb_last'][1]} MB |",
                f"| CPU per replica | {soak['cpu_s_total'][0]} / {soak['cpu_s_total'][1]} s over the run |",
                f"| gateway log | {soak['gateway_warnings']} warning/error lines, {soak['gateway_tracebacks']} "
                "tracebacks |",
                f"| failed streams, kinds (first {len(soak['failures'])} recorded) | {failure_kinds(soak['failures'])} |"]
    return "\n".join(out) + "\n"


def failure_kinds(failures: list[str]) -> str:
    kinds: dict[str, int] = {}
    for f in failures:
        k = "503 no_healthy_worker" if "no_healthy_worker" in f else f.split(":")[0].split(" b'")[0]
        kinds[k] = kinds.get(k, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items(), key=lambda x: -x[1])) or "none"


def soak_date() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def write_section(text: str, title: str = TITLE) -> None:
    """Replace the section of chaos.md headed `title` (or add it at the end); the other sections stay."""
    old = CHAOS_MD.read_text() if CHAOS_MD.exists() else "# Chaos suite results\n\n"
    if title in old:
        start = old.index(title)
        nxt = old.find("\n## ", start + len(title))
        old = old[:start] + old[nxt + 1:] if nxt != -1 else old[:start]
    CHAOS_MD.write_text(old.rstrip("\n") + "\n\n" + text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--commit", help="with --report-only: the commit the scenarios ran at")
    args = ap.parse_args()
    commit = args.commit or git_commit()
    code = 0 if args.report_only else run_scenarios()
    runs = read_runs(RUN)
    soak = json.loads(SOAK.read_text()) if SOAK.exists() else None
    write_section(section(runs, soak, commit, code == 0))
    print(f"wrote the section of {CHAOS_MD} ({len(runs)} scenario(s), soak: {'yes' if soak else 'no'})")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
