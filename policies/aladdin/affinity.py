"""Where a conversation's prefix is cached when no KV-event view says so: the worker that served its last turn.

A chat resends the whole conversation every turn, so a turn's prompt starts with the previous turn's prompt and
answer, and vLLM's prefix cache on the worker that served that turn still holds them (until evicted). With KV
events the caller fills RequestFeatures.cached_prefix_tokens exactly (docs/routing.md); without them, aladdin's
cache pricing falls back to this estimate: on the last turn's worker, min(that turn's prompt + answer, this
prompt − 1) tokens (vLLM never serves a prompt's last token from cache); elsewhere what the worker was sent (below).
So the prefill a turn saves where its conversation ran is in (c)'s and (d)'s estimate, and moving a conversation
costs its re-prefill. `infer` off (aladdin's infer_prefix false): the id's last turn only, nothing inferred.

Which turn was the last one:
  * the request carries a conversation id (`session_id`: the gateway's `x-session-id` header, a Responses chain,
    `prompt_cache_key`, Anthropic `metadata.user_id`): the id's last turn. The id always wins.
  * it does not: inferred from its prefix. `prefix_chain` holds the chained hash of every full chunk of the prompt
    (policies/prefix.py `prompt_chain`; the simulator's block keys), so turn k+1's chain holds the hash of turn
    k's deepest full chunk, its *turn end*. Each turn placed without an id records its turn end; a request's
    previous turn is the deepest turn end in its chain (one dict look-up per chunk, deepest first); on its own
    last chunk only a completed turn whose prompt and answer its prompt can hold (an answer and a new message
    shorter than a chunk).
    A head that many conversations share must not glue them together: conversations that open with the same
    system prompt and a message shorter than a chunk all end their first turn on the system prompt's last chunk,
    and every later conversation on that prompt holds it. In a conversation each turn end is continued once,
    by the next turn, so a turn end is *shared*, and matches nothing any more, once two turns end on it or two
    different requests continue it; a request whose deepest turn end is shared infers nothing (every shallower
    one is shared at least as widely). At most one request per shared head (the first to continue it) is
    matched before the second shows it is shared.

What every worker was sent: a conversation's turn is one source of a cached prefix; a prefix that many requests
share (a system prompt, a document) is another, and it is cached on every worker that served one of them. So the
chain of every request placed is recorded per worker (policies/prefix.py PrefixIndex: LRU, the head chunks the
most recent, as production-stack's prefixaware and llm-d's approximate prefix scorer keep it), and each worker is
credited with the tokens of the longest head of the request's chain it was sent (its chunks x the fewest tokens a
chunk of this prompt can hold, prompt / (chunks + 1), so never more than was sent). That credits a shared system
prompt where it went, and only it: it names no conversation, so it glues none. The estimate for a worker is the
larger of the two.

Bounded: the `max_sessions` most recently seen ids and as many turn ends (each an LRU), `max_sent_chunks` chunk
hashes per worker. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from itertools import islice

from policies.prefix import PrefixIndex
from policies.types import RequestFeatures

DEFAULT_MAX_SESSIONS = 100_000
DEFAULT_MAX_SENT_CHUNKS = 20_000    # per worker, as prefix_affinity's index (policies/baselines.py)


class _Turn:
    """A turn placed without a conversation id: where it ran and what it left cached there."""

    __slots__ = ("request_id", "worker", "tokens", "done", "next_id", "shared")

    def __init__(self, request_id: str, worker: str, tokens: int) -> None:
        self.request_id, self.worker, self.tokens = request_id, worker, tokens
        self.done = False                 # completed: `tokens` is its prompt + answer
        self.next_id: str | None = None   # the request that continued it (its conversation's next turn)
        self.shared = False               # two turns ended here, or two requests continued it


class SessionCache:
    """Per conversation: the worker of its last turn and the tokens that turn left in its prefix cache; the
    conversation named by the request's id, else inferred from its prefix chain (module docstring)."""

    __slots__ = ("max_sessions", "infer", "_last", "_ends", "_sent", "_version", "_memo")

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, infer: bool = True,
                 max_sent_chunks: int = DEFAULT_MAX_SENT_CHUNKS) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self.infer = bool(infer)
        self._last: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._sent = PrefixIndex(max_sent_chunks)               # worker -> the chunks it was sent (LRU)
        self._ends: OrderedDict[int, _Turn] = OrderedDict()   # turn-end hash -> the turn
        # A request is looked up at each decision, at its dispatch and when placed: one scan while nothing changed.
        self._version = 0
        self._memo: tuple[str, tuple[int, ...], int, tuple[_Turn | None, _Turn | None]] | None = None

    def view(self, request: RequestFeatures) -> Mapping[str, int]:
        """The estimated cached prefix per worker for the request ({} where nothing is known)."""
        top = max(int(request.prompt_tokens) - 1, 0)
        out: dict[str, int] = {}
        chain = request.prefix_chain
        if self.infer and chain:
            # Tokens a chunk holds, at least: the chain's full chunks and a partial one make the prompt.
            per, sent = int(request.prompt_tokens) / (len(chain) + 1), self._sent
            for w in sent.workers():
                n = sent.match_len(w, chain)
                if n:
                    out[w] = min(int(n * per), top)
        sid = request.session_id
        if sid:
            last = self._last.get(sid)
            if last is None:
                return out
            worker, tokens = last
        else:
            turn = self._previous(request)[0]
            if turn is None:
                return out
            worker, tokens = turn.worker, turn.tokens
        out[worker] = max(out.get(worker, 0), min(tokens, top))
        return out

    def previous_turn(self, request: RequestFeatures) -> str | None:
        """The request id of the turn inferred to precede this request (None: none, or it carries an id)."""
        turn = None if request.session_id else self._previous(request)[0]
        return turn.request_id if turn is not None else None

    def placed(self, request: RequestFeatures, worker_id: str) -> None:
        """The turn went to `worker_id`: its prompt will be cached there once prefilled."""
        if self.infer and request.prefix_chain:
            self._sent.record(worker_id, request.prefix_chain)
        if request.session_id:
            self._note(request.session_id, worker_id, int(request.prompt_tokens))
            return
        if not self.infer or not request.prefix_chain:
            return
        rid = request.request_id
        prev, fork = self._previous(request)
        self._version += 1
        if prev is not None:
            prev.next_id = rid
        elif fork is not None:
            fork.shared = True
        end = request.prefix_chain[-1]
        turn = self._ends.get(end)
        if turn is None or turn is prev:   # new, or its previous turn ended on the same chunk: it moves on
            self._ends[end] = _Turn(rid, worker_id, max(int(request.prompt_tokens), 0))
            while len(self._ends) > self.max_sessions:
                self._ends.popitem(last=False)
            return
        self._ends.move_to_end(end)
        if turn.request_id == rid:      # placed again (a retry elsewhere): it runs there now
            turn.worker, turn.tokens = worker_id, max(int(request.prompt_tokens), 0)
        else:                           # a second turn ends on this head: shared by two conversations
            turn.shared = True

    def completed(self, request: RequestFeatures, worker_id: str, output_tokens: int) -> None:
        """The turn ended on `worker_id` after `output_tokens`: its prompt and answer are cached there."""
        tokens = int(request.prompt_tokens) + max(int(output_tokens), 0)
        if request.session_id:
            self._note(request.session_id, worker_id, tokens)
            return
        if not self.infer or not request.prefix_chain:
            return
        turn = self._ends.get(request.prefix_chain[-1])
        if turn is not None and turn.request_id == request.request_id:
            turn.worker, turn.tokens, turn.done = worker_id, max(tokens, 0), True
            self._version += 1

    def _previous(self, request: RequestFeatures) -> tuple[_Turn | None, _Turn | None]:
        """(the turn this request continues, None) or, when its deepest turn end is shared or continued by another
        request already, (None, that turn); (None, None) when its chain holds no turn end."""
        if not self.infer or not request.prefix_chain:
            return None, None
        rid, chain = request.request_id, request.prefix_chain
        memo = self._memo
        if memo is not None and memo[0] == rid and memo[1] is chain and memo[2] == self._version:
            return memo[3]
        found = self._scan(request)
        self._memo = (rid, chain, self._version, found)
        return found

    def _scan(self, request: RequestFeatures) -> tuple[_Turn | None, _Turn | None]:
        ends, rid, chain = self._ends, request.request_id, request.prefix_chain
        last = ends.get(chain[-1])
        # On its own last chunk, a turn that ended there too is its previous turn only if this prompt holds that
        # one's prompt and answer (a short answer and message); else it is a second conversation that opened on
        # the same head (a system prompt and a message shorter than a chunk), or itself, asked again once placed.
        if last is not None and last.request_id != rid and last.done and int(request.prompt_tokens) >= last.tokens:
            turn: _Turn | None = last
        else:   # the deepest turn end before it: the look-ups run in C (a long prompt has thousands of chunks)
            turn = next(filter(None, map(ends.get, islice(reversed(chain), 1, None))), None)
        if turn is None:
            return None, None
        if turn.shared or (turn.next_id is not None and turn.next_id != rid):
            return None, turn
        return turn, None

    def _note(self, sid: str, worker_id: str, tokens: int) -> None:
        self._last[sid] = (worker_id, max(tokens, 0))
        self._last.move_to_end(sid)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def sent_chunks(self, worker_id: str) -> int:
        """How many chunk hashes sent to the worker it remembers (at most `max_sent_chunks`)."""
        return self._sent.size(worker_id)

    @property
    def turn_ends(self) -> int:
        """How many turn ends (requests placed without an id) it remembers."""
        return len(self._ends)

    def __len__(self) -> int:
        return len(self._last)
