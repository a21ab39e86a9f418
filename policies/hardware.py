"""Model and GPU tables, and the step-time profile of a model on `tp` GPUs of one type (tensor parallelism).

Pure data and arithmetic: `derive_profile(model, gpu, tp)` returns a mapping with the keys of the simulator's
profiles (simulator/profiles.py, simulator/CALIBRATION.md), so a derived profile runs in the simulator and in the
planner exactly like a calibrated one. The derivation generalises the calibrated profiles' own arithmetic:

- Memory (heterogeneous-cluster paper, section 3.1.1, eq. 1): KV bytes = tp · (mem · φ_usage − δ_engine) − weights,
  φ_usage = 0.9 (vLLM's gpu_memory_utilization), δ_engine per GPU from the table (2 GiB; 3 GiB where vLLM captures
  CUDA graphs for 1024 sequences). Weights and KV split evenly over the tp GPUs (Megatron-style TP shards the
  attention heads and the MLP columns), so KV bytes per token stay 2 · layers · kv_heads · head_dim · 2 B in all.
- Weight streaming and KV reading (memory bound): bytes / (tp · 0.9 · HBM bandwidth).
- Compute (prefill tokens, decode sequences): 2 · params FLOP per token / (tp · effective TFLOP/s · e(tp)), with
  e(tp) = 1 − 0.05 · log2(tp) for the smaller GEMM shards (an assumption; Aladdin section 4.1, eq. 5, writes the
  compute time as k4 / N_g + c4).
- Communication: two all-reduces of hidden · 2 B per token per layer (after attention and after the MLP). An
  all-reduce of S bytes over tp GPUs takes 2·log2(tp) · α + 2(tp−1)/tp · S / β: the latency of a tree (what NCCL
  uses for the small messages of a decode step; α per hop including the kernel launch, 7.5 µs on NVLink so that
  TP2 pays the calibrated ~15 µs) and the bandwidth term of a ring (β: effective one-direction link bandwidth).
  The bandwidth term is paid per token (added to the per-token compute), the latency term once per step (added to
  c_step). NVLink vs PCIe differ in α and β.

Sources of the table's numbers (public datasheets; prices are on-demand list prices per GPU-hour, rounded, and are
meant to be overridden): NVIDIA A100 / A800 / H100 / L4 / V100 datasheets for memory, HBM bandwidth, dense BF16/FP16
tensor TFLOP/s and NVLink bandwidth; model shapes from each model's Hugging Face `config.json`. The effective
prefill TFLOP/s of A100 and H100 are the calibrated profiles' measured-derived per-token prefill times
(simulator/CALIBRATION.md); for the other GPUs 70 % of the dense peak (an assumption, stated per row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

GIB = 1024**3
BLOCK_SIZE = 16
GPU_MEMORY_UTILIZATION = 0.9      # vLLM's --gpu-memory-utilization default; the paper's φ_usage
BANDWIDTH_EFFICIENCY = 0.9        # achieved fraction of peak HBM bandwidth (simulator/CALIBRATION.md)
TP_DEGREES = (1, 2, 4, 8)
NVLINK, PCIE = "nvlink", "pcie"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A dense decoder-only transformer as its config.json describes it."""

    name: str                 # short name (`llama3-8b`)
    hf_id: str
    family: str
    params_b: float           # parameters, billions
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    context: int              # max_position_embeddings

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * 2          # BF16 / FP16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2   # K and V, 2 B each


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU type; `full_name` is what profiles write in their `gpu` field."""

    name: str                  # short name (`a100`)
    full_name: str
    memory_gib: float          # memory the driver reports (GiB)
    bandwidth_tbs: float       # peak HBM bandwidth, TB/s
    peak_tflops: float         # dense BF16 (FP16 on V100) tensor TFLOP/s
    prefill_tflops: float      # effective TFLOP/s of prefill GEMMs
    attn_tflops: float         # effective TFLOP/s of prefill attention (flash attention)
    interconnect: str          # nvlink | pcie
    link_gbs: float            # effective one-direction bandwidth between two GPUs, GB/s
    link_latency_us: float     # per ring hop of an all-reduce (latency + kernel launch)
    price_per_hour: float      # USD per GPU-hour (override with --gpus TYPE:COUNT:PRICE)
    host_step_s: float = 0.003        # CPU scheduling / launch overhead per engine step
    engine_overhead_gib: float = 2.0  # δ_engine per GPU (CUDA graphs, activations)
    max_num_seqs: int = 256           # vLLM 0.11 defaults for this GPU
    max_num_batched_tokens: int = 2048
    pd_link_bytes_per_s: float = 25e9  # KV transfer between nodes (P/D)


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama2-7b", "meta-llama/Llama-2-7b-chat-hf", "llama2", 6.738, 32, 32, 32, 4096, 4096),
    ModelSpec("llama2-13b", "meta-llama/Llama-2-13b-chat-hf", "llama2", 13.015, 40, 40, 40, 5120, 4096),
    ModelSpec("llama2-70b", "meta-llama/Llama-2-70b-chat-hf", "llama2", 68.98, 80, 64, 8, 8192, 4096),
    ModelSpec("llama3-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama3", 8.03, 32, 32, 8, 4096, 131072),
    ModelSpec("llama3-70b", "meta-llama/Llama-3.1-70B-Instruct", "llama3", 70.55, 80, 64, 8, 8192, 131072),
    ModelSpec("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", "mistral", 7.248, 32, 32, 8, 4096, 32768),
    ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "qwen2", 7.616, 28, 28, 4, 3584, 32768),
    ModelSpec("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", "qwen2", 14.77, 48, 40, 8, 5120, 32768),
    ModelSpec("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", "qwen2", 32.76, 64, 40, 8, 5120, 32768),
)}

# A100: 2 x 8.03e9 FLOP / 0.070 ms = 229 TFLOP/s; H100: / 0.024 ms = 669 TFLOP/s (simulator/CALIBRATION.md).
# Attention: 190 / 400 TFLOP/s as calibrated; others 60 % of peak (flash attention at 40-60 % of peak).
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("a100", "A100-80GB-SXM", 79.1, 2.04, 312, 229, 190, NVLINK, 240, 7.5, 1.80),
    GpuSpec("h100", "H100-80GB-SXM", 79.1, 3.35, 989, 669, 400, NVLINK, 360, 6.0, 3.00, host_step_s=0.002,
            engine_overhead_gib=3.0, max_num_seqs=1024, max_num_batched_tokens=8192, pd_link_bytes_per_s=40e9),
    # A800 80GB PCIe (the heterogeneous-cluster paper's section 5.3 machine): A100 silicon, PCIe Gen4 between cards.
    GpuSpec("a800", "A800-80GB-PCIe", 79.1, 1.94, 312, 0.7 * 312, 0.6 * 312, PCIE, 22, 15.0, 1.50),
    GpuSpec("l4", "L4-24GB", 22.49, 0.30, 121, 0.7 * 121, 0.6 * 121, PCIE, 22, 15.0, 0.80),
    # V100-SXM2-32GB on PCIe 3.0 x16 as in the heterogeneous-cluster paper's section 5.1 testbed (~12 GB/s).
    GpuSpec("v100", "V100-32GB-SXM2", 31.7, 0.90, 125, 0.7 * 125, 0.5 * 125, PCIE, 11, 15.0, 0.60),
)}


def model_spec(name: str) -> ModelSpec:
    """A model by short name or Hugging Face id (case-insensitive)."""
    key = name.strip().lower()
    for m in MODELS.values():
        if key in (m.name, m.hf_id.lower()):
            return m
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def gpu_spec(name: str, price_per_hour: float | None = None) -> GpuSpec:
    """A GPU by short name or full name (case-insensitive), with its price overridden if given."""
    key = name.strip().lower()
    for g in GPUS.values():
        if key in (g.name, g.full_name.lower()):
            if price_per_hour is None:
                return g
            if not (math.isfinite(price_per_hour) and price_per_hour >= 0):
                raise ValueError(f"price of {name} must be a finite number >= 0, got {price_per_hour!r}")
            return replace(g, price_per_hour=float(price_per_hour))
    raise ValueError(f"unknown GPU type {name!r}; known: {', '.join(GPUS)}")


def allreduce_s(gpu: GpuSpec, tp: int, nbytes: float) -> tuple[float, float]:
    """(latency, bandwidth) parts of one all-reduce of `nbytes` over `tp` GPUs (0, 0 for tp 1)."""
    if tp <= 1:
        return 0.0, 0.0
    latency = 2 * math.log2(tp) * gpu.link_latency_us * 1e-6
    return latency, 2 * (tp - 1) / tp * nbytes / (gpu.link_gbs * 1e9)


def tp_efficiency(tp: int) -> float:
    """GEMM efficiency of a 1/tp shard relative to the whole (assumption: 5 % lost per doubling)."""
    return 1.0 - 0.05 * math.log2(tp)


def kv_cache_bytes(model: ModelSpec, gpu: GpuSpec, tp: int) -> float:
    """Heterogeneous-cluster paper eq. 1: tp · (d · φ_usage − δ_engine) − Φ · b (may be negative: does not fit)."""
    per_gpu = gpu.memory_gib * GPU_MEMORY_UTILIZATION - gpu.engine_overhead_gib
    return tp * per_gpu * GIB - model.weight_bytes


def profile_name(model: ModelSpec, gpu: GpuSpec, tp: int) -> str:
    return f"{model.name}-{gpu.name}" if tp == 1 else f"{model.name}-tp{tp}-{gpu.name}"


def fits(model: ModelSpec, gpu: GpuSpec, tp: int, min_context: int = 2048) -> bool:
    """Weights fit and the KV cache holds at least one sequence of min(min_context, context) tokens (eq. 2)."""
    need = min(min_context, model.context) * model.kv_bytes_per_token
    return kv_cache_bytes(model, gpu, tp) >= need


def derive_profile(model: ModelSpec | str, gpu: GpuSpec | str, tp: int) -> dict[str, Any]:
    """The simulator profile (as a mapping) of `model` on `tp` GPUs of type `gpu`; ValueError if it does not fit."""
    m = model if isinstance(model, ModelSpec) else model_spec(model)
    g = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    if tp not in TP_DEGREES:
        raise ValueError(f"tp must be one of {TP_DEGREES}, got {tp}")
    if m.heads % tp or m.kv_heads % tp and tp % m.kv_heads:
        raise ValueError(f"{m.name}: {m.heads} heads / {m.kv_heads} KV heads do not split over tp={tp}")
    if not fits(m, g, tp):
        raise ValueError(f"{m.name} does not fit on {tp}x {g.name}: weights {m.weight_bytes / GIB:.1f} GiB, "
                         f"usable {tp * (g.memory_gib * GPU_MEMORY_UTILIZATION - g.engine_overhead_gib):.1f} GiB")
    kv_bytes = m.kv_bytes_per_token
    blocks = int(kv_cache_bytes(m, g, tp) // (kv_bytes * BLOCK_SIZE))
    bandwidth = tp * BANDWIDTH_EFFICIENCY * g.bandwidth_tbs * 1e12
    compute = 2 * m.params_b * 1e9 / (tp * g.prefill_tflops * 1e12 * tp_efficiency(tp))
    # Two all-reduces per layer of one token's hidden state: bandwidth per token, latency per step.
    ar_latency, ar_bytes = allreduce_s(g, tp, m.hidden * 2)
    per_token = compute + 2 * m.layers * ar_bytes
    link = f"{g.interconnect} {g.link_gbs:g} GB/s, {g.link_latency_us:g} us/hop" if tp > 1 else "no TP"
    return {
        "name": profile_name(m, g, tp),
        "description": f"{m.hf_id} BF16 on {tp}x {g.full_name} (TP{tp}, {link}); derived by policies/hardware.py, "
                       "checks in simulator/CALIBRATION.md (Derived profiles)",
        "model": m.hf_id,
        "family": m.family,
        "gpu": g.full_name,
        "tp": tp,
        "weight_bytes": m.weight_bytes,
        "kv_bytes_per_token": kv_bytes,
        "num_gpu_blocks": blocks,
        "block_size": BLOCK_SIZE,
        "max_model_len": min(m.context, blocks * BLOCK_SIZE),
        "max_num_seqs": g.max_num_seqs,
        "max_num_batched_tokens": g.max_num_batched_tokens,
        "c_step_s": g.host_step_s + 2 * m.layers * ar_latency,
        "t_weights_s": m.weight_bytes / bandwidth,
        "k_prefill_s": per_token,
        "c_decode_s": per_token,
        "k_ctx_s": kv_bytes / bandwidth,
        "k_attn_s": 4 * m.hidden * m.layers / (tp * g.attn_tflops * 1e12),
        "ttft_overhead_s": 0.015,
        "output_mean_tokens": 256,
        "output_sigma": 0.9,
        "pd_link_bytes_per_s": g.pd_link_bytes_per_s,
        "pd_setup_s": 0.001,
        # Loading weights from host memory at ~25 GB/s per GPU, plus engine start (interpolates the calibrated 1-4 s).
        "wake_up_s": 0.5 + m.weight_bytes / tp / 25e9,
    }
