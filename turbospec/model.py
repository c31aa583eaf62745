"""turbospec's own compact Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2).

No HF modeling code runs here: weights are loaded (``loader.py``) into plain tensors, the q/k/v and
gate/up projections are fused into one matrix each (fewer, wider GEMVs), and on CPU every linear
runs on oneDNN with weights pre-packed once at load. Attention reads the static KV cache
(``kv_cache.py``) over the valid prefix plus the new tokens, under an arbitrary tree mask.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg) -> "ModelConfig":
        """From a ``transformers`` config; raises ValueError for unsupported architectures."""
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} (architectures {getattr(cfg, 'architectures', None)}) is "
                             f"not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)} "
                             f"(Llama 2/3, Mistral, Qwen2/2.5, SmolLM2)")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; only 'silu'")
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: default, "
                             f"linear, llama3")
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        eos = getattr(cfg, "eos_token_id", None)
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=n_heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            qkv_bias=mt == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096) or 4096,
            model_type=mt, eos_token_ids=eos)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Rotary inverse frequencies [head_dim / 2], computed as transformers computes them."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / sc["factor"]
    # llama3: long wavelengths divided by factor, short kept, smooth interpolation between.
    factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_ctx = sc.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    mid = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(mid, smoothed, out)


class Linear:
    """y = x @ W^T (+ b).

    On CPU with turbospec's kernels built, inputs of up to ``SMALL_ROWS`` rows (decode steps, short
    verify passes) run ``turbospec::small_linear`` on the dense weight (one weight read for all rows,
    faster than oneDNN's GEMV here); larger inputs run oneDNN on a copy of the weight pre-packed once
    at load. Without the kernels: oneDNN with two packings (one tuned for a
    single row, one for several), or F.linear off CPU."""

    SMALL_ROWS = 4  # measured crossover with oneDNN's GEMM (see csrc/cpu/llama_layers.cpp)

    def __init__(self, weight: Tensor, bias: Tensor | None = None, pack: bool = True):
        from .ops import has_op
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.packed_row = self.packed_rows = None
        self.small = False
        if pack and weight.device.type == "cpu" and torch.backends.mkldnn.is_available() \
                and weight.dtype in (torch.float32, torch.bfloat16):
            self.packed_rows = torch.ops.mkldnn._reorder_linear_weight(weight)
            if has_op("small_linear"):
                self.small = True
                self.weight = weight.contiguous()
            else:
                self.packed_row = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                self.weight = None

    @property
    def row_weight(self) -> Tensor:
        """What ``turbospec::llama_layers`` takes for few-row inputs (dense or oneDNN-packed)."""
        return self.weight if self.small else self.packed_row

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed_rows is not None:
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            if self.small and x2.shape[0] <= self.SMALL_ROWS:
                return torch.ops.turbospec.small_linear(x, self.weight, self.bias)
            w = self.packed_row if x2.shape[0] == 1 and self.packed_row is not None else self.packed_rows
            y = torch.ops.mkldnn._linear_pointwise(x2, w, self.bias, "none", [], "")
            return y.view(*shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:  # one fused op, bit-identical to the formula below in float32
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotary embedding in the half-split layout HF checkpoints use. x: [B, n, H, D].
    ``sin_signed`` is sin with its first half negated, so x * cos + roll(x, D/2) * sin_signed equals
    transformers' x * cos + rotate_half(x) * sin bit for bit, in fewer ops."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class Layer:
    def __init__(self, w: dict[str, Tensor], pack: bool):
        self.qkv = Linear(w["qkv"], w.get("qkv_bias"), pack)
        self.o = Linear(w["o"], None, pack)
        self.gate_up = Linear(w["gate_up"], None, pack)
        self.down = Linear(w["down"], None, pack)
        self.attn_norm, self.mlp_norm = w["attn_norm"], w["mlp_norm"]


class Transformer:
    """Forward over new tokens against a static KV cache.

    Weights are a flat dict in turbospec names (see ``loader.convert_hf_state_dict``)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor], pack: bool = True):
        self.cfg = cfg
        self.embed = weights["embed"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.layers = [Layer({k.split(".", 2)[2]: v for k, v in weights.items()
                                   if k.startswith(f"layers.{i}.")}, pack)
                       for i in range(cfg.num_layers)]
        self.norm = weights["norm"]
        self.lm_head_weight = weights.get("lm_head", self.embed)  # [V, H]; draft heads share it
        self.lm_head = Linear(self.lm_head_weight, None, pack)
        self._inv_freq = rope_inv_freq(cfg)
        self._rope_len = 0
        self._cos = self._sin = None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.use_cpp_layers = True  # run the layer loop in C++ when the kernel is built (bit-identical)
        self.flatten_layers()

    def new_cache(self, max_seq_len: int, batch_size: int = 1) -> KVCache:
        # On CPU, 16-bit models keep K/V in float32: the CPU's bf16 batched matmuls are about twice as
        # slow as fp32 ones at these sizes, and the stored values are the same bf16-rounded numbers.
        dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        return KVCache(self.cfg.num_layers, batch_size, self.cfg.num_kv_heads, max_seq_len,
                       self.cfg.head_dim, dtype, self.device)

    def _rope(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        need = int(position_ids.max()) + 1 if position_ids.numel() else 1
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, : sin.shape[1] // 2].neg_()
            self._cos, self._sin = emb.cos().to(self.device, self.dtype), sin.to(self.device, self.dtype)
            self._rope_len = n
        return self._cos[position_ids].unsqueeze(2), self._sin[position_ids].unsqueeze(2)  # [B, n, 1, D]

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, position_ids: Tensor, cache: KVCache, cache_len: int,
                tree_mask: Tensor | None = None, logits: str = "all", features=None):
        """Run ``input_ids [B, n]`` at ``position_ids [B, n]``; their K/V are written to cache
        slots [cache_len, cache_len + n). Each new token attends to the whole valid prefix
        [0, cache_len) and, among the new tokens, to those allowed by ``tree_mask`` (bool [B, n, n];
        None = causal). ``logits``: "all" -> [B, n, V] float32, "last" -> [B, 1, V], "none" -> None.

        ``features`` (what draft heads read): None -> only the logits are returned; "final" ->
        (logits, the final-normed hidden state [B, n, hidden], what the LM head reads: Medusa,
        EAGLE-1/2); a tuple of layer indices -> (logits, [B, n, len * hidden], the residual streams
        after those layers, concatenated: EAGLE-3).
        """
        cfg = self.cfg
        bsz, n = input_ids.shape
        total = cache_len + n
        if total > cache.max_seq_len:
            raise ValueError(f"cache overflow: cache_len {cache_len} + {n} new tokens > max_seq_len "
                             f"{cache.max_seq_len}")
        cos, sin = self._rope(position_ids)
        if tree_mask is None:
            allowed = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        else:
            allowed = tree_mask
        mask = None
        if n > 1:  # [B or 1, 1, n, total]: the whole prefix, then the tree (or causal) mask
            allowed = allowed.view(-1, 1, n, n)
            prefix = torch.ones(allowed.shape[0], 1, n, cache_len, dtype=torch.bool, device=self.device)
            mask = torch.cat((prefix, allowed), dim=-1)
        capture = self._capture_layers(features)
        x = self.embed[input_ids]
        if self.use_cpp_layers and self._flat is not None:
            x, *captured = torch.ops.turbospec.llama_layers(
                x, cos, sin, mask, self._flat, cache.k, cache.v, cache_len, cfg.num_heads, cfg.num_kv_heads,
                cfg.rms_norm_eps, self.scale, cfg.qkv_bias, capture)
        else:
            x, captured = self._layers_python(x, cos, sin, mask, cache, cache_len, capture)
        if logits == "none" and features != "final":
            return None if features is None else (None, torch.cat(captured, dim=-1))
        if logits == "last" and features is None:
            x = x[:, -1:]
        x = rms_norm(x, self.norm, cfg.rms_norm_eps)
        if logits == "none":
            out = None
        else:
            out = self.lm_head(x[:, -1:] if logits == "last" else x).float()
        if features is None:
            return out
        return out, (x if features == "final" else torch.cat(captured, dim=-1))

    def _layers_python(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache,
                       cache_len: int, capture=()) -> tuple[Tensor, list[Tensor]]:
        """The decoder layers; the specification of the C++ kernel ``turbospec::llama_layers``."""
        n = x.shape[1]
        total = cache_len + n

        def attend(li: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.k[li], cache.v[li]
            kc[:, :, cache_len:total] = k.transpose(1, 2)
            vc[:, :, cache_len:total] = v.transpose(1, 2)
            # K/V stay grouped (enable_gqa): no repeated copies of the cache.
            out = F.scaled_dot_product_attention(q.transpose(1, 2).to(kc.dtype), kc[:, :, :total], vc[:, :, :total],
                                                 attn_mask=mask, scale=self.scale, enable_gqa=True)
            return out.transpose(1, 2)

        return self._decoder(x, cos, sin, attend, capture)

    def _decoder(self, x: Tensor, cos: Tensor, sin: Tensor, attend, capture=()) -> tuple[Tensor, list[Tensor]]:
        """The layer loop around ``attend(layer, q, k, v)`` (q [B, n, H, D], k / v [B, n, H_kv, D],
        rotated; it stores k / v in the cache and returns the attention output [B, n, H, D])."""
        cfg = self.cfg
        bsz, n = x.shape[:2]
        h_kv, d = cfg.num_kv_heads, cfg.head_dim
        captured: list = [None] * len(capture)
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h).view(bsz, n, cfg.num_heads + 2 * h_kv, d)
            qk = rotate(qkv[:, :, : cfg.num_heads + h_kv], cos, sin)  # q and k heads in one pass
            attn = attend(li, qk[:, :, : cfg.num_heads], qk[:, :, cfg.num_heads:], qkv[:, :, cfg.num_heads + h_kv:])
            x = x + layer.o(attn.to(self.dtype).reshape(bsz, n, self.q_size))
            h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
            gu = layer.gate_up(h)
            gate, up = gu.chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            for j, c in enumerate(capture):
                if c == li:
                    captured[j] = x
        return x, captured

    # ------------------------------------------------------------------------------------------
    # The static-shape path: what a CUDA graph captures (turbospec.runner).
    def ensure_rope(self, length: int) -> None:
        """Make the rotary table cover positions [0, length), so that the static path never grows it."""
        if length > self._rope_len:
            self._rope(torch.tensor([[length - 1]]))

    @torch.inference_mode()
    def forward_static(self, input_ids: Tensor, position_ids: Tensor, cache: KVCache, cache_len: Tensor,
                       tree_mask_packed: Tensor, features=None):
        """``forward`` with fixed shapes and no host reads, so that it can be captured in a CUDA graph
        and replayed for any prefix length.

        ``cache_len``: int64 [B] on the model's device (the prefix each row attends to; the n new
        tokens' K/V are written at slots cache_len + j). ``tree_mask_packed``: int64 [B, n], bit j of
        row i set iff new token i attends new token j (``ops.build_tree``'s packed mask; a chain is
        bits 0..i). Rows may be padding: a row that attends only itself changes nothing for the
        others. Positions must be inside the rotary table (``ensure_rope``). Returns logits
        [B, n, V] float32, with ``features`` as in ``forward``.
        """
        from . import ops
        cfg = self.cfg
        bsz, n = input_ids.shape
        cos, sin = self._cos[position_ids].unsqueeze(2), self._sin[position_ids].unsqueeze(2)
        slots = cache_len[:, None] + torch.arange(n, device=input_ids.device)  # [B, n]
        capture = self._capture_layers(features)

        def attend(li: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.k[li], cache.v[li]
            for b in range(bsz):
                kc[b].index_copy_(1, slots[b], k[b].transpose(0, 1).to(kc.dtype))
                vc[b].index_copy_(1, slots[b], v[b].transpose(0, 1).to(vc.dtype))
            out, _ = ops.tree_attention(q.to(kc.dtype), kc, vc, cache_len, tree_mask_packed, self.scale)
            return out

        x, captured = self._decoder(self.embed[input_ids], cos, sin, attend, capture)
        x = rms_norm(x, self.norm, cfg.rms_norm_eps)
        logits = self.lm_head(x).float()
        if features is None:
            return logits
        return logits, (x if features == "final" else torch.cat(captured, dim=-1))

    def _capture_layers(self, features) -> list[int]:
        capture = [] if features is None or features == "final" else [int(i) for i in features]
        for i in capture:
            if not 0 <= i < self.cfg.num_layers:
                raise ValueError(f"features: layer {i} is outside [0, {self.cfg.num_layers})")
        return capture

    def flatten_layers(self) -> None:
        """The per-layer tensors ``turbospec::llama_layers`` takes, or None when it cannot run
        (unpacked weights, no C++ kernel)."""
        from .ops import has_op
        self._flat = None
        if not (self.device.type == "cpu" and has_op("llama_layers")):
            return
        flat = []
        for layer in self.layers:
            lins = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if any(lin.row_weight is None or lin.packed_rows is None for lin in lins):
                return
            flat += [layer.attn_norm, layer.qkv.row_weight, layer.qkv.packed_rows, layer.o.row_weight,
                     layer.o.packed_rows, layer.mlp_norm, layer.gate_up.row_weight, layer.gate_up.packed_rows,
                     layer.down.row_weight, layer.down.packed_rows]
            if self.cfg.qkv_bias:
                flat.append(layer.qkv.bias)
        self._flat = flat
