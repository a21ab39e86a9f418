"""policies/adapters.py: the adapter load price (from the adapter's size, the disk and the host link) and where a
request for an adapter goes, with real policies (least_requests, aladdin)."""

from __future__ import annotations

import pytest

from policies.adapters import DISK_BYTES_PER_S, DISK_FIXED_S, choose_for_adapter, load_cost_key, lora_costs
from policies.base import make_policy
from policies.placement import ModelPlacement
from policies.types import RequestFeatures, WorkerView
from tests.helpers import MODEL

PROFILE = "llama3-8b-h100"


def view(wid: str, adapters: tuple[str, ...] = (), inflight: int = 0, max_loras: int | None = 2) -> WorkerView:
    return WorkerView(wid, inflight=inflight, profile=PROFILE, adapters=frozenset(adapters), max_loras=max_loras)


def req(adapter: str | None = "sql", ttft: float | None = None) -> RequestFeatures:
    return RequestFeatures("r1", MODEL, prompt_tokens=128, max_tokens=32, predicted_output_tokens=32,
                           slo_ttft_s=ttft, adapter=adapter)


def test_a_runtime_load_reads_the_adapter_from_disk_then_copies_it_over_the_host_link():
    # Llama-3.1-8B: 32 layers; q,o (4096 + 4096) x 2, k,v (4096 + 1024) x 2, gate,up,down (4096 + 14336) x 3;
    # rank 16, BF16; NVMe-class disk (our assumption), PCIe Gen4 x16 ~25 GB/s
    size = 16 * 32 * (2 * 8192 + 2 * 5120 + 3 * 18432) * 2
    c = lora_costs(MODEL)
    assert c.adapter_bytes == size
    assert c.runtime_load_s == pytest.approx(DISK_FIXED_S + size / DISK_BYTES_PER_S + size / 25e9)


def test_a_worker_serving_the_adapter_wins_over_an_idle_one():
    d = choose_for_adapter(make_policy("least_requests"), req(), [view("idle"), view("busy", ("sql",), 3)], 0.0,
                           0.1)
    assert d.worker_id == "busy"


def test_without_a_resident_worker_the_cheapest_load_wins():
    views = [view("full", ("a", "b"), 0), view("two", ("a", "e"), 0, max_loras=4), view("one", ("c",), 2),
             view("one-idle", ("d",), 0)]
    assert sorted(views, key=load_cost_key)[0].id == "one-idle"
    d = choose_for_adapter(make_policy("least_requests"), req(), views, 0.0, 0.1)
    assert d.worker_id == "one-idle"    # a free slot, one adapter resident, least load
    d = choose_for_adapter(make_policy("least_requests"), req(), [view("full", ("a", "b")), view("two", ("a",), 5)],
                           0.0, 0.1)
    assert d.worker_id == "two"         # a free GPU slot beats a full one, whatever the load


def test_a_base_request_is_the_policys_choice_alone():
    placement = ModelPlacement(make_policy("least_requests"))
    d = placement.place(req(adapter=None), [view("a", ("sql",), 2), view("b")], 0.0)
    assert d.worker_id == "b"
    assert placement.place(req(), [view("a", ("sql",), 2), view("b")], 0.0).worker_id == "a"


def test_aladdin_prices_the_load_into_its_ttft_check():
    policy = make_policy("aladdin", slo_ttft_s=1.0)
    views = [view("w0")]
    fits = choose_for_adapter(policy, req(), views, 0.0, load_s=0.1)
    assert fits.worker_id == "w0" and fits.reason != "best_effort"
    # the same idle worker cannot meet a 1 s TTFT once a 2 s load comes first: aladdin's best effort (no worker
    # could); a request's own, looser target counts instead of the default
    late = choose_for_adapter(policy, req(), views, 0.0, load_s=2.0)
    assert (late.worker_id, late.reason) == ("w0", "best_effort")
    assert choose_for_adapter(policy, req(ttft=5.0), views, 0.0, load_s=2.0).reason == fits.reason
    # a worker serving the adapter needs no load
    assert choose_for_adapter(policy, req(), [view("w0", ("sql",))], 0.0, load_s=2.0).reason == fits.reason
