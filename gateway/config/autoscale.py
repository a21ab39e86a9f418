"""Config of the control loops: autoscaling and its actuators, re-planning, deployments."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import _Strict
from gateway.config.models import SloConfig
from gateway.config.workers import check_worker_url


class SimActuatorConfig(_Strict):
    """`sim`: workers are simulated vLLM servers started in this process (simulator/fleet.py)."""

    profile: str = Field("llama3-8b-h100", description="Simulator profile of new workers.")
    model: str | None = Field(None, description="Served model name (default: the profile's).")
    time_scale: float = Field(1.0, gt=0, description="New workers run K x faster than their profile.")
    cold_start_s: float = Field(30.0, ge=0, description="Wall seconds before a new worker takes traffic.")
    initial: dict[Literal["interactive", "mixed", "batch"], int] = Field(
        default_factory=dict, description="Workers per pool (interactive, mixed, batch) started at once, "
                                          "without a cold start.")
    seed: int = Field(0, description="Random seed of the simulated workers.")
    cap: int | None = Field(None, ge=1, description="New workers' cap (None: the local autoscaler's, if on).")
    base_port: int = Field(0, ge=0, le=65535,
                           description="Worker n (sim-n, the lowest n not in use) listens on base_port + n; "
                                       "0: any free port.")


class WebhookActuatorConfig(_Strict):
    """`webhook`: POST the desired state to `url`, read back the fleet (gateway/control/actuators.py)."""

    url: str | None = Field(None,
                            description="Where the desired state is POSTed (required with kind: webhook).")
    timeout_s: float = Field(5.0, gt=0, description="A webhook call answering nothing this long has failed.")
    headers: dict[str, str] = Field(default_factory=dict,
                                    description="Extra HTTP headers of every webhook call (e.g. "
                                                "Authorization).")


class DockerActuatorConfig(_Strict):
    """`docker`: scale compose services by creating and removing their containers (gateway/control/docker_actuator.py)."""

    socket: str = Field("/var/run/docker.sock", description="The Docker Engine API's unix socket (mounted into "
                                                            "the gateway's container)")
    project: str | None = Field(None, description="The compose project (`-p`); default: the project of the "
                                                  "gateway's own container, read from its labels")
    services: dict[Literal["mixed", "batch"], str] = Field(
        default_factory=dict, description="The compose service whose containers are a pool's workers, e.g. "
                                          "{mixed: sim}; the interactive pool takes its workers from mixed")
    port: int = Field(8000, ge=1, le=65535, description="The workers' HTTP port inside their containers")
    start_timeout_s: float = Field(300.0, gt=0, description="A new container not healthy in the gateway by then "
                                                            "is removed (and counted as failed)")
    stop_timeout_s: int = Field(30, ge=0, description="Seconds between SIGTERM and SIGKILL when a drained "
                                                      "container is stopped")


class ActuatorConfig(_Strict):
    kind: Literal["none", "sim", "webhook", "docker"] = Field(
        "none", description="What acts on scale decisions: none (export the numbers only, e.g. for KEDA), "
                            "sim, webhook or docker.")
    sim: SimActuatorConfig = Field(default_factory=SimActuatorConfig,
                                   description="The sim actuator: simulated workers started in this process.")
    webhook: WebhookActuatorConfig = Field(
        default_factory=WebhookActuatorConfig, description="The webhook actuator.")
    docker: DockerActuatorConfig = Field(
        default_factory=DockerActuatorConfig,
        description="The docker actuator: containers of a compose service through the Docker Engine API.")

    @model_validator(mode="after")
    def _webhook_url(self) -> ActuatorConfig:
        if self.kind == "webhook":
            if not self.webhook.url:
                raise ValueError("webhook.url is required with kind: webhook")
            check_worker_url(self.webhook.url)
        if self.kind == "docker" and not self.docker.services:
            raise ValueError("docker.services is required with kind: docker (e.g. {mixed: sim})")
        return self


class AutoscaleConfig(_Strict):
    """Chiron's local caps and global pool sizes with a leader lease (gateway/control/autoscaler.py)."""

    enabled: bool = Field(False,
                          description="Run the autoscaler (Chiron's local caps and global pool sizes; one "
                                      "leader among the replicas).")
    interval_s: float = Field(5.0, gt=0, description="Global decision period.")
    local_interval_s: float = Field(2.0, gt=0, description="Local cap window (Chiron Algorithm 1).")
    sample_s: float = Field(0.25, gt=0, description="In-flight sampling period for busy and cap-binding.")
    local_caps: bool = Field(True, description="Enforce per-worker caps from Chiron Algorithm 1.")
    itl_slo_ms: float | None = Field(
        None, gt=0, description="Inter-token latency target of interactive and mixed workers; default "
                                "slo.tpot_ms, else 200.")
    batch_itl_slo_ms: float = Field(2000.0, gt=0,
                                    description="Inter-token latency target of batch workers (Chiron section"
                                                " 6: 2 s).")
    busy_cap: int = Field(16, ge=1, description="The busy denominator of a worker without a cap.")
    local: dict[str, Any] = Field(default_factory=dict, description="policies.autoscale.LocalConfig fields.")
    scaler: dict[str, Any] = Field(default_factory=dict,
                                   description="policies.autoscale.GlobalConfig fields.")
    lease_ttl_s: float = Field(10.0, gt=0,
                               description="Leader lease; a dead leader is replaced after this long.")
    drain_timeout_s: float = Field(60.0, gt=0,
                                   description="In-flight requests of a removed worker get this long.")
    rate_window_s: float = Field(60.0, gt=0, description="Arrival rates are measured over this window.")
    throughput_window_s: float = Field(
        60.0, gt=0, description="Token throughputs (per worker, batch) are measured over this window.")
    actuator: ActuatorConfig = Field(
        default_factory=ActuatorConfig, description="What starts and stops workers.")

    @field_validator("local", "scaler")
    @classmethod
    def _policy_params(cls, v: dict[str, Any], info: Any) -> dict[str, Any]:
        from policies.autoscale import GlobalConfig, LocalConfig

        try:
            if info.field_name == "local":
                LocalConfig(itl_slo_s=1.0, **v)
            else:
                GlobalConfig(**v)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return v

