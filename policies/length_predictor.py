"""Output-length prediction per (model, input-length bucket), learned online from completed requests.

Point prediction: the bucket's running mean (unbiased), shrunk towards the model-wide mean while the
bucket has few samples. `max_tokens` bounds it: with recent samples at hand the prediction is the
mean of min(L, max_tokens), the expectation of the truncated output, not just min(mean, max_tokens).

Re-prediction (Aladdin appendix C): when a request outlives its prediction, the new prediction is
the conditional mean E[L | L > generated] over the bucket's recent samples (then the model's), and,
with too few long samples, generated + mean (an exponential tail, which is memoryless).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_OUTPUT_TOKENS = 128.0  # RequestFeatures.predicted_output_tokens' default
MAX_BUCKET = 24                # 2^24 tokens of prompt is beyond any context window


def length_bucket(prompt_tokens: int) -> int:
    """log2 bucket of the prompt length: 0 for 0-1 tokens, 1 for 2-3, 2 for 4-7, ..."""
    return min(max(int(prompt_tokens), 1).bit_length() - 1, MAX_BUCKET)


@dataclass(slots=True)
class _Stats:
    """Running mean/variance (Welford) plus a ring of the most recent samples."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    ring: np.ndarray = field(default_factory=lambda: np.zeros(0))
    filled: int = 0
    pos: int = 0

    def add(self, x: float, ring_size: int) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)
        if len(self.ring) != ring_size:
            self.ring = np.resize(self.ring[: self.filled], ring_size)
            self.filled = min(self.filled, ring_size)
            self.pos = self.filled % ring_size
        self.ring[self.pos] = x
        self.pos = (self.pos + 1) % ring_size
        self.filled = min(self.filled + 1, ring_size)

    @property
    def var(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0

    def samples(self) -> np.ndarray:
        return self.ring[: self.filled]

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "m2": self.m2, "ring": self.samples().tolist(), "pos": self.pos}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> _Stats:
        ring = np.asarray(d.get("ring", []), dtype=float)
        return cls(n=int(d["n"]), mean=float(d["mean"]), m2=float(d["m2"]), ring=ring, filled=len(ring),
                   pos=int(d.get("pos", 0)) % max(len(ring), 1))


