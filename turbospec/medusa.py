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
import torch.nn.functional as F
from torch import Tensor, nn

from .heads import HeadConfig


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.method != "medusa" or cfg.medusa_num_heads < 1:
            raise ValueError(f"MedusaHeads needs method 'medusa' and medusa_num_heads >= 1, got "
                             f"{cfg.method!r} / {cfg.medusa_num_heads}")
        self.cfg = cfg
        self.blocks = nn.ModuleList([nn.Sequential(*[ResBlock(cfg.hidden_size)
                                                     for _ in range(cfg.medusa_num_layers)])
                                     for _ in range(cfg.medusa_num_heads)])
        self.lm_heads: nn.ModuleList | None = None  # per-head LM heads (Medusa checkpoints), else shared

    @property
    def feature_spec(self):
        return "final"

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> the heads' outputs [K, ..., H] (before the LM head)."""
        return torch.stack([blk(hidden) for blk in self.blocks])

    def init_identity(self) -> None:
        """Medusa's init: the blocks start as (almost) the identity (zero linear), so every head
        starts by predicting what the LM head predicts at the root."""
        for blk in self.blocks:
            for rb in blk:
                nn.init.zeros_(rb.linear.weight)
                nn.init.zeros_(rb.linear.bias)


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
