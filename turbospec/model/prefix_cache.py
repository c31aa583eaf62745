"""Automatic prefix caching: the K/V of prompt prefixes already computed, reused by later prompts
(the target's: ``decode.step.TargetStep``; a draft model's: ``drafters.draft_model``).

Chats resend the whole conversation every turn and agents resend long system prompts. A
``PrefixCache`` keeps the target's K/V (and the drafter's features, when it reads them) of prompts in
blocks of ``block_tokens`` tokens, each block keyed by its own tokens and the block before it (so a
block stands for the whole prefix up to its end, compared exactly: no hash can collide). A prompt's
last, partial block is kept too, as a leaf (a chain never continues from it), so a later prompt that
extends the text (the next turn of a chat) reuses every token up to where it differs rather than
up to a block boundary. A new prompt's longest run of cached blocks is copied into its KV-cache slot
and only the rest is prefilled. Blocks are evicted least recently used when the cache would pass its byte budget;
concurrent requests share its blocks (each copies them into its own slot).

Exactness: a cached prefix gives the same bits as recomputing it. Prefill computes every prompt
token with the same forward whatever else shares its pass (the chunked-prefill property the batch
scheduler already relies on), so the K/V read back from a block are the ones a whole prefill would
write, and the rest of the prompt, prefilled after them, sees the same numbers. The same property
covers generated tokens: a verify pass computes a tree node with the same kernels and the same
reduction order as a prefill of its path (attention over its ancestors only), so the K/V and
features of the tokens a request accepted are the bits a prefill of prompt + answer writes. A
finished request's whole text is therefore kept too (``TargetStep.store_written``), and the next
turn of a chat, which resends the answer, prefills only its new message.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from .kv_cache import KVCache
from ..ops.checks import is_int


class _Block:
    __slots__ = ("key", "uid", "kv", "features", "nbytes", "tokens")

    def __init__(self, key, uid: int, kv: list[Tensor], features: Tensor | None):
        self.key, self.uid, self.kv, self.features = key, uid, kv, features
        self.tokens = len(key[1])  # block_tokens, or fewer for a prompt's last (leaf) block
        self.nbytes = sum(t.numel() * t.element_size() for t in kv) + (
            0 if features is None else features.numel() * features.element_size())


class PrefixCache:
    """Blocks of prompt K/V keyed by token prefix, LRU under ``budget_bytes``.

    A block's key is (the uid of the block before it, its own tokens): uids are never reused, so a
    key stands for its whole prefix, exactly, and hashes in time independent of the prefix length.
    ``match`` finds how many leading tokens of a prompt are cached, ``load`` copies them into a
    KV-cache row, ``store`` keeps a row's prompt blocks. ``hits`` / ``lookups`` count prompt tokens
    served from the cache and prompt tokens looked up."""

    def __init__(self, budget_bytes: int, block_tokens: int = 16):
        if not is_int(budget_bytes) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0 (0: no prefix cache), got {budget_bytes!r}")
        if not is_int(block_tokens) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        self._blocks: OrderedDict = OrderedDict()  # key -> _Block, least recently used first
        self._next_uid = 1  # 0: the empty prefix
        self.nbytes = 0
        self.hits = self.lookups = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _cached_prefix(self, ids: list[int], upto: int) -> list[_Block]:
        """The cached full blocks that cover the longest prefix of ``ids[:upto]``."""
        found, uid, b = [], 0, self.block_tokens
        for s in range(0, upto - upto % b, b):
            block = self._blocks.get((uid, tuple(ids[s:s + b])))
            if block is None:
                break
            found.append(block)
            uid = block.uid
        return found

    def _leaf(self, ids: list[int], upto: int, chain: list[_Block]) -> _Block | None:
        """The longest cached partial block after ``chain`` that ``ids[:upto]`` continues with."""
        s = len(chain) * self.block_tokens
        uid = chain[-1].uid if chain else 0
        for n in range(min(self.block_tokens - 1, upto - s), 0, -1):
            block = self._blocks.get((uid, tuple(ids[s:s + n])))
            if block is not None:
                return block
        return None

    def match(self, ids: list[int], upto: int) -> list[_Block]:
        """The cached blocks that cover the longest prefix of ``ids[:upto]`` (full blocks, then
        perhaps a partial one), most recently used from now on."""
        found = self._cached_prefix(ids, upto)
        leaf = self._leaf(ids, upto, found)
        if leaf is not None:
            found.append(leaf)
        self._touch([block.key for block in found])
        self.lookups += upto
        self.hits += sum(block.tokens for block in found)
        return found

    def load(self, blocks: list[_Block], cache: KVCache) -> Tensor | None:
        """Copy ``blocks`` (consecutive, from token 0) into ``cache`` (one row); returns their
        features [tokens, F] when they were stored with features."""
        at = 0
        for block in blocks:
            for dst, src in zip(cache.tensors(), block.kv):
                dst[0, :, at:at + block.tokens].copy_(src)
            at += block.tokens
        if not blocks or blocks[0].features is None:
            return None
        return torch.cat([block.features for block in blocks])

    def store(self, ids: list[int], upto: int, cache: KVCache, features: Tensor | None = None) -> None:
        """Keep the blocks of ``ids[:upto]`` from ``cache`` (one row, holding their K/V) that are
        not cached yet, the last partial one included (``features`` [upto, F]: the drafter's
        features of those tokens, kept with them). Least recently used blocks go when the budget
        would be passed (never this prompt's own); a block larger than the whole budget is not
        kept."""
        b = self.block_tokens
        chain = self._cached_prefix(ids, upto)  # the blocks already cached are a prefix of the chain
        keys = [block.key for block in chain]
        self._touch(keys)  # (ahead of what this store evicts)
        own = set(keys)
        uid = chain[-1].uid if chain else 0
        for i in range(len(chain), -(-upto // b)):
            s, e = i * b, min(upto, (i + 1) * b)
            key = (uid, tuple(ids[s:e]))
            if key in self._blocks:  # the partial block, stored before
                keys.append(key)
                break
            kv = [t[0, :, s:e].clone() for t in cache.tensors()]
            f = None if features is None else features[s:e].clone()
            block = _Block(key, self._next_uid, kv, f)
            if block.nbytes > self.budget_bytes:
                break
            while self.nbytes + block.nbytes > self.budget_bytes:
                if next(iter(self._blocks)) in own:  # only this prompt's own blocks are left to evict
                    self._touch(keys)
                    return
                _, old = self._blocks.popitem(last=False)
                self.nbytes -= old.nbytes
            self._next_uid += 1
            self._blocks[key] = block
            self.nbytes += block.nbytes
            keys.append(key)
            own.add(key)
            uid = block.uid
        self._touch(keys)

    def _touch(self, keys: list) -> None:
        """Mark a chain's blocks used now, its deepest block least recently: eviction takes a
        chain's tail before its head (a block is only reachable through the blocks before it)."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0