class ReplanConfig(_Strict):
    """Re-planning from observed traffic by the autoscaler's leader (gateway/control/replanner.py, policies/replan.py):
    the closed-form plan over `gpus` every interval, the interval adapted by SeaLLM eq. 8 (section 4.3)."""

    enabled: bool = Field(False,
                          description="Re-plan the fleet from observed traffic (needs autoscale.enabled and "
                                      "slo.ttft_ms and slo.tpot_ms).")
    gpus: list[str] = Field(default_factory=list,
                            description="The GPU stock, TYPE:COUNT[:PRICE] as `fleetgate plan --gpus`.")
    interval_s: float = Field(60.0, gt=0, description="I_0, the first interval between two plans.")
    min_interval_s: float = Field(10.0, gt=0, description="Shortest interval between two plans.")
    max_interval_s: float = Field(600.0, gt=0, description="Longest interval between two plans.")
    beta: float = Field(0.1, gt=0, lt=1, description="SeaLLM eq. 8's smoothing (0.1 in its section 6.1).")
    target: float = Field(0.95, gt=0, le=1,
                          description="SLO attainment a covered plan is estimated to reach.")
    objective: Literal["cost", "throughput"] = Field(
        "cost", description="Cheapest plan that covers the traffic (cost), or most throughput within the "
                            "stock and budget (throughput).")
    budget_per_hour: float | None = Field(
        None, gt=0, description="Most a plan may cost per hour (None: no budget).")
    headroom: float = Field(1.0, ge=1.0, description="Plan for this multiple of the observed rates.")
    min_saving: float = Field(0.1, ge=0, lt=1,
                              description="Move to a cheaper plan only when it saves this fraction.")
    min_finished: int = Field(10, ge=1, description="Finished requests a window needs for its length means.")
    time_scale: float | None = Field(
        None, gt=0, description="Model seconds per wall second (default: the sim actuator's).")

    @model_validator(mode="after")
    def _bounds(self) -> ReplanConfig:
        if not self.min_interval_s <= self.interval_s <= self.max_interval_s:
            raise ValueError("need min_interval_s <= interval_s <= max_interval_s")
        return self


class DeploymentGroupConfig(_Strict):
    """`count` instances of a model on `tp` GPUs of one type (a row of `fleetgate plan`)."""

    model: str = Field(description="Short model name (policies/hardware.py: llama3-8b, llama2-70b, ...).")
    gpu: str = Field(description="GPU type: a100, h100, l4, v100, a800 (or the full names).")
    tp: Literal[1, 2, 4, 8] = Field(description="Tensor-parallel GPUs per instance.")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="mixed, prefill or decode instances.")
    count: int = Field(ge=0, description="Instances.")
    gpus: int | None = Field(None, ge=0, description="tp x count, as the plan prints it.")
    price_per_gpu_hour: float | None = Field(
        None, ge=0, description="Price of one GPU per hour, as the plan prints it.")
    cost_per_hour: float | None = Field(
        None, ge=0, description="The group's cost per hour, as the plan prints it.")


class DeploymentServiceConfig(_Strict):
    model: str = Field(description="Short model name of the service.")
    share: float = Field(1.0, gt=0, description="Its fraction of the traffic (normalised over the services).")


class DeploymentConfig(_Strict):
    """A deployment from `fleetgate plan` (the `deployment` section of its JSON, as YAML here); `fleetgate simulate
    --deployment FILE` replays traffic on it."""

    groups: list[DeploymentGroupConfig] = Field(min_length=1, description="The plan's instance groups.")
    services: list[DeploymentServiceConfig] = Field(
        default_factory=list, description="The services (models) the plan serves and their traffic shares.")
    policy: str | None = Field(None, description="The routing policy the plan was scored with.")
    slo: SloConfig = Field(default_factory=SloConfig, description="The SLO the plan was sized for.")
