"""The target's verify forward for one speculative step, on CPU or replayed from CUDA graphs.

Two paths, the same results:

* dynamic (CPU default): ``Transformer.forward`` on exactly the step's n tokens, with the C++ layer
  loop (``turbospec::llama_layers``) on CPU.
* static (CUDA default): ``Transformer.forward_static`` on a fixed *bucket* of tokens (the smallest
  of ``buckets`` that holds the step's n), padded with rows that attend only themselves; the prefix
  length is a device tensor, so one capture serves every step. With ``graphs`` each bucket's forward
  is captured once in a CUDA graph (all buckets share one memory pool) and a step is: copy the
  step's ids / positions / mask into the bucket's static inputs, set the prefix length, replay.
  No host read and no device allocation happen inside it. The static path also runs eagerly on CPU
  (``static=True``), which is how the tests check padding and masks without a GPU.

Padding rows write K/V at slots cache_len + n .. cache_len + bucket - 1, beyond anything committed:
the next step overwrites them. The cache therefore needs ``max(buckets)`` slots of slack
(``Engine`` allocates them).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.reference import MAX_TREE_NODES
from .kv_cache import KVCache
from .transformer import Transformer

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, MAX_TREE_NODES)


def chain_mask_packed(n: int, device=None) -> Tensor:
    """int64 [1, n]: row i attends new tokens 0..i (a causal chain), bit-packed as ``build_tree``."""
    rows = [(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(n)]  # row 63: all 64 bits (= -1)
    return torch.tensor([rows], dtype=torch.int64, device=device)


def pad_mask_packed(n: int, device=None) -> Tensor:
    """int64 [1, n]: row i attends only itself (a padding node), bit-packed as ``build_tree``."""
    return torch.tensor([[1 << i if i < 63 else -(1 << 63) for i in range(n)]], dtype=torch.int64, device=device)


class TargetRunner:
    """Runs ``target`` over a step's tokens against ``cache``.

    Args:
        features: what the drafter reads back (None, "final" or layer indices; see ``Transformer.forward``).
        static: use the fixed-shape path (default: on any device but CPU).
        graphs: capture the static path in CUDA graphs (CUDA only; default: on CUDA).
        buckets: token counts the static path is built for (ascending, at most ``MAX_TREE_NODES``).
    """

    def __init__(self, target: Transformer, cache: KVCache, features=None, static: bool | None = None,
                 graphs: bool | None = None, buckets=DEFAULT_BUCKETS):
        self.target, self.cache, self.features = target, cache, features
        dev = target.device
        on_cuda = dev.type == "cuda"
        if graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs the target on a CUDA device, got {dev}")
        self.graphs = on_cuda if graphs is None else bool(graphs)
        self.static = self.graphs or (dev.type != "cpu" if static is None else bool(static))
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1 or buckets[-1] > MAX_TREE_NODES:
            raise ValueError(f"buckets must be token counts in [1, {MAX_TREE_NODES}], got {buckets}")
        self.buckets = buckets
        self._graphs: dict[int, tuple] = {}
        if self.static:
            target.ensure_rope(cache.max_seq_len)
            self.cache_len = torch.zeros(1, dtype=torch.int64, device=dev)
            self._inputs = {b: (torch.zeros(1, b, dtype=torch.int64, device=dev),
                                torch.zeros(1, b, dtype=torch.int64, device=dev),
                                torch.zeros(1, b, dtype=torch.int64, device=dev)) for b in buckets}
            self._chain = chain_mask_packed(buckets[-1], dev)  # row i of any chain (no host copy per step)
            # padding row i attends only itself
            self._pad_mask = pad_mask_packed(buckets[-1], dev)
        if self.graphs:
            self._capture_all()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1] if self.static else MAX_TREE_NODES

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"a step of {n} tokens does not fit the largest bucket ({self.buckets[-1]})")

    # ------------------------------------------------------------------------------------------
    def forward(self, node_ids: Tensor, positions: Tensor, cache_len: int, tree_mask_packed: Tensor | None = None,
                tree_mask: Tensor | None = None, logits: str = "all"):
        """Logits [1, n, V] float32 for ``node_ids`` [1, n] at ``positions`` [1, n] after a prefix of
        ``cache_len`` tokens (and the drafter's features [1, n, F] when it reads them). The tree is
        ``tree_mask_packed`` int64 [1, n] (static path) or ``tree_mask`` bool [1, n, n] (dynamic
        path; either is derived from the other when only one is given); neither: a causal chain.
        ``logits="normed"`` (dynamic path only): the final-normed hidden states in their place."""
        n = node_ids.shape[1]
        if logits != "all" and self.static:
            raise ValueError(f"logits={logits!r}: the static path returns every row's logits ('all')")
        if not self.static:
            if tree_mask is None and tree_mask_packed is not None:
                bits = torch.arange(n, device=tree_mask_packed.device)
                tree_mask = (tree_mask_packed[..., None] >> bits) & 1 == 1
            if tree_mask is not None:
                tree_mask = tree_mask.to(self.target.device)
            return self.target.forward(node_ids, positions, self.cache, cache_len, tree_mask, logits=logits,
                                       features=self.features)
        b = self.bucket(n)
        ids, pos, mask = self._inputs[b]
        ids[:, :n].copy_(node_ids, non_blocking=True)
        pos[:, :n].copy_(positions, non_blocking=True)
        mask[:, :n].copy_(self._chain[:, :n] if tree_mask_packed is None else tree_mask_packed, non_blocking=True)
        if b > n:
            ids[:, n:].zero_()
            pos[:, n:].copy_(pos[:, n - 1: n].expand(1, b - n))
            mask[:, n:].copy_(self._pad_mask[:, n:b])
        self.cache_len.fill_(cache_len)
        if self.graphs:
            graph, out = self._graphs[b]
            graph.replay()
        else:
            out = self.target.forward_static(ids, pos, self.cache, self.cache_len, mask, self.features)
        if self.features is None:
            return out[:, :n]
        return out[0][:, :n], out[1][:, :n]

    # ------------------------------------------------------------------------------------------
    def _capture_all(self) -> None:
        """Capture every bucket's forward (largest first, so the shared pool is sized once). Runs
        before any generation: the warm-up passes write K/V slots that prefill overwrites."""
        pool = None
        for b in reversed(self.buckets):
            ids, pos, mask = self._inputs[b]
            mask.copy_(chain_mask_packed(b, mask.device))
            pos.copy_(torch.arange(b, device=pos.device)[None])
            self.cache_len.zero_()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy inits and autotuning happen outside the capture
                for _ in range(2):
                    self.target.forward_static(ids, pos, self.cache, self.cache_len, mask, self.features)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.target.forward_static(ids, pos, self.cache, self.cache_len, mask, self.features)
            pool = graph.pool()
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize()
