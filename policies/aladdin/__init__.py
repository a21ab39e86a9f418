"""`aladdin`: SLO-aware best-fit bin packing of requests onto workers (Aladdin sections 3-4, appendices C, E, F).

For each candidate worker the policy keeps a ledger of the requests it placed there (input length,
predicted output, tokens generated so far) and checks, for the new request j, the constraints of the
section 4.2 MIP:

  (b) ATGT   Σ(l_in + γ·l_out) + (l_in_j + γ·l_pred_j) <= θ·l_d(b + 1)           (eq. 4, strictness γ)
  (c) TTFT   t_pre(pending prefill tokens + l_in_j) <= T_pre                       (eq. 2)
  (d) slack  t_pre(pending + l_in_j) <= θ·min_k (T_dec·l_out_k − t_dec_k)          over ongoing decodes
  (e) KV     max over future decode steps of Σ w_k + w_j <= M                      (the vector w, eq. 1)

and picks, among the feasible workers, the one with the largest capacity_norm (Algorithm 1: the
fullest bin that still fits, so workers are filled before others are opened). With no feasible worker
it answers Decision(None, "no_fit") and `shortfall` says how many more workers the unplaced requests
need. tail="cantelli"/"normal" replaces the point estimates by μ + γ(τ)·σ with the violation budget δ
split over the busy workers (section 4.3, appendix F).

The package, one module per part of the paper:
  * ledger.py       the per-worker ledger (named per-worker arrays; how it stays O(workers) per decision:
                    the decode-step clock of eq. 3, the KV ring of eq. 1, appendix C's re-prediction);
  * constraints.py  (b)-(e) of section 4.2, tail mode (section 4.3, appendix F), `Feasibility`: the
                    per-decision state the choice rules read;
  * choice.py       Algorithm 1's best fit, worst fit, risk mode's deadline and the trust rule;
  * shortfall.py    the scale signal (section 4.1, appendix E.2);
  * rebalancing.py  Algorithm 2 (appendix C);
  * affinity.py     where a conversation's prefix is cached when no KV-event view says so;
  * policy.py       `AladdinPolicy`, the Policy interface over them.

Choices beyond the paper (each a parameter):
  * slack="risk" (default) turns (d) into a risk budget: the new prefill stalls every decode on the
    worker, and a request that has not saved that much slack yet misses its ATGT only if its remaining
    output is too short to earn the deficit back. The expected number of such misses, summed over the
    worker's `YOUNG` (ledger.py) most recently started decodes and its not yet started requests, comes from the
    conditional distribution of output lengths (appendix C: P(L < g + x | L >= g) over the predictor's
    recent completed lengths) and must stay <= `stall_risk`. Until 32 lengths were seen it is "lifetime".
    "lifetime" adds to (d) a lower bound on the slack ongoing requests will still save (their fewest
    predicted remaining steps x (T_dec − current step time)): it trusts mean lengths, so the short
    answers miss; "paper" is (d) as printed (placed requests not decoding yet have slack 0), which closes
    a worker to any prompt after each admission; "off" drops (d). bench/results/placement.md compares them.
  * Risk mode waits for a worker within the budget only while the TTFT allows: once no worker would meet
    the TTFT after `deadline_margin_s` more, it takes the feasible ((b), (c), (e)) worker with the least
    risk ("deadline"). Decision.retry_at tells the admission queue when that moment comes.
  * Which feasible worker: `fit="best"` is Algorithm 1 (the fullest bin; with `margin` m, the fullest of
    those that keep at least m relative headroom on every constraint, else the one with the most); `fit=
    "worst"` takes the one with the most headroom (the constraints then act as admission control and a fleet
    larger than needed spreads its load instead of idling). Best fit minimises the workers in use, which pays
    when idle workers can be released; on a fixed fleet it leaves the model's errors no room. The default is
    "worst": the placement study's leave-one-trace-out protocol chose it, with a 16-deep admission queue
    look-ahead, in every fold (bench/results/placement.md).
  * Trust: `observe_outcome` keeps each worker's recent SLO miss rate (EWMA over `miss_window` requests). Where
    the model is right, requests it placed hardly ever miss; a worker above `max_miss_rate` is not trusted
    and, when every worker the model would place on is untrusted, the `fallback` baseline places the request
    ("fallback") until the rate falls or the learner installs a new model (which resets it).
  * (c) counts the time the request already waited (now − arrival, `count_wait`), the decode step in
    flight and, per prefill chunk (the worker's model's `chunk_tokens`, vLLM's max_num_batched_tokens; else
    `prefill_chunk_tokens`), the ongoing decodes batched with it: their share of the step, eq. 3 without c3
    (the chunk's own pass streams the weights). A request whose TTFT is lost anyway ("late") is placed where
    (b), (d), (e) hold, or (risk mode) where the risk is least, instead of waiting and blocking others.
  * (d)'s t_pre is the stall the decodes suffer under chunked prefill: k1 per queued and new prefill token,
    without c1 (the server's per-request overhead stalls no decode) (`Constraints.stall`).
  * capacity_norm divides batch size and context by the worker's own limits (eq. 4 at b=1, (T−c3)/c2)
    so that workers of different profiles rank on one scale.
  * A request that fits no worker even when alone (e.g. its prefill exceeds the TTFT target) is placed by
    the `fallback` baseline ("best_effort") instead of waiting forever.
  * Engine-reported load (WorkerView running/waiting/kv_usage) beyond the ledger's (other gateway
    replicas) is counted in (b) and (e); in (e) the engine's report also corrects the ledger downwards
    (`Ledger.kv_correction`): prefix blocks that running requests share (a system prompt) are held once.
  * Cache pricing (`price_cache`, on by default: on multi-turn chats half the prompt tokens are cached and
    the estimate without it is 2.5x too long, bench/results/aladdin_estimates.md): the policy declares
    `needs_kv_blocks`, so the
    gateway (from the engines' KV events) and the simulator fill RequestFeatures.cached_prefix_tokens, and
    on each worker only the prompt tokens its prefix cache does not hold count as prefill work in (c), (d)
    and the ledger's prefill queue (eq. 2's k1·l plus the quadratic term's k1q·(l_in² − cached²): the
    uncached tokens still attend to the cached ones). A cached prefix then wins a placement exactly when
    the TTFT or slack it saves is what makes a worker fit (or gives it the most headroom). (b) and (e)
    still count the whole context: cached blocks are decoded over and held like any other.
  * Conversation affinity without KV events (affinity.py): where the caller has no KV-event view, a turn's
    cached prefix is estimated on the worker that served its conversation's last turn (`session_id`, the
    `x-session-id` header), so staying saves the prefill and moving costs the re-prefill in (c) and (d).
    With `infer_prefix` (on by default; the policy declares `needs_prefix_chain`): a turn without an id continues
    the turn whose last full prompt chunk is the deepest in its `prefix_chain` that no two conversations share,
    and every worker is also credited with the longest head of the prompt it was sent (a shared system prompt).
"""

from policies.aladdin.choice import FIT_BEST, FIT_WORST, FITS
from policies.aladdin.constraints import (
    C_ATGT,
    C_KV,
    C_SLACK,
    C_TTFT,
    SLACK_LIFETIME,
    SLACK_MODES,
    SLACK_OFF,
    SLACK_PAPER,
    SLACK_RISK,
    Feasibility,
)
from policies.aladdin.ledger import Ledger
from policies.aladdin.policy import AladdinPolicy
from policies.aladdin.rebalancing import WorkerError, error_distance, propose_moves, worker_errors
from policies.types import Move

__all__ = [
    "C_ATGT", "C_KV", "C_SLACK", "C_TTFT", "FITS", "FIT_BEST", "FIT_WORST", "SLACK_LIFETIME", "SLACK_MODES",
    "SLACK_OFF", "SLACK_PAPER", "SLACK_RISK", "AladdinPolicy", "Feasibility", "Ledger", "Move", "WorkerError",
    "error_distance", "propose_moves", "worker_errors",
]
