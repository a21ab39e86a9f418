"""Workers found by DNS (config `worker_discovery`, gateway/fleet/discovery.py), resolved for real: a DNS server
on a loopback UDP port (tests/dns_server.py) names simulated vLLM servers listening on 127.0.0.2, .3, .4 (one
port for all, as a compose service or a headless Service has), and the system resolver for `localhost`."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from gateway.state.base import WORKER_DRAINING
from simulator.fleet import specs_from_options
from tests.dns_server import LoopbackDns
from tests.helpers import MODEL, free_port, poll, running_gateway

ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
INTERVAL_S = 0.2
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


def entry(dns: LoopbackDns, port: int, **extra: object) -> dict[str, object]:
    return {"dns": "sim.test", "port": port, "interval_s": INTERVAL_S, "nameservers": [dns.address],
            "labels": {"pool": "mixed"}, **extra}


def start_workers(sim_fleet, port: int, addresses: list[str]) -> dict[str, object]:
    """One simulated server per loopback address, all on `port`."""
    return {a: sim_fleet(specs=specs_from_options(1, port, "llama3-8b-h100", None, 1.0, i), host=a)
            for i, a in enumerate(addresses)}


def in_rotation(gw) -> set[str]:  # noqa: ANN001
    return {ws.id for ws in gw.gateway.registry.rotation(MODEL)}


async def test_addresses_join_drain_with_a_stream_in_flight_and_survive_an_outage(sim_fleet, make_client,
                                                                                  caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.discovery")
    port = free_port()
    start_workers(sim_fleet, port, ADDRESSES)
    ids = {a: f"sim-{a}:{port}" for a in ADDRESSES}
    with LoopbackDns({"sim.test": ADDRESSES[:2]}) as dns:
        async with running_gateway(workers=[], worker_discovery=[entry(dns, port)]) as gw:
            reg = gw.gateway.registry
            # the first resolution runs before the gateway serves; the workers join after their health check
            assert set(reg.workers) == {ids[a] for a in ADDRESSES[:2]}
            await poll(lambda: in_rotation(gw) == {ids[a] for a in ADDRESSES[:2]}, what="both workers in rotation")
            assert reg.workers[ids["127.0.0.2"]].rec.url == f"http://127.0.0.2:{port}"
            assert reg.workers[ids["127.0.0.2"]].rec.labels == {"pool": "mixed"}

            # a new address joins: health check, then its models from /v1/models
            dns.set("sim.test", ADDRESSES)
            await poll(lambda: ids["127.0.0.4"] in in_rotation(gw), what="the new address in rotation")
            assert reg.workers[ids["127.0.0.4"]].models == (MODEL,)

            # one address goes while a stream runs on it: it drains, the stream finishes, then it leaves
            oa = make_client(gw.url, max_retries=0)
            streams, on = [], None
            while on is None:   # open streams until one lands on a worker we can take away (not the newest)
                s = await oa.chat.completions.create(**{**CHAT, "max_tokens": 400}, stream=True,
                                                     extra_headers={"x-sim-output-tokens": "400"})
                chunks = s.__aiter__()
                first = await chunks.__anext__()
                streams.append((s, chunks, first))
                busy = {w for w, f in gw.gateway.store.inflight().items() if f.requests}
                on = next((w for w in sorted(busy) if w != ids["127.0.0.4"]), None)
            gone = next(a for a, i in ids.items() if i == on)
            dns.set("sim.test", [a for a in ADDRESSES if a != gone])
            await poll(lambda: reg.workers[on].rec.state == WORKER_DRAINING, what="the gone address draining")
            assert on not in in_rotation(gw) and on in reg.workers
            for _ in range(4):   # new requests go elsewhere meanwhile
                r = await oa.chat.completions.create(**CHAT)
                assert r.choices[0].finish_reason == "length"
            for s, chunks, first in streams:
                texts = [first.choices[0].delta.content or ""] + [c.choices[0].delta.content or "" async for c in chunks
                                                                 if c.choices]
                assert sum(1 for t in texts if t) >= 390, "a stream in flight on the drained worker was cut short"
                await s.close()
            await poll(lambda: on not in reg.workers, timeout=15, what="the drained worker leaving the registry")
            assert set(reg.workers) == {i for a, i in ids.items() if a != gone}

            # the resolver goes silent: the set stays, one line when it starts failing and one when it is back
            before = set(reg.workers)
            dns.silent = True
            queries = dns.queries
            await asyncio.sleep(3.0)
            assert dns.queries > queries + 1, "the name was not asked again during the outage"
            assert set(reg.workers) == before and in_rotation(gw) == before
            dns.silent = False
            await poll(lambda: any("resolves again" in r.getMessage() for r in caplog.records), what="recovery line")
            lines = [r.getMessage() for r in caplog.records]
            assert sum("does not resolve" in m for m in lines) == 1, lines
            assert sum("resolves again" in m for m in lines) == 1, lines

            # an answer with no address (NXDOMAIN and empty alike) keeps the set too
            dns.set("sim.test", [])
            await asyncio.sleep(5 * INTERVAL_S)
            assert set(reg.workers) == before

            # the address comes back: the same worker id as before
            dns.set("sim.test", ADDRESSES)
            await poll(lambda: on in in_rotation(gw), what="the returning address back in rotation")
            assert set(reg.workers) == set(ids.values())


async def test_system_resolver_finds_localhost(sim_fleet) -> None:
    """Without `nameservers` the system resolver answers (/etc/hosts here, Docker's or the cluster's DNS in a
    deployment). `localhost` may also name ::1, where nothing listens: that worker stays out of rotation."""
    port = free_port()
    start_workers(sim_fleet, port, ["127.0.0.1"])
    async with running_gateway(workers=[], worker_discovery=[{"dns": "localhost", "port": port, "cap": 3,
                                                              "interval_s": INTERVAL_S}]) as gw:
        wid = f"localhost-127.0.0.1:{port}"
        await poll(lambda: wid in in_rotation(gw), what="the localhost worker")
        assert gw.gateway.registry.workers[wid].rec.cap == 3   # the entry's cap is every found worker's
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.redis
async def test_replicas_share_the_fleet_and_a_lagging_resolver_does_not_bring_a_worker_back(
        sim_fleet, redis_url, redis_prefix) -> None:
    """Two gateway replicas on one Redis, each with its own resolver. When replica A's DNS drops an address
    and A drains and removes the worker, replica B, whose DNS still lists it, does not put it back."""
    port = free_port()
    start_workers(sim_fleet, port, ADDRESSES[:2])
    ids = {a: f"sim-{a}:{port}" for a in ADDRESSES[:2]}
    shared = {"workers": [], "redis_url": redis_url, "redis_key_prefix": redis_prefix}
    with LoopbackDns({"sim.test": ADDRESSES[:2]}) as dns_a, LoopbackDns({"sim.test": ADDRESSES[:2]}) as dns_b:
        async with running_gateway(**shared, replica_id="a", worker_discovery=[entry(dns_a, port)]) as a, \
                running_gateway(**shared, replica_id="b", worker_discovery=[entry(dns_b, port)]) as b:
            for gw in (a, b):
                await poll(lambda gw=gw: in_rotation(gw) == set(ids.values()), what="both workers on both replicas")
            dns_a.set("sim.test", ADDRESSES[:1])
            gone = ids[ADDRESSES[1]]
            await poll(lambda: gone not in a.gateway.registry.workers and gone not in b.gateway.registry.workers,
                       timeout=15, what="the gone worker leaving both replicas")
            await asyncio.sleep(10 * INTERVAL_S + 1.0)   # B keeps resolving it: it must stay gone
            for gw in (a, b):
                assert set(gw.gateway.registry.workers) == {ids[ADDRESSES[0]]}
            stored = {w.id for w in await a.gateway.store.list_workers()}
            assert stored == {ids[ADDRESSES[0]]}

            # the address comes back on A: it joins again under its old id, on both replicas
            dns_a.set("sim.test", ADDRESSES[:2])
            for gw in (a, b):
                await poll(lambda gw=gw: in_rotation(gw) == set(ids.values()), what="the worker back on both")


async def test_aaaa_records_and_the_family_setting(sim_fleet) -> None:
    """AAAA records are workers too (URL with the address in brackets); `family` keeps one kind only, for
    dual-stack networks where every worker has both."""
    port = free_port()
    start_workers(sim_fleet, port, ["127.0.0.2", "::1"])
    with LoopbackDns({"sim.test": ["127.0.0.2", "::1"]}) as dns:
        async with running_gateway(workers=[], worker_discovery=[entry(dns, port)]) as gw:
            await poll(lambda: in_rotation(gw) == {f"sim-127.0.0.2:{port}", f"sim-::1:{port}"},
                       what="the IPv4 and the IPv6 worker")
            assert gw.gateway.registry.workers[f"sim-::1:{port}"].rec.url == f"http://[::1]:{port}"
        for family, wid in (("ipv4", f"sim-127.0.0.2:{port}"), ("ipv6", f"sim-::1:{port}")):
            async with running_gateway(workers=[], worker_discovery=[entry(dns, port, family=family)]) as gw:
                await poll(lambda gw=gw, wid=wid: in_rotation(gw) == {wid}, what=f"the {family} worker only")
                assert set(gw.gateway.registry.workers) == {wid}


@pytest.mark.redis
async def test_a_restarted_gateway_drains_the_stored_workers_its_first_answer_lacks(
        sim_fleet, redis_url, redis_prefix, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.discovery")
    port = free_port()
    start_workers(sim_fleet, port, ADDRESSES[:2])
    ids = [f"sim-{a}:{port}" for a in ADDRESSES[:2]]
    shared = {"workers": [], "redis_url": redis_url, "redis_key_prefix": redis_prefix}
    with LoopbackDns({"sim.test": ADDRESSES[:2]}) as dns:
        async with running_gateway(**shared, worker_discovery=[entry(dns, port)]) as gw:
            await poll(lambda: in_rotation(gw) == set(ids), what="both workers")
        dns.set("sim.test", ADDRESSES[:1])          # while no gateway runs, one address goes
        async with running_gateway(**shared, worker_discovery=[entry(dns, port)]) as gw:
            await poll(lambda: set(gw.gateway.registry.workers) == {ids[0]}, what="the stale worker removed")
            assert any(m.startswith(f"worker {ids[1]}: its address no longer resolves")
                       for m in (r.getMessage() for r in caplog.records)), "it was not in the store to begin with"
            assert {w.id for w in await gw.gateway.store.list_workers()} == {ids[0]}
