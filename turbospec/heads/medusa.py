"""Medusa heads (the modules); drafting with them is ``drafters.medusa``.

K heads read the target's final-normed hidden state f_i at the last committed position i; head k
(0-based) predicts the token k+1 places after the root. Each head is ``medusa_num_layers`` residual
blocks x + SiLU(W x + b) followed by the target's LM head (shared; a Medusa checkpoint with its own
per-head LM heads keeps them in ``lm_heads``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import HeadConfig


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
