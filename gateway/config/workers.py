"""Config of the workers and the connection to them: static workers, DNS discovery, upstream client, TLS,
timeouts, health checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import _Strict, check_worker_id


class KvEventsSource(_Strict):
    """Where one worker publishes vLLM's KV-cache events (its --kv-events-config, as the gateway reaches it)."""

    endpoint: str = Field(description="The publisher's ZMQ address, tcp://host:port; a * or 0.0.0.0 host "
                                      "means the worker URL's host.")
    replay_endpoint: str | None = Field(
        None, description="The publisher's replay ROUTER, asked for the events of a gap.")
    topic: str = Field("", description="ZMQ topic to subscribe to (empty: every topic).")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(tcp://\S+:\d{1,5}|ipc://\S+|inproc://\S+)$", v):
            raise ValueError("must be a ZMQ address such as tcp://10.0.0.5:5557")
        return v


class WorkerConfig(_Strict):
    id: str = Field(description="Unique worker id: 1-128 characters from A-Z a-z 0-9 . _ : - (used in metric"
                                " labels and Redis keys).")
    url: str = Field(description="The worker's base URL, http(s)://host[:port][/prefix].")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="mixed serves whole requests; prefill and decode are the two legs of P/D "
                             "disaggregation.")
    models: list[str] = Field(default_factory=list,
                              description="Models it serves; empty: discovered from the worker's /v1/models.")
    labels: dict[str, str] = Field(default_factory=dict,
                                   description="Free-form labels; `pool` names its autoscaling pool "
                                               "(interactive, mixed, batch), `weight` its share for weighted"
                                               " policies.")
    profile: str = Field("",
                         description="Its performance profile (a built-in simulator profile, a profile file "
                                     "or a learning.priors entry); SLO-aware policies need it.")
    cap: int | None = Field(None, ge=1,
                            description="Most requests the gateway puts on it at once (None: no gateway "
                                        "cap).")
    kv_events: KvEventsSource | None = Field(
        None, description="Its KV-event publisher (else discovered, see kv_events.discover).")

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        return check_worker_id(v)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return check_worker_url(v)


class WorkerDiscoveryConfig(_Strict):
    """Workers found by DNS (gateway/fleet/discovery.py): every address a name resolves to (A/AAAA) is a worker.

    Not `discovery_interval_s`: that one re-reads the /v1/models of workers already known; this one finds the
    workers. A worker found here starts with no models and gets them from its /v1/models the same way, re-read
    every `discovery_interval_s`."""

    dns: str = Field(description="Host name resolved on every round, e.g. a compose service (`sim`) or a "
                                 "Kubernetes headless Service (`vllm-mixed`); each A/AAAA address is a worker")
    port: int = Field(ge=1, le=65535, description="Port of the workers' HTTP server at every address")
    scheme: Literal["http", "https"] = Field("http", description="Worker URL scheme (https: see upstream.tls)")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels of every worker found (e.g. pool)")
    role: Literal["mixed", "prefill", "decode"] = Field("mixed", description="Role of every worker found")
    cap: int | None = Field(None, ge=1, description="Requests in flight the gateway puts on each worker found, "
                                                    "across all replicas (None: no cap)")
    interval_s: float = Field(5.0, gt=0, description="Seconds between two resolutions of `dns`")
    family: Literal["any", "ipv4", "ipv6"] = Field(
        "any", description="Which records make workers: A and AAAA (any), A only or AAAA only. On a dual-stack "
                           "network a worker has both: choose one there, else each worker counts twice")
    nameservers: list[str] = Field(
        default_factory=list,
        description="DNS servers to ask, `IP` or `IP:PORT` ([IPv6]:PORT), e.g. Consul's DNS on 127.0.0.1:8600; "
                    "empty: the system resolver (/etc/hosts, /etc/resolv.conf, search domains). Needs dnspython")
    id_prefix: str | None = Field(
        None, description="Worker ids are `PREFIX-ADDRESS:PORT` (stable per address); default: the first label "
                          "of `dns`")
    drain_timeout_s: float = Field(60.0, gt=0, description="An address gone from DNS is drained (no new "
                                   "requests); its in-flight requests get this long before it leaves the registry")

    @field_validator("dns")
    @classmethod
    def _host_name(cls, v: str) -> str:
        if not re.match(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_-]{1,63})*\.?$", v):
            raise ValueError("must be a DNS name such as `sim` or `vllm-mixed.fleetgate.svc.cluster.local`")
        return v

    @field_validator("nameservers")
    @classmethod
    def _addresses(cls, v: list[str]) -> list[str]:
        for ns in v:
            parse_nameserver(ns)
        return v

    @field_validator("id_prefix")
    @classmethod
    def _prefix_chars(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9._:-]{1,64}$", v):
            raise ValueError("must be 1-64 characters from A-Z a-z 0-9 . _ : -")
        return v

    def prefix(self) -> str:
        return self.id_prefix or self.dns.split(".")[0]

    def worker_id(self, address: str) -> str:
        return f"{self.prefix()}-{address}:{self.port}"

    def worker_url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"


