"""Draft-head building blocks shared by EAGLE (1/2/3) and Medusa: their config, a Llama decoder
layer in plain torch with its own small KV cache, RMSNorm, and the draft vocabulary.

Heads are ordinary ``nn.Module``s (they are trained with autograd, see ``turbospec.train.trainer``) whose parameter
names follow the public checkpoint layouts (EAGLE: ``fc`` + ``layers.0.*``; EAGLE-3: ``fc`` +
``midlayer.*`` + ``norm`` + ``lm_head`` + ``d2t``/``t2d``; Medusa: ``{head}.{block}.linear``), so
``heads.formats`` maps them with little more than a config translation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..model.kv_cache import KVCache
from ..model.rope import RopeTable, rope_inv_freq, rotate
from ..model.transformer import rms_norm
from .config import HeadConfig

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)  # the target's norm (the same bits)


class Rotary:
    """The head's cos / sign-folded sin [B, 1, n, D] at given positions (the target's RoPE settings),
    in the dtype and on the device of the call."""

    def __init__(self, cfg: HeadConfig):
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.table: RopeTable | None = None

    def __call__(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        t = self.table
        if t is None or t.dtype != dtype or t.device != position_ids.device:
            t = self.table = RopeTable(self.inv_freq, dtype, position_ids.device)
        cos, sin = t.lookup(position_ids)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def head_cache(cfg: HeadConfig, max_seq_len: int, batch_size: int = 1, dtype=torch.float32, device="cpu") -> KVCache:
    """A head's KV cache: the target's cache type with one layer ([B, H_kv, S, D] K and V)."""
    return KVCache(1, batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim, dtype, device)


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVCache | None, cache_len: int,
                mask: Tensor | None) -> Tensor:
        """x [B, n, in_dim]. With ``kv``: K/V written at [cache_len, cache_len + n), attention over
        the prefix [0, cache_len) (all of it) and the new tokens under ``mask`` (bool [B or 1, n, n],
        None = causal), or under a full ``mask`` [B or 1, n, cache_len + n]. Without ``kv``: attention
        over the new tokens only (training)."""
        return self.o_proj(self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, kv, cache_len, mask))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv: KVCache | None,
               cache_len: int, mask: Tensor | None) -> Tensor:
        """``forward`` between the projections: q [B, n, nh * d], k / v [B, n, nkv * d] (before
        RoPE) -> the attention output [B, n, nh * d] (before o_proj)."""
        b, n, _ = q.shape
        q = q.view(b, n, self.nh, self.d).transpose(1, 2)
        k = k.view(b, n, self.nkv, self.d).transpose(1, 2)
        v = v.view(b, n, self.nkv, self.d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if mask is not None and kv is not None and mask.shape[-1] == cache_len + n:
            allowed = mask.view(-1, 1, n, cache_len + n)  # a full mask over prefix + new tokens
        elif mask is not None:
            allowed = mask.view(-1, 1, n, n)
        else:
            allowed = torch.ones(1, 1, n, n, dtype=torch.bool, device=q.device).tril_()
        if kv is not None:
            kc, vc = kv.k[0], kv.v[0]
            kc[:, :, cache_len:cache_len + n] = k.to(kc.dtype)
            vc[:, :, cache_len:cache_len + n] = v.to(vc.dtype)
            k, v = kc[:, :, :cache_len + n].to(q.dtype), vc[:, :, :cache_len + n].to(q.dtype)
            if allowed.shape[-1] != cache_len + n:
                prefix = torch.ones(allowed.shape[0], 1, n, cache_len, dtype=torch.bool, device=q.device)
                allowed = torch.cat((prefix, allowed), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=self.nkv != self.nh)
        return out.transpose(1, 2).reshape(b, n, self.nh * self.d)


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Llama-style init for a fresh head (norms at one, linears N(0, std), biases zero)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


def draft_vocab_from_counts(counts: Tensor, size: int, keep: Tensor | None = None) -> Tensor:
    """The ``size`` most frequent token ids (ties: lower id first), sorted ascending. ``keep``: the ids
    of a head's present draft vocabulary, which come first (the most frequent of them when ``size`` is
    smaller), so that a resized vocabulary drops none of the tokens a trained head drafts."""
    size = min(size, counts.numel())
    score = counts.double()
    if keep is not None:
        score = score.clone()
        score[keep.to(torch.int64).cpu()] += float(counts.sum()) + 1.0  # above every other id
    order = torch.sort(-score, stable=True).indices[:size]
    return torch.sort(order).values
