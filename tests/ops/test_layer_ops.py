"""The fused decoder-layer ops (add_rms_norm, silu_mul, rope_cache) against their pure-torch
specifications, on CPU and CUDA, and the model's fused static path against the unfused one."""
from __future__ import annotations

import re

import pytest
import torch

import turbospec
from turbospec import ops
from turbospec.ops import reference

from helpers import gen, make_tiny_model, need_kernels

DEVICES = ["cpu", "cuda"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def assert_near_ulps(out: torch.Tensor, ref: torch.Tensor, what: str):
    """Equal up to one unit in the last place of a 16-bit dtype (float32: a few float32 ulps), and
    in 16 bits equal bit for bit in most elements: another float32 reduction order moves few of
    their roundings (in float32 a one-ulp change of a row's norm moves every value of the row)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    rtol = 1e-5 if out.dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-5, msg=what)
    if out.dtype == torch.float32:
        return
    same = (out == ref).float().mean().item()
    assert same >= 0.9, f"{what}: only {same:.1%} of the values are bit-identical to the spec"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
# widths: the warp kernel (<= 1024), the block kernel with the row in registers (<= 8192: 2048,
# Llama-3-8B's 4096, 8192) and the block loop kernel past it (12288)
@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 3, 576), (2, 5, 1000), (7, 64), (2, 3, 2048), (3, 4096),
                                   (1, 2, 8192), (2, 12288)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_spec(device, dtype, shape, with_delta):
    dev = need_kernels(device)
    x = rand(*shape, dtype=dtype, seed=1, scale=3.0)
    delta = rand(*shape, dtype=dtype, seed=2) if with_delta else None
    w = (1 + rand(shape[-1], seed=3, scale=0.1)).to(dtype)
    ref_s, ref_y = reference.add_rms_norm(x, delta, w, 1e-5)
    s, y = ops.add_rms_norm(x.to(dev), None if delta is None else delta.to(dev), w.to(dev), 1e-5)
    assert torch.equal(s.cpu(), ref_s), "x + delta must round as torch's add does"
    assert_near_ulps(y.cpu(), ref_y, f"add_rms_norm {dtype} {shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_rows_are_independent(device):
    """A row's result does not depend on the other rows (one reduction order per row)."""
    dev = need_kernels(device)
    x, d = rand(6, 1000, seed=4).to(dev), rand(6, 1000, seed=5).to(dev)
    w = rand(1000, seed=6).to(dev)
    _, all_rows = ops.add_rms_norm(x, d, w, 1e-6)
    for r in range(6):
        _, one = ops.add_rms_norm(x[r:r + 1], d[r:r + 1], w, 1e-6)
        assert torch.equal(one[0], all_rows[r])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2), (1, 4, 3072), (3, 2, 200)])
def test_silu_mul_matches_spec(device, dtype, shape):
    dev = need_kernels(device)
    gu = rand(*shape, dtype=dtype, seed=7, scale=4.0)
    assert_near_ulps(ops.silu_mul(gu.to(dev)).cpu(), reference.silu_mul(gu), f"silu_mul {dtype} {shape}")


def rope_inputs(bsz, n, heads, h_kv, d, seq, dtype, seed=0):
    qkv = rand(bsz, n, heads + 2 * h_kv, d, dtype=dtype, seed=seed)
    angles = rand(bsz, n, 1, d // 2, seed=seed + 1)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    kc = rand(bsz, h_kv, seq, d, dtype=dtype, seed=seed + 2)
    vc = rand(bsz, h_kv, seq, d, dtype=dtype, seed=seed + 3)
    return qkv, cos, sin, kc, vc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(1, 1, 9, 3, 64), (2, 5, 4, 2, 16), (1, 64, 32, 8, 128)])
