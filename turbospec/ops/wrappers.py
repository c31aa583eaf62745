"""Thin Python wrappers over the ``turbospec::*`` torch ops, with fake kernels for torch.compile.

Capability is decided once, at import: if ``turbospec._C`` (the C++/CUDA extension) loads, the ops
run on its kernels; otherwise every op runs on the pure-torch reference (``turbospec.reference``) and
a warning says how to build. ``kernels_available()`` tells which path is live per device.

All ops write into caller-provided buffers (allocated here when omitted), take randomness as
tensors and never read device values on the host, so a decode step built from them can be captured
in a CUDA graph.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
from torch import Tensor

from . import reference
from .limits import MAX_TREE_NODES

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


@functools.lru_cache(maxsize=None)  # the kernels register when _C is imported (the check cost ~5 us a call)
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
    ``{"cpu": bool, "cuda": bool, "cpu_isa": "avx512" | "avx2" | "scalar" | None,
    "cpu_prefetch": "t0" | "nta" | None, "cpu_bf16_dot": bool | None, "cpu_amx": bool | None}``.
    A device mapped to False runs the pure-torch reference ops; ``cpu_isa`` is the instruction-set
    path of every CPU kernel (the best this CPU has, capped by $TURBOSPEC_ISA; ``cpu_isa()``) and
    ``cpu_prefetch`` the cache hint of their weight-stream prefetches (``cpu_prefetch()``);
    ``cpu_bf16_dot`` whether bfloat16 products use the AVX-512 BF16 instructions (``cpu_bf16_dot()``),
    ``cpu_amx`` whether the int8-activation linears use AMX tiles (``cpu_amx()``)."""
    if not _EXTENSION:
        return {**_KERNELS, "cpu_isa": None, "cpu_prefetch": None, "cpu_bf16_dot": None, "cpu_amx": None}
    return {**_KERNELS, "cpu_isa": cpu_isa(), "cpu_prefetch": cpu_prefetch(), "cpu_bf16_dot": cpu_bf16_dot(),
            "cpu_amx": cpu_amx()}


_ISA_NAMES = ("scalar", "avx2", "avx512")


def cpu_isa(isa: str | None = None) -> str:
    """The instruction-set path of turbospec's CPU kernels. With ``isa`` ("scalar", "avx2",
    "avx512", or "default": detected, capped by $TURBOSPEC_ISA) force it first (capped at what the
    CPU has). Every path gives the same bits; tests force the narrow ones."""
    codes = {None: -2, "default": -1, **{name: i for i, name in enumerate(_ISA_NAMES)}}
    if isa not in codes:
        raise ValueError(f"cpu_isa: isa must be one of {', '.join(_ISA_NAMES)} or 'default', got {isa!r}")
    return _ISA_NAMES[torch.ops.turbospec.cpu_isa(codes[isa])]


_PREFETCH_NAMES = ("t0", "nta")


def cpu_prefetch(hint: str | None = None) -> str:
    """The cache hint of the CPU kernels' weight-stream prefetches: "nta" (non-temporal: the default
    on AMD CPUs with AVX-512, where it measured faster) or "t0" (the default elsewhere: on Intel and
    on an AVX2-only Zen 3 the non-temporal hint measured slower); $TURBOSPEC_PREFETCH overrides the default. With ``hint`` ("t0", "nta" or
    "default") set it first. Speed only: every hint gives the same bits."""
    codes = {None: -2, "default": -1, **{name: i for i, name in enumerate(_PREFETCH_NAMES)}}
    if hint not in codes:
        raise ValueError(f"cpu_prefetch: hint must be one of {', '.join(_PREFETCH_NAMES)} or 'default', got {hint!r}")
    return _PREFETCH_NAMES[torch.ops.turbospec.cpu_prefetch(codes[hint])]


def cpu_bf16_dot(on: bool | str | None = None) -> bool:
    """Whether bfloat16 weights times bfloat16-valued inputs with many rows (a bfloat16 model's
    prefill and batched steps) use the CPU's AVX-512 BF16 dot products (``vdpbf16ps``): on by default
    where the CPU has them, the AVX-512 path is in force and their self-test found them computing the
    float32 kernels' two fused multiply-adds per lane ($TURBOSPEC_BF16_DOT=0 turns them off). With
    ``on`` (True, False or "default") set it first; True is capped at what the CPU allows. Speed
    only: the bits are those of every other path (``csrc/cpu/linear.cpp``, rows_dpbf16)."""
    codes = {None: -2, "default": -1, False: 0, True: 1}
    if not any(on is k for k in codes) and on != "default":
        raise ValueError(f"cpu_bf16_dot: on must be True, False or 'default', got {on!r}")
    return bool(torch.ops.turbospec.cpu_bf16_dot(codes["default" if on == "default" else on]))


def cpu_amx(on: bool | str | None = None) -> bool:
    """Whether the int8-activation linears over interleaved blocks (``activations=8``) with 16 or more
    input rows compute their integer block sums on the CPU's AMX tiles (``tdpbsud``): on by default
    where the CPU has AMX-TILE and AMX-INT8, the OS grants the tile state, a self-test passed and the
    AVX-512 path is in force ($TURBOSPEC_AMX=0 turns them off). With ``on`` (True, False or
    "default") set it first; True is capped at what the CPU allows. Speed only: the integers are
    exact, the float steps those of the vector kernels (``csrc/cpu/linear_int8.cpp``, rows_x_amx)."""
    codes = {None: -2, "default": -1, False: 0, True: 1}
    if not any(on is k for k in codes) and on != "default":
        raise ValueError(f"cpu_amx: on must be True, False or 'default', got {on!r}")
    return bool(torch.ops.turbospec.cpu_amx(codes["default" if on == "default" else on]))


def _compiled(device: torch.device) -> bool:
    return _KERNELS.get(device.type, False)


