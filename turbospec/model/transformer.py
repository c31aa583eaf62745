"""turbospec's own compact Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2).

No HF modeling code runs here: weights are loaded (``loader.py``) into plain tensors or GGUF blocks
kept as stored (``quant.py``), the q/k/v and gate/up projections are fused into one linear each
(fewer, wider GEMVs), and on CPU every linear runs turbospec's own kernel (``turbospec::linear``).
Attention (``turbospec::tree_attention``) reads the static KV cache (``kv_cache.py``) over the valid
prefix plus the new tokens, under an arbitrary tree mask. Both reduce in one order per row, so a
token's numbers do not depend on how many tokens share the pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from ..ops import reference
from .gguf import is_mapped, release_pages
from .kv_cache import KVCache
from .rope import RopeTable, rope_inv_freq, rope_parameters, rotate
from .quant import QuantWeight
from ..ops.limits import MAX_TREE_NODES
from ..ops.reference import DENSE_FORMATS, is_block_format

_CPU_RMS_NORM = ops.has_op("rms_norm")  # the C++ kernel is built (the C++ layer loop uses it too)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma3_text", "mixtral",
                         "qwen3_moe", "olmoe")


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
    # sliding-window attention (Mistral, Phi-3, Qwen2/3 with use_sliding_window, Gemma): each query
    # attends the last ``sliding_window`` positions in the layers ``layer_windows`` marks (0: full
    # attention; None: every layer), through tree_attention's window.
    sliding_window: int | None = None
    layer_windows: list[int] | None = None
    # RMS norms of q and k before the rotary embedding: "head" over each head (weights [head_dim]:
    # Qwen3), "full" over the whole projection (weights [heads * head_dim]: OLMo 2); None: none
    qk_norm: str | None = None
    # where a layer's RMS norms sit: "pre" x + attn(norm(x)), x + mlp(norm(x)); "post" (OLMo 2)
    # x + norm(attn(x)), x + norm(mlp(x)); "sandwich" (Gemma) x + norm(attn(norm(x))), ... both
    norm_layout: str = "pre"
    activation: str = "silu"           # the MLP's gate activation: "silu" or "gelu_tanh" (Gemma)
    embed_scale: float | None = None   # the embeddings are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None    # the attention's softmax scale (None: 1 / sqrt(head_dim))
    # the rotary embedding of the sliding-window layers when it differs from the others' (Gemma 3)
    rope_local_theta: float | None = None
    rope_local_scaling: dict | None = None
    # logit soft-capping (Gemma 2): attention scores s -> cap * tanh(s / cap), and the final logits
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # mixture of experts (Mixtral, Qwen3-MoE, OLMoE): each token's MLP is the weighted sum of the
    # ``experts_per_token`` experts its router scores highest (softmax; renormalised over those when
    # ``moe_norm_topk``), in the layers ``moe_layers`` lists (the others have a dense MLP)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_norm_topk: bool = False
    moe_layers: list[int] | None = None

    def windows(self) -> list[int]:
        """Each layer's sliding window (0: full attention)."""
        if self.sliding_window is None:
            return [0] * self.num_layers
        return list(self.layer_windows) if self.layer_windows is not None else [self.sliding_window] * self.num_layers

    @classmethod
    def from_hf(cls, cfg) -> "ModelConfig":
        """From a ``transformers`` config; raises ValueError for unsupported architectures."""
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} (architectures {getattr(cfg, 'architectures', None)}) is "
                             f"not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)} "
                             f"(Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4, OLMo 2, Gemma 2/3, SmolLM2; "
                             f"mixtures of experts: Mixtral, Qwen3-MoE, OLMoE)")
        gemma = mt in ("gemma2", "gemma3_text")
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
        activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act)
        if activation is None or (activation == "gelu_tanh" and not gemma):
            raise ValueError(f"hidden_act {act!r} ({mt}) is not supported; only 'silu' (and Gemma's "
                             f"'gelu_pytorch_tanh')")
        caps = {c: getattr(cfg, c, None) for c in ("attn_logit_softcapping", "final_logit_softcapping")}
        for cap, v in caps.items():
            if v is not None and (not gemma or float(v) <= 0):
                raise ValueError(f"{cap}={v} ({mt}) is not supported: logit soft-capping is implemented for "
                                 f"Gemma 2 / 3 (a positive cap) only")
        # Llama / Mistral / Qwen3's attention_bias puts biases on q, k, v *and* o; mlp_bias on the MLP's
        # three projections: neither is implemented (Qwen2's q/k/v biases are)
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(cfg, flag, False):
                raise ValueError(f"{flag}=True ({mt}) is not supported: biases on the "
                                 f"{'attention' if flag == 'attention_bias' else 'MLP'} projections are not "
                                 f"implemented; only Qwen2's q/k/v biases are")
        partial = [v for v in (getattr(cfg, "partial_rotary_factor", None),
                                (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor"))
                   if v is not None]
        if any(float(v) != 1.0 for v in partial):
            raise ValueError(f"partial_rotary_factor {partial[0]} ({mt}) is not supported: the rotary embedding "
                             f"covers the whole head (partial_rotary_factor 1.0) only")
        rp = getattr(cfg, "rope_parameters", None)
        local_theta = local_scaling = None
        if isinstance(rp, dict) and "full_attention" in rp:  # per layer type (Gemma 3)
            if "sliding_attention" in rp and rp["sliding_attention"] != rp["full_attention"]:
                local_theta, local_scaling = rope_parameters({"rope_parameters": rp["sliding_attention"]})
            rp = rp["full_attention"]
        theta, scaling = rope_parameters({"rope_parameters": rp,
                                          "rope_scaling": None if rp else getattr(cfg, "rope_scaling", None),
                                          "rope_theta": getattr(cfg, "rope_theta", None)})
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        eos = getattr(cfg, "eos_token_id", None)
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = getattr(cfg, "sliding_window", None)
        if mt in ("qwen2", "qwen3", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
            window = None  # Qwen2/3 configs carry a window they do not use unless use_sliding_window
        if mt == "llama":
            window = None
        layer_windows = None
        types = getattr(cfg, "layer_types", None)
        if window and types is not None:
            bad = set(types) - {"full_attention", "sliding_attention"}
            if bad:
                raise ValueError(f"layer_types {sorted(bad)} ({mt}) are not supported; full_attention and "
                                 f"sliding_attention are")
            layer_windows = [int(window) if t == "sliding_attention" else 0 for t in types]
            if not any(layer_windows):
                window, layer_windows = None, None
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=n_heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=theta, rope_scaling=scaling,
            qkv_bias=mt == "qwen2",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096) or 4096,
            model_type=mt, eos_token_ids=eos, sliding_window=int(window) if window else None,
            layer_windows=layer_windows,
            qk_norm={"qwen3": "head", "olmo2": "full", "gemma3_text": "head", "qwen3_moe": "head", "olmoe": "full"}.get(mt),
            norm_layout="sandwich" if gemma else {"olmo2": "post"}.get(mt, "pre"), activation=activation,
            attn_softcap=caps["attn_logit_softcapping"], final_softcap=caps["final_logit_softcapping"],
            embed_scale=float(cfg.hidden_size) ** 0.5 if gemma else None,
            attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else None,
            rope_local_theta=local_theta, rope_local_scaling=local_scaling, **_moe_fields(cfg, mt))


def _moe_fields(cfg, mt: str) -> dict:
    """ModelConfig's mixture-of-experts fields from a transformers config (none for a dense model)."""
    if mt not in ("mixtral", "qwen3_moe", "olmoe"):
        return {}
    n = cfg.num_local_experts if mt == "mixtral" else cfg.num_experts
    layers = list(range(cfg.num_hidden_layers))
    if mt == "qwen3_moe":  # dense MLPs in mlp_only_layers and between every decoder_sparse_step-th layer
        step, dense = getattr(cfg, "decoder_sparse_step", 1) or 1, set(getattr(cfg, "mlp_only_layers", None) or [])
        layers = [i for i in layers if i not in dense and (i + 1) % step == 0]
    return dict(num_experts=int(n), experts_per_token=int(cfg.num_experts_per_tok),
                moe_intermediate_size=int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size),
                moe_norm_topk=True if mt == "mixtral" else bool(getattr(cfg, "norm_topk_prob", False)),
                moe_layers=layers)


