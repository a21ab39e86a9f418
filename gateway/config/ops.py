"""Config of the gateway's own server and what operators see: listen, server, logs, tracing, metrics, admin,
status page, batch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import MiB, _Strict


class ListenConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on; 0 picks a free one.")


class LoggingConfig(_Strict):
    """Process logs (gateway/ops/logs.py) and the per-request access log (gateway/ops/access_log.py)."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level: debug, info, warning or error.")
    format: Literal["text", "logfmt", "json"] = Field("text", description="Log lines: text, logfmt or json.")
    access_log: bool = Field(True, description="One line per request (gateway/ops/access_log.py).")
    rate_limit_window_s: float = Field(
        10.0, gt=0, description="The same message is logged at most `rate_limit_burst` times per window.")
    rate_limit_burst: int = Field(5, ge=1,
                                  description="Repeats of one message logged per rate_limit_window_s.")


class TracingConfig(_Strict):
    """OpenTelemetry spans per request (gateway/ops/tracing.py; needs the `tracing` extra)."""

    enabled: bool = Field(False, description="Export OpenTelemetry spans (needs the `tracing` extra).")
    service_name: str = Field("fleetgate", description="The spans' service.name.")
    otlp_endpoint: str | None = Field(
        None, description="Where spans go, e.g. http://otel-collector:4318/v1/traces (OTLP/HTTP); None: "
                          "spans are made but not exported.")
    headers: dict[str, str] = Field(default_factory=dict,
                                    description="Extra HTTP headers sent with every export.")
    timeout_s: float = Field(10.0, gt=0, description="An export answering nothing this long has failed.")
    sample_ratio: float = Field(1.0, ge=0, le=1,
                                description="Fraction of the traces the gateway starts that are sampled (a "
                                            "sampled parent wins).")


class AdminConfig(_Strict):
    worker_hosts: list[str] = Field(default_factory=list,
                                    description="Hosts a worker added through the admin API may be on: names"
                                                " (`gpu-1.internal`), wildcards (`*.svc`), addresses and "
                                                "networks (`10.0.0.0/8`). Always allowed too: loopback and "
                                                "the configured workers' hosts.")


class MetricsConfig(_Strict):
    auth: bool = Field(False,
                       description="/metrics requires `Authorization: Bearer <metrics.key or the admin "
                                   "key>`.")
    key: str | None = Field(None, min_length=16,
                            description="A key for /metrics only (at least 16 characters).")


class StatusConfig(_Strict):
    """The status page's numbers and history (gateway/ops/status_history.py): a fixed-size ring buffer in memory,
    sampled from the gateway's own counters; no other service."""

    sample_s: float = Field(5.0, gt=0, description="Seconds between two history samples (one sparkline point).")
    history_s: float = Field(900.0, gt=0, description="How far back the sparklines reach; history_s / sample_s "
                             "points are kept per model and worker (at most 3600).")
    window_s: float = Field(60.0, gt=0, description="The current request rate, latency percentiles, error "
                            "counts and worker throughput cover the last this many seconds.")

    @model_validator(mode="after")
    def _bounded(self) -> StatusConfig:
        if max(self.history_s, self.window_s) / self.sample_s > 3600:
            raise ValueError("history_s / sample_s and window_s / sample_s must be at most 3600 samples (memory is "
                             "kept bounded)")
        return self


class ServerConfig(_Strict):
    """Limits on what clients can make the gateway hold (gateway/wire/client_limits.py)."""

    header_timeout_s: float = Field(10.0, gt=0,
                                    description="From a request's first byte to the end of its headers.")
    body_timeout_s: float = Field(30.0, gt=0,
                                  description="The longest gap between two pieces of a request body.")
    keepalive_s: float = Field(5.0, gt=0,
                               description="An idle client connection (new, or between requests) is closed "
                                           "after this long.")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="Request line plus headers; beyond: 431.")
    max_headers: int = Field(100, ge=8, description="Header lines; beyond: 431.")
    max_connections: int = Field(4096, ge=1, description="Open client connections; beyond: closed at once.")
    drain_timeout_s: float = Field(30.0, ge=0, description=(
        "On SIGTERM, how long requests in flight may take to finish (/ready answers 503 at once, new requests "
        "get 503 with Retry-After); those still running then end with an error event. Give the orchestrator's "
        "grace period more than this."))
    trusted_proxies: list[str] = Field(
        default_factory=list, description="Peers (addresses or networks) whose X-Forwarded-For is kept (the "
                                          "client address is appended to it); others' is replaced.")

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        import ipaddress

        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network") from None
        return v


class BatchConfig(_Strict):
    """OpenAI Files + Batches API and the runner that feeds queued batch requests to spare capacity
    (gateway/api/batch.py, gateway/batch/runner.py)."""

    enabled: bool = Field(True,
                          description="Serve the OpenAI Files and Batches API and run queued batch requests.")
    max_file_bytes: int = Field(100 * MiB, ge=1024, description="Largest uploaded JSONL file.")
    max_requests: int = Field(50_000, ge=1, description="Lines in one batch input file.")
    poll_s: float = Field(0.1, gt=0, description="The runner looks for spare capacity this often.")
    lease_s: float = Field(10.0, gt=0,
                           description="A claimed request returns to the queue if not renewed within this "
                                       "long.")
    slots_per_worker: int = Field(8, ge=1, description="Batch requests per worker that has no cap.")
    max_inflight: int = Field(256, ge=1, description="Batch requests this replica runs at once.")
    file_ttl_s: float = Field(30 * 86_400.0, gt=0,
                              description="Files expire this long after upload unless the upload sets "
                                          "expires_after.")
    storage_per_key_bytes: int = Field(
        1024 * MiB, ge=1024, description="Bytes of files one key may keep (uploads beyond: refused).")
