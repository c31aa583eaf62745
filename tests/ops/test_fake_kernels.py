"""The fake (meta) kernels of ``turbospec::*`` (turbospec/ops/wrappers.py) against the CPU kernels.

A fake kernel runs instead of the real one when torch.compile / FakeTensorMode traces a call, so it
must accept every call the CPU kernel accepts, give outputs of the same shapes and dtypes, and reject
the shapes / dtypes / layouts / devices the CPU kernel rejects, naming the argument. Every valid case
is traced under FakeTensorMode (static and symbolic shapes) and run for real; every bad case must
raise both ways.
"""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "extension not built": the module skips itself then
    from turbospec import ops
    from turbospec.ops import reference

pytestmark = pytest.mark.skipif(not ops.kernels_available()["cpu"],
                                reason="turbospec._C is not built (`python setup.py build_ext --inplace`)")

Q8_0, Q4_K, Q6_K = 8, 12, 14


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tree(bsz: int, n: int, g: torch.Generator) -> torch.Tensor:
    """A random valid parents array int64 [bsz, n] (node 0 the root, parents before children)."""
    parents = torch.full((bsz, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bsz,), generator=g)
    return parents


def blocks(fmt: int, rows: int, k: int) -> torch.Tensor:
    """uint8 [rows, row bytes] GGUF blocks of format ``fmt``, all zero (valid blocks: scale 0)."""
    return torch.zeros(rows, reference.row_bytes(fmt, k), dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------
# valid calls: name -> () -> (op name, args)
# ----------------------------------------------------------------------------------------------
def build_tree_args(bsz: int = 2, n: int = 5) -> tuple:
    return (tree(bsz, n, gen(0)), torch.empty(bsz, n, n, dtype=torch.bool), torch.empty(bsz, n, dtype=torch.int64),
            torch.empty(bsz, n, dtype=torch.int64), torch.empty(bsz, n, n, dtype=torch.int64))


def verify_args(dtype: torch.dtype = torch.float32, with_q: bool = True, temperature: float = 1.0,
                bsz: int = 2, n: int = 5, vocab: int = 30) -> tuple:
    g = gen(1)
    logits = (torch.randn(bsz, n, vocab, generator=g) * 2).to(dtype)
    draft_probs = torch.softmax(torch.randn(bsz, n, vocab, generator=g), -1).to(dtype) if with_q else None
    outs = (torch.empty(bsz, dtype=torch.int64), torch.empty(bsz, n, dtype=torch.int64),
            torch.empty(bsz, n, dtype=torch.int64))
    return (logits, tree(bsz, n, g), torch.randint(0, vocab, (bsz, n), generator=g), draft_probs,
            torch.rand(bsz, n, generator=g), torch.full((bsz,), temperature), torch.full((bsz,), 5),
            torch.full((bsz,), 0.9), *outs)


def compact_kv_args(layers: int = 3) -> tuple:
    g = gen(2)
    caches = [torch.randn(2, 2, 12, 8, generator=g) for _ in range(layers)]
    return caches, torch.tensor([1, 3]), torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]]), torch.tensor([2, 1])


def tree_attention_args(dtype: torch.dtype = torch.float32, with_lse: bool = True, include_prefix: bool = True,
                        bsz: int = 2, n: int = 5, hq: int = 4, hkv: int = 2, seq: int = 30, d: int = 16) -> tuple:
    g = gen(3)
    q = torch.randn(bsz, n, hq, d, generator=g).to(dtype)
    k = torch.randn(bsz, hkv, seq, d, generator=g).to(dtype)
    v = torch.randn(bsz, hkv, seq, d, generator=g).to(dtype)
    packed = reference.build_tree(tree(bsz, n, g))[1]
    cache_len = torch.tensor([3, seq - n][:bsz])
    lse = torch.empty(bsz, hq, n) if with_lse else None
    return q, k, v, cache_len, packed, 0.25, include_prefix, torch.empty(q.shape, dtype=dtype), lse


