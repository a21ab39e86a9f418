"""The simulator's package data, found through importlib.resources (a checkout and an installed wheel alike).

- `traces/`: public LLM-serving traces, unchanged, with their licenses (`traces/README.md`);
- `profiles/`: the built-in performance profiles (`<name>.yaml`, see `simulator/CALIBRATION.md`).

Everything that reads them (`simulator.workload`, `simulator.profiles`, the benchmarks, the gateway's priors
through `simulator.profiles`) goes through the functions here, never through a path built from `__file__`.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

# built-in trace name -> file in traces/
BUILTIN_TRACES = {
    "azure_conv": "azure2023_conv.csv",
    "sharegpt": "sharegpt_lengths_llama2.csv",
    "arxiv": "arxiv_summarization_lengths_llama2.csv",
    "mooncake": "mooncake_synthetic.jsonl",
}


def _dir(name: str) -> Traversable:
    return resources.files("simulator").joinpath(name)


def builtin_trace(name: str) -> Traversable | None:
    """The file of a built-in trace (`azure_conv`, `sharegpt`, `arxiv`, `mooncake`), None for other names."""
    file = BUILTIN_TRACES.get(name)
    return _dir("traces").joinpath(file) if file is not None else None


def builtin_profile_names() -> list[str]:
    return sorted(f.name[: -len(".yaml")] for f in _dir("profiles").iterdir() if f.name.endswith(".yaml"))


def builtin_profile(name: str) -> Traversable | None:
    """The YAML file of a built-in profile, None if there is none of that name."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    file = _dir("profiles").joinpath(f"{name}.yaml")
    return file if file.is_file() else None


__all__ = ["BUILTIN_TRACES", "builtin_profile", "builtin_profile_names", "builtin_trace"]
