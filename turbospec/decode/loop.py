"""The generation loop: prefill, then draft -> verify step -> commit until max_new_tokens, an EOS
token or a stop string, with the statistics users read (tau, acceptance by position, timings)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from ..drafters.base import Draft, Drafter
from ..drafters.budget import DraftBudget
from ..ops import nvtx
from ..ops.sampling import SamplingParams, TokenLogprob
from .step import StepResult, TargetStep, draft_depth
from .text import StopMatcher


@dataclass
class Generation:
    text: str | None
    token_ids: list[int]          # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str            # "eos", "stop", "length"
    stats: dict = field(default_factory=dict)
    # with logprobs=True: one ``TokenLogprob`` per token of ``token_ids`` (its log-probability under
    # the distribution it was drawn from and the top_logprobs alternatives; ``ops.sampling``); None
    # when not asked for
    logprobs: list[TokenLogprob] | None = None


def check_draft(draft: Draft, max_tokens: int, vocab: int) -> None:
    """A drafter's proposal must fit the request; a bad one is a bug in the drafter, said clearly."""
    k = len(draft.token_ids)
    if not 1 <= k <= max_tokens:
        raise ValueError(f"drafter returned {k} draft tokens; allowed: 1..{max_tokens} (max_tokens)")
    if draft.parents is not None and len(draft.parents) != k:
        raise ValueError(f"drafter returned {len(draft.parents)} parents for {k} draft tokens")
    if draft.draft_probs is not None and tuple(draft.draft_probs.shape) != (k + 1, vocab):
        raise ValueError(f"drafter returned draft_probs of shape {tuple(draft.draft_probs.shape)}; "
                         f"expected ({k + 1}, {vocab})")


