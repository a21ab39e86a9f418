"""What keeping a stream resumable costs on the relay's hot path, per relayed event (CPU microseconds).

    python -m bench.resume_overhead

The relay's per-chunk work in-process, on vLLM-shaped chat events of one token each (~230 bytes): the stream
scanner (engine_adapters/vllm/sse.py) as for any stream, against the scanner in whole-events mode plus
StreamResume.note (gateway/wire/resume.py), for streams of 256 to 16,000 tokens. Past FOLD_BYTES of relayed bytes
(~4,000 tokens) a resumable stream folds them into its text (one regex pass), which is the cost the longest
streams pay. Timed with time.process_time(), the best of 9 alternated runs of 200,000 events per point and mode (the
machine is shared: process time is less disturbed by other load than wall time). Results: bench/results/resume_overhead.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import orjson

from bench.report import write_report
from engine_adapters.vllm.sse import VllmStreamScanner
from gateway.wire.resume import FOLD_BYTES, StreamResume

EVENT = b"data: " + orjson.dumps({
    "id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk", "created": 1764165000,
    "model": "meta-llama/Llama-3.1-8B-Instruct", "choices": [{"index": 0, "delta": {"content": " the"},
                                                             "logprobs": None, "finish_reason": None,
                                                             "token_ids": None}]}) + b"\n\n"
EVENTS = 200_000
LENGTHS = (256, 1000, 4000, 16000)
ROUNDS = 9


def per_event_us(resumable: bool, tokens: int, runs: int = 5) -> float:
    """Best-of-`runs` CPU microseconds per event relayed in streams of `tokens` events."""
    best = float("inf")
    for _ in range(runs):
        t = time.process_time()
        for _ in range(EVENTS // tokens):
            feed = VllmStreamScanner(False, resumable).feed
            note = StreamResume(True, True, False).note if resumable else None
            for _ in range(tokens):
                out = feed(EVENT)
                if out and note is not None:
                    note(out)
        best = min(best, (time.process_time() - t) / (EVENTS // tokens * tokens) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "resume_overhead.md"))
    args = ap.parse_args()
    rows = ["| stream length (tokens) | plain stream, us/event | resumable stream, us/event | added |", "|---|---|---|---|"]
    for n in LENGTHS:
        plain = res = float("inf")
        for _ in range(ROUNDS):  # alternated, so both see the same moments of the shared machine
            plain = min(plain, per_event_us(False, n, 1))
            res = min(res, per_event_us(True, n, 1))
        rows.append(f"| {n:,} | {plain:.2f} | {res:.2f} | {res - plain:+.2f} ({(res / plain - 1) * 100:+.0f} %) |")
        print(rows[-1])
    body = ("Per relayed event, the scanner as for any stream against the scanner in whole-events mode plus "
            f"StreamResume.note; a resumable stream folds its relayed bytes into its text past {FOLD_BYTES >> 10} "
            f"KiB (event size here {len(EVENT)} bytes).\n\n" + "\n".join(rows))
    write_report(Path(args.out), "Resumable streams: relay cost per event", "python -m bench.resume_overhead", body)


if __name__ == "__main__":
    main()
