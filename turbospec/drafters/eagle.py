"""EAGLE-2 dynamic-tree drafting with an EAGLE-1/2 or EAGLE-3 head (the head modules and how they
read target features: ``heads.eagle``). The head keeps its own KV cache of committed pairs and
grows each step's tree after them; see ``EagleDrafter``.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from .budget import DepthBudget
from .base import Draft, Drafter
from ..ops.checks import is_int
from ..ops.lockstep import Rows
from ..heads.config import check_head_compatible
from ..heads.eagle import EagleHead
from ..heads.layers import head_cache
from ..ops.limits import MAX_TREE_NODES
from ..ops.sampling import SamplingParams

GREEDY = SamplingParams(0.0, 0, 1.0)
from .tree import DraftLMHead, Node, ancestor_closed_top, choose_children, greedy_children, head_activations, \
    head_weights, inference_copy, to_draft


TOP_K_MIN, TOP_K_MAX = 2, 8


def budget_top_k(max_tokens: int) -> int:
    """Children per expanded node when ``top_k`` is None: half the step's node budget, within
    [TOP_K_MIN, TOP_K_MAX]. A wider tree gives the re-ranking more candidates to choose its
    ``max_tokens`` from (the shipped SmolLM2 head, Spec-Bench sample, 16 nodes, depth 6: τ 1.85 with
    top_k 4, 1.90 with 8; bench/results/2026-11-29-tree-top-k.md)."""
    return max(TOP_K_MIN, min(TOP_K_MAX, max_tokens // 2))


class EagleDrafter(Drafter):
    """EAGLE-2 dynamic-tree drafting with an EAGLE-1/2 or EAGLE-3 head.

    The head keeps its own KV cache: slots [0, _fill) hold the pairs of committed tokens (of
    positions up to _cached), computed from the target's true features; a proposal first feeds the
    pairs the last verify step committed, then grows the tree in the slots after them (overwritten
    next step: that is the rollback). A proposal after steps without one that committed about a
    token each (the draft budget had speculation off; not a hybrid's suffix-only steps, which
    commit many) feeds only the last CATCH_UP_WINDOW of the pairs queued since: the head's
    attention then skips the positions between (the features carry their context), and a probe
    costs a window's head forward, not one of every token committed while off (~0.11 ms a token
    on an AVX2 Zen 3: a probe after 200 plain steps cost ~20 ms, more than a plain step's 7-9 ms).
    Drafts are proposals, so the output is unchanged; a head drafting every step sees every pair.

    Each round expands the ``top_k`` best nodes by cumulative draft log-probability, ``top_k``
    children each, for up to ``depth`` rounds; greedy then keeps the best ``max_tokens`` nodes
    (EAGLE-2's re-ranking), sampling keeps every drawn child (see tree_draft). ``top_k=None`` (the
    default) follows each step's node budget (``budget_top_k``).

    ``share``: another EagleDrafter over the same head and options (a batch's other slots) whose
    prepared head copy and LM head this one uses too: one copy of the weights, and in a batch one
    call per round of each row-wise part (the head's projections and MLP, the LM head) for every
    request (``propose_steps``). Each drafter keeps its own KV cache and runs its own attention.
    """

    name = "eagle"
    CATCH_UP_WINDOW = 32  # pairs fed at most by a proposal after steps without one

    def __init__(self, target, head: EagleHead, max_seq_len: int, depth: int = 6, top_k: int | None = None,
                 draft_vocab: Tensor | None = None, draft_dtype: torch.dtype | None = None,
                 adaptive_depth: bool = True, share: "EagleDrafter | None" = None,
                 draft_weights: str | None = None, draft_activations: str | None = None):
        check_head_compatible(head, target.cfg)
        if not is_int(depth) or depth < 1 or not (top_k is None or (is_int(top_k) and top_k >= 1)):
            raise ValueError(f"EagleDrafter: depth must be an integer >= 1 and top_k an integer >= 1 or None (half "
                             f"the node budget, {TOP_K_MIN}-{TOP_K_MAX}), got depth={depth!r}, top_k={top_k!r}")
        self.target, self.depth, self.top_k = target, depth, top_k
        dtype = draft_dtype or torch.float32
        dev = self.device = target.device  # the head drafts where the target runs
        self.dtype = dtype
        self.weights = head_weights(draft_weights, dev)  # how the head's linears are stored for drafting
        self.activations = head_activations(draft_activations, self.weights)  # ... and what they compute with
        self.features = head.feature_spec
        # committed pairs + the tree grown after them (up to two trees' worth of nodes ahead)
        self.kv = head_cache(head.cfg, max_seq_len + 2 * MAX_TREE_NODES, dtype=dtype, device=dev)
        # self.logits: rows [n, H] of head outputs -> draft logits [n, draft vocab] (float32), one
        # object for all the drafters that share the head, so that a batch's requests go in one call
        if share is not None:
            if share.target is not target or share.dtype != dtype or share.head.cfg != head.cfg \
                    or share.weights != self.weights or share.activations != self.activations:
                raise ValueError("EagleDrafter: share= must be a drafter of the same target, head, draft_dtype, "
                                 "draft_weights and draft_activations")
            self.head, self.lm, self.vocab_ids, self.logits = share.head, share.lm, share.vocab_ids, share.logits
        else:
            self.head = inference_copy(head, dtype, dev, self.weights, strict=draft_weights not in (None, "auto"),
                                       activations=self.activations)
            self.head.bind_row_kernels()  # (CPU, float32: each row-wise part one turbospec op)
            if head.eagle3:
                self.lm = None
                self.vocab_ids = self.head.draft_vocab_ids()
                lm_head = self.head.logits
                self.logits = lambda out: lm_head(out).float()
            else:
                draft_vocab = None if draft_vocab is None else draft_vocab.to(dev)
                self.lm = DraftLMHead(target.lm_head_weight, draft_vocab, dtype, self.weights, self.activations)
                self.vocab_ids = draft_vocab
                self.logits = self.lm
        self._cached = 0  # committed positions [0, _cached) were fed to the head (or skipped)
        self._fill = 0  # KV slots holding them
        self._prompt_queued = 0  # pairs of the prompt queued at ``begin``, not fed yet
        self._feats: list[Tensor] = []  # features of the positions not fed to the head yet, in chunks
        # greedy steps: the number of expansion rounds from measured acceptance by depth and timings
        self.depth_budget = DepthBudget(depth) if adaptive_depth else None
        self._pending: tuple[int, float | None] | None = None  # (depth drafted, seconds per round)
        self._t_end: float | None = None   # when the last proposal returned
        self._steps_since = 0              # steps observed since then

    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        self._cached = self._fill = self._steps_since = 0
        self._t_end = None
        self._feats = [] if features is None else [features]
        self._prompt_queued = 0 if features is None else features.shape[0]

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None) -> None:
        # Steps without a proposal (the budget chose plain decoding) still commit tokens: their
        # features queue up until the next proposal feeds them all (kept as a list and joined once
        # then: joining at every step copied the whole queue each time, ~0.9 ms a step after a few
        # hundred tokens of a SmolLM2 prompt; the step's rows are already a copy, TargetStep.step).
        if features is not None and features.shape[0]:
            self._feats.append(features)
        self._steps_since += 1
        if self._pending is not None and self.depth_budget is not None:
            depth_used, t_round = self._pending
            self.depth_budget.record(depth_used, num_accepted, t_round, None)
        self._pending = None

    def _token(self, idx: Tensor) -> Tensor:
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def propose_steps(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None, point_mass: bool = False):
        """The EAGLE-2 tree (see the class). ``point_mass``: grow the greedy tree (top-k children,
        re-ranked to ``max_tokens``, no draft probabilities) even when ``params`` sample, and without
        the timed depth budget, so that the tree depends on the context only (a hybrid verifies it as
        point masses beside other point-mass drafts: exact under sampling too). Greedy and
        ``point_mass`` drafts carry ``Draft.scores`` (the head's path probabilities)."""
        t_start = time.perf_counter()
        if self.depth_budget is not None and self._t_end is not None and self._steps_since == 1:
            self.depth_budget.record(0, 0, None, t_start - self._t_end)  # one step's verify + the rest
        # steps without a proposal since the last one (or the start) that committed ~1 token each:
        # speculation was off (a hybrid whose suffix tree drafted alone commits many a step: all fed)
        idle_steps = self._steps_since - 1
        self._steps_since = 0
        self._t_end = None
        root_pos = len(tokens) - 1
        m = root_pos - self._cached
        feats = None if not self._feats else self._feats[0] if len(self._feats) == 1 else torch.cat(self._feats)
        self._feats = []
        if m <= 0 or feats is None or feats.shape[0] != m:
            raise RuntimeError(f"EagleDrafter: expected features for {m} new positions, got "
                               f"{None if feats is None else tuple(feats.shape)}")
        dev = self.device
        committed, self._prompt_queued = m - self._prompt_queued, 0  # pairs of the steps since (the prompt's aside)
        skip = m - self.CATCH_UP_WINDOW if m > self.CATCH_UP_WINDOW and 0 < committed <= 2 * idle_steps + 1 else 0
        first = self._cached + skip
        emb = self.target.embedding(torch.tensor(tokens[first + 1: root_pos + 1], device=dev)).to(self.dtype)[None]
        pos = torch.arange(first, root_pos, device=dev)[None]
        out = yield from self.head.forward_steps(feats[skip:].to(self.dtype)[None], emb, pos, self.kv, self._fill)
        self._cached, self._fill = root_pos, self._fill + m - skip
        if max_tokens <= 0:
            return None
        vocab = self.target.cfg.vocab_size
        # Tree growth. Fed nodes get KV slots after the committed pairs.
        nodes: list[Node] = []
        slot_of: dict[int, int] = {}          # node -> KV slot (relative to _fill)
        hidden: dict[int, Tensor] = {-1: out[0, -1]}
        frontier_logits = yield Rows(self.logits, out[0, -1:])  # [len(frontier), draft vocab]
        frontier = [-1]
        root_q = None
        k = self.top_k or budget_top_k(max_tokens)
        greedy = params.greedy or point_mass
        tree_params = GREEDY if point_mass else params
        depth = min(self.depth, max_tokens)
        if params.greedy and self.depth_budget is not None:
            depth = self.depth_budget.choose(depth)
        rounds, t_rounds = 0, 0.0
        for d in range(1, depth + 1):
            new = []
            if greedy:  # every frontier node's top_k children in one call
                idx, val = greedy_children(frontier_logits, k)
                toks_all, lqs_all = self._token(idx).tolist(), val.tolist()
            for j, f in enumerate(frontier):
                # Sampling keeps every drawn child, so a group's size is fixed before it is drawn:
                # top_k, or what is left of the budget. Greedy draws top_k and re-ranks at the end.
                if greedy:
                    toks, lqs = toks_all[j], lqs_all[j]
                else:
                    kk = min(k, max_tokens - len(nodes))
                    if kk <= 0:
                        break
                    idx, lq, q = choose_children(frontier_logits[j], kk, tree_params, generator)
                    if f < 0:
                        root_q = q
                    else:
                        nodes[f].q = q
                    toks, lqs = self._token(idx).tolist(), lq.tolist()
                base = 0.0 if f < 0 else nodes[f].score
                for t, l in zip(toks, lqs):
                    nodes.append(Node(token=t, parent=f, score=base + l, depth=d))
                    if f >= 0:
                        nodes[f].children.append(len(nodes) - 1)
                    new.append(len(nodes) - 1)
            if d == depth or (not greedy and len(nodes) >= max_tokens) or not new:
                break
            t_round = time.perf_counter()
            # expand the best top_k of this round's children
            expand = sorted(new, key=lambda i: (-nodes[i].score, i))[:k]
            expand.sort()
            n_new = len(expand)
            start = len(slot_of)
            for j, i in enumerate(expand):
                slot_of[i] = start + j
            # each expanded node attends the committed pairs, its ancestors' slots and its own (built as
            # lists: a tensor store per ancestor cost ~5 us each, a quarter of a round's Python)
            rows = []
            for i in expand:
                row = [False] * (start + n_new)
                a = i
                while a >= 0:
                    row[slot_of[a]] = True
                    a = nodes[a].parent
                rows.append(row)
            mask = torch.tensor(rows, dtype=torch.bool)  # over the tree's slots; the committed pairs before: all
            h_in = torch.stack([hidden[nodes[i].parent] for i in expand])[None]
            e_in = self.target.embedding(torch.tensor([nodes[i].token for i in expand], device=dev)).to(self.dtype)[None]
            p_in = torch.full((1, n_new), root_pos - 1 + d, device=dev)
            o = yield from self.head.forward_steps(h_in, e_in, p_in, self.kv, self._fill + start, mask.to(dev)[None],
                                                   fused=True)
            frontier_logits = yield Rows(self.logits, o[0])
            for j, i in enumerate(expand):
                hidden[i] = o[0, j]
            frontier = expand
            rounds += 1
            t_rounds += time.perf_counter() - t_round
        self._t_end = time.perf_counter()
        if not nodes:
            return None
        keep = ancestor_closed_top(nodes, max_tokens) if greedy else list(range(len(nodes)))
        if params.greedy:
            self._pending = (max(nodes[i].depth for i in keep), t_rounds / rounds if rounds else None)
        return to_draft(nodes, keep, root_q, self.vocab_ids, vocab, with_scores=greedy)
