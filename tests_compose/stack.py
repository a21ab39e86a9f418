"""The compose stack of docker-compose.yml, driven as a user drives it: `docker-compose` (Debian's 1.29, or the
Compose v2 plugin) for the project, `docker` for single containers, HTTP on the published ports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.helpers import free_port, metric

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "fleetgate-test"
PROFILES = ("ha", "autoscale")  # every profile the tests start (down removes what they started)


def compose_command() -> list[str]:
    """Debian's docker-compose when installed, else the Compose v2 plugin: both read the same file."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


def docker(*args: str, timeout: float = 120.0, check: bool = True) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def build_images() -> dict[str, str]:
    """scripts/compose_images.sh: stand-in images from Debian's packages; returns the compose image variables."""
    r = subprocess.run([str(ROOT / "scripts/compose_images.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200, env={**os.environ, "PYTHON": sys.executable})  # the venv's pip builds wheels
    assert r.returncode == 0, f"scripts/compose_images.sh failed:\n{r.stderr[-3000:]}"
    return dict(line.split("=", 1) for line in r.stdout.split() if "=" in line)


@dataclass
class Stack:
    images: dict[str, str]
    commands: list[tuple[str, ...]] = field(default_factory=list)  # every `docker-compose ...` run, in order
    ports: dict[str, int] = field(default_factory=lambda: {
        "FLEETGATE_PORT": free_port(), "FLEETGATE_HA_PORT": free_port(), "FLEETGATE_AUTOSCALE_PORT": free_port(),
        "PROMETHEUS_PORT": free_port(), "GRAFANA_PORT": free_port()})

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **self.images, **{k: str(v) for k, v in self.ports.items()},
                "COMPOSE_PROJECT_NAME": PROJECT}

    def compose(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """`docker-compose ARGS` in the repository, as the docs write it (project name from the environment)."""
        self.commands.append(args)
        r = subprocess.run([*compose_command(), *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return r

    def down(self) -> None:
        profiles = [a for p in PROFILES for a in ("--profile", p)]
        self.compose(*profiles, "down", "-v", "--remove-orphans", "--timeout", "5")

    def url(self, port_var: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_var]}"

    # --- what the project has on the Docker host ----------------------------------------------------------------
    def containers(self, service: str | None = None, *, running: bool = True) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return docker("ps", "-q", *([] if running else ["-a"]), *filters).split()

    def networks(self) -> list[str]:
        return docker("network", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").split()

    def volumes(self) -> list[str]:
        """Named volumes of the project and every volume mounted into one of its containers (anonymous ones
        carry no project label)."""
        named = docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").split()
        ids = self.containers(running=False)
        mounts = json.loads(docker("inspect", *ids)) if ids else []
        return sorted(set(named) | {m["Name"] for c in mounts for m in c["Mounts"] if m["Type"] == "volume"})

    def health(self, container: str) -> str:
        return docker("inspect", "-f", "{{.State.Health.Status}}", container).strip()

    def wait_healthy(self, service: str, count: int, timeout: float = 120.0) -> list[str]:
        """The service's running containers once `count` of them report healthy."""
        deadline = time.monotonic() + timeout
        while True:
            ids = self.containers(service)
            states = [self.health(c) for c in ids]
            if len(ids) == count and all(s == "healthy" for s in states):
                return ids
            assert time.monotonic() < deadline, f"{service}: {states} after {timeout:g} s, want {count} healthy"
            time.sleep(1.0)

    def container_ip(self, container: str) -> str:
        nets = json.loads(docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", container))
        return next(iter(nets.values()))["IPAddress"]

    # --- the gateway's view -----------------------------------------------------------------------------------
    def gateway_metrics(self, port_var: str = "FLEETGATE_PORT") -> str:
        return httpx.get(self.url(port_var) + "/metrics", timeout=5).text

    def healthy_workers(self, port_var: str = "FLEETGATE_PORT") -> set[str]:
        """Worker ids the gateway has in rotation (fleetgate_worker_healthy == 1)."""
        text = self.gateway_metrics(port_var)
        return {m.group(1) for m in re.finditer(r'^fleetgate_worker_healthy\{worker="([^"]+)"\} 1\.0$', text, re.M)}

    def gauge(self, name: str, labels: dict[str, str] | None = None, port_var: str = "FLEETGATE_PORT") -> float | None:
        return metric(self.gateway_metrics(port_var), name, labels)
