"""The fault check of `fleetgate demo`: a worker that dies mid-stream and a zombie worker, with the simulator's own
fault endpoint, in a plain fleet and in a P/D fleet. Writes the section "Faults through the demo" of
bench/results/chaos.md (the other sections are kept).

    python -m bench.chaos_demo                   # both modes
    python -m bench.chaos_demo --mode pd --no-write

One worker gets `POST /sim/faults {"drop_after_tokens": 5}` (it dies mid-stream, every time), another
`{"hang": true}` (a zombie: takes generation requests, never answers, /health says 200). Then 24 streams with
4k-token prompts, started 0.25 s apart, each allowed 60 s from send to `[DONE]` with exactly `max_tokens` tokens
(the text continuous, the usage exact). Modes: `--workers 5` (faults on sim-1 and sim-2) and `--pd 2:3`
(faults on two of the three decode workers: decode-3 and decode-4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from bench.chaos_procs import free_port, poll_sync
from bench.chaos_state import ROOT, section_head, write_section
from bench.report import git_commit
from simulator.vllm_api import FILLER_WORDS

TITLE = "## Faults through the demo"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STREAMS = 24
PROMPT_TOKENS = 4096
MAX_TOKENS = 200
SPACING_S = 0.25
ALLOWED_S = 60.0
# The same script on the commit before the one leg runner (60c7d8a), 2026-11-28, this machine.
BEFORE = ("Before the one leg runner (commit `60c7d8a`, the same script): `--workers 5` 3/24 failed (not done "
          "within 60 s: a stream on the zombie waited the 60 s cold first-token limit), `--pd 2:3` 20/24 failed "
          "(error events `the worker stopped responding mid-stream`: P/D legs never resumed; the rest not done "
          "within 60 s).")
MODES = {"workers": (["--workers", "5"], 5, (1, 2)), "pd": (["--pd", "2:3"], 5, (3, 4))}


@dataclass
class Outcome:
    ok: bool
    took_s: float
    why: str = ""


def continuous(words: list[str]) -> bool:
    idx = [FILLER_WORDS.index(w) if w in FILLER_WORDS else -1 for w in words]
    return -1 not in idx and all(b == (a + 1) % len(FILLER_WORDS) for a, b in zip(idx, idx[1:], strict=False))


async def one_stream(http: httpx.AsyncClient, url: str, i: int) -> Outcome:
    prompt = (f"stream {i} " + "lorem ipsum dolor sit amet " * (PROMPT_TOKENS * 4 // 27))[:PROMPT_TOKENS * 4]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(ALLOWED_S):
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return Outcome(False, time.monotonic() - t0, f"status {r.status_code}")
                async for chunk in r.aiter_raw():
                    chunks.append(chunk)
    except TimeoutError:
        return Outcome(False, time.monotonic() - t0, f"not done within {ALLOWED_S:g} s")
    except httpx.HTTPError as e:
        return Outcome(False, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    took = time.monotonic() - t0
    events = [e for e in b"".join(chunks).split(b"\n\n") if e]
    if not events or events[-1] != b"data: [DONE]":
        return Outcome(False, took, "no [DONE]")
    objs = [json.loads(e[6:]) for e in events[:-1]]
    errs = [o["error"]["message"] for o in objs if "error" in o]
    if errs:
        return Outcome(False, took, f"error event: {errs[0]}")
    words = "".join(c["delta"].get("content") or "" for o in objs for c in o["choices"]).split(" ")
    usage = [o["usage"] for o in objs if o.get("usage")]
    if len(words) != MAX_TOKENS or not continuous(words):
        return Outcome(False, took, f"text not continuous or incomplete ({len(words)} words)")
    if len(usage) != 1 or usage[0]["completion_tokens"] != MAX_TOKENS:
        return Outcome(False, took, f"usage {usage}")
    return Outcome(True, took)


async def drive(url: str) -> list[Outcome]:
    limits = httpx.Limits(max_connections=STREAMS + 4, max_keepalive_connections=STREAMS + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(ALLOWED_S + 10, connect=10.0), limits=limits) as http:
        tasks = []
        for i in range(STREAMS):
            tasks.append(asyncio.create_task(one_stream(http, url, i)))
            await asyncio.sleep(SPACING_S)
        return list(await asyncio.gather(*tasks))


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_mode(mode: str) -> dict:
    args, n, faulty = MODES[mode]
    port, base = free_port(), free_port() + 50
    while any(not _free(base + i) for i in range(n)) or base <= port < base + n:
        base = free_port() + 50
    env = {**os.environ, "FLEETGATE_ADMIN_KEY": "fg-admin-chaos-demo"}
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--base-port", str(base), *args]
    with tempfile.NamedTemporaryFile("w", prefix=f"fleetgate-chaos-demo-{mode}-", suffix=".log",
                                     delete=False) as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            outcomes, wall, metrics = _check(f"http://127.0.0.1:{port}",
                                             [f"http://127.0.0.1:{base + i}" for i in range(n)], faulty)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    print(f"{mode}: the demo's log is {log.name}", file=sys.stderr)
    failed = [o.why for o in outcomes if not o.ok]
    return {"mode": mode, "demo": " ".join(args), "streams": STREAMS, "failed": len(failed),
            "why": sorted(set(failed))[:5], "slowest_s": round(max(o.took_s for o in outcomes), 2),
            "median_s": round(sorted(o.took_s for o in outcomes)[STREAMS // 2], 2), "wall_s": round(wall, 1),
            "resumed": _metric(metrics, "fleetgate_stream_breaks_total", 'outcome="resumed"'),
            "retries": _metric(metrics, "fleetgate_retries_total", "")}


def _check(url: str, workers: list[str], faulty: tuple[int, int]) -> tuple[list[Outcome], float, str]:
    """Faults on two workers, then the streams: their outcomes, the wall time, the gateway's metrics after."""
    poll_sync(lambda: healthy(url + "/health") and all(healthy(w + "/health") for w in workers), 120,
              "the demo's gateway and workers")
    poll_sync(lambda: _rotation(url) >= len(workers), 30, "every worker in rotation")
    drop, hang = workers[faulty[0]], workers[faulty[1]]
    httpx.post(drop + "/sim/faults", json={"drop_after_tokens": 5}, timeout=5).raise_for_status()
    httpx.post(hang + "/sim/faults", json={"hang": True}, timeout=5).raise_for_status()
    t0 = time.monotonic()
    outcomes = asyncio.run(drive(url))
    wall = time.monotonic() - t0
    metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer fg-admin-chaos-demo"}, timeout=10).text
    return outcomes, wall, metrics


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _rotation(url: str) -> int:
    try:
        r = httpx.get(url + "/admin/workers", headers={"Authorization": "Bearer fg-admin-chaos-demo"}, timeout=5)
        return sum(1 for w in r.json()["data"] if w["healthy"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def _metric(text: str, name: str, label: str) -> int:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def section(results: list[dict], commit: str) -> str:
    passed = all(r["failed"] == 0 for r in results)
    out = section_head(TITLE, "`python -m bench.chaos_demo`", commit, passed)
    for r in results:
        where = "sim-1, sim-2" if r["mode"] == "workers" else "decode-3, decode-4 (two of the three decode workers)"
        why = f" ({'; '.join(r['why'])})" if r["why"] else ""
        out.append(f"| `fleetgate demo {r['demo']}`; `drop_after_tokens: 5` and `hang: true` on {where}; "
                   f"{r['streams']} streams of {MAX_TOKENS} tokens, 4k-token prompts, {SPACING_S} s apart | 0 "
                   f"failed, each `[DONE]` within {ALLOWED_S:g} s with exactly max_tokens tokens | {r['failed']}/"
                   f"{r['streams']} failed{why}; slowest {r['slowest_s']} s, median {r['median_s']} s; "
                   f"{r['resumed']} streams resumed, {r['retries']} retries |")
    out += ["", BEFORE]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=[*MODES, "both"], default="both")
    ap.add_argument("--no-write", action="store_true", help="print the results, leave chaos.md alone")
    a = ap.parse_args()
    results = [run_mode(m) for m in (MODES if a.mode == "both" else [a.mode])]
    for r in results:
        print(json.dumps(r))
    if not a.no_write:
        write_section(section(results, git_commit()), TITLE)
        print(f"wrote the section {TITLE!r} of bench/results/chaos.md")
    sys.exit(0 if all(r["failed"] == 0 for r in results) else 1)


if __name__ == "__main__":
    main()
