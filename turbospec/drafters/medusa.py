"""Medusa draft heads.

K heads read the target's final-normed hidden state f_i at the last committed position i (the one
whose logits gave the root x_{i+1}); head k (0-based) predicts x_{i+2+k}, the token k+1 places after
the root. Each head is ``medusa_num_layers`` residual blocks x + SiLU(W x + b) followed by the
target's LM head (shared; a Medusa checkpoint with its own per-head LM heads keeps them in
``lm_heads``). The candidates form a static tree given as Medusa "choices" (paths of top-k ranks,
e.g. [[0], [0, 0], [1], [0, 1]]): node [a, b] is the a-th candidate of head 0 followed by the b-th
candidate of head 1.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Draft, Drafter
from ..ops.lockstep import Rows
from ..heads.config import check_head_compatible
from ..heads.medusa import MedusaHeads
from ..ops.limits import MAX_TREE_NODES
from ..ops.sampling import SamplingParams
from .tree import DraftLMHead, Node, choose_children, head_activations, head_weights, inference_copy, to_draft


def default_choices(num_heads: int, num_nodes: int, head_accuracy: list[list[float]] | None = None
                    ) -> list[list[int]]:
    """A static tree of ``num_nodes`` nodes that maximises the expected accepted length when the
    rank-r candidate of head k is right with probability ``head_accuracy[k][r]`` (independently):
    a node's value is the product along its path; the best nodes form a tree because extending a
    path never raises its value. Without measured accuracies a geometric guess is used."""
    ranks = 8
    if head_accuracy is None:
        head_accuracy = [[0.55 * 0.75 ** k * 0.45 ** r for r in range(ranks)] for k in range(num_heads)]
    chosen: list[tuple[tuple[int, ...], float]] = []
    frontier = {(): 1.0}
    while len(chosen) < num_nodes:
        best = None
        for path, val in frontier.items():
            k = len(path)
            if k >= num_heads:
                continue
            used = {c[0][-1] for c in chosen if len(c[0]) == k + 1 and c[0][:-1] == path}
            r = len(used)  # ranks are added in order: a node's siblings form a prefix of ranks
            if r >= len(head_accuracy[k]):
                continue
            v = val * head_accuracy[k][r]
            if best is None or v > best[1]:
                best = (path + (r,), v)
        if best is None:
            break
        chosen.append(best)
        frontier[best[0]] = best[1]
    return [list(p) for p, _ in chosen]


# ---------------------------------------------------------------------------------------------
class MedusaDrafter(Drafter):
    """A static Medusa tree: ``choices`` (or ``default_choices`` from the heads' measured accuracy
    when a trained checkpoint carries it) truncated to the step's budget. Greedy: node [.., r] at
    depth d is the rank-r token of head d-1; sampling: the siblings of a node are the first draws,
    without replacement, from head d-1's distribution (shared by all nodes of that depth; each node
    is tested against it at most once per path), with that distribution kept for exact acceptance.

    ``share``: another MedusaDrafter over the same heads and options (a batch's other slots) whose
    prepared heads and LM heads this one uses too: one copy, and in a batch one call of each per
    step for every request (``propose_steps``)."""

    name = "medusa"
    features = "final"

    def __init__(self, target, heads: MedusaHeads, choices: list[list[int]] | None = None,
                 num_nodes: int = 32, draft_vocab: Tensor | None = None,
                 draft_dtype: torch.dtype | None = None, share: "MedusaDrafter | None" = None,
                 draft_weights: str | None = None, draft_activations: str | None = None):
        check_head_compatible(heads, target.cfg)
        dtype = draft_dtype or torch.float32
        self.target, self.dtype = target, dtype
        self.weights = head_weights(draft_weights, target.device)  # how the heads' linears are stored for drafting
        self.activations = head_activations(draft_activations, self.weights)  # ... and what they compute with
        k = heads.cfg.medusa_num_heads
        if choices is None:
            acc = getattr(heads, "extra", {}).get("head_accuracy")
            choices = default_choices(k, num_nodes, acc)
        self.choices = _check_choices(choices, k)
        if share is not None:
            if share.target is not target or share.dtype != dtype or share.heads.cfg != heads.cfg \
                    or share.weights != self.weights or share.activations != self.activations:
                raise ValueError("MedusaDrafter: share= must be a drafter of the same target, heads, draft_dtype, "
                                 "draft_weights and draft_activations")
            self.heads, self.lms, self.head_rows = share.heads, share.lms, share.head_rows
        else:
            # the heads draft where the target runs; their LM heads (if any) are the DraftLMHeads below
            self.heads = inference_copy(heads, dtype, target.device, self.weights,
                                        strict=draft_weights not in (None, "auto"), skip=("lm_heads",),
                                        activations=self.activations)
            draft_vocab = None if draft_vocab is None else draft_vocab.to(target.device)
            if heads.lm_heads is not None:
                self.lms = [DraftLMHead(lm.weight.detach().to(target.device), draft_vocab, dtype, self.weights,
                                        self.activations) for lm in heads.lm_heads]
            else:
                shared = DraftLMHead(target.lm_head_weight, draft_vocab, dtype, self.weights, self.activations)
                self.lms = [shared] * k
            blocks = self.heads
            #: features [n, H] -> the K heads' outputs [n, K, H] (one object for the sharing drafters)
            self.head_rows = lambda f: blocks(f).transpose(0, 1)
        self._f: Tensor | None = None

    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        self._f = None if features is None or features.shape[0] == 0 else features[-1]

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None) -> None:
        self._f = None if features is None else features[-1]

    def propose_steps(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None):
        f, self._f = self._f, None
        if f is None or max_tokens <= 0:
            return None
        choices = self.choices[:max_tokens]
        depth = max(len(c) for c in choices)
        ranks = [0] * depth
        for c in choices:
            ranks[len(c) - 1] = max(ranks[len(c) - 1], c[-1] + 1)
        out = (yield Rows(self.head_rows, f.to(self.dtype)[None]))[0]  # [K, H]
        if all(lm is self.lms[0] for lm in self.lms[:depth]):  # one LM head: all depths in one call
            logits = yield Rows(self.lms[0], out[:depth])
        else:
            logits = []
            for d in range(depth):
                logits.append((yield Rows(self.lms[d], out[d:d + 1]))[0])
        cand, qs = [], []
        for d in range(depth):
            idx, _, q = choose_children(logits[d], ranks[d], params, generator)
            cand.append(self.lms[d].to_target(idx).tolist())
            qs.append(q)
        index = {(): -1}
        nodes: list[Node] = []
        for c in choices:
            parent = index.get(tuple(c[:-1]))
            if parent is None:
                continue  # its parent was dropped (below)
            # sampling: the r-th listed sibling takes the r-th draw (draws are an ordered sample)
            r = c[-1] if params.greedy else sum(1 for n in nodes if n.parent == parent and n.depth == len(c))
            if r >= len(cand[len(c) - 1]):
                continue  # fewer tokens with q > 0 than the tree asks for: drop this node
            nodes.append(Node(token=cand[len(c) - 1][r], parent=parent, score=0.0, depth=len(c),
                              q=qs[len(c)] if len(c) < depth else None))
            index[tuple(c)] = len(nodes) - 1
            if parent >= 0:
                nodes[parent].children.append(len(nodes) - 1)
        if not nodes:
            return None
        return to_draft(nodes, list(range(len(nodes))), qs[0], self.lms[0].ids, self.target.cfg.vocab_size)


def _check_choices(choices, num_heads: int) -> list[list[int]]:
    """Medusa choices, validated and sorted parents-first (by length, then ranks)."""
    out = []
    for c in choices:
        if not isinstance(c, (list, tuple)) or not c or any(not isinstance(r, int) or r < 0 for r in c):
            raise ValueError(f"medusa choices: each entry must be a non-empty list of ranks >= 0, got {c!r}")
        if len(c) > num_heads:
            raise ValueError(f"medusa choices: path {list(c)} is deeper than the {num_heads} heads")
        out.append(list(c))
    out.sort(key=lambda c: (len(c), c))
    have = {tuple(c) for c in out}
    for c in out:
        if len(c) > 1 and tuple(c[:-1]) not in have:
            raise ValueError(f"medusa choices: path {c} has no parent {c[:-1]} in the tree")
    if len(out) > MAX_TREE_NODES - 1:
        raise ValueError(f"medusa choices: {len(out)} nodes; at most {MAX_TREE_NODES - 1} ({MAX_TREE_NODES} with the root)")
    return out
