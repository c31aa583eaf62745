"""Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"), ``drafter="lookahead"``: Jacobi iteration fills an n-gram pool, and the pool's
n-grams that start with the root are verified, both in the one target pass of the step.

The lookahead branch is a window of ``window`` (W) *diagonals*. Diagonal q holds N - 1 guesses
(N = ``ngram``) for the positions q, q + 1, ..., q + N - 2 after the root (depth 0; diagonal 0's
first guess is the root itself). Its first guess is level 0 of the paper's 2-D window (the oldest
Jacobi iterate), its last level N - 2 (the newest). In the draft tree:

* the *trunk* is the chain of the level-0 guesses of diagonals 1, 2, ..., W - 1 after the root: the
  oldest Jacobi iterate, itself a draft chain verified like any other;
* from the trunk node of diagonal q (the root for q = 0) hangs the chain of its levels 1..N - 2.

So the context of every lookahead node is one path from the root: trunk tokens up to its diagonal,
then the diagonal's lower levels. That is the paper's lookahead attention (a token sees the oldest
level before its diagonal and the diagonal below it), and the existing tree mask with positions
``cache_len + depth`` gives it exactly. The target's greedy token at the last node of diagonal q
(``Drafter.wants_node_argmax``: the verify step returns the argmax of every node in its one host
read) predicts position q + N - 1: the diagonal with its prediction is an N-gram (key: its first
token), which goes into the pool, and the diagonal advances one Jacobi step: its oldest guess
drops out, the prediction comes in, and it now starts at position q + 1. Diagonals are kept by the
absolute position they start at, so after a step that kept more tokens the window realigns (the
diagonals the accepted tokens overtook are dropped; new ones at the far end start from the pool's
continuation of the trunk token before them, else from tokens of the context). Identical siblings
merge (the tree is a trie), which costs nothing: a merged node has one context.

The verification branch: the pool's most recent n-grams (up to ``guesses``, G) that start with the
root, each a path of N - 1 tokens after it, merged into the same trie. With
``pool_from_context`` (default) the pool also holds the N-grams of the prompt and of the output as
it is committed (as LADE's pool-from-prompt option does), so repeated text is proposed as prompt
lookup would.

The node budget (``max_tokens``) is shared: while the pool has candidates for the root, they are
kept up to half of it and the lookahead branch gets the rest (whole diagonals first, then a prefix
of the next one: fewer levels); the candidates then fill what the lookahead left, and the window
grows into what is still left. The lookahead branch shrinks, it never exceeds the budget. Defaults
are the paper's small settings: W = 5, N = 4, G = 5 (14 lookahead nodes + up to 15 verification
nodes, fewer after merging).

Drafts are point masses (no draft probabilities): verification is lossless whatever is proposed,
so the greedy output is plain decoding's token for token and sampling keeps the target's
distribution; the Jacobi step uses the target's argmax with sampling too. Drafts depend only on the
committed tokens and the target's argmaxes, never on the random stream, so a seeded request gives
the same tokens alone and batched.
"""
from __future__ import annotations

import random
from collections import OrderedDict

import torch

from .base import Draft, Drafter
from ..ops.sampling import SamplingParams
from ..ops.checks import is_int


def _check_int(name: str, value, lo: int, hi: int, what: str) -> None:
    if not is_int(value) or not lo <= value <= hi:
        raise ValueError(f"lookahead {name} ({what}) must be an integer in [{lo}, {hi}], got {value!r}")


