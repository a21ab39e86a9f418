"""LoRA adapters in the simulated vLLM server: vLLM's flags, the adapter registry, and what a load costs.

What is emulated (vLLM 0.11; docs/reference/vllm-interface.md §6.2 restates it with its sources):

- Flags: `--enable-lora`, `--lora-modules name=path` or the JSON form `{"name", "path", "base_model_name"}`,
  `--max-loras` (distinct adapters in one batch; default 1), `--max-cpu-loras` (adapters kept loaded in host
  memory; default = max_loras, never below it), `--max-lora-rank` (default 16). `vllm/config/lora.py`,
  `vllm/entrypoints/openai/cli_args.py::LoRAParserAction`.
- The registry of served adapters (`vllm/entrypoints/openai/serving_models.py::OpenAIServingModels`): each load
  gets the next integer id; an adapter's `parent` is its `base_model_name` when that names the served model,
  else the served model; unloading only drops the name from the registry (the engine's caches keep the weights
  until evicted).
- Runtime updates need `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set to `1` or `true` (`vllm/envs.py`); the simulator reads
  the same variable, or takes `ServerConfig.allow_runtime_lora_updating`.

What a load costs, and the constants it uses, live in policies/adapters.py (the gateway prices a runtime load
with the same function).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # the ranks vLLM's LoRA kernels are built for


class LoraError(ValueError):
    """A LoRA flag that vLLM would refuse; the message names it."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Sequence[str | dict[str, Any]] | None) -> list[LoraModule]:
    """`name=path` strings, JSON objects (as strings or dicts) with name, path and optional base_model_name."""
    out: list[LoraModule] = []
    if isinstance(values, (str, dict)):   # one entry given without a list (a fleet file's `lora_modules: a=/p`)
        values = [values]
    for raw in values or ():
        data: Any = raw
        if isinstance(raw, str):
            text = raw.strip()
            if text.startswith("{"):
                try:
                    data = orjson.loads(text)
                except orjson.JSONDecodeError:
                    raise LoraError(f"--lora-modules: invalid JSON {raw!r}") from None
            else:
                name, sep, path = text.partition("=")
                if not sep or not name or not path:
                    raise LoraError(f"--lora-modules: expected name=path or JSON, got {raw!r}")
                out.append(LoraModule(name, path))
                continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) \
                or not isinstance(data.get("path"), str):
            raise LoraError(f"--lora-modules: a JSON entry needs string 'name' and 'path', got {raw!r}")
        base = data.get("base_model_name")
        out.append(LoraModule(data["name"], data["path"], base if isinstance(base, str) else None))
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise LoraError(f"--lora-modules: duplicate adapter name(s) {dup}")
    return out


def runtime_updating_from_env() -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true", any case."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def check_limits(enable_lora: bool, max_loras: int, max_cpu_loras: int | None, max_lora_rank: int,
                 modules: Sequence[LoraModule]) -> int:
    """Validate the LoRA flags as vLLM's LoRAConfig does; returns the effective max_cpu_loras."""
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LoraError(f"{name} must be an integer >= 1, got {value!r}")
    if max_lora_rank not in MAX_LORA_RANKS:
        raise LoraError(f"max_lora_rank ({max_lora_rank}) must be one of {MAX_LORA_RANKS}.")
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if isinstance(cpu, bool) or not isinstance(cpu, int):
        raise LoraError(f"max_cpu_loras must be an integer, got {cpu!r}")
    if cpu < max_loras:   # vllm/config/lora.py: max_cpu_loras must be >= max_loras
        raise LoraError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})")
    if modules and not enable_lora:
        raise LoraError("--lora-modules needs --enable-lora")
    return cpu
