"""The target's side of speculative decoding: ``TargetStep``, one verify step for one request or many.

A step takes the planned drafts of the requests in its rows (batch slots: a request keeps its slot
from prefill to finish; one request alone is slot 0) and runs: the target over every row's root +
drafts under its tree mask (a chain or a tree, each row its own length; shorter rows are padded with
nodes that attend only themselves and carry draft id -1, which ``verify`` never accepts), one
``verify`` with per-row sampling parameters, one ``compact_kv`` when a row is a tree, and one host
read for all rows (``accept_len`` with the emitted tokens). The step's inputs are built on the host
in one staging buffer (drafts come from there) and go to the device in one copy.

The target pass takes one of two paths, with the same results:

* dynamic (CPU default, one row): ``Transformer.forward`` on exactly the step's n tokens (the C++
  layer loop), with the LM head computed lazily (``LazyLogits``, below);
* fixed-shape (``TargetRunner``: any row count; the only path off CPU): ``Transformer.forward_static``
  on a (rows, nodes) bucket with per-row prefix lengths on the device, replayed from one CUDA graph
  per bucket on a GPU. Rows past the batch's highest slot and up to its bucket ride along as
  one-node padding rows, as do idle slots below it.

The pass covers the slots up to the highest active one (requests take the lowest free slot); a slot
whose prompt is being prefilled in chunks (``parked``) rides along writing after its prefix, never
over it.

On CPU a wide verify pass of one row computes the LM head lazily: ``verify`` reads the logits of the
nodes on the accepted path only (the root, each accepted node, the last one's bonus or recovered
token), so the pass stops at the final norm and the LM head runs over the likeliest path (each
node's first child, ``LAZY_ROWS`` rows at a time) until the walk stays on computed rows. The LM
head's rows are batch-invariant there, so every row read has the bits the full pass gives it and the
step's result is the same (costs: bench/results/, the lazy LM head's run). A drafter that reads the
target's argmax at every node (``Drafter.wants_node_argmax``: lookahead decoding) gets every row's
logits instead, and the argmax of each comes back in the same host read as ``accept_len``.

Log-probabilities (a request's ``logprobs``; ``ops.sampling``): after ``verify``, still on the
device, the rows of each asking request's accepted path (``accept_index``, as deep as its draft;
padded entries point at the root) give each emitted token's log-probability and the top alternatives
(``path_logprobs``), computed with that request's own sampling parameters, and they come back in the
same host read (one float64 copy then: token ids are exact there). On the lazy path those rows are
exactly the ones computed, so nothing more of the LM head runs. Without such a request, none of this
runs.

Every row's numbers are its own: the linears, norms and attention reduce in one order per row
whatever else is in the pass, and a request's coins come from its own generator, so a request's
output does not depend on its neighbours or on the path its pass took (greedy: identical to decoding
it alone; seeded sampling: the same tokens as alone with the same seed).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import ops
from ..drafters.base import Draft
from ..model.kv_cache import KVCache
from ..model.runner import TargetRunner, cache_slots, chain_mask_packed, pad_mask_packed
from ..model.transformer import Transformer
from ..ops import nvtx
from ..ops.checks import is_int
from ..ops.limits import MAX_TREE_NODES
from ..ops.sampling import LogitProcessingBuffers, SamplingParams, TokenLogprob, path_logprobs, read_logprobs
from .errors import NonFiniteLogitsError
from .grammar import bitmask_words
from ..model.prefix_cache import PrefixCache

# A one-row pass over more nodes than this computes its LM head lazily on CPU, this many rows per
# round (the LM head's cost by row count: bench/results/, the lazy LM head's run).
LAZY_ROWS = 4


class StepResult(NamedTuple):
    """What a verify step gave one row: the emitted tokens (accepted drafts + the bonus or recovered
    token), how many drafts were accepted, the drafter's features of the root and the accepted
    nodes [n + 1, F] (when it reads them), the target's argmax at the root and every draft node
    (when the drafter reads them), each emitted token's ``TokenLogprob`` (when the request asked)."""
    tokens: list[int]
    accepted: int
    features: Tensor | None = None
    node_argmax: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None


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


