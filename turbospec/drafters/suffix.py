"""Suffix decoding: draft trees from what came before, in this request and in earlier ones.

``SuffixCache`` holds token sequences — every request's prompt and output as it grows — and an
index from each n-gram (``min_ngram``..``max_ngram`` tokens) to where it occurred with a
continuation. It is shared by the drafters an engine builds, so a request drafts from its own
context and from every earlier request still in the cache (the same prompt asked again, an agent's
repeated tool output, the next turn of a chat, an edited file). Memory is bounded: past
``max_tokens`` the least recently used sequences are dropped (a sequence is used when a proposal
draws from it, or when it grows).

``SuffixDrafter.propose`` finds the longest n-gram ending the context that occurred before, takes
the continuations of its most recent occurrences (up to ``max_occurrences``, ``depth`` tokens
each), counts them into a trie, and proposes the trie's most likely nodes: a node's score is the
product of its conditional frequencies along the path (an estimate of the chance the target
reaches it), nodes scoring under ``min_prob`` are left out, and the tree grows with the match
length (up to ``nodes_per_match`` nodes per matched token, ``max_tokens`` at most), as in
SuffixDecoding (Oliaro et al., 2024): a long match is evidence for a deep, wide tree.

Drafts are point masses (no draft probabilities), verified like prompt lookup's: greedy output is
the plain output token for token, and sampling stays exact. With sampling, which tokens a seeded
request draws depends on the drafts, so on what the cache held when it ran (earlier requests, the
batch beside it); their distribution does not.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

import torch

from .base import Draft, Drafter
from ..ops.sampling import SamplingParams
from ..ops.checks import is_int


class SuffixCache:
    """Sequences and their n-gram index, shared by an engine's suffix drafters (one thread)."""

    # At most ~1.8 KB of index a token (measured on random tokens; text that repeats shares n-grams):
    # the default bound of 131,072 tokens is ~240 MB at worst. ``cache_tokens`` in ``tree=`` sets it.
    def __init__(self, max_tokens: int = 1 << 17, max_ngram: int = 8, min_ngram: int = 2):
        for name, v, lo in (("max_tokens", max_tokens, 1), ("min_ngram", min_ngram, 1), ("max_ngram", max_ngram, 1)):
            if not is_int(v) or v < lo:
                raise ValueError(f"suffix {name} must be an integer >= {lo}, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"suffix min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.max_tokens, self.max_ngram, self.min_ngram = max_tokens, max_ngram, min_ngram
        self.seqs: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self.indexed: dict[int, int] = {}   # sequence -> tokens whose n-grams are indexed
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> [(sequence, end)]
        self.tokens = 0                      # tokens held
        self.stale = 0                       # index entries of dropped sequences
        self._ids = itertools.count()

    def new_sequence(self, tokens: list[int]) -> int:
        sid = next(self._ids)
        self.seqs[sid] = []
        self.indexed[sid] = 0
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        """``tokens``: the sequence's whole content so far (it only grows); what is new is indexed."""
        seq = self.seqs.get(sid)
        if seq is None:  # dropped while its request was still running: start it again
            self.seqs[sid], self.indexed[sid] = [], 0
            seq = self.seqs[sid]
        if len(tokens) < len(seq) or tokens[:len(seq)] != seq:
            raise ValueError("SuffixCache.extend: a sequence only grows (its tokens so far must be kept)")
        if len(tokens) > len(seq):
            self.tokens += len(tokens) - len(seq)
            seq.extend(tokens[len(seq):])
        # an n-gram ending at e-1 is entered once it has a continuation (the token at e)
        for e in range(max(self.indexed[sid], 1), len(seq)):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                self.index.setdefault(tuple(seq[e - n:e]), []).append((sid, e))
        self.indexed[sid] = max(self.indexed[sid], len(seq))
        self.seqs.move_to_end(sid)
        self._evict(keep=sid)

    def _evict(self, keep: int) -> None:
        while self.tokens > self.max_tokens and len(self.seqs) > 1:
            sid, seq = next(iter(self.seqs.items()))
            if sid == keep:
                self.seqs.move_to_end(sid)
                continue
            del self.seqs[sid]
            n = self.indexed.pop(sid)
            self.tokens -= len(seq)
            self.stale += max(0, n - 1) * (self.max_ngram - self.min_ngram + 1)
        if self.stale > 4 * self.tokens + 1024:  # rebuild once dropped entries dominate the index
            self.index = {k: kept for k, v in self.index.items() if (kept := [p for p in v if p[0] in self.seqs])}
            self.stale = 0

    def continuations(self, context: list[int], depth: int, max_occurrences: int) -> tuple[int, list[list[int]]]:
        """(the longest n-gram ending ``context`` that occurred with a continuation, the
        continuations of its most recent occurrences, up to ``depth`` tokens each); (0, []) when none."""
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            occ = self.index.get(tuple(context[-n:]))
            if not occ:
                continue
            conts = []
            for sid, e in reversed(occ):
                seq = self.seqs.get(sid)
                if seq is None:
                    continue
                conts.append(seq[e:e + depth])
                self.seqs.move_to_end(sid)  # used
                if len(conts) >= max_occurrences:
                    break
            if conts:
                return n, conts
        return 0, []


class SuffixDrafter(Drafter):
    """Draft trees from a ``SuffixCache`` (shared: pass the engine's; alone: one of its own)."""

    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, depth: int = 16, max_occurrences: int = 64,
                 min_prob: float = 0.1, nodes_per_match: float = 4.0):
        if not is_int(depth) or depth < 1:
            raise ValueError(f"suffix depth must be an integer >= 1, got {depth!r}")
        if not is_int(max_occurrences) or max_occurrences < 1:
            raise ValueError(f"suffix max_occurrences must be an integer >= 1, got {max_occurrences!r}")
        if not 0 <= min_prob <= 1:
            raise ValueError(f"suffix min_prob must be in [0, 1], got {min_prob!r}")
        if not nodes_per_match > 0:
            raise ValueError(f"suffix nodes_per_match must be > 0, got {nodes_per_match!r}")
        self.cache = cache if cache is not None else SuffixCache()
        self.depth, self.max_occurrences = depth, max_occurrences
        self.min_prob, self.nodes_per_match = min_prob, nodes_per_match
        self.sid: int | None = None

    def begin(self, prompt_ids: list[int]) -> None:
        self.sid = self.cache.new_sequence(list(prompt_ids))

    def lookup(self, tokens: list[int]) -> tuple[int, list[list[int]]]:
        """Enters ``tokens`` (this request's sequence so far) into the cache and returns the longest
        match's length and its continuations (``SuffixCache.continuations``)."""
        if self.sid is None:
            self.sid = self.cache.new_sequence(list(tokens))
        else:
            self.cache.extend(self.sid, tokens)
        return self.cache.continuations(tokens, self.depth, self.max_occurrences)

    def propose(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        if max_tokens <= 0:
            return None
        match, conts = self.lookup(tokens)
        if not match:
            return None
        return build_tree(conts, min(max_tokens, max(1, round(self.nodes_per_match * match))), self.min_prob)


def build_tree(conts: list[list[int]], budget: int, min_prob: float) -> Draft | None:
    """The ``budget`` most likely nodes of the trie of ``conts`` (score: the product of conditional
    frequencies along the path; at least ``min_prob``), as a draft tree in topological order, each
    node's score in ``Draft.scores``."""
    # trie: node -> (count, {token: child}); node 0 is the root
    counts, children = [len(conts)], [{}]
    for c in conts:
        node = 0
        for t in c:
            nxt = children[node].get(t)
            if nxt is None:
                nxt = len(counts)
                children[node][t] = nxt
                counts.append(0)
                children.append({})
            counts[nxt] += 1
            node = nxt
    # best first: a child never scores above its parent, so the chosen set is ancestor-closed
    token_ids, parents, scores = [], [], []
    heap = [(-counts[ch] / counts[0], ch, t, 0) for t, ch in children[0].items()]
    heapq.heapify(heap)
    while heap and len(token_ids) < budget:
        neg, node, tok, parent = heapq.heappop(heap)
        score = -neg
        if score < min_prob:
            break
        token_ids.append(tok)
        parents.append(parent)
        scores.append(score)
        me = len(token_ids)  # this node's number in the draft (root 0)
        for t, ch in children[node].items():
            heapq.heappush(heap, (-score * counts[ch] / counts[node], ch, t, me))
    return Draft(token_ids=token_ids, parents=parents, scores=scores) if token_ids else None
