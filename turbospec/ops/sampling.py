"""Sampling parameters, their validation, drafter-side sampling, and the log-probabilities of
emitted tokens.

The target side of sampling lives in the ``verify`` op; drafters use the same ``logits_to_probs``
so that their q is computed exactly as documented.

Log-probabilities (``logprobs`` / ``top_logprobs``) are those of the distribution each token was
actually drawn from (what OpenAI and vLLM report):

* greedy (temperature 0): ``log_softmax`` of the target's raw logits (float32);
* sampling: the log of the processed distribution ``verify`` samples from,
  ``logits_to_probs(logits, temperature, top_k, top_p)`` (float32 probabilities; the log is taken
  in float64 on the host). A token removed by top-k / top-p has probability 0 (log -inf).

Under speculation every emitted token (accepted draft, recovered or bonus token) follows the
target's processed distribution at its prefix exactly (recursive rejection sampling), so its
log-probability is that distribution's at the node of the accepted path that predicts it: the same
number plain decoding reports for the same prefix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .reference import logits_to_probs
from .checks import is_int


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not is_int(k) or k < 0:
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


# ----------------------------------------------------------------------------------------------
# log-probabilities of emitted tokens
# ----------------------------------------------------------------------------------------------
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability under the distribution it was drawn from (see the module
    docstring), and the most likely alternatives there: ``top`` holds up to ``top_logprobs``
    (token id, logprob) pairs, most likely first (ties: lower id first); tokens of probability 0
    (filtered out by top-k / top-p) are left out, so the list may be shorter."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_logprobs(logprobs, top_logprobs) -> int | None:
    """``logprobs`` (bool) and ``top_logprobs`` (int in [0, 20]) checked: the number of alternatives
    to report per token, or None when log-probabilities are off. Raises ValueError naming the field."""
    if logprobs is None:
        logprobs = False
    if top_logprobs is None:
        top_logprobs = 0
    if not isinstance(logprobs, bool):
        raise ValueError(f"logprobs must be True or False, got {logprobs!r}")
    if not is_int(top_logprobs) or \
            not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    if top_logprobs and not logprobs:
        raise ValueError(f"top_logprobs={top_logprobs} needs logprobs=True")
    return top_logprobs if logprobs else None


def logprob_width(top: int, vocab: int) -> int:
    """Numbers per path node that ``path_logprobs`` returns."""
    return 1 + 2 * min(top, vocab)


def path_logprobs(logits: Tensor, tokens: Tensor, params: SamplingParams, top: int) -> Tensor:
    """The device side of a step's log-probabilities, computed without a host sync: ``logits``
    [m, V] at the m nodes of the accepted path (padding rows allowed), ``tokens`` int64 [m] the
    tokens emitted there (-1: none). Returns float64 [m * (1 + 2 t)], t = min(top, V), per node:
    the value at the emitted token, the t largest values, their token ids (exact in float64).
    The values are log_softmax(logits) for greedy ``params``, else the probabilities of
    ``logits_to_probs`` (``read_logprobs`` takes their log on the host). Each row's numbers depend
    on that row only (the same bits whatever else is in ``logits``)."""
    x = logits.float()
    if params.greedy:
        vals = torch.log_softmax(x, dim=-1)
    else:
        vals = logits_to_probs(x, params.temperature, params.top_k, params.top_p)
    parts = [vals.gather(-1, tokens.clamp(min=0)[:, None]).double()]
    t = min(top, vals.shape[-1])
    if t:
        top_vals, top_ids = torch.topk(vals, t, dim=-1)
        parts += [top_vals.double(), top_ids.double()]
    return torch.cat(parts, dim=-1).flatten()


def read_logprobs(values: list[float], tokens: list[int], params: SamplingParams, top: int,
                  vocab: int) -> list[TokenLogprob]:
    """The host side: ``values`` from ``path_logprobs`` (as Python floats, at least
    ``len(tokens)`` nodes' worth), ``tokens`` the tokens emitted at those nodes -> one
    ``TokenLogprob`` per token."""
    t = min(top, vocab)
    width = 1 + 2 * t
    greedy = params.greedy

    def lp(v: float) -> float:
        if greedy:
            return v
        return math.log(v) if v > 0 else float("-inf")

    out = []
    for j, tok in enumerate(tokens):
        row = values[j * width: (j + 1) * width]
        alts = sorted(((int(i), lp(v)) for v, i in zip(row[1: 1 + t], row[1 + t:])
                       if (v != float("-inf") if greedy else v > 0)), key=lambda a: (-a[1], a[0]))
        out.append(TokenLogprob(int(tok), lp(row[0]), tuple(alts)))
    return out
