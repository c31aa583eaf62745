"""A head's tree and an n-gram continuation, or a head's tree and suffix decoding's, verified
together in one pass.

Draft heads guess well where the text is new (chat, reasoning); prompt lookup guesses well where the
answer copies its input (RAG, summaries, code edits), and then for many tokens. ``HybridDrafter``
proposes both: the n-gram chain is merged into the head's tree as a trie (where the chain starts
with tokens the tree already holds, it continues from those nodes; the rest becomes a new branch),
so the target verifies every candidate in one pass and keeps whichever path it agrees with longest.

Greedy only: with sampling the head's children are drawn from q and a point-mass branch beside
them would need its own acceptance rule, so sampling steps draft with the head alone (exact either
way). The head gets the node budget left after the n-gram chain.

``HeadSuffixDrafter`` (``drafter="hybrid"``) does the same with suffix decoding's tree (this request
and earlier ones), sharing the node budget by confidence: the head's path probabilities against the
suffix tree's path frequencies, calibrated by how often suffix drafts were right (see its docstring).
It drafts under sampling too (point masses where the suffix tree takes part).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Draft, Drafter
from .eagle import EagleDrafter
from .ngram import NgramDrafter
from .suffix import SuffixDrafter, build_tree
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


class _HeadBacked(Drafter):
    """A drafter built around ``self.head``: the prompt read and the window are the head's."""
    head: Drafter

    def prepare(self, tokens: list[int]) -> None:
        self.head.prepare(tokens)

    @property
    def windowed(self) -> bool:
        return self.head.windowed


class HybridDrafter(_HeadBacked):
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


# ---------------------------------------------------------------------------------------------
# Head + suffix decoding in one tree, the node budget shared by confidence

def merge_scored(drafts: list[Draft | None], max_tokens: int) -> Draft | None:
    """The union of ``drafts`` (point-mass trees or chains with ``scores``) as one trie cut to its
    ``max_tokens`` best nodes. A path both drafts hold is one node (shared prefixes are not drafted
    twice); its score combines theirs as independent evidence, 1 − Π(1 − score). Each draft's scores
    never rise along a path, so neither do the combined ones and the best nodes are ancestor-closed
    (ties go to the shallower node). Nodes come out by depth, siblings best first (the verify step's
    likeliest path is each node's first child), with their combined scores."""
    tokens: list[int] = []
    parent_of: list[int] = []      # trie node (1-based) -> parent trie node
    miss: list[float] = []         # trie node -> product of (1 - score) over the drafts holding it
    depth: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for d in drafts:
        if d is None or not len(d):
            continue
        if d.scores is None or len(d.scores) != len(d):
            raise ValueError("merge_scored: every draft needs one score per node (Draft.scores)")
        if d.draft_probs is not None:
            raise ValueError("merge_scored: drafts must be point masses (draft_probs None)")
        parents = d.parents if d.parents is not None else list(range(len(d)))
        where = [0]  # draft node -> trie node
        for t, p, sc in zip(d.token_ids, parents, d.scores):
            at = where[p]
            node = children.get((at, t))
            if node is None:
                tokens.append(t)
                parent_of.append(at)
                miss.append(1.0)
                depth.append(1 if at == 0 else depth[at - 1] + 1)
                node = len(tokens)
                children[(at, t)] = node
            miss[node - 1] *= 1.0 - min(max(float(sc), 0.0), 1.0)
            where.append(node)
    if not tokens:
        return None
    score = [0.0] * len(tokens)
    for i in range(len(tokens)):  # parents come first in the trie; clamp to the parent (rounding)
        s = 1.0 - miss[i]
        score[i] = s if parent_of[i] == 0 else min(s, score[parent_of[i] - 1])
    keep = sorted(range(len(tokens)), key=lambda i: (-score[i], depth[i], i))[:max_tokens]
    keep.sort(key=lambda i: (depth[i], -score[i], i))
    pos = {i + 1: j + 1 for j, i in enumerate(keep)}  # trie node -> draft node
    return Draft(token_ids=[tokens[i] for i in keep], parents=[pos.get(parent_of[i], 0) for i in keep],
                 scores=[score[i] for i in keep])


