"""Batched speculative decoding with continuous batching.

``BatchStep`` is the target side: a static KV cache of ``max_batch`` slots (a request keeps its slot
from prefill to finish; nothing is copied between slots) and one verify step over every slot: each
active request's root + drafts (a chain or a tree, its own length; shorter rows are padded with nodes
that attend only themselves and carry draft id -1, which ``verify`` never accepts), one fixed-shape
target pass (``Transformer.forward_static``: per-row prefix lengths), one ``verify`` with per-row
sampling parameters, one ``compact_kv``, one host read for all rows. Idle slots ride along as
one-node padding rows.

``run_batch`` is the scheduler: requests wait in order, take a free slot between steps (their prompt
is prefilled into it alone), and leave when they finish, freeing the slot for the next one.

Every row's numbers are its own: the linears, norms and attention reduce in one order per row
whatever else is in the pass, and a request's coins come from its own generator, so a request's
output does not depend on its neighbours (greedy: identical to decoding it alone; seeded sampling:
the same tokens as alone with the same seed).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from .. import ops
from ..drafters.base import Drafter
from ..model.runner import chain_mask_packed, pad_mask_packed
from ..model.transformer import Transformer
from ..ops import nvtx
from ..ops.reference import MAX_TREE_NODES
from .loop import Sequence
from .step import NonFiniteLogitsError, prefill


class BatchStep:
    """The target side of a batch of up to ``max_batch`` requests (see the module docstring)."""

    def __init__(self, target: Transformer, max_batch: int, max_seq_len: int, features=None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.target, self.max_batch, self.features = target, max_batch, features
        # a step writes its padded nodes' K/V after a row's prefix: one tree's worth of slack
        self.cache = target.new_cache(max_seq_len + MAX_TREE_NODES, batch_size=max_batch)
        target.ensure_rope(self.cache.max_seq_len)
        self._chain = chain_mask_packed(MAX_TREE_NODES)[0]  # packed mask rows, built once
        self._pad = pad_mask_packed(MAX_TREE_NODES)[0]

    def prefill(self, slot: int, ids: list[int]) -> tuple[int, Tensor | None]:
        """A joining request's prompt (all but its last token) into its slot, alone."""
        return prefill(self.target, self.cache.rows(slot, slot + 1), ids, self.features)

    @torch.inference_mode()
    def step(self, rows: dict[int, Sequence]) -> dict[int, tuple[list[int], int, Tensor | None]]:
        """One verify pass over the planned drafts of ``rows`` (slot -> request). Returns, per slot,
        (emitted tokens, accepted drafts, the drafter's features of the root and the accepted nodes)."""
        bsz, dev = self.max_batch, self.target.device
        n = max(1 + (0 if s.draft is None else len(s.draft)) for s in rows.values())
        ids = torch.zeros(bsz, n, dtype=torch.int64)
        draft_ids = torch.full((bsz, n), -1, dtype=torch.int64)
        draft_ids[:, 0] = 0
        parents = torch.zeros(bsz, n, dtype=torch.int64)
        parents[:, 0] = -1
        positions = torch.zeros(bsz, n, dtype=torch.int64)
        packed = self._pad[:n].repeat(bsz, 1)
        cache_len = torch.zeros(bsz, dtype=torch.int64)
        uniform = torch.zeros(bsz, n)
        # float64: the Python numbers exactly, as a request decoded alone passes them
        temperature = torch.zeros(bsz, dtype=torch.float64)
        top_k, top_p = torch.zeros(bsz, dtype=torch.int64), torch.ones(bsz, dtype=torch.float64)
        with_probs = any(s.draft is not None and s.draft.draft_probs is not None for s in rows.values())
        probs = torch.zeros(bsz, n, self.target.cfg.vocab_size) if with_probs else None
        trees = False
        for b, s in rows.items():
            d = s.draft
            k = 0 if d is None else len(d)
            root = s.tokens[-1]
            ids[b, 0] = draft_ids[b, 0] = root
            cache_len[b] = s.cache_len
            if k:
                ids[b, 1:k + 1] = draft_ids[b, 1:k + 1] = torch.tensor(d.token_ids)
            if d is None or d.parents is None:
                parents[b, 1:k + 1] = torch.arange(k)
                depth = torch.arange(k + 1)
                packed[b, :k + 1] = self._chain[:k + 1]
            else:
                trees = True
                _, pk, depth, _ = ops.build_tree(torch.tensor([[-1] + d.parents]))
                depth = depth[0]
                parents[b, 1:k + 1] = torch.tensor(d.parents)
                packed[b, :k + 1] = pk[0]
            positions[b, :k + 1] = s.cache_len + depth
            positions[b, k + 1:] = s.cache_len  # padding: the root's position (attends only itself)
            uniform[b, :k + 1] = s.uniform()
            temperature[b], top_k[b], top_p[b] = s.params.temperature, s.params.top_k, s.params.top_p
            if with_probs:
                if d is not None and d.draft_probs is not None:
                    probs[b, :k + 1] = d.draft_probs
                elif not s.params.greedy and k:
                    raise ValueError("a batch mixes sampled rows with point-mass drafts and rows with draft "
                                     "probabilities; verify takes one kind per pass")
        ids, positions, packed, cache_len_d = (t.to(dev) for t in (ids, positions, packed, cache_len))
        with nvtx.range("verify"):
            out = self.target.forward_static(ids, positions, self.cache, cache_len_d, packed, self.features)
        logits, feats = (out, None) if self.features is None else out
        with nvtx.range("accept"):
            accept_len, accept_index, emitted = ops.verify(
                logits, parents.to(dev), draft_ids.to(dev), None if probs is None else probs.to(dev),
                uniform.to(dev), temperature.to(dev), top_k.to(dev), top_p.to(dev))
            host = torch.cat((accept_len, emitted.flatten())).tolist()  # the one host read of the step
        if trees:
            with nvtx.range("compact"):
                ops.compact_kv(self.cache.tensors(), cache_len_d, accept_index, accept_len)
        results = {}
        for b in rows:
            n_acc = host[b]
            if n_acc < 0:
                raise NonFiniteLogitsError(f"the target produced non-finite logits (NaN/inf) for the request in "
                                           f"slot {b} at position {rows[b].cache_len}; no token was emitted")
            toks = host[bsz + b * n: bsz + b * n + n_acc + 1]
            f = None if feats is None else feats[b, accept_index[b, : n_acc + 1]]
            results[b] = (toks, n_acc, f)
        return results


