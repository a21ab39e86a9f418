"""Prompt chunk hashes, the LRU prefix index, and the prefix_affinity policy."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

from policies.base import make_policy
from policies.prefix import PrefixIndex, prompt_chunk_hashes
from policies.types import RequestFeatures, WorkerView

SHARED = "You are a helpful assistant. Follow the house style guide exactly. " * 40  # ~2.7 KB


def req(i: int, text: str) -> RequestFeatures:
    return RequestFeatures(request_id=f"r{i}", model="m", prompt_tokens=len(text) // 4, prefix_hashes=prompt_chunk_hashes(text))


def test_hashes_share_head_and_diverge_at_the_differing_chunk():
    a = prompt_chunk_hashes(SHARED + "question one?")
    b = prompt_chunk_hashes(SHARED + "a different question")
    full = len(SHARED) // 128
    assert a[:full] == b[:full]
    assert a[full] != b[full]
    assert len(a) == -(-len(SHARED + "question one?") // 128)  # the partial tail chunk counts
    assert all(0 <= h < 1 << 64 for h in a) and len(set(a)) == len(a)
    assert prompt_chunk_hashes("") == ()
    assert len(prompt_chunk_hashes("x" * 100_000)) == 64
    assert len(prompt_chunk_hashes("x" * 1000, chunk_chars=10, max_chunks=5)) == 5
    assert prompt_chunk_hashes("héllo wörld ✓" * 30) == prompt_chunk_hashes("héllo wörld ✓" * 30)


def test_hashes_are_stable_across_processes():
    # Python's hash() of str is randomised per process; these must not be (two gateway replicas).
    code = "from policies.prefix import prompt_chunk_hashes as f; print(f('abc' * 500))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == str(prompt_chunk_hashes("abc" * 500))


def test_index_match_length_and_lru_bound_keeps_heads():
    idx = PrefixIndex(max_entries_per_worker=50)
    h = prompt_chunk_hashes(SHARED + "tail" * 100)
    idx.record("w1", h[:10])
    assert idx.match_len("w1", h) == 10
    assert idx.match_len("w1", h[:4]) == 4
    assert idx.match_len("w2", h) == 0
    assert idx.match_len("w1", prompt_chunk_hashes("unrelated" * 50)) == 0
    # fill past the bound with other prompts: size stays bounded, and a prompt's head outlives its tail
    idx.record("w1", h)
    for i in range(30):
        idx.record("w1", prompt_chunk_hashes(f"{i}" * 300))
        assert idx.size("w1") <= 50
        m = idx.match_len("w1", h)
        assert all(x in idx._by_worker["w1"] for x in h[:m])
    idx.forget_worker("w1")
    assert idx.match_len("w1", h) == 0


def test_same_long_prefix_goes_to_the_same_worker():
    p = make_policy("prefix_affinity")
    ws = [WorkerView(id=f"w{i}") for i in range(4)]
    first = req(0, SHARED + "first question")
    d0 = p.choose(first, ws, 0.0)
    assert d0.reason == "prefix_miss"
    p.on_dispatch(first, d0.worker_id, 0.0)
    for i in range(1, 20):
        r = req(i, SHARED + f"follow-up question number {i}")
        d = p.choose(r, ws, float(i))
        assert (d.worker_id, d.reason) == (d0.worker_id, "prefix_hit")
        p.on_dispatch(r, d.worker_id, float(i))


def test_distinct_prefixes_spread():
    p = make_policy("prefix_affinity")
    ws = [WorkerView(id=f"w{i}") for i in range(4)]
    homes: dict[int, str] = {}
    for round_ in range(3):
        for g in range(8):
            r = req(g, f"group {g} system prompt. " * 60 + f"turn {round_}")
            d = p.choose(r, ws, 0.0)
            p.on_dispatch(r, d.worker_id, 0.0)
            if round_ == 0:
                homes[g] = d.worker_id
            else:
                assert d.worker_id == homes[g]
    assert Counter(homes.values()) == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}


def test_load_guard_and_min_match():
    p = make_policy("prefix_affinity", min_match_chunks=3, guard_factor=2.0, slack=4.0)
    r = req(0, SHARED + "q")
    p.on_dispatch(r, "w1", 0.0)
    ws = [WorkerView(id="w0", inflight=1), WorkerView(id="w1", inflight=8), WorkerView(id="w2", inflight=2)]
    assert p.choose(r, ws, 0.0).worker_id == "w1"  # 8 <= 2 x (1 + 1) + 4
    hot = [WorkerView(id="w0", inflight=1), WorkerView(id="w1", inflight=9), WorkerView(id="w2", inflight=2)]
    d = p.choose(r, hot, 0.0)
    assert (d.worker_id, d.reason) == ("w0", "prefix_load_guard")
    # sharing only two leading chunks is below min_match_chunks=3
    short = req(1, SHARED[:256] + "something else entirely " * 20)
    d = p.choose(short, [WorkerView(id="w0", inflight=3), WorkerView(id="w1", inflight=2), WorkerView(id="w2", inflight=0)], 0.0)
    assert d.reason == "prefix_miss" and d.worker_id == "w2"
    # a worker that is not a candidate (at cap, unhealthy) is never returned even if it matches best
    d = p.choose(r, [WorkerView(id="w0", inflight=5), WorkerView(id="w2", inflight=3)], 0.0)
    assert d.worker_id == "w2"


def test_equal_matches_prefer_less_loaded():
    p = make_policy("prefix_affinity")
    r = req(0, SHARED + "q")
    p.on_dispatch(r, "w0", 0.0)
    p.on_dispatch(r, "w1", 0.0)
    d = p.choose(r, [WorkerView(id="w0", inflight=3), WorkerView(id="w1", inflight=1), WorkerView(id="w2")], 0.0)
    assert (d.worker_id, d.reason) == ("w1", "prefix_hit")


def test_hash_timing_print():
    """Prints the cost of hashing a 16 KB prompt (target: tens of µs); not an assertion on speed."""
    text = ("lorem ipsum dolor sit amet " * 700)[:16384]
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        h = prompt_chunk_hashes(text)
    print(f"prompt_chunk_hashes(16 KB): {(time.perf_counter() - t0) / n * 1e6:.1f} us, {len(h)} chunks")
    assert len(h) == 64
