"""Fixtures of the tests against the real Docker daemon (`make test-docker`): a tiny worker image imported
from Debian's busybox-static (no registry needed), and compose projects that are taken down, with every
container and network they had, whatever the test did.

    def test_x(compose_project):
        project = compose_project(COMPOSE_YAML)      # `docker-compose -p fgtest-... up -d`; down at teardown
        project.compose("ps", "-q")
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import require_command

IMAGE = "fleetgate-test-busybox:1"
APPLETS = ("sh", "mkdir", "httpd", "wget", "nslookup", "sleep", "cat")


def docker(*args: str, check: bool = True, timeout: float = 120, stdin: bytes | None = None) -> str:
    r = subprocess.run(["docker", *args], input=stdin, capture_output=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {r.stderr.decode(errors='replace')}")
    return r.stdout.decode()


@pytest.fixture(scope="session")
def worker_image() -> str:
    """A busybox image (httpd, wget, nslookup) made by `docker import` of Debian's static busybox."""
    require_command("docker", "docker.io")
    busybox = Path(require_command("busybox", "busybox-static"))
    info = subprocess.run(["docker", "info"], capture_output=True, timeout=60)
    if info.returncode != 0:
        pytest.fail(f"no Docker daemon answers (start dockerd): {info.stderr.decode(errors='replace')[:300]}")
    if docker("images", "-q", IMAGE).strip():
        return IMAGE
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(busybox, arcname="bin/busybox")
        for name in APPLETS:
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        for d in ("tmp", "etc"):
            dirinfo = tarfile.TarInfo(d)
            dirinfo.type, dirinfo.mode = tarfile.DIRTYPE, 0o1777
            tar.addfile(dirinfo)
    docker("import", "--change", "ENV PATH=/bin", "-", IMAGE, stdin=buf.getvalue())
    return IMAGE


@dataclass
class ComposeProject:
    name: str
    file: Path

    def compose(self, *args: str, check: bool = True) -> str:
        r = subprocess.run(["docker-compose", "-p", self.name, "-f", str(self.file), *args], capture_output=True,
                           timeout=180)
        if check and r.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} failed: {r.stderr.decode(errors='replace')}")
        return r.stdout.decode()


@pytest.fixture
def compose_project(worker_image: str, tmp_path: Path) -> Iterator[Callable[[str], ComposeProject]]:
    require_command("docker-compose", "docker-compose")
    made: list[ComposeProject] = []

    def up(yaml_text: str) -> ComposeProject:
        f = tmp_path / "docker-compose.yml"
        f.write_text(yaml_text)
        project = ComposeProject(f"fgtest-{uuid.uuid4().hex[:8]}", f)
        made.append(project)
        project.compose("up", "-d")
        return project

    yield up
    for project in made:   # compose's own down, then whatever carries the project's label (made by the test)
        project.compose("down", "-v", "--remove-orphans", "-t", "1", check=False)
        label = f"label=com.docker.compose.project={project.name}"
        left = docker("ps", "-aq", "--filter", label, check=False).split()
        if left:
            docker("rm", "-f", "-v", *left, check=False)
        nets = docker("network", "ls", "-q", "--filter", label, check=False).split()
        if nets:
            docker("network", "rm", *nets, check=False)
