"""turbospec::rms_norm (csrc/cpu/rms_norm.cpp) against its specification reference.rms_norm: the same
bits on every instruction-set path, for every row count and in place, in float32, bfloat16 and
float16; close to F.rms_norm / the composite norm; bad input named in the error."""
import pytest
import torch
import torch.nn.functional as F

from turbospec import ops
from turbospec.ops import reference

from helpers import on_every_isa


pytestmark = pytest.mark.skipif(not ops.has_op("rms_norm"), reason="turbospec._C with rms_norm not built")


def inputs(rows: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    w = torch.randn(k, generator=g)
    return x, w


@pytest.mark.parametrize("k", [1, 7, 8, 13, 64, 576, 1000, 1536])
@pytest.mark.parametrize("rows", [1, 3])
def test_kernel_is_the_spec_bit_for_bit_on_every_isa(k, rows):
    x, w = inputs(rows, k, seed=k)
    spec = reference.rms_norm(x, w, 1e-6)
    got = on_every_isa(lambda: ops.rms_norm(x, w, 1e-6))
    for y in got:
        assert torch.equal(y, spec)
    # close to torch's own RMS norm (a different summation order: a few ulps apart at most)
    torch.testing.assert_close(spec, F.rms_norm(x, (k,), w, 1e-6), rtol=2e-6, atol=1e-6)


def test_a_row_is_the_same_alone_in_place_and_in_a_batch():
    x, w = inputs(9, 576, seed=1)
    together = ops.rms_norm(x.view(3, 3, 576), w, 1e-5).view(9, 576)
    for r in range(9):
        assert torch.equal(ops.rms_norm(x[r:r + 1], w, 1e-5), together[r:r + 1])
    y = x.clone()
    ops.rms_norm(y, w, 1e-5, out=y)
    assert torch.equal(y, together)
    # a strided x (a view) gives the contiguous copy's result
    wide = torch.randn(4, 1152)
    assert torch.equal(ops.rms_norm(wide[:, ::2], w, 1e-5), ops.rms_norm(wide[:, ::2].contiguous(), w, 1e-5))


def test_zero_row_and_eps():
    w = torch.ones(16)
    assert torch.equal(ops.rms_norm(torch.zeros(2, 16), w, 1e-6), torch.zeros(2, 16))
    x = torch.full((1, 16), 3.0)
    assert torch.equal(ops.rms_norm(x, w, 0.0), torch.ones(1, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [7, 64, 576, 1000])
@pytest.mark.parametrize("rows", [1, 5])
def test_16bit_kernel_is_the_spec_bit_for_bit_on_every_isa(dtype, k, rows):
    x, w = inputs(rows, k, seed=k + rows)
    x, w = x.to(dtype), w.to(dtype)
    spec = reference.rms_norm(x, w, 1e-6)
    assert spec.dtype == dtype
    for y in on_every_isa(lambda: ops.rms_norm(x, w, 1e-6)):
        assert y.dtype == dtype and torch.equal(y, spec)
    # each row alone gives the bits it gives among the others
    for r in range(rows):
        assert torch.equal(ops.rms_norm(x[r:r + 1], w, 1e-6), spec[r:r + 1])
    # the composite norm HF runs (torch's order of the sum of squares): the same roundings, so at
    # most one unit in the last place apart, and almost everywhere equal
    h = x.float()
    composite = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    ulp = (composite.float().abs() * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)).clamp_min(1e-30)
    assert ((spec.float() - composite.float()).abs() <= ulp).all()
    assert (spec == composite).float().mean() > 0.97


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"weight \[K\] of x's dtype, got x torch.bfloat16 \(2, 8\), "
                                         r"weight torch.float32 \(8,\)"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x must be float32 / bfloat16 / float16"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match=r"weight \[K\] of x's dtype, got .* weight torch.float32 \(7,\)"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    # the kernel's own checks (what a direct torch.ops call meets)
    op = torch.ops.turbospec.rms_norm.default
    x16 = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be bfloat16 \[K\] = \[8\], got float32 \[8\]"):
        op(x16, torch.ones(8), 1e-6, torch.empty_like(x16))
    with pytest.raises(RuntimeError, match=r"rms_norm: out must be a contiguous bfloat16 tensor of x's shape "
                                           r"\[2, 8\], got float32 \[2, 8\]"):
        op(x16, torch.ones(8, dtype=torch.bfloat16), 1e-6, torch.empty(2, 8))
    with pytest.raises(RuntimeError, match=r"rms_norm: x must be a float32 / bfloat16 / float16 tensor \[..., K\], "
                                           r"got int64 \[2, 8\]"):
        op(torch.ones(2, 8, dtype=torch.long), torch.ones(8), 1e-6, torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="eps must be finite and >= 0, got -1"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), -1.0)
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 tensor"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, out=torch.empty(2, 9))
