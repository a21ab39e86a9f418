"""Service-aware priority in the live gateway (gateway/tenancy/services.py): the service of a request (X-Service header,
tenant, model), the admission queue's order and vLLM's `priority` field, over loopback HTTP with the official
openai client against simulated vLLM workers."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import openai
import pytest

from gateway.config import ServicePriorityConfig, load_config
from gateway.tenancy.auth import ANONYMOUS, Tenant
from gateway.tenancy.services import ServiceOrder
from policies.tokens import estimate_chat_tokens
from simulator.engine import EngineCore
from tests.helpers import MODEL, poll, running_gateway, worker_entries

FAST = 20.0
MESSAGES = [{"role": "user", "content": "hello there"}]


def chat(client: openai.AsyncOpenAI, service: str, tokens: int, **kw):
    """One request of `service` generating exactly `tokens` tokens (ignore_eos)."""
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=tokens,
        extra_body={"ignore_eos": True}, extra_headers={"X-Service": service}, **kw)


async def teach(client: openai.AsyncOpenAI, profiles: dict[str, int]) -> None:
    """One finished request per service: the scheduler learns each service's length."""
    for service, tokens in profiles.items():
        r = await chat(client, service, tokens)
        assert r.usage.completion_tokens == tokens


def test_service_of_header_tenant_model():
    order = ServiceOrder(ServicePriorityConfig(order="seallm"))
    acme = Tenant("t1", "acme")
    assert order.service_of([(b"x-service", b"code")], acme, "m") == "code"
    assert order.service_of([], acme, "m") == "tenant:acme"
    assert order.service_of([], ANONYMOUS, "m") == "model:m"
    by_model = ServiceOrder(ServicePriorityConfig(order="seallm", service_from=["model"]))
    assert by_model.service_of([(b"x-service", b"code")], acme, "m") == "model:m"
    only_header = ServiceOrder(ServicePriorityConfig(order="fcfs", service_from=["header"]))
    assert only_header.service_of([], acme, "m") == ""
    with pytest.raises(Exception, match="X-Service"):
        order.service_of([(b"x-service", b"bad name!")], acme, "m")


def test_config_validation():
    with pytest.raises(Exception, match="order"):
        load_config(None, service_priority={"order": "lottery"})
    with pytest.raises(Exception, match="starvation"):
        load_config(None, service_priority={"order": "seallm", "starvation_s": {"code": 0}})
    with pytest.raises(Exception, match="service_from"):
        load_config(None, service_priority={"order": "seallm", "service_from": ["cookie"]})
    cfg = load_config(None, service_priority={"order": "seallm", "engine_priority": True,
                                              "starvation_s": {"code": 2.5}})
    assert cfg.service_priority.engine_priority and cfg.service_priority.starvation_s == {"code": 2.5}


async def test_vllm_priority_field_set_from_the_service_order(sim_fleet, make_client, monkeypatch):
    """Workers with --scheduling-policy priority get SeaLLM's priority in vLLM's `priority` field: a short service's
    requests a smaller number (served first) than a long one's."""
    fleet = sim_fleet(1, time_scale=FAST, scheduling_policy="priority")
    seen: dict[str, int] = {}
    add = EngineCore.add

    def recording_add(self, req, now):   # the engine sees what vLLM's scheduler would
        seen[req.request_id] = req.priority
        return add(self, req, now)

    monkeypatch.setattr(EngineCore, "add", recording_add)
    async with running_gateway(fleet.urls, service_priority={"order": "seallm", "engine_priority": True}) as gw:
        client = make_client(gw.url)
        await teach(client, {"essay": 120, "code": 4})
        seen.clear()
        await chat(client, "essay", 8)
        essay_priority = next(iter(seen.values()))
        seen.clear()
        await chat(client, "code", 8)
        code_priority = next(iter(seen.values()))
        # After one sample per service the spread is 0, so Q = L̂ and the first priority is 1 + ceil(L̂ · L̂), with
        # L̂ the generated tokens plus the prompt's prefill at 1/256 of a decode iteration per token.
        prompt = estimate_chat_tokens(MESSAGES)
        for priority, taught in [(essay_priority, 120), (code_priority, 4)]:
            cost = taught + prompt / 256
            assert priority == 1 + math.ceil(cost * cost)
        assert 0 < code_priority < essay_priority
        sched = gw.gateway.dispatcher.services.scheduler(MODEL)
        assert sched.profile("essay").n == sched.profile("code").n == 2


async def test_priority_field_on_a_fcfs_worker_is_vllms_400(sim_fleet, make_client):
    """engine_priority needs workers started with --scheduling-policy priority: vLLM's own 400 comes back (no 500)."""
    fleet = sim_fleet(1, time_scale=FAST)
    async with running_gateway(fleet.urls, service_priority={"order": "seallm", "engine_priority": True}) as gw:
        client = make_client(gw.url)
        with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled"):
            await chat(client, "essay", 4)
        # Without engine_priority the queue order alone is used and the same worker answers.
    async with running_gateway(fleet.urls, service_priority={"order": "seallm"}) as gw:
        r = await chat(make_client(gw.url), "essay", 4)
        assert r.usage.completion_tokens == 4