class _Staging:
    """A step's host-built inputs, allocated once in one buffer: ``rows`` x ``MAX_TREE_NODES`` nodes
    per node field, ``rows`` values per row field, each step viewing a contiguous [rows, n] / [rows]
    prefix of every field (draft probabilities and grammar bitmasks: ``extra`` buffers of their own,
    grown to the largest size seen, then reused). Off the CPU the buffer is pinned and ``to_device`` copies it
    whole (a few KB) into a device twin of the same layout in one transfer (the extra buffers in one
    more each), so a step allocates
    nothing on either side once warm (the host buffer is refilled only after the step's one host
    read, by which time the copy has completed)."""
    NODES = dict(ids=torch.int64, draft_ids=torch.int64, parents=torch.int64, positions=torch.int64,
                 packed=torch.int64, uniform=torch.float32)
    ROWS = dict(cache_len=torch.int64, temperature=torch.float64, top_k=torch.int64, top_p=torch.float64,
                nodes=torch.int64)

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.device = rows, torch.device(device)
        self.pin = self.device.type != "cpu"
        self._at: dict[str, tuple[int, int, torch.dtype]] = {}
        at = 0
        for fields, count in ((self.NODES, rows * MAX_TREE_NODES), (self.ROWS, rows)):
            for name, dt in fields.items():
                nbytes = count * torch.empty(0, dtype=dt).element_size()
                self._at[name] = (at, nbytes, dt)
                at += (nbytes + 7) // 8 * 8
        self.host = torch.zeros(at, dtype=torch.uint8, pin_memory=self.pin)
        self.dev = torch.zeros(at, dtype=torch.uint8, device=self.device) if self.pin else self.host
        self._extra: dict[str, tuple[Tensor, Tensor | None]] = {}
        self._views: dict[tuple, dict[str, Tensor]] = {}

    def views(self, rows: int, n: int, on_device: bool = False) -> dict[str, Tensor]:
        """Every field's [rows, n] (node fields) or [rows] (row fields) view of the host buffer (or
        of its device twin); made once per shape (the buffers never move)."""
        key = (rows, n, on_device)
        out = self._views.get(key)
        if out is None:
            buf = self.dev if on_device else self.host
            out = {}
            for name, (at, nbytes, dt) in self._at.items():
                flat = buf[at: at + nbytes].view(dt)
                out[name] = flat[: rows * n].view(rows, n) if name in self.NODES else flat[:rows]
            self._views[key] = out
        return out

    def extra(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A host buffer of its own for ``name`` ("probs": draft probabilities [rows, n, V];
        "bitmask": the grammar's token bitmasks [rows, n, W]), grown to the largest size seen, then
        reused; ``to_device`` copies it with the rest."""
        numel = 1
        for d in shape:
            numel *= d
        have = self._extra.get(name)
        if have is None or have[0].numel() < numel:
            host = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self._extra[name] = have = (host, torch.empty(numel, dtype=dtype, device=self.device) if self.pin else None)
        return have[0][:numel].view(shape)

    def to_device(self, rows: int, n: int, **extras: Tensor | None) -> tuple[dict[str, Tensor], dict]:
        """The step's inputs on the device: the whole buffer in one copy (and each of ``extras``,
        views of ``extra`` buffers or None, in one more); on CPU the host views themselves."""
        if not self.pin:
            return self.views(rows, n), extras
        self.dev.copy_(self.host, non_blocking=True)
        out = {}
        for name, host in extras.items():
            if host is not None:
                dev = self._extra[name][1][: host.numel()].view(host.shape)
                dev.copy_(host, non_blocking=True)
                host = dev
            out[name] = host
        return self.views(rows, n, on_device=True), out


class TargetStep:
    """The target side of generation, for one request (slot 0) or a batch of up to ``max_batch``:
    ``prefill`` a slot's prompt, then ``step`` once per planned draft of the requests in the pass.

    Args:
        target: the model. Its KV cache holds ``max_seq_len`` tokens per slot (plus one tree of
            slack, where a step's padding nodes write); it is allocated for one slot until
            ``reserve`` asks for more (a batch), so a single request costs one slot's memory.
        max_batch: the most slots ``reserve`` may allocate.
        features: what the drafter reads back from the target (None, "final" or layer indices).
        node_argmax: the drafter reads the target's argmax at every node (``Drafter.wants_node_argmax``):
            ``step`` computes every node's logits and returns the argmax of each.
        static / graphs: the fixed-shape path for every pass, and its CUDA-graph capture (see
            ``TargetRunner``; default: off on CPU, on elsewhere).
        prefix_cache: prompt prefixes already computed, copied into a slot instead of prefilled again
            (``model.prefix_cache``; None: every prompt is prefilled whole).
    """

    def __init__(self, target: Transformer, max_seq_len: int, max_batch: int = 1, features=None,
                 static: bool | None = None, graphs: bool | None = None, node_argmax: bool = False,
                 prefix_cache: PrefixCache | None = None):
        if not is_int(max_batch) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.target, self.max_seq_len, self.max_batch, self.features = target, max_seq_len, max_batch, features
        self.node_argmax = bool(node_argmax)
        self.prefix_cache = prefix_cache
        dev = target.device
        self.static = dev.type != "cpu" if static is None else bool(static)
        self.graphs = (dev.type == "cuda" if graphs is None else bool(graphs)) and self.static
        # the lazy LM head needs its rows to be batch-invariant (turbospec's CPU linear); it pays
        # where the LM head's cost grows with its rows: GGUF blocks, compute-bound on CPU (a dense
        # one is memory-bound over a few rows, and each extra round would read it again)
        lm = target.lm_head
        self._lazy = LazyLogits(target) if not self.static and lm.kernel and lm.quantized else None
        self._chain = chain_mask_packed(MAX_TREE_NODES)[0]  # packed mask rows, built once
        self._pad = pad_mask_packed(MAX_TREE_NODES)[0]
        self.cache: KVCache | None = None
        self.runner: TargetRunner | None = None
        self._stage: _Staging | None = None
        self._build(1)

    @property
    def slots(self) -> int:
        """Slots the KV cache holds now."""
        return self.cache.k[0].shape[0]

    def _build(self, slots: int) -> None:
        self.cache = self.target.new_cache(cache_slots(self.max_seq_len), batch_size=slots)
        self.runner = TargetRunner(self.target, self.cache, self.features, static=self.static,
                                   graphs=self.graphs)
        self._stage = _Staging(slots, self.target.device)
        self._buffers: LogitProcessingBuffers | None = None  # made when a request first asks for processing
        self._owners: list = [None] * slots  # the request whose settings each slot's buffer row holds

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` concurrent requests (at most ``max_batch``): the KV cache grows to
        ``max_batch`` slots the first time more than one is asked for. Call between generations:
        the cache is allocated anew (what it held is not kept), and the CUDA graphs are captured
        again against it as their buckets are first used."""
        if not is_int(slots) or not 1 <= slots <= self.max_batch:
            raise ValueError(f"slots must be an integer in [1, {self.max_batch}] (max_batch), got {slots!r}")
        if slots > self.slots:
            self.cache = self.runner = self._stage = None  # the old cache goes before the new one comes
            self._build(self.max_batch)

    def _check_slot(self, slot: int) -> None:
        if not is_int(slot) or not 0 <= slot < self.slots:
            raise ValueError(f"slot must be an integer in [0, {self.slots}) (the slots reserved), got {slot!r}")

    def prefill(self, slot: int, ids: list[int]) -> tuple[int, Tensor | None, int]:
        """A request's prompt (all but its last token, the first root) into its slot, alone: its
        cached prefix copied in (``load_prefix``), the rest computed, its blocks kept
        (``store_prefix``). Returns the cache length, the drafter's features of the prompt [n, F]
        (when it reads them) and how many prompt tokens came from the prefix cache."""
        self._check_slot(slot)
        m, cached = self.load_prefix(slot, ids)
        n = len(ids) - 1
        if m == 0:
            _, features = prefill(self.target, self.cache.rows(slot, slot + 1), ids, self.features)
        else:
            rest = self.prefill_part(slot, ids, m, n) if n > m else None
            features = None if self.features is None else (cached if rest is None else torch.cat([cached, rest]))
        self.store_prefix(slot, ids, features)
        return n, features, m

    def load_prefix(self, slot: int, ids: list[int]) -> tuple[int, Tensor | None]:
        """Copy the longest cached prefix of the prompt ``ids`` (all but its last token) into
        ``slot``; returns how many tokens that is and their features (when the drafter reads them).
        (0, None) without a prefix cache."""
        self._check_slot(slot)
        pc = self.prefix_cache
        if pc is None:
            return 0, None
        blocks = pc.match(ids, len(ids) - 1)
        if blocks and self.features is not None and blocks[0].features is None:
            blocks = []  # stored by a step whose drafter read no features: recomputed
        f = pc.load(blocks, self.cache.rows(slot, slot + 1))
        return sum(block.tokens for block in blocks), f

    def store_prefix(self, slot: int, ids: list[int], features: Tensor | None) -> None:
        """Keep the prompt's K/V (and the drafter's ``features`` of it) from ``slot`` in the prefix
        cache, once the whole prompt but its last token is in the slot."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(ids, len(ids) - 1, self.cache.rows(slot, slot + 1), features)

    @property
    def keeps_features(self) -> bool:
        """Do requests keep the drafter's features of their tokens for the prefix cache?"""
        return self.prefix_cache is not None and self.features is not None

    def store_written(self, slot: int, seq) -> None:
        """Keep a finished request's tokens whose K/V are in ``slot`` (its prompt and what it
        generated; ``loop.Sequence``) in the prefix cache, so a later prompt that contains the answer
        (the next turn of a chat) is not prefilled again. A generated token's K/V and features, written
        by a verify pass, are the same bits a prefill of the whole text writes (every token's numbers
        are the same whatever shares its pass; tests/decode/test_prefix_cache.py checks it)."""
        pc = self.prefix_cache
        if pc is None:
            return
        upto = min(seq.cache_len, len(seq.tokens))  # drafts accepted past an EOS or the length cut are in the cache, not in tokens
        features = None
        if self.features is not None:
            if seq.written_features is None:
                return
            features = torch.cat(seq.written_features)
            upto = min(upto, features.shape[0])
        pc.store(seq.tokens, upto, self.cache.rows(slot, slot + 1), features)

    @torch.inference_mode()
    def prefill_part(self, slot: int, ids: list[int], start: int, end: int) -> Tensor | None:
        """Prompt tokens ``ids[start:end]`` into the slot after the ``start`` already there (chunked
        prefill: the same K/V and features as one ``prefill``, since every token's numbers are the
        same whatever shares its pass). Returns their features [end - start, F] when the drafter reads
        them."""
        self._check_slot(slot)
        dev = self.target.device
        x = torch.tensor([ids[start:end]], dtype=torch.int64).to(dev)
        pos = torch.arange(start, end, device=dev)[None]
        out = self.target.forward(x, pos, self.cache.rows(slot, slot + 1), start, logits="none",
                                  features=self.features)
        return None if self.features is None else out[1][0]

    @property
    def ragged(self) -> bool:
        """Whether a batched pass computes only its rows' own tokens (CPU's eager pass: the C++ layer
        loop skips the padding of shorter drafts and of free and parked slots), so that it costs the
        tokens of its drafts, not rows x the longest; the static path (CUDA graphs) computes its shape."""
        return not self.runner.static and self.target.device.type == "cpu"

    @torch.inference_mode()
    def step(self, rows: dict, parked: dict[int, int] | None = None
             ) -> dict[int, StepResult | NonFiniteLogitsError]:
        """One verify pass over the planned drafts of ``rows`` (slot -> the request's ``loop.Sequence``,
        its ``draft`` planned).
        Returns each slot's ``StepResult``, or a ``NonFiniteLogitsError`` in its place for a row
        whose logits were not finite (that row only: nothing was emitted for it). ``parked``: slots
        holding a prompt being prefilled in chunks (slot -> tokens in the cache)."""
        bsz = max(rows) + 1
        if bsz > self.slots:
            raise ValueError(f"slot {bsz - 1} is past the {self.slots} slots reserved (TargetStep.reserve)")
        n = max(1 + (0 if s.draft is None else len(s.draft)) for s in rows.values())
        dynamic = bsz == 1 and not self.static
        rb = self.runner.row_bucket(bsz)  # rows of the pass: bsz, or its bucket on the fixed-shape path
        st = self._stage
        v = st.views(rb, n)
        ids, draft_ids, parents, positions, packed, uniform = (v[k] for k in _Staging.NODES)
        cache_len, temperature, top_k, top_p, nodes = (v[k] for k in _Staging.ROWS)
        # every row and node is written below when every row of the pass is a request with n nodes
        # (one request alone); else the rest are padding: a node attending only itself, never accepted
        if len(rows) < rb or any((0 if s.draft is None else len(s.draft)) + 1 < n for s in rows.values()):
            ids.zero_()
            draft_ids.fill_(-1)
            draft_ids[:, 0] = 0
            parents.zero_()
            parents[:, 0] = -1
            positions.zero_()
            packed.copy_(self._pad[:n].expand(rb, n))
            cache_len.zero_()
            nodes.zero_()  # a free or parked slot: no token (the pass skips it on CPU)
            uniform.zero_()
            # float64: the Python numbers exactly, as given
            temperature.zero_()
            top_k.zero_()
            top_p.fill_(1.0)
        vocab = self.target.cfg.vocab_size
        with_probs = any(s.draft is not None and s.draft.draft_probs is not None for s in rows.values())
        probs = st.extra("probs", (rb, n, vocab), torch.float32).zero_() if with_probs else None
        constrained = any(s.constraint is not None for s in rows.values())
        bitmask = st.extra("bitmask", (rb, n, bitmask_words(vocab)), torch.int32).fill_(-1) if constrained else None
        trees = False
        tree_mask = None  # the dynamic path's bool mask of its one row, when it is a tree
        path_len: dict[int, int] = {}  # rows that want log-probabilities -> the most nodes on their path
        for b, length in (parked or {}).items():
            if b < rb:  # a padding row writes after its prefix, never over it
                cache_len[b] = length
                positions[b] = length
        for b, s in rows.items():
            d = s.draft
            k = 0 if d is None else len(d)
            root = s.tokens[-1]
            ids[b, 0] = draft_ids[b, 0] = root
            parents[b, 0] = -1
            cache_len[b] = s.cache_len
            nodes[b] = k + 1
            if k:
                ids[b, 1:k + 1] = draft_ids[b, 1:k + 1] = torch.tensor(d.token_ids)
            if d is None or d.parents is None:
                parents[b, 1:k + 1] = torch.arange(k)
                depth = torch.arange(k + 1)
                packed[b, :k + 1] = self._chain[:k + 1]
            else:
                trees = True
                mask, pk, depth, _ = ops.build_tree(torch.tensor([[-1] + d.parents]))
                tree_mask = mask
                depth = depth[0]
                parents[b, 1:k + 1] = torch.tensor(d.parents)
                packed[b, :k + 1] = pk[0]
            positions[b, :k + 1] = s.cache_len + depth
            positions[b, k + 1:] = s.cache_len  # padding: the root's position (attends only itself)
            if s.logprobs is not None:
                path_len[b] = draft_depth(d) + 1
            uniform[b, :k + 1] = s.uniform()
            temperature[b], top_k[b], top_p[b] = s.params.temperature, s.params.top_k, s.params.top_p
            if s.constraint is not None:  # the grammar's bitmask of every node (see decode.grammar)
                s.constraint.fill([] if d is None else d.token_ids, None if d is None else d.parents,
                                  bitmask[b, :k + 1])
            if with_probs:
                if d is not None and d.draft_probs is not None:
                    probs[b, :k + 1] = d.draft_probs
                elif not s.params.greedy and k:
                    raise ValueError("a batch mixes sampled rows with point-mass drafts and rows with draft "
                                     "probabilities; verify takes one kind per pass")
        processing = self._processing(rows, rb)
        v, extra = st.to_device(rb, n, probs=probs, bitmask=bitmask)
        probs = extra["probs"]
        if extra["bitmask"] is not None:
            processing["token_bitmask"] = extra["bitmask"]
        lazy = dynamic and self._lazy is not None and n > LAZY_ROWS and not self.node_argmax
        ragged = not dynamic and self.ragged
        with nvtx.range("verify"):
            if dynamic:
                out = self.runner.forward(v["ids"], v["positions"], int(cache_len[0]), tree_mask=tree_mask,
                                          logits="normed" if lazy else "all")
            else:
                out = self.runner.forward_rows(v["ids"], v["positions"], v["cache_len"], v["packed"],
                                               nodes=v["nodes"] if ragged else None)
        logits, feats = (out, None) if self.features is None else out
        with nvtx.range("accept"):
            args = (v["parents"], v["draft_ids"], probs, v["uniform"], v["temperature"], v["top_k"], v["top_p"])
            if lazy:
                accept_len, accept_index, emitted = self._lazy.verify(logits, *args, **processing)
                logits = self._lazy.logits  # the accepted path's rows are computed
            else:
                accept_len, accept_index, emitted = ops.verify(logits, *args, **processing)
            parts = (accept_len, emitted.flatten()) + ((logits.argmax(-1).flatten(),) if self.node_argmax else ())
            if not path_len:
                host = torch.cat(parts).tolist()  # the one host read of the step
            else:  # with the log-probabilities of the rows that asked: one float64 read
                lps = [path_logprobs(logits[b, accept_index[b, :m].clamp(min=0)], emitted[b, :m], rows[b].params,
                                     rows[b].logprobs, **self._path_processing(processing, b, accept_index[b, :m]))
                       for b, m in path_len.items()]
                host = torch.cat([p.double() for p in parts] + lps).tolist()
                n_int = sum(p.numel() for p in parts)
                lp_host, lp_at, at = host[n_int:], {}, 0
                for b, t in zip(path_len, lps):
                    lp_at[b], at = at, at + t.numel()
                host = [int(x) for x in host[:n_int]]
        if processing.get("output_counts") is not None:  # this step's tokens join the penalties' counts
            self._buffers.add_emitted(emitted, accept_len)
        if trees:
            with nvtx.range("compact"):
                ops.compact_kv(self.cache.rows(0, rb).tensors(), v["cache_len"], accept_index, accept_len)
        results: dict[int, StepResult | NonFiniteLogitsError] = {}
        for b, s in rows.items():
            n_acc = host[b]
            if n_acc < 0:  # this row's failure only: the scheduler fails its request, the others go on
                why = "non-finite logits (NaN/inf)"
                if s.params.processed or s.constraint is not None:  # (verify's invalid-row rule covers both)
                    why += " or logits its penalties / grammar left no token to choose from"
                results[b] = NonFiniteLogitsError(
                    f"the target produced {why} at position {s.cache_len}"
                    + (f" for the request in slot {b}" if self.slots > 1 else "") + "; no token was emitted from them")
                continue
            toks = host[rb + b * n: rb + b * n + n_acc + 1]
            # a copy: with CUDA graphs, feats is the graph's output buffer, which the next replay
            # overwrites while a drafter may still hold these rows (steps without a proposal)
            f = None if feats is None else feats[b, accept_index[b, : n_acc + 1]]
            amax = None
            if self.node_argmax:
                k = 0 if s.draft is None else len(s.draft)
                at = rb + rb * n + b * n
                amax = host[at: at + k + 1]
            lp = None
            if b in path_len:
                lp = read_logprobs(lp_host[lp_at[b]:], toks, s.params, s.logprobs, logits.shape[-1])
            results[b] = StepResult(toks, n_acc, f, amax, lp)
        return results


    def _processing(self, rows: dict, rb: int) -> dict:
        """``ops.verify``'s logit-processing arguments for a pass over ``rb`` rows (penalties,
        logit_bias, min_p; ``ops.sampling.LogitProcessingBuffers``): a request's buffer row is set
        at its first step in a slot (its prompt, its settings, the tokens it has generated) and
        then counts its emitted tokens on the device; rows without processing hold neutral values.
        Empty (verify as before) while no row of the pass asks for any."""
        if self._buffers is None:
            if not any(s.params.processed for s in rows.values()):
                return {}
            self._buffers = LogitProcessingBuffers(self.slots, self.target.cfg.vocab_size, self.target.device,
                                                   max_nodes=MAX_TREE_NODES)
        buf = self._buffers
        for b in range(rb):
            s = rows.get(b)
            want = s if s is not None and s.params.processed else None
            if self._owners[b] is not want:
                if want is None:
                    buf.clear_row(b)
                else:
                    buf.set_row(b, s.params, s.ids, s.tokens[len(s.ids):])
                self._owners[b] = want
        if all(o is None for o in self._owners[:rb]):
            return {}
        return buf.verify_kwargs(rb)

    @staticmethod
    def _path_processing(processing: dict, b: int, path: Tensor) -> dict:
        """``path_logprobs``' processing arguments for row ``b``'s accepted ``path`` (node indices;
        -1 padding): the counts before this step, as verify read them."""
        out = {}
        for name in ("output_counts", "prompt_mask", "logit_bias"):
            if processing.get(name) is not None:
                out[name] = processing[name][b]
        if processing.get("token_bitmask") is not None:
            out["token_bitmask"] = processing["token_bitmask"][b, path.clamp(min=0)]
        return out


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
               uniform: Tensor, temperature, top_k=0, top_p=1.0, **processing) -> tuple[Tensor, Tensor, Tensor]:
        """``ops.verify`` with the final-normed hidden states [1, n, hidden] in place of the logits;
        ``temperature`` may also be a ``SamplingParams``; ``processing``: verify's logit-processing
        arguments."""
        if isinstance(temperature, SamplingParams):
            temperature, top_k, top_p = temperature.temperature, temperature.top_k, temperature.top_p
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
            accept_len, accept_index, out = ops.verify(logits, parents, node_ids, probs, uniform, temperature,
                                                       top_k, top_p, **processing)
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
