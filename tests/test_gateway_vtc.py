"""Fair sharing between tenants in the live gateway (`service_priority.order: vtc`, gateway/tenancy/services.py): a tenant is
an API key's name, and under VTC a light tenant's request overtakes a heavy tenant's backlog in the admission queue
(under FCFS it waits behind it). Real HTTP on loopback, the openai client, simulated vLLM workers."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from gateway.config import ServicePriorityConfig, load_config
from gateway.tenancy.auth import ANONYMOUS, Tenant
from gateway.tenancy.services import ServiceOrder
from tests.helpers import MODEL, running_gateway, worker_entries

FAST = 20.0
MESSAGES = [{"role": "user", "content": "hello there"}]
KEYS = [{"key": "sk-heavy-tenant-0001", "name": "heavy"}, {"key": "sk-light-tenant-0001", "name": "light"}]


def test_tenant_is_the_key_name_and_keyless_callers_are_one_tenant():
    order = ServiceOrder(ServicePriorityConfig(order="vtc", service_from=["tenant"], weights={"heavy": 2.0}))
    assert order.service_of([], Tenant("id-1", "heavy"), "m") == "tenant:heavy"
    assert order.service_of([], Tenant("id-2", "heavy"), "m") == "tenant:heavy"   # two keys, one name
    assert order.service_of([(b"x-service", b"other")], Tenant("id-3", "light"), "m") == "tenant:light"
    assert order.service_of([], ANONYMOUS, "m") == order.service_of([], ANONYMOUS, "other-model") == ""
    sched = order.scheduler("m")
    assert sched.name == "vtc"
    assert sched.weight("tenant:heavy") == sched.weight("heavy") == 2.0 and sched.weight("tenant:light") == 1.0


def test_vtc_config_validation():
    with pytest.raises(Exception, match="weights"):
        load_config(None, service_priority={"order": "vtc", "weights": {"a": 0}})
    with pytest.raises(Exception, match="output_token_weight"):
        load_config(None, service_priority={"order": "vtc", "output_token_weight": -1})
    cfg = load_config(None, service_priority={"order": "vtc", "weights": {"a": 3}, "input_token_weight": 0.5})
    sched = ServiceOrder(cfg.service_priority).scheduler(MODEL)
    assert (sched.weight("tenant:a"), sched.input_weight, sched.output_weight) == (3.0, 0.5, 2.0)


async def finish_order(make_client, urls: list[str], order: str) -> list[str]:
    """One worker taking one request at a time: a heavy request runs while three more heavy ones and then one light
    one queue. The order in which the queued four finish (with cap 1 they run one after the other)."""
    settings = {"workers": worker_entries(urls, cap=1), "auth": {"keys": KEYS},
                "service_priority": {"order": order, "service_from": ["tenant"]}, "limits": {"queue_timeout_s": 60}}
    async with running_gateway(**settings) as gw:
        clients = {k["name"]: make_client(gw.url, k["key"]) for k in KEYS}
        done: list[str] = []

        async def one(name: str, tenant: str, tokens: int) -> None:
            r = await clients[tenant].chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=tokens, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == tokens
            done.append(name)

        blocker = asyncio.ensure_future(one("blocker", "heavy", 200))
        queue = gw.gateway.dispatcher.runtime(MODEL).queue
        deadline = time.monotonic() + 5
        sched = gw.gateway.dispatcher.services.scheduler(MODEL)
        while not (len(sched) == 1 and len(queue) == 0) and time.monotonic() < deadline:   # the blocker is placed
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.02)
        tasks = []
        for name, tenant in [("heavy-a", "heavy"), ("heavy-b", "heavy"), ("heavy-c", "heavy"), ("light", "light")]:
            tasks.append(asyncio.ensure_future(one(name, tenant, 50)))
            deadline = time.monotonic() + 5
            while len(queue) < len(tasks) and time.monotonic() < deadline:   # queued in this order
                await asyncio.sleep(0.002)
        assert len(queue) == 4, "the four did not queue behind the blocker"
        await asyncio.gather(blocker, *tasks)
        assert len(sched) == 0
        if order == "vtc":
            assert set(sched.counters) == {"tenant:heavy", "tenant:light"}
        return [n for n in done if n != "blocker"]


async def test_light_tenant_overtakes_the_heavy_backlog_under_vtc_not_fcfs(sim_fleet, make_client):
    fleet = sim_fleet(1, time_scale=2.0)   # the blocker runs ~0.6 s: time for the four to queue on a busy machine
    assert await finish_order(make_client, fleet.urls, "fcfs") == ["heavy-a", "heavy-b", "heavy-c", "light"]
    # VTC: light returns from idle while heavy is backlogged, so its counter is lifted to heavy's (the blocker's
    # prompt). When the blocker finishes, heavy is charged its 200 output tokens x 2 before the queue is drained:
    # light's counter is the smallest and its request goes first; heavy's follow in their order.
    assert await finish_order(make_client, fleet.urls, "vtc") == ["light", "heavy-a", "heavy-b", "heavy-c"]


async def test_unkeyed_request_is_refused_when_keys_are_required(sim_fleet, make_client):
    """The tenant comes from the key: a caller without one gets the gateway's 401, not a 500."""
    fleet = sim_fleet(1, time_scale=FAST)
    async with running_gateway(fleet.urls, auth={"keys": KEYS}, service_priority={"order": "vtc"}) as gw:
        with pytest.raises(openai.AuthenticationError):
            await make_client(gw.url, "sk-not-a-key-0000").chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2)
