"""Admin API (add, list, drain, activate, delete) and the gateway's own Prometheus series."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai

from tests.helpers import ADMIN, MODEL
from tests.helpers import running_gateway as gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


async def served(http: httpx.AsyncClient, url: str) -> int:
    return sum((await http.get(url + "/sim/state")).json()["stats"]["finished"].values())


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    return None


async def test_admin_add_list_drain_activate_delete(sim_fleet) -> None:
    first = sim_fleet(1, time_scale=10)
    second = sim_fleet(1, time_scale=10)
    a, b = first.urls[0], second.urls[0]
    async with gateway([a], default_policy="round_robin") as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        admin = gw.url + "/admin/workers"
        listed = (await http.get(admin)).json()["data"]
        assert [(w["id"], w["url"], w["healthy"], w["state"], w["models"]) for w in listed] == [
            ("w0", a, True, "active", [MODEL])]

        # add: validated, probed (models discovered) before the answer
        r = await http.post(admin, json={"id": "extra", "url": b, "cap": 8, "labels": {"zone": "b"}})
        assert r.status_code == 201, r.text
        assert r.json()["healthy"] and r.json()["models"] == [MODEL] and r.json()["source"] == "admin"
        assert (await http.post(admin, json={"id": "extra", "url": b})).status_code == 409
        bad = await http.post(admin, json={"id": "x y", "url": "ftp://nope", "role": "boss"})
        assert bad.status_code == 400
        assert all(f in bad.json()["error"]["message"] for f in ("id", "url", "role"))
        assert (await http.post(admin, content=b"[not json")).status_code == 400
        assert sorted(w["id"] for w in (await http.get(admin)).json()["data"]) == ["extra", "w0"]
        before = (await served(http, a), await served(http, b))
        for _ in range(4):
            assert (await http.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await served(http, a) - before[0], await served(http, b) - before[1]) == (2, 2)

        # drain w0 while a stream runs on it: the stream finishes, new requests avoid w0
        body = {**CHAT, "max_tokens": 60, "stream": True}
        async with http.stream("POST", gw.url + "/v1/chat/completions", json=body,
                               headers={"x-sim-output-tokens": "60"}) as running:
            chunks = running.aiter_bytes()
            first_chunk = await chunks.__anext__()
            assert first_chunk.startswith(b"data: ")
            on_w0 = gw.gateway.store.inflight().get("w0")
            target = "w0" if on_w0 and on_w0.requests else "extra"
            r = await http.post(f"{admin}/{target}/drain")
            assert r.status_code == 200 and r.json()["state"] == "draining"
            other_url = b if target == "w0" else a
            mid = await served(http, other_url)
            for _ in range(3):
                assert (await http.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
            assert await served(http, other_url) - mid == 3
            rest = b"".join([c async for c in chunks])
        stream = first_chunk + rest
        assert stream.endswith(b"data: [DONE]\n\n") and b'"error"' not in stream
        assert stream.count(b'"delta":{"content":"') == 60  # every token arrived

        r = await http.post(f"{admin}/{target}/activate")
        assert r.status_code == 200 and r.json()["state"] == "active"

        # delete
        assert (await http.delete(f"{admin}/extra")).status_code == 200
        assert [w["id"] for w in (await http.get(admin)).json()["data"]] == ["w0"]
        for method, path in (("DELETE", "/extra"), ("POST", "/extra/drain"), ("GET", "/extra")):
            r = await http.request(method, admin + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
        assert (await http.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200


async def test_metrics_are_exported_and_move(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=10)
    async with gateway(fleet.urls, scrape_interval_s=0.05) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        text0 = (await http.get(gw.url + "/metrics")).text
        assert text0.startswith("# HELP") and sample(text0, "fleetgate_worker_healthy", worker="w0") == 1
        assert sample(text0, "fleetgate_worker_inflight", worker="w0") == 0

        await oa.chat.completions.create(**CHAT)
        s = await oa.chat.completions.create(**CHAT, stream=True, extra_headers={"x-sim-output-tokens": "5"})
        assert [c async for c in s]

        # while a long stream runs, the inflight gauge and the scraped engine numbers show it
        body = {**CHAT, "max_tokens": 100_000, "stream": True}
        async with http.stream("POST", gw.url + "/v1/chat/completions", json=body,
                               headers={"x-sim-output-tokens": "100000"}) as running:
            chunks = running.aiter_bytes()  # keep a reference: a collected generator closes the stream
            await chunks.__anext__()
            text = (await http.get(gw.url + "/metrics")).text
            assert sample(text, "fleetgate_worker_inflight", worker="w0") == 1
            for _ in range(100):
                if gw.gateway.registry.workers["w0"].metrics.running == 1:
                    break
                await asyncio.sleep(0.02)
            assert gw.gateway.registry.workers["w0"].metrics.running == 1
            listed = (await http.get(gw.url + "/admin/workers")).json()["data"][0]
            assert listed["inflight"] == 1 and listed["engine"]["running"] == 1
        # leaving the block hung up on the stream: the reservation goes, the request counts as 499
        for _ in range(100):
            text = (await http.get(gw.url + "/metrics")).text
            if sample(text, "fleetgate_worker_inflight", worker="w0") == 0:
                break
            await asyncio.sleep(0.02)
        assert sample(text, "fleetgate_requests_total", model=MODEL, status="499") == 1
        labels = {"model": MODEL, "policy": "least_tokens", "status": "200"}
        assert sample(text, "fleetgate_requests_total", **labels) == 2
        assert sample(text, "fleetgate_request_duration_seconds_count", model=MODEL) == 3
        assert sample(text, "fleetgate_time_to_first_token_seconds_count", model=MODEL) == 1
        assert sample(text, "fleetgate_time_per_output_token_seconds_count", model=MODEL) == 1
        assert sample(text, "fleetgate_routing_seconds_count", model=MODEL) == 3
        assert sample(text, "fleetgate_routing_seconds_bucket", model=MODEL, le="1e-05") is not None
        assert sample(text, "fleetgate_worker_inflight", worker="w0") == 0
        # an upstream failure shows up by worker and kind
        await http.post(fleet.urls[0] + "/sim/faults", json={"error_status": 502})
        assert (await http.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 502
        text = (await http.get(gw.url + "/metrics")).text
        assert sample(text, "fleetgate_upstream_errors_total", worker="w0", kind="status_5xx") == 1
        assert sample(text, "fleetgate_requests_total", model=MODEL, status="502") == 1
