"""Draft-head building blocks shared by EAGLE (1/2/3) and Medusa: their config, a Llama decoder
layer in plain torch with its own small KV cache, RMSNorm, and the draft vocabulary.

Heads are ordinary ``nn.Module``s (they are trained with autograd, see ``turbospec.train.trainer``) whose parameter
names follow the public checkpoint layouts (EAGLE: ``fc`` + ``layers.0.*``; EAGLE-3: ``fc`` +
``midlayer.*`` + ``norm`` + ``lm_head`` + ``d2t``/``t2d``; Medusa: ``{head}.{block}.linear``), so
``heads.formats`` maps them with little more than a config translation.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..model.kv_cache import KVCache
from ..model.rope import RopeTable, rope_inv_freq, rotate
from ..model.transformer import rms_norm
from ..ops import has_op, tree_attention
from ..ops.limits import MAX_TREE_NODES
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
    FUSED = {"qkv_fused": ("q_proj", "k_proj", "v_proj")}  # drafting copies (``drafters.tree.inference_copy``)

    def __init__(self, cfg: HeadConfig, in_dim: int):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)
        self.qkv_fused = None  # a drafting copy's q/k/v projections as one linear

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(q, k, v) of x [..., in_dim]: one fused linear in a drafting copy, else the three."""
        if self.qkv_fused is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = self.qkv_fused(x).split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        return q, k, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVCache | None, cache_len: int,
                mask: Tensor | None) -> Tensor:
        """x [B, n, in_dim]. With ``kv``: K/V written at [cache_len, cache_len + n), attention over
        [0, cache_len + n) where ``mask`` (bool [B or 1, n, w], n <= w <= cache_len + n) says which of
        the last w keys each new token attends, every key before those attended (w = n: the whole
        prefix and a tree over the new tokens; w = cache_len + n: a full mask); None: the prefix and
        causal over the new tokens. Without ``kv``: attention over the new tokens only (training;
        w = n)."""
        return self.o_proj(self.attend(*self.project(x), cos, sin, kv, cache_len, mask))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv: KVCache | None,
               cache_len: int, mask: Tensor | None) -> Tensor:
        """``forward`` between the projections: q [B, n, nh * d], k / v [B, n, nkv * d] (before
        RoPE) -> the attention output [B, n, nh * d] (before o_proj). Over a cache on CPU with at most
        MAX_TREE_NODES masked keys: turbospec's tree_attention kernel (one query row costs ~15 us
        there against ~100 us for SDPA with a mask); else SDPA. Drafting arithmetic: acceptance only."""
        b, n, _ = q.shape
        q = q.view(b, n, self.nh, self.d)
        k = k.view(b, n, self.nkv, self.d)
        v = v.view(b, n, self.nkv, self.d)
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, n, 1, D]: rotate in [B, n, heads, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        w = n if mask is None else mask.shape[-1]
        if kv is None:
            if w != n:
                raise ValueError(f"Attention: without a cache the mask covers the n = {n} new tokens, got width {w}")
        elif not n <= w <= cache_len + n:
            raise ValueError(f"Attention: mask width must be in [{n}, {cache_len + n}] (the new tokens .. the "
                             f"whole cache), got {w}")
        if kv is not None:
            kc, vc = kv.k[0], kv.v[0]
            kc[:, :, cache_len:cache_len + n] = k.transpose(1, 2).to(kc.dtype)
            vc[:, :, cache_len:cache_len + n] = v.transpose(1, 2).to(vc.dtype)
            if q.device.type == "cpu" and w <= MAX_TREE_NODES and q.dtype == kc.dtype and has_op("tree_attention") \
                    and not (q.requires_grad or kc.requires_grad or vc.requires_grad):  # (the kernel has no backward)
                return self._tree_attend(q, kc, vc, cache_len + n - w, self._packed(mask, b, n, w))
            k, v = kc[:, :, :cache_len + n].to(q.dtype), vc[:, :, :cache_len + n].to(q.dtype)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if mask is None:
            allowed = torch.ones(1, 1, n, n, dtype=torch.bool, device=q.device).tril_()
        else:
            allowed = mask.view(-1, 1, n, w)
        if kv is not None and w < cache_len + n:
            prefix = torch.ones(allowed.shape[0], 1, n, cache_len + n - w, dtype=torch.bool, device=q.device)
            allowed = torch.cat((prefix, allowed), dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=allowed,
                                             enable_gqa=self.nkv != self.nh)
        return out.transpose(1, 2).reshape(b, n, self.nh * self.d)

    @staticmethod
    def _packed(mask: Tensor | None, b: int, n: int, w: int) -> Tensor:
        """tree_attention's packed mask [B, w] of ``attend``'s mask over the last w keys: rows w - n ..
        w - 1 are the new tokens' (None: causal); the first w - n rows, queries only computed to be
        dropped, attend their own key."""
        bits, causal = _mask_bits(w)
        if mask is None:
            return causal.expand(b, w)
        new = (mask.to(device="cpu", dtype=torch.int64) * bits).sum(-1)  # [B or 1, n]
        return torch.cat((bits[:w - n].expand(new.shape[0], w - n), new), dim=-1).expand(b, w).contiguous()

    def _tree_attend(self, q: Tensor, kc: Tensor, vc: Tensor, prefix: int, packed: Tensor) -> Tensor:
        b, n = q.shape[:2]
        w = packed.shape[-1]
        if w > n:  # queries for the masked keys before the new tokens': computed, then dropped
            q = torch.cat((q.new_zeros(b, w - n, self.nh, self.d), q), dim=1)
        out, _ = tree_attention(q.contiguous(), kc, vc, torch.full((b,), prefix, dtype=torch.int64), packed,
                                1.0 / math.sqrt(self.d))
        return out[:, w - n:].reshape(b, n, self.nh * self.d)


@functools.lru_cache(maxsize=MAX_TREE_NODES)
def _mask_bits(w: int) -> tuple[Tensor, Tensor]:
    """(bit j of each of w keys as int64 [w], the causal packed mask [1, w]); bit 63 wraps to the sign."""
    bits = torch.ones((), dtype=torch.int64).bitwise_left_shift(torch.arange(w))
    return bits, (torch.ones(w, w, dtype=torch.int64).tril_() * bits).sum(-1)[None]


class MLP(nn.Module):
    FUSED = {"gate_up_fused": ("gate_proj", "up_proj")}  # drafting copies (``drafters.tree.inference_copy``)

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_fused = None  # a drafting copy's gate and up projections as one linear

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_fused is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_fused(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
