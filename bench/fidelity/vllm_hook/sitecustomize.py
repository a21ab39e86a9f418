"""A step trace for vLLM (a bench diagnostic, not used by the gateway): on the vLLM server's PYTHONPATH with
FLEETGATE_STEP_TRACE=<dir>, every scheduler step of the engine is appended to <dir>/steps-<pid>.jsonl.

One JSON object per step: t0 (wall clock when schedule() began), t_sched (its duration), t_upd_start (when
update_from_output began: the forward pass and sampling lie between), t_upd (its duration), and the batch:
dec (sequences decoding), ctx (their summed context before the step), ctx_max (the longest), pre_n / pre_tok
(prompts prefilling and their tokens this step), pairs (causal attention pairs of those prefill chunks), run /
wait (the scheduler's running and waiting queues), tot (tokens scheduled), new / fin (requests the model runner
adds to its batch in this step, and finished ones it drops from it: the batch's churn).
bench/fidelity/step_trace.py reads it and sets every step beside a simulator profile's step time for the same batch.

It wraps vllm.v1.core.sched.scheduler.Scheduler.schedule and update_from_output (vLLM 0.32) when that module is
first imported; with FLEETGATE_STEP_TRACE unset it does nothing. The wrappers only read the scheduler's state.
"""

import atexit
import gc
import importlib.abc
import importlib.util
import json
import os
import sys
import time

OUT = os.environ.get("FLEETGATE_STEP_TRACE")
TARGET = "vllm.v1.core.sched.scheduler"


def _patch(module) -> None:  # noqa: ANN001
    scheduler = module.Scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output
    state = {"file": None, "pending": None}

    def out():  # noqa: ANN202
        if state["file"] is None:
            state["file"] = open(os.path.join(OUT, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
        return state["file"]

    def traced_schedule(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.time()
        result = schedule(self, *args, **kwargs)
        t1 = time.time()
        dec = ctx = ctx_max = pre_n = pre_tok = 0
        pairs = 0.0
        for rid, n in result.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            before = req.num_computed_tokens - n      # schedule() has already advanced it by n
            if before >= req.num_prompt_tokens:
                dec += 1
                ctx += before
                ctx_max = max(ctx_max, before)
            else:
                pre_n += 1
                pre_tok += n
                pairs += n * before + n * n / 2
        state["pending"] = {"t0": t0, "t_sched": t1 - t0, "dec": dec, "ctx": ctx, "ctx_max": ctx_max,
                            "pre_n": pre_n, "pre_tok": pre_tok, "pairs": pairs, "run": len(self.running),
                            "wait": len(self.waiting),
                            "tot": result.total_num_scheduled_tokens, "new": len(result.scheduled_new_reqs),
                            "fin": len(result.finished_req_ids)}
        return result

    def traced_update(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        t2 = time.time()
        result = update(self, *args, **kwargs)
        step = state["pending"]
        if step is not None and step["tot"] > 0:
            step["t_upd_start"], step["t_upd"] = t2, time.time() - t2
            out().write(json.dumps(step) + "\n")
        state["pending"] = None
        return result

    scheduler.schedule, scheduler.update_from_output = traced_schedule, traced_update


def _time_gc() -> None:
    """Append every garbage collection of this process to OUT/gc-<pid>.jsonl (start, duration, generation)."""
    pending: list[str] = []
    state = {"start": 0.0, "flushed": time.time(), "file": None}

    def flush(now: float) -> None:
        if state["file"] is None:
            state["file"] = open(os.path.join(OUT, f"gc-{os.getpid()}.jsonl"), "a")  # noqa: SIM115
        with open("/proc/self/comm") as comm:   # vLLM names its processes after startup
            name = comm.read().strip()
        proc = {"pid": os.getpid(), "comm": name, "cpus": sorted(os.sched_getaffinity(0)),
                "frozen": gc.get_freeze_count()}
        state["file"].write(json.dumps(proc) + "\n" + "".join(pending))
        state["file"].flush()
        pending.clear()
        state["flushed"] = now

    def on_gc(phase: str, info: dict) -> None:
        now = time.time()
        if phase == "start":
            state["start"] = now
            return
        pending.append(f'{{"t":{state["start"]:.6f},"d":{now - state["start"]:.6f},'
                       f'"g":{info.get("generation", -1)},"n":{info.get("collected", 0)}}}\n')
        if now - state["flushed"] > 1.0:
            flush(now)

    gc.callbacks.append(on_gc)
    atexit.register(lambda: flush(time.time()) if pending else None)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:  # noqa: ANN001
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if OUT:
    sys.meta_path.insert(0, _PatchOnImport())
    _time_gc()
