"""The `docker` actuator against the real Docker daemon: a compose project of one service grows and shrinks
through it; docker-compose lists the containers it made, Docker's DNS resolves the service name to them, and a
container with a request in flight is drained before it is stopped.

The workers are busybox httpd serving a static /health and /v1/models (enough for the gateway's health check and
model discovery; no inference is sent to them). The in-flight request is a reservation in the gateway's state
store, which is what a request holds on its worker and what the drain waits for."""

from __future__ import annotations

import asyncio
import re

from gateway.config import DockerActuatorConfig
from gateway.control.actuators import ActuatorContext
from gateway.control.docker_actuator import DockerActuator
from tests.helpers import poll, running_gateway
from tests_docker.conftest import IMAGE, docker

COMPOSE = f"""\
version: "2.4"
services:
  sim:
    image: {IMAGE}
    command: ["sh", "-c", "mkdir -p /www/v1 && echo ok > /www/health && echo '{{\\"object\\": \\"list\\", \\"data\\": [{{\\"id\\": \\"tiny\\", \\"object\\": \\"model\\"}}]}}' > /www/v1/models && exec httpd -f -p 8000 -h /www"]
    healthcheck: {{test: ["CMD", "wget", "-q", "-O-", "http://127.0.0.1:8000/health"], interval: 2s}}
"""


def listed(project) -> set[str]:  # noqa: ANN001
    return set(project.compose("ps", "-q").split())


def running(cid: str) -> bool:
    return docker("inspect", "-f", "{{.State.Running}}", cid, check=False).strip() == "true"


def resolved(container: str, name: str) -> set[str]:
    """What Docker's DNS on the project network answers for `name`, asked from inside `container`."""
    out = docker("exec", container, "nslookup", name, "127.0.0.11", check=False)
    answers = out.split("Name:", 1)[-1]
    return set(re.findall(r"Address(?: \d+)?:\s*(\d+\.\d+\.\d+\.\d+)", answers))


def worker_ips(gw) -> set[str]:  # noqa: ANN001
    return {re.match(r"http://([\d.]+):", ws.rec.url).group(1) for ws in gw.gateway.registry.workers.values()}


async def test_a_compose_service_grows_and_shrinks_through_the_docker_actuator(compose_project) -> None:
    project = compose_project(COMPOSE)
    (first,) = listed(project)
    async with running_gateway(workers=[], health={"interval_s": 0.3}) as gw:
        reg, store = gw.gateway.registry, gw.gateway.store
        ctx = ActuatorContext(reg, store, None, drain_timeout_s=30)
        act = DockerActuator(ctx, DockerActuatorConfig(project=project.name, services={"mixed": "sim"},
                                                       stop_timeout_s=1))
        await act.start()
        try:
            # the service's container from `up` is a worker (the id a worker_discovery entry `sim` would give)
            await poll(lambda: [ws.id for ws in reg.workers.values() if ws.healthy], what="the first container")
            (ip,) = worker_ips(gw)
            assert set(reg.workers) == {f"sim-{ip}:8000"} and reg.workers[f"sim-{ip}:8000"].models == ("tiny",)

            # grow to 3: two new containers, pending until their health check passes, then in rotation
            await act.apply({"mixed": 3})
            assert sum(act.pending().values()) == 2
            await act.apply({"mixed": 3})                     # the autoscaler's next tick: nothing more started
            assert len(listed(project)) == 3

            def grown_to(n: int):  # noqa: ANN202 - a poll condition: the autoscaler's ticks until n are healthy
                async def check() -> bool:
                    await act.apply({"mixed": n})
                    return (not act.pending() and len(reg.workers) == n
                            and all(w.healthy for w in reg.workers.values()))
                return check
            await poll(grown_to(3), timeout=60, what="three healthy workers")
            containers = listed(project)
            assert len(containers) == 3 and first in containers
            names = docker("ps", "--filter", f"label=com.docker.compose.project={project.name}",
                           "--format", "{{.Names}} {{.Label \"com.docker.compose.container-number\"}}").split("\n")
            assert sorted(n.split()[1] for n in names if n) == ["1", "2", "3"]
            assert resolved(first, "sim") == worker_ips(gw)  # Docker's DNS names the service's new containers

            # shrink to 2 while every worker has a request in flight: the victim drains, stays up, then goes
            for wid in reg.workers:
                assert await store.try_reserve(wid, f"req-{wid}", None)
            await act.apply({"mixed": 2})
            (victim,) = act.draining()
            victim_cid = act._victims[victim]
            assert victim not in {ws.id for ws in reg.rotation("tiny")}
            await asyncio.sleep(1.5)
            assert running(victim_cid) and victim in reg.workers, "stopped with a request in flight"
            for wid in list(reg.workers):
                await store.release(wid, f"req-{wid}")
            await poll(lambda: victim not in reg.workers and not running(victim_cid), timeout=30,
                       what="the drained container stopped")
            await poll(lambda: len(listed(project)) == 2, timeout=30, what="docker-compose listing two containers")

            # and back to 1
            await act.apply({"mixed": 1})
            await poll(lambda: len(reg.workers) == 1 and len(listed(project)) == 1, timeout=30, what="one container")
            (last,) = listed(project)
            await poll(lambda: resolved(last, "sim") == worker_ips(gw), timeout=10, what="DNS naming the last one")

            # a container killed behind the actuator's back: its worker goes, a new container takes its place
            await act.apply({"mixed": 2})
            await poll(grown_to(2), timeout=60, what="two healthy workers again")
            (killed,) = listed(project) - {last}
            docker("kill", killed)
            await poll(grown_to(2), timeout=60, what="a replacement for the killed container")
            assert not running(killed) and killed not in act.by_ip.values()   # compose lists it as exited
            assert len(reg.workers) == 2 and worker_ips(gw) == set(act.by_ip)
        finally:
            await act.stop()
