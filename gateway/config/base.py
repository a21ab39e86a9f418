"""What every config section shares: the strict base model, worker ids, the config error, small validators."""

from __future__ import annotations

import logging
import re
import warnings

from pydantic import BaseModel, ConfigDict

WORKER_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def check_worker_id(v: str) -> str:
    """A worker or shared-host id: safe in Redis keys, metric labels and URLs."""
    if not WORKER_ID_RE.match(v):
        raise ValueError("must be 1-128 characters from A-Z a-z 0-9 . _ : -")
    return v
MiB = 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _deprecated_key(key: str, instead: str) -> None:
    warnings.warn(f"config key {key} is deprecated: {instead}", DeprecationWarning, stacklevel=2)
    logging.getLogger("fleetgate.config").warning("config key %s is deprecated: %s", key, instead)


def _all_positive(v: dict[str, float], what: str) -> dict[str, float]:
    bad = [k for k, x in v.items() if not x > 0]
    if bad:
        raise ValueError(f"{what} (services {', '.join(bad)})")
    return v


class ConfigError(Exception):
    """Every problem found in a configuration, one human-readable line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
