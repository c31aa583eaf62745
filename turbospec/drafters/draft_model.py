"""A separate, smaller draft model (any checkpoint the loader takes) drafting a chain.

Each request's drafter keeps the draft's K/V in one slot of a ``DraftPool``: a static KV cache with
a row per request. ``_cached`` counts the committed tokens whose K/V the slot holds; a proposal
feeds the committed tokens it has not seen (the root, and the last accepted draft when every draft
was kept), then drafts autoregressively, writing speculative entries that ``observe`` keeps only
for the accepted prefix. Every draft forward is a ``lockstep.Rows`` request on the pool, so a
batch's proposals run one draft forward per round over all their rows (``lockstep.drive``); the
kernels are batch-invariant, so each request drafts what it drafts alone.

While the draft budget keeps speculation off, the draft reads nothing. ``begin`` only resets the
slot; ``prepare`` reads the prompt during the prefill when the first step is expected to draft. A
proposal after a long stretch of plain steps (a probe) does not catch up on every token committed
meanwhile (on 2 cores a 0.5B draft spends ~5 ms a token, 6% of the decode time of a 1.5B target): when
more than ``max_catchup`` tokens are missing it restarts its cache from the last ``max_catchup``
committed tokens, written from position 0 (RoPE attention depends only on relative positions), and
drafts from that shorter context from then on. Drafts only decide speed; the output is the target's.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Draft, Drafter
from ..ops.lockstep import Rows
from ..model.prefix_cache import PrefixCache
from ..model.runner import cache_slots, chain_mask_packed, pad_mask_packed
from ..model.transformer import Transformer
from ..ops.reference import logits_are_valid
from ..ops.sampling import SamplingParams, draft_sample
from ..ops.checks import is_int

CHUNK = 16  # committed tokens a pooled request feeds per forward (a longer catch-up takes several)
MAX_CATCHUP = 2 * CHUNK  # default: the most committed tokens a proposal reads to catch up


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


class DraftPool:
    """The draft model's KV cache for up to ``slots`` requests (one batch row each) and the batched
    forward their proposals share. ``step`` is the ``Rows`` op: row r of its input asks for the
    logits after feeding up to ``CHUNK`` tokens to one slot; one call runs every row asked in a round
    as one forward over slots [lowest asked, highest asked], idle slots between riding along as
    one-token padding rows that write after everything their slot ever wrote (``_written``).

    The cache holds rows for the slots taken so far (one at first; ``acquire`` grows it, by
    doubling, up to ``slots``), so an engine that never batches keeps one row."""

    def __init__(self, model: Transformer, max_seq_len: int, slots: int):
        if not is_int(slots) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        self.model, self.slots = model, slots
        # slack after max_seq_len: a chain of drafts (<= MAX_TREE_NODES) and a padded chunk after it
        self._seq_len = cache_slots(max_seq_len) + CHUNK
        self.cache = model.new_cache(self._seq_len, batch_size=1)
        model.ensure_rope(self._seq_len)
        self._written: list[int] = []  # per slot taken: 1 + the last position written since its begin
        self._chain = chain_mask_packed(CHUNK)[0]
        self._pad = pad_mask_packed(CHUNK)[0]

    def acquire(self) -> int | None:
        """The next slot (None when all ``slots`` are taken); slots are never given back (a drafter
        holds its slot for its life)."""
        slot = len(self._written)
        if slot == self.slots:
            return None
        rows = self.cache.k[0].shape[0]
        if slot == rows:  # grow the cache, keeping what the slots taken hold
            grown = self.model.new_cache(self._seq_len, batch_size=min(self.slots, 2 * rows))
            for new, old in zip(grown.tensors(), self.cache.tensors()):
                new[:rows].copy_(old)
            self.cache = grown
        self._written.append(0)
        return slot

    def reset(self, slot: int, length: int) -> None:
        """A new generation in ``slot`` whose first ``length`` positions were just written."""
        self._written[slot] = length

    @staticmethod
    def request(slot: int, cache_len: int, ids: list[int]) -> Tensor:
        """The input row of ``step`` for ``ids`` (1..CHUNK tokens) fed to ``slot`` after ``cache_len``."""
        return torch.tensor([[slot, cache_len, len(ids)] + list(ids) + [0] * (CHUNK - len(ids))], dtype=torch.int64)

    @torch.inference_mode()
    def step(self, x: Tensor) -> Tensor:
        """``x`` int64 [R, 3 + CHUNK] rows from ``request`` (distinct slots) -> float32 [R, V]: each row's
        logits after its last token."""
        asked = x.tolist()
        dev = self.model.device
        if len(asked) == 1:  # one row: the ordinary forward (the same numbers, none of the padding)
            slot, start, k, *toks = asked[0]
            self._check(slot, start, k, k)
            self._written[slot] = max(self._written[slot], start + k)
            ids = torch.tensor([toks[:k]], dtype=torch.int64, device=dev)
            pos = torch.arange(start, start + k, device=dev)[None]
            return self.model.forward(ids, pos, self.cache.rows(slot, slot + 1), start, logits="last")[:, -1]
        lo, hi = min(r[0] for r in asked), max(r[0] for r in asked) + 1
        bsz, n = hi - lo, max(r[2] for r in asked)
        ids = torch.zeros(bsz, n, dtype=torch.int64)
        cache_len = torch.tensor(self._written[lo:hi], dtype=torch.int64)  # idle rows: after their writes
        packed = self._pad[:n].expand(bsz, n).clone()
        last = torch.zeros(bsz, dtype=torch.int64)
        for slot, start, k, *toks in asked:
            self._check(slot, start, k, n)
            ids[slot - lo, :k] = torch.tensor(toks[:k])
            cache_len[slot - lo] = start
            packed[slot - lo, :k] = self._chain[:k]
            last[slot - lo] = k - 1
        for slot, start, k, *_ in asked:  # real K/V up to here (what padding rows must write after)
            self._written[slot] = max(self._written[slot], start + k)
        positions = cache_len[:, None] + torch.arange(n)
        logits = self.model.forward_static(ids.to(dev), positions.to(dev), self.cache.rows(lo, hi),
                                           cache_len.to(dev), packed.to(dev), last=last.to(dev))
        return logits[[r[0] - lo for r in asked]]

    def _check(self, slot: int, start: int, k: int, width: int) -> None:
        """A request of ``k`` tokens after ``start`` in a pass ``width`` tokens wide must fit the cache."""
        if not 0 <= slot < len(self._written) or not 1 <= k <= CHUNK or start < 0 \
                or start + width > self.cache.max_seq_len:
            raise ValueError(f"draft pool: slot {slot} asks for {k} tokens after {start} (slots taken: "
                             f"{len(self._written)}; 1..{CHUNK} tokens inside a cache of {self.cache.max_seq_len})")


class DraftModelDrafter(Drafter):
    """Chain drafting with a separate model. ``pool``: the ``DraftPool`` whose free slot this drafter
    takes (the drafters of a batch share one, so their proposals share each draft forward); None
    or full: a pool of its own. ``static`` (default: off CPU) runs the draft's steps through a
    ``TargetRunner`` of its own instead: fixed token-count buckets, replayed from CUDA graphs on a
    GPU (``graphs``, default on CUDA); a catch-up longer than the largest bucket (the prompt) runs
    the ordinary forward. Static drafters draft alone (no pool)."""

    name = "draft_model"

    def __init__(self, model: Transformer, max_seq_len: int, static: bool | None = None,
                 graphs: bool | None = None, pool: DraftPool | None = None,
                 max_catchup: int | None = MAX_CATCHUP, prefix_cache: PrefixCache | None = None):
        from ..model.runner import TargetRunner
        if max_catchup is not None and (not is_int(max_catchup)
                                        or max_catchup < 1):
            raise ValueError(f"max_catchup must be an integer >= 1 or None (no limit), got {max_catchup!r}")
        self.model, self.max_catchup, self.prefix_cache = model, max_catchup, prefix_cache
        static = model.device.type != "cpu" if static is None else static
        self.pool, self.slot, self.runner = None, None, None
        if static:
            self._cache = model.new_cache(cache_slots(max_seq_len))  # a tree of slack
            self.runner = TargetRunner(model, self._cache, static=True, graphs=graphs)
        else:
            slot = None if pool is None or pool.model is not model else pool.acquire()
            if slot is None:
                pool = DraftPool(model, max_seq_len, 1)
                slot = pool.acquire()
            self.pool, self.slot = pool, slot
        self._cached = 0  # committed tokens [offset, cached) are in the cache, token i at position i - offset
        self._offset = 0
        self._base = 0
        self._speculative = 0
        self._proposed = False

    @property
    def cache(self):
        """The draft's KV cache for this request (a pooled drafter: its row of the pool's cache, which
        may be reallocated when the pool grows)."""
        return self._cache if self.pool is None else self.pool.cache.rows(self.slot, self.slot + 1)

    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        """A new generation: forget the last one's cache (nothing is read here; see ``prepare``)."""
        self._cached = self._offset = self._base = self._speculative = 0
        self._proposed = False
        if self.pool is not None:
            self.pool.reset(self.slot, 0)

    @property
    def windowed(self) -> bool:
        return self._offset > 0

    @torch.inference_mode()
    def prepare(self, tokens: list[int]) -> None:
        """Read the committed tokens but the root in one forward (the engine calls this in the
        prefill when the first step is expected to draft), so that the first proposal costs what
        every later one does and the draft budget does not judge the drafter by a prompt read.
        With a ``prefix_cache`` (the draft model's; shared by an engine's drafters) the longest
        cached prefix of a new prompt is copied in and only the rest is computed, then its blocks
        are kept: the draft's forward computes a token with the same numbers whatever shares its
        pass, so a cached prefix has the bits of reading it again (the same drafts)."""
        pc = self.prefix_cache
        if pc is not None and self._cached == 0 and self._offset == 0 and len(tokens) > 1:
            blocks = pc.match(tokens, len(tokens) - 1)
            pc.load(blocks, self.cache)
            self._cached = sum(b.tokens for b in blocks)
        if len(tokens) - 1 > self._cached:
            dev = self.model.device
            ids = torch.tensor([tokens[self._cached:-1]], dtype=torch.int64, device=dev)
            pos = torch.arange(self._cached - self._offset, len(tokens) - 1 - self._offset, device=dev)[None]
            self.model.forward(ids, pos, self.cache, self._cached - self._offset, logits="last")
            self._cached = len(tokens) - 1
            if pc is not None and self._offset == 0:
                pc.store(tokens, self._cached, self.cache)
        self._base = self._cached
        if self.pool is not None:
            self.pool.reset(self.slot, self._cached - self._offset)

    def propose_steps(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None):
        self._base, self._speculative = self._cached, 0
        if max_tokens <= 0:
            return None
        self._proposed = True
        if self.max_catchup is not None and len(tokens) - self._cached > self.max_catchup:
            # a long stretch without proposals: restart from the last max_catchup tokens
            self._cached = self._offset = len(tokens) - self.max_catchup
            if self.pool is not None:
                self.pool.reset(self.slot, 0)
        logits = None
        step = CHUNK if self.pool is not None else len(tokens)  # a static drafter feeds them at once
        for start in range(self._cached, len(tokens), step):  # the committed tokens not yet fed
            logits = yield from self._feed(tokens[start:start + step], start)
        self._base = len(tokens)
        drafted, qs = [], []
        for i in range(max_tokens):
            if not logits_are_valid(logits):  # NaN/inf draft: stop drafting, the target decides alone
                break
            t, q = draft_sample(logits, params, generator)
            drafted.append(t)
            qs.append(q)
            if i + 1 < max_tokens:
                logits = yield from self._feed([t], len(tokens) + i)
        self._speculative = min(len(drafted), max_tokens - 1)  # drafts whose K/V were written
        if not drafted:
            return None
        probs = None
        if not params.greedy:
            qs.append(torch.zeros_like(qs[0]))  # the last node has no children
            probs = torch.stack(qs)
        return Draft(token_ids=drafted, draft_probs=probs)

    def _feed(self, ids: list[int], cache_len: int):
        """The draft's logits [V] after ``ids``, committed tokens from index ``cache_len`` on (a
        generator: a pooled drafter asks its pool through a ``Rows`` request; a static one runs its
        own forward)."""
        cache_len -= self._offset  # token index -> cache position
        if self.pool is not None:
            return (yield Rows(self.pool.step, DraftPool.request(self.slot, cache_len, ids)))[0]
        dev = self.model.device
        x = torch.tensor([ids], dtype=torch.int64, device=dev)
        pos = torch.arange(cache_len, cache_len + len(ids), device=dev)[None]
        if x.shape[1] <= self.runner.max_tokens:
            return self.runner.forward(x, pos, cache_len)[0, -1]
        return self.model.forward(x, pos, self.cache, cache_len, logits="last")[0, -1]

    def finish(self, tokens: list[int]) -> None:
        """Keep the K/V of the finished text in the prefix cache (the next turn of a chat resends
        the answer): the committed tokens the cache holds, read or accepted as drafts, which have
        the bits of reading them (tests/decode/test_prefix_cache.py)."""
        pc = self.prefix_cache
        if pc is None or self._offset != 0:
            return
        valid = self._base if self._proposed else self._cached  # (the last step was not observed)
        if valid > 0:
            pc.store(tokens, min(valid, len(tokens)), self.cache)

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None) -> None:
        # Only a step that proposed moves the cached prefix (its accepted drafts' K/V are valid);
        # after a plain step the draft's cache is as it was, and the next proposal catches up on
        # the tokens committed since (not on the whole context).
        if self._proposed:
            self._cached = self._base + min(num_accepted, self._speculative)
            self._proposed = False
