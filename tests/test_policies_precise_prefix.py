"""precise_prefix: weighted scorers on the exact cache view, the load guard, the max-score picker."""

from __future__ import annotations

import pytest

from policies.base import make_policy, policy_names
from policies.kv_index import BlockStored, KvIndex
from policies.precise_prefix import PrecisePrefix
from policies.types import RequestFeatures, WorkerView


def _req(cached: dict[str, int], prompt: int = 1000) -> RequestFeatures:
    return RequestFeatures("r", "m", prompt, cached_prefix_tokens=cached)


def _w(wid: str, load: int = 0, kv: float = 0.0, tokens: int = 0) -> WorkerView:
    return WorkerView(wid, inflight=load, kv_usage=kv, inflight_tokens=tokens)


def test_registered_and_validated() -> None:
    assert "precise_prefix" in policy_names()
    assert isinstance(make_policy("precise_prefix", scorers={"prefix": 1, "kv_cache": 1}), PrecisePrefix)
    for bad in ({"scorers": {"nope": 1}}, {"scorers": {"prefix": -1}}, {"scorers": {"prefix": 0}},
                {"guard_factor": 0.5}):
        with pytest.raises(ValueError):
            make_policy("precise_prefix", **bad)


def test_cached_prefix_wins_when_loads_are_close() -> None:
    p = PrecisePrefix()
    d = p.choose(_req({"b": 960}), [_w("a", 2), _w("b", 3), _w("c", 2)], 0.0)
    assert d.worker_id == "b" and d.reason == "prefix_hit"


def test_no_hit_anywhere_is_least_requests() -> None:
    p = PrecisePrefix()
    d = p.choose(_req({}), [_w("a", 3), _w("b", 1)], 0.0)
    assert (d.worker_id, d.reason) == ("b", "prefix_miss")


def test_load_guard_drops_an_overloaded_holder() -> None:
    p = PrecisePrefix(guard_factor=2.0, slack=4.0)
    # b holds the whole prompt but runs 20 requests; the least loaded runs 1: 20 > 2 x (1 + 1) + 4
    d = p.choose(_req({"b": 1000}), [_w("a", 1), _w("b", 20), _w("c", 3)], 0.0)
    assert d.worker_id == "a" and d.reason == "prefix_load"


def test_weights_trade_prefix_against_load() -> None:
    workers = [_w("a", 0), _w("b", 6)]
    small_hit = _req({"b": 200})                 # 20% of the prompt cached on the busier worker
    assert PrecisePrefix({"prefix": 3, "queue": 2}).choose(small_hit, workers, 0).worker_id == "a"
    assert PrecisePrefix({"prefix": 3, "queue": 0.1}).choose(small_hit, workers, 0).worker_id == "b"
    # prefill scorer: uncached prompt + reserved tokens, low is good
    heavy = [_w("a", 1, tokens=9000), _w("b", 1, tokens=0)]
    assert PrecisePrefix({"prefix": 1, "prefill": 1}).choose(_req({"a": 100}), heavy, 0).worker_id == "b"
    # kv_cache scorer
    kv = [_w("a", 1, kv=0.9), _w("b", 1, kv=0.1)]
    assert PrecisePrefix({"prefix": 1, "kv_cache": 5}).choose(_req({"a": 100}), kv, 0).worker_id == "b"


def test_ties_rotate() -> None:
    p = PrecisePrefix()
    ws = [_w("a"), _w("b"), _w("c")]
    picks = [p.choose(_req({"a": 500, "b": 500, "c": 500}), ws, 0).worker_id for _ in range(6)]
    assert sorted(set(picks)) == ["a", "b", "c"]


def test_reads_a_live_index_view() -> None:
    idx = KvIndex(16)
    view = idx.view([1, 2, 3])
    req = _req(view, prompt=60)  # type: ignore[arg-type]
    p = PrecisePrefix()
    ws = [_w("a", 1), _w("b", 1)]
    assert p.choose(req, ws, 0).reason == "prefix_miss"
    idx.apply("b", [BlockStored((1, 2, 3), None, (), 16)])
    assert p.choose(req, ws, 0).worker_id == "b"