class LengthPredictor:
    """Online output-length predictor; one per gateway (or per simulation), shared by the policies."""

    def __init__(
        self,
        default_output: float = DEFAULT_OUTPUT_TOKENS,
        shrink: float = 8.0,
        ring_size: int = 512,
        min_conditional: int = 4,
    ) -> None:
        if default_output <= 0 or shrink < 0 or ring_size < 1 or min_conditional < 1:
            raise ValueError("default_output > 0, shrink >= 0, ring_size >= 1, min_conditional >= 1 required")
        self.default_output = float(default_output)
        self.shrink = float(shrink)          # pseudo-samples of the model-wide mean in a bucket's estimate
        self.ring_size = int(ring_size)
        self.min_conditional = int(min_conditional)
        self._buckets: dict[tuple[str, int], _Stats] = {}
        self._models: dict[str, _Stats] = {}

    # --- learning ----------------------------------------------------------------------------------
    def observe(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request of `model` with `prompt_tokens` finished after generating `output_tokens`."""
        if output_tokens < 0 or prompt_tokens < 0:
            raise ValueError("token counts must be >= 0")
        x = float(output_tokens)
        key = (model, length_bucket(prompt_tokens))
        st = self._buckets.get(key)  # not setdefault: that would build (and drop) a _Stats on every call
        if st is None:
            st = self._buckets[key] = _Stats()
        st.add(x, self.ring_size)
        st = self._models.get(model)
        if st is None:
            st = self._models[model] = _Stats()
        st.add(x, self.ring_size)

    def count(self, model: str, prompt_tokens: int | None = None) -> int:
        if prompt_tokens is None:
            st = self._models.get(model)
        else:
            st = self._buckets.get((model, length_bucket(prompt_tokens)))
        return st.n if st else 0

    # --- prediction --------------------------------------------------------------------------------
    def model_mean(self, model: str) -> float:
        """The model-wide mean output length seen so far (the default before any)."""
        ms = self._models.get(model)
        return ms.mean if ms and ms.n else self.default_output

    def _mean(self, model: str, prompt_tokens: int) -> float:
        """Bucket mean shrunk towards the model mean: (n_b·m_b + s·m_model) / (n_b + s)."""
        ms = self._models.get(model)
        base = ms.mean if ms and ms.n else self.default_output
        bs = self._buckets.get((model, length_bucket(prompt_tokens)))
        if not bs or not bs.n:
            return base
        return (bs.n * bs.mean + self.shrink * base) / (bs.n + self.shrink)

    def predict(self, model: str, prompt_tokens: int, max_tokens: int | None = None) -> float:
        """Expected output tokens, at least 1, at most `max_tokens`."""
        mean = self._mean(model, prompt_tokens)
        if max_tokens is not None:
            bs = self._buckets.get((model, length_bucket(prompt_tokens)))
            if bs and bs.filled >= self.min_conditional:
                s = bs.samples()
                if s.max() > max_tokens:  # E[min(L, max_tokens)] over recent samples
                    mean = float(np.minimum(s, max_tokens).mean())
            mean = min(mean, float(max_tokens))
        return max(mean, 1.0)

    def predict_std(self, model: str, prompt_tokens: int) -> float:
        """Standard deviation of the output length in the bucket (model-wide, then exponential: std = mean)."""
        for st in (self._buckets.get((model, length_bucket(prompt_tokens))), self._models.get(model)):
            if st and st.n >= self.min_conditional:
                return math.sqrt(st.var)
        return self._mean(model, prompt_tokens)

    def conditional_mean(
        self, model: str, prompt_tokens: int, generated: float, max_tokens: int | None = None
    ) -> float:
        """Aladdin appendix C re-prediction: E[L | L > generated], bounded by max_tokens."""
        cap = math.inf if max_tokens is None else float(max_tokens)
        if generated >= cap:
            return cap
        for st in (self._buckets.get((model, length_bucket(prompt_tokens))), self._models.get(model)):
            if st and st.filled:
                s = st.samples()
                longer = s[s > generated]
                if len(longer) >= self.min_conditional:
                    return float(np.minimum(longer, cap).mean())
        # Too few longer samples: an exponential tail is memoryless, E[L | L > g] = g + E[L].
        return min(generated + self._mean(model, prompt_tokens), cap)

    def conditional_std(self, model: str, prompt_tokens: int, generated: float) -> float:
        """Std of L given L > generated (same fallbacks as conditional_mean)."""
        for st in (self._buckets.get((model, length_bucket(prompt_tokens))), self._models.get(model)):
            if st and st.filled:
                s = st.samples()
                longer = s[s > generated]
                if len(longer) >= self.min_conditional:
                    return float(longer.std(ddof=1)) if len(longer) > 1 else 0.0
        return self._mean(model, prompt_tokens)

    # --- persistence -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "default_output": self.default_output,
            "shrink": self.shrink,
            "ring_size": self.ring_size,
            "min_conditional": self.min_conditional,
            "buckets": [[m, b, st.to_dict()] for (m, b), st in self._buckets.items()],
            "models": {m: st.to_dict() for m, st in self._models.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LengthPredictor:
        p = cls(
            default_output=data.get("default_output", DEFAULT_OUTPUT_TOKENS),
            shrink=data.get("shrink", 8.0),
            ring_size=data.get("ring_size", 512),
            min_conditional=data.get("min_conditional", 4),
        )
        for m, b, st in data.get("buckets", []):
            p._buckets[(str(m), int(b))] = _Stats.from_dict(st)
        for m, st in data.get("models", {}).items():
            p._models[str(m)] = _Stats.from_dict(st)
        return p
