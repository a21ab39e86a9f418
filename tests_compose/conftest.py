"""`make test-compose`: docker-compose.yml brought up for real as the project `fleetgate-test`.

Needs a running Docker daemon, docker-compose (or the Compose v2 plugin) and debootstrap (.ci/run installs and
starts them). The images are stand-ins built from Debian's packages by scripts/compose_images.sh (no registry);
Grafana has none, so the stack runs with `--scale grafana=0`. Whatever happens, the project is taken down with
`down -v` at the end; test_down_leaves_nothing asserts that nothing of it remains."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import poll_sync
from tests_compose.stack import Stack, build_images, docker

UP = ("up", "-d", "--scale", "grafana=0")  # docs/deploy.md's `docker-compose up -d`, without Grafana


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    assert shutil.which("docker"), "docker is needed: apt-get install docker.io (.ci/run does)"
    docker("info", timeout=30)  # a daemon answers
    s = Stack(images=build_images())
    s.down()  # leftovers of an interrupted run
    try:
        s.compose(*UP)
        s.wait_healthy("gateway", 1)
        poll_sync(lambda: httpx.get(s.url("FLEETGATE_PORT") + "/ready", timeout=5).status_code == 200,
                  timeout=60, what="the gateway's /ready", every=0.5)
        yield s
    finally:
        s.down()
