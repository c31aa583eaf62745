"""Rotary position embedding: the inverse frequencies (as transformers computes them, with linear
and llama3 scaling), cos / sin tables that grow as positions need, and the rotation itself."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def rope_parameters(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling in turbospec's form: None or a dict with "rope_type") from a HF
    config dict: v4 ``rope_theta`` + ``rope_scaling`` (with "type" or "rope_type"), or v5
    ``rope_parameters``. Scaling types: default, linear, llama3."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3")
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # checked by ModelConfig.from_hf (1.0 only)
    return float(theta), (None if rope_type == "default" else {**params, "rope_type": rope_type})


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Rotary inverse frequencies [head_dim / 2], computed as transformers computes them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling["rope_type"] == "linear":
        return inv / scaling["factor"]
    # llama3: long wavelengths divided by factor, short kept, smooth interpolation between.
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    mid = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(mid, smoothed, out)


class RopeTable:
    """cos and sign-folded sin [length, D] for positions [0, length), in one dtype on one device;
    ``lookup`` grows the table (doubling, at least 256 rows) when a position is beyond it."""

    def __init__(self, inv_freq: Tensor, dtype: torch.dtype, device):
        self.inv_freq, self.dtype, self.device = inv_freq, dtype, device
        self.length = 0
        self.cos = self.sin = None

    def ensure(self, length: int) -> None:
        """Cover positions [0, length) (a fixed-shape path must never grow the table)."""
        if length > self.length:
            n = max(length, 2 * self.length, 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, : sin.shape[1] // 2].neg_()
            self.cos, self.sin = emb.cos().to(self.device, self.dtype), sin.to(self.device, self.dtype)
            self.length = n

    def lookup(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sign-folded sin at ``position_ids`` [..., D] (the table grows as needed; this reads
        the largest position on the host)."""
        self.ensure(int(position_ids.max()) + 1 if position_ids.numel() else 1)
        return self.cos[position_ids], self.sin[position_ids]


def rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotary embedding in the half-split layout HF checkpoints use (D last). ``sin_signed`` is sin
    with its first half negated, so x * cos + roll(x, D/2) * sin_signed equals transformers'
    x * cos + rotate_half(x) * sin bit for bit, in fewer ops."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed
