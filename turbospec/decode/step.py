"""One speculative step on the target: the verify pass over root + drafts under the tree mask,
``verify`` (the one host read per step is ``accept_len`` with the emitted tokens), ``compact_kv``
for trees. ``VerifyStep`` owns the target's KV cache, the runner (dynamic or fixed-shape / CUDA
graphs) and, off CPU, the pinned staging buffer the step's inputs go over in.

On CPU a wide verify pass computes the LM head lazily (``LazyLogits``): ``verify`` reads the logits
of the nodes on the accepted path only (the root, each accepted node, the last one's bonus or
recovered token), so the pass stops at the final norm and the LM head runs over the likeliest path
(each node's first child, ``LAZY_ROWS`` rows at a time) until the walk stays on computed rows.
The LM head's rows are batch-invariant there, so every row read has the bits the full pass gives
it and the step's result is the same; SmolLM2's LM head over 64 rows costs 49 ms, as much as six
one-token steps, and over 4 rows 2.5 ms. A drafter that reads the target's argmax at every node
(``Drafter.wants_node_argmax``: lookahead decoding) gets every row's logits instead, and the argmax
of each comes back in the same host read as ``accept_len``.

Log-probabilities (a request's ``logprobs``; ``ops.sampling``): after ``verify``, still on the
device, the rows of the accepted path (``accept_index``, as deep as the draft; padded entries point
at the root) give each emitted token's log-probability and the top alternatives
(``path_logprobs``), and they come back in the same host read as ``accept_len`` (one float64 copy:
token ids are exact there); the host keeps the ``accept_len + 1`` nodes that emitted. On the lazy
path those rows are exactly the ones computed, so nothing more of the LM head runs. A request
without logprobs does none of this."""
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
from ..ops.sampling import SamplingParams, TokenLogprob, path_logprobs, read_logprobs


# A pass over more nodes than this computes its LM head lazily on CPU, this many rows per round: on
# the AVX2 machine of bench/RESULTS.md the Q8_0 LM head of SmolLM2 costs 1.7 / 2.0 / 2.2 / 2.5 ms
# over 1 / 2 / 3 / 4 rows and 3.4 / 4.6 / 10 / 49 ms over 5 / 8 / 16 / 64 (2 threads).
LAZY_ROWS = 4


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN/inf logits; no token was emitted from them."""


def draft_depth(draft: Draft | None) -> int:
    """The number of draft tokens on the longest root-to-leaf path (from the host-side draft)."""
    if draft is None:
        return 0
    if draft.parents is None:
        return len(draft)
    depth = [0]
    for p in draft.parents:
        depth.append(depth[p] + 1)
    return max(depth)


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
        node_argmax: the drafter reads the target's argmax at every node (``Drafter.wants_node_argmax``):
            ``step`` computes every node's logits and returns the argmax of each.
        static / graphs: the fixed-shape path and its CUDA-graph capture (see ``TargetRunner``).
    """

    def __init__(self, target: Transformer, max_seq_len: int, features=None, static: bool = False,
                 graphs: bool | None = False, node_argmax: bool = False):
        self.target, self.features = target, features
        self.node_argmax = bool(node_argmax)
        self.cache = target.new_cache(max_seq_len + (MAX_TREE_NODES if static else 0))
        self.runner = TargetRunner(target, self.cache, features, static=static, graphs=graphs if static else False)
        # the lazy LM head needs its rows to be batch-invariant (turbospec's CPU linear); it pays
        # where the LM head's cost grows with its rows: GGUF blocks, compute-bound on CPU (a dense
        # one is memory-bound over a few rows, and each extra round would read it again)
        lm = target.lm_head
        self._lazy = LazyLogits(target) if not static and lm.kernel and lm.quantized else None
        dev = target.device
        if dev.type != "cpu":  # the step's inputs go over in one copy from a pinned buffer (_stage)
            self._host_stage = torch.zeros(5, MAX_TREE_NODES, dtype=torch.int64, pin_memory=True)
            self._dev_stage = torch.zeros(5, MAX_TREE_NODES, dtype=torch.int64, device=dev)

    def prefill(self, ids: list[int]) -> tuple[int, Tensor | None]:
        """Write K/V for every prompt token but the last; see ``prefill``."""
        return prefill(self.target, self.cache, ids, self.features)

    def step(self, tokens: list[int], cache_len: int, draft: Draft | None, params: SamplingParams,
             generator: torch.Generator | None, logprobs: int | None = None
             ) -> tuple[list[int], int, Tensor | None, list[int] | None, list[TokenLogprob] | None]:
        """Verify ``draft`` after root ``tokens[-1]``; returns (emitted tokens, accepted drafts, the
        target features of the root and the accepted nodes [n + 1, F] when the drafter reads them,
        the target's argmax at the root and every draft node [k + 1] when ``node_argmax`` is set,
        each emitted token's ``TokenLogprob`` with ``logprobs`` alternatives when ``logprobs`` is
        not None)."""
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
        lazy = self._lazy is not None and k + 1 > LAZY_ROWS and not self.node_argmax
        with nvtx.range("verify"):
            out = self.runner.forward(node_ids, positions, cache_len, packed, tree_mask,
                                      logits="normed" if lazy else "all")
        logits, feats = (out, None) if self.features is None else out
        with nvtx.range("accept"):
            if lazy:
                accept_len, accept_index, out = self._lazy.verify(
                    logits, parents, node_ids, probs, uniform, params)
            else:
                accept_len, accept_index, out = ops.verify(
                    logits, parents, node_ids, probs, uniform, params.temperature, params.top_k, params.top_p)
            # The one host read per step: accept_len and the emitted tokens (and each node's argmax,
            # when the drafter reads them; and the accepted path's log-probabilities, when asked) in
            # one copy.
            parts = (accept_len, out[0]) + ((logits[0].argmax(-1),) if self.node_argmax else ())
            if logprobs is None:
                host = torch.cat(parts).tolist()
            else:
                full = self._lazy.logits if lazy else logits  # lazy: the path's rows are computed
                vocab = full.shape[-1]
                path_len = draft_depth(draft) + 1  # the most nodes an accepted path can have
                rows = accept_index[0, :path_len].clamp(min=0)
                lp = path_logprobs(full[0, rows], out[0, :path_len], params, logprobs)
                host = torch.cat([p.double() for p in parts] + [lp]).tolist()
                n_int = sum(p.numel() for p in parts)
                host, lp_host = [int(v) for v in host[:n_int]], host[n_int:]
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
        emitted = host[1: n + 2]
        lps = None if logprobs is None else read_logprobs(lp_host, emitted, params, logprobs, vocab)
        return emitted, n, feats, (host[k + 2:] if self.node_argmax else None), lps

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


class LazyLogits:
    """``ops.verify`` over logits computed only where the walk reads them (see the module docstring).

    Rows not computed this step hold stale values; the walk is rerun after each round of rows, and
    a result is final once every node on its path was computed this step: the walk's decisions up to
    the first stale node read computed rows only, so that node is where the next round starts (it
    and its first-child chain). A walk that reads a non-finite row (accept_len -1) is redone with
    every row computed, so that an error is reported only for the target's own logits. ``rows`` and
    ``rounds`` count the LM-head rows computed and the passes that computed them."""

    def __init__(self, target: Transformer):
        self.target = target
        self._buf: Tensor | None = None
        self.logits: Tensor | None = None  # the last walk's logits [1, n, V] (rows off its path: stale)
        self.rows = self.rounds = 0

    def verify(self, hidden: Tensor, parents: Tensor, node_ids: Tensor, probs: Tensor | None,
               uniform: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor, Tensor]:
        n = hidden.shape[1]
        vocab = self.target.cfg.vocab_size
        if self._buf is None:
            self._buf = torch.zeros(1, MAX_TREE_NODES, vocab)
        logits = self.logits = self._buf[:, :n]  # (read by the step for the path's log-probabilities)
        first_child = [-1] * n
        for i, p in enumerate(parents[0].tolist()[1:], start=1):
            if first_child[p] < 0:
                first_child[p] = i
        done = [False] * n
        start = 0
        while True:
            rows = []
            node = start
            while node >= 0 and len(rows) < LAZY_ROWS:
                if not done[node]:
                    rows.append(node)
                node = first_child[node]
            self._compute(hidden, logits, rows, done)
            accept_len, accept_index, out = ops.verify(
                logits, parents, node_ids, probs, uniform, params.temperature, params.top_k, params.top_p)
            n_acc = int(accept_len[0])
            if n_acc < 0:
                if all(done):
                    return accept_len, accept_index, out
                self._compute(hidden, logits, [i for i in range(n) if not done[i]], done)
                continue
            stale = [i for i in accept_index[0, : n_acc + 1].tolist() if not done[i]]
            if not stale:
                return accept_len, accept_index, out
            start = stale[0]

    def _compute(self, hidden: Tensor, logits: Tensor, rows: list[int], done: list[bool]) -> None:
        if not rows:
            return
        idx = torch.tensor(rows)
        logits[0, idx] = self.target.lm_head(hidden[0, idx]).float()
        for i in rows:
            done[i] = True
        self.rows += len(rows)
        self.rounds += 1
