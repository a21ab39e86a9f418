"""The engine adapter interface: everything that knows an engine's wire formats.

The gateway never parses engine formats itself. It asks the adapter to shape a request body, to scan
a streamed response (count tokens, find and optionally strip the usage event), to read usage from a
whole response, to parse `/metrics` into `EngineMetrics` and `/v1/models` into model cards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from engine_adapters.types import EngineMetrics


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class ShapedRequest:
    """The body to send upstream and what the relay must do with the answer."""

    body: bytes
    strip_usage: bool = False  # the usage event was requested by the gateway, not the client


class StreamScanner(ABC):
    """Incremental scanner over a streamed response; one per request.

    `feed(chunk)` returns the bytes to forward to the client now (the chunk itself when nothing is
    stripped). Attributes are updated as events complete.
    """

    tokens: int  # output-token events seen so far
    usage: Usage | None
    done: bool  # the terminal event was seen

    @abstractmethod
    def feed(self, chunk: bytes) -> bytes: ...

    @abstractmethod
    def at_boundary(self) -> bool:
        """True when everything forwarded so far ends on an event boundary."""

    @abstractmethod
    def error_event(self, message: str) -> bytes:
        """Bytes that end the stream with an error the client's SDK understands."""


class EngineAdapter(ABC):
    name: str = "base"
    health_path: str = "/health"
    models_path: str = "/v1/models"
    metrics_path: str = "/metrics"

    @abstractmethod
    def shape_request(self, raw: bytes, body: dict[str, Any], stream: bool, changed: bool) -> ShapedRequest:
        """`raw` is the client's body and `body` its parsed form; `changed` says the gateway edited
        `body` (e.g. filled in `model`), so `raw` can no longer be forwarded as is."""

    @abstractmethod
    def new_stream_scanner(self, strip_usage: bool, whole_events: bool = False) -> StreamScanner: ...

    @abstractmethod
    def parse_usage(self, body: bytes) -> Usage | None:
        """Usage from a whole (non-streamed) response body, or None."""

    @abstractmethod
    def parse_metrics(self, text: str, now: float) -> EngineMetrics: ...

    def openai_error(self, status: int, body: bytes) -> bytes:
        """An engine's error answer (status >= 400) in OpenAI's error shape; the body as is by default."""
        return body

    def context_exceeded(self, status: int, body: bytes) -> bool:
        """Is this error answer the engine's refusal of a request longer than its context? (no by default)"""
        return False

    @abstractmethod
    def parse_models(self, payload: bytes) -> list[dict[str, Any]]:
        """Model cards (each with at least an `id`) from the models endpoint's body."""

    def sleep_path(self, level: int, mode: str) -> str:
        """The dev-mode sleep endpoint (vLLM 0.33: level 0 pauses the scheduler only, `mode=keep` keeps the
        in-flight requests paused; docs/reference/vllm-interface.md §6.1)."""
        return f"/sleep?level={level}&mode={mode}"

    def sleep_fallback(self, level: int, status: int) -> int | None:
        """The level to try when the engine refused `level` with `status` (None: none). A vLLM without level 0
        answers 400 (`level` then means 1 or 2 only): pausing goes through level 1 there."""
        return 1 if level == 0 and status == 400 else None