def parse_nameserver(v: str) -> tuple[str, int]:
    """`IP`, `IP:PORT`, `[IPv6]:PORT` or a bare IPv6 address -> (ip, port)."""
    import ipaddress

    m = re.match(r"^\[([0-9A-Fa-f:.]+)\](?::(\d{1,5}))?$", v) or re.match(r"^([0-9.]+)(?::(\d{1,5}))?$", v)
    host, port = (m.group(1), int(m.group(2) or 53)) if m else (v, 53)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"nameserver {v!r}: expected an IP address, IP:PORT or [IPv6]:PORT") from None
    if not 0 < port < 65536:
        raise ValueError(f"nameserver {v!r}: port must be 1-65535")
    return host, port


def check_worker_url(v: str) -> str:
    """A worker base URL: http(s)://host[:port][/prefix], returned without a trailing slash."""
    m = re.match(r"^https?://([^/:\s]+|\[[0-9a-fA-F:]+\])(:(\d{1,5}))?(/\S*)?$", v)
    if not m:
        raise ValueError("must be an http:// or https:// URL such as http://10.0.0.5:8000")
    if m.group(3) and not 0 < int(m.group(3)) < 65536:
        raise ValueError("port must be 1-65535")
    return v.rstrip("/")


class TimeoutsConfig(_Strict):
    connect_s: float = Field(3.0, gt=0, description="Connecting to a worker.")
    first_byte_s: float = Field(300.0, gt=0, description=(
        "Until the worker's response headers. vLLM sends them at once for streams, but only with the finished "
        "answer for non-streaming requests, so this bounds a non-streaming generation. For a stream it is only "
        "the upper cap: a stream that has not started is judged by the stall rule (resume.stall_factor x its "
        "predicted time to first token on that worker, or its pace), as are P/D prefill legs."))
    idle_s: float = Field(60.0, gt=0, description="Between two chunks of a stream.")


class UpstreamTlsConfig(_Strict):
    """TLS to `https://` workers (gateway/wire/upstream.py TlsSettings)."""

    verify: bool = Field(True, description="Check the worker's certificate and host name.")
    ca_bundle: str | None = Field(None, description="PEM file of the CAs to trust (default: the system's).")
    client_cert: str | None = Field(None,
                                    description="PEM certificate to present to workers that ask for one.")
    client_key: str | None = Field(None, description="Its private key, when not in client_cert.")

    @field_validator("ca_bundle", "client_cert", "client_key")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no such file: {v!r}")
        return v

    @model_validator(mode="after")
    def _key_needs_cert(self) -> UpstreamTlsConfig:
        if self.client_key is not None and self.client_cert is None:
            raise ValueError("client_key is set without client_cert")
        return self


class UpstreamConfig(_Strict):
    """The one HTTP client to workers (gateway/wire/upstream.py): relaying, health checks, scrapes, discovery, webhooks."""

    max_connections: int | None = Field(
        None, ge=1, description="Connections to all workers together; None: no limit.")
    max_connections_per_host: int | None = Field(
        None, ge=1, description="Connections per worker (scheme, host, port); None: no limit.")
    pool_timeout_s: float = Field(10.0, gt=0,
                                  description="A request waits this long for a connection at the limit.")
    keepalive_expiry_s: float = Field(
        4.0, gt=0, description="Idle connections are not reused after this long: below the worker's own "
                               "keep-alive (vLLM's uvicorn: 5 s).")
    dns_cache_ttl_s: float = Field(300.0, ge=0,
                                   description="A host name is resolved once per this long; 0: on every "
                                               "connect.")
    tls: UpstreamTlsConfig = Field(default_factory=UpstreamTlsConfig, description="TLS to https:// workers.")


class HealthConfig(_Strict):
    interval_s: float = Field(2.0, gt=0, description="Each worker's health is checked this often.")
    timeout_s: float = Field(1.0, gt=0, description="A health check answering nothing this long failed.")
    failures_to_eject: int = Field(2, ge=1,
                                   description="Failed checks in a row that take a worker out of rotation.")
    successes_to_restore: int = Field(2, ge=1, description="Passed checks in a row that bring it back.")
