"""Run the 10x-overload chaos scenario (tests_chaos/test_overload.py: no caps, real processes) with the admission
rule that sheds what will miss and, for the figures beside them, without it (`limits.shed_will_miss: false`, the
admission before the rule; that run fails its assertions, as the code before did), and write their section of
bench/results/chaos.md ("Overload without caps: admission sheds what will miss"); the other sections are kept.

    python -m bench.chaos_overload [--hogs 2]

`--hogs N` runs both while N CPU-bound processes (`nice -n 10`) load the cores, as the issue's "done when" asks.
"""

from __future__ import annotations

import argparse
import os

from bench.chaos_state import RESULTS, pytest_under_hogs, read_runs, section_head, write_section
from bench.report import git_commit

RUN = RESULTS / "chaos_overload.jsonl"
TITLE = "## Overload without caps: admission sheds what will miss"
TEST = "tests_chaos/test_overload.py"
OLD_PROBE = ("an outside probe: 200 clients against 2 workers slowed 5x (`POST /sim/faults {\"slowdown\": 5}`), no "
             "caps: 987 of 987 admitted, SLO attainment 6%, aladdin 3.8%")


def row(r: dict, before: dict | None) -> str:
    scenario = (f"2 workers (tiny-cpu profile at time scale 0.1), no `cap`, the default policy; SLO 2500 ms TTFT, 200 ms "
                f"TPOT; streamed chats of 128 tokens, Poisson at {r['offered_rps']:g} req/s for {r['duration_s']:g} s "
                f"(~10x what the fleet serves within the SLO)")
    must = ">= 99% of admitted requests meet TTFT and TPOT (the gateway's judgement); every 429 has `Retry-After`; no " \
           "5xx; gateway RSS growth < 100 MB"
    measured = (f"{r['slo_met_admitted']} of {r['admitted']} admitted met their SLO "
                f"({r['attainment_admitted']:.1%}), {r['refused_429']} of {r['sent']} refused with 429 "
                f"(`Retry-After` {', '.join(r['retry_after_values'])} s seen), goodput {r['goodput_rps']} req/s, "
                f"{len(r.get('errors', []))} failed, RSS +{r['rss_growth_mb']} MB, {r['took_s']} s")
    old = OLD_PROBE
    if before:
        old += (f"; this test without the rule (`limits.shed_will_miss: false`): {before['slo_met_admitted']} of "
                f"{before['admitted']} admitted met their SLO, {before['refused_429']} refused, goodput "
                f"{before['goodput_rps']} req/s, RSS +{before['rss_growth_mb']} MB, {before['took_s']} s")
    return f"| {scenario} | {must} | {measured} (before: {old}) |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=0, help="CPU-bound processes loading the cores meanwhile")
    args = ap.parse_args()
    RUN.unlink(missing_ok=True)
    commit = git_commit()
    env = {**os.environ, "FLEETGATE_CHAOS_RESULTS": str(RUN)}
    (code, _), load = pytest_under_hogs(args.hogs, [([TEST], env), ([TEST], {**env, "FLEETGATE_OVERLOAD_SHED": "0"})])
    runs = read_runs(RUN)
    flag = f" --hogs {args.hogs}" if args.hogs else ""
    out = section_head(TITLE, f"`python -m bench.chaos_overload{flag}` "
                              f"(pytest {TEST}, then with FLEETGATE_OVERLOAD_SHED=0)", commit, code == 0)
    out.insert(6, "- load: " + (load or "none added (other test suites may share the host)"))
    if "overload_10x_no_caps" in runs:
        out.append(row(runs["overload_10x_no_caps"], runs.get("overload_10x_no_caps_no_rule")))
    write_section("\n".join(out) + "\n", TITLE)
    print(f"wrote the section {TITLE!r} of bench/results/chaos.md ({len(runs)} scenario(s))")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
