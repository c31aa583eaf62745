"""Sampling parameters, their validation, drafter-side sampling, and the log-probabilities of
emitted tokens.

The target side of sampling lives in the ``verify`` op; drafters use the same ``logits_to_probs``
so that their q is computed exactly as documented.

Log-probabilities (``logprobs`` / ``top_logprobs``) are those of the distribution each token was
actually drawn from (what OpenAI and vLLM report):

* greedy (temperature 0): ``log_softmax`` of the target's logits (float32) after the logit
  processing (bias, penalties, bitmask: ``reference.process_logits``), the raw logits without it;
* sampling: the log of the processed distribution ``verify`` samples from,
  ``logits_to_probs(processed logits, temperature, top_k, top_p, min_p)`` (float32 probabilities;
  the log is taken in float64 on the host). A token removed by min-p / top-k / top-p or the bitmask
  has probability 0 (log -inf).

Logit processing (``SamplingParams``' presence / frequency / repetition penalties, logit_bias,
min_p, and a per-node token bitmask) happens inside ``verify`` for every node of a draft tree with
that node's own path (``reference.verify``). ``LogitProcessingBuffers`` holds the per-row tensors
verify takes (persistent, reused every step) and counts the emitted tokens on the device
(``add_emitted_counts``); ``path_logprobs`` applies the same processing to the accepted path.

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

from .reference import LOGIT_BIAS_RANGE, bitmask_words, logits_to_probs, process_logits, unpack_token_bitmask
from .checks import is_int


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings (OpenAI / vLLM semantics, see ``reference.verify``).

    temperature (0: greedy), top_k (0: off), top_p (1: off); presence_penalty and
    frequency_penalty in [-2, 2] (0: off; output tokens only); repetition_penalty > 0 (1: off;
    prompt and output tokens; HF's rule: a positive logit divided, a negative one multiplied);
    min_p in [0, 1] (0: off; after temperature, before top-k / top-p, as vLLM v1); logit_bias
    ``{token_id: bias}`` with biases in [-100, 100] (added to the raw logits; token ids >= 0, checked
    against the vocabulary by ``LogitProcessingBuffers``), stored as a tuple of (token_id, bias)
    pairs sorted by id (the dataclass stays hashable); a dict or such pairs are accepted."""
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    presence_penalty: float = 0.0    # 0: off
    frequency_penalty: float = 0.0   # 0: off
    repetition_penalty: float = 1.0  # 1: off
    min_p: float = 0.0               # 0: off
    logit_bias: tuple = ()           # ((token_id, bias), ...): none

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not is_int(k) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not (math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        m = self.min_p
        if not _is_number(m) or not 0.0 <= m <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {m!r}")
        object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processed(self) -> bool:
        """Whether verify has logit processing to do for this request (penalties, logit_bias, min_p)."""
        return self.penalized or bool(self.logit_bias) or self.min_p != 0.0


def _check_logit_bias(bias) -> tuple:
    """``{token_id: bias}`` (or (token_id, bias) pairs) -> sorted pairs; ValueError naming the entry."""
    if bias is None:
        return ()
    if isinstance(bias, dict):
        items = list(bias.items())
    else:
        try:
            items = [tuple(kv) for kv in bias]
        except TypeError:
            raise ValueError(f"logit_bias must be a {{token_id: bias}} mapping, got {bias!r}") from None
    out = {}
    for kv in items:
        if len(kv) != 2:
            raise ValueError(f"logit_bias must be a {{token_id: bias}} mapping, got the entry {kv!r}")
        tok, b = kv
        if not is_int(tok) or tok < 0:
            raise ValueError(f"logit_bias: token ids must be integers >= 0, got {tok!r}")
        if not _is_number(b) or not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias[{tok}] must be a number in [-100, 100], got {b!r}")
        out[tok] = float(b)
    return tuple(sorted(out.items()))


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


def path_processed_logits(logits: Tensor, tokens: Tensor, params: SamplingParams,
                          output_counts: Tensor | None = None, prompt_mask: Tensor | None = None,
                          logit_bias: Tensor | None = None, token_bitmask: Tensor | None = None) -> Tensor:
    """float32 [m, V]: verify's logit processing (``reference.process_logits``) of ``logits`` [m, V]
    at the m nodes of one request's accepted path, ``tokens`` int64 [m] the tokens emitted there
    (-1: none): node j is processed with ``output_counts`` (int32 [V], the request's counts before
    this step) plus tokens[0:j] (the accepted drafts above it), as verify processed it. Vectorised
    over the nodes, no host sync. ``prompt_mask`` bool [V]; ``logit_bias`` float32 [V] (None: built
    from ``params.logit_bias``); ``token_bitmask`` int32 [m, ceil(V / 32)], the bitmask rows of those
    nodes. The raw logits as float32 when nothing is to be done."""
    m, vocab = logits.shape
    dev = logits.device
    if logit_bias is None and params.logit_bias:
        logit_bias = dense_logit_bias(params.logit_bias, vocab, dev)
    if not (params.penalized or logit_bias is not None or token_bitmask is not None):
        return logits.float()
    counts = None
    if params.penalized:
        if output_counts is None:
            raise ValueError("path_logprobs: penalties need output_counts (int32 [V], the request's generated "
                             "token counts before this step)")
        real = (tokens >= 0).to(torch.int64)[:, None]
        onehot = torch.zeros(m, vocab, dtype=torch.int64, device=dev).scatter_(1, tokens.clamp(min=0)[:, None], real)
        counts = output_counts.to(torch.int64)[None, :] + torch.cumsum(onehot, 0) - onehot  # tokens[0:j] for row j
    allowed = None if token_bitmask is None else unpack_token_bitmask(token_bitmask, vocab)

    def row(v: float):
        return torch.full((m,), v, dtype=torch.float32, device=dev)
    return process_logits(logits, counts, None if prompt_mask is None else prompt_mask[None, :],
                          row(params.presence_penalty) if params.penalized else None,
                          row(params.frequency_penalty) if params.penalized else None,
                          row(params.repetition_penalty) if params.penalized else None,
                          None if logit_bias is None else logit_bias[None, :], allowed)


def path_logprobs(logits: Tensor, tokens: Tensor, params: SamplingParams, top: int, *,
                  output_counts: Tensor | None = None, prompt_mask: Tensor | None = None,
                  logit_bias: Tensor | None = None, token_bitmask: Tensor | None = None) -> Tensor:
    """The device side of a step's log-probabilities, computed without a host sync: ``logits``
    [m, V] at the m nodes of the accepted path (padding rows allowed), ``tokens`` int64 [m] the
    tokens emitted there (-1: none). Returns float64 [m * (1 + 2 t)], t = min(top, V), per node:
    the value at the emitted token, the t largest values, their token ids (exact in float64).
    The values are log_softmax(processed logits) for greedy ``params``, else the probabilities of
    ``logits_to_probs(processed logits, temperature, top_k, top_p, min_p)`` (``read_logprobs``
    takes their log on the host): the distribution verify drew each token from. The processing is
    ``path_processed_logits`` (the keyword arguments are its own; with none and no penalties /
    logit_bias in ``params``, the raw logits). Each row's numbers depend on that row and the tokens
    above it only."""
    x = path_processed_logits(logits, tokens, params, output_counts, prompt_mask, logit_bias, token_bitmask)
    if params.greedy:
        vals = torch.log_softmax(x, dim=-1)
    else:
        vals = logits_to_probs(x, params.temperature, params.top_k, params.top_p, params.min_p)
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


# ----------------------------------------------------------------------------------------------
# the per-row tensors of verify's logit processing
# ----------------------------------------------------------------------------------------------
def dense_logit_bias(bias: tuple, vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """float32 [V] from ``SamplingParams.logit_bias`` pairs; ValueError for a token id >= V."""
    out = torch.zeros(vocab, dtype=torch.float32)
    for tok, b in bias:
        if tok >= vocab:
            raise ValueError(f"logit_bias: token id {tok} is not in the vocabulary [0, {vocab})")
        out[tok] = b
    return out.to(device)


def add_emitted_counts(output_counts: Tensor, emitted: Tensor, accept_len: Tensor) -> None:
    """Adds a verify step's emitted tokens to ``output_counts`` (int32 [B, V], or more rows: the
    first B are updated) in place, on the device, without a host sync: row b gets tokens
    ``emitted[b, 0 .. accept_len[b]]`` (``accept_len[b] + 1`` of them; none when accept_len is -1).
    ``emitted`` int64 [B, n] (verify's output_token_ids), ``accept_len`` int64 [B]. Allocates two
    small [B, n] temporaries; ``LogitProcessingBuffers.add_emitted`` does the same with none."""
    bsz, n = emitted.shape
    keep = torch.arange(n, device=emitted.device)[None, :] <= accept_len[:, None]
    output_counts[:bsz].scatter_add_(1, emitted.clamp(min=0), keep.to(torch.int32))


class LogitProcessingBuffers:
    """Persistent per-row tensors of verify's logit processing for a batch of up to ``max_batch``
    requests over a vocabulary of ``vocab`` tokens, on ``device``; a decode step reads them and
    updates the counts in place, allocating nothing.

    Tensors (row b = batch slot b): ``output_counts`` int32 [max_batch, V], ``prompt_mask`` bool
    [max_batch, V], ``logit_bias`` float32 [max_batch, V], ``presence_penalty`` /
    ``frequency_penalty`` / ``repetition_penalty`` / ``min_p`` float64 [max_batch]. A free slot
    holds the neutral values (0 counts and bias, penalties 0 / 0 / 1, min_p 0).

    Use: ``set_row(b, params, prompt_ids)`` when a request takes slot b (host writes, once per
    request), ``clear_row(b)`` when it leaves; each step ``ops.verify(..., **buffers.verify_kwargs(B))``
    then ``buffers.add_emitted(output_token_ids, accept_len)`` (device only, no sync).
    ``max_nodes`` bounds the n of ``add_emitted`` (verify's N)."""

    def __init__(self, max_batch: int, vocab: int, device: torch.device | str = "cpu", max_nodes: int = 64):
        for name, v, lo in (("max_batch", max_batch, 1), ("vocab", vocab, 1), ("max_nodes", max_nodes, 1)):
            if not is_int(v) or v < lo:
                raise ValueError(f"LogitProcessingBuffers: {name} must be an integer >= {lo}, got {v!r}")
        dev = torch.device(device)
        self.max_batch, self.vocab, self.device, self.max_nodes = max_batch, vocab, dev, max_nodes
        self.output_counts = torch.zeros(max_batch, vocab, dtype=torch.int32, device=dev)
        self.prompt_mask = torch.zeros(max_batch, vocab, dtype=torch.bool, device=dev)
        self.logit_bias = torch.zeros(max_batch, vocab, dtype=torch.float32, device=dev)
        self.presence_penalty = torch.zeros(max_batch, dtype=torch.float64, device=dev)
        self.frequency_penalty = torch.zeros(max_batch, dtype=torch.float64, device=dev)
        self.repetition_penalty = torch.ones(max_batch, dtype=torch.float64, device=dev)
        self.min_p = torch.zeros(max_batch, dtype=torch.float64, device=dev)
        # add_emitted's scratch
        self._positions = torch.arange(max_nodes, device=dev)
        self._keep = torch.zeros(max_batch, max_nodes, dtype=torch.bool, device=dev)
        self._ones = torch.zeros(max_batch, max_nodes, dtype=torch.int32, device=dev)
        self._index = torch.zeros(max_batch, max_nodes, dtype=torch.int64, device=dev)
        # host-side: which slots use which feature (verify_kwargs passes only what some row uses)
        self._params: list[SamplingParams | None] = [None] * max_batch

    @classmethod
    def for_batch(cls, params: list[SamplingParams], prompts: list, vocab: int,
                  device: torch.device | str = "cpu", max_nodes: int = 64) -> "LogitProcessingBuffers":
        """Buffers for exactly these requests, request i in slot i (``prompts[i]``: its token ids)."""
        if len(params) != len(prompts):
            raise ValueError(f"LogitProcessingBuffers.for_batch: {len(params)} params for {len(prompts)} prompts")
        out = cls(max(1, len(params)), vocab, device, max_nodes)
        for b, (p, ids) in enumerate(zip(params, prompts)):
            out.set_row(b, p, ids)
        return out

    def _slot(self, b) -> int:
        if not is_int(b) or not 0 <= b < self.max_batch:
            raise ValueError(f"LogitProcessingBuffers: slot must be an integer in [0, {self.max_batch}), got {b!r}")
        return b

    def set_row(self, b: int, params: SamplingParams, prompt_ids=(), output_ids=()) -> None:
        """Slot b takes a request: its settings, its prompt's tokens (the repetition penalty's prompt
        mask) and, when it resumes, the tokens it has generated so far (``output_ids``; else 0)."""
        b = self._slot(b)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"LogitProcessingBuffers.set_row: params must be a SamplingParams, got {params!r}")
        bias = dense_logit_bias(params.logit_bias, self.vocab, self.device)
        ids = {}
        for name, seq in (("prompt_ids", prompt_ids), ("output_ids", output_ids)):
            t = torch.as_tensor(seq if isinstance(seq, Tensor) else list(seq), dtype=torch.int64).flatten().cpu()
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab):
                bad = int(t[(t < 0) | (t >= self.vocab)][0])
                raise ValueError(f"LogitProcessingBuffers.set_row: {name} holds {bad}, not a token id in "
                                 f"[0, {self.vocab})")
            ids[name] = t.to(self.device)
        self.prompt_mask[b].zero_()
        self.prompt_mask[b, ids["prompt_ids"]] = True
        self.output_counts[b].zero_()
        self.output_counts[b].scatter_add_(0, ids["output_ids"],
                                           torch.ones_like(ids["output_ids"], dtype=torch.int32))
        self.logit_bias[b].copy_(bias)
        self.presence_penalty[b] = params.presence_penalty
        self.frequency_penalty[b] = params.frequency_penalty
        self.repetition_penalty[b] = params.repetition_penalty
        self.min_p[b] = params.min_p
        self._params[b] = params

    def clear_row(self, b: int) -> None:
        """Slot b is free: neutral values."""
        b = self._slot(b)
        for t in (self.output_counts, self.prompt_mask, self.logit_bias, self.presence_penalty,
                  self.frequency_penalty, self.min_p):
            t[b].zero_()
        self.repetition_penalty[b] = 1.0
        self._params[b] = None

    def verify_kwargs(self, bsz: int | None = None, every: bool = False) -> dict:
        """The keyword arguments of ``ops.verify`` for slots [0, bsz) (default: all): views of the
        buffers (no copies). Only the features some slot uses are passed (None for the others), so a
        batch without any processing runs verify exactly as before; ``every=True`` passes every
        tensor (a CUDA graph captured once stays valid whatever the requests ask)."""
        bsz = self.max_batch if bsz is None else bsz
        if not is_int(bsz) or not 0 < bsz <= self.max_batch:
            raise ValueError(f"LogitProcessingBuffers.verify_kwargs: bsz must be in [1, {self.max_batch}], got {bsz!r}")
        used = [p for p in self._params[:bsz] if p is not None]
        penalized = every or any(p.penalized for p in used)
        kw = dict(output_counts=self.output_counts[:bsz] if penalized else None,
                  prompt_mask=self.prompt_mask[:bsz] if penalized else None,
                  presence_penalty=self.presence_penalty[:bsz] if penalized else None,
                  frequency_penalty=self.frequency_penalty[:bsz] if penalized else None,
                  repetition_penalty=self.repetition_penalty[:bsz] if penalized else None,
                  logit_bias=self.logit_bias[:bsz] if every or any(p.logit_bias for p in used) else None,
                  min_p=self.min_p[:bsz] if every or any(p.min_p for p in used) else None)
        return kw

    def add_emitted(self, emitted: Tensor, accept_len: Tensor) -> None:
        """``add_emitted_counts`` into ``output_counts`` with the preallocated scratch: no allocation,
        no host sync. ``emitted`` int64 [B, n] (n <= max_nodes), ``accept_len`` int64 [B]."""
        bsz, n = emitted.shape
        if bsz > self.max_batch or n > self.max_nodes:
            raise ValueError(f"LogitProcessingBuffers.add_emitted: emitted is [{bsz}, {n}], at most "
                             f"[{self.max_batch}, {self.max_nodes}]")
        keep, ones, index = self._keep[:bsz, :n], self._ones[:bsz, :n], self._index[:bsz, :n]
        torch.le(self._positions[:n][None, :], accept_len[:, None], out=keep)
        ones.copy_(keep)
        torch.clamp(emitted, min=0, out=index)
        self.output_counts[:bsz].scatter_add_(1, index, ones)