class Calibration:
    """How far a drafter's own probabilities are to be trusted, measured: for each key (a source and
    a depth or match length), hits / predicted over the draft nodes whose parent the target reached,
    where predicted is the node's conditional probability under its drafter (its score over its
    parent's) and a hit is the target emitting its token there. A node's calibrated conditional
    probability is min(1, ratio × its own). Starts from ``prior`` (pseudo-counts worth 2 nodes).
    Shared by an engine's hybrid drafters (one thread), so it is learnt across requests."""

    def __init__(self, prior: dict | None = None):
        self.prior = dict(prior or {})
        self.stats: dict = {}  # key -> [hits, predicted]

    def ratio(self, key) -> float:
        h, p = self.stats.get(key, (0.0, 0.0))
        r0 = self.prior.get(key[0], 1.0)
        return (h + 2.0 * r0) / (p + 2.0)

    def record(self, draft: Draft, keys: list, emitted: list[int]) -> None:
        """``draft`` (scores: its drafter's path probabilities), ``keys`` (one per node), ``emitted``:
        what the target kept after the root (accepted drafts + its own token)."""
        parents = draft.parents if draft.parents is not None else list(range(len(draft)))
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i + 1)
        node = 0
        for t in emitted:
            nxt = None
            for c in kids.get(node, ()):
                parent_score = 1.0 if node == 0 else draft.scores[node - 1]
                cond = draft.scores[c - 1] / parent_score if parent_score > 0 else 0.0
                st = self.stats.setdefault(keys[c - 1], [0.0, 0.0])
                st[1] += min(cond, 1.0)
                if draft.token_ids[c - 1] == t:
                    st[0] += 1.0
                    nxt = c
            if nxt is None:
                break
            node = nxt

    def apply(self, draft: Draft, keys: list) -> Draft:
        """``draft`` with its scores calibrated (a new Draft; the scores stay non-increasing)."""
        parents = draft.parents if draft.parents is not None else list(range(len(draft)))
        out: list[float] = []
        for i, (p, s) in enumerate(zip(parents, draft.scores)):
            parent_raw = 1.0 if p == 0 else draft.scores[p - 1]
            cond = s / parent_raw if parent_raw > 0 else 0.0
            out.append((1.0 if p == 0 else out[p - 1]) * min(1.0, self.ratio(keys[i]) * cond))
        return Draft(token_ids=draft.token_ids, parents=draft.parents, draft_probs=draft.draft_probs, scores=out)


def node_depths(draft: Draft) -> list[int]:
    parents = draft.parents if draft.parents is not None else list(range(len(draft)))
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth[1:]


MATCH_BUCKETS = (2, 3, 4, 6, 8)  # suffix matches are calibrated by length: from each bucket's start


def match_bucket(match: int) -> int:
    return max(0, sum(1 for b in MATCH_BUCKETS if match >= b) - 1)