@dataclass
class Request:
    """One request of a batch (``Engine.generate([...])``): the prompt (text, messages or token ids)
    and its own settings. None takes the value given to ``generate``."""
    prompt: object
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stop: object = None
    seed: int | None = None
    speculate: bool = True  # False: plain decoding for this request (no drafts)


@dataclass
class Job:
    """A request in the scheduler: its index in the caller's list, its sequence, whether it drafts."""
    index: int
    seq: Sequence
    speculate: bool = True


def run_batch(step: BatchStep, jobs: list[Job], drafter_for_slot: Callable[[int], Drafter | None]
              ) -> Iterator[tuple[int, list[int]]]:
    """Continuous batching: yields (job index, kept tokens) after every step for every active job.
    Jobs take free slots in order between steps and leave when finished. ``drafter_for_slot(slot)``
    gives the drafter of a drafting job in that slot (set on its sequence when it starts; a job with
    ``speculate=False`` gets none)."""
    waiting = deque(jobs)
    free = list(range(step.max_batch - 1, -1, -1))
    active: dict[int, Job] = {}
    while waiting or active:
        while waiting and free:
            job = waiting.popleft()
            slot = free.pop()
            job.seq.drafter = drafter_for_slot(slot) if job.speculate else None
            job.seq.start(*step.prefill(slot, job.seq.ids))
            active[slot] = job
        for job in active.values():
            job.seq.plan()
        t = time.perf_counter()
        results = step.step({slot: job.seq for slot, job in active.items()})
        seconds = time.perf_counter() - t
        for slot, (toks, n_acc, feats) in results.items():
            job = active[slot]
            yield job.index, job.seq.commit(toks, n_acc, feats, verify_seconds=seconds)
            if job.seq.finish is not None:
                del active[slot]
                free.append(slot)