async def test_bad_service_header_is_a_400(sim_fleet, make_client):
    fleet = sim_fleet(1, time_scale=FAST)
    async with running_gateway(fleet.urls, service_priority={"order": "seallm"}) as gw:
        with pytest.raises(openai.BadRequestError, match="X-Service"):
            await chat(make_client(gw.url), "no spaces allowed", 4)


async def finish_order(make_client, urls: list[str], order: str) -> list[str]:
    """cap=1: one request at a time; a long one runs while two long and then two short ones queue. The order in
    which the queued four finish. The blocker is held at its first token (the simulator's stall_after_tokens
    fault) until the four have queued: at time scale 20 it would otherwise finish in ~0.15 s, before a loaded
    machine has queued them."""
    # hung_detection off: the held blocker is not yet answered (not streamed), and on a loaded machine queueing
    # the four can outlast the stall rule's 2 s floor, which would eject the worker and place the blocker again.
    settings = {"workers": worker_entries(urls, cap=1), "service_priority": {"order": order},
                "limits": {"queue_timeout_s": 60}, "resume": {"hung_detection": False}}
    async with running_gateway(**settings) as gw:
        client = make_client(gw.url)
        await teach(client, {"long": 400, "short": 2})
        done: list[str] = []

        async def one(name: str, service: str, tokens: int) -> None:
            await chat(client, service, tokens)
            done.append(name)

        async with httpx.AsyncClient(timeout=10) as http:
            await http.post(urls[0] + "/sim/faults", json={"stall_after_tokens": 1})
            blocker = asyncio.ensure_future(one("blocker", "long", 400))
            async def held() -> bool:    # it runs, held at its first token
                return (await http.get(urls[0] + "/sim/state")).json()["stalled"]

            await poll(held, timeout=30, what="the blocker to start", every=0.01)
            tasks = await queue_four(gw, one)
            await http.delete(urls[0] + "/sim/faults")
        await asyncio.gather(blocker, *tasks)
        return [n for n in done if n != "blocker"]


async def queue_four(gw, one) -> list[asyncio.Future]:  # noqa: ANN001
    """Send the four, each once the previous one has queued (so they queue in this order)."""
    queue = gw.gateway.dispatcher.runtime(MODEL).queue
    tasks = []
    for name, service, tokens in [("long-a", "long", 400), ("long-b", "long", 400), ("short-a", "short", 2),
                                  ("short-b", "short", 2)]:
        tasks.append(asyncio.ensure_future(one(name, service, tokens)))
        deadline = time.monotonic() + 30      # a bound on a hang: a loaded machine took more than 5 s
        while len(queue) < len(tasks) and time.monotonic() < deadline:   # queued in this order
            await asyncio.sleep(0.002)
    assert len(queue) == 4, "the four did not queue behind the blocker"
    return tasks


async def test_admission_queue_serves_short_services_first_with_seallm(sim_fleet, make_client):
    fleet = sim_fleet(1, time_scale=FAST)
    assert await finish_order(make_client, fleet.urls, "fcfs") == ["long-a", "long-b", "short-a", "short-b"]
    assert await finish_order(make_client, fleet.urls, "seallm") == ["short-a", "short-b", "long-a", "long-b"]
    # Round robin: turns alternate between the services (long had the blocker's turn, so short goes first).
    assert await finish_order(make_client, fleet.urls, "round_robin") == ["short-a", "long-a", "short-b", "long-b"]


async def test_service_from_tenant_and_model_over_http(sim_fleet, make_client):
    """Without X-Service the tenant of the key names the service; an open gateway falls back to the model."""
    fleet = sim_fleet(1, time_scale=FAST)
    keys = [{"key": "sk-team-a-0001", "name": "team-a"}, {"key": "sk-team-b-0001", "name": "team-b"}]
    async with running_gateway(fleet.urls, auth={"keys": keys}, service_priority={"order": "seallm"}) as gw:
        for key, tokens in [("sk-team-a-0001", 30), ("sk-team-b-0001", 3), ("sk-team-b-0001", 5)]:
            r = await make_client(gw.url, key).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=tokens, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == tokens
        sched = gw.gateway.dispatcher.services.scheduler(MODEL)
        assert {name: p.n for name, p in sched.profiles.items()} == {"tenant:team-a": 1, "tenant:team-b": 2}
        prompt = estimate_chat_tokens(MESSAGES) / 256
        assert sched.profile("tenant:team-b").expected == pytest.approx(4 + prompt)
        assert len(sched) == 0          # every finished request left the scheduler
    async with running_gateway(fleet.urls, service_priority={"order": "round_robin"}) as gw:
        await make_client(gw.url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert set(gw.gateway.dispatcher.services.scheduler(MODEL).profiles) == {f"model:{MODEL}"}
