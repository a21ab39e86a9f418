"""LoRA adapters: what loading one costs, and where a request for one goes. Pure; the clock is passed in.

What a load costs (model seconds; simulator/lora.py charges it in the simulated engine, the gateway prices a
runtime load with it):

- Adapter bytes = rank x layers x sum over the adapted linear modules of (d_in + d_out) x 2 bytes (BF16 A and B
  matrices). Modules: q, k, v, o, gate, up, down (all linear layers, the usual serving target). Rank: vLLM sizes
  its GPU slots at `--max-lora-rank`, so a slot copy moves max_lora_rank-sized matrices.
- Host memory to GPU (activation into one of the max_loras GPU slots): bytes / the host link (PCIe Gen4 x16
  ~25 GB/s). S-LoRA (Sheng et al., MLSys 2024, §4-5) keeps all adapters in host memory and copies the ones a
  batch needs to the GPU this way; vLLM's LRU GPU slots do the same.
- Disk to host memory (an adapter not in the max_cpu_loras cache, or a runtime load): bytes / DISK_BYTES_PER_S
  plus DISK_FIXED_S. These two are assumptions of ours (NVMe-class read rate, file open and config checks), not
  measurements.
- Per step with at least one adapter in the batch: LORA_STEP_S, the per-token latency Punica reports for its
  batched LoRA kernels (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024, abstract: "only adding
  2ms latency per token"), whose SGMV/BGMV kernels vLLM uses.

Where a request for an adapter goes (`choose_for_adapter`, called by the placement step):

    resident  the workers that serve the adapter already; the policy chooses among them as usual (so an
              SLO-aware policy refuses one that cannot meet the request's SLO)
    load      else the workers without it, cheapest load first: a free GPU slot (fewer adapters than
              max_loras), then fewest adapters resident, then least load; the first the policy accepts with
              the load time taken off the request's TTFT target (how aladdin prices the load into its check)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import Policy
from policies.slo_targets import SloTarget
from policies.types import Decision, RequestFeatures, WorkerView

DISK_BYTES_PER_S = 2e9      # assumption: NVMe-class sequential read of the adapter's safetensors
DISK_FIXED_S = 0.02         # assumption: opening the files, parsing adapter_config.json, checks
LORA_STEP_S = 0.002         # Punica (MLSys 2024): ~2 ms added per token with batched LoRA kernels
BYTES_PER_PARAM = 2         # BF16
HOST_LINK_BYTES_PER_S = 25e9   # PCIe Gen4 x16, for a worker whose profile names no host link
MIN_TTFT_S = 1e-3           # what is left of a TTFT target the load time exceeds (the policy then refuses)
DEFAULT_RANK = 16           # vLLM's default --max-lora-rank: the size of its GPU slots

# (hidden, kv_dim, intermediate, layers) of the served model, from each model's config.json.
MODEL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "meta-llama/Llama-3.1-8B-Instruct": (4096, 1024, 14336, 32),
    "meta-llama/Llama-2-13b-chat-hf": (5120, 5120, 13824, 40),
    "meta-llama/Llama-2-70b-chat-hf": (8192, 1024, 28672, 80),
    "tiny": (256, 256, 512, 2),     # scripts/make_tiny_model.py
}
_DEFAULT_SHAPE = MODEL_SHAPES["meta-llama/Llama-3.1-8B-Instruct"]


@dataclass(frozen=True, slots=True)
class LoraCosts:
    """Model seconds of the LoRA work an engine does (see the module docstring for the derivation)."""

    adapter_bytes: float
    activate_s: float       # host memory -> a GPU slot
    disk_s: float           # disk -> host memory
    step_s: float           # per step with at least one adapter in the batch

    @property
    def runtime_load_s(self) -> float:
        """A runtime load before the adapter's first step: read from disk, then copied into a GPU slot."""
        return self.disk_s + self.activate_s


def lora_costs(model: str, rank: int = DEFAULT_RANK, host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S,
               tp: int = 1) -> LoraCosts:
    """What loading and running a rank-`rank` adapter of `model` costs; tensor parallel splits the bytes."""
    hidden, kv_dim, inter, layers = MODEL_SHAPES.get(model, _DEFAULT_SHAPE)
    per_layer = (hidden + hidden) * 2 + (hidden + kv_dim) * 2 + (hidden + inter) * 3   # q,o; k,v; gate,up,down
    size = rank * layers * per_layer * BYTES_PER_PARAM
    share = size / max(1, tp)
    return LoraCosts(adapter_bytes=size, activate_s=share / host_link_bytes_per_s,
                     disk_s=DISK_FIXED_S + size / DISK_BYTES_PER_S, step_s=LORA_STEP_S)


def load_cost_key(view: WorkerView) -> tuple[int, int, int]:
    """Sort key, cheapest load first: a free GPU slot, fewest adapters resident, least load."""
    full = view.max_loras is not None and len(view.adapters) >= view.max_loras
    return (int(full), len(view.adapters), view.load)


def choose_for_adapter(policy: Policy, feats: RequestFeatures, views: Sequence[WorkerView], now: float,
                       load_s: float) -> Decision:
    """The worker for a request naming `feats.adapter` (module docstring); `load_s`: what loading it costs."""
    adapter = feats.adapter
    resident = [v for v in views if adapter in v.adapters]
    decision = Decision(None, "no_workers")
    if resident:
        decision = policy.choose(feats, resident, now)
        if decision.worker_id is not None:
            return decision
    priced = _priced(policy, feats, load_s)
    for v in sorted((v for v in views if adapter not in v.adapters), key=load_cost_key):
        d = policy.choose(priced, [v], now)
        if d.worker_id is not None:
            return d
        if decision.worker_id is None and (decision.retry_at is None or
                                           (d.retry_at is not None and d.retry_at < decision.retry_at)):
            decision = d
    return decision


def _priced(policy: Policy, feats: RequestFeatures, load_s: float) -> RequestFeatures:
    """The request with the load time taken off its TTFT target: its own target, else the SLO-aware policy's
    default (`policy.slo`, as aladdin keeps it); unchanged when neither has one."""
    default = getattr(policy, "slo", None)
    ttft = feats.slo_ttft_s if feats.slo_ttft_s else (default.ttft_s if isinstance(default, SloTarget) else None)
    if ttft is None or load_s <= 0:
        return feats
    return dataclasses.replace(feats, slo_ttft_s=max(MIN_TTFT_S, ttft - load_s))
