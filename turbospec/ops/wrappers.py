"""Thin Python wrappers over the ``turbospec::*`` torch ops, with fake kernels for torch.compile.

Capability is decided once, at import: if ``turbospec._C`` (the C++/CUDA extension) loads, the ops
run on its kernels; otherwise every op runs on the pure-torch reference (``turbospec.reference``) and
a warning says how to build. ``kernels_available()`` tells which path is live per device.

All ops write into caller-provided buffers (allocated here when omitted), take randomness as
tensors and never read device values on the host, so a decode step built from them can be captured
in a CUDA graph.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from . import reference

_BUILD_HINT = ("turbospec: the C++ extension turbospec._C is not built; using the pure-torch reference "
               "ops (slow). Build it with `pip install --no-build-isolation -e .` or "
               "`python setup.py build_ext --inplace`.")

try:
    from .. import _C  # noqa: F401  (registers the turbospec::* kernels)
    _EXTENSION = True
    _EXTENSION_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the build
    _EXTENSION = False
    _EXTENSION_ERROR = e
    warnings.warn(f"{_BUILD_HINT} ({e})", stacklevel=2)


def _has_kernel(op: str, key: str) -> bool:
    if not _EXTENSION:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"turbospec::{op}", key)


_KERNELS = {dev: _EXTENSION and all(_has_kernel(op, key) for op in ("build_tree", "verify", "compact_kv"))
            for dev, key in (("cpu", "CPU"), ("cuda", "CUDA"))}


def has_op(op: str, key: str = "CPU") -> bool:
    """Whether the built extension registers ``turbospec::<op>`` for a dispatch key (an op registered
    for every backend counts)."""
    return _has_kernel(op, key) or _has_kernel(op, "CompositeExplicitAutograd")


def kernels_available() -> dict:
    """Which devices run turbospec's compiled kernels, and the CPU path in force:
    ``{"cpu": bool, "cuda": bool, "cpu_isa": "avx512" | "avx2" | "scalar" | None}``.
    A device mapped to False runs the pure-torch reference ops; ``cpu_isa`` is the instruction-set
    path of every CPU kernel (the best this CPU has, capped by $TURBOSPEC_ISA; ``cpu_isa()``)."""
    return {**_KERNELS, "cpu_isa": cpu_isa() if _EXTENSION else None}


_ISA_NAMES = ("scalar", "avx2", "avx512")


def cpu_isa(isa: str | None = None) -> str:
    """The instruction-set path of turbospec's CPU kernels. With ``isa`` ("scalar", "avx2",
    "avx512", or "default": detected, capped by $TURBOSPEC_ISA) force it first (capped at what the
    CPU has). Every path gives the same bits; tests force the narrow ones."""
    codes = {None: -2, "default": -1, **{name: i for i, name in enumerate(_ISA_NAMES)}}
    if isa not in codes:
        raise ValueError(f"cpu_isa: isa must be one of {', '.join(_ISA_NAMES)} or 'default', got {isa!r}")
    return _ISA_NAMES[torch.ops.turbospec.cpu_isa(codes[isa])]


def _compiled(device: torch.device) -> bool:
    return _KERNELS.get(device.type, False)


# ----------------------------------------------------------------------------------------------
def build_tree(parents: Tensor, tree_mask: Tensor | None = None, tree_mask_packed: Tensor | None = None,
               depth: Tensor | None = None, retrieve_index: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tree attention metadata from parent indices; see ``reference.build_tree``.

    parents: int64 [B, N] (N <= 64) -> tree_mask bool [B, N, N], tree_mask_packed int64 [B, N],
    depth int64 [B, N], retrieve_index int64 [B, N, N].

    Example: ``build_tree(torch.tensor([[-1, 0, 0, 1]]))`` gives depth ``[[0, 1, 1, 2]]`` and
    tree_mask_packed ``[[0b1, 0b11, 0b101, 0b1011]]``.
    """
    bsz, n = parents.shape if parents.dim() == 2 else (0, 0)
    dev = parents.device
    if tree_mask is None:
        tree_mask = torch.empty(bsz, n, n, dtype=torch.bool, device=dev)
    if tree_mask_packed is None:
        tree_mask_packed = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    if depth is None:
        depth = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    if retrieve_index is None:
        retrieve_index = torch.empty(bsz, n, n, dtype=torch.int64, device=dev)
    if _compiled(dev):
        torch.ops.turbospec.build_tree.default(parents, tree_mask, tree_mask_packed, depth, retrieve_index)
    else:
        outs = reference.build_tree(parents)
        for dst, src in zip((tree_mask, tree_mask_packed, depth, retrieve_index), outs):
            dst.copy_(src)
    return tree_mask, tree_mask_packed, depth, retrieve_index


