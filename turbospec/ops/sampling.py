"""Sampling parameters, their validation, and drafter-side sampling.

The target side of sampling lives in the ``verify`` op; drafters use the same ``logits_to_probs``
so that their q is computed exactly as documented.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .reference import logits_to_probs


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def draft_sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None
                 ) -> tuple[int, Tensor | None]:
    """Draw one draft token from ``logits [V]``. Greedy: (argmax, None). Otherwise (token, q) with
    q = logits_to_probs(logits, ...) [V] float32, the distribution it was drawn from."""
    if params.greedy:
        return int(torch.argmax(logits)), None
    q = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
    return int(torch.multinomial(q, 1, generator=generator)), q
