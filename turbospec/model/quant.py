"""Weights kept in their storage format: GGUF block quantizations and dense dtypes.

A ``QuantWeight`` is a matrix [N, K] stored as GGUF blocks (uint8 [N, row bytes]) with its format, a
GGML type id (``reference.WEIGHT_FORMATS``). ``turbospec::linear`` multiplies by it without
dequantizing it in memory: every weight is dequantized in registers to exactly the float32 value
gguf's dequantization gives, so a quantized model computes what the same model dequantized to
float32 computes, bit for bit (tests/ops/test_linear.py, tests/model/test_quantized_model.py).

``quantize`` makes Q8_0 / Q4_0 blocks from a dense matrix (``Engine(weights="q8_0")`` for HF
checkpoints), with gguf's own rounding rules.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .. import ops
from ..ops import reference

FORMAT_IDS = {v[0].lower(): k for k, v in reference.WEIGHT_FORMATS.items()}  # "q4_1" -> 3
# What ``weights=`` may say besides these: keep the checkpoint's storage ("auto": GGUF blocks as
# stored, dense checkpoints in the model dtype) or dequantize everything ("dense").
QUANTIZE_ON_LOAD = ("q8_0", "q4_0")
WEIGHT_MODES = ("auto", "dense") + QUANTIZE_ON_LOAD


@dataclass
class QuantWeight:
    """A weight matrix [rows, k] in GGUF blocks: ``data`` uint8 [rows, row bytes], ``fmt`` a GGML type id."""
    data: Tensor
    fmt: int
    k: int

    def __post_init__(self):
        want = reference.row_bytes(self.fmt, self.k)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(f"{self.name} weight with K = {self.k} must be uint8 [N, {want}], got "
                             f"{self.data.dtype} {list(self.data.shape)}")

    @property
    def name(self) -> str:
        return reference.WEIGHT_FORMATS[self.fmt][0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.k

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense matrix [rows, k] (float32 values exactly as gguf dequantizes, then cast)."""
        return ops.dequantize(self.data, self.fmt, self.k).to(dtype)

    def rows(self, index) -> "QuantWeight":
        return QuantWeight(self.data[index].contiguous(), self.fmt, self.k)


def weight_mode(mode: str) -> str:
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights {mode!r} is not supported; choose one of {', '.join(WEIGHT_MODES)}")
    return mode


def quantize(w: Tensor, fmt: str) -> QuantWeight:
    """Q8_0 or Q4_0 blocks of a dense matrix [N, K] (K a multiple of 32), rounded as gguf rounds."""
    if fmt not in QUANTIZE_ON_LOAD:
        raise ValueError(f"quantize: format {fmt!r} is not supported; supported: {', '.join(QUANTIZE_ON_LOAD)}")
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"quantize: weight must be [N, K] with K a multiple of 32, got {list(w.shape)}")
    n, k = w.shape
    blocks = w.detach().float().cpu().reshape(n, k // 32, 32)
    if fmt == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        # np.round: half to even, as gguf's Q8_0 quantizer
        qs = torch.from_numpy(np.round((blocks * inv).numpy())).to(torch.int8)
        raw = torch.cat((d.half().view(torch.uint8).reshape(n, -1, 2), qs.view(torch.uint8)), -1)
    else:
        imax = blocks.abs().argmax(-1, keepdim=True)
        d = torch.gather(blocks, -1, imax) / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
        qs = q[..., :16] | (q[..., 16:] << 4)
        raw = torch.cat((d.half().view(torch.uint8).reshape(n, -1, 2), qs), -1)
    return QuantWeight(raw.reshape(n, -1).contiguous(), FORMAT_IDS[fmt], k)
