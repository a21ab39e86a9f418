"""Autoscaling policies: pure math, `now` is an argument (the gateway and the simulator call the same code).

- `local`: Chiron's per-worker cap (Algorithm 1).
- `global_`: Chiron's interactive band and batch-queue sizing (section 5, Algorithm 2), Aladdin's
  N = ceil(k5 * rate + c5) fit (appendix E.2), and the per-pool combiner with hysteresis and cooldown.
- `utilization_band`: a utilisation-band autoscaler (Llumnix-style) and static provisioning.
- `routing`: pool-aware routing (own pool first, spill to mixed) and the eviction choice.
"""

from policies.autoscale.global_ import (
    POOL_BATCH,
    POOL_INTERACTIVE,
    POOL_MIXED,
    POOLS,
    FleetObservation,
    GlobalAutoscaler,
    GlobalConfig,
    PoolScaler,
    RateWorkerFit,
    ScaleAction,
    ScalePlan,
)
from policies.autoscale.local import LocalAutoscaler, LocalConfig
from policies.autoscale.utilization_band import StaticProvisioning, UtilizationBand, fleet_utilization

__all__ = [
    "POOLS", "POOL_BATCH", "POOL_INTERACTIVE", "POOL_MIXED", "FleetObservation", "GlobalAutoscaler",
    "GlobalConfig", "LocalAutoscaler", "LocalConfig", "PoolScaler", "RateWorkerFit", "ScaleAction", "ScalePlan",
    "StaticProvisioning", "UtilizationBand", "fleet_utilization",
]