def verify(target_logits: Tensor, parents: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
           uniform: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           accept_len: Tensor | None = None, accept_index: Tensor | None = None,
           output_token_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Fused softmax + speculative acceptance (chain or tree); see ``reference.verify``.

    target_logits: [B, N, V] float; parents, draft_token_ids: int64 [B, N];
    draft_probs: [B, N, V] float or None (point-mass drafts); uniform: float32 [B, N] in [0, 1).
    Returns accept_len int64 [B] (-1: non-finite logits, nothing emitted),
    accept_index int64 [B, N], output_token_ids int64 [B, N] (padded with -1).
    """
    bsz, n = target_logits.shape[:2] if target_logits.dim() == 3 else (0, 0)
    dev = target_logits.device
    if accept_len is None:
        accept_len = torch.empty(bsz, dtype=torch.int64, device=dev)
    if accept_index is None:
        accept_index = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    if output_token_ids is None:
        output_token_ids = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    if _compiled(dev):
        torch.ops.turbospec.verify.default(target_logits, parents, draft_token_ids, draft_probs, uniform,
                                           float(temperature), int(top_k), float(top_p),
                                           accept_len, accept_index, output_token_ids)
    else:
        outs = reference.verify(target_logits.cpu(), parents.cpu(), draft_token_ids.cpu(),
                                None if draft_probs is None else draft_probs.cpu(), uniform.cpu(),
                                float(temperature), int(top_k), float(top_p))
        for dst, src in zip((accept_len, accept_index, output_token_ids), outs):
            dst.copy_(src)
    return accept_len, accept_index, output_token_ids


def compact_kv(caches: list[Tensor], prefix_len: Tensor, accept_index: Tensor, accept_len: Tensor) -> None:
    """In place, move accepted tree nodes' KV entries to contiguous positions after the prefix,
    every layer in one call; see ``reference.compact_kv``.

    caches: list of [B, H, S, D] tensors (each layer's K and V); prefix_len, accept_len: int64 [B];
    accept_index: int64 [B, N].
    """
    if not caches:
        return
    if _compiled(caches[0].device):
        torch.ops.turbospec.compact_kv.default(caches, prefix_len, accept_index, accept_len)
    else:
        reference.compact_kv(caches, prefix_len, accept_index, accept_len)


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, tree_mask_packed: Tensor,
                   scale: float, include_prefix: bool = True, out: Tensor | None = None,
                   lse: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The attention of the target's verify pass over one layer's static KV cache; see
    ``reference.tree_attention``.

    q: [B, n, Hq, D] (n <= 64); k_cache, v_cache: [B, Hkv, S, D] holding the prefix at
    ``[0, cache_len)`` and the n new tokens at ``cache_len + j``; cache_len: int64 [B] on q's device;
    tree_mask_packed: int64 [B, n] (``build_tree``). Writes ``out`` [B, n, Hq, D] (q's dtype,
    allocated when None) and, when given, ``lse`` float32 [B, Hq, n]; returns ``(out, lse)``.
    ``include_prefix=False`` attends the tree keys only: merge with a prefix part by
    ``merge_attention``. Never reads device values on the host (CUDA-graph safe); the CPU kernel
    raises when ``cache_len + n > S``, the CUDA kernel makes such a row attend nothing (out 0,
    lse -inf).
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cache_len", cache_len),
                    ("tree_mask_packed", tree_mask_packed), ("out", out), ("lse", lse)):
        # A tensor on another device would send the call to that device's kernel (a meta tensor:
        # to the fake kernel, which checks nothing).
        if t is not None and t.device != q.device:
            raise ValueError(f"tree_attention: {name} must be on {q.device} (the device of q), got {t.device}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    key = "CUDA" if q.device.type == "cuda" else "CPU"
    if _compiled(q.device) and has_op("tree_attention", key):
        torch.ops.turbospec.tree_attention.default(q, k_cache, v_cache, cache_len, tree_mask_packed, float(scale),
                                                   bool(include_prefix), out, lse)
    else:
        o, l = reference.tree_attention(q, k_cache, v_cache, cache_len, tree_mask_packed, float(scale),
                                        bool(include_prefix))
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)
    return out, lse


def merge_attention(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Log-sum-exp merge of two partial attentions over disjoint key sets (e.g. a prefix part from
    flash attention and ``tree_attention(..., include_prefix=False)``); see
    ``reference.merge_attention``. o: [B, n, Hq, D], lse: float32 [B, Hq, n]."""
    return reference.merge_attention(o1, lse1, o2, lse2)


def small_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ weight^T (+ bias) for ``x [..., K]``, ``weight [N, K]`` float32 / float16 / bfloat16 on
    CPU, accumulated in float32 in a fixed order that does not depend on the number of rows, the
    thread split or the instruction set (see csrc/cpu/linear.cpp). Reference: ``reference.small_linear``."""
    if _compiled(x.device) and has_op("small_linear"):
        return torch.ops.turbospec.small_linear.default(x, weight, bias)
    return reference.small_linear(x, weight, bias)


def linear(x: Tensor, weights: list[Tensor], formats: list[int], bias: Tensor | None = None,
           activations: int = 0) -> Tensor:
    """y [..., sum N_i] = x [..., K] @ concat_i(W_i)^T (+ bias) on CPU with every weight segment in its
    storage format: ``weights[i]`` [N_i, K] float32 / float16 / bfloat16 (``formats[i]`` 0 / 1 / 30)
    or uint8 [N_i, row bytes] GGUF blocks (``formats[i]`` a GGML type id, ``reference.WEIGHT_FORMATS``).
    Same order as ``small_linear`` on the dequantized weights (reference: ``reference.linear``).
    ``activations=8`` (all segments GGUF blocks, K % 32 == 0): x quantized to int8 per 32 values and
    integer dot products, as llama.cpp does (reference: ``reference.linear_int8``); faster, not the
    float32 result, still the same for a row whatever the other rows. Otherwise it is ignored."""
    if activations not in (0, 8):
        raise ValueError(f"activations must be 0 (exact) or 8 (int8), got {activations!r}")
    int8 = activations == 8 and x.shape[-1] % 32 == 0 and all(map(reference.has_int8_kernel, formats))
    if _compiled(x.device) and has_op("linear"):
        return torch.ops.turbospec.linear.default(x, list(weights), [int(f) for f in formats], bias,
                                                  8 if int8 else 0)
    if int8:
        return reference.linear_int8(x, weights, formats, bias)
    return reference.linear(x, weights, formats, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """RMS norm of float32 rows in one fixed order (reference: ``reference.rms_norm``): the same bits
    on every instruction set and for a row whatever the other rows. x [..., K], weight float32 [K];
    ``out`` (contiguous, x's shape) may be x."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: x must be float32 [..., K] and weight float32 [K], got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if _compiled(x.device) and has_op("rms_norm"):
        torch.ops.turbospec.rms_norm.default(x, weight, float(eps), out)
    else:
        out.copy_(reference.rms_norm(x, weight, eps))
    return out


def dequantize(raw: Tensor, fmt: int, k: int) -> Tensor:
    """uint8 [N, row bytes] GGUF blocks of format ``fmt`` -> float32 [N, K] (``reference.dequantize``)."""
    if _compiled(raw.device) and has_op("dequantize"):
        return torch.ops.turbospec.dequantize.default(raw, int(fmt), int(k))
    return reference.dequantize(raw, int(fmt), int(k))


# ----------------------------------------------------------------------------------------------
# Fake kernels: the ops only mutate their out-arguments, so tracing needs no output metadata.
if _EXTENSION:
    @torch.library.register_fake("turbospec::build_tree")
    def _build_tree_fake(parents, tree_mask, tree_mask_packed, depth, retrieve_index):
        return None

    @torch.library.register_fake("turbospec::verify")
    def _verify_fake(target_logits, parents, draft_token_ids, draft_probs, uniform, temperature, top_k,
                     top_p, accept_len, accept_index, output_token_ids):
        return None

    @torch.library.register_fake("turbospec::compact_kv")
    def _compact_kv_fake(caches, prefix_len, accept_index, accept_len):
        return None

    if hasattr(torch.ops.turbospec, "tree_attention"):  # an older build may lack the op
        @torch.library.register_fake("turbospec::tree_attention")
        def _tree_attention_fake(q, k_cache, v_cache, cache_len, tree_mask_packed, scale, include_prefix, out, lse):
            return None

    if has_op("small_linear"):
        @torch.library.register_fake("turbospec::small_linear")
        def _small_linear_fake(x, weight, bias):
            torch._check(weight.dim() == 2 and x.shape[-1] == weight.shape[1])
            return x.new_empty(*x.shape[:-1], weight.shape[0])

    if has_op("linear"):
        @torch.library.register_fake("turbospec::linear")
        def _linear_fake(x, weights, formats, bias, activations=0):
            torch._check(len(weights) == len(formats) and len(weights) > 0)
            return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))

        @torch.library.register_fake("turbospec::dequantize")
        def _dequantize_fake(raw, fmt, k):
            torch._check(raw.dim() == 2)
            return raw.new_empty(raw.shape[0], k, dtype=torch.float32)

    if has_op("rms_norm"):
        @torch.library.register_fake("turbospec::rms_norm")
        def _rms_norm_fake(x, weight, eps, out):
            return None