class LookaheadDrafter(Drafter):
    """Lookahead decoding: see the module docstring. ``window`` W (Jacobi diagonals), ``ngram`` N
    (n-gram size: N - 1 guesses per diagonal, N - 1 tokens per pooled candidate), ``guesses`` G
    (pooled n-grams verified per step, and kept per first token), ``pool_from_context`` (also pool
    the n-grams of the prompt and the output)."""

    name = "lookahead"
    wants_node_argmax = True
    # Chosen on SmolLM2-135M-Instruct, fp32 greedy, 16 nodes, one Spec-Bench prompt per category x 64
    # tokens (2026-11-27): tau 1.45 realigned vs 1.40 with LADE's always-forward-one window; 1.45
    # with half the budget kept for candidates vs 1.41 / 1.40 with a quarter / three quarters;
    # 1.35 without the context's n-grams in the pool; W 7, N 3: 1.44; W 4, N 5, G 3: 1.39.
    _realign = True  # see observe
    _reserve = 0.5  # the share of the budget kept for the pool's candidates

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, pool_from_context: bool = True):
        _check_int("window", window, 1, 64, "W, the Jacobi window")
        _check_int("ngram", ngram, 2, 64, "N, the n-gram size")
        _check_int("guesses", guesses, 1, 64, "G, the n-grams verified per step")
        if not isinstance(pool_from_context, bool):
            raise ValueError(f"lookahead pool_from_context must be True or False, got {pool_from_context!r}")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.pool_from_context = pool_from_context
        self.begin([])

    def begin(self, prompt_ids: list[int]) -> None:
        # first token -> its continuations (tuples), least recently added first, at most G
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        # absolute position of a diagonal's first guess -> its guesses (up to N - 1)
        self.diags: dict[int, list[int]] = {}
        self._indexed = 0  # context n-grams starting before this position are pooled
        self._pending = None  # the last proposal's layout, until its observe
        self._rng = random.Random(0)  # fallback guesses: context tokens, the same for the same context
        # counters: n-grams the Jacobi iteration pooled, draft tokens accepted on pooled candidates
        self.jacobi_ngrams = self.pool_tokens_accepted = 0
        if prompt_ids:
            self._index_context(prompt_ids)

    # ------------------------------------------------------------------------------------------
    def _add(self, key: int, cont: tuple[int, ...]) -> None:
        d = self.pool.get(key)
        if d is None:
            d = self.pool[key] = OrderedDict()
        if cont in d:
            d.move_to_end(cont)
        else:
            d[cont] = None
            if len(d) > self.guesses:
                d.popitem(last=False)

    def _index_context(self, tokens: list[int]) -> None:
        if not self.pool_from_context:
            return
        n = self.ngram
        for i in range(self._indexed, len(tokens) - n + 1):
            self._add(tokens[i], tuple(tokens[i + 1:i + n]))
        self._indexed = max(self._indexed, len(tokens) - n + 1)

    def _latest(self, key: int) -> tuple[int, ...] | None:
        d = self.pool.get(key)
        return next(reversed(d)) if d else None

    def _fill(self, d: list[int], prev: int, tokens: list[int], want: int) -> list[int]:
        """``d`` completed to ``want`` guesses: each next one is the pool's latest continuation of the
        token before it (``prev`` before the first), else a token of the context."""
        while len(d) < want:
            last = d[-1] if d else prev
            cont = self._latest(last)
            if cont:
                d.extend(cont[: want - len(d)])
            else:
                d.append(tokens[self._rng.randrange(len(tokens))])
        return d[:want]

    # ------------------------------------------------------------------------------------------
    def propose(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        self._pending = None
        if max_tokens <= 0 or not tokens:
            return None
        self._index_context(tokens)
        r, root = len(tokens) - 1, tokens[-1]
        n1 = self.ngram - 1
        # the window: diagonal q starts at position r + q (diagonal 0's first guess is the root)
        diags, prev = [], root
        for q in range(self.window):
            d = list(self.diags.get(r + q, ()))
            if q == 0:
                d = [root] + self._fill(d[1:], root, tokens, n1 - 1)
            else:
                d = self._fill(d, prev, tokens, n1)
            diags.append(d)
            prev = d[0]
        # kept as they are unless this step advances them (observe)
        self.diags = {r + q: d for q, d in enumerate(diags)}

        token_ids: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}

        def add(parent: int, t: int, limit: int) -> int | None:
            node = child.get((parent, t))
            if node is None and len(token_ids) < limit:
                token_ids.append(t)
                parents.append(parent)
                node = child[(parent, t)] = len(token_ids)
            return node

        # the lookahead branch, element by element: diagonal 0's levels 1.., then for each next
        # diagonal its trunk node (after the previous diagonal's) and its levels
        nodes = [[0] + [None] * (n1 - 1)] + [[None] * n1 for _ in range(self.window - 1)]
        order = [(q, j) for q in range(self.window) for j in range(1 if q == 0 else 0, n1)]
        cursor = 0

        def grow(limit: int) -> int:
            c = cursor
            while c < len(order):
                q, j = order[c]
                parent = nodes[q - 1][0] if j == 0 else nodes[q][j - 1]
                node = add(parent, diags[q][j], limit)
                if node is None:
                    break
                nodes[q][j] = node
                c += 1
            return c

        budget = max_tokens
        cands = list(reversed(self.pool.get(root, {})))[: self.guesses]
        reserve = min(sum(map(len, cands)), int(budget * self._reserve)) if cands else 0
        cursor = grow(budget - reserve)
        cand_nodes: set[int] = set()
        for c in cands:  # the verification branch
            node = 0
            for t in c:
                node = add(node, t, budget)
                if node is None:
                    break
                cand_nodes.add(node)
        cursor = grow(budget)  # the window grows into what the candidates left

        # the diagonals this pass feeds: the elements with a node (diagonal 0 always: the root's
        # argmax continues its first f guesses)
        fed = []
        for q in range(self.window):
            f = next((j for j in range(n1) if nodes[q][j] is None), n1)
            if f == 0:
                break
            fed.append((r + q, diags[q], f, nodes[q][f - 1]))
        self._pending = (r, len(token_ids), fed, cand_nodes, child)
        if not token_ids:
            return None
        return Draft(token_ids=token_ids, parents=parents)

    def observe(self, tokens: list[int], num_accepted: int, node_argmax: list[int] | None = None) -> None:
        pending, self._pending = self._pending, None
        if pending is None or node_argmax is None:
            return
        r, k, fed, cand_nodes, child = pending
        if len(node_argmax) != k + 1 or len(tokens) != r + num_accepted + 2:
            return  # not this proposal's pass
        node = 0
        for t in tokens[r + 1: r + 1 + num_accepted]:  # the accepted path
            node = child.get((node, t))
            if node is None:
                return  # not this proposal's pass
            self.pool_tokens_accepted += node in cand_nodes
        # realigned: a diagonal keeps its absolute positions; else (LADE's ALWAYS_FWD_ONE) the window
        # stays where it was relative to the root, however many tokens were kept
        skip = 0 if self._realign else num_accepted
        if skip:
            self.diags = {p + skip: d for p, d in self.diags.items()}
        for start, d, f, last in fed:
            out = node_argmax[last]  # the target's token after the diagonal's first f guesses
            self._add(d[0], tuple(d[1:f]) + (out,))
            self.jacobi_ngrams += 1
            # one Jacobi step: the oldest guess drops out, the prediction replaces guess f
            self.diags[start + 1 + skip] = d[1:f] + [out] + d[f + 1:]
