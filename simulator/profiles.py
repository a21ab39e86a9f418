"""Performance profiles of simulated workers (model x GPU x TP): capacity, step-time coefficients, lengths.

A profile is plain data loaded from YAML: a built-in name (`simulator/profiles/<name>.yaml`, package data read
through simulator.package_data) or a path to a user file with the same keys. Every number and its derivation is documented in simulator/CALIBRATION.md.

Step time of one engine iteration (model seconds), after Aladdin's iteration-time models
(Aladdin section 3, eq. 2-3; docs/reference/vllm-interface.md §8.4 "practical model"):

    t = c_step + max(t_weights, k_prefill * P + c_decode * B) + k_ctx * C + k_attn * A + c_admit * N

P = prefill tokens in the step, B = decoding sequences, C = sum of their context lengths,
A = sum over prefill chunks of chunk_len * (context_before_chunk + chunk_len / 2) (causal attention pairs),
N = requests admitted into the running batch in this step. A profile with `speed_quantiles` multiplies t by
the machine-speed factor at the step's start (simulator/speed.py).
"""

from __future__ import annotations

import math
import random
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from simulator.package_data import builtin_profile, builtin_profile_names


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model: str                      # served model name (Hugging Face id)
    family: str                     # llama3, llama2, ...
    gpu: str
    tp: int                         # tensor-parallel degree = GPUs per worker
    weight_bytes: float
    kv_bytes_per_token: int
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # step-time coefficients (seconds)
    c_step_s: float                 # per-iteration CPU/scheduling/launch overhead
    t_weights_s: float              # weight-streaming floor of one forward pass
    k_prefill_s: float              # per prefill token (compute bound)
    c_decode_s: float               # per decode sequence (its one token's compute)
    k_ctx_s: float                  # per context token read by a decoding sequence (KV streaming)
    k_attn_s: float                 # per (query, key) pair of prefill attention
    ttft_overhead_s: float          # API server + tokenization, once per request before WAITING
    # output-length distribution when the caller has no length of its own (lognormal)
    output_mean_tokens: float
    output_sigma: float
    # P/D KV transfer and sleep/wake
    pd_link_bytes_per_s: float
    pd_setup_s: float
    wake_up_s: float
    description: str = ""
    # Host (CPU) memory link for swapping KV out of and back into the GPU (Chiron section 4's "fast
    # restart": an evicted request's KV is kept in CPU memory). Default: PCIe Gen4 x16, ~25 GB/s effective.
    host_link_bytes_per_s: float = 25e9
    # Engine time per request admitted into the running batch (request state, block table, sampler set-up on the
    # engine's own core, serialised with the forward pass). Fitted for the CPU build by bench/fidelity/calibrate.py's
    # admission probe; 0 where it hides inside c_step_s and ttft_overhead_s (the GPU profiles).
    c_admit_s: float = 0.0
    # Host-path delay per request already running on the engine: a real vLLM API server hands a new request to
    # the EngineCore (and its first token back) more slowly the more streams it is serving. Fitted for the CPU
    # build by bench/fidelity/calibrate.py's host-path probe; 0 in the GPU profiles (no measurement there).
    host_delay_per_running_s: float = 0.0
    # Machine-speed drift (simulator/speed.py): step times x a factor drawn over time from these quantiles of the
    # step time relative to its median (at speed.QUANTILE_PROBS), correlation time speed_tau_s. Measured for the
    # CPU build by bench/fidelity/calibrate.py's speed probe; empty = one constant speed (the GPU profiles).
    speed_quantiles: tuple[float, ...] = ()
    speed_tau_s: float = 30.0

    def pre_engine_delay(self, running: int) -> float:
        """Model seconds from a request's HTTP arrival to its engine entry, with `running` requests on the engine."""
        return self.ttft_overhead_s + self.host_delay_per_running_s * running

    @property
    def gpus_per_worker(self) -> int:
        return self.tp

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def step_time(self, prefill_tokens: int, decode_seqs: int, decode_ctx: int, attn_pairs: float,
                  admitted: int = 0) -> float:
        """One iteration's duration in model seconds (formula in the module docstring)."""
        return (
            self.c_step_s
            + self.c_admit_s * admitted
            + max(self.t_weights_s, self.k_prefill_s * prefill_tokens + self.c_decode_s * decode_seqs)
            + self.k_ctx_s * decode_ctx
            + self.k_attn_s * attn_pairs
        )

    def kv_transfer_s(self, tokens: int) -> float:
        """Time to move `tokens` of KV from a prefill worker to a decode worker (docs/reference/vllm-interface.md §8.5)."""
        return self.pd_setup_s + tokens * self.kv_bytes_per_token / self.pd_link_bytes_per_s

    def kv_swap_s(self, tokens: int, link_bytes_per_s: float | None = None) -> float:
        """Time to copy `tokens` of KV between GPU and host memory (or over `link_bytes_per_s` if given)."""
        return tokens * self.kv_bytes_per_token / (link_bytes_per_s or self.host_link_bytes_per_s)

    def sample_output_tokens(self, rng: random.Random, max_tokens: int | None = None) -> int:
        return sample_output_tokens(self, rng, max_tokens)


