"""The `docker` actuator: a pool's workers are the containers of a compose service, and scaling creates and
removes them through the Docker Engine API on its unix socket (`autoscale.actuator.docker`).

Why httpx on the socket and not the `docker` SDK: the handful of calls needed here (list, inspect, create,
connect, start, stop, remove) are plain JSON requests, and httpx's transport speaks HTTP over a unix socket
natively and asynchronously, so no call holds the event loop or a thread; the SDK is synchronous (requests
underneath: a thread per call) and its high-level objects would hide the compose labels this module must copy.
httpx is the optional extra `fleetgate[docker]`.

Scale-out copies a running container of the service (its template): image, command, entrypoint, environment,
working dir, user, healthcheck, exposed ports, host settings (fixed published host ports dropped: a second
container could not bind them), and every network with the service's aliases, so Docker's DNS resolves the
service name to the new container too and `worker_discovery` finds it. The labels are compose's own, with the
next `com.docker.compose.container-number`, so `docker-compose ps` lists the container and `up` keeps it (same
config hash). The actuator registers the container's worker itself, as `SERVICE-IP:PORT`: the id a
`worker_discovery` entry for the service name gives it, so the two agree when both run. A new container counts
as pending until its worker passes its health check; one not healthy within `start_timeout_s` is removed.

Scale-in: the victim (any container of the service) is drained first (gateway/control/actuators.py ManagedActuator:
no new requests, in-flight ones finish or `drain_timeout_s` passes), then stopped (SIGTERM, SIGKILL after
`stop_timeout_s`) and removed. A container still starting is removed at once.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from gateway.control.actuators import ActuatorContext, ManagedActuator
from gateway.state.base import WorkerRecord

if TYPE_CHECKING:
    import httpx

    from gateway.config import DockerActuatorConfig
    from gateway.fleet.registry import WorkerState

log = logging.getLogger("fleetgate.actuators")

PROJECT = "com.docker.compose.project"
SERVICE = "com.docker.compose.service"
NUMBER = "com.docker.compose.container-number"
ONEOFF = "com.docker.compose.oneoff"
# What a new container takes from its template's Config (Hostname and Domainname stay its own).
COPIED = ("Image", "Cmd", "Entrypoint", "Env", "WorkingDir", "User", "Healthcheck", "ExposedPorts", "StopSignal",
          "StopTimeout", "Tty", "OpenStdin", "Volumes")


class DockerError(Exception):
    """The Docker Engine answered a call with an error (or could not be reached)."""


class DockerEngine:
    """The Docker Engine API calls the actuator makes, over the unix socket."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        try:
            import httpx
        except ImportError:
            raise DockerError("autoscale.actuator.kind docker needs httpx (pip install 'fleetgate[docker]')") from None
        self._errors = (httpx.HTTPError,)
        self._client: httpx.AsyncClient = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url="http://docker", timeout=timeout_s)

    async def call(self, method: str, path: str, params: dict[str, Any] | None = None,
                   body: dict[str, Any] | None = None) -> Any:
        try:
            r = await self._client.request(method, path, params=params,
                                           content=orjson.dumps(body) if body is not None else None,
                                           headers={"Content-Type": "application/json"} if body is not None else None)
        except self._errors as e:
            raise DockerError(f"{method} {path}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            try:
                why = orjson.loads(r.content).get("message", "")
            except orjson.JSONDecodeError:
                why = r.text[:200]
            raise DockerError(f"{method} {path}: {r.status_code} {why}")
        return orjson.loads(r.content) if r.content else None

    async def containers(self, labels: dict[str, str], running_only: bool = True) -> list[dict[str, Any]]:
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        params = {"filters": orjson.dumps(filters).decode(), "all": "0" if running_only else "1"}
        return await self.call("GET", "/containers/json", params)

    async def inspect(self, container: str) -> dict[str, Any]:
        return await self.call("GET", f"/containers/{container}/json")

    async def close(self) -> None:
        await self._client.aclose()


@dataclass
class _Starting:
    pool: str
    worker_id: str
    since: float


class DockerActuator(ManagedActuator):
    kind = "docker"

    def __init__(self, ctx: ActuatorContext, cfg: DockerActuatorConfig) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self.engine: DockerEngine | None = None
        self.project = cfg.project or ""
        self.starting: dict[str, _Starting] = {}    # container id -> a container we created, not healthy yet
        self.by_ip: dict[str, str] = {}              # address of a container of our services -> its id
        self._victims: dict[str, str] = {}           # worker id being drained -> its container
        self._warned: set[str] = set()

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.engine = DockerEngine(self.cfg.socket)
        if not self.project:
            self.project = await self._own_project()
        log.info("docker actuator: compose project %s, services %s", self.project,
                 ", ".join(f"{p}={s}" for p, s in sorted(self.cfg.services.items())))
        for pool, service in sorted(self.cfg.services.items()):   # the service's running containers are workers
            for c in await self.engine.containers(self._labels(service)):
                with contextlib.suppress(DockerError):   # gone since it was listed
                    await self._register(c["Id"], pool, service)

    async def stop(self) -> None:
        await super().stop()
        if self.engine is not None:
            await self.engine.close()
            self.engine = None

    async def _own_project(self) -> str:
        assert self.engine is not None
        try:
            me = await self.engine.inspect(socket.gethostname())
        except DockerError as e:
            raise DockerError(f"autoscale.actuator.docker.project is not set and the gateway's own container "
                              f"cannot be inspected to read it: {e}") from None
        project = (me["Config"].get("Labels") or {}).get(PROJECT)
        if not project:
            raise DockerError("autoscale.actuator.docker.project is not set and the gateway's container has no "
                              f"{PROJECT} label (not started by compose?)")
        return project

    def _labels(self, service: str) -> dict[str, str]:
        return {PROJECT: self.project, SERVICE: service, ONEOFF: "False"}

    # --- what ManagedActuator asks --------------------------------------------------------------------
    def owns(self, ws: WorkerState) -> bool:
        return (urlsplit(ws.rec.url).hostname or "") in self.by_ip

    def pending_ids(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for cid, s in sorted(self.starting.items(), key=lambda kv: kv[1].since):
            out.setdefault(s.pool, []).append(cid)
        return out

    async def apply(self, desired: dict[str, int]) -> None:
        await self._refresh()
        await super().apply(desired)

    async def _refresh(self) -> None:
        """Which containers run (their addresses), which new ones are healthy now, which took too long."""
        assert self.engine is not None
        by_ip: dict[str, str] = {}
        for service in set(self.cfg.services.values()):
            for c in await self.engine.containers(self._labels(service)):
                for net in ((c.get("NetworkSettings") or {}).get("Networks") or {}).values():
                    if net.get("IPAddress"):
                        by_ip[net["IPAddress"]] = c["Id"]
                    if net.get("GlobalIPv6Address"):
                        by_ip[net["GlobalIPv6Address"]] = c["Id"]
        self.by_ip = by_ip
        reg = self.ctx.registry
        for wid, ws in list(reg.workers.items()):   # its container died or was removed by hand
            if (ws.rec.source == "docker" and wid not in self._draining
                    and (urlsplit(ws.rec.url).hostname or "") not in by_ip):
                log.warning("docker actuator: worker %s has no running container any more; removing it", wid)
                await reg.remove(wid)
        now = time.monotonic()
        for cid, s in list(self.starting.items()):
            ws = reg.workers.get(s.worker_id)
            if ws is not None and ws.healthy:
                del self.starting[cid]
                log.info("container %s is worker %s, in rotation", cid[:12], s.worker_id)
            elif cid not in by_ip.values():
                log.warning("container %s (worker %s) stopped before it became healthy; removing it", cid[:12],
                            s.worker_id)
                await self.cancel(cid)
            elif now - s.since > self.cfg.start_timeout_s:
                log.warning("container %s (worker %s) not healthy after %.0f s; removing it", cid[:12],
                            s.worker_id, now - s.since)
                await self.cancel(cid)

    async def provision(self, pool: str) -> None:
        service = self.cfg.services.get(pool)
        if service is None:
            if pool not in self._warned:
                self._warned.add(pool)
                log.warning("docker actuator: no service for pool %s (autoscale.actuator.docker.services); "
                            "not scaling it", pool)
            return
        try:
            cid = await self._create(service)
            wid = await self._register(cid, pool, service)
        except DockerError as e:
            log.warning("docker actuator: cannot start a container of %s: %s", service, e)
            return
        if wid is not None:
            self.starting[cid] = _Starting(pool, wid, time.monotonic())

    async def drain(self, worker_id: str) -> None:
        ws = self.ctx.registry.workers.get(worker_id)
        if ws is not None:
            cid = self.by_ip.get(urlsplit(ws.rec.url).hostname or "")
            if cid is not None:
                self._victims[worker_id] = cid
        await super().drain(worker_id)

    async def release(self, worker_id: str) -> None:
        cid = self._victims.pop(worker_id, None)
        if cid is not None:
            await self._remove(cid, self.cfg.stop_timeout_s)

    async def cancel(self, worker_id: str) -> bool:
        """`worker_id` here is a starting container's id (pending_ids)."""
        s = self.starting.pop(worker_id, None)
        if s is None:
            return False
        await self.ctx.registry.remove(s.worker_id)
        await self._remove(worker_id, 0)
        return True

    # --- containers ---------------------------------------------------------------------------------
    async def _create(self, service: str) -> str:
        assert self.engine is not None
        every = await self.engine.containers(self._labels(service), running_only=False)
        running = sorted((c for c in every if c.get("State") == "running"),
                         key=lambda c: int(c["Labels"].get(NUMBER, "0") or 0))
        if not running:
            raise DockerError(f"no running container of service {service} in project {self.project} to copy")
        template = await self.engine.inspect(running[0]["Id"])
        number = 1 + max(int(c["Labels"].get(NUMBER, "0") or 0) for c in every)
        name, body, extra = container_spec(template, service, number)
        created = await self.engine.call("POST", "/containers/create", {"name": name}, body)
        cid = created["Id"]
        try:
            for net, aliases in extra.items():
                await self.engine.call("POST", f"/networks/{net}/connect", None,
                                       {"Container": cid, "EndpointConfig": {"Aliases": aliases}})
            await self.engine.call("POST", f"/containers/{cid}/start")
        except DockerError:
            await self._remove(cid, 0)
            raise
        log.info("docker actuator: started container %s (%s, %s)", name, cid[:12], template["Config"]["Image"])
        return cid

    async def _register(self, cid: str, pool: str, service: str) -> str | None:
        """Add the container's worker to the registry (its first address); its id, or None without one."""
        assert self.engine is not None
        info = await self.engine.inspect(cid)
        address = container_address(info)
        if address is None:
            log.warning("docker actuator: container %s has no network address; not a worker", cid[:12])
            return None
        self.by_ip[address] = cid
        host = f"[{address}]" if ":" in address else address
        wid = f"{service}-{address}:{self.cfg.port}"
        if wid not in self.ctx.registry.workers:
            await self.ctx.registry.add(WorkerRecord(id=wid, url=f"http://{host}:{self.cfg.port}",
                                                     labels={"pool": pool}, source="docker"))
        return wid

    async def _remove(self, cid: str, stop_timeout_s: int) -> None:
        assert self.engine is not None
        with contextlib.suppress(DockerError):    # already stopped, or gone
            await self.engine.call("POST", f"/containers/{cid}/stop", {"t": str(stop_timeout_s)})
        try:
            await self.engine.call("DELETE", f"/containers/{cid}", {"force": "1", "v": "1"})
        except DockerError as e:
            log.warning("docker actuator: cannot remove container %s: %s", cid[:12], e)
            return
        for ip, c in list(self.by_ip.items()):
            if c == cid:
                del self.by_ip[ip]
        log.info("docker actuator: stopped and removed container %s", cid[:12])


def container_spec(template: dict[str, Any], service: str,
                   number: int) -> tuple[str, dict[str, Any], dict[str, list[str]]]:
    """(name, create body, {other network: aliases}) of container `number` of `service`, copied from the inspect
    of a running container of it. Its first network comes with the create; the others are connected after."""
    config, host = template["Config"], dict(template["HostConfig"])
    labels = dict(config.get("Labels") or {})
    project = labels.get(PROJECT, "")
    labels[NUMBER], labels[ONEOFF] = str(number), "False"
    body: dict[str, Any] = {k: config[k] for k in COPIED if config.get(k) is not None}
    body["Labels"] = labels
    bindings = host.get("PortBindings") or {}   # a fixed host port could not be bound twice: keep ephemeral ones
    host["PortBindings"] = {p: [b for b in bs if not b.get("HostPort")] for p, bs in bindings.items()}
    body["HostConfig"] = host
    own = {template["Id"][:12], (config.get("Hostname") or ""), template.get("Name", "").lstrip("/")}
    networks = {name: [a for a in (ep.get("Aliases") or []) if a not in own] or [service]
                for name, ep in (template["NetworkSettings"].get("Networks") or {}).items()}
    first = host.get("NetworkMode") if host.get("NetworkMode") in networks else next(iter(networks), None)
    if first is not None:
        body["NetworkingConfig"] = {"EndpointsConfig": {first: {"Aliases": networks[first]}}}
    old = template.get("Name", "").lstrip("/")
    sep = "-" if old.startswith(f"{project}-{service}-") else "_"
    return f"{project}{sep}{service}{sep}{number}", body, {n: a for n, a in networks.items() if n != first}


def container_address(info: dict[str, Any]) -> str | None:
    """The container's address on its first network (the one it was created with)."""
    networks = (info.get("NetworkSettings") or {}).get("Networks") or {}
    mode = (info.get("HostConfig") or {}).get("NetworkMode")
    ordered = [networks[mode]] if mode in networks else []
    for ep in [*ordered, *networks.values()]:
        if ep.get("IPAddress") or ep.get("GlobalIPv6Address"):
            return ep.get("IPAddress") or ep.get("GlobalIPv6Address")
    return None
