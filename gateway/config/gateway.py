"""The whole configuration (`GatewayConfig`) and where its values come from: the YAML file, FLEETGATE_*
environment variables, aliases.
"""

from __future__ import annotations

import contextvars
import os
import re
from typing import Any

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.config.autoscale import AutoscaleConfig, DeploymentConfig, ReplanConfig
from gateway.config.models import (
    KvEventsConfig,
    LearningConfig,
    ModelConfig,
    PdConfig,
    RebalanceConfig,
    ResumeConfig,
    SloClassName,
    SloConfig,
)
from gateway.config.ops import (
    AdminConfig,
    BatchConfig,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
    ServerConfig,
    StatusConfig,
    TracingConfig,
)
from gateway.config.pooling import SharedHostConfig
from gateway.config.responses import ResponsesConfig
from gateway.config.tenancy import AuthConfig, LimitsConfig, ServicePriorityConfig
from gateway.config.workers import (
    HealthConfig,
    TimeoutsConfig,
    UpstreamConfig,
    WorkerConfig,
    WorkerDiscoveryConfig,
)
from policies.base import DEFAULT_POLICY

_FILE_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("fleetgate_file", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The YAML file's contents, below the environment in precedence."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_FILE_DATA.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get() or {})


class _AliasSource(PydanticBaseSettingsSource):
    """Short environment names for nested settings, between the environment and the file in precedence:
    FLEETGATE_ADMIN_KEY is auth.admin_key."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        admin = os.environ.get("FLEETGATE_ADMIN_KEY")
        return {"auth": {"admin_key": admin}} if admin else {}


class GatewayConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEETGATE_", env_nested_delimiter="__", extra="forbid")

    listen: ListenConfig = Field(default_factory=ListenConfig, description="Where the gateway listens.")
    workers: list[WorkerConfig] = Field(
        default_factory=list, description="The workers (vLLM servers) behind the gateway.")
    models: dict[str, ModelConfig] = Field(
        default_factory=dict, description="Per model name: policy, parameters and SLO.")
    # stable names for served models: a request for the alias is served by its target
    aliases: dict[str, str] = Field(
        default_factory=dict, description="Model aliases, name -> served model (e.g. chat-default: "
                                          "meta-llama/Llama-3.1-8B-Instruct): a request for the alias is served by "
                                          "the target, whose name the answer's `model` carries; /v1/models lists "
                                          "the alias with `root` and `parent` = the target. The target must be a "
                                          "configured model and the alias no model's name.")
    slo: SloConfig = Field(default_factory=SloConfig,
                           description="Every model's SLO unless models.<name> sets one.")
    slo_classes: dict[SloClassName, SloConfig] = Field(
        default_factory=dict, description="Per request class (interactive, batch) overrides of `slo`.")
    slo_window_s: float = Field(300.0, gt=0,
                                description="fleetgate_slo_attainment_ratio and the status page's attainment"
                                            " cover this many seconds.")
    learning: LearningConfig = Field(
        default_factory=LearningConfig, description="Online performance models and output-length prediction.")
    default_policy: str = Field(DEFAULT_POLICY,
                                description="Routing policy of models without their own (`fleetgate config "
                                            "check` lists them).")
    default_policy_params: dict[str, Any] = Field(
        default_factory=dict, description="Parameters of default_policy.")
    redis_url: str | None = Field(None,
                                  description="Share state between gateway replicas through Redis (redis://,"
                                              " rediss:// or unix://); None: in-memory state, one replica.")
    redis_key_prefix: str = Field("fg:", min_length=1,
                                  description="Prefix of every Redis key: several fleets (or tests) can "
                                              "share one Redis.")
    redis_lease_block: int = Field(8, ge=1,
                                   description="Slots a replica leases from Redis per worker at a time and "
                                               "hands out locally (gateway/state/redis_store.py \"Leases\");"
                                               " 1: one Redis call per reservation and one per release.")
    replica_id: str | None = Field(None,
                                   description="This replica's id in shared state and on the status page "
                                               "(default: host name and process id).")
    api_keys: list[str] = Field(default_factory=list,
                                description="Inference keys without limits (see auth.keys); none at all: "
                                            "open.")
    auth: AuthConfig = Field(default_factory=AuthConfig,
                             description="Who may call what: the admin key and inference keys with limits.")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="The admin API.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Access to /metrics.")
    server: ServerConfig = Field(default_factory=ServerConfig,
                                 description="Limits on what clients can make the gateway hold.")
    status: StatusConfig = Field(default_factory=StatusConfig,
                                 description="The status page's numbers and history.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig,
                                 description="Request body size, the admission queue and retries.")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Talking to workers.")
    resume: ResumeConfig = Field(default_factory=ResumeConfig,
                                 description="Streams that survive their worker, and hung-worker detection.")
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig,
                                       description="The Responses API's stored conversations (previous_response_id).")
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig,
                                       description="Moving queued requests between workers (Aladdin's "
                                                   "Algorithm 2), for every model unless models.<name> sets "
                                                   "its own.")
    upstream: UpstreamConfig = Field(
        default_factory=UpstreamConfig, description="The HTTP client to workers.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="Health checks of the workers.")
    pd: PdConfig = Field(default_factory=PdConfig, description="Prefill/decode disaggregation.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="The OpenAI Files and Batches API.")
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig, description="Autoscaling.")
    replan: ReplanConfig = Field(default_factory=ReplanConfig,
                                 description="Re-planning the fleet from observed traffic.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Process and access logs.")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry tracing.")
    kv_events: KvEventsConfig = Field(
        default_factory=KvEventsConfig, description="The exact prefix-cache view from the workers' KV-cache "
                                                    "events.")
    deployment: DeploymentConfig | None = Field(
        None, description="A `fleetgate plan` result (capacity plan of the fleet).")
    service_priority: ServicePriorityConfig = Field(
        default_factory=ServicePriorityConfig, description="Priority across the services sharing a model's "
                                                           "workers.")
    shared_hosts: list[SharedHostConfig] = Field(
        default_factory=list, description="Hosts holding several models' engines, swapped through sleep mode"
                                          " (gateway/control/pooling.py).")
    scrape_interval_s: float = Field(0.5, gt=0, description="Each worker's /metrics is read this often.")
    discovery_interval_s: float = Field(
        10.0, gt=0, description="Seconds between two reads of the /v1/models of a worker without configured "
                                "models (configured, added, or found by `worker_discovery`); it finds no workers.")
    worker_discovery: list[WorkerDiscoveryConfig] = Field(
        default_factory=list,
        description="Names whose DNS addresses are the workers, re-resolved every `interval_s` "
                    "(gateway/fleet/discovery.py): a new address joins after its health check and model "
                    "discovery, a gone one drains and leaves. `discovery_interval_s` is another thing: how "
                    "often the /v1/models of known workers is re-read.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _AliasSource(settings_cls), _FileSource(settings_cls)

    @model_validator(mode="after")
    def _unique_worker_ids(self) -> GatewayConfig:
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            if w.id in seen:
                raise ValueError(f"workers[{i}].id: duplicate worker id {w.id!r}")
            seen.add(w.id)
        hosts: set[str] = set()
        for i, h in enumerate(self.shared_hosts):
            if h.id in hosts:
                raise ValueError(f"shared_hosts[{i}].id: duplicate shared host id {h.id!r}")
            hosts.add(h.id)
            for m in h.engines:
                wid = h.worker_id(m)
                if wid in seen:
                    raise ValueError(f"shared_hosts[{i}].engines.{m}: worker id {wid!r} is already taken "
                                     "(give the engine its own `id`)")
                seen.add(wid)
            if h.scheduling == "turns" and self.turn_tbt_s(h) is None:
                raise ValueError(f"shared_hosts[{i}].scheduling: turns needs a TBT target for its quotas "
                                 f"(Aegaeon eq. 2-3): set shared_hosts[{i}].tbt_ms or slo.tpot_ms")
        adapters: set[str] = set()
        for base, mc in self.models.items():
            for j, a in enumerate(mc.adapters):
                if a.name in adapters or a.name in self.models:
                    raise ValueError(f"models.{base}.adapters[{j}].name: {a.name!r} is already a model or adapter")
                adapters.add(a.name)
        if self.redis_url is not None and not re.match(r"^(redis|rediss|unix)://", self.redis_url):
            raise ValueError(f"redis_url: expected redis://host:port/db, got {self.redis_url!r}")
        return self

    def turns_workers(self) -> frozenset[str]:
        """Worker ids of the engines on `scheduling: turns` hosts (their silences and timings include other
        models' turns: hung detection and the learner leave them out)."""
        return frozenset(h.worker_id(m) for h in self.shared_hosts if h.scheduling == "turns" for m in h.engines)

    def turn_tbt_s(self, host: SharedHostConfig) -> float | None:
        """A turns host's TBT target in seconds: its `tbt_ms`, else the tightest slo.tpot_ms of its models."""
        if host.tbt_ms is not None:
            return host.tbt_ms / 1000
        tpots = [self.models[m].slo.tpot_ms if m in self.models and self.models[m].slo.tpot_ms is not None
                 else self.slo.tpot_ms for m in host.engines]
        known = [t for t in tpots if t is not None]
        return min(known) / 1000 if known else None

    def all_workers(self) -> list[WorkerConfig]:
        """The configured workers and every shared host's engines."""
        return [*self.workers, *(w for h in self.shared_hosts for w in h.workers())]

    def adapter_limits(self) -> dict[str, int]:
        """Base model -> max_adapters_per_worker, for the models that set it."""
        return {m: mc.max_adapters_per_worker for m, mc in self.models.items() if mc.max_adapters_per_worker}

    def adapter_parents(self) -> dict[str, tuple[str, str]]:
        """Every configured LoRA adapter's name -> (its base model, its path)."""
        return {a.name: (base, a.path) for base, mc in self.models.items() for a in mc.adapters}

    def rebalance_for(self, model: str) -> RebalanceConfig:
        """The model's rebalancing settings (its own, else the top-level ones)."""
        mc = self.models.get(model)
        return mc.rebalance if mc is not None and mc.rebalance is not None else self.rebalance

    def model_settings(self, model: str) -> tuple[str, dict[str, Any], SloConfig]:
        """(policy name, params, SLO) for a model, falling back to the defaults."""
        mc = self.models.get(model)
        if mc is None or mc.policy is None:
            params = mc.params if mc is not None and mc.params else self.default_policy_params
            return self.default_policy, params, mc.slo if mc is not None else SloConfig()
        return mc.policy, mc.params, mc.slo
