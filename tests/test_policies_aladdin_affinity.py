"""Conversation inference from the prefix (policies/aladdin/affinity.py): a turn without a conversation id is priced
where the turn its prompt continues ran; a system prompt that many conversations share glues none of them together;
the memory is bounded; an id the request carries wins; the simulator feeds the same code the same way."""

from __future__ import annotations

import pytest

from policies.aladdin import AladdinPolicy
from policies.aladdin.affinity import SessionCache
from policies.perf_model import PerfModel
from policies.prefix import CHUNK_CHARS, prompt_chain, prompt_chunk_hashes
from policies.types import RequestFeatures, WorkerView

# A 2k-token system prompt that, with chat_text's newline, fills 64 chunks exactly.
SYSTEM = ("You are a helpful assistant. Answer briefly and cite sources. " * 140)[:64 * CHUNK_CHARS - 1]
CLOCK = PerfModel(k1=1e-3, c1=0.0, k2=1e-9, c2=0.0, c3=0.01, h=1.0, j=0.0, kv_capacity=1e6, max_batch=256)


def turn(rid: str, *messages: str, session: str | None = None) -> RequestFeatures:
    """A chat turn as the gateway builds it: the messages joined as chat_text joins them, ~4 characters a token."""
    text = "\n".join(messages)
    return RequestFeatures(request_id=rid, model="m", prompt_tokens=len(text) // 4, session_id=session,
                           prefix_chain=prompt_chain(text))


def run(cache: SessionCache, request: RequestFeatures, worker: str, output_tokens: int) -> None:
    cache.placed(request, worker)
    cache.completed(request, worker, output_tokens)


def test_prompt_chain_is_every_full_chunk_of_the_prefix_hashes():
    text = "x" * (CHUNK_CHARS * 70 + 5)
    chain = prompt_chain(text)
    assert len(chain) == 70                                   # the partial last chunk is left out
    assert chain[:64] == prompt_chunk_hashes(text)[:64]       # the same chained hashes, past prefix_hashes' 64
    assert prompt_chain("short") == () and prompt_chain(text + "y" * 500)[:70] == chain


def test_a_continuation_is_found_and_priced_on_the_worker_of_its_previous_turn():
    cache = SessionCache()
    t0 = turn("c1-t0", SYSTEM, "What is the capital of France, and why did it become the capital?")
    run(cache, t0, "w2", output_tokens=200)
    t1 = turn("c1-t1", SYSTEM, "What is the capital of France, and why did it become the capital?",
              "Paris. " * 150, "And of Italy?")
    assert cache.previous_turn(t1) == "c1-t0"
    assert cache.view(t1) == {"w2": t0.prompt_tokens + 200}   # its prompt and answer, where it ran
    run(cache, t1, "w0", output_tokens=25)                     # it moved: the third turn follows it
    t2 = turn("c1-t2", SYSTEM, "What is the capital of France, and why did it become the capital?",
              "Paris. " * 150, "And of Italy?", "Rome. " * 20, "Spain?")
    assert cache.previous_turn(t2) == "c1-t1" and cache.view(t2)["w0"] == t1.prompt_tokens + 25
    # w2, which served the first turn, was sent the head of this prompt up to that turn's prompt: credited with it.
    assert cache.view(t2)["w2"] == int(len(t0.prefix_chain) * t2.prompt_tokens / (len(t2.prefix_chain) + 1))
    # A short answer and a short message add less than a chunk: the next turn ends on the chunk this one ended on,
    # and holds its prompt and answer, so it is still this conversation's next turn (and moves the end on).
    run(cache, t2, "w1", output_tokens=2)
    t3 = turn("c1-t3", SYSTEM, "What is the capital of France, and why did it become the capital?",
              "Paris. " * 150, "And of Italy?", "Rome. " * 20, "Spain?", "Madrid.", "Thanks!")
    assert t3.prefix_chain[-1] == t2.prefix_chain[-1] and t3.prompt_tokens >= t2.prompt_tokens + 2
    assert cache.previous_turn(t3) == "c1-t2" and cache.view(t3)["w1"] == t2.prompt_tokens + 2
    run(cache, t3, "w1", output_tokens=3)
    t4 = turn("c1-t4", SYSTEM, "What is the capital of France, and why did it become the capital?",
              "Paris. " * 150, "And of Italy?", "Rome. " * 20, "Spain?", "Madrid.", "Thanks!", "Welcome " * 30)
    assert cache.turn_ends == 3 and cache.previous_turn(t4) == "c1-t3"
    # Never more than the prompt minus its last token (vLLM recomputes it).
    short = RequestFeatures("c1-t9", "m", prompt_tokens=10, prefix_chain=t4.prefix_chain)
    assert cache.view(short)["w1"] == 9 and max(cache.view(short).values()) == 9
    # Asked again once placed (a retry), a turn still finds the turn before it, not itself.
    assert cache.previous_turn(t2) == "c1-t1"


