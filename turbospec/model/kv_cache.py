"""Static KV cache: one preallocated K and one V tensor per layer, [B, H_kv, max_seq_len, D].

Fixed shapes (the basis for CUDA graphs); the model writes new entries at ``cache_len`` and the
engine owns the length. One tensor per layer and per K/V (rather than one stacked tensor) so that
writing a slice never copies the whole cache under torch.compile.
"""
from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len

    def rows(self, start: int, stop: int) -> "KVCache":
        """Batch rows [start, stop) as a cache of their own: views, so writes land in this cache."""
        view = object.__new__(KVCache)
        view.k = [k[start:stop] for k in self.k]
        view.v = [v[start:stop] for v in self.v]
        view.max_seq_len = self.max_seq_len
        return view

    def tensors(self) -> list[Tensor]:
        """Every layer's K and V, the list ``ops.compact_kv`` takes."""
        return self.k + self.v
