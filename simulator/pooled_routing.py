"""Which engine of a model takes a request in the pooled simulator: the gateway's placement step, not a copy.

On a pooled fleet the gateway sees each engine of a shared host as a worker serving its model (gateway/control/pooling.py,
gateway/control/turns.py) and places a request as it places any other: the model's `ModelPlacement`
(policies/placement.py) with the default policy (`policies.base.DEFAULT_POLICY`, least_tokens) over the
candidates under their cap (`has_room`), each a `WorkerView` carrying the requests and tokens reserved on it
(`reserved_tokens`: the prompt and the predicted output, the online `LengthPredictor` the gateway runs). This
module holds those reservations per (model, host) and asks the same objects, so simulator/pooled.py routes by the
rule the gateway routes by. The simulator's engines take requests while paused or asleep, as the gateway's
turns hosts do (`Registry.route_while_asleep`), so a host is a candidate whatever its engine's state; the modes
that route only to an awake engine (request-level swapping) pass those hosts alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.base import DEFAULT_POLICY, make_policy
from policies.length_predictor import LengthPredictor
from policies.placement import ModelPlacement, has_room, reserved_tokens
from policies.types import Decision, RequestFeatures, WorkerView
from simulator.workload import WorkloadRequest


@dataclass
class _Held:
    """What one engine (a model on a host) holds: its requests and their reserved tokens."""

    tokens: dict[str, int] = field(default_factory=dict)


class EngineRouter:
    """The gateway's placement step per model over the engines serving it (module docstring). `cap`: the
    per-engine cap the candidate filter applies (None: none, the gateway's default for a shared host's engine)."""

    def __init__(self, policy: str = DEFAULT_POLICY, cap: int | None = None) -> None:
        self.policy_name = policy
        self.cap = cap
        self.lengths = LengthPredictor()
        self._placements: dict[str, ModelPlacement] = {}
        self._held: dict[tuple[str, str], _Held] = {}
        self._feats: dict[str, RequestFeatures] = {}

    def _placement(self, model: str) -> ModelPlacement:
        p = self._placements.get(model)
        if p is None:
            p = self._placements[model] = ModelPlacement(make_policy(self.policy_name), None, self.lengths.observe)
        return p

    def features(self, model: str, r: WorkloadRequest) -> RequestFeatures:
        return RequestFeatures(request_id=r.request_id, model=model, prompt_tokens=r.prompt_tokens,
                               max_tokens=r.max_tokens, arrival=r.arrival,
                               predicted_output_tokens=self.lengths.predict(model, r.prompt_tokens, r.max_tokens))

    def view(self, model: str, host: str) -> WorkerView:
        held = self._held.get((model, host))
        n, tokens = (len(held.tokens), sum(held.tokens.values())) if held is not None else (0, 0)
        return WorkerView(host, inflight=n, inflight_tokens=tokens, cap=self.cap)

    def place(self, model: str, r: WorkloadRequest, hosts: Sequence[str], now: float) -> str | None:
        """The host whose engine of `model` takes the request (reserved there), None when no candidate has
        room."""
        views = [v for v in (self.view(model, h) for h in hosts) if has_room(v.inflight, v.cap)]
        feats = self.features(model, r)
        placement = self._placement(model)
        d = placement.place(feats, views, now)
        if d.worker_id is None:
            return None
        placement.dispatched(feats, d, now)
        self._hold(model, d.worker_id, feats)
        return d.worker_id

    def hold(self, model: str, host: str, r: WorkloadRequest, now: float) -> None:
        """A request another rule put on `host` (a swap brought its model in): reserved and told to the policy as
        dispatched there, as the gateway's admission queue places a waiting request on the woken engine."""
        feats = self.features(model, r)
        self._placement(model).dispatched(feats, Decision(host, "woken"), now)
        self._hold(model, host, feats)

    def _hold(self, model: str, host: str, feats: RequestFeatures) -> None:
        self._held.setdefault((model, host), _Held()).tokens[feats.request_id] = reserved_tokens(feats)
        self._feats[feats.request_id] = feats

    def finished(self, model: str, host: str, request_id: str, output_tokens: int, now: float) -> None:
        """The request ended on `host` with `output_tokens` (0: failed): its reservation is given back and the
        placement step hears it (the length predictor learns from a completed one)."""
        feats = self._feats.pop(request_id, None)
        if feats is None:
            return
        held = self._held.get((model, host))
        if held is not None:
            held.tokens.pop(request_id, None)
        self._placement(model).finished(feats, host, output_tokens, now)
