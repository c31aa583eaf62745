"""One speculative step on the target: the verify pass over root + drafts under the tree mask,
``verify`` (the one host read per step is ``accept_len`` with the emitted tokens), ``compact_kv``
for trees. ``VerifyStep`` owns the target's KV cache, the runner (dynamic or fixed-shape / CUDA
graphs) and, off CPU, the pinned staging buffer the step's inputs go over in."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import ops
from ..drafters.base import Draft
from ..model.kv_cache import KVCache
from ..model.runner import TargetRunner
from ..model.transformer import Transformer
from ..ops import nvtx
from ..ops.reference import MAX_TREE_NODES
from ..ops.sampling import SamplingParams


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN/inf logits; no token was emitted from them."""


def prefill(target: Transformer, cache: KVCache, ids: list[int], features=None) -> tuple[int, Tensor | None]:
    """Write K/V for every prompt token but the last (the first root) into ``cache`` (one row).
    Returns the cache length and, when ``features`` is set (what the drafter reads), those of the
    prefilled positions [n, F]."""
    n = len(ids) - 1
    dev = target.device
    if n > 0:
        x = torch.tensor([ids[:-1]], dtype=torch.int64).to(dev)
        pos = torch.arange(n, device=dev)[None]
        out = target.forward(x, pos, cache, 0, logits="none", features=features)
        return n, (None if features is None else out[1][0])
    return n, (None if features is None else torch.zeros(0, 1))


class VerifyStep:
    """The target side of a generation: ``prefill`` a prompt, then ``step`` once per draft.

    Args:
        target: the model; its cache holds ``max_seq_len`` tokens (plus one bucket of slack on the
            fixed-shape path, which pads a step to its bucket).
        features: what the drafter reads back from the target (None, "final" or layer indices).
        static / graphs: the fixed-shape path and its CUDA-graph capture (see ``TargetRunner``).
    """

    def __init__(self, target: Transformer, max_seq_len: int, features=None, static: bool = False,
                 graphs: bool | None = False):
        self.target, self.features = target, features
        self.cache = target.new_cache(max_seq_len + (MAX_TREE_NODES if static else 0))
        self.runner = TargetRunner(target, self.cache, features, static=static, graphs=graphs if static else False)
        dev = target.device
        if dev.type != "cpu":  # the step's inputs go over in one copy from a pinned buffer (_stage)
            self._host_stage = torch.zeros(5, MAX_TREE_NODES, dtype=torch.int64, pin_memory=True)
            self._dev_stage = torch.zeros(5, MAX_TREE_NODES, dtype=torch.int64, device=dev)

    def prefill(self, ids: list[int]) -> tuple[int, Tensor | None]:
        """Write K/V for every prompt token but the last; see ``prefill``."""
        return prefill(self.target, self.cache, ids, self.features)

    def step(self, tokens: list[int], cache_len: int, draft: Draft | None, params: SamplingParams,
             generator: torch.Generator | None) -> tuple[list[int], int, Tensor | None]:
        """Verify ``draft`` after root ``tokens[-1]``; returns (emitted tokens, accepted drafts, the
        target features of the root and the accepted nodes [n + 1, F] when the drafter reads them)."""
        k = 0 if draft is None else len(draft)
        dev = self.target.device
        # The step's inputs are built on the host (drafts come from there) and copied over once.
        node_ids = torch.tensor([[tokens[-1]] + ([] if draft is None else draft.token_ids)])
        if draft is None or draft.parents is None:
            parents = torch.arange(-1, k)[None]
            tree_mask = packed = None
            positions = torch.arange(cache_len, cache_len + k + 1)[None]
        else:
            parents = torch.tensor([[-1] + draft.parents])
            tree_mask, packed, depth, _ = ops.build_tree(parents)
            positions = cache_len + depth
        if params.greedy:
            uniform = torch.zeros(1, k + 1)
        else:
            uniform = torch.rand(1, k + 1, generator=generator)
        probs = None if draft is None or draft.draft_probs is None else draft.draft_probs[None]
        if dev.type != "cpu":
            node_ids, positions, parents, packed, uniform = self._stage(node_ids, positions, parents, packed, uniform)
            probs = None if probs is None else probs.to(dev, non_blocking=True)
        with nvtx.range("verify"):
            out = self.runner.forward(node_ids, positions, cache_len, packed, tree_mask)
        logits, feats = (out, None) if self.features is None else out
        with nvtx.range("accept"):
            accept_len, accept_index, out = ops.verify(
                logits, parents, node_ids, probs, uniform, params.temperature, params.top_k, params.top_p)
            # The one host read per step: accept_len and the emitted tokens in one copy.
            host = torch.cat((accept_len, out[0])).tolist()
        n = host[0]
        if n < 0:
            raise NonFiniteLogitsError(f"the target produced non-finite logits (NaN/inf) at position "
                                       f"{cache_len}; no token was emitted from them")
        if tree_mask is not None:
            with nvtx.range("compact"):
                # the static path already holds the prefix length on the device
                prefix = self.runner.cache_len if self.runner.static else \
                    torch.full((1,), cache_len, dtype=torch.int64, device=dev)
                ops.compact_kv(self.cache.tensors(), prefix, accept_index, accept_len)
        if feats is not None:
            # a copy either way: with CUDA graphs, feats is the graph's output buffer, which the next
            # replay overwrites while a drafter may still hold these rows (steps without a proposal)
            feats = feats[0, accept_index[0, : n + 1]] if tree_mask is not None else feats[0, : n + 1].clone()
        return host[1: n + 2], n, feats

    def _stage(self, node_ids: Tensor, positions: Tensor, parents: Tensor, packed: Tensor | None,
               uniform: Tensor) -> tuple[Tensor, ...]:
        """The step's host-built inputs -> device, in one asynchronous copy from a pinned buffer
        (a copy from pageable memory would wait for the stream). Reusing the buffer is safe: the
        previous step's copy finished before that step's accept_len read."""
        n = node_ids.shape[1]
        h = self._host_stage
        h[0, :n], h[1, :n], h[2, :n] = node_ids[0], positions[0], parents[0]
        if packed is not None:
            h[3, :n] = packed[0]
        h[4, :n] = uniform[0].view(torch.int32).to(torch.int64)  # float32 bits, carried in int64
        d = self._dev_stage
        d.copy_(h, non_blocking=True)  # 2.5 KB: one contiguous transfer
        uni = d[4, :n].to(torch.int32).view(torch.float32)[None]
        return d[0:1, :n], d[1:2, :n], d[2:3, :n], None if packed is None else d[3:4, :n], uni