class HeadSuffixDrafter(_HeadBacked):
    """An EAGLE head's tree and suffix decoding's tree, merged into one draft tree of at most
    ``max_tokens`` nodes (``drafter="hybrid"``).

    Both propose for the whole budget; ``merge_scored`` keeps the likeliest nodes of their union. A
    head node scores its path probability under the head (EAGLE-2's own ranking), a suffix node the
    frequency of its path among the match's continuations (``build_tree``); each conditional step is
    scaled by how often that source's drafts were right at that depth (head) or match length
    (suffix), measured (``Calibration``). So a long match in a repeated text fills the tree with the
    remembered continuation, and a short, unreliable one only adds a few nodes beside the head's.

    Sampling: when the suffix cache has a match, the head drafts its greedy top-k tree
    (``point_mass``) and the merged tree is verified as point masses (exact: the drafts depend on the
    context only, never on the target's coins); without a match the head drafts alone, drawing its
    children from q as usual. ``suffix`` is a ``SuffixDrafter`` (its cache shared by the engine).

    ``calibration`` (shared by an engine's hybrid drafters): how far each source's probabilities are
    trusted, measured as the target accepts or rejects their nodes (``Calibration``); suffix trees'
    frequencies start at half trust (a continuation seen once scores 1 by frequency), the head's at
    full.

    ``skip_head_at``: when the suffix tree's likeliest path is at least half the budget deep and
    each of its steps is calibrated at least this likely (a long, reliable match: a repeated
    request, a copied passage), the head does not draft that step: its rounds cost more than the
    suffix tree's lookup, and its nodes would only displace the remembered continuation's deepest
    ones. It reads the committed features at its next proposal. None: the head always drafts.
    Default 0.9 (bench/results/2026-11-28-hybrid-skip.md): on the repeated Spec-Bench round τ 12.34
    vs 12.42 and 1.14x the tok/s (327-329 vs 284-290, 2 threads, two runs each); on the first pass
    τ equal, tok/s within the runs' noise (50.4-50.5 vs 50.1-52.2); chats and code edits τ equal."""

    PRIOR = {"head": 1.0, "suffix": 0.5}
    SKIP_HEAD_AT = 0.9  # repeated Spec-Bench: 1.14x the tok/s for 0.6 % of tau; elsewhere equal

    @staticmethod
    def check_skip_head_at(skip_head_at) -> None:
        if skip_head_at is not None and (isinstance(skip_head_at, bool) or not isinstance(skip_head_at, (int, float))
                                         or not 0.0 < skip_head_at <= 1.0):
            raise ValueError(f"skip_head_at must be None or a number in (0, 1], got {skip_head_at!r}")

    def __init__(self, head: Drafter, suffix: SuffixDrafter, calibration: Calibration | None = None,
                 skip_head_at: float | None = SKIP_HEAD_AT):
        if not isinstance(head, EagleDrafter):
            raise ValueError(f"drafter='hybrid' needs an EAGLE / EAGLE-3 head drafter, got {type(head).__name__}")
        if not isinstance(suffix, SuffixDrafter):
            raise ValueError(f"HeadSuffixDrafter: suffix must be a SuffixDrafter, got {type(suffix).__name__}")
        self.check_skip_head_at(skip_head_at)
        self.head, self.suffix, self.skip_head_at = head, suffix, skip_head_at
        self.head_skipped = 0  # proposals drafted by the suffix tree alone
        self.calibration = calibration if calibration is not None else Calibration(self.PRIOR)
        self.name = f"{head.name}+suffix"
        self.features = head.features
        self._last: list[tuple[Draft, list]] = []  # the last proposal's (tree, calibration keys) per source

    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        self.head.begin(prompt_ids, features=features)
        self.suffix.begin(prompt_ids)
        self._last = []

    def _suffix_is_sure(self, tree: Draft, keys: list, max_tokens: int) -> bool:
        """Is the suffix tree's likeliest path at least half the budget deep, with every step on it
        calibrated at least ``skip_head_at`` likely? (Each step's own probability, not the path's:
        a remembered continuation is accepted or rejected as a whole far more than independent
        steps would be.)"""
        if len(tree) < max(1, max_tokens // 2):
            return False
        parents = tree.parents if tree.parents is not None else list(range(len(tree)))
        best: dict[int, int] = {}  # node -> its likeliest child (ties: the first)
        for i, p in enumerate(parents):
            if p not in best or tree.scores[i] > tree.scores[best[p] - 1]:
                best[p] = i + 1
        node, depth = 0, 0
        while node in best:
            child = best[node]
            parent_score = 1.0 if node == 0 else tree.scores[node - 1]
            cond = tree.scores[child - 1] / parent_score if parent_score > 0 else 0.0
            if min(1.0, self.calibration.ratio(keys[child - 1]) * cond) < self.skip_head_at:
                return False
            node, depth = child, depth + 1
        return depth >= max(1, max_tokens // 2)

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None) -> None:
        self.head.observe(tokens, num_accepted, features=features)
        emitted = tokens[len(tokens) - num_accepted - 1:]
        for tree, keys in self._last:
            self.calibration.record(tree, keys, emitted)
        self._last = []

    def propose_steps(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None):
        self._last = []
        if max_tokens <= 0:
            return (yield from self.head.propose_steps(tokens, max_tokens, params, generator))
        match, conts = self.suffix.lookup(tokens)
        tree = build_tree(conts, max_tokens, self.suffix.min_prob) if match else None
        if tree is None:  # nothing remembered: the head alone (its own sampling, q kept)
            return (yield from self.head.propose_steps(tokens, max_tokens, params, generator))
        suffix_keys = [("suffix", match_bucket(match))] * len(tree)
        if self.skip_head_at is not None and self._suffix_is_sure(tree, suffix_keys, max_tokens):
            self.head_skipped += 1
            self._last.append((tree, suffix_keys))
            return merge_scored([self.calibration.apply(tree, suffix_keys)], max_tokens)
        head = yield from self.head.propose_steps(tokens, max_tokens, params, generator, point_mass=True)
        drafts = []
        for d, keys in ((head, None), (tree, suffix_keys)):
            if d is None:
                continue
            keys = keys or [("head", min(x, 8)) for x in node_depths(d)]
            self._last.append((d, keys))
            drafts.append(self.calibration.apply(d, keys))
        return merge_scored(drafts, max_tokens)
