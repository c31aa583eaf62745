"""Draft-head building blocks shared by EAGLE (1/2/3) and Medusa: their config, a Llama decoder
layer in plain torch with its own small KV cache, RMSNorm, and the draft vocabulary.

Heads are ordinary ``nn.Module``s (they are trained with autograd, see ``train.py``) whose parameter
names follow the public checkpoint layouts (EAGLE: ``fc`` + ``layers.0.*``; EAGLE-3: ``fc`` +
``midlayer.*`` + ``norm`` + ``lm_head`` + ``d2t``/``t2d``; Medusa: ``{head}.{block}.linear``), so
``checkpoints.py`` maps them with little more than a config translation.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..model.transformer import ModelConfig, rope_inv_freq

METHODS = ("medusa", "eagle", "eagle3")


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head; stored as config.json next to the weights."""
    method: str                    # "medusa", "eagle" (EAGLE-1/2 feature head) or "eagle3"
    hidden_size: int
    vocab_size: int                # the target's vocabulary
    intermediate_size: int = 0     # eagle/eagle3 decoder layer
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    fc_bias: bool = True           # eagle: EAGLE-1/2 checkpoints have a bias on fc
    feature_layers: list[int] = field(default_factory=list)  # eagle3: target layers fused by fc
    draft_vocab_size: int = 0      # eagle3: its own LM head's size (0: the full vocabulary)
    medusa_num_heads: int = 0      # medusa: heads predicting tokens +1 .. +K after the root
    medusa_num_layers: int = 1     # medusa: residual blocks per head
    target: str = ""               # informational: what it was trained for

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} is not supported; choose one of {METHODS}")

    @classmethod
    def for_target(cls, method: str, cfg: ModelConfig, **kw) -> "HeadConfig":
        """A head shaped like one decoder layer of the target ``cfg``."""
        base = dict(method=method, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                    intermediate_size=cfg.intermediate_size, num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                    rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)
        if method == "eagle3" and "feature_layers" not in kw:
            n = cfg.num_layers  # EAGLE-3's choice: a low, a middle and a high layer
            kw["feature_layers"] = sorted({min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0)})
        if method == "medusa" and "medusa_num_heads" not in kw:
            kw["medusa_num_heads"] = 4
        base.update(kw)
        return cls(**base)

    def to_json(self) -> str:
        return json.dumps({"turbospec_head": asdict(self)}, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        d = d.get("turbospec_head", d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"head config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def model_config(self) -> ModelConfig:
        """The ModelConfig of the head's decoder layer (for RoPE)."""
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary:
    """cos / sin tables for the head's positions (the target's RoPE settings)."""

    def __init__(self, cfg: HeadConfig):
        self.inv_freq = rope_inv_freq(cfg.model_config())
        self.n = 0
        self.cos = self.sin = None

    def __call__(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        need = int(position_ids.max()) + 1 if position_ids.numel() else 1
        if need > self.n or self.cos.dtype != dtype or self.cos.device != position_ids.device:
            n = max(need, 2 * self.n, 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos().to(dtype).to(position_ids.device), \
                emb.sin().to(dtype).to(position_ids.device)
            self.n = n
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)  # [B, 1, n, D]


def _rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class HeadKV:
    """A head's KV cache: one layer, [B, H_kv, S, D] K and V."""

    def __init__(self, cfg: HeadConfig, max_seq_len: int, batch_size: int = 1, dtype=torch.float32,
                 device="cpu"):
        shape = (batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: HeadKV | None, cache_len: int,
                mask: Tensor | None) -> Tensor:
        """x [B, n, in_dim]. With ``kv``: K/V written at [cache_len, cache_len + n), attention over
        the prefix [0, cache_len) (all of it) and the new tokens under ``mask`` (bool [B or 1, n, n],
        None = causal), or under a full ``mask`` [B or 1, n, cache_len + n]. Without ``kv``: attention
        over the new tokens only (training)."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.nkv, self.d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if mask is not None and kv is not None and mask.shape[-1] == cache_len + n:
            allowed = mask.view(-1, 1, n, cache_len + n)  # a full mask over prefix + new tokens
        elif mask is not None:
            allowed = mask.view(-1, 1, n, n)
        else:
            allowed = torch.ones(1, 1, n, n, dtype=torch.bool, device=x.device).tril_()
        if kv is not None:
            kv.k[:, :, cache_len:cache_len + n] = k.to(kv.k.dtype)
            kv.v[:, :, cache_len:cache_len + n] = v.to(kv.v.dtype)
            k, v = kv.k[:, :, :cache_len + n].to(q.dtype), kv.v[:, :, :cache_len + n].to(q.dtype)
            if allowed.shape[-1] != cache_len + n:
                prefix = torch.ones(allowed.shape[0], 1, n, cache_len, dtype=torch.bool, device=x.device)
                allowed = torch.cat((prefix, allowed), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=self.nkv != self.nh)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.nh * self.d))


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


def draft_vocab_from_counts(counts: Tensor, size: int) -> Tensor:
    """The ``size`` most frequent token ids (ties: lower id first), sorted ascending."""
    size = min(size, counts.numel())
    order = torch.sort(-counts.double(), stable=True).indices[:size]
    return torch.sort(order).values
