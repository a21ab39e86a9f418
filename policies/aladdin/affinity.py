"""Where a conversation's prefix is cached when no KV-event view says so: the worker that served its last turn.

A chat resends the whole conversation every turn, so a turn's prompt starts with the previous turn's prompt and
answer, and vLLM's prefix cache on the worker that served that turn still holds them (until evicted). With KV
events the caller fills RequestFeatures.cached_prefix_tokens exactly (docs/routing.md); without them, aladdin's
cache pricing falls back to this estimate, keyed by the request's conversation id (`session_id`, the gateway's
`x-session-id` header): on the last turn's worker, min(that turn's prompt + answer, this prompt − 1) tokens (vLLM
never serves a prompt's last token from cache); elsewhere none. So the prefill a turn saves where its conversation
ran is in (c)'s and (d)'s estimate, and moving a conversation costs its re-prefill there.

Bounded: the `max_sessions` most recently seen conversations (LRU). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from policies.types import RequestFeatures

DEFAULT_MAX_SESSIONS = 100_000


class SessionCache:
    """Per conversation: the worker of its last turn and the tokens that turn left in its prefix cache."""

    __slots__ = ("max_sessions", "_last")

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def view(self, request: RequestFeatures) -> Mapping[str, int]:
        """The estimated cached prefix per worker for the request ({} when its conversation is unknown)."""
        sid = request.session_id
        last = self._last.get(sid) if sid else None
        if last is None:
            return {}
        worker, tokens = last
        return {worker: max(min(tokens, int(request.prompt_tokens) - 1), 0)}

    def placed(self, request: RequestFeatures, worker_id: str) -> None:
        """The turn went to `worker_id`: its prompt will be cached there once prefilled."""
        self._note(request, worker_id, int(request.prompt_tokens))

    def completed(self, request: RequestFeatures, worker_id: str, output_tokens: int) -> None:
        """The turn ended on `worker_id` after `output_tokens`: its prompt and answer are cached there."""
        self._note(request, worker_id, int(request.prompt_tokens) + max(int(output_tokens), 0))

    def _note(self, request: RequestFeatures, worker_id: str, tokens: int) -> None:
        sid = request.session_id
        if not sid:
            return
        self._last[sid] = (worker_id, max(tokens, 0))
        self._last.move_to_end(sid)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