def _runs(op: str, device: torch.device) -> bool:
    """Whether ``op`` has a compiled kernel for ``device`` (some ops are CPU-only)."""
    return _compiled(device) and has_op(op, "CUDA" if device.type == "cuda" else "CPU")


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


def _check_sampling_scalars(temperature: float | None, top_k: int | None, top_p: float | None) -> None:
    """The checks of csrc/cpu/verify.cpp on the sampling parameters given as Python numbers (None:
    a tensor, checked by the kernel), in its words without a row: done on the host before
    broadcasting, so that a CUDA call raises too instead of marking every row invalid."""
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0.0):
        raise RuntimeError(f"verify: temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and not top_k >= 0:
        raise RuntimeError(f"verify: top_k must be >= 0 (0 disables top-k), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise RuntimeError(f"verify: top_p must be in (0, 1] (1 disables top-p), got {top_p}")


_ROW_SCALARS: dict[tuple, Tensor] = {}  # CPU [B] tensors of broadcast scalars, reused (the op never writes them)


def _row_tensor(value: float | int, dtype: torch.dtype, bsz: int, device: torch.device, reuse: bool) -> Tensor:
    """``value`` broadcast to a [bsz] tensor of ``dtype`` on ``device``. With ``reuse`` (plain CPU
    tensors: no fake tensors, no CUDA graph capture to get wrong) the tensor is kept for the next call
    with the same value: allocating three tensors a call costs more than a small verify itself."""
    if not reuse:
        return torch.full((bsz,), value, dtype=dtype, device=device)
    key = (value, dtype, bsz)
    t = _ROW_SCALARS.get(key)
    if t is None:
        if len(_ROW_SCALARS) >= 256:
            _ROW_SCALARS.clear()
        t = _ROW_SCALARS[key] = torch.full((bsz,), value, dtype=dtype)
    return t


_ROW_PROCESSING = {  # per-row logit-processing parameter: its rule (reference.check_*)
    "presence_penalty": reference.check_penalty, "frequency_penalty": reference.check_penalty,
    "repetition_penalty": reference.check_repetition, "min_p": reference.check_min_p}


def verify(target_logits: Tensor, parents: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
           uniform: Tensor, temperature: float | Tensor, top_k: int | Tensor = 0, top_p: float | Tensor = 1.0,
           accept_len: Tensor | None = None, accept_index: Tensor | None = None,
           output_token_ids: Tensor | None = None, output_counts: Tensor | None = None,
           prompt_mask: Tensor | None = None, presence_penalty: float | Tensor | None = None,
           frequency_penalty: float | Tensor | None = None, repetition_penalty: float | Tensor | None = None,
           logit_bias: Tensor | None = None, min_p: float | Tensor | None = None,
           token_bitmask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Fused softmax + speculative acceptance (chain or tree); see ``reference.verify``.

    target_logits: [B, N, V] float; parents, draft_token_ids: int64 [B, N] (draft id -1: a padding
    node, after the row's real nodes: never accepted, a padded row gives what it gives alone);
    draft_probs: [B, N, V] float or None (point-mass drafts); uniform: float32 [B, N] in [0, 1).
    temperature, top_k, top_p: Python numbers (every row; checked here, then broadcast to [B] as
    float64 / int64 / float64, which keeps them exact) or per-row tensors [B] on target_logits'
    device: temperature and top_p float32 or float64, top_k int64 (a CUDA graph captured with
    tensors replays with new values). A bad per-row value raises on CPU (naming the row) and marks
    the row invalid (accept_len -1) on CUDA, which cannot raise without a host sync.
    Returns accept_len int64 [B] (-1: non-finite logits, nothing emitted),
    accept_index int64 [B, N], output_token_ids int64 [B, N] (padded with -1).

    Logit processing (optional trailing arguments; none given: exactly the behaviour above; the
    semantics, order and arithmetic are ``reference.verify``'s): each node is processed with the
    tokens of its own path (``output_counts`` + the drafts from the root to the node, node
    included, root excluded), in one call, no loop per node.
    output_counts: int32 [B, V] (committed output token counts, >= 0; needed by the penalties);
    prompt_mask: bool [B, V] (prompt tokens; repetition penalty only);
    presence_penalty, frequency_penalty ([-2, 2], 0 off), repetition_penalty (> 0, 1 off),
    min_p ([0, 1], 0 off): Python numbers (checked here, broadcast to float64 [B]) or float32 /
    float64 tensors [B];
    logit_bias: float32 [B, V] (added to the raw logits);
    token_bitmask: int32 [B, N, ceil(V / 32)] (per node, bit v % 32 of word v // 32 set = allowed;
    a visited node that allows no token makes the row invalid, accept_len -1).
    Tensors go on target_logits' device, contiguous (else a contiguous copy is made each call).
    Bad values in tensors raise on CPU naming the row; the CUDA kernel marks the row invalid.
    """
    bsz, n = target_logits.shape[:2] if target_logits.dim() == 3 else (0, 0)
    dev = target_logits.device
    temperature = temperature if isinstance(temperature, Tensor) else float(temperature)
    top_k = top_k if isinstance(top_k, Tensor) else int(top_k)
    top_p = top_p if isinstance(top_p, Tensor) else float(top_p)
    _check_sampling_scalars(None if isinstance(temperature, Tensor) else temperature,
                            None if isinstance(top_k, Tensor) else top_k, None if isinstance(top_p, Tensor) else top_p)
    rows = {"presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
            "repetition_penalty": repetition_penalty, "min_p": min_p}
    for name, value in rows.items():
        if value is None or isinstance(value, Tensor):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RuntimeError(f"verify: {name} must be a number or a float tensor [B], got {value!r}")
        message = _ROW_PROCESSING[name](float(value))
        if message:
            raise RuntimeError(f"verify: {name} must be {message}, got {float(value)}")
        rows[name] = float(value)
    if output_counts is None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if rows[name] is not None:
                raise RuntimeError(f"verify: {name} needs output_counts (int32 [B, V], the request's generated "
                                   f"token counts; zeros for a fresh request)")
    if accept_len is None:
        accept_len = torch.empty(bsz, dtype=torch.int64, device=dev)
    if accept_index is None:
        accept_index = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    if output_token_ids is None:
        output_token_ids = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    if _compiled(dev):
        reuse = dev.type == "cpu" and type(target_logits) is Tensor
        if not isinstance(temperature, Tensor):
            temperature = _row_tensor(temperature, torch.float64, bsz, dev, reuse)
        if not isinstance(top_k, Tensor):
            top_k = _row_tensor(top_k, torch.int64, bsz, dev, reuse)
        if not isinstance(top_p, Tensor):
            top_p = _row_tensor(top_p, torch.float64, bsz, dev, reuse)
        for name, value in rows.items():
            if value is not None and not isinstance(value, Tensor):
                rows[name] = _row_tensor(value, torch.float64, bsz, dev, reuse)
        torch.ops.turbospec.verify.default(target_logits, parents, draft_token_ids, draft_probs, uniform,
                                           temperature, top_k, top_p, accept_len, accept_index, output_token_ids,
                                           output_counts, prompt_mask, rows["presence_penalty"],
                                           rows["frequency_penalty"], rows["repetition_penalty"], logit_bias,
                                           rows["min_p"], token_bitmask)
    else:
        temperature, top_k, top_p = (v.cpu() if isinstance(v, Tensor) else v for v in (temperature, top_k, top_p))
        cpu = {name: v.cpu() if isinstance(v, Tensor) else v for name, v in rows.items()}
        extra = {name: None if t is None else t.cpu() for name, t in (
            ("output_counts", output_counts), ("prompt_mask", prompt_mask), ("logit_bias", logit_bias),
            ("token_bitmask", token_bitmask))}
        outs = reference.verify(target_logits.cpu(), parents.cpu(), draft_token_ids.cpu(),
                                None if draft_probs is None else draft_probs.cpu(), uniform.cpu(),
                                temperature, top_k, top_p, **cpu, **extra)
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
                   lse: Tensor | None = None, window: int = 0, softcap: float = 0.0,
                   bf16_products: bool = False) -> tuple[Tensor, Tensor | None]:
    """The attention of the target's verify pass over one layer's static KV cache; see
    ``reference.tree_attention``.

    q: [B, n, Hq, D] (n <= 64); k_cache, v_cache: [B, Hkv, S, D] holding the prefix at
    ``[0, cache_len)`` and the n new tokens at ``cache_len + j``; cache_len: int64 [B] on q's device;
    tree_mask_packed: int64 [B, n] (``build_tree``). Writes ``out`` [B, n, Hq, D] (q's dtype,
    allocated when None) and, when given, ``lse`` float32 [B, Hq, n]; returns ``(out, lse)``.
    ``include_prefix=False`` attends the tree keys only: merge with a prefix part by
    ``merge_attention``. Never reads device values on the host (CUDA-graph safe); the CPU kernel
    raises when ``cache_len + n > S``, the CUDA kernel makes such a row attend nothing (out 0,
    lse -inf). ``window`` > 0: sliding-window attention over that many positions; ``softcap`` > 0:
    attention logit soft-capping (CPU kernel and reference; the CUDA kernel refuses both).
    ``bf16_products`` (bfloat16 caches, CPU kernel and reference): q and the probabilities rounded to
    bfloat16 before their products (the int8-activation mode's attention).
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cache_len", cache_len),
                    ("tree_mask_packed", tree_mask_packed), ("out", out), ("lse", lse)):
        # A tensor on another device would send the call to that device's kernel (a meta tensor:
        # to the fake kernel, which checks nothing).
        if t is not None and t.device != q.device:
            raise ValueError(f"tree_attention: {name} must be on {q.device} (the device of q), got {t.device}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if _runs("tree_attention", q.device):
        torch.ops.turbospec.tree_attention.default(q, k_cache, v_cache, cache_len, tree_mask_packed, float(scale),
                                                   bool(include_prefix), out, lse, int(window), float(softcap),
                                                   bool(bf16_products))
    else:
        o, l = reference.tree_attention(q, k_cache, v_cache, cache_len, tree_mask_packed, float(scale),
                                        bool(include_prefix), int(window), float(softcap), bool(bf16_products))
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
    if _runs("small_linear", x.device):
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
    if _runs("linear", x.device):
        return torch.ops.turbospec.linear.default(x, list(weights), [int(f) for f in formats], bias,
                                                  8 if int8 else 0)
    if int8:
        return reference.linear_int8(x, weights, formats, bias)
    return reference.linear(x, weights, formats, bias)


_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """RMS norm of rows in one fixed order (reference: ``reference.rms_norm``): the same bits on every
    instruction set and for a row whatever the other rows. x [..., K] float32 / bfloat16 / float16,
    weight [K] of x's dtype; ``out`` (contiguous, x's shape and dtype) may be x."""
    if x.dtype not in _NORM_DTYPES or weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: x must be float32 / bfloat16 / float16 [..., K] and weight [K] of x's dtype, "
                         f"got x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if _runs("rms_norm", x.device):
        torch.ops.turbospec.rms_norm.default(x, weight, float(eps), out)
    else:
        out.copy_(reference.rms_norm(x, weight, eps))
    return out


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, RMS norm of it) in one kernel (``reference.add_rms_norm``): x, delta [..., K] of one
    float dtype, weight [K] of that dtype. Without delta: (x, RMS norm of x)."""
    if _runs("add_rms_norm", x.device):
        x = x.contiguous()
        out = torch.empty_like(x)
        if delta is None:
            torch.ops.turbospec.add_rms_norm.default(x, None, weight, float(eps), out, None)
            return x, out
        s = torch.empty_like(x)
        torch.ops.turbospec.add_rms_norm.default(x, delta.contiguous(), weight, float(eps), out, s)
        return s, out
    return reference.add_rms_norm(x, delta, weight, eps)


def _flat_linears(linears) -> tuple[list[Tensor], list[int], list[int], list[int]]:
    weights, formats, counts, acts = [], [], [], []
    for w, f, a in linears:
        weights += list(w)
        formats += [int(x) for x in f]
        counts.append(len(w))
        acts.append(8 if a == 8 else 0)
    return weights, formats, counts, acts


def eagle_input(rows: Tensor, linears, fc_bias: Tensor | None, norms: list[Tensor], hidden_size: int, eps: float,
                mode: int) -> Tensor:
    """An EAGLE head's input side in one kernel (CPU; ``reference.eagle_input``, ``EagleHead._input``):
    rows float32 [N, F + H] -> [N, H + q + k + v]. linears: [fc, qkv], each (weights, formats,
    activations) as ``linear`` takes them (fc: no segments in mode 2)."""
    if _runs("eagle_input", rows.device):
        return torch.ops.turbospec.eagle_input.default(rows, *_flat_linears(linears), fc_bias, list(norms),
                                                       int(hidden_size), float(eps), int(mode))
    return reference.eagle_input(rows, linears, fc_bias, norms, hidden_size, eps, mode)


def eagle_output(rows: Tensor, linears, norm: Tensor, eps: float) -> Tensor:
    """An EAGLE head's output side in one kernel (CPU; ``reference.eagle_output``, ``EagleHead._output``):
    rows float32 [N, A + H] -> [N, H]. linears: [o, gate_up, down] as (weights, formats, activations)."""
    if _runs("eagle_output", rows.device):
        return torch.ops.turbospec.eagle_output.default(rows, *_flat_linears(linears), norm, float(eps))
    return reference.eagle_output(rows, linears, norm, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [..., 2I] = [gate | up] in one kernel (``reference.silu_mul``)."""
    if _runs("silu_mul", gate_up.device):
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        torch.ops.turbospec.silu_mul.default(gate_up, out)
        return out
    return reference.silu_mul(gate_up)


def rope_cache(qkv: Tensor, cos: Tensor, sin_signed: Tensor, cache_len: Tensor, num_heads: int, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:
    """Rotate the q and k heads of qkv [B, n, H + 2 Hkv, D] and write k and v into the caches at
    slots cache_len + j, in one kernel (``reference.rope_cache``); returns the rotated q [B, n, H, D]."""
    if _runs("rope_cache", qkv.device):
        qkv = qkv.contiguous()
        q = qkv.new_empty(qkv.shape[0], qkv.shape[1], num_heads, qkv.shape[3])
        torch.ops.turbospec.rope_cache.default(qkv, cos.contiguous(), sin_signed.contiguous(), cache_len,
                                               int(num_heads), q, k_cache, v_cache)
        return q
    return reference.rope_cache(qkv, cos, sin_signed, cache_len, num_heads, k_cache, v_cache)


def dequantize(raw: Tensor, fmt: int, k: int) -> Tensor:
    """uint8 [N, row bytes] GGUF blocks of format ``fmt`` -> float32 [N, K] (``reference.dequantize``)."""
    if _runs("dequantize", raw.device):
        return torch.ops.turbospec.dequantize.default(raw, int(fmt), int(k))
    return reference.dequantize(raw, int(fmt), int(k))


# ----------------------------------------------------------------------------------------------
# Fake kernels: the ops only mutate their out-arguments, so tracing needs no output metadata; but each
# checks, with torch._check, the dtype / shape / layout / device relations that csrc/checks.h and the
# CPU kernels check (in the same words), so that a traced call fails where the real call would. Only
# metadata is read (FakeTensors hold no data); values (parents, token ids, cache_len) are the kernels'.
# The kernel's own device ("must be a CPU tensor for this kernel") is left to the dispatcher: a fake
# stands for every backend, and runs the meta device's calls.
_MAX_TREE_NODES = MAX_TREE_NODES
_MAX_HEAD_DIM = 256  # csrc/checks.h kMaxHeadDim
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INT32_MAX = 2 ** 31 - 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _describe(t: Tensor) -> str:
    return f"{_dtype_name(t.dtype)} {_shape(t.shape)}"


def _dtypes(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [_dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _check_tensor(op: str, name: str, t: Tensor, dtypes: tuple[torch.dtype, ...], dims: tuple) -> None:
    """``t`` has one of ``dtypes`` and the shape ``dims`` (pairs (name, size)); checks.h check_tensor."""
    def msg() -> str:
        return (f"{op}: {name} must be {_dtypes(dtypes)} [{', '.join(d for d, _ in dims)}] = "
                f"{_shape(s for _, s in dims)}, got {_describe(t)}")
    torch._check(t.dtype in dtypes and t.dim() == len(dims), msg)
    for i, (_, size) in enumerate(dims):
        torch._check(t.shape[i] == size, msg)


def _check_device(op: str, name: str, t: Tensor, ref: Tensor, ref_name: str) -> None:
    torch._check(t.device == ref.device,
                 lambda: f"{op}: {name} must be on {ref.device} (the device of {ref_name}), got {t.device}")


def _check_output(op: str, name: str, t: Tensor) -> None:
    torch._check(t.is_contiguous(), lambda: f"{op}: output {name} must be contiguous, got {_describe(t)} with "
                                            f"strides {_shape(t.stride())}")


def _check_last_dim(op: str, name: str, t: Tensor) -> None:
    torch._check(t.shape[-1] <= 1 or t.stride(-1) == 1,
                 lambda: f"{op}: {name} must be contiguous in its last dim (D), got strides {_shape(t.stride())}")


def _check_build_tree_fake(parents: Tensor, tree_mask: Tensor, tree_mask_packed: Tensor, depth: Tensor,
                           retrieve_index: Tensor) -> None:
    op = "build_tree"
    torch._check(parents.dim() == 2 and parents.dtype == torch.int64,
                 lambda: f"{op}: parents must be int64 [B, N], got {_describe(parents)}")
    bsz, n = parents.shape
    torch._check(n >= 1 and n <= _MAX_TREE_NODES,
                 lambda: f"{op}: parents must have N in [1, {_MAX_TREE_NODES}] nodes, got N = {n} "
                         f"({_describe(parents)})")
    _check_tensor(op, "tree_mask", tree_mask, (torch.bool,), (("B", bsz), ("N", n), ("N", n)))
    _check_tensor(op, "tree_mask_packed", tree_mask_packed, (torch.int64,), (("B", bsz), ("N", n)))
    _check_tensor(op, "depth", depth, (torch.int64,), (("B", bsz), ("N", n)))
    _check_tensor(op, "retrieve_index", retrieve_index, (torch.int64,), (("B", bsz), ("N", n), ("N", n)))
    for name, t in (("tree_mask", tree_mask), ("tree_mask_packed", tree_mask_packed), ("depth", depth),
                    ("retrieve_index", retrieve_index)):
        _check_device(op, name, t, parents, "parents")
        _check_output(op, name, t)


def _check_verify_fake(target_logits: Tensor, parents: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
                       uniform: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, accept_len: Tensor,
                       accept_index: Tensor, output_token_ids: Tensor, output_counts: Tensor | None = None,
                       prompt_mask: Tensor | None = None, presence_penalty: Tensor | None = None,
                       frequency_penalty: Tensor | None = None, repetition_penalty: Tensor | None = None,
                       logit_bias: Tensor | None = None, min_p: Tensor | None = None,
                       token_bitmask: Tensor | None = None) -> None:
    op = "verify"
    torch._check(target_logits.dim() == 3 and target_logits.dtype in _FLOATS,
                 lambda: f"{op}: target_logits must be float32, bfloat16 or float16 [B, N, V], got "
                         f"{_describe(target_logits)}")
    bsz, n, vocab = target_logits.shape
    torch._check(n >= 1 and n <= _MAX_TREE_NODES,
                 lambda: f"{op}: target_logits must have N in [1, {_MAX_TREE_NODES}] nodes, got N = {n} "
                         f"({_describe(target_logits)})")
    torch._check(vocab >= 1, lambda: f"{op}: target_logits must have a vocabulary V >= 1, got "
                                     f"{_describe(target_logits)}")
    torch._check(vocab <= _INT32_MAX,
                 lambda: f"{op}: target_logits vocabulary V must fit in int32, got V = {vocab}")
    _check_tensor(op, "parents", parents, (torch.int64,), (("B", bsz), ("N", n)))
    _check_tensor(op, "draft_token_ids", draft_token_ids, (torch.int64,), (("B", bsz), ("N", n)))
    if draft_probs is not None:
        _check_tensor(op, "draft_probs", draft_probs, _FLOATS, (("B", bsz), ("N", n), ("V", vocab)))
        _check_device(op, "draft_probs", draft_probs, target_logits, "target_logits")
    _check_tensor(op, "uniform", uniform, (torch.float32,), (("B", bsz), ("N", n)))
    _check_tensor(op, "accept_len", accept_len, (torch.int64,), (("B", bsz),))
    _check_tensor(op, "accept_index", accept_index, (torch.int64,), (("B", bsz), ("N", n)))
    _check_tensor(op, "output_token_ids", output_token_ids, (torch.int64,), (("B", bsz), ("N", n)))
    for name, t in (("parents", parents), ("draft_token_ids", draft_token_ids), ("uniform", uniform)):
        _check_device(op, name, t, target_logits, "target_logits")
    for name, t in (("accept_len", accept_len), ("accept_index", accept_index),
                    ("output_token_ids", output_token_ids)):
        _check_device(op, name, t, target_logits, "target_logits")
        _check_output(op, name, t)
    # the per-row sampling tensors (verify.cpp check_row_param_tensors); their values are the kernels'
    _check_tensor(op, "temperature", temperature, (torch.float32, torch.float64), (("B", bsz),))
    _check_tensor(op, "top_k", top_k, (torch.int64,), (("B", bsz),))
    _check_tensor(op, "top_p", top_p, (torch.float32, torch.float64), (("B", bsz),))
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        _check_device(op, name, t, target_logits, "target_logits")
    # the optional logit processing (checks.h check_verify_processing)
    if output_counts is not None:
        _check_tensor(op, "output_counts", output_counts, (torch.int32,), (("B", bsz), ("V", vocab)))
    if prompt_mask is not None:
        _check_tensor(op, "prompt_mask", prompt_mask, (torch.bool,), (("B", bsz), ("V", vocab)))
    if logit_bias is not None:
        _check_tensor(op, "logit_bias", logit_bias, (torch.float32,), (("B", bsz), ("V", vocab)))
    if token_bitmask is not None:
        _check_tensor(op, "token_bitmask", token_bitmask, (torch.int32,),
                      (("B", bsz), ("N", n), ("ceil(V / 32)", (vocab + 31) // 32)))
    per_row = (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
               ("repetition_penalty", repetition_penalty), ("min_p", min_p))
    for name, t in per_row:
        if t is not None:
            _check_tensor(op, name, t, (torch.float32, torch.float64), (("B", bsz),))
    for name, t in (("output_counts", output_counts), ("prompt_mask", prompt_mask), *per_row[:3],
                    ("logit_bias", logit_bias), ("min_p", min_p), ("token_bitmask", token_bitmask)):
        if t is not None:
            _check_device(op, name, t, target_logits, "target_logits")
    for name, t in per_row[:3]:
        torch._check(t is None or output_counts is not None,
                     lambda: f"{op}: {name} needs output_counts (int32 [B, V], the request's generated token counts; "
                             f"zeros for a fresh request)")


def _check_compact_kv_fake(caches: list[Tensor], prefix_len: Tensor, accept_index: Tensor,
                           accept_len: Tensor) -> None:
    op = "compact_kv"
    torch._check(accept_len.dim() == 1 and accept_len.dtype == torch.int64,
                 lambda: f"{op}: accept_len must be int64 [B], got {_describe(accept_len)}")
    bsz = accept_len.shape[0]
    torch._check(accept_index.dim() == 2 and accept_index.dtype == torch.int64,
                 lambda: f"{op}: accept_index must be int64 [B, N] with B = {bsz}, got {_describe(accept_index)}")
    torch._check(accept_index.shape[0] == bsz,
                 lambda: f"{op}: accept_index must be int64 [B, N] with B = {bsz}, got {_describe(accept_index)}")
    _check_tensor(op, "prefix_len", prefix_len, (torch.int64,), (("B", bsz),))
    _check_device(op, "accept_index", accept_index, accept_len, "accept_len")
    _check_device(op, "prefix_len", prefix_len, accept_len, "accept_len")
    if not caches:
        return
    c0 = caches[0]
    torch._check(c0.dim() == 4, lambda: f"{op}: caches[0] must be [B, H, S, D] with B = {bsz}, got {_describe(c0)}")
    torch._check(c0.shape[0] == bsz,
                 lambda: f"{op}: caches[0] must be [B, H, S, D] with B = {bsz}, got {_describe(c0)}")
    for layer, c in enumerate(caches):
        name = f"caches[{layer}]"
        torch._check(c.dtype == c0.dtype and c.dim() == c0.dim(),
                     lambda: f"{op}: {name} must have the dtype and shape of caches[0] ({_describe(c0)}), got "
                             f"{_describe(c)}")
        for i in range(c0.dim()):
            torch._check(c.shape[i] == c0.shape[i],
                         lambda: f"{op}: {name} must have the dtype and shape of caches[0] ({_describe(c0)}), got "
                                 f"{_describe(c)}")
        torch._check(c.is_floating_point(),
                     lambda: f"{op}: {name} must be a floating-point tensor, got {_describe(c)}")
        _check_device(op, name, c, accept_len, "accept_len")
        _check_last_dim(op, name, c)


def _check_tree_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor,
                               tree_mask_packed: Tensor, scale: float, out: Tensor, lse: Tensor | None) -> None:
    op = "tree_attention"
    torch._check(q.dim() == 4 and q.dtype in _FLOATS,
                 lambda: f"{op}: q must be float32, bfloat16 or float16 [B, n, Hq, D], got {_describe(q)}")
    bsz, n, hq, d = q.shape
    torch._check(n >= 1 and n <= _MAX_TREE_NODES,
                 lambda: f"{op}: q must have n in [1, {_MAX_TREE_NODES}] new tokens, got n = {n} ({_describe(q)})")
    torch._check(hq >= 1, lambda: f"{op}: q must have Hq >= 1 heads, got {_describe(q)}")
    torch._check(d >= 1 and d <= _MAX_HEAD_DIM,
                 lambda: f"{op}: q must have a head dim D in [1, {_MAX_HEAD_DIM}], got D = {d} ({_describe(q)})")
    _check_last_dim(op, "q", q)
    # the caches hold q's dtype; on CPU float32 queries also read float16 / bfloat16 caches
    cpu_f32 = q.device.type == "cpu" and q.dtype == torch.float32
    kv_dtype = k_cache.dtype if cpu_f32 and k_cache.dtype in (torch.float16, torch.bfloat16) else q.dtype
    dt = "float32, float16 or bfloat16 (float32 q)" if cpu_f32 else f"{_dtype_name(q.dtype)} (q's dtype)"

    def k_msg() -> str:
        return (f"{op}: k_cache must be {dt} [B, Hkv, S, D] with B = {bsz} and D = {d} (the sizes of q), "
                f"got {_describe(k_cache)}")
    torch._check(k_cache.dim() == 4 and k_cache.dtype == kv_dtype, k_msg)
    torch._check(k_cache.shape[0] == bsz, k_msg)
    torch._check(k_cache.shape[3] == d, k_msg)
    hkv, seq = k_cache.shape[1], k_cache.shape[2]
    torch._check(hkv >= 1 and hq % hkv == 0,
                 lambda: f"{op}: the query heads Hq = {hq} must be a multiple of the kv heads Hkv = {hkv} (GQA), "
                         f"got q {_describe(q)} and k_cache {_describe(k_cache)}")
    _check_tensor(op, "v_cache", v_cache, (kv_dtype,), (("B", bsz), ("Hkv", hkv), ("S", seq), ("D", d)))
    _check_tensor(op, "cache_len", cache_len, (torch.int64,), (("B", bsz),))
    _check_tensor(op, "tree_mask_packed", tree_mask_packed, (torch.int64,), (("B", bsz), ("n", n)))
    _check_tensor(op, "out", out, (q.dtype,), (("B", bsz), ("n", n), ("Hq", hq), ("D", d)))
    if lse is not None:
        _check_tensor(op, "lse", lse, (torch.float32,), (("B", bsz), ("Hq", hq), ("n", n)))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cache_len", cache_len),
                    ("tree_mask_packed", tree_mask_packed), ("out", out)):
        _check_device(op, name, t, q, "q")
    _check_last_dim(op, "k_cache", k_cache)
    _check_last_dim(op, "v_cache", v_cache)
    _check_output(op, "out", out)
    if lse is not None:
        _check_device(op, "lse", lse, q, "q")
        _check_output(op, "lse", lse)
    torch._check(math.isfinite(scale), lambda: f"{op}: scale must be a finite number (e.g. 1 / sqrt(D)), got {scale}")


def _check_rms_norm_fake(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    torch._check(x.dtype in _NORM_DTYPES and x.dim() >= 1,
                 lambda: f"rms_norm: x must be a float32 / bfloat16 / float16 tensor [..., K], got {_describe(x)}")
    k = x.shape[-1]
    _check_tensor("rms_norm", "weight", weight, (x.dtype,), (("K", k),))

    def out_msg() -> str:
        return (f"rms_norm: out must be a contiguous {_dtype_name(x.dtype)} tensor of x's shape {_shape(x.shape)}, "
                f"got {_describe(out)}")
    torch._check(out.dtype == x.dtype and out.dim() == x.dim(), out_msg)
    for i in range(x.dim()):
        torch._check(out.shape[i] == x.shape[i], out_msg)
    torch._check(out.is_contiguous(), out_msg)
    _check_device("rms_norm", "weight", weight, x, "x")
    _check_device("rms_norm", "out", out, x, "x")
    torch._check(math.isfinite(eps) and eps >= 0, lambda: f"rms_norm: eps must be finite and >= 0, got {eps}")


def _format_info(op: str, fmt: int) -> tuple[str, int, int]:
    """(name, weights per block, bytes per block) of a GGML type id (linear.cpp checked_info)."""
    torch._check(fmt in reference.WEIGHT_FORMATS,
                 lambda: f"{op}: weight format {fmt} is not supported; supported (GGML type ids): "
                         + ", ".join(f"{f} {v[0]}" for f, v in reference.WEIGHT_FORMATS.items()))
    return reference.WEIGHT_FORMATS[fmt]


def _row_bytes(op: str, fmt: int, k) -> int:
    """Bytes of a row of ``k`` weights in format ``fmt`` (linear.cpp format_row_bytes)."""
    name, block, nbytes = _format_info(op, fmt)
    torch._check(k % block == 0, lambda: f"{op}: a {name} row holds a multiple of {block} weights, got K = {k}")
    return k // block * nbytes


def _check_linear_fake(op: str, x: Tensor, weights: list[Tensor], formats: list[int], bias: Tensor | None,
                       activations: int) -> None:
    """linear.cpp linear (segments) and linear_int8.cpp: x [..., K], weights[i] [N_i, K] of a dense dtype matching
    formats[i] or uint8 [N_i, row bytes] GGUF blocks, bias with sum N_i elements, all on x's device."""
    torch._check(x.dim() >= 1, lambda: f"{op}: x must be a tensor [..., K], got {_describe(x)}")
    torch._check(activations in (0, 8), lambda: f"{op}: activations must be 0 (exact) or 8 (int8), got {activations}")
    torch._check(len(weights) > 0 and len(weights) == len(formats),
                 lambda: f"{op}: weights and formats must be non-empty lists of the same length, got {len(weights)} "
                         f"and {len(formats)}")
    k = x.shape[-1]
    int8 = activations == 8 and k % 32 == 0 and all(map(reference.has_int8_kernel, formats))
    if not int8:  # the int8 path takes any x dtype (converted to float32 and back) and K = 0
        torch._check(x.dtype in _FLOATS,
                     lambda: f"{op}: x dtype must be float32, bfloat16 or float16, got {_dtype_name(x.dtype)}")
        torch._check(k > 0, lambda: f"{op}: x must have K > 0 features, got {_describe(x)}")
    for i, (w, fmt) in enumerate(zip(weights, formats)):
        name, block, _ = _format_info(op, fmt)
        torch._check(w.dim() == 2, lambda: f"{op}: weights[{i}] must be a dense 2-D tensor, got {_describe(w)}")
        _check_device(op, f"weights[{i}]", w, x, "x")
        if block == 1:
            torch._check(reference.DENSE_FORMATS.get(w.dtype) == fmt,
                         lambda: f"{op}: weights[{i}] has dtype {_dtype_name(w.dtype)} but format {fmt} ({name})")
            torch._check(w.shape[1] == k, lambda: f"{op}: x has {k} features, weights[{i}] expects {w.shape[1]}")
        else:
            rb = _row_bytes(op, fmt, k)

            def msg() -> str:
                return f"{op}: weights[{i}] ({name}, K = {k}) must be uint8 [N, {rb}], got {_describe(w)}"
            torch._check(w.dtype == torch.uint8, msg)
            torch._check(w.shape[1] == rb, msg)
    if bias is not None:
        n_out = sum(w.shape[0] for w in weights)
        torch._check(bias.numel() == n_out, lambda: f"{op}: bias has {bias.numel()} elements, expected {n_out}")


if _EXTENSION:
    @torch.library.register_fake("turbospec::build_tree")
    def _build_tree_fake(parents, tree_mask, tree_mask_packed, depth, retrieve_index):
        _check_build_tree_fake(parents, tree_mask, tree_mask_packed, depth, retrieve_index)
        return None

    @torch.library.register_fake("turbospec::verify")
    def _verify_fake(target_logits, parents, draft_token_ids, draft_probs, uniform, temperature, top_k,
                     top_p, accept_len, accept_index, output_token_ids, output_counts=None, prompt_mask=None,
                     presence_penalty=None, frequency_penalty=None, repetition_penalty=None, logit_bias=None,
                     min_p=None, token_bitmask=None):
        _check_verify_fake(target_logits, parents, draft_token_ids, draft_probs, uniform, temperature, top_k, top_p,
                           accept_len, accept_index, output_token_ids, output_counts, prompt_mask, presence_penalty,
                           frequency_penalty, repetition_penalty, logit_bias, min_p, token_bitmask)
        return None

    @torch.library.register_fake("turbospec::compact_kv")
    def _compact_kv_fake(caches, prefix_len, accept_index, accept_len):
        _check_compact_kv_fake(caches, prefix_len, accept_index, accept_len)
        return None

    @torch.library.register_fake("turbospec::tree_attention")
    def _tree_attention_fake(q, k_cache, v_cache, cache_len, tree_mask_packed, scale, include_prefix, out, lse,
                             window=0, softcap=0.0, bf16_products=False):
        _check_tree_attention_fake(q, k_cache, v_cache, cache_len, tree_mask_packed, scale, out, lse)
        torch._check(not bf16_products or (k_cache.dtype == torch.bfloat16 and q.dtype != torch.float16),
                     lambda: f"tree_attention: bf16_products=True needs bfloat16 caches and float32 or bfloat16 q, "
                             f"got q {_describe(q)} over {_describe(k_cache)}")
        return None

    if has_op("small_linear"):
        @torch.library.register_fake("turbospec::small_linear")
        def _small_linear_fake(x, weight, bias):
            torch._check(weight.dim() == 2,
                         lambda: f"small_linear: weight must be a dense 2-D tensor, got {_describe(weight)}")
            torch._check(weight.dtype in reference.DENSE_FORMATS,
                         lambda: f"small_linear: weight dtype must be float32, float16 or bfloat16, got "
                                 f"{_dtype_name(weight.dtype)}")
            _check_linear_fake("small_linear", x, [weight], [reference.DENSE_FORMATS[weight.dtype]], bias, 0)
            return x.new_empty(*x.shape[:-1], weight.shape[0])

    if has_op("linear"):
        @torch.library.register_fake("turbospec::linear")
        def _linear_fake(x, weights, formats, bias, activations=0):
            _check_linear_fake("linear", x, weights, formats, bias, activations)
            return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))

        @torch.library.register_fake("turbospec::dequantize")
        def _dequantize_fake(raw, fmt, k):
            name, block, _ = _format_info("dequantize", fmt)
            torch._check(block > 1, lambda: f"dequantize: format {name} is not a block format (use .float())")
            rb = _row_bytes("dequantize", fmt, k)

            def msg() -> str:
                return f"dequantize: raw must be uint8 [N, {rb}] for {name} with K = {k}, got {_describe(raw)}"
            torch._check(raw.dim() == 2 and raw.dtype == torch.uint8, msg)
            torch._check(raw.shape[1] == rb, msg)
            return raw.new_empty(raw.shape[0], k, dtype=torch.float32)

    if has_op("add_rms_norm"):
        @torch.library.register_fake("turbospec::add_rms_norm")
        def _add_rms_norm_fake(x, delta, weight, eps, out, sum_out):
            op = "add_rms_norm"
            torch._check(x.dim() >= 1 and x.dtype in _FLOATS and x.shape[-1] >= 1,
                         lambda: f"{op}: x must be float32, bfloat16 or float16 [..., K] with K >= 1, got {_describe(x)}")
            torch._check(weight.dtype == x.dtype and tuple(weight.shape) == (x.shape[-1],),
                         lambda: f"{op}: weight must be {_dtype_name(x.dtype)} [K] = [{x.shape[-1]}], "
                                 f"got {_describe(weight)}")
            torch._check((delta is None) == (sum_out is None),
                         lambda: f"{op}: sum_out (where x + delta is written) must be given exactly when delta is")
            for name, t in (("out", out), ("delta", delta), ("sum_out", sum_out)):
                if t is not None:
                    torch._check(t.dtype == x.dtype and t.shape == x.shape,
                                 lambda: f"{op}: {name} must be {_dtype_name(x.dtype)} {list(x.shape)} (the dtype "
                                         f"and shape of x), got {_describe(t)}")
            return None

        @torch.library.register_fake("turbospec::silu_mul")
        def _silu_mul_fake(gate_up, out):
            op = "silu_mul"
            torch._check(gate_up.dim() >= 1 and gate_up.dtype in _FLOATS and gate_up.shape[-1] >= 2
                         and gate_up.shape[-1] % 2 == 0,
                         lambda: f"{op}: gate_up must be float32, bfloat16 or float16 [..., 2I] with I >= 1, "
                                 f"got {_describe(gate_up)}")
            want = [*gate_up.shape[:-1], gate_up.shape[-1] // 2]
            torch._check(out.dtype == gate_up.dtype and list(out.shape) == want,
                         lambda: f"{op}: out must be {_dtype_name(gate_up.dtype)} {want}, got {_describe(out)}")
            return None

        @torch.library.register_fake("turbospec::rope_cache")
        def _rope_cache_fake(qkv, cos, sin_signed, cache_len, num_heads, q_out, k_cache, v_cache):
            op = "rope_cache"
            torch._check(qkv.dim() == 4 and qkv.dtype in _FLOATS,
                         lambda: f"{op}: qkv must be float32, bfloat16 or float16 [B, n, H + 2 Hkv, D], "
                                 f"got {_describe(qkv)}")
            bsz, n, _, d = qkv.shape
            torch._check(k_cache.dim() == 4 and qkv.shape[2] == num_heads + 2 * k_cache.shape[1],
                         lambda: f"{op}: qkv must hold num_heads = {num_heads} q heads and 2 x Hkv k / v heads "
                                 f"in dim 2, got {_describe(qkv)} and k_cache {_describe(k_cache)}")
            torch._check(list(q_out.shape) == [bsz, n, num_heads, d] and q_out.dtype == qkv.dtype,
                         lambda: f"{op}: q_out must be {_dtype_name(qkv.dtype)} [B, n, H, D] = "
                                 f"{[bsz, n, num_heads, d]}, got {_describe(q_out)}")
            return None

    if has_op("rms_norm"):
        @torch.library.register_fake("turbospec::rms_norm")
        def _rms_norm_fake(x, weight, eps, out):
            _check_rms_norm_fake(x, weight, eps, out)
            return None
