"""Tenants: inference keys with limits, the admin key and the keys it manages, per-key rpm / tpm / concurrency
(in memory and shared by two gateways through Redis), model allow-lists, /metrics behind a key, and the
allow-list of worker hosts. The official openai client and httpx against simulated workers, on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re

import httpx
import openai
import pytest

from gateway.state.ratelimit import KeyLimits, LocalBuckets, RateLimited, Ticket, format_reset
from tests.helpers import ADMIN, MODEL, running_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def reset_seconds(text: str) -> float:
    """`1m0s`, `59.6s`, `20ms` -> seconds."""
    m = re.fullmatch(r"(?:(\d+)m)?(?:([\d.]+)s)?(?:(\d+)ms)?", text)
    assert m, text
    return int(m.group(1) or 0) * 60 + float(m.group(2) or 0) + int(m.group(3) or 0) / 1000


def ratelimit_headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("x-ratelimit-")}


# --- the arithmetic ------------------------------------------------------------------------------------------
def test_reset_durations_use_openais_format() -> None:
    assert [format_reset(ms) for ms in (0, 20, 999.2, 1000, 1500, 59_999, 60_000, 360_000)] == [
        "0ms", "20ms", "1000ms", "1s", "1.5s", "60s", "1m0s", "6m0s"]


def test_local_buckets_refill_at_the_limit_per_minute_and_settle() -> None:
    b = LocalBuckets()
    lim = KeyLimits(rpm=60, tpm=1000)
    t = [Ticket(f"r{i}", "tenant", lim, cost=100) for i in range(12)]
    for x in t[:10]:
        b.charge(x, 0.0)  # 10 x 100 tokens: the tokens bucket (1000) is empty, requests 50 left
    with pytest.raises(RateLimited) as exc:
        b.charge(t[10], 0.0)
    err = exc.value
    assert err.status == 429 and "tokens per minute" in err.message
    assert math.isclose(err.retry_after, 6.0)  # 100 tokens at 1000/min: 6 s
    b.settle("tenant", 1000, 100 - 40, 0.0)   # a request that used 40 of its 100: 60 back
    b.charge(Ticket("r-a", "tenant", lim, cost=60), 0.0)
    with pytest.raises(RateLimited):
        b.charge(Ticket("r-b", "tenant", lim, cost=1), 0.0)
    b.charge(t[11], 6000.0)  # 6 s later: 100 tokens refilled
    too_big = Ticket("r-c", "tenant", lim, cost=1001)
    with pytest.raises(RateLimited) as exc:
        b.charge(too_big, 60_000.0)
    assert exc.value.code == "request_too_large"


# --- keys and limits on the proxy path ---------------------------------------------------------------------------
async def test_rpm_limit_answers_429_with_openai_headers_and_recovers(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=50)
    keys = [{"key": "sk-rpm-limited-1", "name": "team-a", "rpm": 6},
            {"key": "sha256:" + hashlib.sha256(b"sk-hashed-in-config").hexdigest(), "name": "hashed"}]
    async with running_gateway(fleet.urls, auth={"keys": keys}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        codes, remaining = [], []
        for _ in range(8):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-rpm-limited-1"))
            codes.append(r.status_code)
            remaining.append(r.headers.get("x-ratelimit-remaining-requests"))
        assert codes == [200] * 6 + [429] * 2
        assert remaining[:6] == ["5", "4", "3", "2", "1", "0"]
        assert r.headers["x-ratelimit-limit-requests"] == "6"
        assert 50 < reset_seconds(r.headers["x-ratelimit-reset-requests"]) <= 60  # empty: about a minute to full
        assert 5 <= int(r.headers["retry-after"]) <= 10  # one request back at 6/min: 10 s from empty
        body = r.json()["error"]
        assert (body["type"], body["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        # the hashed key authenticates and has no limits; unknown keys are 401
        for _ in range(8):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-hashed-in-config"))
            assert r.status_code == 200 and not ratelimit_headers(r)
        assert (await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-nope"))).status_code == 401
        # a rate-limited request is not an SLO miss of the fleet, and the official client retries 429s
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-rpm-limited-1", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await oa.chat.completions.create(**CHAT)


async def test_tpm_reserves_max_tokens_and_settles_on_usage(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=50)
    async with running_gateway(fleet.urls, auth={"keys": [{"key": "sk-tpm-limited-1", "tpm": 1000}]}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20, headers=bearer("sk-tpm-limited-1")) as http:
        body = {**CHAT, "max_tokens": 300}
        r = await http.post("/v1/chat/completions", json=body, headers={"x-sim-output-tokens": "10"})
        assert r.status_code == 200
        usage = r.json()["usage"]
        reserved_left = int(r.headers["x-ratelimit-remaining-tokens"])
        assert reserved_left <= 1000 - 300 - usage["prompt_tokens"] + 2  # max_tokens + prompt reserved up front
        # settled: the 290 tokens not generated came back (the next reservation sees them)
        r = await http.post("/v1/chat/completions", json=body, headers={"x-sim-output-tokens": "10"})
        left_after = int(r.headers["x-ratelimit-remaining-tokens"])
        assert left_after >= 1000 - 2 * 300 - usage["prompt_tokens"] + 280, (reserved_left, left_after)
        big = {**CHAT, "max_tokens": 2000}
        r = await http.post("/v1/chat/completions", json=big)
        assert r.status_code == 429 and r.json()["error"]["code"] == "request_too_large"


async def test_max_concurrency_counts_requests_in_flight(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=5)
    async with running_gateway(fleet.urls, auth={"keys": [{"key": "sk-conc-limited", "max_concurrency": 2}]}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30, headers=bearer("sk-conc-limited")) as http:
        slow = {**CHAT, "max_tokens": 200, "stream": True}

        async def hold(ready: asyncio.Event, done: asyncio.Event) -> None:
            async with http.stream("POST", "/v1/chat/completions", json=slow,
                                   headers={"x-sim-output-tokens": "200"}) as r:
                assert r.status_code == 200
                it = r.aiter_bytes()
                await it.__anext__()
                ready.set()
                await done.wait()

        readies = [asyncio.Event(), asyncio.Event()]
        done = asyncio.Event()
        holders = [asyncio.create_task(hold(readies[i], done)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in readies)), 20)
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and "in flight" in r.json()["error"]["message"]
        done.set()
        await asyncio.gather(*holders)
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.redis
async def test_two_gateways_share_one_keys_buckets_through_redis(sim_fleet, redis_url, redis_prefix) -> None:
    fleet = sim_fleet(2, time_scale=50)
    cfg = {"redis_url": redis_url, "redis_key_prefix": redis_prefix,
           "auth": {"keys": [{"key": "sk-shared-limit", "rpm": 20}], "admin_key": ADMIN["authorization"][7:]}}
    async with running_gateway(fleet.urls, **cfg) as a, running_gateway(fleet.urls, **cfg) as b:
        async with httpx.AsyncClient(timeout=20, headers=bearer("sk-shared-limit")) as http:
            async def one(url: str) -> int:
                return (await http.post(url + "/v1/chat/completions", json=CHAT)).status_code
            codes = await asyncio.gather(*(one((a, b)[i % 2].url) for i in range(60)))
        assert codes.count(200) == 20 and codes.count(429) == 40  # one bucket for both replicas: no overshoot


# --- model allow-list, admin-made keys, metrics key ---------------------------------------------------------------
async def test_key_models_allow_list_hides_other_models(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": "m-a"}, {"model": "m-b"}]}, time_scale=50)
    keys = [{"key": "sk-only-model-a", "models": ["m-a"]}]
    async with running_gateway(fleet.urls, auth={"keys": keys}) as gw:
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-only-model-a", max_retries=0)
        assert [m.id async for m in oa.models.list()] == ["m-a"]
        assert (await oa.chat.completions.create(**{**CHAT, "model": "m-a"})).usage.completion_tokens >= 1
        with pytest.raises(openai.NotFoundError):
            await oa.chat.completions.create(**{**CHAT, "model": "m-b"})


async def test_admin_manages_keys_and_inference_keys_cannot_administer(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=50)
    async with running_gateway(fleet.urls, api_keys=["sk-legacy-key"]) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        assert (await http.get("/admin/keys", headers=bearer("sk-legacy-key"))).status_code == 401
        r = await http.post("/admin/keys", headers=ADMIN, json={"name": "ci", "rpm": 2, "models": [MODEL]})
        assert r.status_code == 201, r.text
        made = r.json()
        key, kid = made["key"], made["id"]
        assert key.startswith("sk-fg-") and made["rpm"] == 2 and made["source"] == "admin"
        listed = (await http.get("/admin/keys", headers=ADMIN)).json()["data"]
        assert {k["name"] for k in listed} == {"ci", "api_keys[0]"} and all("key" not in k for k in listed)
        codes = [(await http.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code
                 for _ in range(3)]
        assert codes == [200, 200, 429]
        assert (await http.post("/admin/keys", headers=ADMIN, json={"rpm": 0})).status_code == 400
        assert (await http.post("/admin/keys", headers=ADMIN, json={"key": key})).status_code == 409
        legacy_id = next(k["id"] for k in listed if k["name"] == "api_keys[0]")
        assert (await http.delete(f"/admin/keys/{legacy_id}", headers=ADMIN)).status_code == 409
        assert (await http.delete(f"/admin/keys/{kid}", headers=ADMIN)).status_code == 200
        assert (await http.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code == 401
        assert (await http.delete(f"/admin/keys/{kid}", headers=ADMIN)).status_code == 404


@pytest.mark.redis
async def test_admin_made_keys_reach_the_other_replica(sim_fleet, redis_url, redis_prefix) -> None:
    fleet = sim_fleet(1, time_scale=50)
    cfg = {"redis_url": redis_url, "redis_key_prefix": redis_prefix, "api_keys": ["sk-bootstrap-key"]}
    async with running_gateway(fleet.urls, **cfg) as a, running_gateway(fleet.urls, **cfg) as b, \
            httpx.AsyncClient(timeout=20) as http:
        key = (await http.post(a.url + "/admin/keys", headers=ADMIN, json={"name": "shared"})).json()["key"]

        async def works_on_b() -> bool:
            r = await http.post(b.url + "/v1/chat/completions", json=CHAT, headers=bearer(key))
            return r.status_code == 200
        from tests.helpers import poll
        await poll(works_on_b, 5, "the new key to work on the other replica")


async def test_metrics_can_require_a_key(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=50)
    async with running_gateway(fleet.urls, metrics={"auth": True, "key": "scrape-key-0123456789"}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers=bearer("scrape-key-0123456789"))).status_code == 200
        assert (await http.get("/metrics", headers=ADMIN)).status_code == 200
        assert (await http.get("/health")).status_code == 200 and (await http.get("/ready")).status_code == 200


async def test_admin_added_workers_must_be_on_allowed_hosts(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=50)
    async with running_gateway(fleet.urls[:1], admin={"worker_hosts": ["*.internal.example", "10.9.0.0/16"]},
                               health={"timeout_s": 0.2}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20, headers=ADMIN) as http:
        refused = []
        for url in ("http://169.254.169.254", "http://10.8.0.1:8000", "http://evil.example:80/x",
                    "http://internal.example.evil:80"):
            r = await http.post("/admin/workers", json={"id": "x", "url": url})
            refused.append((r.status_code, r.json()["error"]["code"]))
        assert refused == [(403, "worker_host_not_allowed")] * 4
        r = await http.post("/admin/workers", json={"id": "loop", "url": fleet.urls[1]})
        assert r.status_code == 201 and r.json()["healthy"]
        for wid, url in (("n", "http://gpu-1.internal.example:9"), ("ip", "http://10.9.3.4:9")):
            assert (await http.post("/admin/workers", json={"id": wid, "url": url})).status_code == 201


async def test_admin_key_from_the_environment(sim_fleet, monkeypatch) -> None:
    monkeypatch.setenv("FLEETGATE_ADMIN_KEY", "env-admin-key-0123456789")
    from gateway.config import load_config

    assert load_config(None).auth.admin_key == "env-admin-key-0123456789"
    fleet = sim_fleet(1, time_scale=50)
    async with running_gateway(fleet.urls, auth={}) as gw, httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        assert (await http.get("/admin/workers", headers=bearer("env-admin-key-0123456789"))).status_code == 200
        assert (await http.get("/admin/workers", headers=ADMIN)).status_code == 401
