"""The `responses:` config section: how long and how much of the Responses API's conversation state the gateway
keeps (gateway/api/responses.py, gateway/state/responses.py). A model of its own so gateway/config/ does not
grow; it imports nothing of the runtime."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ResponsesConfig(BaseModel):
    """Stored responses (`store: true`, the default) that `previous_response_id` continues."""

    model_config = ConfigDict(extra="forbid")

    ttl_s: float = Field(86_400.0, gt=0, description=(
        "How long a stored response (its input and output items, and the conversation before it) is kept; a "
        "`previous_response_id` older than this is not found (404)."))
    max_bytes: int = Field(8 * 1024 * 1024, ge=1024, description=(
        "Largest stored response (JSON bytes, the whole conversation it ends included). A larger one is answered "
        "but not stored: continuing it with `previous_response_id` is refused with a 400 that says so (send the "
        "history with `store: false` instead)."))
    max_total_bytes: int = Field(256 * 1024 * 1024, ge=1024, description=(
        "In-memory state only: all stored responses together; the oldest are dropped first beyond it. With Redis, "
        "its own `maxmemory` policy bounds them (each has a TTL)."))
