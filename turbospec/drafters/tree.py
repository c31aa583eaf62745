"""Shared pieces of the tree drafters (EAGLE, Medusa): the draft LM head, choosing children, and
turning a list of nodes into a ``Draft``.

Greedy decoding: children are the top-k tokens of the draft distribution (any tree is exact under
greedy verification). Sampling (T > 0): children are drawn *without replacement* from the draft
distribution q (Gumbel top-k, which yields the same ordered sample as drawing one at a time), and q
is kept per node, so ``verify``'s recursive rejection sampling is exactly lossless. Which children a
node gets may depend on anything drawn before them, never on the children themselves; so in
sampling mode a node's children are kept all-or-none (no pruning of sibling groups by their own
scores).

How this differs from the EAGLE / Medusa reference code, which treats q as 1 when sampling: taking a
drafted token x as a point mass (accept with probability p(x), on rejection renormalise p without x)
is also lossless, because x was drawn independently of the target's coins; but it accepts x with
probability p(x) instead of min(1, p(x) / q(x)), i.e. less often whenever q(x) < 1. turbospec keeps
q (``Draft.draft_probs``) and gets the higher acceptance. What is never allowed is a q that is not
the distribution the drafts were drawn from (tests/heads/test_heads.py shows that such a drafter fails
the distribution test). Medusa's "typical acceptance" is lossy and is not implemented.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .base import Draft
from ..model.quant import WEIGHT_MODES, quantize
from ..model.transformer import Linear
from ..ops.reference import logits_to_probs
from ..ops.sampling import SamplingParams


class DraftLMHead:
    """logits over a draft vocabulary: rows ``ids`` of the target's LM head (all rows when None),
    in ``dtype``, stored as ``weights`` (``head_weights``; the draft's precision does not affect
    exactness, only acceptance)."""

    def __init__(self, weight: Tensor, ids: Tensor | None = None, dtype: torch.dtype | None = None,
                 weights: str = "dense", activations: str = "exact"):
        w = weight if ids is None else weight[ids]
        self.ids = ids
        self.dtype = dtype or weight.dtype
        self.linear = draft_linear(w, self.dtype, weights, name="the draft LM head", strict=False,
                                   activations=activations)

    def __call__(self, h: Tensor) -> Tensor:
        return self.linear(h.to(self.dtype)).float()

    def to_target(self, idx: Tensor) -> Tensor:
        return idx if self.ids is None else self.ids[idx]


def choose_children(logits: Tensor, k: int, params: SamplingParams, generator: torch.Generator | None
                    ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Up to ``k`` children from draft logits [dv]: (indices [m], log q of each [m], q [dv] or None).
    Greedy: top-k of log_softmax. Sampling: an ordered sample without replacement from
    q = logits_to_probs(logits, params) (Gumbel top-k), only among tokens with q > 0."""
    if params.greedy:
        idx, val = greedy_children(logits[None], k)
        return idx[0], val[0], None
    q = logits_to_probs(logits.float(), params.temperature, params.top_k, params.top_p)
    m = min(k, int((q > 0).sum()))
    u = torch.rand(q.shape, generator=generator, dtype=torch.float64).clamp_(min=1e-300).to(q.device)
    keys = torch.log(q.double()) - torch.log(-torch.log(u))
    idx = torch.topk(keys, m).indices
    return idx, torch.log(q[idx]), q


