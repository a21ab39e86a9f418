"""What one relay to a worker produced: the result of an answer relayed (`RelayResult`), where the client's
response is (`ResponseState`), and a worker's failure before the client saw a byte (`UpstreamFailure` and
its kinds). Plain data, read by the pipeline, learning, SLO accounting, the access log and tracing.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapters.base import Usage

STATUS_429 = "status_429"  # UpstreamFailure.kind of a worker's 429 (a refusal, not a fault of the worker)
TOO_LONG = "context_length"  # ... of a worker's 400 for a request longer than its context


class UpstreamFailure(Exception):
    """The worker failed before the client saw a byte; the dispatcher may try another worker."""

    def __init__(self, kind: str, detail: str, status: int | None = None, body: bytes = b"",
                 content_type: bytes = b"application/json") -> None:
        super().__init__(detail)
        self.kind = kind  # connect | timeout | status_5xx | body
        self.detail = detail
        self.status = status
        self.body = body
        self.content_type = content_type


@dataclass(slots=True)
class RelayResult:
    status: int = 0
    usage: Usage | None = None
    tokens: int = 0  # output-token events seen (streams)
    first_token_at: float | None = None  # perf_counter() times
    last_token_at: float | None = None
    midstream_error: str | None = None  # the stream broke after it started
    stalled: bool = False  # ... because the worker went silent for longer than its pace allows
    max_gap: float | None = None  # the longest wait between two output tokens (streams of 2+ tokens)
    kv_params: dict | None = None  # a P/D prefill leg's answer: the kv_transfer_params for the decode leg

    @property
    def output_tokens(self) -> int:
        """Generated tokens of the answer: the usage block's count, else the stream's token events (the one
        definition: SLO judging, the learning loop, the placement step's feedback and metrics all read it)."""
        return self.usage.completion_tokens if self.usage is not None else self.tokens


class ResponseState:
    """Where the client's response is: started (no retry possible any more), ended (last byte queued),
    and the output tokens relayed so far (read by the learning loop for progress reports)."""

    __slots__ = ("started", "ended", "tokens")

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self.tokens = 0
