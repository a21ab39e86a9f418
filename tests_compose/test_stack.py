"""The stack of docker-compose.yml as a user meets it (tests run in file order; the last one takes it down)."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.helpers import poll, poll_sync
from tests_compose.conftest import UP
from tests_compose.stack import ROOT, Stack, docker
from tests_compose.timeline import Sample, direction_changes, write

pytestmark = pytest.mark.timeout(900)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def client(stack: Stack, port_var: str = "FLEETGATE_PORT") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url(port_var) + "/v1", api_key="unused", max_retries=0, timeout=120)


async def chat(c: openai.AsyncOpenAI, max_tokens: int = 16, stream: bool = False, full: bool = False,
               first: list[int] | None = None) -> str:
    """One chat completion's text; `full`: exactly max_tokens tokens (vLLM's min_tokens), for long requests;
    `first`: a stream appends to it when its first chunk arrives."""
    msgs = [{"role": "user", "content": "Say hello to the fleet."}]
    extra = {"min_tokens": max_tokens} if full else None
    if not stream:
        r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, extra_body=extra)
        assert r.usage.completion_tokens > 0
        return r.choices[0].message.content
    parts = []
    async for chunk in await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens,
                                                       stream=True, extra_body=extra):
        if first is not None and not parts:
            first.append(1)
        parts += [ch.delta.content or "" for ch in chunk.choices]
    return "".join(parts)


async def test_openai_requests_through_the_gateway(stack: Stack) -> None:
    c = client(stack)
    models = await c.models.list()
    assert MODEL in [m.id for m in models.data]
    assert await chat(c)
    assert await chat(c, stream=True)
    completion = await c.completions.create(model=MODEL, prompt="The fleet", max_tokens=8)
    assert completion.choices[0].text
    with pytest.raises(openai.NotFoundError):
        await c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


async def test_responses_and_messages_through_the_gateway(stack: Stack) -> None:
    """The agents' front doors in the stack: a two-turn Responses chain (its state in the stack's Redis) with the
    official `openai` SDK, one Messages request and one stream with the official `anthropic` SDK."""
    import anthropic

    c = client(stack)
    first = await c.responses.create(model=MODEL, input="Say hello to the fleet.", max_output_tokens=8)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = await c.responses.create(model=MODEL, input="Again.", previous_response_id=first.id,
                                      max_output_tokens=8)
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens   # turn 1 came back
    assert (await c.responses.retrieve(second.id)).output_text == second.output_text
    an = anthropic.AsyncAnthropic(base_url=stack.url("FLEETGATE_PORT"), api_key="unused", max_retries=0, timeout=120)
    msg = await an.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello?"}])
    assert msg.type == "message" and msg.content[0].type == "text" and msg.content[0].text
    assert msg.usage.output_tokens > 0
    async with an.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as s:
        streamed = await s.get_final_message()
    assert streamed.content[0].text and streamed.stop_reason in ("end_turn", "max_tokens")


def prometheus(stack: Stack, path: str, **params: str) -> dict:
    r = httpx.get(stack.url("PROMETHEUS_PORT") + path, params=params, timeout=10)
    r.raise_for_status()
    return r.json()["data"]


def up_targets(stack: Stack, job: str) -> dict[str, float]:
    """instance -> value of `up` for the job's targets, as Prometheus last scraped them."""
    res = prometheus(stack, "/api/v1/query", query=f'up{{job="{job}"}}')["result"]
    return {r["metric"]["instance"]: float(r["value"][1]) for r in res}


def scraped(stack: Stack, job: str, services: tuple[str, ...]) -> bool:
    want = {f"{stack.container_ip(c)}:{port}" for svc in services for c in stack.containers(svc)
            for port in [8100 if svc == "sim" else 8000]}
    got = up_targets(stack, job)
    return set(got) == want and all(v == 1.0 for v in got.values())


