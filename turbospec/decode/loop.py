"""The generation loop: prefill, then draft -> verify step -> commit until max_new_tokens, an EOS
token or a stop string, with the statistics users read (tau, acceptance by position, timings)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..drafters.base import Draft, Drafter
from ..drafters.budget import DraftBudget
from ..ops import nvtx
from ..ops.sampling import SamplingParams
from .step import VerifyStep
from .text import StopMatcher


@dataclass
class Generation:
    text: str | None
    token_ids: list[int]          # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str            # "eos", "stop", "length"
    stats: dict = field(default_factory=dict)


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


def draft_depth(draft: Draft | None) -> int:
    """The number of draft tokens on the longest root-to-leaf path."""
    if draft is None:
        return 0
    if draft.parents is None:
        return len(draft)
    depth = [0]
    for p in draft.parents:
        depth.append(depth[p] + 1)
    return max(depth)


def run(step: VerifyStep, drafter: Drafter | None, budget: DraftBudget, num_draft: int, ids: list[int],
        max_new_tokens: int, params: SamplingParams, eos_token_ids: set[int], stop: StopMatcher | None,
        generator: torch.Generator | None, stats: dict) -> Iterator[list[int]]:
    """Generate after prompt ``ids``; yields each step's emitted tokens (cut at max_new_tokens and
    after an EOS). ``num_draft``: the most draft tokens per step (the length of the
    acceptance-by-position statistics). Fills ``stats`` when done; ``stats["stop_text_end"]``: where a stop string begins
    in the generated text, when one matched."""
    vocab = step.target.cfg.vocab_size
    t0 = time.perf_counter()
    cache_len, feats = step.prefill(ids)
    tokens = list(ids)
    if drafter is not None:  # (a draft model reads the prompt here: part of the prefill)
        drafter.begin(tokens, features=feats)
    t_prefill = time.perf_counter() - t0
    steps = emitted_total = 0
    t_draft = t_verify = 0.0
    accepted_at, proposed_at = [0] * num_draft, [0] * num_draft
    finish = "length"
    while emitted_total < max_new_tokens:
        remaining = max_new_tokens - emitted_total
        k = min(budget.choose(), remaining - 1) if drafter is not None else 0
        t1 = time.perf_counter()
        with nvtx.range("draft"):
            draft = drafter.propose(tokens, k, params, generator) if k > 0 else None
        if draft is not None:
            check_draft(draft, k, vocab)
        t2 = time.perf_counter()
        new, n_acc, feats = step.step(tokens, cache_len, draft, params, generator)
        t3 = time.perf_counter()
        proposed = 0 if draft is None else len(draft)
        budget.record(proposed, n_acc, proposed + 1, t3 - t2, t2 - t1)
        t_draft += t2 - t1
        t_verify += t3 - t2
        steps += 1
        # per position = per depth on the accepted path (a tree of k nodes may be shallower)
        for i in range(draft_depth(draft)):
            proposed_at[i] += 1
            accepted_at[i] += i < n_acc
        cache_len += n_acc + 1
        new = new[:remaining]
        for j, t in enumerate(new):
            if t in eos_token_ids:
                new, finish = new[: j + 1], "eos"
                break
        tokens.extend(new)
        emitted_total += len(new)
        if stop is not None and finish != "eos":
            end = stop.find(tokens[len(ids):])
            if end is not None:
                finish = "stop"
                stats["stop_text_end"] = end
        yield new
        if finish != "length":
            break
        if drafter is not None:
            drafter.observe(tokens, n_acc, features=feats)
    elapsed = time.perf_counter() - t0
    stats.update(
        new_tokens=emitted_total, verify_steps=steps, tau=emitted_total / max(steps, 1),
        accept_per_position=[a / p if p else None for a, p in zip(accepted_at, proposed_at)],
        tokens_per_s=emitted_total / elapsed, decode_tokens_per_s=emitted_total / max(elapsed - t_prefill, 1e-9),
        prefill_s=t_prefill, draft_s=t_draft, verify_s=t_verify, total_s=elapsed,
        prompt_tokens=len(ids), finish_reason=finish)