class Sequence:
    """One request's decoding state between verify steps: the committed tokens, the cache length,
    its drafter and draft budget, the finish test (length, EOS, stop string) and the statistics.
    ``plan`` asks the drafter for the next step's draft; ``commit`` takes what the step emitted. The
    single-request loop (``run``) and the batch scheduler both drive it."""

    def __init__(self, ids: list[int], max_new_tokens: int, params: SamplingParams, drafter: Drafter | None,
                 budget: DraftBudget, num_draft: int, vocab: int, eos_token_ids: set[int],
                 stop: StopMatcher | None, generator: torch.Generator | None, stats: dict,
                 logprobs: int | None = None, constraint=None):
        self.ids, self.max_new_tokens, self.params = ids, max_new_tokens, params
        # log-probabilities: None (off) or the number of alternatives per token; one entry per kept token
        self.logprobs = logprobs
        self.token_logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        # structured output: the grammar's state (``decode.grammar.Constraint``), or None
        self.constraint = constraint
        self.drafter, self.budget, self.vocab = drafter, budget, vocab
        self.eos_token_ids, self.stop, self.generator, self.stats = eos_token_ids, stop, generator, stats
        self.tokens = list(ids)
        self.cache_len = self.cached_prompt_tokens = 0
        self.emitted = self.steps = 0
        self.finish: str | None = None
        self.t0 = time.perf_counter()
        self.t_prefill = self.t_draft = self.t_verify = 0.0
        self.accepted_at, self.proposed_at = [0] * num_draft, [0] * num_draft
        self.draft: Draft | None = None
        self._t_plan = self._draft_seconds = 0.0
        # the drafter's features of every token whose K/V are in the cache (prompt, then each step's
        # root and accepted nodes), kept when the finished request's tokens go to the prefix cache
        # (``start(keep_features=True)``); None otherwise
        self.written_features: list[Tensor] | None = None

    def start(self, cache_len: int, features: Tensor | None, cached: int = 0, keep_features: bool = False) -> None:
        """After the prompt's prefill (``cache_len`` tokens in the cache, ``cached`` of them copied
        from the prefix cache; the drafter's features of them). ``keep_features``: keep the features
        of every token written from now on too (``written_features``)."""
        self.cache_len = cache_len
        self.cached_prompt_tokens = cached
        if keep_features and features is not None:
            self.written_features = [features]
        if self.drafter is not None:
            self.drafter.begin(self.tokens, features=features)
            # a draft model reads the prompt here (part of the prefill) when that is expected to pay
            if self.budget.reading_pays(len(self.tokens) - 1, self.max_new_tokens):
                t = time.perf_counter()
                self.drafter.prepare(self.tokens)
                self.budget.record_read(len(self.tokens) - 1, time.perf_counter() - t)
        self.t_prefill = time.perf_counter() - self.t0

    def plan(self, k: int | None = None) -> Draft | None:
        """The draft for the next verify step (None: a plain step): ``k`` tokens at most when given
        (a batch's budget), else what this request's own budget chooses."""
        k = self._draft_length(k)
        t1 = time.perf_counter()
        with nvtx.range("draft"):
            draft = self.drafter.propose(self.tokens, k, self.params, self.generator) if k > 0 else None
        self._take(draft, k)
        self.planned(time.perf_counter() - t1)
        return draft

    def plan_steps(self, k: int | None = None):
        """``plan`` as a generator of the drafter's shared-weight requests (``ops.lockstep``),
        for a batch that drafts all its requests together; the caller then calls ``planned``."""
        k = self._draft_length(k)
        self.draft = None
        draft = (yield from self.drafter.propose_steps(self.tokens, k, self.params, self.generator)) if k > 0 else None
        self._take(draft, k)
        return draft

    def _draft_length(self, k: int | None) -> int:
        if self.drafter is None:
            return 0
        return min(self.budget.choose() if k is None else k, self.max_new_tokens - self.emitted - 1)

    def _take(self, draft: Draft | None, k: int) -> None:
        if draft is not None:
            check_draft(draft, k, self.vocab)
        if k > 0 and self.drafter.windowed:
            self.budget.windowed = True
        self.draft = draft

    def planned(self, draft_seconds: float) -> None:
        """The planned draft took ``draft_seconds`` (this request's share of a batch's drafting)."""
        self._t_plan = time.perf_counter()
        self._draft_seconds = draft_seconds
        self.t_draft += draft_seconds

    def uniform(self) -> Tensor:
        """The coins of the planned step's nodes [k + 1] (zeros when greedy), from this request's
        generator: the same stream whatever else shares the verify pass."""
        k = 0 if self.draft is None else len(self.draft)
        if self.params.greedy:
            return torch.zeros(k + 1)
        return torch.rand(1, k + 1, generator=self.generator)[0]

    def commit(self, result: StepResult, verify_seconds: float | None = None) -> list[int]:
        """Take what the verify step emitted for this request (its accepted drafts + 1 tokens, and
        with them the drafter's features, the target's argmax at every node when the drafter reads
        them, the tokens' log-probabilities when asked); returns the tokens kept (cut at
        max_new_tokens and after an EOS). Sets ``finish`` when the request is done."""
        new, n_acc, features, node_argmax, logprobs = result
        draft = self.draft
        t3 = time.perf_counter()
        verify_seconds = t3 - self._t_plan if verify_seconds is None else verify_seconds
        proposed = 0 if draft is None else len(draft)
        self.budget.record(proposed, n_acc, proposed + 1, verify_seconds, self._draft_seconds)
        self.t_verify += verify_seconds
        self.steps += 1
        # per position = per depth on the accepted path (a tree of k nodes may be shallower)
        for i in range(draft_depth(draft)):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < n_acc
        self.cache_len += n_acc + 1
        if self.written_features is not None and features is not None:
            self.written_features.append(features)
        new = new[: self.max_new_tokens - self.emitted]
        for j, t in enumerate(new):
            if t in self.eos_token_ids:
                new, self.finish = new[: j + 1], "eos"
                break
        self.tokens.extend(new)
        if self.constraint is not None:
            self.constraint.commit([t for t in new if t not in self.constraint.eos])
        if self.token_logprobs is not None:
            self.token_logprobs.extend(logprobs[: len(new)])
        self.emitted += len(new)
        if self.stop is not None and self.finish is None:
            end = self.stop.find(self.tokens[len(self.ids):])
            if end is not None:
                self.finish = "stop"
                self.stats["stop_text_end"] = end
        if self.finish is None and self.emitted >= self.max_new_tokens:
            self.finish = "length"
        if self.finish is None and self.drafter is not None:
            if node_argmax is not None and self.drafter.wants_node_argmax:
                self.drafter.observe(self.tokens, n_acc, features=features, node_argmax=node_argmax)
            else:
                self.drafter.observe(self.tokens, n_acc, features=features)
        if self.finish is not None:
            if self.drafter is not None:
                self.drafter.finish(self.tokens)
            self._finish_stats()
        return new

    def _finish_stats(self) -> None:
        elapsed = time.perf_counter() - self.t0
        self.stats.update(
            new_tokens=self.emitted, verify_steps=self.steps, tau=self.emitted / max(self.steps, 1),
            accept_per_position=[a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            draft_proposed=sum(self.proposed_at), draft_accepted=sum(self.accepted_at),
            tokens_per_s=self.emitted / elapsed,
            decode_tokens_per_s=self.emitted / max(elapsed - self.t_prefill, 1e-9),
            prefill_s=self.t_prefill, draft_s=self.t_draft, verify_s=self.t_verify, total_s=elapsed,
            prompt_tokens=len(self.ids), cached_prompt_tokens=self.cached_prompt_tokens,
            finish_reason=self.finish)


def run(step: TargetStep, seq: Sequence) -> Iterator[list[int]]:
    """Generate ``seq`` alone on ``step`` (in slot 0): yields each step's kept tokens. Fills
    ``seq.stats`` when done; ``stats["stop_text_end"]``: where a stop string begins in the generated
    text, when one matched."""
    seq.start(*step.prefill(0, seq.ids), keep_features=step.keeps_features)
    while seq.finish is None:
        seq.plan()
        result = step.step({0: seq})[0]
        if isinstance(result, Exception):
            raise result
        kept = seq.commit(result)
        if seq.finish is not None:
            step.store_written(0, seq)  # before the caller hears the end and starts another request
        yield kept
