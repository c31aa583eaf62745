"""turbospec::small_linear (csrc/cpu/gemv.cpp) against its specification (reference.small_linear):
same bits, on every instruction-set path, independent of the number of rows."""
import pytest
import torch

from turbospec import ops, reference

pytestmark = pytest.mark.skipif(not ops.has_op("small_linear"), reason="turbospec._C with small_linear not built")


def _data(rows, n, k, wdtype, xdtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(wdtype)
    x = torch.randn(rows, k, generator=g).to(xdtype)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.fixture(params=[0, 1, 2], ids=["scalar", "avx2", "avx512"])
def isa(request):
    got = torch.ops.turbospec.small_linear_isa(request.param)
    if got != request.param:
        torch.ops.turbospec.small_linear_isa(-1)
        pytest.skip(f"this CPU has no path {request.param} (best: {got})")
    yield got
    torch.ops.turbospec.small_linear_isa(-1)


@pytest.mark.parametrize("rows,n,k", [(1, 37, 64), (1, 50, 576), (3, 19, 100), (4, 8, 7), (9, 33, 40), (64, 5, 48)])
@pytest.mark.parametrize("wdtype,xdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_spec(isa, rows, n, k, wdtype, xdtype, bias):
    x, w, b = _data(rows, n, k, wdtype, xdtype, bias)
    got = ops.small_linear(x, w, b)
    want = reference.small_linear(x, w, b)
    assert got.dtype == xdtype and got.shape == (rows, n)
    assert torch.equal(got, want)
    # and it is a matrix product (the order is the only freedom taken)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert torch.allclose(got.double(), exact, rtol=1e-2 if xdtype == torch.bfloat16 else 1e-5, atol=1e-4 * k)


def test_small_linear_rows_and_paths_give_identical_bits():
    x, w, b = _data(13, 301, 576, torch.float32, torch.float32, True, seed=1)
    per_path = []
    for isa in (0, 1, 2):
        if torch.ops.turbospec.small_linear_isa(isa) != isa:
            continue
        together = ops.small_linear(x, w, b)
        alone = torch.cat([ops.small_linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
        assert torch.equal(together, alone)  # rows do not change each other's arithmetic
        per_path.append(together)
    torch.ops.turbospec.small_linear_isa(-1)
    assert len(per_path) >= 1
    for y in per_path[1:]:
        assert torch.equal(y, per_path[0])


def test_small_linear_threads_do_not_change_bits():
    x, w, b = _data(2, 4099, 200, torch.float32, torch.float32, False, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.small_linear(x, w, b)
        torch.set_num_threads(2)
        two = ops.small_linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_small_linear_bad_input():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="x has 15 features, weight expects 16"):
        torch.ops.turbospec.small_linear(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="1..64 rows"):
        torch.ops.turbospec.small_linear(torch.randn(65, 16), w, None)
    with pytest.raises(RuntimeError, match="weight dtype must be float32 or bfloat16"):
        torch.ops.turbospec.small_linear(torch.randn(1, 16), w.double(), None)
    with pytest.raises(RuntimeError, match="bias has 3 elements, expected 8"):
        torch.ops.turbospec.small_linear(torch.randn(1, 16), w, torch.randn(3))


def test_small_linear_opcheck():
    x, w, b = _data(2, 24, 32, torch.float32, torch.float32, True)
    torch.library.opcheck(torch.ops.turbospec.small_linear.default, (x, w, b))