def test_rope_cache_matches_spec_exactly(device, dtype, dims):
    """Same roundings as model.rope.rotate and the index copies: bit-identical."""
    dev = need_kernels(device)
    bsz, n, heads, h_kv, d = dims
    qkv, cos, sin, kc, vc = rope_inputs(bsz, n, heads, h_kv, d, 80, dtype, seed=8)
    cache_len = torch.tensor([3, 11][:bsz])
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_q = reference.rope_cache(qkv, cos, sin, cache_len, heads, ref_k, ref_v)
    k, v = kc.to(dev), vc.to(dev)
    q = ops.rope_cache(qkv.to(dev), cos.to(dev), sin.to(dev), cache_len.to(dev), heads, k, v)
    assert torch.equal(q.cpu(), ref_q)
    assert torch.equal(k.cpu(), ref_k) and torch.equal(v.cpu(), ref_v)
    # the spec itself: q = model.rope.rotate of the q heads; the cache slots hold the rotated k
    from turbospec.model.rope import rotate
    assert torch.equal(ref_q, rotate(qkv[:, :, :heads], cos, sin))
    assert torch.equal(ref_k[0, :, 3:3 + n].transpose(0, 1), rotate(qkv[0, :, heads:heads + h_kv], cos[0], sin[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_rope_cache_skips_slots_outside_the_cache(device):
    """cache_len < 0 or cache_len + j >= S: those slots are not written (no error, no host read)."""
    dev = need_kernels(device)
    qkv, cos, sin, kc, vc = rope_inputs(3, 4, 4, 2, 16, 10, torch.float32, seed=9)
    cache_len = torch.tensor([-1, 8, 2])
    k, v = kc.to(dev), vc.to(dev)
    ops.rope_cache(qkv.to(dev), cos.to(dev), sin.to(dev), cache_len.to(dev), 4, k, v)
    k, v = k.cpu(), v.cpu()
    assert torch.equal(k[0], kc[0]) and torch.equal(v[0], vc[0])  # row 0: nothing written
    assert torch.equal(k[1, :, :8], kc[1, :, :8])  # row 1: slots 8, 9 written, 10 and 11 dropped
    assert torch.equal(v[1, :, 8:], qkv[1, :2, 4 + 2:].transpose(0, 1))
    assert torch.equal(v[2, :, 2:6], qkv[2, :, 6:].transpose(0, 1))


def test_layer_ops_bad_arguments_raise():
    need_kernels("cpu")
    x, w = torch.randn(2, 8), torch.randn(8)
    cases = [
        (lambda: torch.ops.turbospec.add_rms_norm(x, torch.randn(2, 8), w, 1e-5, torch.empty(2, 8), None),
         "add_rms_norm: sum_out (where x + delta is written) must be given exactly when delta is, got delta given "
         "and sum_out None"),
        (lambda: torch.ops.turbospec.add_rms_norm(x, None, w.double(), 1e-5, torch.empty(2, 8), None),
         "add_rms_norm: weight must be float32 [K] = [8], got float64 [8]"),
        (lambda: torch.ops.turbospec.add_rms_norm(x, None, w, float("nan"), torch.empty(2, 8), None),
         "add_rms_norm: eps must be finite and >= 0, got nan"),
        (lambda: torch.ops.turbospec.add_rms_norm(x.t(), None, torch.randn(2), 1e-5, torch.empty(8, 2), None),
         "add_rms_norm: x must be contiguous"),
        (lambda: torch.ops.turbospec.silu_mul(torch.randn(2, 7), torch.empty(2, 3)),
         "silu_mul: gate_up must be float32, bfloat16 or float16 [..., 2I] with I >= 1, got float32 [2, 7]"),
        (lambda: torch.ops.turbospec.silu_mul(torch.randn(2, 8), torch.empty(2, 8)),
         "silu_mul: out must be float32 [2, 4] (gate_up's dtype, half its last dim), got float32 [2, 8]"),
    ]
    qkv, cos, sin, kc, vc = rope_inputs(1, 2, 4, 2, 16, 10, torch.float32)
    q = torch.empty(1, 2, 4, 16)
    cases += [
        (lambda: torch.ops.turbospec.rope_cache(qkv, cos, sin, torch.tensor([0]), 5, q, kc, vc),
         "rope_cache: qkv must hold num_heads = 5 q heads and 2 x Hkv = 2 x 2 k / v heads in dim 2"),
        (lambda: torch.ops.turbospec.rope_cache(qkv, cos, sin, torch.tensor([0], dtype=torch.int32), 4, q, kc, vc),
         "rope_cache: cache_len must be int64 [B] = [1], got int32 [1]"),
        (lambda: torch.ops.turbospec.rope_cache(qkv, cos, sin, torch.tensor([0]), 4, q, kc.bfloat16(), vc),
         "rope_cache: k_cache must be float32 [B, Hkv, S, D] with B = 1 and D = 16"),
        (lambda: torch.ops.turbospec.rope_cache(qkv, cos[..., :8], sin, torch.tensor([0]), 4, q, kc, vc),
         "rope_cache: cos must be float32 [B, n, 1, D] = [1, 2, 1, 16], got float32 [1, 2, 1, 8]"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()


# ---------------------------------------------------------------------------------------------
# The model's fused static path (what runs on CUDA), forced on the CPU kernels here
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("capture", [None, "eagle3"])
def test_fused_static_path_matches_unfused(kind, capture):
    need_kernels("cpu")
    hf = make_tiny_model(kind, seed=11)
    model = turbospec.load_model(hf)
    model.use_cpp_layers = False  # the Python layer loop: fused vs unfused decoders
    cfg = model.cfg
    features = None if capture is None else [0, cfg.num_layers - 1]
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=gen(12))
    pos = torch.arange(4, 10)[None]
    mask = ops.build_tree(torch.tensor([[-1, 0, 1, 1, 0, 4]]))[1]
    outs = []
    for fused in (False, True):
        model.fused_layers = fused
        cache = model.new_cache(32)
        model.ensure_rope(32)
        # a prefix of 4 tokens first, then the 6-node tree after it
        model.forward_static(torch.randint(0, cfg.vocab_size, (1, 4), generator=gen(13)), torch.arange(4)[None],
                             cache, torch.tensor([0]), ops.build_tree(torch.tensor([[-1, 0, 1, 2]]))[1])
        outs.append((model.forward_static(ids, pos, cache, torch.tensor([4]), mask, features), cache))
    (a, ca), (b, cb) = outs
    if features is not None:
        (a, fa), (b, fb) = a, b
        torch.testing.assert_close(fb, fa, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(b.argmax(-1), a.argmax(-1))
    for la, lb in zip(ca.k + ca.v, cb.k + cb.v):
        torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)


def test_fused_static_path_is_the_cuda_default():
    """On CUDA (kernels built) the static path takes the fused decoder; on CPU the C++ loop."""
    hf = make_tiny_model("llama", seed=14)
    cpu = turbospec.load_model(hf)
    assert not cpu._fused_static(cpu.new_cache(8))
    if not (torch.cuda.is_available() and ops.kernels_available()["cuda"]):
        pytest.skip("no CUDA device or CUDA kernels")
    gpu = turbospec.load_model(hf, device="cuda")
    assert gpu._fused_static(gpu.new_cache(8))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_layer_ops(device):
    """The fakes against the kernels (schema, fake tensors, AOT dispatch with dynamic shapes)."""
    dev = need_kernels(device)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    x, d, w = (rand(2, 3, 16, seed=s).to(dev) for s in (20, 21, 22))
    torch.library.opcheck(torch.ops.turbospec.add_rms_norm.default,
                          (x, d, w[0, 0], 1e-5, torch.empty_like(x), torch.empty_like(x)), test_utils=utils)
    torch.library.opcheck(torch.ops.turbospec.add_rms_norm.default, (x, None, w[0, 0], 1e-5, torch.empty_like(x), None),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.turbospec.silu_mul.default, (x, torch.empty(2, 3, 8, device=dev)),
                          test_utils=utils)
    qkv, cos, sin, kc, vc = (t.to(dev) for t in rope_inputs(1, 2, 4, 2, 16, 10, torch.float32))
    torch.library.opcheck(torch.ops.turbospec.rope_cache.default,
                          (qkv, cos, sin, torch.tensor([3], device=dev), 4, torch.empty(1, 2, 4, 16, device=dev), kc, vc),
                          test_utils=utils)