ACTIVATION_MODES = {"exact": 0, "int8": 8}  # -> the ``activations`` argument of turbospec::linear
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_as_stored(t: Tensor, kc: Tensor, bf16_products: bool) -> Tensor:
    """New K or V rows as a cache ``kc`` stores them: in its dtype and, where attention over it takes
    bf16_products, every value below 2^-50 in magnitude as +0 (what ``tree_attention`` reads it as: the
    C++ layer loop stores it so and skips that flush at every read). The same values either way."""
    t = t.to(kc.dtype)
    return t.masked_fill(t.abs() < 2.0 ** -50, 0) if bf16_products else t


def attn_query(q: Tensor, kc: Tensor) -> Tensor:
    """q as tree_attention takes it over cache ``kc``: float32 over a 16-bit CPU cache (the CPU kernel
    widens the cache's values), else in the cache's dtype."""
    if kc.device.type == "cpu" and kc.dtype in (torch.float16, torch.bfloat16):
        return q.float()
    return q.to(kc.dtype)


LOGITS_MODES = ("all", "last", "none", "normed")

MOE_DISPATCHES = ("auto", "index", "masked")  # Transformer.moe_dispatch


class Linear:
    """y = x @ W^T (+ b), W kept in its storage format.

    ``weight``: a dense [N, K] tensor, a ``QuantWeight`` (GGUF blocks), or a list of those stacked
    along N (a fused q/k/v whose parts may differ in format; adjacent parts of one format are
    merged). On CPU with turbospec's kernels built every call runs ``turbospec::linear`` (one
    reduction order for any number of rows: a verify pass computes for each token exactly what a
    one-token step computes); elsewhere F.linear on the dense (dequantized) weight."""

    def __init__(self, weight, bias: Tensor | None = None):
        from ..ops import has_op
        parts = weight if isinstance(weight, (list, tuple)) else [weight]
        self.bias = bias
        self.weights: list[Tensor] = []
        self.formats: list[int] = []
        for p in parts:
            data, fmt = (p.data, p.fmt) if isinstance(p, QuantWeight) else (p.contiguous(), DENSE_FORMATS.get(p.dtype))
            if fmt is None:
                raise ValueError(f"Linear: weight dtype {p.dtype} is not supported; float32, float16, bfloat16 "
                                 f"or GGUF blocks")
            if self.formats and self.formats[-1] == fmt:
                merged = torch.cat((self.weights[-1], data))
                for w in (self.weights[-1], data):  # (a GGUF's pages, once copied: see release_pages)
                    release_pages(w)
                self.weights[-1] = merged
            else:
                self.weights.append(data)
                self.formats.append(fmt)
        first = parts[0]
        self.in_features = first.k if isinstance(first, QuantWeight) else first.shape[1]
        self.out_features = sum(w.shape[0] for w in self.weights)
        self.device = self.weights[0].device
        self.quantized = any(map(is_block_format, self.formats))
        self.kernel = self.device.type == "cpu" and has_op("linear")
        if self.quantized and self.device.type != "cpu":
            raise ValueError(f"GGUF-quantized weights run on CPU only (got device {self.device}); load the "
                             f"model with weights='dense' for {self.device.type}")
        self._dense = None if (self.kernel or self.quantized) else self.dense()
        self.activations = 0  # 8: int8 activations for the GGUF block segments (Transformer.set_activations)
        self.set_layout()

    def set_layout(self) -> None:
        """Q4_0 / Q4_1 / Q5_0 / Q8_0 segments in the layout the CPU kernels read fastest where they run
        their AVX-512 path: with exact activations grouped (``reference.group_blocks``: each row's
        scales side by side; Q4_1 decode 1.15-1.3x faster in bench/RESULTS.md run 19); with int8
        activations on every path Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K segments of whole groups of 16 rows
        interleaved (``reference.interleave_blocks``: the int8 kernels' 16-row tiles, 2-4x the older
        kernel's speed, bench/results/2026-11-29-int8-interleaved.md; every segment of the linear
        must take int8 activations), else GGUF's. The same values in every layout; grouped and GGUF
        order give the same bits on every kernel path, the interleaved layout its own order
        (``reference.linear_int8``), the same on every path too."""
        from ..ops import cpu_isa
        avx512 = self.kernel and cpu_isa() == "avx512"
        k = self.in_features
        plain = [reference.grouped_base(f) or reference.interleaved_base(f) or f for f in self.formats]
        # int8 activations: every segment takes them (GGUF blocks) or the call keeps exact ones
        int8 = self.kernel and self.activations == 8 and k % 32 == 0 and all(map(reference.has_int8_kernel, plain))
        for i, f in enumerate(self.formats):
            base = plain[i]
            if int8 and base in reference.INTERLEAVED and self.weights[i].shape[0] % reference.INTERLEAVE_ROWS == 0:
                want = reference.INTERLEAVED[base]
            elif avx512 and self.activations == 0 and base in reference.GROUPED:
                want = reference.GROUPED[base]
            else:
                want = base
            if want == f:
                continue
            old = w = self.weights[i]
            if reference.grouped_base(f) is not None:
                w = reference.ungroup_blocks(w, f, k)
            elif reference.interleaved_base(f) is not None:
                w = reference.deinterleave_blocks(w, f, k)
            if want in reference.GROUPED.values():
                w = reference.group_blocks(w, base, k)
            elif want in reference.INTERLEAVED.values():
                w = reference.interleave_blocks(w, base, k)
            self.weights[i], self.formats[i] = w, want
            release_pages(old)  # (a GGUF's pages, once copied)

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight as one dense [N, K] tensor (GGUF blocks dequantized exactly), in ``dtype``
        (default: float32 if any part is quantized, else the stored dtype)."""
        from ..ops import dequantize
        parts = [dequantize(w, f, self.in_features) if is_block_format(f) else w
                 for w, f in zip(self.weights, self.formats)]
        if dtype is None:
            dtype = torch.float32 if self.quantized else parts[0].dtype
        return torch.cat([p.to(dtype) for p in parts])

    def __call__(self, x: Tensor) -> Tensor:
        if self.kernel:
            return torch.ops.turbospec.linear(x, self.weights, self.formats, self.bias, self.activations)
        if self.activations == 8 and self.quantized:
            from ..ops import linear
            return linear(x, self.weights, self.formats, self.bias, activations=8)
        w = self._dense if self._dense is not None else self.dense(x.dtype)
        return F.linear(x, w.to(x.dtype), self.bias)


class CappedLinear(Linear):
    """An LM head whose logits are soft-capped (Gemma 2): cap * tanh(logits / cap), in the logits' dtype
    as transformers computes them. Every row alone, so the lazy LM head's rows keep their bits."""

    def __init__(self, weight, bias: Tensor | None = None, cap: float = 30.0):
        super().__init__(weight, bias)
        self.cap = float(cap)

    def __call__(self, x: Tensor) -> Tensor:
        y = super().__call__(x)
        return torch.tanh(y / self.cap) * self.cap


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _CPU_RMS_NORM and x.device.type == "cpu" and weight.dtype == x.dtype \
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and not (x.requires_grad or weight.requires_grad):
        # one fixed order in every dtype (llama_layers runs the same kernel); the roundings of the
        # formula below, whose sum of squares is torch's own order
        return ops.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # bit-identical to the formula below
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Layer:
    def __init__(self, w: dict):
        self.qkv = Linear(w["qkv"], w.get("qkv_bias"))
        self.o = Linear(w["o"])
        # a dense MLP (gate_up, down), or a router [E, hidden] and each expert's (gate_up, down)
        self.gate_up = Linear(w["gate_up"]) if "gate_up" in w else None
        self.down = Linear(w["down"]) if "down" in w else None
        self.router = Linear(w["router"]) if "router" in w else None
        self.experts = None if self.router is None else [
            (Linear(w[f"experts.{e}.gate_up"]), Linear(w[f"experts.{e}.down"])) for e in range(self.router.out_features)]
        self.attn_norm, self.mlp_norm = w.get("attn_norm"), w.get("mlp_norm")
        self.q_norm, self.k_norm = w.get("q_norm"), w.get("k_norm")  # q / k norms (Qwen3, OLMo 2, Gemma 3)
        # norms of the sublayers' outputs (OLMo 2, Gemma); attn_norm / mlp_norm (their inputs') may be None
        self.attn_post_norm, self.mlp_post_norm = w.get("attn_post_norm"), w.get("mlp_post_norm")

    def linears(self) -> tuple[Linear, ...]:
        """qkv, o, gate_up, down; for a mixture of experts qkv, o, the router and every expert's two."""
        if self.experts is None:
            return self.qkv, self.o, self.gate_up, self.down
        return (self.qkv, self.o, self.router) + tuple(lin for pair in self.experts for lin in pair)


