"""The target's verify forward for one speculative step, on CPU or replayed from CUDA graphs.

Two paths, the same results:

* dynamic (CPU default, one row): ``Transformer.forward`` on exactly the step's n tokens, with the
  C++ layer loop (``turbospec::llama_layers``) on CPU.
* static (CUDA default; any row count): ``Transformer.forward_static`` on a fixed *bucket* of rows
  and tokens (the smallest of ``row_buckets`` that holds the step's rows and of ``buckets`` that
  holds its n nodes), padded with rows and nodes that attend only themselves; the prefix lengths
  are a device tensor, so one capture serves every step. With ``graphs`` each (rows, nodes)
  bucket's forward is captured in a CUDA graph the first time it is used (all share one memory
  pool; the one-row buckets are captured up front) and a step is: copy the step's ids / positions /
  mask / prefix lengths into the bucket's static inputs, replay. No host read and no device
  allocation happen inside it. The static path also runs eagerly on CPU (``static=True``), which is
  how the tests check padding and masks without a GPU.

Padding writes K/V at slots past each row's prefix, beyond anything committed: the next step
overwrites them. The cache therefore needs ``MAX_TREE_NODES`` slots of slack (``cache_slots``); a
capture's warm-up passes write there too, so a bucket can be captured between any two steps.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.limits import MAX_TREE_NODES
from .kv_cache import KVCache
from .transformer import Transformer

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, MAX_TREE_NODES)


def cache_slots(max_seq_len: int) -> int:
    """KV-cache slots for sequences of up to ``max_seq_len`` tokens: one tree of slack past them,
    where a verify step's padding nodes (and a capture's warm-up) write."""
    return max_seq_len + MAX_TREE_NODES


def row_buckets(rows: int) -> tuple[int, ...]:
    """The row counts the static path is built for, up to a cache of ``rows`` rows: powers of two
    and ``rows`` itself."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return tuple(out) + (rows,)


