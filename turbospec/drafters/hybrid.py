"""A head's tree and an n-gram continuation, verified together in one pass.

Draft heads guess well where the text is new (chat, reasoning); prompt lookup guesses well where the
answer copies its input (RAG, summaries, code edits), and then for many tokens. ``HybridDrafter``
proposes both: the n-gram chain is merged into the head's tree as a trie (where the chain starts
with tokens the tree already holds, it continues from those nodes; the rest becomes a new branch),
so the target verifies every candidate in one pass and keeps whichever path it agrees with longest.

Greedy only: with sampling the head's children are drawn from q and a point-mass branch beside
them would need its own acceptance rule, so sampling steps draft with the head alone (exact either
way). The head gets the node budget left after the n-gram chain.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Draft, Drafter
from .ngram import NgramDrafter
from ..ops.sampling import SamplingParams
from ..ops.checks import is_int


def merge_chain(draft: Draft | None, chain: list[int], max_tokens: int) -> Draft | None:
    """``draft`` (a tree or chain, point-mass) with ``chain`` (tokens after the root) merged in as a
    trie, at most ``max_tokens`` nodes; nodes stay in topological order."""
    tokens = [] if draft is None else list(draft.token_ids)
    if draft is None:
        parents = []
    elif draft.parents is None:
        parents = list(range(len(tokens)))  # a chain: node i + 1's parent is node i
    else:
        parents = list(draft.parents)
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node (nodes numbered from 1)
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault((p, t), i + 1)
    node = 0
    for t in chain:
        nxt = children.get((node, t))
        if nxt is None:
            if len(tokens) >= max_tokens:
                break
            tokens.append(t)
            parents.append(node)
            nxt = len(tokens)
            children[(node, t)] = nxt
        node = nxt
    if not tokens:
        return None
    return Draft(token_ids=tokens, parents=parents)


class HybridDrafter(Drafter):
    """``head`` (an EAGLE or Medusa drafter) plus up to ``ngram_tokens`` prompt-lookup tokens."""

    def __init__(self, head: Drafter, ngram_tokens: int = 8, ngram: NgramDrafter | None = None):
        if not is_int(ngram_tokens) or not 1 <= ngram_tokens <= 62:
            raise ValueError(f"ngram_tokens must be an integer in [1, 62], got {ngram_tokens!r}")
        self.head, self.ngram_tokens = head, ngram_tokens
        self.ngram = ngram or NgramDrafter()
        self.name = f"{head.name}+ngram"
        self.features = head.features

    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        self.head.begin(prompt_ids, features=features)
        self.ngram.begin(prompt_ids)

    def prepare(self, tokens: list[int]) -> None:
        self.head.prepare(tokens)

    @property
    def windowed(self) -> bool:
        return self.head.windowed

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None) -> None:
        self.head.observe(tokens, num_accepted, features=features)
        self.ngram.observe(tokens, num_accepted)

    def propose_steps(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None):
        if not params.greedy or max_tokens < 2:
            return (yield from self.head.propose_steps(tokens, max_tokens, params, generator))
        found = self.ngram.propose(tokens, min(self.ngram_tokens, max_tokens - 1), params, generator)
        chain = [] if found is None else found.token_ids
        tree = yield from self.head.propose_steps(tokens, max_tokens - len(chain), params, generator)
        return merge_chain(tree, chain, max_tokens)
