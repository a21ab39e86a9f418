"""The vLLM versions fleetgate supports, stated in this one place (docs, the deploy files' image pins and the
real-vLLM checks are tested against it).

- `SUPPORTED_VLLM`: the vLLM release series the engine adapter speaks. 0.11 is the reference
  (docs/reference/vllm-interface.md): its /metrics names (plus the pre-0.9 `gpu_*` spellings the metric parser
  still reads), its positional KV-event arrays and its P/D `kv_transfer_params`; 0.32 and 0.33 add the tagged
  KV-event maps, cache_salt-tagged block hashes (`kv_events.hash_style: "0.32"`), `vllm:engine_sleep_state` and
  `/sleep?level=0&mode=keep`. Releases between them are not checked.
- `CHECKED_VLLM`: the exact release the real-vLLM end-to-end suite runs (tests_vllm/, the CPU build from
  scripts/vllm_env.sh); the deploy files pin its image, `VLLM_IMAGE`.
"""

from __future__ import annotations

SUPPORTED_VLLM: tuple[str, ...] = ("0.11", "0.32", "0.33")
CHECKED_VLLM = "0.32.0"
VLLM_IMAGE = f"vllm/vllm-openai:v{CHECKED_VLLM}"


def supported(version: str) -> bool:
    """Whether a vLLM version string (`0.32.0`, `0.11.1`, `0.33.0rc1`) is of a supported release series."""
    parts = version.lstrip("v").split(".")
    return len(parts) >= 2 and ".".join(parts[:2]) in SUPPORTED_VLLM
