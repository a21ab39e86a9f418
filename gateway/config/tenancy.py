"""Config of who may ask: API keys, auth, per-key limits, service order between tenants."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from gateway.config.base import MiB, _all_positive, _Strict
from policies.admission import DEFAULT_QUEUE_LOOKAHEAD, DEFAULT_QUEUE_SIZE, DEFAULT_QUEUE_TIMEOUT_S


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(4 * MiB, ge=1024, description="Largest request body accepted; beyond: 413.")
    queue_size: int = Field(DEFAULT_QUEUE_SIZE, ge=0,
                            description="Requests per model that may wait in the admission queue "
                                        "(policies/admission.py); 0 disables queueing (429 at once).")
    queue_timeout_s: float = Field(DEFAULT_QUEUE_TIMEOUT_S, ge=0,
                                   description="Longest wait in the admission queue for a request without a "
                                               "TTFT target.")
    queue_lookahead: int = Field(DEFAULT_QUEUE_LOOKAHEAD, ge=1,
                                 description="A drain tries waiting requests until this many found no worker"
                                             " (1: head-of-line FIFO); a new request tries at once while "
                                             "fewer than this many wait.")
    queue_poll_s: float | None = Field(
        None, gt=0, description="How often the queue drains besides on every release (this replica's, and "
                                "other replicas' announced through Redis while requests wait), on a registry"
                                " change, after each engine scrape and when a policy asked (None: 0.5 s). A "
                                "request that found no worker is tried again only after a release, registry "
                                "change or scrape, or when its policy asked.")
    retries: int = Field(2, ge=0, le=10,
                         description="Extra workers tried when one fails before any byte was sent.")
    shed_will_miss: bool = Field(True,
                                 description="Refuse (429, Retry-After = the predicted drain time) a request with "
                                             "a TTFT target whose predicted TTFT (wait + prefill, from the learned "
                                             "performance models) misses it, for every policy and without caps "
                                             "(policies/shedding.py). Requests of the batch class or without a "
                                             "TTFT target are never refused by it.")


ServiceSource = Literal["header", "tenant", "model"]


class ServicePriorityConfig(_Strict):
    """Service-aware priority across the services sharing a model's workers (gateway/tenancy/services.py,
    policies/service_priority.py)."""

    order: Literal["off", "fcfs", "round_robin", "seallm", "vtc"] = Field(
        "off", description="How services sharing a model's workers take turns: off, fcfs, round_robin, "
                           "seallm or vtc (fair sharing by the Virtual Token Counter).")
    engine_priority: bool = Field(False,
                                  description="Also set vLLM's `priority` field (workers must run "
                                              "`--scheduling-policy priority`, else vLLM answers 400).")
    service_from: list[ServiceSource] = Field(
        default_factory=lambda: ["header", "tenant", "model"], min_length=1, description="Where a request's "
                                                                                         "service comes "
                                                                                         "from, first match "
                                                                                         "wins: the "
                                                                                         "X-Service header, "
                                                                                         "the tenant (API "
                                                                                         "key), the model.")
    starvation_s: dict[str, float] = Field(
        default_factory=dict, description="Per service, the longest wait before it goes first; others: "
                                          "default_starvation_s.")
    default_starvation_s: float = Field(
        10.0, gt=0, description="The longest wait before a service goes first, for services not in "
                                "starvation_s.")
    prompt_token_cost: float = Field(
        1.0 / 256.0, ge=0, description="Decode iterations one prompt token costs in a service's share.")
    weights: dict[str, float] = Field(
        default_factory=dict, description="vtc: a tenant's share relative to others (an X-Service name or an API "
                                          "key's name; others: 1).")
    input_token_weight: float = Field(1.0, ge=0,
                                      description="vtc: counter charge per prompt token (the paper's 1).")
    output_token_weight: float = Field(2.0, ge=0,
                                       description="vtc: counter charge per generated token (the paper's 2).")

    @field_validator("starvation_s")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        return _all_positive(v, "starvation thresholds must be > 0 seconds")

    @field_validator("weights")
    @classmethod
    def _positive_weights(cls, v: dict[str, float]) -> dict[str, float]:
        return _all_positive(v, "vtc weights must be > 0")


class ApiKeyConfig(_Strict):
    """One inference key and its limits (gateway/tenancy/auth.py, gateway/state/ratelimit.py). `key` is the secret itself or
    `sha256:<64 hex digits>` of it (the config then holds no secret). Limits left out are not enforced."""

    key: str = Field(min_length=8,
                     description="The key, or `sha256:` and the 64 hex digits of its SHA-256 (the config "
                                 "then holds no secret).")
    name: str = Field("",
                      description="The tenant's name in logs and the admin API (default: key- and the start "
                                  "of its hash).")
    rpm: int | None = Field(None, ge=1, description="Requests per minute.")
    tpm: int | None = Field(None, ge=1,
                            description="Tokens per minute: prompt + max_tokens reserved, settled at the "
                                        "end.")
    max_concurrency: int | None = Field(None, ge=1, description="Requests in flight at once (all replicas).")
    models: list[str] = Field(default_factory=list, description="Models the key may use; empty: every model.")

    @field_validator("key")
    @classmethod
    def _key_form(cls, v: str) -> str:
        if v.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", v):
            raise ValueError("a hashed key is `sha256:` and 64 hex digits")
        return v


class AuthConfig(_Strict):
    """Who may call what. `admin_key` (or env FLEETGATE_ADMIN_KEY) guards /admin/*; without it the admin API is
    off. Inference keys: `keys` (with limits) and the top-level `api_keys` (no limits); none at all: open."""

    admin_key: str | None = Field(None, min_length=16,
                                  description="Guards /admin/* (or env FLEETGATE_ADMIN_KEY); at least 16 "
                                              "characters, or `sha256:<64 hex digits>`. None: the admin API "
                                              "is off.")
    keys: list[ApiKeyConfig] = Field(default_factory=list, description="Inference keys with limits.")

    @field_validator("admin_key")
    @classmethod
    def _admin_form(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", v):
            raise ValueError("a hashed key is `sha256:` and 64 hex digits")
        return v