def greedy_children(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """choose_children's greedy rule for every row of ``logits`` [F, dv] in one call (a tree round's
    frontier): (indices [F, m], log q [F, m]), the top m = min(k, dv) of each row's log_softmax."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    val, idx = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return idx, val


@dataclass
class Node:
    token: int            # target vocabulary id
    parent: int           # index into the node list (-1: child of the root)
    score: float          # cumulative draft log-probability
    depth: int            # 1 for children of the root
    q: Tensor | None = None  # draft distribution over the draft vocab at this node (sampling)
    children: list[int] = field(default_factory=list)


def to_draft(nodes: list[Node], keep: list[int], root_q: Tensor | None, vocab_ids: Tensor | None, vocab: int,
             with_scores: bool = False) -> Draft:
    """A ``Draft`` of the nodes ``keep`` (an ancestor-closed subset of ``nodes``), ordered by depth
    and then by their order in ``nodes`` (siblings stay in the order they were drawn). ``vocab_ids``:
    the target id of each draft-vocabulary entry q is over (None: q is over the whole vocabulary).
    ``with_scores``: ``Draft.scores`` from the nodes' cumulative draft log-probabilities."""
    keep = sorted(set(keep), key=lambda i: (nodes[i].depth, i))
    pos = {i: j + 1 for j, i in enumerate(keep)}  # node index -> draft node number (root = 0)
    parents = [0 if nodes[i].parent < 0 else pos[nodes[i].parent] for i in keep]
    probs = None
    if root_q is not None:
        probs = torch.zeros(len(keep) + 1, vocab, device=root_q.device)
        rows = [(0, root_q)] + [(pos[i], nodes[i].q) for i in keep
                                if nodes[i].q is not None and any(c in pos for c in nodes[i].children)]
        for r, q in rows:
            if vocab_ids is None:
                probs[r] = q
            else:
                probs[r, vocab_ids] = q
    scores = [math.exp(min(nodes[i].score, 0.0)) for i in keep] if with_scores else None
    return Draft(token_ids=[nodes[i].token for i in keep], parents=parents, draft_probs=probs, scores=scores)


def ancestor_closed_top(nodes: list[Node], n: int) -> list[int]:
    """The ``n`` best nodes by score (ties: earlier first) plus whatever ancestors they need,
    trimmed back to ``n`` by dropping the worst leaves."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))
    chosen: set[int] = set()
    for i in order:
        if len(chosen) >= n:
            break
        path = []
        j = i
        while j >= 0 and j not in chosen:
            path.append(j)
            j = nodes[j].parent
        if len(chosen) + len(path) <= n:
            chosen.update(path)
    return sorted(chosen)


def head_weights(mode: str | None, device) -> str:
    """How a draft head stores its linears for drafting: "dense" (the head's dtype), "q8_0" or
    "q4_0" (GGUF blocks through ``turbospec::linear``, CPU only). None / "auto": "q4_0" on CPU with
    the kernels built, else "dense". Drafting reads every head weight each expansion round; after a
    target step has streamed its own weights through the cache they come from memory, so on CPU the
    head's weight bytes set its cost (bench/results/2026-11-29-quantized-head-drafting.md); the
    head's arithmetic changes acceptance only, never the output."""
    from ..ops import has_op
    mode = "auto" if mode is None else mode
    if mode not in WEIGHT_MODES:
        raise ValueError(f"draft_weights {mode!r} is not supported for a head; choose one of {', '.join(WEIGHT_MODES)}")
    cpu = torch.device(device).type == "cpu"
    if mode == "auto":
        return "q4_0" if cpu and has_op("linear") else "dense"
    if mode != "dense" and not cpu:
        raise ValueError(f"draft_weights={mode!r}: quantized head weights run on CPU only (device {device}); "
                         f"use 'dense' or 'auto'")
    return mode


# a quantized head's default activations: int8, as a draft model's on CPU (the shipped EAGLE-3 head, 4-node
# proposals: 4.74 -> 3.66 ms, tau 1.598 either way; Spec-Bench tau at 16 nodes 1.90 either way;
# bench/results/2026-11-29-int8-interleaved.md)
HEAD_ACTIVATIONS = "int8"


def head_activations(mode: str | None, weights: str) -> str:
    """The activations a head's quantized linears draft with (``draft_activations``): "exact", or
    "int8" (int8 activations and integer dot products, as a draft model's; speed and acceptance
    only, never the output). None: HEAD_ACTIVATIONS for quantized heads, "exact" for dense ones."""
    if mode not in (None, "exact", "int8"):
        raise ValueError(f"draft_activations must be 'exact', 'int8' or None, got {mode!r}")
    if mode == "int8" and weights == "dense":
        raise ValueError("draft_activations='int8': a head takes int8 activations with quantized weights only "
                         "(draft_weights q8_0 / q4_0, or auto on CPU), got draft_weights='dense'")
    if mode is None:
        return HEAD_ACTIVATIONS if weights != "dense" else "exact"
    return mode


def draft_linear(weight: Tensor, dtype: torch.dtype, weights: str = "dense", bias: Tensor | None = None,
                 name: str = "linear", strict: bool = True, activations: str = "exact") -> Linear:
    """turbospec's ``Linear`` over a head's ``weight`` [N, K]: dense in ``dtype``, or quantized to
    ``weights`` (q8_0 / q4_0) from its float values, computing with ``activations`` ("int8": int8
    activations, the quantized blocks in the int8 kernels' layout). K must be a multiple of 32 to
    quantize: a layer that is not stays dense unless ``strict`` (an explicit request), which raises
    naming it."""
    if weights != "dense":
        if weight.shape[-1] % 32 == 0:
            lin = Linear(quantize(weight.detach().float(), weights), None if bias is None else bias.detach().to(dtype))
            if activations == "int8":
                lin.activations = 8
                lin.set_layout()
            return lin
        if strict:
            raise ValueError(f"draft_weights={weights!r}: {name} has K = {weight.shape[-1]} inputs, not a multiple "
                             f"of 32 (GGUF blocks); use draft_weights='auto' (such layers stay dense) or 'dense'")
    return Linear(weight.detach().to(dtype).contiguous(), None if bias is None else bias.detach().to(dtype))


def inference_copy(module: torch.nn.Module, dtype: torch.dtype, device=None, weights: str = "dense",
                   strict: bool = True, skip: tuple[str, ...] = (), activations: str = "exact") -> torch.nn.Module:
    """A copy of a head for drafting: in ``dtype`` (on ``device``: default, where it is), eval mode,
    every ``nn.Linear`` running on turbospec's ``Linear`` (``turbospec::linear`` on CPU)
    instead of F.linear, its weight stored as ``weights`` says (``head_weights``; quantized from the
    caller's float values; ``activations``: theirs, ``draft_linear``). The caller's module is left
    untouched (it may still be trained).
    ``skip``: submodules (names) the drafter computes some other way, left as they are."""
    import copy
    m = copy.deepcopy(module).to(dtype).eval().requires_grad_(False)  # (norms: turbospec's kernel, not autograd's)
    if device is not None:
        m = m.to(device)
    if next(m.parameters()).device.type != "cpu":
        if weights != "dense":
            raise ValueError(f"draft_weights={weights!r}: quantized head weights run on CPU only")
        return m
    source = dict(module.named_modules())
    for name, sub in m.named_modules():
        if any(name == k or name.startswith(k + ".") for k in skip):
            continue
        if isinstance(sub, torch.nn.Linear):
            orig = source[name]
            fast = draft_linear(orig.weight, dtype, weights, orig.bias, name or "linear", strict, activations)
            sub.forward = fast.__call__
        # linears of one input computed as one (``FUSED``: attribute -> the linears' names): one weight
        # stream and one call instead of several (each output row's dot product is unchanged)
        for attr, parts in getattr(sub, "FUSED", {}).items():
            lins = [source[f"{name}.{p}" if name else p] for p in parts]
            if all(lin.bias is None for lin in lins):
                w = torch.cat([lin.weight.detach() for lin in lins])
                setattr(sub, attr, draft_linear(w, dtype, weights, None, f"{name}.{attr}", strict, activations))
    return m
