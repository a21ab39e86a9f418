"""Read a vLLM step trace (bench/fidelity/vllm_hook) and set every step beside a simulator profile's step time.

    .venv/bin/python -m bench.fidelity.step_trace <trace dir> [--profile simulator/profiles/tiny-cpu.yaml]

`hook_env(dir)` is the environment that makes a vLLM server record the trace: the hook directory on its
PYTHONPATH (its sitecustomize.py wraps the scheduler when vLLM imports it) and the output directory.

A step's period is from its schedule() to the next one's (forward pass, sampling, output processing and the
engine loop in between), what the profile's step time stands for. Where the engine went idle after a step (the
next schedule() came more than IDLE_TAIL_S after update_from_output ended; usually 0.1-0.3 ms), the step counts
until its update ended, so light load's waits for the next request are not read as step time. Steps split into
decode-only (no prompt tokens) and mixed (prefill chunks with or without decodes); for each kind the ratio
measured / modelled, summed over steps. A ratio that moves between runs alike for both kinds is the host's
speed; a ratio that differs between the kinds is the model's shape. With the hook's garbage-collection log
(gc-<pid>.jsonl), the share of the busy steps' time the processes on the engine's cores spent collecting.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from simulator.profiles import Profile, load_profile

HOOK_DIR = Path(__file__).resolve().parent / "vllm_hook"
IDLE_GAP_S = 0.5   # a longer period than this holds an idle engine, not a step
IDLE_TAIL_S = 0.002   # from update_from_output's end to the next schedule(): longer holds an idle wait


def hook_env(out_dir: Path) -> dict[str, str]:
    """Environment for a vLLM server (scripts/vllm_servers.py ServerSpec.env) whose engine logs every step to
    `out_dir`."""
    return {"PYTHONPATH": str(HOOK_DIR), "FLEETGATE_STEP_TRACE": str(out_dir)}


@dataclass(slots=True, frozen=True)
class Step:
    t0: float           # wall clock when schedule() began
    period_s: float     # to the next step's schedule() (0 for the last one of a trace), idle tail cut
    dec: int            # sequences decoding
    ctx: int            # their summed context before the step
    pre_n: int          # prompts prefilling this step
    pre_tok: int        # their tokens this step
    pairs: float        # causal attention pairs of those chunks

    def modelled_s(self, profile: Profile) -> float:
        """The profile's step time for this batch (simulator/profiles.py Profile.step_time), speed factor 1."""
        return profile.step_time(self.pre_tok, self.dec, self.ctx, self.pairs, admitted=self.pre_n)


def load_steps(trace_dir: Path) -> list[Step]:
    """Every step of every engine process that wrote to `trace_dir`, in time order, with its period."""
    raw = sorted((json.loads(line) for f in sorted(trace_dir.glob("steps-*.jsonl"))
                  for line in f.read_text().splitlines() if line),
                 key=lambda s: s["t0"])
    return [Step(s["t0"], _period(s, nxt), s["dec"], s["ctx"], s["pre_n"], s["pre_tok"], s["pairs"])
            for s, nxt in zip(raw, [*raw[1:], None], strict=True)]


def _period(step: dict, nxt: dict | None) -> float:
    if nxt is None:
        return 0.0
    period = nxt["t0"] - step["t0"]
    if "t_upd_start" in step:
        end = step["t_upd_start"] + step["t_upd"] - step["t0"]
        if period - end > IDLE_TAIL_S:
            return end
    return period


def load_gc(trace_dir: Path) -> list[tuple[float, float]]:
    """(start, duration) of every garbage collection, in time order, of the processes that run on the engine's
    cores: the EngineCore (which writes steps-<pid>.jsonl), its Worker, any helper pinned there; not the API
    server, which the bench moves to the host's cores. Each gc-<pid>.jsonl's last process line says where it
    ran."""
    engine = {f.stem.split("-", 1)[1] for f in trace_dir.glob("steps-*.jsonl")}
    procs: dict[str, tuple[set[int], list[tuple[float, float]]]] = {}
    for f in trace_dir.glob("gc-*.jsonl"):
        cpus: set[int] = set()
        pauses: list[tuple[float, float]] = []
        for line in f.read_text().splitlines():
            rec = json.loads(line) if line else {}
            if "cpus" in rec:
                cpus = set(rec["cpus"])
            elif "t" in rec:
                pauses.append((rec["t"], rec["d"]))
        procs[f.stem.split("-", 1)[1]] = (cpus, pauses)
    cores = set().union(*(procs[pid][0] for pid in engine if pid in procs))
    return sorted(p for cpus, pauses in procs.values() if cpus and cpus <= cores for p in pauses)


@dataclass(slots=True)
class StepRatios:
    decode_steps: int
    decode_ratio: float     # sum measured / sum modelled over decode-only steps (nan if none)
    mixed_steps: int
    mixed_ratio: float
    gc_share: float = float("nan")   # garbage collection on the engine's cores / the busy steps' time (nan: no log)
    all_ratio: float = float("nan")  # both kinds together: the engine's speed in those minutes against the profile


def step_ratios(steps: Sequence[Step], profile: Profile,
                windows: Sequence[tuple[float, float]] = ((float("-inf"), float("inf")),),
                gc: Sequence[tuple[float, float]] = ()) -> StepRatios:
    """Measured over modelled step time for the steps that began inside any of `windows` ([t0, t1] wall clock),
    idle gaps left out; `gc` (load_gc) gives the share of those steps' time spent in garbage collection."""
    busy = [s for s in steps if 0.0 < s.period_s < IDLE_GAP_S and any(a <= s.t0 <= b for a, b in windows)]

    def ratio(kind: list[Step]) -> float:
        model = sum(s.modelled_s(profile) for s in kind)
        return sum(s.period_s for s in kind) / model if model > 0 else float("nan")

    decode = [s for s in busy if s.pre_tok == 0 and s.dec > 0]
    mixed = [s for s in busy if s.pre_tok > 0]
    share = float("nan")
    if gc and busy:
        starts = [t for t, _ in gc]
        collecting = sum(gc[i][1] for s in busy for i in range(bisect.bisect_left(starts, s.t0),
                                                               bisect.bisect_left(starts, s.t0 + s.period_s)))
        share = collecting / sum(s.period_s for s in busy)
    return StepRatios(len(decode), ratio(decode), len(mixed), ratio(mixed), share, ratio(decode + mixed))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--profile", default="tiny-cpu", help="a profile name or YAML path (simulator.profiles)")
    args = ap.parse_args(argv)
    steps = load_steps(args.trace_dir)
    r = step_ratios(steps, load_profile(args.profile), gc=load_gc(args.trace_dir))
    print(f"{len(steps)} steps; decode-only {r.decode_steps} at {r.decode_ratio:.2f}x the profile, "
          f"mixed {r.mixed_steps} at {r.mixed_ratio:.2f}x, all at {r.all_ratio:.2f}x; "
          f"garbage collection {100 * r.gc_share:.1f} % of them")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