def test_prometheus_scrapes_the_gateway_and_every_worker_and_loads_the_alerts(stack: Stack) -> None:
    poll_sync(lambda: scraped(stack, "fleetgate", ("gateway",)), timeout=60, every=1,
              what="Prometheus scraping the gateway")
    poll_sync(lambda: scraped(stack, "vllm-sim", ("sim",)), timeout=60, every=1,
              what="Prometheus scraping every sim container")
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    want = {r["alert"] for g in alerts["groups"] for r in g["rules"] if "alert" in r}
    groups = prometheus(stack, "/api/v1/rules")["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert want and loaded == want
    assert all(r["health"] == "ok" for g in groups for r in g["rules"])


def expected_workers(stack: Stack) -> set[str]:
    """The worker ids DNS discovery gives the running sim containers: sim-ADDRESS:8100."""
    return {f"sim-{stack.container_ip(c)}:8100" for c in stack.containers("sim")}


def scale_sim(stack: Stack, n: int, *profiles: str) -> set[str]:
    """docs/deploy.md's `docker-compose [--profile P] up -d --scale sim=N` (Grafana left out); the workers
    once the gateway has exactly the new fleet in rotation."""
    stack.compose(*[a for p in profiles for a in ("--profile", p)], *UP, "--scale", f"sim={n}")
    stack.wait_healthy("sim", n)
    want = expected_workers(stack)
    poll_sync(lambda: stack.healthy_workers() == want, timeout=60, every=1,
              what=f"the gateway routing to exactly the {n} sim containers")
    return want


def test_scale_sim_grows_and_shrinks_the_fleet_the_gateway_sees(stack: Stack) -> None:
    assert len(scale_sim(stack, 3)) == 3
    assert len(scale_sim(stack, 2)) == 2
    poll_sync(lambda: scraped(stack, "vllm-sim", ("sim",)), timeout=60, every=1,
              what="Prometheus following the scaled sim service")
    assert len(scale_sim(stack, 3)) == 3


async def test_docker_kill_of_a_worker_under_50_streams_fails_no_request(stack: Stack) -> None:
    scale_sim(stack, 3)
    c = client(stack)
    broken_before = recovered(stack)
    started: list[int] = []
    tasks = [asyncio.create_task(chat(c, max_tokens=400, stream=True, full=True, first=started)) for _ in range(25)]
    tasks += [asyncio.create_task(chat(c, max_tokens=400, full=True)) for _ in range(25)]
    await poll(lambda: len(started) == 25, timeout=30, what="every stream's first token")
    await asyncio.to_thread(docker, "kill", stack.containers("sim")[0])
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException) or not r]
    assert not failures, f"{len(failures)} of 50 requests failed: {failures[:3]}"
    assert recovered(stack) > broken_before, "the kill hit no request in flight"
    scale_sim(stack, 3)  # compose starts the killed container again


def recovered(stack: Stack) -> float:
    """Requests the gateway re-sent or resumed on another worker after a failure (retries + stream breaks)."""
    text = stack.gateway_metrics()
    return sum(float(m.group(1)) for m in re.finditer(
        r"^fleetgate_(?:retries|stream_breaks)_total\{[^}]*\} (\S+)$", text, re.M))


async def load(c: openai.AsyncOpenAI, until: float, users: int = 4) -> tuple[int, list[BaseException]]:
    """`users` clients sending short requests back to back until `until`: (answered, failures)."""
    done, failures = 0, []

    async def user() -> None:
        nonlocal done
        while time.monotonic() < until:
            try:
                assert await chat(c, max_tokens=8)
                done += 1
            except Exception as e:  # noqa: BLE001  (every client-visible failure is counted)
                failures.append(e)

    await asyncio.gather(*(user() for _ in range(users)))
    return done, failures


CAP = 6   # deploy/compose/fleetgate.yaml: requests in flight per worker, both replicas together


async def test_ha_profile_replicas_both_serve_and_share_reservations_through_redis(stack: Stack) -> None:
    stack.compose("--profile", "ha", *UP, "--scale", "sim=3")
    stack.wait_healthy("gateway-2", 1)
    workers = expected_workers(stack)
    poll_sync(lambda: stack.healthy_workers("FLEETGATE_HA_PORT") == workers, timeout=60, every=1,
              what="gateway-2 routing to the sim containers")
    one, two = client(stack), client(stack, "FLEETGATE_HA_PORT")
    assert await chat(one) and await chat(two, stream=True)
    # 12 long streams on each replica, 24 in all, over 3 workers capped at 6 each (deploy/compose/fleetgate.yaml):
    # each replica's gauge counts the reservations of both (Redis), so both see more than the 12 requests in
    # flight they could have placed themselves, and no worker ever holds more than its cap across the two.
    tasks = [asyncio.create_task(chat(c, max_tokens=800, stream=True, full=True))
             for c in (one, two) for _ in range(12)]
    peak: dict[str, float] = {}

    def shared() -> bool:
        per_port = [{w: stack.gauge("fleetgate_worker_inflight", {"worker": w}, port) or 0 for w in workers}
                    for port in ("FLEETGATE_PORT", "FLEETGATE_HA_PORT")]
        for seen in per_port:
            for w, n in seen.items():
                peak[w] = max(peak.get(w, 0), n)
        return all(sum(seen.values()) > 12 for seen in per_port)

    await asyncio.to_thread(poll_sync, shared, 20, "both replicas counting the other's reservations", 0.2)
    while not all(t.done() for t in tasks):
        await asyncio.to_thread(shared)
        await asyncio.sleep(0.2)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, str) and r for r in results), results
    assert peak and max(peak.values()) <= CAP, f"a worker held more than its cap of {CAP}: {peak}"