# Packed causal masks (tree_attention's tree_mask_packed): row i attends tokens 0..i (bit 63 is the sign).
_CHAIN_MASK = torch.tensor([(1 << (i + 1)) - 1 for i in range(MAX_TREE_NODES - 1)] + [-1], dtype=torch.int64)


def pack_tree_mask(tree_mask: Tensor) -> Tensor:
    """bool [B, n, n] (n <= 64) -> int64 [B, n]: bit j of row i set iff token i attends token j."""
    n = tree_mask.shape[-1]
    shifts = torch.arange(n, device=tree_mask.device)
    return (tree_mask.long() << shifts).sum(-1)


class Transformer:
    """Forward over new tokens against a static KV cache.

    Weights are a flat dict in turbospec names (see ``loader.convert_hf_state_dict``): dense tensors,
    ``QuantWeight``s, or for the fused qkv / gate_up lists of parts."""

    def __init__(self, cfg: ModelConfig, weights: dict):
        self.cfg = cfg
        embed = weights["embed"]
        self.quantized = any(isinstance(v, QuantWeight) or (isinstance(v, list) and any(isinstance(p, QuantWeight)
                             for p in v)) for v in weights.values())
        self.norm = weights["norm"]
        self.dtype, self.device = self.norm.dtype, self.norm.device
        # The embedding: a dense table, or a quantized one kept as stored whose looked-up rows are
        # dequantized (exactly: the same values as the whole table dequantized), so that a GGUF's
        # table costs its stored bytes; ``embed`` gives the dense table (made on first use: draft heads,
        # training). The LM head keeps the stored blocks.
        self._embed_blocks = embed if isinstance(embed, QuantWeight) else None
        self._embed = None if self._embed_blocks is not None else embed
        self.layers = [Layer({k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")})
                       for i in range(cfg.num_layers)]
        head = weights.get("lm_head", embed)
        self.lm_head = Linear(head) if cfg.final_softcap is None else CappedLinear(head, cap=cfg.final_softcap)
        self._head_blocks = head if head is not embed and isinstance(head, QuantWeight) else None
        self._lm_head_weight = None if head is embed or self._head_blocks is not None else head
        self.rope_table = RopeTable(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), self.dtype,
                                    self.device)
        # the sliding-window layers' own rotary table (Gemma 3), else None
        self.rope_local = None if cfg.rope_local_theta is None else RopeTable(
            rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, cfg.rope_local_scaling), self.dtype, self.device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.windows = cfg.windows()  # per layer: its sliding window (0: none)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        self._embed_scale = None if cfg.embed_scale is None else \
            torch.tensor(cfg.embed_scale, dtype=self.dtype, device=self.device)  # (made once: no per-step tensor)
        self.use_cpp_layers = True  # run the layer loop in C++ when the kernel is built (bit-identical)
        self.matmuls = "kernels"  # use_torch_matmuls: "torch"
        self.fused_layers = None  # static path: None = the fused kernels where they run (CUDA); True / False forces
        self._fused_kernels: bool | None = None
        self.activations = "exact"
        self.kv_cache_dtype = "auto"  # set_kv_cache_dtype
        # the experts' dispatch (mixtures of experts): "index" (the rows routed to each expert, read on
        # the host; the C++ layer loop's on CPU), "masked" (fixed shapes, no host read: the Python loop),
        # "auto": index on CPU, masked elsewhere (see _experts_masked)
        self._moe_dispatch = "auto"
        self.flatten_layers()

    @property
    def embed(self) -> Tensor:
        """The embedding table [V, H], dense in the model dtype (a quantized one dequantized once,
        on first use)."""
        if self._embed is None:
            self._embed = self._embed_blocks.dequantize(self.dtype)
        return self._embed

    @property
    def lm_head_weight(self) -> Tensor:
        """The LM head's weight [V, H], dense (draft heads share it; tied: the embedding itself); a
        quantized head is dequantized once, on first use, beside the blocks ``lm_head`` computes with."""
        if self._lm_head_weight is None:
            self._lm_head_weight = self.embed if self._head_blocks is None else self._head_blocks.dequantize(self.dtype)
        return self._lm_head_weight

    def embedding(self, input_ids: Tensor) -> Tensor:
        """The rows of the embedding table for ``input_ids`` [...] -> [..., H] (unscaled), from the dense
        table if it is made, else dequantized from the stored blocks (the same values)."""
        if self._embed is not None:
            return self._embed[input_ids]
        rows = self._embed_blocks.rows(input_ids.reshape(-1)).dequantize(self.dtype)
        return rows.reshape(*input_ids.shape, rows.shape[-1])

    @property
    def moe_dispatch(self) -> str:
        return self._moe_dispatch

    @moe_dispatch.setter
    def moe_dispatch(self, mode: str) -> None:
        if mode not in MOE_DISPATCHES:
            raise ValueError(f"moe_dispatch must be one of {', '.join(MOE_DISPATCHES)}, got {mode!r}")
        self._moe_dispatch = mode

    def set_activations(self, mode: str) -> "Transformer":
        """"exact" (default): activations stay in the model dtype, a GGUF-quantized model computes
        what the dequantized model computes. "int8": the linears with GGUF block weights quantize
        their input to int8 per 32 values and use integer dot products (what llama.cpp does; faster
        on CPU, not the dequantized model's result, still batch-invariant: speculative output stays
        equal to plain decoding in this mode). Dense weights are unaffected."""
        if mode not in ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, got {mode!r}")
        if mode == "int8" and self.device.type != "cpu":
            raise ValueError(f"activations='int8' runs on CPU only (got device {self.device})")
        self.activations = mode
        for lin in [self.lm_head] + [l for layer in self.layers for l in layer.linears()]:
            lin.activations = ACTIVATION_MODES[mode]
            lin.set_layout()
        self.flatten_layers()
        return self

    def attn_bf16_products(self, cache: Tensor) -> bool:
        """Whether attention over ``cache`` (a layer's K or V cache) rounds its queries and probabilities
        to bfloat16 (``tree_attention``'s bf16_products): with int8 activations over a bfloat16 cache
        (the int8 mode's default cache), as the C++ layer loop does. Both products are then of
        bfloat16 values, on vdpbf16ps where the CPU has AVX-512 BF16 (a float32 attention pays a
        multiply and an add for each of its products: in a 17-row verify over 300 cached tokens it was a
        fifth of the pass; bench/results/2026-12-02-bf16-attention.md)."""
        return self.activations == "int8" and cache.dtype == torch.bfloat16 and cache.device.type == "cpu"

    def set_kv_cache_dtype(self, mode: str) -> "Transformer":
        """The dtype of the K/V caches ``new_cache`` makes: "auto" (default: the model's dtype; a
        16-bit model's K/V values are already rounded to it, so on CPU its cache gives the bits a
        float32 cache gives, in half the bytes; with int8 activations bfloat16, and the attention's
        products of bfloat16 values, ``attn_bf16_products``), "float32", "float16" or "bfloat16". A 16-bit cache
        halves the bytes attention reads per token (what a decode step of many long requests waits
        on); a float32 model's K/V are then rounded to it (to nearest even), so its output is no
        longer the float32 model's, but speculative output still equals plain decoding with the same
        cache dtype. Off CPU only "auto" or the model's dtype."""
        if mode not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {mode!r}")
        if mode != "auto" and self.device.type != "cpu" and KV_CACHE_DTYPES[mode] != self.dtype:
            raise ValueError(f"kv_cache_dtype={mode!r} runs on CPU only: on {self.device} the cache holds the "
                             f"model's dtype ({str(self.dtype).removeprefix('torch.')}; kv_cache_dtype='auto')")
        self.kv_cache_dtype = mode
        return self

    def first_layers(self, num_layers: int) -> "Transformer":
        """A model of this one's first ``num_layers`` layers, final norm and LM head, sharing its weights
        (a layer-skip self-speculative draft); its rotary table is its own."""
        m = object.__new__(Transformer)
        m.__dict__.update(self.__dict__)
        lw = self.cfg.layer_windows
        m.cfg = replace(self.cfg, num_layers=num_layers, layer_windows=None if lw is None else lw[:num_layers])
        m.layers = self.layers[:num_layers]
        m.windows = self.windows[:num_layers]
        m.flatten_layers()
        m.rope_table = RopeTable(self.rope_table.inv_freq, self.dtype, self.device)
        if self.rope_local is not None:
            m.rope_local = RopeTable(self.rope_local.inv_freq, self.dtype, self.device)
        return m

    def new_cache(self, max_seq_len: int, batch_size: int = 1) -> KVCache:
        # "auto": the model's dtype (on CPU the attention kernel widens a 16-bit cache under float32
        # queries: the bits of a float32 cache holding the same rounded values); with int8 activations
        # bfloat16 (attn_bf16_products)
        dtype = KV_CACHE_DTYPES[self.kv_cache_dtype] or (torch.bfloat16 if self.activations == "int8" else self.dtype)
        return KVCache(self.cfg.num_layers, batch_size, self.cfg.num_kv_heads, max_seq_len,
                       self.cfg.head_dim, dtype, self.device)

    def rope(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sign-folded sin [B, n, 1, D] at ``position_ids`` [B, n] (the table grows as needed);
        for a model whose sliding-window layers rotate by their own table (``rope_local``), both
        tables' [2, B, n, 1, D] (global first; ``layer_rope`` picks a layer's)."""
        cos, sin = self.rope_table.lookup(position_ids)
        if self.rope_local is None:
            return cos.unsqueeze(2), sin.unsqueeze(2)
        cl, sl = self.rope_local.lookup(position_ids)
        return torch.stack((cos, cl)).unsqueeze(3), torch.stack((sin, sl)).unsqueeze(3)

    def _rope_static(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``rope`` without growing the tables or reading the device (``ensure_rope`` made them cover)."""
        cos, sin = self.rope_table.cos[position_ids].unsqueeze(2), self.rope_table.sin[position_ids].unsqueeze(2)
        if self.rope_local is None:
            return cos, sin
        cl, sl = self.rope_local.cos[position_ids].unsqueeze(2), self.rope_local.sin[position_ids].unsqueeze(2)
        return torch.stack((cos, cl)), torch.stack((sin, sl))

    def layer_rope(self, li: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``li``'s cos / sin from ``rope``'s output (the local table's for a sliding-window layer)."""
        if cos.dim() == 4:
            return cos, sin
        j = 1 if self.windows[li] else 0
        return cos[j], sin[j]

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The embeddings of ``input_ids`` as the first layer reads them (Gemma scales them by sqrt(hidden),
        rounded to the model's dtype as transformers does)."""
        x = self.embedding(input_ids)
        return x if self._embed_scale is None else x * self._embed_scale

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, position_ids: Tensor, cache: KVCache, cache_len: int,
                tree_mask: Tensor | None = None, logits: str = "all", features=None):
        """Run ``input_ids [B, n]`` at ``position_ids [B, n]``; their K/V are written to cache
        slots [cache_len, cache_len + n). Each new token attends to the whole valid prefix
        [0, cache_len) and, among the new tokens, to those allowed by ``tree_mask`` (bool [B, n, n],
        n <= 64; None = causal, any n: runs in passes of 64 tokens). ``logits``: "all" -> [B, n, V]
        float32, "last" -> [B, 1, V], "none" -> None, "normed" -> the final-normed hidden state
        [B, n, hidden] in their place, for a caller that applies ``lm_head`` to the rows it needs
        (on CPU the LM head's rows are batch-invariant: a row alone gives the bits it gives in "all").

        ``features`` (what draft heads read): None -> only the logits are returned; "final" ->
        (logits, the final-normed hidden state [B, n, hidden], what the LM head reads: Medusa,
        EAGLE-1/2); a tuple of layer indices -> (logits, [B, n, len * hidden], the residual streams
        after those layers, concatenated: EAGLE-3).

        Every token's numbers are the same whatever else shares the pass (the linears and the
        attention reduce in one order per row), so a prompt prefilled in one call equals the same
        prompt decoded token by token, and a verified draft token equals the token decoded alone.
        """
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        bsz, n = input_ids.shape
        if cache_len + n > cache.max_seq_len:
            raise ValueError(f"cache overflow: cache_len {cache_len} + {n} new tokens > max_seq_len "
                             f"{cache.max_seq_len}")
        # use_torch_matmuls: a causal pass of any length is one pass through SDPA
        whole = self.matmuls != "kernels" and tree_mask is None
        if n > MAX_TREE_NODES:
            if tree_mask is not None:
                raise ValueError(f"tree_mask covers at most {MAX_TREE_NODES} new tokens, got n = {n}")
            if not whole:
                return self._forward_passes(input_ids, position_ids, cache, cache_len, logits, features)
        cfg = self.cfg
        cos, sin = self.rope(position_ids)
        capture = self._capture_layers(features)
        x = self.embed_tokens(input_ids)
        packed = None if whole else \
            _CHAIN_MASK[:n].to(self.device)[None] if tree_mask is None else pack_tree_mask(tree_mask)
        if whole:
            x, captured = self.layers_sdpa(x, cos, sin, None, cache, cache_len, capture)
        elif self._cpp_loop():
            norms, weights, formats, counts, biases, qk_norms = self._flat
            x, *captured = torch.ops.turbospec.llama_layers(
                x, cos, sin, packed, norms, weights, formats, counts, biases, cache.k, cache.v, cache_len,
                cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, self.scale, capture,
                qk_norms, ACTIVATION_MODES[self.activations], None, self._cpp_layout, self._cpp_windows,
                self._cpp_act, cfg.attn_softcap or 0.0, self._cpp_experts, cfg.experts_per_token, cfg.moe_norm_topk)
        else:
            x, captured = self.layers_python(x, cos, sin, packed, cache, cache_len, capture)
        if logits == "none" and features != "final":
            return None if features is None else (None, torch.cat(captured, dim=-1))
        if logits == "last" and features is None:
            x = x[:, -1:]
        x = rms_norm(x, self.norm, cfg.rms_norm_eps)
        if logits == "none":
            out = None
        elif logits == "normed":
            out = x
        else:
            out = self.lm_head(x[:, -1:] if logits == "last" else x).float()
        if features is None:
            return out
        return out, (x if features == "final" else torch.cat(captured, dim=-1))

    def _forward_passes(self, input_ids, position_ids, cache, cache_len, logits, features):
        """``forward`` over more than 64 causal tokens: consecutive passes of 64."""
        n = input_ids.shape[1]
        outs, feats = [], []
        for s in range(0, n, MAX_TREE_NODES):
            e = min(n, s + MAX_TREE_NODES)
            mode = logits if logits != "last" or e == n else "none"
            r = self.forward(input_ids[:, s:e], position_ids[:, s:e], cache, cache_len + s, None, mode, features)
            lg, ft = (r, None) if features is None else r
            outs.append(lg)
            feats.append(ft)
        lg = None if logits == "none" else (outs[-1] if logits == "last" else torch.cat(outs, dim=1))
        return lg if features is None else (lg, torch.cat(feats, dim=1))

    def layers_python(self, x: Tensor, cos: Tensor, sin: Tensor, tree_mask_packed: Tensor, cache: KVCache,
                      cache_len: int, capture=()) -> tuple[Tensor, list[Tensor]]:
        """The decoder layers over n <= 64 new tokens; the specification of the C++ kernel
        ``turbospec::llama_layers`` (bit-identical). ``tree_mask_packed``: int64 [B or 1, n]."""
        bsz, n = x.shape[:2]
        total = cache_len + n
        lens = torch.full((bsz,), cache_len, dtype=torch.int64, device=x.device)
        mask = tree_mask_packed.expand(bsz, n).contiguous()

        def attend(li: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.k[li], cache.v[li]
            bf16 = self.attn_bf16_products(kc)
            kc[:, :, cache_len:total] = kv_as_stored(k.transpose(1, 2), kc, bf16)
            vc[:, :, cache_len:total] = kv_as_stored(v.transpose(1, 2), vc, bf16)
            out, _ = ops.tree_attention(attn_query(q, kc), kc, vc, lens, mask, self.scale, window=self.windows[li],
                                        softcap=self.cfg.attn_softcap or 0.0, bf16_products=bf16)
            return out

        return self._decoder(x, cos, sin, attend, capture)

    def layers_sdpa(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache,
                    cache_len: int, capture=()) -> tuple[Tensor, list[Tensor]]:
        """The decoder layers with an arbitrary attention mask (bool [B or 1, 1, n, cache_len + n], or
        None: causal) through SDPA: for batched self-distillation, whose rows are left-padded (each
        row's tokens sit in consecutive slots, so a sliding window is a window of slots)."""
        n = x.shape[1]
        total = cache_len + n
        if mask is None:
            mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril_(cache_len)[None, None]
        q_slot = torch.arange(cache_len, total, device=x.device)[:, None]
        k_slot = torch.arange(total, device=x.device)[None, :]
        # query slot cache_len + i attends key slots > its own - w
        windowed = {w: mask & (k_slot > q_slot - w) for w in set(self.windows) - {0}}

        def attend(li: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.k[li], cache.v[li]
            kc[:, :, cache_len:total] = k.transpose(1, 2)
            vc[:, :, cache_len:total] = v.transpose(1, 2)
            m = windowed[self.windows[li]] if self.windows[li] else mask
            if self.cfg.attn_softcap:  # SDPA has no soft-capping: the attention written out (Gemma 2)
                group = q.shape[2] // kc.shape[1]
                keys = kc[:, :, :total].repeat_interleave(group, 1).float()
                vals = vc[:, :, :total].repeat_interleave(group, 1).float()
                sc = torch.einsum("bnhd,bhkd->bhnk", q.float(), keys) * self.scale
                sc = (torch.tanh(sc / self.cfg.attn_softcap) * self.cfg.attn_softcap).masked_fill(~m, float("-inf"))
                out = torch.einsum("bhnk,bhkd->bhnd", torch.softmax(sc, dim=-1), vals).to(kc.dtype)
            else:  # float32 math over a 16-bit CPU cache, as the verify kernel does (use_torch_matmuls: the cache's)
                q_ = attn_query(q, kc) if self.matmuls == "kernels" else q.to(kc.dtype)
                out = F.scaled_dot_product_attention(q_.transpose(1, 2), kc[:, :, :total].to(q_.dtype),
                                                     vc[:, :, :total].to(q_.dtype), attn_mask=m, scale=self.scale,
                                                     enable_gqa=True)
            return out.transpose(1, 2)

        return self._decoder(x, cos, sin, attend, capture)

    def _decoder(self, x: Tensor, cos: Tensor, sin: Tensor, attend, capture=()) -> tuple[Tensor, list[Tensor]]:
        """The layer loop around ``attend(layer, q, k, v)`` (q [B, n, H, D], k / v [B, n, H_kv, D],
        rotated; it stores k / v in the cache and returns the attention output [B, n, H, D])."""
        cfg = self.cfg
        bsz, n = x.shape[:2]
        h_kv, d = cfg.num_kv_heads, cfg.head_dim
        captured: list = [None] * len(capture)
        eps = cfg.rms_norm_eps
        norm = lambda t, w: t if w is None else rms_norm(t, w, eps)  # noqa: E731 (a missing norm: none)
        act = F.silu if cfg.activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
        for li, layer in enumerate(self.layers):
            h = norm(x, layer.attn_norm)
            qkv = self._qk_norm(layer, layer.qkv(h).view(bsz, n, cfg.num_heads + 2 * h_kv, d))
            qk = rotate(qkv[:, :, : cfg.num_heads + h_kv], *self.layer_rope(li, cos, sin))  # q and k heads at once
            attn = attend(li, qk[:, :, : cfg.num_heads], qk[:, :, cfg.num_heads:], qkv[:, :, cfg.num_heads + h_kv:])
            x = x + norm(layer.o(attn.to(self.dtype).reshape(bsz, n, self.q_size)), layer.attn_post_norm)
            h = norm(x, layer.mlp_norm)
            if layer.experts is not None:
                y = self._moe(layer, h, act)
            else:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                y = layer.down(act(gate) * up)
            x = x + norm(y, layer.mlp_post_norm)
            for j, c in enumerate(capture):
                if c == li:
                    captured[j] = x
        return x, captured

    def _moe(self, layer: Layer, h: Tensor, act) -> Tensor:
        """A mixture-of-experts MLP over h [B, n, hidden]: each token's router softmax (float32), its
        top ``experts_per_token`` experts (renormalised when ``moe_norm_topk``), their weights in the
        model's dtype, and the weighted sum of those experts' outputs, added expert by expert in expert
        order (out = 0, then out = out + w_e * expert_e(h) for each of its experts e ascending, every
        step rounded to the model's dtype). A token's result depends only on the token (the experts'
        linears are batch-invariant and its sum's order is fixed), so it is the same alone or in a
        verify pass. Two dispatches compute it (``moe_dispatch``; the same bits on CPU, tested):
        ``_experts_index`` and ``_experts_masked``."""
        flat = h.reshape(-1, h.shape[-1])
        top, idx = self._route(layer, flat)
        masked = self._moe_dispatch == "masked" or (self._moe_dispatch == "auto" and flat.device.type != "cpu")
        out = (self._experts_masked if masked else self._experts_index)(layer, flat, top, idx, act)
        return out.view(h.shape)

    def _route(self, layer: Layer, flat: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's top ``experts_per_token`` router weights (model dtype) and expert ids [R, k]:
        softmax over all experts in float32, the top k (renormalised to sum 1 when ``moe_norm_topk``:
        Mixtral, Qwen3-MoE with norm_topk_prob; OLMoE keeps the softmax's values)."""
        probs = torch.softmax(layer.router(flat).float(), dim=-1)
        top, idx = torch.topk(probs, self.cfg.experts_per_token, dim=-1)
        if self.cfg.moe_norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(flat.dtype), idx

    @staticmethod
    def _experts_index(layer: Layer, flat: Tensor, top: Tensor, idx: Tensor, act) -> Tensor:
        """The experts over the rows routed to each (index lists read on the host: on CPU the
        cheapest, each expert reads its weights once and computes only its rows)."""
        out = torch.zeros_like(flat)
        for e, (gate_up, down) in enumerate(layer.experts):
            tok, pos = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            gate, up = gate_up(flat[tok]).chunk(2, dim=-1)
            out.index_add_(0, tok, (down(act(gate) * up) * top[tok, pos, None]).to(out.dtype))
        return out

    @staticmethod
    def _experts_masked(layer: Layer, flat: Tensor, top: Tensor, idx: Tensor, act) -> Tensor:
        """The experts with fixed shapes and no host read (what a CUDA graph captures): every expert
        runs over all R rows, and a row takes expert e's output (times its weight, 0 where e is not
        among its top k) only where its routing selected e, by an element-wise select, so the rows
        that did not choose e keep their sum untouched (no +0.0, no inf / NaN of an unused expert).
        A row's additions are those of ``_experts_index``, in the same order, so its bits are the
        same wherever the linears are batch-invariant (CPU).

        Why this for decode-sized passes (1-64 rows), among formulations built from torch ops: a GPU's
        pass over that few rows is bound by reading the weights, not by arithmetic. This reads every
        expert's weights once per layer, whatever the routing, and is exact on CPU (each expert is the
        same batch-invariant Linear). A sort-by-expert or fixed-capacity gather reads only the experts
        used, but running an expert over its segment needs the segment's size on the host (the sync
        this removes) or a grouped kernel reading the bounds on the device; a capacity below R drops
        tokens (not exact), and capacity R is this computation plus a gather. Gathering each
        assignment's expert weights (W[idx], then bmm) reads R * k expert matrices and writes them
        again: cheaper only when 3 R k < E (Mixtral, 8 experts / 2 per token: a single row; Qwen3-MoE,
        128 / 8: up to 5 rows), and not the Linear's arithmetic. With R * k >= E nearly every expert
        is used anyway (Mixtral from 4 rows). The cost: a step reads all E experts where a one-token
        step needs k (E / k = 4 for Mixtral, 16 for Qwen3-MoE's 128 experts); a grouped kernel that
        reads the routing on the device (e.g. torch._grouped_mm with device offsets) would remove it."""
        out = torch.zeros_like(flat)
        for e, (gate_up, down) in enumerate(layer.experts):
            chosen = idx == e                                      # [R, k]: at most one True per row
            w = torch.where(chosen, top, torch.zeros_like(top)).sum(dim=-1, keepdim=True)  # exact: one term
            gate, up = gate_up(flat).chunk(2, dim=-1)
            y = (down(act(gate) * up) * w).to(out.dtype)
            out = torch.where(chosen.any(dim=-1, keepdim=True), out + y, out)
        return out

    def _qk_norm(self, layer: Layer, qkv: Tensor) -> Tensor:
        """The RMS norms of q and k in ``qkv`` [B, n, H + 2 H_kv, D] before the rotary embedding: over each
        head (Qwen3, ``qk_norm`` "head") or over all q / all k values of a token (OLMo 2, "full"); v is
        left as it is. Without q / k norms: ``qkv`` itself."""
        if layer.q_norm is None:
            return qkv
        h, h_kv, eps = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.rms_norm_eps
        q, k = qkv[:, :, :h], qkv[:, :, h:h + h_kv]
        if self.cfg.qk_norm == "full":
            q = rms_norm(q.flatten(2), layer.q_norm, eps).view(q.shape)
            k = rms_norm(k.flatten(2), layer.k_norm, eps).view(k.shape)
        else:
            q, k = rms_norm(q.contiguous(), layer.q_norm, eps), rms_norm(k.contiguous(), layer.k_norm, eps)
        return torch.cat((q, k, qkv[:, :, h + h_kv:]), dim=2)

    def _fused_static(self, cache: KVCache) -> bool:
        """Whether the static path runs ``_decoder_fused``: on CUDA with the fused kernels built and a
        cache in the model's dtype; ``fused_layers`` (True / False) overrides (tests run it on CPU)."""
        cfg = self.cfg
        if cfg.norm_layout != "pre" or cfg.activation != "silu" or self.rope_local is not None or cfg.num_experts:
            return False  # the fused kernels join each residual add to a pre-norm, SiLU, one rotary table
        if self.fused_layers is not None:
            return bool(self.fused_layers)
        if self._fused_kernels is None:  # decided once: the device and the built kernels do not change
            self._fused_kernels = (self.device.type == "cuda" and ops.has_op("rope_cache", "CUDA")
                                   and ops.kernels_available()["cuda"])
        return self._fused_kernels and cache.k[0].dtype == self.dtype

    def _decoder_fused(self, x: Tensor, attend_qkv, capture=()) -> tuple[Tensor, list[Tensor]]:
        """``_decoder`` with three fused kernels: each residual add joins the RMS norm after it
        (``ops.add_rms_norm``: the MLP's output is added at the next layer's first norm), SiLU(gate) *
        up is one kernel (``ops.silu_mul``), and ``attend_qkv(layer, qkv)`` rotates q / k while it
        writes K / V (``ops.rope_cache``). Every value is rounded as in ``_decoder``; only the order of
        the norms' float32 sums of squares differs."""
        cfg = self.cfg
        bsz, n = x.shape[:2]
        eps = cfg.rms_norm_eps
        captured: list = [None] * len(capture)
        pending = None  # the previous layer's MLP output, not yet added to x
        for li, layer in enumerate(self.layers):
            x, h = ops.add_rms_norm(x, pending, layer.attn_norm, eps)
            qkv = layer.qkv(h).view(bsz, n, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
            attn = attend_qkv(li, self._qk_norm(layer, qkv))
            x, h = ops.add_rms_norm(x, layer.o(attn.reshape(bsz, n, self.q_size)), layer.mlp_norm, eps)
            pending = layer.down(ops.silu_mul(layer.gate_up(h)))
            if li in capture:
                x, pending = x + pending, None
                for j, c in enumerate(capture):
                    if c == li:
                        captured[j] = x
        if pending is not None:
            x = x + pending
        return x, captured

    # ------------------------------------------------------------------------------------------
    # The static-shape path: what a CUDA graph captures (turbospec.model.runner).
    def ensure_rope(self, length: int) -> None:
        """Make the rotary tables cover positions [0, length), so that the static path never grows them."""
        self.rope_table.ensure(length)
        if self.rope_local is not None:
            self.rope_local.ensure(length)

    @torch.inference_mode()
    def forward_static(self, input_ids: Tensor, position_ids: Tensor, cache: KVCache, cache_len: Tensor,
                       tree_mask_packed: Tensor, features=None, last: Tensor | None = None,
                       nodes: Tensor | None = None):
        """``forward`` with fixed shapes and no host reads, so that it can be captured in a CUDA graph
        and replayed for any prefix length.

        ``cache_len``: int64 [B] on the model's device (the prefix each row attends to; the n new
        tokens' K/V are written at slots cache_len + j). ``tree_mask_packed``: int64 [B, n], bit j of
        row i set iff new token i attends new token j (``ops.build_tree``'s packed mask; a chain is
        bits 0..i). Rows may be padding: a row that attends only itself changes nothing for the
        others. Positions must be inside the rotary table (``ensure_rope``). Returns logits
        [B, n, V] float32, with ``features`` as in ``forward``; with ``last`` (int64 [B]) only those of
        token ``last[b]`` of each row, [B, V] (no features).

        ``nodes`` (int64 [B] on the CPU, or None): a ragged pass, row b's new tokens its first
        ``nodes[b]``, the rest padding (the batched step's requests with shorter drafts than the
        longest, and free slots: 0). Padding tokens are not computed where the C++ layer loop runs
        and never through the LM head: their logits are 0 and their features unspecified; their K/V
        may or may not be written (at slots no real token attends). The real tokens' logits and
        features are the same bits as without ``nodes``.
        """
        if last is not None and features is not None:
            raise ValueError("forward_static: last= returns logits only (features must be None)")
        if nodes is not None and (last is not None or nodes.device.type != "cpu" or nodes.dtype != torch.int64
                                  or tuple(nodes.shape) != (input_ids.shape[0],)):
            raise ValueError(f"forward_static: nodes must be an int64 CPU tensor [{input_ids.shape[0]}] and last "
                             f"None, got nodes {nodes.dtype} {tuple(nodes.shape)} on {nodes.device}, last {last}")
        cfg = self.cfg
        bsz, n = input_ids.shape
        cos, sin = self._rope_static(position_ids)
        capture = self._capture_layers(features)
        if self._cpp_loop():  # CPU: the C++ loop, per-row prefix lengths
            norms, weights, formats, counts, biases, qk_norms = self._flat
            x, *captured = torch.ops.turbospec.llama_layers(
                self.embed_tokens(input_ids), cos, sin, tree_mask_packed, norms, weights, formats, counts, biases,
                cache.k, cache.v, 0, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, self.scale, capture,
                qk_norms, ACTIVATION_MODES[self.activations], cache_len, self._cpp_layout, self._cpp_windows,
                self._cpp_act, cfg.attn_softcap or 0.0, self._cpp_experts, cfg.experts_per_token, cfg.moe_norm_topk,
                nodes)
            return self._head(x, features, captured, last, nodes)
        if self._fused_static(cache):
            def attend_qkv(li: int, qkv: Tensor) -> Tensor:
                kc, vc = cache.k[li], cache.v[li]
                q = ops.rope_cache(qkv, cos, sin, cache_len, cfg.num_heads, kc, vc)
                return ops.tree_attention(q, kc, vc, cache_len, tree_mask_packed, self.scale,
                                          window=self.windows[li], softcap=cfg.attn_softcap or 0.0,
                                          bf16_products=self.attn_bf16_products(kc))[0]

            x, captured = self._decoder_fused(self.embed_tokens(input_ids), attend_qkv, capture)
            return self._head(x, features, captured, last, nodes)
        slots = cache_len[:, None] + torch.arange(n, device=input_ids.device)  # [B, n]

        def attend(li: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.k[li], cache.v[li]
            bf16 = self.attn_bf16_products(kc)
            for b in range(bsz):
                kc[b].index_copy_(1, slots[b], kv_as_stored(k[b].transpose(0, 1), kc, bf16))
                vc[b].index_copy_(1, slots[b], kv_as_stored(v[b].transpose(0, 1), vc, bf16))
            out, _ = ops.tree_attention(attn_query(q, kc), kc, vc, cache_len, tree_mask_packed, self.scale,
                                        window=self.windows[li], softcap=self.cfg.attn_softcap or 0.0,
                                        bf16_products=bf16)
            return out

        x, captured = self._decoder(self.embed_tokens(input_ids), cos, sin, attend, capture)
        return self._head(x, features, captured, last, nodes)

    def _head(self, x: Tensor, features, captured, last: Tensor | None = None,
              nodes: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Final norm + LM head over every row of the static path (logits [B, n, V] float32), with
        the drafter's features when asked; ``last``: only token last[b] of row b ([B, V]); ``nodes``:
        only each row's first nodes[b] tokens (the others' logits 0; see ``forward_static``)."""
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last]
        real = None
        if nodes is not None and getattr(self.lm_head, "kernel", False):  # row-wise kernels only
            bsz, n = x.shape[:2]
            real = (torch.arange(n) < nodes[:, None]).flatten()
            if bool(real.all()):
                real = None
        if real is None:
            x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
            logits = self.lm_head(x).float()
        else:  # the real rows alone (the kernels are row-wise: the same bits as over every row)
            idx = real.nonzero().squeeze(1)
            flat = x.reshape(bsz * n, -1)
            normed = rms_norm(flat.index_select(0, idx), self.norm, self.cfg.rms_norm_eps)
            rows = self.lm_head(normed).float()
            logits = rows.new_empty(bsz * n, rows.shape[-1])
            logits[~real] = 0.0
            logits.index_copy_(0, idx, rows)
            logits = logits.view(bsz, n, -1)
            if features == "final":
                x = flat.new_zeros(flat.shape).index_copy_(0, idx, normed).view(bsz, n, -1)
        if features is None:
            return logits
        return logits, (x if features == "final" else torch.cat(captured, dim=-1))

    def _capture_layers(self, features) -> list[int]:
        capture = [] if features is None or features == "final" else [int(i) for i in features]
        for i in capture:
            if not 0 <= i < self.cfg.num_layers:
                raise ValueError(f"features: layer {i} is outside [0, {self.cfg.num_layers})")
        return capture

    def use_torch_matmuls(self) -> "Transformer":
        """Compute every linear with torch's matmul over a dense copy of its weight, and the layer loop
        in Python with SDPA over each whole causal pass: for throughput where turbospec's fixed
        reduction order does not matter (the features head training reads). A bfloat16 model's
        matmuls then run on oneDNN's AMX tiles where the CPU has them (features ~4x faster than
        the kernels on a 2-core Sapphire Rapids, bench/results/2026-12-02-amx-head-training.md).
        The result is no longer the bits the kernels give, nor batch-invariant: an engine's target
        never runs this way."""
        if self.matmuls == "torch":
            return self
        for lin in [lin for layer in self.layers for lin in layer.linears() if lin is not None] + [self.lm_head]:
            lin._dense = lin.dense(self.dtype)
            lin.kernel = False
            lin.quantized = False
            lin.weights, lin.formats = [lin._dense], [DENSE_FORMATS[self.dtype]]
        self.use_cpp_layers = False
        self.matmuls = "torch"
        self.flatten_layers()
        return self

    def own_weights(self) -> "Transformer":
        """Copy the linears' weights that are still views of a mapped GGUF (``read_gguf``: the file's
        4 KiB pages) into this process's memory, one tensor at a time, each one's file pages released
        once copied (``release_pages``): the load's peak stays about one copy of the weights, and the
        kernels read anonymous memory (transparent huge pages). Read from the file's pages, plain
        decoding was 7 % and a 16-node verify 12 % slower (bench/out/ab-2026-11-28-gguf-mapped.json,
        bench/results/2026-11-28-serve-peers-vllm.md)."""
        changed = False
        for lin in [lin for layer in self.layers for lin in layer.linears() if lin is not None] + [self.lm_head]:
            for i, w in enumerate(lin.weights):
                if is_mapped(w):
                    lin.weights[i] = w.clone()
                    release_pages(w)
                    changed = True
        if changed:
            self.flatten_layers()
        return self

    def flatten_layers(self) -> None:
        """The arguments ``turbospec::llama_layers`` takes (norms, weight segments, formats, segment
        counts, qkv biases, per-head q / k norms; per layer its number of experts), or None when it
        cannot run (not on CPU, no C++ kernel). An expert layer's linears: qkv, o, the router, then each
        expert's gate_up and down (``Layer.linears``)."""
        self._flat = None
        if not (self.device.type == "cpu" and ops.has_op("llama_layers")):
            return
        norms, weights, formats, counts, biases, qk_norms = [], [], [], [], [], []
        for layer in self.layers:
            norms += [w for w in (layer.attn_norm, layer.attn_post_norm, layer.mlp_norm, layer.mlp_post_norm)
                      if w is not None]
            if self.cfg.qk_norm:
                qk_norms += [layer.q_norm, layer.k_norm]
            for lin in layer.linears():
                if not lin.kernel:
                    return
                weights += lin.weights
                formats += lin.formats
                counts.append(len(lin.weights))
            if self.cfg.qkv_bias:
                biases.append(layer.qkv.bias)
        self._flat = (norms, weights, formats, counts, biases, qk_norms)
        self._cpp_windows = self.windows if any(self.windows) else []
        self._cpp_layout = {"pre": 0, "post": 1, "sandwich": 2}[self.cfg.norm_layout]
        self._cpp_act = {"silu": 0, "gelu_tanh": 1}[self.cfg.activation]
        # per layer its number of experts (0: a dense MLP); empty for a dense model
        self._cpp_experts = [0 if layer.experts is None else len(layer.experts) for layer in self.layers] \
            if self.cfg.num_experts else []

    def _cpp_loop(self) -> bool:
        """Whether the layers run in C++ (``turbospec::llama_layers``, CPU): when it is built for this
        model and ``use_cpp_layers``; a mixture of experts whose ``moe_dispatch`` is "masked" runs the
        Python loop (the C++ loop routes by index lists, as "index" does: the same bits)."""
        return self.use_cpp_layers and self._flat is not None and self._moe_dispatch != "masked"