def test_a_shared_system_prompt_does_not_glue_two_conversations():
    cache = SessionCache()
    # Two conversations open with the same system prompt and a message shorter than a chunk: both first turns end
    # on the system prompt's last full chunk, which every conversation on that prompt holds.
    a0 = turn("a-t0", SYSTEM, "hi")
    b0 = turn("b-t0", SYSTEM, "hey")
    assert a0.prefix_chain == b0.prefix_chain
    run(cache, a0, "w0", 200)
    assert cache.previous_turn(b0) is None            # b's first turn is not a's: a turn ends where it begins
    run(cache, b0, "w1", 200)                         # two turns ended on that head: shared from now on
    c0 = turn("c-t0", SYSTEM, "Tell me about the history of the Roman empire in three long paragraphs. " * 3)
    assert len(c0.prefix_chain) > len(a0.prefix_chain)       # it holds the shared head and goes past it
    assert cache.previous_turn(c0) is None
    # Both workers were sent the system prompt: each is credited with it, and with nothing of a's or b's turns.
    system = int(len(a0.prefix_chain) * c0.prompt_tokens / (len(c0.prefix_chain) + 1))
    assert system <= len(SYSTEM) // 4 + 1 and cache.view(c0) == {"w0": system, "w1": system}
    # Each conversation's own turns are still found past the shared head.
    a1 = turn("a-t1", SYSTEM, "hi", "Hello! How can I help you today? " * 10, "Plan a trip.")
    run(cache, a1, "w0", 80)
    a2 = turn("a-t2", SYSTEM, "hi", "Hello! How can I help you today? " * 10, "Plan a trip.", "Sure. " * 60, "Go")
    assert cache.previous_turn(a2) == "a-t1" and cache.view(a2)["w0"] == a1.prompt_tokens + 80


def test_a_head_continued_by_two_requests_is_shared_and_matches_nothing_more():
    """One conversation opened with the system prompt and a short message (its first turn ends on the shared head);
    the first other conversation to extend that head is taken for its continuation (there is no telling yet), the
    second shows the head is shared: neither it nor any later one is glued to the first."""
    cache = SessionCache()
    run(cache, turn("a-t0", SYSTEM, "hi"), "w0", 200)
    b0 = turn("b-t0", SYSTEM, "Summarise the plot of Hamlet in five sentences, please, with the names. " * 3)
    assert cache.previous_turn(b0) == "a-t0"          # the one glue the rule allows per shared head
    run(cache, b0, "w1", 100)
    c0 = turn("c-t0", SYSTEM, "Write a haiku about autumn leaves falling on a quiet mountain lake. " * 3)
    assert cache.previous_turn(c0) is None
    run(cache, c0, "w2", 100)
    d0 = turn("d-t0", SYSTEM, "Explain quicksort and its average complexity, step by step, with an example. " * 3)
    assert cache.previous_turn(d0) is None
    # No worker is credited with more than the system prompt (what all four share).
    system = int(64 * d0.prompt_tokens / (len(d0.prefix_chain) + 1))
    assert cache.view(d0) == {"w0": system, "w1": system, "w2": system}
    # b's own next turn is found (its turn end is past the shared head).
    b1 = turn("b-t1", SYSTEM, "Summarise the plot of Hamlet in five sentences, please, with the names. " * 3,
              "Hamlet is a prince. " * 30, "Now Macbeth.")
    assert cache.previous_turn(b1) == "b-t0" and cache.view(b1)["w1"] == b0.prompt_tokens + 100


def test_memory_is_bounded_by_max_sessions_and_max_sent_chunks():
    cache = SessionCache(max_sessions=3, max_sent_chunks=10)
    firsts = [turn(f"c{i}-t0", f"conversation {i}: " + "words " * 100) for i in range(10)]
    for i, t in enumerate(firsts):
        run(cache, t, f"w{i % 2}", 50)
    assert cache.turn_ends == 3 and cache.sent_chunks("w0") == cache.sent_chunks("w1") == 10
    old = turn("c0-t1", "conversation 0: " + "words " * 100, "answer " * 40, "next")
    new = turn("c9-t1", "conversation 9: " + "words " * 100, "answer " * 40, "next")
    assert cache.view(old) == {}                       # forgotten, least recently placed first (both kinds)
    assert cache.view(new) == {"w1": firsts[9].prompt_tokens + 50}
    for i in range(10):
        cache.placed(turn(f"s{i}", f"s{i}", session=f"id{i}"), "w0")
    assert len(cache) == 3 and cache.turn_ends == 3
    with pytest.raises(ValueError):
        SessionCache(max_sessions=0)


