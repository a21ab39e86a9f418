"""Config of shared hosts: several engines of different models on one GPU host."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from gateway.config.base import _Strict, check_worker_id
from gateway.config.workers import WorkerConfig, check_worker_url
from policies.pooling.aegaeon import Q_MAX_S
from policies.pooling.turns import RECOMPUTE_OFF_REMOVED

SharedSleepLevel = Literal[1, 2]


class SharedEngineConfig(_Strict):
    """One model's engine on a shared host: a vLLM server started with --enable-sleep-mode (dev-mode endpoints
    /sleep, /wake_up, /is_sleeping: docs/reference/vllm-interface.md §6.1)."""

    url: str = Field(description="The engine's base URL.")
    id: str | None = Field(None, description="Its worker id; default `<host>:<model with / as _>`.")
    profile: str = Field("", description="The engine's performance profile (as workers[].profile).")
    cap: int | None = Field(None, ge=1,
                            description="Most requests the gateway puts on it at once (None: no gateway "
                                        "cap).")
    weight_gb: float | None = Field(None, gt=0,
                                    description="The model's weights in GB, for the derived swap cost.")
    load_s: float | None = Field(None, ge=0, description="Overrides the derived wake-up (swap in) seconds.")
    offload_s: float | None = Field(None, ge=0, description="Overrides the derived sleep (swap out) seconds.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return check_worker_url(v)

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str | None) -> str | None:
        return v if v is None else check_worker_id(v)


class SharedHostConfig(_Strict):
    """A worker host (one GPU or TP group) holding several models' engines, at most `max_awake` of them awake
    at once (its memory); the gateway's swap controller (gateway/control/pooling.py) puts engines to sleep and wakes
    them as requests arrive (request-level swapping), or with `scheduling: turns` runs one engine at a time in Aegaeon's
    decode turns (gateway/control/turns.py)."""

    id: str = Field(description="The host's id (as a worker id).")
    engines: dict[str, SharedEngineConfig | str] = Field(
        min_length=1, description="Model -> its engine (or just its URL).")
    max_awake: int = Field(1, ge=1, description="Engines awake at once (what the host's memory holds).")
    link_gb_per_s: float = Field(25.0, gt=0, description="Host <-> GPU bandwidth (PCIe 4.0 x16 ~ 25 GB/s).")
    wake_overhead_s: float = Field(0.0, ge=0,
                                   description="The engine's fixed wake-up cost on top of the weight copy.")
    sleep_level: SharedSleepLevel = Field(
        1, description="/sleep?level=: 1 offloads the weights to CPU, 2 discards them.")
    swap_timeout_s: float = Field(60.0, gt=0,
                                  description="A /sleep or /wake_up answering nothing this long has failed.")
    drain_after_s: float | None = Field(
        1.0, ge=0, description="With no idle engine: once a model has waited this long, the least busy "
                               "engine stops taking requests and is swapped out when its last one ends "
                               "(policies/pooling/swapping.py); null: only idle engines are swapped out "
                               "(ServerlessLLM's rule).")
    scheduling: Literal["request", "turns"] = Field(
        "request", description="request: an engine is swapped only once idle or drained "
                               "(policies/pooling/swapping.py). turns: Aegaeon's decode turns "
                               "(gateway/control/turns.py): one engine runs at a time, each model with requests in "
                               "flight gets a time quota per round (eq. 2-3, at most q_max_s) and the others"
                               " are paused (/sleep?mode=keep) meanwhile.")
    q_max_s: float = Field(Q_MAX_S, gt=0, description="turns: the largest quota of a turn (Aegaeon's Q_MAX).")
    tbt_ms: float | None = Field(None, gt=0,
                                 description="turns: the TBT target d of eq. 2-3; default slo.tpot_ms.")
    recompute_quota: bool = Field(True,
                                  description="turns at sleep level >= 1: stock vLLM dropped the paused "
                                              "requests' KV, so a turn first recomputes it; that estimate "
                                              "counts as switching (in eq. 3's c, and the quota starts after "
                                              "it). Always on: false (the stock rule) is refused, its turns "
                                              "starve (bench/results/pooling.md, 2026-12-07).")

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        return check_worker_id(v)

    @field_validator("recompute_quota")
    @classmethod
    def _recompute_on(cls, v: bool) -> bool:
        if not v:
            raise ValueError(RECOMPUTE_OFF_REMOVED)
        return v

    @field_validator("engines", mode="after")
    @classmethod
    def _engine_objects(cls, v: dict[str, SharedEngineConfig | str]) -> dict[str, SharedEngineConfig | str]:
        return {m: SharedEngineConfig(url=e) if isinstance(e, str) else e for m, e in v.items()}

    def engine(self, model: str) -> SharedEngineConfig:
        e = self.engines[model]
        assert isinstance(e, SharedEngineConfig)
        return e

    def worker_id(self, model: str) -> str:
        e = self.engine(model)
        return e.id or f"{self.id}:{re.sub(r'[^A-Za-z0-9._:-]', '_', model)}"[:128]

    def workers(self) -> list[WorkerConfig]:
        """One worker per engine, labelled with its host."""
        return [WorkerConfig(id=self.worker_id(m), url=self.engine(m).url, models=[m], profile=self.engine(m).profile,
                             cap=self.engine(m).cap, labels={"shared_host": self.id}) for m in self.engines]