def chain_mask_packed(n: int, device=None) -> Tensor:
    """int64 [1, n]: row i attends new tokens 0..i (a causal chain), bit-packed as ``build_tree``."""
    rows = [(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(n)]  # row 63: all 64 bits (= -1)
    return torch.tensor([rows], dtype=torch.int64, device=device)


def pad_mask_packed(n: int, device=None) -> Tensor:
    """int64 [1, n]: row i attends only itself (a padding node), bit-packed as ``build_tree``."""
    return torch.tensor([[1 << i if i < 63 else -(1 << 63) for i in range(n)]], dtype=torch.int64, device=device)


class TargetRunner:
    """Runs ``target`` over a step's tokens against ``cache`` (its batch rows are the step's rows).

    Args:
        features: what the drafter reads back (None, "final" or layer indices; see ``Transformer.forward``).
        static: use the fixed-shape path (default: on any device but CPU).
        graphs: capture the static path in CUDA graphs (CUDA only; default: on CUDA).
        buckets: token counts the static path is built for (ascending, at most ``MAX_TREE_NODES``).
    """

    def __init__(self, target: Transformer, cache: KVCache, features=None, static: bool | None = None,
                 graphs: bool | None = None, buckets=DEFAULT_BUCKETS):
        self.target, self.cache, self.features = target, cache, features
        self._first_row = cache.rows(0, 1) if cache.k[0].shape[0] > 1 else cache  # (the dynamic path's row)
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
        rows = cache.k[0].shape[0]
        self.row_buckets = row_buckets(rows) if self.static else None
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._inputs: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}
        self._pool = None
        target.ensure_rope(cache.max_seq_len)
        if self.static:
            self.cache_len = torch.zeros(rows, dtype=torch.int64, device=dev)  # each row's prefix length
            self._chain = chain_mask_packed(buckets[-1], dev)  # row i of any chain (no host copy per step)
            # padding row i attends only itself
            self._pad_mask = pad_mask_packed(buckets[-1], dev)
        if self.graphs:
            for b in reversed(self.buckets):  # the one-row buckets up front, largest first: the pool is sized once
                self._capture(1, b)
            torch.cuda.synchronize()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1] if self.static else MAX_TREE_NODES

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"a step of {n} tokens does not fit the largest bucket ({self.buckets[-1]})")

    def row_bucket(self, rows: int) -> int:
        """The rows a pass over ``rows`` rows runs with: their bucket on the static path, else ``rows``."""
        if self.row_buckets is None:
            return rows
        for b in self.row_buckets:
            if b >= rows:
                return b
        raise ValueError(f"a step of {rows} rows does not fit the cache's {self.row_buckets[-1]} rows")

    # ------------------------------------------------------------------------------------------
    def forward(self, node_ids: Tensor, positions: Tensor, cache_len: int, tree_mask_packed: Tensor | None = None,
                tree_mask: Tensor | None = None, logits: str = "all"):
        """Logits [1, n, V] float32 for ``node_ids`` [1, n] at ``positions`` [1, n] after a prefix of
        ``cache_len`` tokens in the cache's first row (and the drafter's features [1, n, F] when it
        reads them). The tree is ``tree_mask_packed`` int64 [1, n] (static path) or ``tree_mask`` bool
        [1, n, n] (dynamic path; either is derived from the other when only one is given); neither: a
        causal chain. ``logits="normed"`` (dynamic path only): the final-normed hidden states in their
        place."""
        n = node_ids.shape[1]
        if logits != "all" and self.static:
            raise ValueError(f"logits={logits!r}: the static path returns every row's logits ('all')")
        if not self.static:
            if tree_mask is None and tree_mask_packed is not None:
                bits = torch.arange(n, device=tree_mask_packed.device)
                tree_mask = (tree_mask_packed[..., None] >> bits) & 1 == 1
            if tree_mask is not None:
                tree_mask = tree_mask.to(self.target.device)
            return self.target.forward(node_ids, positions, self._first_row, cache_len, tree_mask,
                                       logits=logits, features=self.features)
        self.cache_len[:1].fill_(cache_len)
        mask = self._chain[:, :n] if tree_mask_packed is None else tree_mask_packed
        return self._run(node_ids, positions, mask)

    def forward_rows(self, node_ids: Tensor, positions: Tensor, cache_len: Tensor, tree_mask_packed: Tensor,
                     nodes: Tensor | None = None):
        """The fixed-shape forward over several rows (on the dynamic path: eagerly, at the given
        shape, no buckets): ``node_ids`` / ``positions`` / ``tree_mask_packed``
        [R, n] (R one of ``row_buckets``; rows the step does not use are padding: a node that attends
        only itself, at a position past its row's prefix), ``cache_len`` int64 [R] on the device (each
        row's prefix, in cache rows 0..R-1). Returns logits [R, n, V] (and features [R, n, F]).
        ``nodes`` (int64 [R], CPU): each row's real tokens, its first nodes[r] (the dynamic path skips
        the padding: ``Transformer.forward_static``; the static path computes it: its shapes are fixed)."""
        if not self.static:  # the fixed-shape forward, eagerly at the step's own shape
            return self.target.forward_static(node_ids, positions, self.cache.rows(0, node_ids.shape[0]), cache_len,
                                              tree_mask_packed, self.features, nodes=nodes)
        self.cache_len[: node_ids.shape[0]].copy_(cache_len, non_blocking=True)
        return self._run(node_ids, positions, tree_mask_packed)

    def _run(self, node_ids: Tensor, positions: Tensor, tree_mask_packed: Tensor):
        rows, n = node_ids.shape
        if rows not in self.row_buckets:
            raise ValueError(f"a static pass runs a row bucket {self.row_buckets}, got {rows} rows")
        b = self.bucket(n)
        if self.graphs and (rows, b) not in self._graphs:
            self._capture(rows, b)  # before the step's inputs go in: the warm-up writes its own
        ids, pos, mask = self._bucket_inputs(rows, b)
        ids[:, :n].copy_(node_ids, non_blocking=True)
        pos[:, :n].copy_(positions, non_blocking=True)
        mask[:, :n].copy_(tree_mask_packed, non_blocking=True)
        if b > n:
            ids[:, n:].zero_()
            pos[:, n:].copy_(pos[:, n - 1: n].expand(rows, b - n))
            mask[:, n:].copy_(self._pad_mask[:, n:b].expand(rows, b - n))
        if self.graphs:
            graph, out = self._graphs[(rows, b)]
            graph.replay()
        else:
            out = self.target.forward_static(ids, pos, self.cache.rows(0, rows), self.cache_len[:rows], mask,
                                             self.features)
        if self.features is None:
            return out[:, :n]
        return out[0][:, :n], out[1][:, :n]

    def _bucket_inputs(self, rows: int, b: int) -> tuple[Tensor, Tensor, Tensor]:
        if (rows, b) not in self._inputs:
            dev = self.target.device
            self._inputs[(rows, b)] = tuple(torch.zeros(rows, b, dtype=torch.int64, device=dev) for _ in range(3))
        return self._inputs[(rows, b)]

    # ------------------------------------------------------------------------------------------
    def _capture(self, rows: int, b: int) -> None:
        """Capture the (rows, b) bucket's forward. Its warm-up passes run with every row's prefix at
        the cache's last ``b`` slots (the slack past any committed token), so they overwrite
        nothing a request holds, and a bucket can be captured between any two steps. The prefix
        lengths are restored before the caller's step sets its own."""
        ids, pos, mask = self._bucket_inputs(rows, b)
        cache = self.cache.rows(0, rows)
        cache_len = self.cache_len[:rows]
        saved = cache_len.clone()
        mask.copy_(chain_mask_packed(b, mask.device).expand(rows, b))
        pos.copy_(torch.arange(b, device=pos.device)[None].expand(rows, b))
        ids.zero_()
        cache_len.fill_(self.cache.max_seq_len - b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits and autotuning happen outside the capture
            for _ in range(2):
                self.target.forward_static(ids, pos, cache, cache_len, mask, self.features)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.target.forward_static(ids, pos, cache, cache_len, mask, self.features)
        self._pool = graph.pool()
        self._graphs[(rows, b)] = (graph, out)
        cache_len.copy_(saved)