def test_a_conversation_id_wins_over_the_inferred_conversation():
    cache = SessionCache()
    run(cache, turn("x-t0", SYSTEM, "question one, long enough to end past the system prompt"), "w0", 100)
    run(cache, turn("y-t0", "something else entirely", session="conv-y"), "w1", 100)
    # Its prefix continues x-t0 (on w0), but it names conversation y, whose last turn ran on w1.
    t = turn("y-t1", SYSTEM, "question one, long enough to end past the system prompt", "a " * 100, "more",
             session="conv-y")
    sent = int(len(prompt_chain(SYSTEM + "\nquestion one, long enough to end past the system prompt"))
               * t.prompt_tokens / (len(t.prefix_chain) + 1))    # what w0 was sent of it: x-t0's prompt, not its answer
    assert cache.view(t) == {"w1": len("something else entirely") // 4 + 100, "w0": sent}
    assert cache.previous_turn(t) is None
    # An id without a previous turn: not the inferred conversation (x-t0 and its answer), only what w0 was sent.
    assert cache.view(RequestFeatures("z", "m", prompt_tokens=t.prompt_tokens, session_id="conv-z",
                                      prefix_chain=t.prefix_chain)) == {"w0": sent}
    # infer=False: ids only (how it was before).
    off = SessionCache(infer=False)
    run(off, turn("x-t0", SYSTEM, "question one, long enough to end past the system prompt"), "w0", 100)
    assert off.view(turn("x-t1", SYSTEM, "question one, long enough to end past the system prompt", "a b")) == {}


def test_aladdin_places_a_turn_without_an_id_where_its_conversation_ran():
    """Through the policy: on_dispatch and observe_completion feed the cache, (c) prices the cached prefix."""
    ws = [WorkerView("w0"), WorkerView("w1")]
    p = AladdinPolicy(default_perf_model=CLOCK, slack="off")       # 1 ms per prompt token, TTFT 0.6 s
    assert p.needs_prefix_chain and not AladdinPolicy(infer_prefix=False).needs_prefix_chain
    history = "the story so far " * 120                                # ~510 tokens
    t0 = turn("t0", history)
    d = p.choose(t0, ws, 0.0)
    p.on_dispatch(t0, d.worker_id, 0.0)
    p.observe_completion(t0, 100, 1.0)
    p.on_complete(t0, d.worker_id, 1.0)
    t1 = turn("t1", history, "an answer " * 40, "and then?")         # ~620 tokens: 0.62 s uncached, too slow
    assert p.constraints.prefix_view(t1) == {d.worker_id: t0.prompt_tokens + 100}
    d1 = p.choose(t1, ws, 2.0)
    assert d1.worker_id == d.worker_id and d1.reason != "best_effort"
    # Without inference no worker holds it: nothing fits, a best effort.
    q = AladdinPolicy(default_perf_model=CLOCK, slack="off", infer_prefix=False)
    q.on_dispatch(t0, d.worker_id, 0.0)
    q.observe_completion(t0, 100, 1.0)
    q.on_complete(t0, d.worker_id, 1.0)
    assert q.constraints.prefix_view(t1) == {} and q.choose(t1, ws, 2.0).reason == "best_effort"


def test_the_simulator_feeds_the_chain_and_can_run_without_kv_events():
    from simulator.cluster import ClusterSim
    from simulator.workload import WorkloadRequest

    blocks = tuple(range(1, 201))
    r = WorkloadRequest("r", 0.0, 200 * 16, 8, prefix_blocks=blocks)
    sim = ClusterSim("llama3-8b-h100", 2, "aladdin", kv_events=False)
    assert sim.kv_view is None and sim.features(r).prefix_chain == blocks and len(sim.features(r).prefix_hashes) == 64
    assert ClusterSim("llama3-8b-h100", 2, "aladdin").kv_view is not None
    assert ClusterSim("llama3-8b-h100", 2, "least_tokens").features(r).prefix_chain == ()
    # A second turn continuing the first is priced where the first ran.
    nxt = WorkloadRequest("r2", 30.0, 260 * 16, 8, prefix_blocks=blocks + tuple(range(1000, 1060)))
    sim.run([r, nxt])
    first, second = sim.results["r"], sim.results["r2"]
    assert first.finish_reason and second.finish_reason and second.num_cached_tokens >= 199 * 16
    assert sim.policy.constraints.sessions.previous_turn(sim.features(nxt)) == "r"
    assert second.worker_id == first.worker_id
