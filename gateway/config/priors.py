"""The model a worker profile starts from (its prior), from configuration alone: no runtime object.

Sources, in order (the prior of `WorkerRecord.profile`): `learning.priors.<profile>` (Aladdin coefficients
k1, c1, k2, c2, c3, h, j, kv_capacity, max_batch, or a whole simulator-style step profile with c_step_s,
t_weights_s, ...); else, when the simulator is installed (an optional component, imported only here), its
built-in profile of that name or a simulator profile YAML file at that path, read by its profile loader
(PerfModel.from_step_profile); else the PerfModel defaults. Time coefficients are divided by
`learning.time_scale` (a simulated fleet running K times faster than its profiles).

The config validators (gateway/config/) use this module to check `learning.priors` and that an SLO-aware
policy's workers have a model; the learning loop (gateway/pipeline/learning.py) starts each profile's fit from it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policies.perf_model import PerfModel

log = logging.getLogger("fleetgate.learning")

_TIME_COEFS = ("k1", "c1", "k2", "c2", "c3", "k1q", "pf")


def prior_from_mapping(data: Mapping[str, Any]) -> PerfModel:
    """A PerfModel from config: a simulator-style step profile (has c_step_s) or Aladdin coefficients."""
    if not isinstance(data, Mapping):
        raise TypeError(f"expected a mapping of coefficients, got {type(data).__name__}")
    if "c_step_s" in data:
        return PerfModel.from_step_profile(data)
    return PerfModel.from_prior(data)


def profile_prior(name: str, configured: Mapping[str, Mapping[str, Any]], time_scale: float = 1.0) -> PerfModel:
    """The declared model of a worker profile (see the module docstring for the order of sources)."""
    if name in configured:
        model = prior_from_mapping(configured[name])
    else:
        model = simulator_profile_prior(name) or PerfModel()
    return scale_time(model, time_scale)


def known_profile(name: str, configured: Mapping[str, Mapping[str, Any]]) -> bool:
    """Is there a declared model for this worker profile (config priors, a simulator profile or profile file)?"""
    return name in configured or simulator_profile_prior(name) is not None


def simulator_profile_prior(name: str) -> PerfModel | None:
    """Aladdin coefficients of the simulator's profile `name` (a built-in name or a profile YAML path), read by
    the simulator's profile loader; None when the simulator is not installed or has no such profile."""
    try:
        from simulator.package_data import builtin_profile  # optional component
        from simulator.profiles import profile_yaml
    except ImportError:
        return None
    if not name or (builtin_profile(name) is None
                    and not (name.endswith((".yaml", ".yml")) and Path(name).is_file())):
        return None
    try:
        data, _ = profile_yaml(name)
        return PerfModel.from_step_profile(data)
    except (OSError, TypeError, ValueError, KeyError, AttributeError) as e:
        log.warning("profile %r: cannot derive a prior from it (%s); using defaults", name, e)
        return None


def scale_time(model: PerfModel, k: float) -> PerfModel:
    """The model of a worker running k times faster: every time coefficient divided by k."""
    if k == 1.0:
        return model
    data = model.to_dict()
    for name in _TIME_COEFS:
        data[name] = data[name] / k
    if data.get("p") is not None:
        data["p"] = [v / k for v in data["p"]]
    return PerfModel.from_dict(data)