def rms_norm_args(dtype: torch.dtype = torch.float32) -> tuple:
    x = torch.randn(3, 4, 16, generator=gen(4)).to(dtype)
    return x, torch.randn(16, generator=gen(5)).to(dtype), 1e-6, torch.empty_like(x)


def small_linear_args(dtype: torch.dtype = torch.float32, wdtype: torch.dtype = torch.float32) -> tuple:
    g = gen(6)
    return torch.randn(2, 3, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(wdtype), torch.randn(5)


def linear_args(activations: int = 0) -> tuple:
    g = gen(7)
    if activations == 8:  # all GGUF blocks, K % 256 == 0: the int8 path (any x dtype; float64 here)
        return (torch.randn(3, 256, generator=g, dtype=torch.float64), [blocks(Q8_0, 4, 256), blocks(Q4_K, 2, 256)],
                [Q8_0, Q4_K], torch.randn(6), 8)
    return (torch.randn(2, 3, 64, generator=g), [torch.randn(5, 64, generator=g), blocks(Q8_0, 3, 64)], [0, Q8_0],
            torch.randn(8), 0)


VALID: dict[str, Callable[[], tuple[str, tuple]]] = {
    "build_tree": lambda: ("build_tree", build_tree_args()),
    "build_tree-64-nodes": lambda: ("build_tree", build_tree_args(1, 64)),
    "verify": lambda: ("verify", verify_args()),
    "verify-bf16-greedy-no-draft-probs": lambda: ("verify", verify_args(torch.bfloat16, False, 0.0)),
    "compact_kv": lambda: ("compact_kv", compact_kv_args()),
    "compact_kv-no-caches": lambda: ("compact_kv", compact_kv_args(0)),
    "tree_attention": lambda: ("tree_attention", tree_attention_args()),
    "tree_attention-bf16-no-lse-gqa4": lambda: ("tree_attention", tree_attention_args(torch.bfloat16, False, False,
                                                                                      hq=8, hkv=2)),
    "tree_attention-fp16-mha": lambda: ("tree_attention", tree_attention_args(torch.float16, hq=2, hkv=2, d=8)),
    "rms_norm": lambda: ("rms_norm", rms_norm_args()),
    "small_linear": lambda: ("small_linear", small_linear_args()),
    "small_linear-bf16-x-fp16-weight": lambda: ("small_linear", small_linear_args(torch.bfloat16, torch.float16)),
    "linear": lambda: ("linear", linear_args()),
    "linear-int8": lambda: ("linear", linear_args(8)),
    "dequantize": lambda: ("dequantize", (blocks(Q6_K, 3, 256), Q6_K, 256)),
}


def op_of(name: str):
    if not ops.has_op(name):
        pytest.skip(f"turbospec._C has no {name} op")
    return getattr(torch.ops.turbospec, name).default


def to_fake(mode: FakeTensorMode, args: tuple) -> tuple:
    return pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)


def meta(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.device)


