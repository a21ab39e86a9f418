"""Baseline policies: choice and distribution properties, determinism, no-candidate answers."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from policies.base import make_policy, policy_names
from policies.baselines import PowerOfTwo, SessionAffinity
from policies.prefix import prompt_chunk_hashes
from policies.types import RequestFeatures, WorkerView

BASELINES = [
    "round_robin", "random", "least_requests", "least_tokens", "power_of_two", "least_kv", "session_affinity", "prefix_affinity",
]


def req(i: int = 0, session: str | None = None, hashes: tuple[int, ...] = ()) -> RequestFeatures:
    return RequestFeatures(request_id=f"r{i}", model="m", prompt_tokens=100, session_id=session, prefix_hashes=hashes)


def views(loads: dict[str, int], **kw) -> list[WorkerView]:
    return [WorkerView(id=wid, inflight=load, **kw) for wid, load in loads.items()]


def test_all_baselines_registered():
    assert set(BASELINES) <= set(policy_names())
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("no_such_policy")


@pytest.mark.parametrize("name", BASELINES)
def test_no_candidates_gives_none(name):
    d = make_policy(name).choose(req(session="s", hashes=(1, 2, 3)), [], 0.0)
    assert d.worker_id is None and d.reason


@pytest.mark.parametrize("name", BASELINES)
def test_single_candidate_is_chosen(name):
    d = make_policy(name).choose(req(session="s", hashes=(1, 2, 3)), views({"only": 3}), 0.0)
    assert d.worker_id == "only"


def test_round_robin_cycles_in_id_order_regardless_of_input_order():
    p = make_policy("round_robin")
    ws = views({"a": 0, "b": 9, "c": 3})
    rng = random.Random(1)
    picks = []
    for i in range(9):
        rng.shuffle(ws)
        picks.append(p.choose(req(i), ws, 0.0).worker_id)
    assert picks == ["a", "b", "c"] * 3
    # b leaves: the cycle continues over the rest without restarting
    assert [p.choose(req(), views({"a": 0, "c": 0}), 0.0).worker_id for _ in range(4)] == ["a", "c", "a", "c"]


def test_random_is_seeded_and_roughly_uniform():
    ws = views({f"w{i}": 0 for i in range(4)})
    first = make_policy("random", seed=7).choose(req(), ws, 0.0).worker_id
    p1, p2 = make_policy("random", seed=7), make_policy("random", seed=7)
    seq1 = [p1.choose(req(), ws, 0.0).worker_id for _ in range(2000)]
    seq2 = [p2.choose(req(), ws, 0.0).worker_id for _ in range(2000)]
    assert seq1 == seq2 and seq1[0] == first
    counts = Counter(seq1)
    assert set(counts) == {w.id for w in ws}
    assert all(400 <= c <= 600 for c in counts.values()), counts


def test_least_requests_picks_minimum_and_rotates_ties():
    p = make_policy("least_requests")
    assert p.choose(req(), views({"a": 5, "b": 2, "c": 7}), 0.0).worker_id == "b"
    # load uses the larger of gateway in-flight and engine running+waiting
    ws = [WorkerView(id="a", inflight=1, running=6, waiting=2), WorkerView(id="b", inflight=4)]
    assert p.choose(req(), ws, 0.0).worker_id == "b"
    # equal loads spread instead of piling onto one worker
    equal = views({"a": 1, "b": 1, "c": 1, "d": 9})
    assert sorted(p.choose(req(i), equal, 0.0).worker_id for i in range(3)) == ["a", "b", "c"]


def test_least_tokens_weighs_requests_by_their_tokens_then_count_then_rotates():
    p = make_policy("least_tokens")
    # one 100k-token request outweighs three short ones: least_requests would pick "long"
    ws = [WorkerView(id="long", inflight=1, inflight_tokens=100_000),
          WorkerView(id="short", inflight=3, inflight_tokens=3_000)]
    assert p.choose(req(), ws, 0.0).worker_id == "short"
    assert make_policy("least_requests").choose(req(), ws, 0.0).worker_id == "long"
    # equal tokens: fewer requests (gateway's or engine's count), then rotation over the equals
    tie = [WorkerView(id="a", inflight_tokens=500, running=4), WorkerView(id="b", inflight_tokens=500, inflight=1)]
    assert p.choose(req(), tie, 0.0).worker_id == "b"
    idle, fresh = [WorkerView(id=w) for w in "abc"], make_policy("least_tokens")
    assert [fresh.choose(req(i), idle, 0.0).worker_id for i in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_power_of_two_never_picks_the_larger_of_its_two():
    p = make_policy("power_of_two", seed=3)
    two = views({"lo": 1, "hi": 8})
    assert {p.choose(req(), two, 0.0).worker_id for _ in range(200)} == {"lo"}
    loads = {f"w{i}": i for i in range(8)}
    counts = Counter(p.choose(req(), views(loads), 0.0).worker_id for _ in range(4000))
    assert "w7" not in counts  # the global maximum loses every pairing
    # P(w_i) = 2 (7 - i) / 56 for 8 distinct loads: the least loaded is picked most
    assert counts.most_common(1)[0][0] == "w0"
    assert abs(counts["w0"] / 4000 - 14 / 56) < 0.04


def test_power_of_two_is_seeded():
    ws = views({f"w{i}": i % 3 for i in range(6)})
    a, b = PowerOfTwo(seed=11), PowerOfTwo(seed=11)
    assert [a.choose(req(), ws, 0.0).worker_id for _ in range(100)] == [
        b.choose(req(), ws, 0.0).worker_id for _ in range(100)
    ]


def test_least_kv_lowest_usage_then_load():
    p = make_policy("least_kv")
    ws = [WorkerView(id="a", kv_usage=0.5), WorkerView(id="b", kv_usage=0.2, inflight=9), WorkerView(id="c", kv_usage=0.9)]
    assert p.choose(req(), ws, 0.0).worker_id == "b"
    tie = [WorkerView(id="a", kv_usage=0.3, inflight=4), WorkerView(id="b", kv_usage=0.3, inflight=1)]
    assert p.choose(req(), tie, 0.0).worker_id == "b"


def _assign(p: SessionAffinity, sessions: list[str], ws: list[WorkerView]) -> dict[str, str]:
    return {s: p.choose(req(session=s), ws, 0.0).worker_id for s in sessions}


def test_session_affinity_sticky_balanced_and_moves_about_one_nth():
    p = make_policy("session_affinity")
    sessions = [f"user-{i}" for i in range(4000)]
    ws8 = views({f"w{i}": 0 for i in range(8)})
    before = _assign(p, sessions, ws8)
    assert _assign(p, sessions, list(reversed(ws8))) == before  # input order does not matter
    counts = Counter(before.values())
    assert len(counts) == 8 and all(0.6 * 500 < c < 1.4 * 500 for c in counts.values()), counts

    # remove w3: only its sessions move
    ws7 = [w for w in ws8 if w.id != "w3"]
    after = _assign(p, sessions, ws7)
    moved = [s for s in sessions if after[s] != before[s]]
    assert all(before[s] == "w3" for s in moved)
    assert abs(len(moved) / len(sessions) - 1 / 8) < 0.04

    # add w8: about 1/9 of sessions move, all of them to the newcomer
    ws9 = ws8 + views({"w8": 0})
    grown = _assign(p, sessions, ws9)
    moved = [s for s in sessions if grown[s] != before[s]]
    assert all(grown[s] == "w8" for s in moved)
    assert abs(len(moved) / len(sessions) - 1 / 9) < 0.04


def test_session_affinity_weights_shift_share():
    p = make_policy("session_affinity")
    ws = [WorkerView(id="big", weight=3.0), WorkerView(id="small", weight=1.0)]
    counts = Counter(_assign(p, [f"s{i}" for i in range(4000)], ws).values())
    assert abs(counts["big"] / 4000 - 0.75) < 0.04


def test_session_affinity_load_guard_and_no_session():
    p = make_policy("session_affinity", guard_factor=2.0, slack=4.0)
    ws = views({f"w{i}": 1 for i in range(4)})
    home = p.choose(req(session="alice"), ws, 0.0)
    assert home.reason == "session_hash"
    # home worker at 8 <= 2 x (1 + 1) + 4: still sticky
    ws_busy = [WorkerView(id=w.id, inflight=8 if w.id == home.worker_id else 1) for w in ws]
    assert p.choose(req(session="alice"), ws_busy, 0.0).worker_id == home.worker_id
    # home worker at 9 > 8: the guard sends it to the least loaded instead
    ws_hot = [WorkerView(id=w.id, inflight=9 if w.id == home.worker_id else 1) for w in ws]
    d = p.choose(req(session="alice"), ws_hot, 0.0)
    assert d.reason == "session_load_guard" and d.worker_id != home.worker_id
    # no session: least requests
    d = p.choose(req(), views({"a": 3, "b": 0, "c": 2}), 0.0)
    assert (d.worker_id, d.reason) == ("b", "no_session")


def test_micro_timing_print():
    """Not an assertion on speed: prints µs per choose at 16 workers for the report."""
    ws = [WorkerView(id=f"worker-{i:02d}", inflight=i % 5, running=i % 3, kv_usage=i / 20) for i in range(16)]
    text = "system prompt " * 600
    hashes = prompt_chunk_hashes(text)
    for name in BASELINES:
        p = make_policy(name)
        r = req(session="sess-42", hashes=hashes)
        for i in range(16):
            p.on_dispatch(req(i, hashes=prompt_chunk_hashes(f"{i} " + text)), ws[i].id, 0.0)
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            p.choose(r, ws, 0.0)
        us = (time.perf_counter() - t0) / n * 1e6
        print(f"{name:18s} {us:6.1f} us/choose @16 workers")
        assert p.choose(r, ws, 0.0).worker_id in {w.id for w in ws}