async def test_redis_restart_keeps_requests_succeeding_and_the_fleet_recovers(stack: Stack) -> None:
    workers = expected_workers(stack)
    c = client(stack)
    redis = stack.containers("redis")
    assert len(redis) == 1
    loader = asyncio.create_task(load(c, time.monotonic() + 20))
    await asyncio.sleep(4)
    await asyncio.to_thread(docker, "restart", "-t", "1", redis[0])
    done, failures = await loader
    assert not failures, f"{len(failures)} requests failed around the Redis restart: {failures[:3]}"
    assert done > 20
    for port in ("FLEETGATE_PORT", "FLEETGATE_HA_PORT"):
        poll_sync(lambda p=port: stack.gauge("fleetgate_state_store_up", port_var=p) == 1.0, timeout=60, every=1,
                  what=f"{port}'s gateway back on Redis")
        poll_sync(lambda p=port: stack.healthy_workers(p) == workers, timeout=60, every=1,
                  what=f"{port}'s gateway routing to every worker again")
    assert await chat(c) and await chat(client(stack, "FLEETGATE_HA_PORT"))


BURST_S, BURST_USERS = 45.0, 32


async def test_autoscale_profile_grows_sim_under_a_burst_and_shrinks_it_back(stack: Stack, tmp_path) -> None:
    stack.compose("--profile", "autoscale", *UP, "--scale", "sim=1")
    stack.wait_healthy("gateway-autoscale", 1)
    stack.wait_healthy("sim", 1)
    port = "FLEETGATE_AUTOSCALE_PORT"
    poll_sync(lambda: stack.healthy_workers(port) == expected_workers(stack), timeout=60, every=1,
              what="the autoscaling gateway routing to the one sim container")
    c = client(stack, port)
    inflight, answered, failures = 0, 0, []
    samples: list[Sample] = []
    start = time.monotonic()

    def pools(name: str) -> int:
        return int(sum(stack.gauge(name, {"pool": p}, port) or 0 for p in ("interactive", "mixed")))

    async def sampler(until: Callable[[], bool]) -> None:
        while not until():
            containers = len(await asyncio.to_thread(stack.containers, "sim"))
            desired, current = await asyncio.to_thread(lambda: (pools("fleetgate_desired_workers"),
                                                                pools("fleetgate_current_workers")))
            samples.append(Sample(round(time.monotonic() - start, 1), containers, inflight, desired, current))
            await asyncio.sleep(1.0)

    async def user(end: float) -> None:
        nonlocal inflight, answered
        while time.monotonic() < end:
            inflight += 1
            try:
                assert await chat(c, max_tokens=256)
                answered += 1
            except Exception as e:  # noqa: BLE001  (every client-visible failure is counted)
                failures.append(e)
            finally:
                inflight -= 1

    calm = asyncio.Event()
    watch = asyncio.create_task(sampler(calm.is_set))
    await asyncio.gather(*(user(start + BURST_S) for _ in range(BURST_USERS)))
    deadline = time.monotonic() + 180
    while not (samples[-1].containers == 1 and samples[-1].desired <= 1) and time.monotonic() < deadline:
        await asyncio.sleep(1)
    await asyncio.sleep(3)
    calm.set()
    await watch
    out = Path(os.environ.get("FLEETGATE_COMPOSE_RESULTS", tmp_path))
    write(samples, out, burst_s=BURST_S, users=BURST_USERS, failures=len(failures), answered=answered,
          command="FLEETGATE_COMPOSE_RESULTS=bench/results make test-compose")
    counts = [s.containers for s in samples]
    assert not failures, f"{len(failures)} requests failed: {failures[:3]}"
    assert max(counts) >= 2, f"the burst did not grow sim: {counts}"
    assert counts[-1] == 1, f"calm did not shrink sim back to 1: {counts}"
    assert direction_changes(counts) <= 1, f"containers changed direction more than once: {counts}"
    assert direction_changes([s.desired for s in samples]) <= 1, [s.desired for s in samples]


def test_down_leaves_nothing_of_the_project(stack: Stack) -> None:
    assert stack.containers() and stack.networks()
    volumes = stack.volumes()
    stack.down()
    assert stack.containers(running=False) == []
    assert stack.networks() == []
    left = set(volumes) & set(docker("volume", "ls", "-q").split())
    assert not left, f"volumes left behind: {left}"


def test_the_docs_show_the_commands_run_here(stack: Stack) -> None:
    """The compose commands of docs/deploy.md and the README are the ones this lane ran, less `--scale grafana=0`
    (any sim count)."""
    def norm(cmd: str) -> str:
        return re.sub(r"sim=\d+", "sim=N", " ".join(cmd.replace("--scale grafana=0", "").split()))

    ran = {norm("docker-compose " + " ".join(c)) for c in stack.commands}
    assert ran
    for doc in ("docs/deploy.md", "README.md"):   # indented blocks in the one, a ```bash block in the other
        text = (ROOT / doc).read_text()
        shown = {norm(m.group(1)) for m in re.finditer(r"^(?: {4})?(docker-compose [^#`\n]+)", text, re.M)}
        assert ran <= shown, f"run here but not in {doc}: {ran - shown}"