def sample_output_tokens(profile: Profile, rng: random.Random, max_tokens: int | None = None) -> int:
    """Draw an output length from the profile's lognormal (mean, sigma), clipped to [1, max_tokens]."""
    sigma = profile.output_sigma
    mu = math.log(profile.output_mean_tokens) - sigma * sigma / 2  # lognormal mean = exp(mu + sigma^2/2)
    n = max(1, round(rng.lognormvariate(mu, sigma)))
    return min(n, max_tokens) if max_tokens else n


_FIELDS = {f.name: f for f in fields(Profile)}
_INT_FIELDS = {"tp", "kv_bytes_per_token", "num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs",
               "max_num_batched_tokens"}
_STR_FIELDS = {"name", "model", "family", "gpu", "description"}


def profile_from_dict(data: dict[str, Any], source: str = "<dict>") -> Profile:
    """Validate a mapping and build a Profile; errors name the source and the bad key."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a profile must be a mapping of keys to values")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{source}: unknown profile key(s): {', '.join(unknown)}")
    missing = sorted(n for n, f in _FIELDS.items() if n not in data and f.default is MISSING)
    if missing:
        raise ValueError(f"{source}: missing profile key(s): {', '.join(missing)}")
    values: dict[str, Any] = {}
    for key, raw in data.items():
        if key in _STR_FIELDS:
            values[key] = str(raw)
            continue
        if key == "speed_quantiles":
            values[key] = _speed_quantiles(raw, source)
            continue
        try:
            num = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: {key} must be a number, got {raw!r}") from None
        if not math.isfinite(num) or num < 0:
            raise ValueError(f"{source}: {key} must be a finite number >= 0, got {raw!r}")
        if key in _INT_FIELDS:
            if num != int(num) or num < 1:
                raise ValueError(f"{source}: {key} must be a positive integer, got {raw!r}")
            num = int(num)
        values[key] = num
    for key in ("output_mean_tokens", "pd_link_bytes_per_s", "weight_bytes", "host_link_bytes_per_s"):
        if key in values and values[key] <= 0:
            raise ValueError(f"{source}: {key} must be > 0")
    prof = Profile(**values)
    if prof.max_model_len > prof.kv_capacity_tokens:
        # vLLM refuses to start when one max-length sequence does not fit the KV cache.
        raise ValueError(
            f"{source}: max_model_len {prof.max_model_len} exceeds KV capacity "
            f"{prof.kv_capacity_tokens} tokens (num_gpu_blocks x block_size)"
        )
    return prof


def _speed_quantiles(raw: Any, source: str) -> tuple[float, ...]:
    from simulator.speed import checked_quantiles

    if not raw:
        return ()
    try:
        return checked_quantiles(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: speed_quantiles: {exc}") from None


def list_profiles() -> list[str]:
    return builtin_profile_names()


def profile_yaml(name_or_path: str | Path) -> tuple[Any, str]:
    """The parsed YAML of a built-in profile (by name) or of a profile file (by path), and where it came from."""
    key = str(name_or_path)
    source: Any = builtin_profile(key)
    if source is None:
        source = Path(key)
        if not source.is_file():
            raise ValueError(f"unknown profile {key!r}: not a built-in ({', '.join(list_profiles())}) nor a file")
    try:
        return yaml.safe_load(source.read_text()), str(source)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: invalid YAML: {exc}") from None


_CACHE: dict[str, Profile] = {}


def load_profile(name_or_path: str | Path | Profile) -> Profile:
    """A built-in profile by name, or a user profile from a YAML file path."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    key = str(name_or_path)
    if key in _CACHE:
        return _CACHE[key]
    prof = profile_from_dict(*profile_yaml(key))
    _CACHE[key] = prof
    return prof
