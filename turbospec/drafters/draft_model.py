"""A separate, smaller draft model (any checkpoint the loader takes) drafting a chain.

The draft keeps its own static KV cache. ``_cached`` counts the committed tokens whose K/V it holds;
a proposal feeds the committed tokens it has not seen (the root, and the last accepted draft when
every draft was kept), then drafts autoregressively, writing speculative entries that ``observe``
keeps only for the accepted prefix.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Draft, Drafter
from ..model.transformer import Transformer
from ..ops.reference import MAX_TREE_NODES, logits_are_valid
from ..ops.sampling import SamplingParams, draft_sample


def check_compatible(target: Transformer, draft: Transformer, target_tokenizer=None, draft_tokenizer=None):
    """Refuse a draft whose vocabulary or tokenizer differs from the target's."""
    tv, dv = target.cfg.vocab_size, draft.cfg.vocab_size
    if tv != dv:
        raise ValueError(f"draft model vocab_size {dv} != target vocab_size {tv}: the draft must share "
                         f"the target's tokenizer and vocabulary")
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError("draft tokenizer differs from the target tokenizer (token -> id maps are not "
                             "equal): the draft must share the target's tokenizer")


def layer_skip_draft(target: Transformer, num_layers: int) -> Transformer:
    """A self-speculative draft: the target's first ``num_layers`` layers, its final norm and LM head
    (shares the target's weights; no extra memory for weights)."""
    if not 1 <= num_layers <= target.cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {target.cfg.num_layers}], got {num_layers}")
    return target.first_layers(num_layers)


class DraftModelDrafter(Drafter):
    """Chain drafting with a separate model. ``static`` (default: off CPU) runs the draft's steps
    through a ``TargetRunner`` of its own: fixed token-count buckets, replayed from CUDA graphs on a
    GPU (``graphs``, default on CUDA); a catch-up longer than the largest bucket (the prompt) runs
    the ordinary forward."""

    name = "draft_model"

    def __init__(self, model: Transformer, max_seq_len: int, static: bool | None = None,
                 graphs: bool | None = None):
        from ..model.runner import TargetRunner
        self.model = model
        static = model.device.type != "cpu" if static is None else static
        self.cache = model.new_cache(max_seq_len + (MAX_TREE_NODES if static else 0))  # a bucket of slack
        self.runner = TargetRunner(model, self.cache, static=True, graphs=graphs) if static else None
        self._cached = 0
        self._base = 0
        self._speculative = 0
        self._proposed = False

    @torch.inference_mode()
    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        """Reads the prompt into the draft's cache (no state from an earlier generation is kept), so
        that the first proposal costs what every later one does: the draft budget must not judge
        the drafter by a prompt-length catch-up."""
        self._cached = self._base = self._speculative = 0
        self._proposed = False
        if len(prompt_ids) > 1:
            dev = self.model.device
            ids = torch.tensor([prompt_ids[:-1]], dtype=torch.int64, device=dev)
            pos = torch.arange(len(prompt_ids) - 1, device=dev)[None]
            self.model.forward(ids, pos, self.cache, 0, logits="last")
            self._cached = self._base = len(prompt_ids) - 1

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        self._base, self._speculative = self._cached, 0
        if max_tokens <= 0:
            return None
        self._proposed = True
        m = self.model
        dev = m.device
        pending = torch.tensor([tokens[self._cached:]], dtype=torch.int64, device=dev)
        pos = torch.arange(self._cached, len(tokens), device=dev)[None]
        logits = self._last_logits(pending, pos, self._cached)
        self._base = len(tokens)
        drafted, qs = [], []
        for i in range(max_tokens):
            if not logits_are_valid(logits):  # NaN/inf draft: stop drafting, the target decides alone
                break
            t, q = draft_sample(logits, params, generator)
            drafted.append(t)
            qs.append(q)
            if i + 1 < max_tokens:
                p = len(tokens) + i
                logits = self._last_logits(torch.tensor([[t]], device=dev), torch.tensor([[p]], device=dev), p)
        self._speculative = min(len(drafted), max_tokens - 1)  # drafts whose K/V were written
        if not drafted:
            return None
        probs = None
        if not params.greedy:
            qs.append(torch.zeros_like(qs[0]))  # the last node has no children
            probs = torch.stack(qs)
        return Draft(token_ids=drafted, draft_probs=probs)

    def _last_logits(self, ids, pos, cache_len: int):
        if self.runner is not None and ids.shape[1] <= self.runner.max_tokens:
            return self.runner.forward(ids, pos, cache_len)[0, -1]
        return self.model.forward(ids, pos, self.cache, cache_len, logits="last")[0, -1]

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None) -> None:
        # Only a step that proposed moves the cached prefix (its accepted drafts' K/V are valid);
        # after a plain step the draft's cache is as it was, and the next proposal catches up on
        # the tokens committed since (not on the whole context).
        if self._proposed:
            self._cached = self._base + min(num_accepted, self._speculative)
            self._proposed = False