@pytest.mark.parametrize("case", VALID)
def test_valid_call_traces_to_the_real_kernels_shapes(case):
    name, args = VALID[case]()
    op = op_of(name)
    mode = FakeTensorMode()
    fake_args = to_fake(mode, args)
    with mode:
        fake_out = op(*fake_args)
    real_args = pytree.tree_map_only(torch.Tensor, torch.clone, args)
    real_out = op(*real_args)
    # the returned tensor (linear, small_linear, dequantize) or None (the ops writing into out-arguments)
    assert (fake_out is None) == (real_out is None)
    if real_out is not None:
        assert isinstance(fake_out, torch.Tensor) and meta(fake_out) == meta(real_out)
    # the arguments (out-arguments included) keep their shapes, dtypes and devices both ways
    assert [meta(t) for t in pytree.tree_leaves(fake_args) if isinstance(t, torch.Tensor)] == \
        [meta(t) for t in pytree.tree_leaves(real_args) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("case", ["build_tree", "verify", "compact_kv", "tree_attention", "rms_norm", "small_linear",
                                  "linear", "dequantize"])
def test_valid_call_traces_with_symbolic_shapes(case):
    """Under make_fx(tracing_mode="symbolic") every size is a SymInt: the checks must hold symbolically."""
    name, args = VALID[case]()
    op = op_of(name)
    gm = make_fx(lambda *a: op(*a), tracing_mode="symbolic")(*args)
    assert f"turbospec.{name}.default" in gm.code
    real = op(*pytree.tree_map_only(torch.Tensor, torch.clone, args))
    got = gm(*pytree.tree_map_only(torch.Tensor, torch.clone, args))
    if real is not None:
        assert meta(got) == meta(real)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_rms_norm(dtype):
    """rms_norm has no opcheck elsewhere (the other ops' opchecks are in test_ops / test_tree_attention /
    test_linear): the fake against the kernel, with static and dynamic shapes."""
    op = op_of("rms_norm")
    torch.library.opcheck(op, rms_norm_args(dtype), test_utils=("test_schema", "test_faketensor",
                                                                "test_aot_dispatch_dynamic"))


# ----------------------------------------------------------------------------------------------
# bad calls: (case id, valid case, {argument: new value}, regex of the fake's message)
# ----------------------------------------------------------------------------------------------
I64 = torch.int64


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with a last-dim stride of 2 (not contiguous)."""
    return torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]


BAD = [
    # build_tree
    ("build_tree-parents-3d", "build_tree", {"parents": torch.zeros(2, 5, 1, dtype=I64)},
     r"build_tree: parents must be int64 \[B, N\], got int64 \[2, 5, 1\]"),
    ("build_tree-parents-int32", "build_tree", {"parents": torch.zeros(2, 5, dtype=torch.int32)},
     r"build_tree: parents must be int64 \[B, N\], got int32 \[2, 5\]"),
    ("build_tree-65-nodes", "build_tree", {"parents": torch.zeros(2, 65, dtype=I64)},
     r"build_tree: parents must have N in \[1, 64\] nodes, got N = 65"),
    ("build_tree-tree_mask-shape", "build_tree", {"tree_mask": torch.empty(2, 5, 4, dtype=torch.bool)},
     r"build_tree: tree_mask must be bool \[B, N, N\] = \[2, 5, 5\], got bool \[2, 5, 4\]"),
    ("build_tree-tree_mask_packed-dtype", "build_tree", {"tree_mask_packed": torch.empty(2, 5, dtype=torch.int32)},
     r"build_tree: tree_mask_packed must be int64 \[B, N\] = \[2, 5\], got int32 \[2, 5\]"),
    ("build_tree-depth-batch", "build_tree", {"depth": torch.empty(3, 5, dtype=I64)},
     r"build_tree: depth must be int64 \[B, N\] = \[2, 5\], got int64 \[3, 5\]"),
    ("build_tree-retrieve_index-strided", "build_tree", {"retrieve_index": strided(torch.empty(2, 5, 5, dtype=I64))},
     r"build_tree: output retrieve_index must be contiguous"),
    ("build_tree-depth-device", "build_tree", {"depth": torch.empty(2, 5, dtype=I64, device="meta")},
     r"build_tree: depth must be on cpu \(the device of parents\), got meta"),
    # verify
    ("verify-target_logits-2d", "verify", {"target_logits": torch.zeros(2, 5)},
     r"verify: target_logits must be float32, bfloat16 or float16 \[B, N, V\], got float32 \[2, 5\]"),
    ("verify-target_logits-int", "verify", {"target_logits": torch.zeros(2, 5, 30, dtype=I64)},
     r"verify: target_logits must be float32, bfloat16 or float16 \[B, N, V\], got int64"),
    ("verify-empty-vocab", "verify", {"target_logits": torch.zeros(2, 5, 0)},
     r"verify: target_logits must have a vocabulary V >= 1, got float32 \[2, 5, 0\]"),
    ("verify-parents-shape", "verify", {"parents": torch.zeros(2, 4, dtype=I64)},
     r"verify: parents must be int64 \[B, N\] = \[2, 5\], got int64 \[2, 4\]"),
    ("verify-draft_token_ids-dtype", "verify", {"draft_token_ids": torch.zeros(2, 5, dtype=torch.int32)},
     r"verify: draft_token_ids must be int64 \[B, N\] = \[2, 5\], got int32 \[2, 5\]"),
    ("verify-draft_probs-vocab", "verify", {"draft_probs": torch.zeros(2, 5, 31)},
     r"verify: draft_probs must be float32, bfloat16 or float16 \[B, N, V\] = \[2, 5, 30\], got float32 \[2, 5, 31\]"),
    ("verify-uniform-float64", "verify", {"uniform": torch.zeros(2, 5, dtype=torch.float64)},
     r"verify: uniform must be float32 \[B, N\] = \[2, 5\], got float64 \[2, 5\]"),
    ("verify-accept_len-shape", "verify", {"accept_len": torch.empty(2, 1, dtype=I64)},
     r"verify: accept_len must be int64 \[B\] = \[2\], got int64 \[2, 1\]"),
    ("verify-accept_index-shape", "verify", {"accept_index": torch.empty(2, 6, dtype=I64)},
     r"verify: accept_index must be int64 \[B, N\] = \[2, 5\], got int64 \[2, 6\]"),
    ("verify-output_token_ids-strided", "verify", {"output_token_ids": strided(torch.empty(2, 5, dtype=I64))},
     r"verify: output output_token_ids must be contiguous"),
    ("verify-uniform-device", "verify", {"uniform": torch.zeros(2, 5, device="meta")},
     r"verify: uniform must be on cpu \(the device of target_logits\), got meta"),
    # per-row sampling tensors (their values are checked by the kernels: test_verify_rows.py)
    ("verify-temperature-int", "verify", {"temperature": torch.ones(2, dtype=I64)},
     r"verify: temperature must be float32 or float64 \[B\] = \[2\], got int64 \[2\]"),
    ("verify-top_k-float", "verify", {"top_k": torch.zeros(2)},
     r"verify: top_k must be int64 \[B\] = \[2\], got float32 \[2\]"),
    ("verify-top_p-shape", "verify", {"top_p": torch.ones(3)},
     r"verify: top_p must be float32 or float64 \[B\] = \[2\], got float32 \[3\]"),
    ("verify-top_k-device", "verify", {"top_k": torch.zeros(2, dtype=I64, device="meta")},
     r"verify: top_k must be on cpu \(the device of target_logits\), got meta"),
    # compact_kv
    ("compact_kv-accept_len-2d", "compact_kv", {"accept_len": torch.zeros(2, 1, dtype=I64)},
     r"compact_kv: accept_len must be int64 \[B\], got int64 \[2, 1\]"),
    ("compact_kv-accept_index-batch", "compact_kv", {"accept_index": torch.zeros(3, 4, dtype=I64)},
     r"compact_kv: accept_index must be int64 \[B, N\] with B = 2, got int64 \[3, 4\]"),
    ("compact_kv-prefix_len-int32", "compact_kv", {"prefix_len": torch.tensor([0, 0], dtype=torch.int32)},
     r"compact_kv: prefix_len must be int64 \[B\] = \[2\], got int32 \[2\]"),
    ("compact_kv-caches-3d", "compact_kv", {"caches": [torch.zeros(2, 12, 8)]},
     r"compact_kv: caches\[0\] must be \[B, H, S, D\] with B = 2, got float32 \[2, 12, 8\]"),
    ("compact_kv-caches-batch", "compact_kv", {"caches": [torch.zeros(3, 2, 12, 8)]},
     r"compact_kv: caches\[0\] must be \[B, H, S, D\] with B = 2, got float32 \[3, 2, 12, 8\]"),
    ("compact_kv-caches-mismatch", "compact_kv", {"caches": [torch.zeros(2, 2, 12, 8), torch.zeros(2, 2, 10, 8)]},
     r"compact_kv: caches\[1\] must have the dtype and shape of caches\[0\] \(float32 \[2, 2, 12, 8\]\), "
     r"got float32 \[2, 2, 10, 8\]"),
    ("compact_kv-caches-int", "compact_kv", {"caches": [torch.zeros(2, 2, 12, 8, dtype=I64)]},
     r"compact_kv: caches\[0\] must be a floating-point tensor, got int64"),
    ("compact_kv-caches-strided", "compact_kv", {"caches": [strided(torch.zeros(2, 2, 12, 8))]},
     r"compact_kv: caches\[0\] must be contiguous in its last dim \(D\)"),
    ("compact_kv-prefix_len-device", "compact_kv", {"prefix_len": torch.zeros(2, dtype=I64, device="meta")},
     r"compact_kv: prefix_len must be on cpu \(the device of accept_len\), got meta"),
    # tree_attention
    ("tree_attention-q-3d", "tree_attention", {"q": torch.zeros(2, 5, 64)},
     r"tree_attention: q must be float32, bfloat16 or float16 \[B, n, Hq, D\], got float32 \[2, 5, 64\]"),
    ("tree_attention-q-65-tokens", "tree_attention", {"q": torch.zeros(2, 65, 4, 16)},
     r"tree_attention: q must have n in \[1, 64\] new tokens, got n = 65"),
    ("tree_attention-q-head-dim", "tree_attention", {"q": torch.zeros(2, 5, 4, 257)},
     r"tree_attention: q must have a head dim D in \[1, 256\], got D = 257"),
    ("tree_attention-q-strided", "tree_attention", {"q": strided(torch.zeros(2, 5, 4, 16))},
     r"tree_attention: q must be contiguous in its last dim \(D\)"),
    ("tree_attention-k_cache-dtype", "tree_attention", {"k_cache": torch.zeros(2, 2, 30, 16, dtype=torch.float64)},
     r"tree_attention: k_cache must be float32, float16 or bfloat16 \(float32 q\) \[B, Hkv, S, D\] with B = 2 and "
     r"D = 16 .*got float64"),
    ("tree_attention-v_cache-dtype", "tree_attention", {"k_cache": torch.zeros(2, 2, 30, 16, dtype=torch.float16)},
     r"tree_attention: v_cache must be float16 \[B, Hkv, S, D\] = \[2, 2, 30, 16\], got float32"),
    ("tree_attention-k_cache-head-dim", "tree_attention", {"k_cache": torch.zeros(2, 2, 30, 8)},
     r"tree_attention: k_cache must be float32, float16 or bfloat16 \(float32 q\) \[B, Hkv, S, D\] with B = 2 and "
     r"D = 16 .*got float32 \[2, 2, 30, 8\]"),
    ("tree_attention-gqa", "tree_attention",
     {"k_cache": torch.zeros(2, 3, 30, 16), "v_cache": torch.zeros(2, 3, 30, 16)},
     r"tree_attention: the query heads Hq = 4 must be a multiple of the kv heads Hkv = 3"),
    ("tree_attention-v_cache-seq", "tree_attention", {"v_cache": torch.zeros(2, 2, 29, 16)},
     r"tree_attention: v_cache must be float32 \[B, Hkv, S, D\] = \[2, 2, 30, 16\], got float32 \[2, 2, 29, 16\]"),
    ("tree_attention-cache_len-int32", "tree_attention", {"cache_len": torch.tensor([0, 0], dtype=torch.int32)},
     r"tree_attention: cache_len must be int64 \[B\] = \[2\], got int32 \[2\]"),
    ("tree_attention-tree_mask_packed-shape", "tree_attention", {"tree_mask_packed": torch.zeros(2, 4, dtype=I64)},
     r"tree_attention: tree_mask_packed must be int64 \[B, n\] = \[2, 5\], got int64 \[2, 4\]"),
    ("tree_attention-out-dtype", "tree_attention", {"out": torch.empty(2, 5, 4, 16, dtype=torch.float16)},
     r"tree_attention: out must be float32 \[B, n, Hq, D\] = \[2, 5, 4, 16\], got float16 \[2, 5, 4, 16\]"),
    ("tree_attention-lse-shape", "tree_attention", {"lse": torch.empty(2, 5, 4)},
     r"tree_attention: lse must be float32 \[B, Hq, n\] = \[2, 4, 5\], got float32 \[2, 5, 4\]"),
    ("tree_attention-out-strided", "tree_attention", {"out": torch.empty(2, 4, 5, 16).transpose(1, 2)},
     r"tree_attention: output out must be contiguous"),
    ("tree_attention-cache_len-device", "tree_attention", {"cache_len": torch.zeros(2, dtype=I64, device="meta")},
     r"tree_attention: cache_len must be on cpu \(the device of q\), got meta"),
    ("tree_attention-scale", "tree_attention", {"scale": float("nan")},
     r"tree_attention: scale must be a finite number \(e.g. 1 / sqrt\(D\)\), got nan"),
    # rms_norm
    ("rms_norm-x-int", "rms_norm", {"x": torch.zeros(3, 16, dtype=torch.int64)},
     r"rms_norm: x must be a float32 / bfloat16 / float16 tensor \[..., K\], got int64 \[3, 16\]"),
    ("rms_norm-weight-dtype", "rms_norm", {"x": torch.zeros(3, 4, 16, dtype=torch.bfloat16),
                                           "out": torch.zeros(3, 4, 16, dtype=torch.bfloat16)},
     r"rms_norm: weight must be bfloat16 \[K\] = \[16\], got float32 \[16\]"),
    ("rms_norm-weight-size", "rms_norm", {"weight": torch.ones(15)},
     r"rms_norm: weight must be float32 \[K\] = \[16\], got float32 \[15\]"),
    ("rms_norm-weight-2d", "rms_norm", {"weight": torch.ones(1, 16)},
     r"rms_norm: weight must be float32 \[K\] = \[16\], got float32 \[1, 16\]"),
    ("rms_norm-out-shape", "rms_norm", {"out": torch.empty(3, 4, 15)},
     r"rms_norm: out must be a contiguous float32 tensor of x's shape \[3, 4, 16\], got float32 \[3, 4, 15\]"),
    ("rms_norm-out-strided", "rms_norm", {"out": strided(torch.empty(3, 4, 16))},
     r"rms_norm: out must be a contiguous float32 tensor of x's shape \[3, 4, 16\], got float32 \[3, 4, 16\]"),
    ("rms_norm-eps", "rms_norm", {"eps": -1.0}, r"rms_norm: eps must be finite and >= 0, got -1.0"),
    # small_linear
    ("small_linear-weight-1d", "small_linear", {"weight": torch.zeros(64)},
     r"small_linear: weight must be a dense 2-D tensor, got float32 \[64\]"),
    ("small_linear-weight-int", "small_linear", {"weight": torch.zeros(5, 64, dtype=I64)},
     r"small_linear: weight dtype must be float32, float16 or bfloat16, got int64"),
    ("small_linear-weight-K", "small_linear", {"weight": torch.zeros(5, 63)},
     r"small_linear: x has 64 features, weights\[0\] expects 63"),
    ("small_linear-x-int", "small_linear", {"x": torch.zeros(2, 64, dtype=I64)},
     r"small_linear: x dtype must be float32, bfloat16 or float16, got int64"),
    ("small_linear-bias", "small_linear", {"bias": torch.zeros(4)}, r"small_linear: bias has 4 elements, expected 5"),
    # linear
    ("linear-formats-length", "linear", {"formats": [0]},
     r"linear: weights and formats must be non-empty lists of the same length, got 2 and 1"),
    ("linear-format-unknown", "linear", {"formats": [0, 7]}, r"linear: weight format 7 is not supported"),
    ("linear-weights-dtype-format", "linear", {"formats": [1, Q8_0]},
     r"linear: weights\[0\] has dtype float32 but format 1 \(F16\)"),
    ("linear-weights-K", "linear", {"weights": [torch.zeros(5, 32), blocks(Q8_0, 3, 64)]},
     r"linear: x has 64 features, weights\[0\] expects 32"),
    ("linear-blocks-row-bytes", "linear", {"weights": [torch.zeros(5, 64), blocks(Q8_0, 3, 32)]},
     r"linear: weights\[1\] \(Q8_0, K = 64\) must be uint8 \[N, 68\], got uint8 \[3, 34\]"),
    ("linear-blocks-K", "linear", {"formats": [0, Q4_K]},
     r"linear: a Q4_K row holds a multiple of 256 weights, got K = 64"),
    ("linear-bias", "linear", {"bias": torch.zeros(7)}, r"linear: bias has 7 elements, expected 8"),
    ("linear-activations", "linear", {"activations": 4},
     r"linear: activations must be 0 \(exact\) or 8 \(int8\), got 4"),
    ("linear-x-K-0", "linear", {"x": torch.zeros(2, 0), "weights": [torch.zeros(5, 0)], "formats": [0],
                                "bias": None}, r"linear: x must have K > 0 features"),
    # dequantize
    ("dequantize-raw-row-bytes", "dequantize", {"raw": blocks(Q6_K, 3, 256)[:, :200]},
     r"dequantize: raw must be uint8 \[N, 210\] for Q6_K with K = 256, got uint8 \[3, 200\]"),
    ("dequantize-raw-dtype", "dequantize", {"raw": torch.zeros(3, 210, dtype=torch.int8)},
     r"dequantize: raw must be uint8 \[N, 210\] for Q6_K with K = 256, got int8 \[3, 210\]"),
    ("dequantize-dense-format", "dequantize", {"fmt": 0}, r"dequantize: format F32 is not a block format"),
    ("dequantize-K", "dequantize", {"k": 100}, r"dequantize: a Q6_K row holds a multiple of 256 weights, got K = 100"),
]


def replace_args(op, args: tuple, new: dict) -> tuple:
    """``args`` with the arguments named in ``new`` (by the op's schema; ``fmt`` / ``k``: dequantize's
    format / K) replaced."""
    names = [a.name for a in op._schema.arguments]
    out = list(args)
    for name, value in new.items():
        out[names.index({"fmt": "format", "k": "K"}.get(name, name))] = value
    return tuple(out)


@pytest.mark.parametrize("case, valid, new, message", BAD, ids=[b[0] for b in BAD])
def test_bad_call_raises_naming_the_argument(case, valid, new, message):
    name, args = VALID[valid]()
    op = op_of(name)
    args = replace_args(op, args, new)
    mode = FakeTensorMode()
    fake_args = to_fake(mode, args)
    with pytest.raises(RuntimeError, match=message):
        with mode:
            op(*fake_args)
    # the real kernel rejects the call too (a tensor on the meta device sends it to the fake kernel)
    with pytest.raises(RuntimeError):
        op(*args)


def test_every_fake_is_covered():
    """Each op with a registered fake kernel has valid and bad cases here."""
    faked = [n for n in ("build_tree", "verify", "compact_kv", "tree_attention", "rms_norm", "small_linear", "linear",
                         "dequantize") if ops.has_op(n)]
    assert {VALID[v]()[0] for _, v, _, _ in BAD} >= set(faked)
    assert {f()[0] for f in VALID.values()} >= set(faked)
