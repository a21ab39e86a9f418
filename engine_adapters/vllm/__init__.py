"""vLLM's OpenAI-compatible server: request shaping, SSE scanning, /metrics and /v1/models parsing."""

from engine_adapters.vllm.adapter import VllmAdapter

__all__ = ["VllmAdapter"]
