"""turbospec::linear / small_linear / dequantize (csrc/cpu/linear.cpp) against their specifications
(reference.linear, reference.small_linear, reference.dequantize) and against gguf's own
dequantization: the same bits on every instruction-set path, for every row count and thread
count, and a quantized weight gives exactly what its dequantized float32 copy gives."""
import numpy as np
import pytest
import torch

from turbospec import ops
from turbospec.model import quant
from turbospec.ops import reference

from helpers import on_every_isa


pytestmark = pytest.mark.skipif(not ops.has_op("linear"), reason="turbospec._C with linear not built")

BLOCK_FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
ISAS = ["scalar", "avx2", "avx512"]


@pytest.fixture(params=ISAS)
def isa(request):
    got = ops.cpu_isa(request.param)
    try:
        if got != request.param:
            pytest.skip(f"this CPU has no {request.param} path (best: {got})")
        yield got
    finally:
        ops.cpu_isa("default")


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row bytes] of format ``name``: gguf's quantizer where it has one, else random
    bytes with finite fp16 scales (every bit pattern of the quantized values is then exercised)."""
    import gguf
    from gguf import quants
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[name]
    w = rng.standard_normal((n, k)).astype(np.float32)
    try:
        return torch.from_numpy(quants.quantize(w, qtype).copy())
    except (NotImplementedError, quants.QuantError):
        pass
    fmt = BLOCK_FORMATS[name]
    nbytes = reference.WEIGHT_FORMATS[fmt][2]
    raw = rng.integers(0, 256, (n, k // reference.WEIGHT_FORMATS[fmt][1], nbytes), dtype=np.uint8)
    f16 = lambda c: np.frombuffer((rng.standard_normal(n * raw.shape[1] * c) * 0.05).astype(np.float16).tobytes(),
                                  dtype=np.uint8).reshape(n, raw.shape[1], 2 * c)
    if name in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = f16(2)
    elif name == "Q6_K":
        raw[..., 208:210] = f16(1)
    return torch.from_numpy(raw.reshape(n, -1).copy())


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_dequantize_matches_gguf(isa, name):
    from gguf import GGMLQuantizationType, quants
    k = 512
    raw = random_blocks(name, 9, k)
    want = torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType[name]).copy())
    fmt = BLOCK_FORMATS[name]
    spec = reference.dequantize(raw, fmt, k)
    got = ops.dequantize(raw, fmt, k)
    assert want.dtype == torch.float32
    assert torch.equal(spec.view(torch.int32), want.view(torch.int32))  # same bits, -0.0 included
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
# 1-4: one pass; 5-8: one split-lane pass (Q4_0 / Q4_1 / Q8_0); 9-16: two passes; past 16: panel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_matches_spec(isa, name, rows, bias):
    k, n = 256, 11
    raw = random_blocks(name, n, k, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    fmt = BLOCK_FORMATS[name]
    got = ops.linear(x, [raw], [fmt], b)
    assert torch.equal(got, reference.linear(x, [raw], [fmt], b))
    # ... which is the dense float32 matrix product on the dequantized weight, in the kernel's order
    dense = reference.dequantize(raw, fmt, k)
    assert torch.equal(got, ops.small_linear(x, dense, b))
    exact = x.double() @ dense.double().T + (0 if b is None else b.double())
    # float32 summation error bound: (k + 1) u sum |x w| (+ |b|), u = 2^-24
    bound = (k + 1) * 2.0 ** -24 * (x.double().abs() @ dense.double().abs().T + (0 if b is None else b.double().abs()))
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 16, 17, 45])
def test_quantized_linear_long_rows_match_spec(isa, name, rows):
    """Rows of 2304 weights (72 blocks of 32, 9 of 256): longer than the AVX-512 kernels' chunk of
    widened scales (64 blocks) and than their K-chunks past 4 input rows (<= 16 KB of x: 1-3
    super-blocks for the K-quants), with a weight row count (7) that leaves a partial row block.
    Past 16 rows the panel runs chunk by chunk of K (512), and 45 rows take two passes (40 + 5 rows
    at this K: rows_per_pass)."""
    k, n = 2304, 7
    raw = random_blocks(name, n, k, seed=rows + 100)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    fmt = BLOCK_FORMATS[name]
    assert torch.equal(ops.linear(x, [raw], [fmt]), reference.linear(x, [raw], [fmt]))


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_quantized_rows_isas_and_threads_give_identical_bits(name):
    """Every row of a 70-row pass (two passes of <= 64, the panel path) equals that row alone (the
    fused path), on every ISA this CPU has and for 1 and 2 threads."""
    k, n = 512, 37
    raw = random_blocks(name, n, k, seed=3)
    fmt = BLOCK_FORMATS[name]
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    y = rows_alone_on_every_path(lambda rows: ops.linear(rows, [raw], [fmt]), x)
    assert torch.equal(y, ops.small_linear(x, ops.dequantize(raw, fmt, k)))


def rows_alone_on_every_path(fn, x):
    """fn(x) == fn(each row alone), for 1 and 2 threads, identical on every ISA; returns fn(x)."""
    def per_thread_count():
        out = []
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                together = fn(x)
                alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
                assert torch.equal(together, alone), (ops.cpu_isa(), threads)
                out.append(together)
        finally:
            torch.set_num_threads(before)
        return out

    results = [y for per_isa in on_every_isa(per_thread_count) for y in per_isa]
    for y in results[1:]:
        assert torch.equal(y, results[0])
    return results[0]


@pytest.mark.parametrize("rows,n,k", [(1, 37, 64), (1, 50, 576), (3, 19, 100), (4, 8, 7), (9, 33, 40),
                                      (64, 5, 48), (70, 6, 33)])
@pytest.mark.parametrize("wdtype,xdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                           (torch.float32, torch.float16)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_matches_spec(isa, rows, n, k, wdtype, xdtype, bias):
    g = torch.Generator().manual_seed(rows * n)
    w = torch.randn(n, k, generator=g).to(wdtype)
    x = torch.randn(rows, k, generator=g).to(xdtype)
    b = torch.randn(n, generator=g) if bias else None
    got = ops.small_linear(x, w, b)
    want = reference.small_linear(x, w, b)
    assert got.dtype == xdtype and got.shape == (rows, n)
    assert torch.equal(got, want)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    tol = 1e-5 if xdtype == torch.float32 else 1e-2
    assert torch.allclose(got.double(), exact, rtol=tol, atol=1e-4 * k)


@pytest.mark.parametrize("rows,k", [(5, 1100), (9, 1536), (17, 2304), (70, 1100), (45, 2304)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_dense_long_k_chunks_and_passes_match_spec(isa, rows, k, wdtype):
    """Past 4 input rows and K > 1024 the AVX-512 kernel runs K in chunks of 512 (the last one
    masked when K % 16 != 0: K = 1100), every group of 4 rows per chunk; a long K also takes fewer
    rows per pass (2304: 40). Same bits as the spec, and each row alone gives them too."""
    g = torch.Generator().manual_seed(rows + k)
    w = torch.randn(7, k, generator=g).to(wdtype)
    x = torch.randn(rows, k, generator=g)
    got = ops.small_linear(x, w)
    assert torch.equal(got, reference.small_linear(x, w))
    alone = torch.cat([ops.small_linear(x[i:i + 1], w) for i in range(rows)])
    assert torch.equal(got, alone)


def test_dense_rows_and_isas_give_identical_bits():
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(1))
    w = torch.randn(301, 576, generator=torch.Generator().manual_seed(2))

    def rows_together_and_alone():
        together = ops.small_linear(x, w)
        alone = torch.cat([ops.small_linear(x[i:i + 1], w) for i in range(x.shape[0])])
        assert torch.equal(together, alone)
        return together

    per_path = on_every_isa(rows_together_and_alone)
    for y in per_path[1:]:
        assert torch.equal(y, per_path[0])


@pytest.fixture
def bf16_dot():
    """The AVX-512 BF16 dot-product kernel on (skipped where the CPU or its self-test does not allow it)."""
    ops.cpu_isa("default")
    try:
        if not ops.cpu_bf16_dot(True):
            pytest.skip("no AVX-512 BF16 dot products here (CPU, AVX-512 path or self-test)")
        yield
    finally:
        ops.cpu_bf16_dot("default")


def _both_ways(x, weights, formats, bias=None):
    """linear with the dot-product kernel allowed, then with it off (the float32 kernel)."""
    ops.cpu_bf16_dot(True)
    on = ops.linear(x, weights, formats, bias)
    ops.cpu_bf16_dot(False)
    try:
        off = ops.linear(x, weights, formats, bias)
    finally:
        ops.cpu_bf16_dot(True)
    return on, off


@pytest.mark.parametrize("rows", [4, 5, 6, 7, 12, 13, 64, 70])
@pytest.mark.parametrize("k", [32, 576, 1536, 2304])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_dot_products_give_the_float32_kernels_bits(bf16_dot, rows, k, bias):
    """bfloat16 weights x bfloat16 inputs, 4+ rows: vdpbf16ps gives every other path's bits (the
    spec's), for every tile shape (6 rows and the rest), passes (K = 2304: 40 rows), two segments and
    a partial row block; each row alone (the float32 kernel, 1 row) gives them too."""
    g = torch.Generator().manual_seed(rows * k)
    w1 = (torch.randn(37, k, generator=g) * 0.05).bfloat16()  # 9 row blocks and 1 row
    w2 = torch.randn(7, k, generator=g).bfloat16()
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    b = torch.randn(37 + 7, generator=g) if bias else None
    on, off = _both_ways(x, [w1, w2], [30, 30], b)
    assert torch.equal(on, off)
    assert torch.equal(on, reference.linear(x, [w1, w2], [30, 30], b))
    alone = torch.cat([ops.linear(x[i:i + 1], [w1, w2], [30, 30], b) for i in range(rows)])
    assert torch.equal(on, alone)


def test_bf16_dot_products_step_aside_where_they_would_flush(bf16_dot):
    """vdpbf16ps reads denormal inputs as zero and flushes denormal results: with values whose
    products fall below 2^-126 (here 2^-140) it would give 0 where the float32 kernels give the
    denormal sum. Such rows (and weights outside [2^-50, 2^50), inputs that are not bfloat16 values,
    huge values) keep the float32 kernel: the spec's bits every time."""
    k, rows = 64, 8
    tiny = 2.0 ** -70
    w = torch.full((5, k), tiny).bfloat16()
    x = torch.full((rows, k), tiny)  # bfloat16 values in float32 (the layer loop's inputs): float32 out
    want = reference.linear(x, [w], [30])
    assert (want != 0).all()  # the denormal sums the flush would lose
    on, off = _both_ways(x, [w], [30])
    assert torch.equal(on, want) and torch.equal(off, want)
    g = torch.Generator().manual_seed(5)
    wn = (torch.randn(9, k, generator=g) * 0.05).bfloat16()
    xn = torch.randn(rows, k, generator=g).bfloat16().float()
    cases = []
    xt = xn.clone(); xt[3, 7] = tiny; cases.append((xt, wn))            # one tiny input
    xh = xn.clone(); xh[0, 0] = 2.0 ** 60; cases.append((xh, wn))        # one huge input
    wt = wn.clone(); wt[4, 10] = tiny; cases.append((xn, wt))            # one tiny weight (one row block)
    wh = wn.clone(); wh[8, 1] = -(2.0 ** 55); cases.append((xn, wh))     # one huge weight (the last, partial block)
    cases.append((xn + 1e-3, wn))                                        # inputs that are not bfloat16 values
    cases.append((xn, wn))                                               # (and the dot products' own case)
    for xc, wc in cases:
        on, off = _both_ways(xc, [wc], [30])
        assert torch.equal(on, off)
        assert torch.equal(on, reference.linear(xc, [wc], [30]))


@pytest.mark.parametrize("op,var", [("cpu_bf16_dot", "TURBOSPEC_BF16_DOT"), ("cpu_amx", "TURBOSPEC_AMX")])
def test_cpu_switch_setting_and_errors(op, var):
    """ops.cpu_bf16_dot / ops.cpu_amx: the default is what kernels_available reports; False turns the
    feature off, True on where the CPU allows it (what a process without the environment variable gets),
    never on the AVX2 path; bad values are errors naming what is allowed, and a bad $var too."""
    switch = getattr(ops, op)
    default = switch("default")
    try:
        assert ops.kernels_available()[op] == default
        assert switch(False) is False and switch() is False
        available = _kernels_available_with(var, "", op).stdout.strip() == "True"
        assert switch(True) == available
        ops.cpu_isa("avx2")
        assert switch() is False  # an AVX-512 path only
    finally:
        ops.cpu_isa("default")
        switch("default")
    with pytest.raises(ValueError, match="on must be True, False or 'default', got 'yes'"):
        switch("yes")
    with pytest.raises(RuntimeError, match=r"on must be -2 \(read\), -1 \(default\), 0 \(off\) or 1 \(on\), got 3"):
        getattr(torch.ops.turbospec, op)(3)
    assert _kernels_available_with(var, "0", op).stdout.strip() == "False"
    bad = _kernels_available_with(var, "yes", op)
    assert bad.returncode != 0 and f"{var} must be 0 or 1 (or unset), got 'yes'" in bad.stderr


def _kernels_available_with(var: str, value: str, key: str):
    """A new process with $var = value: its ``kernels_available()[key]`` (stdout) or its error."""
    import os
    import subprocess
    import sys
    code = f"import turbospec; print(turbospec.ops.kernels_available()[{key!r}])"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, var: value}, capture_output=True, text=True)


def test_segments_of_mixed_formats_concatenate():
    """A fused linear whose parts have different formats (Qwen2.5's Q4_K q/k with a Q6_K v) equals its
    parts computed one by one."""
    k = 256
    parts = [random_blocks("Q4_K", 12, k, 1), random_blocks("Q6_K", 5, k, 2),
             torch.randn(7, k, generator=torch.Generator().manual_seed(3))]
    fmts = [12, 14, 0]
    b = torch.randn(24)
    x = torch.randn(3, k)
    split = torch.cat([ops.linear(x, [p], [f]) for p, f in zip(parts, fmts)], -1)
    assert torch.equal(ops.linear(x, parts, fmts), split)
    assert torch.equal(ops.linear(x, parts, fmts, b), reference.linear(x, parts, fmts, b))


def test_linear_bad_input():
    w = torch.randn(8, 64)
    raw = random_blocks("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="x has 63 features, weights\\[0\\] expects 64"):
        torch.ops.turbospec.linear(torch.randn(1, 63), [w], [0], None)
    with pytest.raises(RuntimeError, match="weight format 5 is not supported"):
        torch.ops.turbospec.linear(torch.randn(1, 64), [raw], [5], None)
    with pytest.raises(RuntimeError, match="a Q4_1 row holds a multiple of 32 weights, got K = 48"):
        torch.ops.turbospec.linear(torch.randn(1, 48), [raw], [3], None)
    with pytest.raises(RuntimeError, match=r"weights\[0\] \(Q4_1, K = 64\) must be uint8 \[N, 40\]"):
        torch.ops.turbospec.linear(torch.randn(1, 64), [raw[:, :30]], [3], None)
    with pytest.raises(RuntimeError, match="has dtype Float but format 30"):
        torch.ops.turbospec.linear(torch.randn(1, 64), [w], [30], None)
    with pytest.raises(RuntimeError, match="bias has 3 elements, expected 16"):
        torch.ops.turbospec.linear(torch.randn(1, 64), [w, raw], [0, 3], torch.randn(3))
    with pytest.raises(RuntimeError, match="weight dtype must be float32, float16 or bfloat16"):
        torch.ops.turbospec.small_linear(torch.randn(1, 64), w.double(), None)
    with pytest.raises(ValueError, match="isa must be one of scalar, avx2, avx512 or 'default', got 'sse'"):
        ops.cpu_isa("sse")


def test_linear_opcheck():
    x = torch.randn(2, 64)
    torch.library.opcheck(torch.ops.turbospec.linear.default, (x, [torch.randn(5, 64), random_blocks("Q8_0", 3, 64)],
                                                               [0, 8], torch.randn(8)))
    torch.library.opcheck(torch.ops.turbospec.small_linear.default, (x, torch.randn(4, 64), None))
    torch.library.opcheck(torch.ops.turbospec.dequantize.default, (random_blocks("Q6_K", 2, 256), 14, 256))


@pytest.mark.parametrize("fmt,qtype", [("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_quantize_on_load_matches_gguf(fmt, qtype):
    import gguf
    from gguf import quants
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    w[0, :32] = 0  # an all-zero block (scale 0)
    q = quant.quantize(w, fmt)
    want = quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(q.data.numpy(), want)
    assert q.shape == (40, 96) and q.name == qtype
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quant.quantize(torch.randn(4, 40), fmt)
    with pytest.raises(ValueError, match="format 'q5_1' is not supported"):
        quant.quantize(w, "q5_1")


def test_env_override_caps_the_isa(tmp_path):
    """TURBOSPEC_ISA picks the path at import (CI forces the narrow ones this way)."""
    assert _kernels_available_with("TURBOSPEC_ISA", "scalar", "cpu_isa").stdout.strip() == "scalar"


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_prefetch_hint_changes_no_bit(isa, name):
    """The weight-stream prefetch hint (T0 or non-temporal, picked per CPU vendor) is speed only:
    exact and int8-activation linears, dense weights too, give the same bits under either hint."""
    k, n = 512, 13
    raw = random_blocks(name, n, k, seed=3)
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    fmt = BLOCK_FORMATS[name]
    out = {}
    try:
        for hint in ("t0", "nta"):
            assert ops.cpu_prefetch(hint) == hint
            for rows in (1, 8):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                out[hint, rows] = (torch.ops.turbospec.linear(x, [raw], [fmt], None, 0),
                                   torch.ops.turbospec.linear(x, [raw], [fmt], None, 8),
                                   torch.ops.turbospec.linear(x, [dense], [30], None, 0))
    finally:
        ops.cpu_prefetch("default")
    for rows in (1, 8):
        for a, b in zip(out["t0", rows], out["nta", rows]):
            assert torch.equal(a, b), (name, rows)
        assert torch.equal(out["t0", rows][0], reference.linear(
            torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)), [raw], [fmt]))


def test_prefetch_hint_setting_and_errors():
    import platform
    default = ops.cpu_prefetch("default")
    try:
        vendor = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
        flags = next((line for line in vendor.splitlines() if line.startswith("flags")), "").split()
        assert default == ("nta" if "AuthenticAMD" in vendor and "avx512f" in flags else "t0")
        assert ops.kernels_available()["cpu_prefetch"] == default
        assert ops.cpu_prefetch("nta") == "nta" and ops.cpu_prefetch() == "nta"
    finally:
        ops.cpu_prefetch("default")
    assert ops.cpu_prefetch() == default
    with pytest.raises(ValueError, match="hint must be one of t0, nta or 'default', got 'l2'"):
        ops.cpu_prefetch("l2")
    with pytest.raises(RuntimeError, match=r"hint must be -2 \(read\), -1 \(default\), 0 \(t0\) or 1 \(nta\), got 7"):
        torch.ops.turbospec.cpu_prefetch(7)


def test_prefetch_env_override():
    """TURBOSPEC_PREFETCH sets the default hint; a bad value is an error naming it, not a crash."""
    run = lambda v: _kernels_available_with("TURBOSPEC_PREFETCH", v, "cpu_prefetch")
    assert run("nta").stdout.strip() == "nta"
    assert run("t0").stdout.strip() == "t0"
    bad = run("l2")
    assert bad.returncode != 0
    assert "TURBOSPEC_PREFETCH must be t0 or nta (or unset), got 'l2'" in bad.stderr
    assert "Traceback" in bad.stderr  # a Python exception, not an abort


# ------------------------------------------------------------------------------------------------
# activations=8: int8 activations, integer dot products (opt-in; reference.linear_int8)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_int8_linear_matches_spec(isa, name, rows):
    k, n = 512, 11
    raw = random_blocks(name, n, k, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g)
    fmt = BLOCK_FORMATS[name]
    got = ops.linear(x, [raw], [fmt], b, activations=8)
    assert torch.equal(got, reference.linear_int8(x, [raw], [fmt], b))
    exact = ops.linear(x, [raw], [fmt], b)
    assert not torch.equal(got, exact)  # a different arithmetic ...
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()  # ... close to the exact one


def test_int8_activation_quantization_spec():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5, 127.0] + [0.0] * 28])
    q, d = reference.quantize_activations(x)
    assert d[0, 0] == 0 and torch.all(q[0, :32] == 0)  # an all-zero block: d = 0, q = 0
    assert d[0, 1] == torch.tensor(127.0) / 127 and q[0, 32:36].tolist() == [1, -2, 0, 127]  # 0.5: ties to even


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_int8_rows_isas_and_threads_give_identical_bits(name):
    """A row's int8 result does not depend on the other rows, the thread count or the ISA."""
    k, n = 512, 37
    raw = random_blocks(name, n, k, seed=5)
    fmt = BLOCK_FORMATS[name]
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(6))
    y = rows_alone_on_every_path(lambda rows: ops.linear(rows, [raw], [fmt], activations=8), x)
    assert torch.equal(y, reference.linear_int8(x, [raw], [fmt]))


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_int8_activation_quantization_isas_agree_on_edge_values(name):
    """The vectorised activation quantizer rounds ties to even, clamps, and treats zeros, inf and NaN
    exactly as the scalar one (the bits of the output, NaNs included, are the same on every path)."""
    k = 512
    raw = random_blocks(name, 5, k, seed=9)
    fmt = BLOCK_FORMATS[name]
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(10))
    x[0] = torch.arange(k) % 7 - 3.5          # exact ties after scaling by 127 / 3.5
    x[1] = 0.0                                # d = 0
    x[2, 7] = float("inf")
    x[3, 40] = float("nan")
    x[4, :256] = 1e-30                        # subnormal scale products
    x[5, 100] = -1e30
    ys = on_every_isa(lambda: ops.linear(x, [raw], [fmt], activations=8).view(torch.int32))
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    finite = [0, 1, 4, 5]
    assert torch.equal(ys[0][finite].view(torch.float32), reference.linear_int8(x[finite], [raw], [fmt]))


def test_int8_mixed_segments_and_dense_weights():
    """A fused linear of Q4_K + Q6_K segments takes int8 activations segment by segment; a call with
    a dense segment keeps exact activations (dense weights have no integer form)."""
    k = 256
    parts = [random_blocks("Q4_K", 6, k, 1), random_blocks("Q6_K", 5, k, 2)]
    x = torch.randn(3, k)
    got = ops.linear(x, parts, [12, 14], activations=8)
    assert torch.equal(got, torch.cat([reference.linear_int8(x, [p], [f]) for p, f in zip(parts, (12, 14))], dim=1))
    dense = torch.randn(4, k)
    mixed = parts + [dense]
    assert torch.equal(ops.linear(x, mixed, [12, 14, 0], activations=8), ops.linear(x, mixed, [12, 14, 0]))
    with pytest.raises(ValueError, match="activations must be 0 \\(exact\\) or 8 \\(int8\\), got 4"):
        ops.linear(x, parts, [12, 14], activations=4)


# ------------------------------------------------------------------------------------------------
# grouped layouts (1000 + the GGUF id): the same blocks with each row's scales side by side
# ------------------------------------------------------------------------------------------------
GROUPED = {"Q4_0": 1002, "Q4_1": 1003, "Q5_0": 1006, "Q8_0": 1008}


@pytest.mark.parametrize("name", list(GROUPED))
@pytest.mark.parametrize("k", [32, 512, 544, 576, 1056])  # 1, 16, 17, 18, 33 blocks: whole and partial groups
def test_group_blocks_layout_and_round_trip(name, k):
    """group_blocks moves bytes only (ungroup_blocks undoes it), to the places gguf_blocks.h
    describes: per group of 16 blocks (the last may be shorter) the d halves, then (Q4_1) the m
    halves, then each block's remaining bytes; C++ dequantize of either layout gives the same bits."""
    fmt, gfmt = BLOCK_FORMATS[name], GROUPED[name]
    raw = random_blocks(name, 5, k)
    grouped = reference.group_blocks(raw, fmt, k)
    assert grouped.shape == raw.shape and not torch.equal(grouped, raw) or k == 32
    assert torch.equal(reference.ungroup_blocks(grouped, gfmt, k), raw)
    nbytes, nh = reference.WEIGHT_FORMATS[fmt][2], 2 if name == "Q4_1" else 1
    nb = k // 32
    blocks = raw.reshape(5, nb, nbytes)
    for j in range(nb):
        g0 = j - j % 16
        n = min(16, nb - g0)
        base = g0 * nbytes
        for h in range(nh):
            at = base + 2 * (h * n + j - g0)
            assert torch.equal(grouped[:, at:at + 2], blocks[:, j, 2 * h:2 * h + 2])
        at = base + 2 * nh * n + (nbytes - 2 * nh) * (j - g0)
        assert torch.equal(grouped[:, at:at + nbytes - 2 * nh], blocks[:, j, 2 * nh:])
    want = ops.dequantize(raw, fmt, k).view(torch.int32)
    assert torch.equal(ops.dequantize(grouped, gfmt, k).view(torch.int32), want)
    assert torch.equal(reference.dequantize(grouped, gfmt, k).view(torch.int32), want)


@pytest.mark.parametrize("name", list(GROUPED))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("k", [576, 2304])  # 18 blocks (a group of 16 and one of 2); 72 (past a chunk of 64)
def test_grouped_linear_gives_the_gguf_layouts_bits(isa, name, rows, k):
    """linear over grouped blocks == over the same blocks in GGUF order, bit for bit, on every path
    (AVX-512 reads the grouped layout itself; the others, and the panel past 16 rows, read the rows
    put back in GGUF order), with a bias and a second segment in another format."""
    n = 7
    fmt, gfmt = BLOCK_FORMATS[name], GROUPED[name]
    raw = random_blocks(name, n, k, seed=rows)
    other = random_blocks("Q6_K" if k % 256 == 0 else "Q8_0", 5, k, seed=rows + 1)
    ofmt = 14 if k % 256 == 0 else 8
    grouped = reference.group_blocks(raw, fmt, k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n + 5, generator=g)
    want = ops.linear(x, [raw, other], [fmt, ofmt], b)
    assert torch.equal(ops.linear(x, [grouped, other], [gfmt, ofmt], b), want)
    assert torch.equal(reference.linear(x, [grouped, other], [gfmt, ofmt], b), want)


@pytest.mark.parametrize("name", list(GROUPED))
def test_grouped_rows_isas_and_threads_give_identical_bits(name):
    k, n = 576, 37
    fmt, gfmt = BLOCK_FORMATS[name], GROUPED[name]
    raw = random_blocks(name, n, k, seed=3)
    grouped = reference.group_blocks(raw, fmt, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    y = rows_alone_on_every_path(lambda rows: ops.linear(rows, [grouped], [gfmt]), x)
    assert torch.equal(y, ops.small_linear(x, ops.dequantize(raw, fmt, k)))


@pytest.mark.parametrize("name", list(GROUPED))
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_grouped_int8_linear_gives_the_gguf_layouts_bits(isa, name, rows):
    k, n = 576, 11
    fmt, gfmt = BLOCK_FORMATS[name], GROUPED[name]
    raw = random_blocks(name, n, k, seed=rows)
    grouped = reference.group_blocks(raw, fmt, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = ops.linear(x, [raw], [fmt], activations=8)
    assert torch.equal(ops.linear(x, [grouped], [gfmt], activations=8), want)
    assert torch.equal(reference.linear_int8(x, [grouped], [gfmt]), want)


def test_grouped_layout_bad_input():
    raw = random_blocks("Q4_K", 2, 256)
    with pytest.raises(ValueError, match=r"group_blocks: format 12 has no grouped layout; Q4_0 \(2\)"):
        reference.group_blocks(raw, 12, 256)
    with pytest.raises(ValueError, match=r"ungroup_blocks: format 3 is not a grouped format"):
        reference.ungroup_blocks(random_blocks("Q4_1", 2, 256), 3, 256)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match=r"weights\[0\] \(Q4_1G, K = 256\) must be uint8 \[N, 160\]"):
        ops.linear(x, [torch.zeros(2, 150, dtype=torch.uint8)], [1003])
    with pytest.raises(RuntimeError, match=r"weight format 1004 is not supported; .*1003 Q4_1G"):
        ops.linear(x, [torch.zeros(2, 160, dtype=torch.uint8)], [1004])


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_int8_extreme_weights_and_activations(name):
    """Every integer at its extreme (Q8_0's -128, 4- and 5-bit values 0 and 15 / 31, activations
    quantized to +-127): the byte products that the AVX2 and AVX-512 kernels pair up stay exact, so
    every path gives the spec's bits (8 weight rows: two four-row tiles of the AVX-512 kernel)."""
    k, n = 256, 8
    fmt = BLOCK_FORMATS[name]
    nbytes = reference.WEIGHT_FORMATS[fmt][2]
    raw = random_blocks(name, n, k, seed=11).reshape(n, k // 32, nbytes).clone()
    hdr = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q8_0": 2}[name]
    raw[0::2, :, hdr:] = 0x80 if name == "Q8_0" else 0xFF   # -128 / both nibbles 15
    raw[1::2, :, hdr:] = 0x7F if name == "Q8_0" else 0x00
    if name == "Q5_0":
        raw[0::2, :, 2:6] = 0xFF                             # fifth bits set: 31
        raw[1::2, :, 2:6] = 0x00
    raw = raw.reshape(n, -1)
    x = torch.full((3, k), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    ys = on_every_isa(lambda: ops.linear(x, [raw], [fmt], activations=8))
    for y in ys:
        assert torch.equal(y, reference.linear_int8(x, [raw], [fmt]))


# ------------------------------------------------------------------------------------------------
# interleaved layouts (2000 + the GGUF id): 16 rows' blocks side by side, int8 activations only
# ------------------------------------------------------------------------------------------------
INTERLEAVED = {"Q4_0": 2002, "Q4_1": 2003, "Q5_0": 2006, "Q8_0": 2008}


def extreme_blocks(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """random_blocks with every other row's values at the format's extremes (Q8_0: -128 and 127;
    4-bit: 15 and 0 in both nibbles; Q5_0: 31 and 0), the products the byte-pairing instructions
    must keep exact."""
    nbytes = reference.WEIGHT_FORMATS[BLOCK_FORMATS[name]][2]
    raw = random_blocks(name, n, k, seed=seed).reshape(n, k // 32, nbytes).clone()
    hdr = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q8_0": 2}[name]  # Q5_0: its fifth bits (qh) too
    raw[0::4, :, hdr:] = 0x80 if name == "Q8_0" else 0xFF
    raw[1::4, :, hdr:] = 0x7F if name == "Q8_0" else 0x00
    return raw.reshape(n, -1)


@pytest.mark.parametrize("name", list(INTERLEAVED))
@pytest.mark.parametrize("k", [32, 576])
def test_interleave_blocks_layout_and_round_trip(name, k):
    """interleave_blocks moves bytes only (deinterleave_blocks undoes it; Q8_0's values + 128), to
    the places gguf_blocks.h describes; C++ dequantize of it gives the GGUF layout's bits."""
    fmt, xfmt = BLOCK_FORMATS[name], INTERLEAVED[name]
    n = 32
    raw = random_blocks(name, n, k, seed=k)
    inter = reference.interleave_blocks(raw, fmt, k)
    assert inter.shape == raw.shape and not torch.equal(inter, raw)
    assert torch.equal(reference.deinterleave_blocks(inter, xfmt, k), raw)
    nbytes = reference.WEIGHT_FORMATS[fmt][2]
    blocks = raw.reshape(n, k // 32, nbytes)
    group = inter.reshape(n // 16, k // 32, 16 * nbytes)
    nh = 2 if name == "Q4_1" else 1
    g, j, i = 1, k // 32 - 1, 5  # row 16 + 5, the last block
    chunk = group[g, j]
    assert torch.equal(chunk[2 * i:2 * i + 2], blocks[16 + i, j, 0:2])                  # d
    if nh == 2:
        assert torch.equal(chunk[32 + 2 * i:32 + 2 * i + 2], blocks[16 + i, j, 2:4])    # m
    qs = blocks[16 + i, j, 2 * nh + (4 if name == "Q5_0" else 0):]
    for c in range(len(qs) // 4):
        got = chunk[32 * nh + 64 * c + 4 * i:32 * nh + 64 * c + 4 * i + 4]
        want = qs[4 * c:4 * c + 4] ^ (0x80 if name == "Q8_0" else 0)
        assert torch.equal(got, want), c
    if name == "Q5_0":  # fifth bits: byte i of part c = qh bits 4c..4c+3 | bits 16+4c..16+4c+3 << 4
        qh = int.from_bytes(bytes(blocks[16 + i, j, 2:6].tolist()), "little")
        for c in range(4):
            want = (qh >> (4 * c)) & 15 | ((qh >> (16 + 4 * c)) & 15) << 4
            assert int(chunk[32 + 256 + 16 * c + i]) == want, c
    want = ops.dequantize(raw, fmt, k).view(torch.int32)
    assert torch.equal(ops.dequantize(inter, xfmt, k).view(torch.int32), want)
    assert torch.equal(reference.dequantize(inter, xfmt, k).view(torch.int32), want)


@pytest.mark.parametrize("name", list(INTERLEAVED))
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 33])
def test_interleaved_int8_linear_matches_spec(isa, name, rows):
    """int8 linear over interleaved blocks == reference.linear_int8 (its own order: one accumulator,
    an exact integer per block) on every path, extreme values included, with a bias and a second
    interleaved segment; close to the exact result."""
    k = 576
    fmt, xfmt = BLOCK_FORMATS[name], INTERLEAVED[name]
    parts = [reference.interleave_blocks(extreme_blocks(name, 32, k, seed=rows), fmt, k),
             reference.interleave_blocks(random_blocks("Q4_1", 16, k, seed=rows + 1), 3, k)]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[0, :64] = torch.sign(x[0, :64])  # whole blocks quantized to +-127
    b = torch.randn(48, generator=g)
    got = ops.linear(x, parts, [xfmt, 2003], b, activations=8)
    assert torch.equal(got, reference.linear_int8(x, parts, [xfmt, 2003], b))
    plain = [reference.deinterleave_blocks(p, f, k) for p, f in zip(parts, (xfmt, 2003))]
    exact = ops.linear(x, plain, [fmt, 3], b)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("name", list(INTERLEAVED))
def test_interleaved_rows_isas_and_threads_give_identical_bits(name):
    k = 576
    fmt, xfmt = BLOCK_FORMATS[name], INTERLEAVED[name]
    inter = reference.interleave_blocks(random_blocks(name, 48, k, seed=3), fmt, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    y = rows_alone_on_every_path(lambda rows: ops.linear(rows, [inter], [xfmt], activations=8), x)
    assert torch.equal(y, reference.linear_int8(x, [inter], [xfmt]))


def test_interleaved_without_vnni_gives_the_same_bits():
    """The AVX-512 kernel without VNNI (maddubs + madd; TURBOSPEC_VNNI=0) gives the VNNI form's bits."""
    import os
    import subprocess
    import sys
    if ops.cpu_isa() != "avx512":
        pytest.skip("the AVX-512 path only")
    code = ("import torch, sys; from turbospec import ops; from turbospec.ops import reference as R; "
            "sys.path[:0] = ['tests', 'tests/ops']; from test_linear import random_blocks, extreme_blocks; "
            "ok = True\n"
            "for name, f in (('Q4_0', 2), ('Q4_1', 3), ('Q5_0', 6), ('Q8_0', 8), ('Q4_K', 12)):\n"
            "    k = 512 if name == 'Q4_K' else 576\n"
            "    raw = random_blocks(name, 32, k, 1) if name == 'Q4_K' else extreme_blocks(name, 32, k, 1)\n"
            "    w = R.interleave_blocks(raw, f, k)\n"
            "    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))\n"
            "    ok &= torch.equal(ops.linear(x, [w], [2000 + f], activations=8), R.linear_int8(x, [w], [2000 + f]))\n"
            "print(ok)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TURBOSPEC_VNNI": "0"}, cwd=root,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.fixture
def amx():
    """AMX int8 tiles on (skipped where the CPU, the OS or the self-test does not allow them)."""
    ops.cpu_isa("default")
    try:
        if not ops.cpu_amx(True):
            pytest.skip("no AMX int8 tiles here (CPU, OS permission, AVX-512 path or self-test)")
        yield
    finally:
        ops.cpu_amx("default")


@pytest.mark.parametrize("name", [n for n in INTERLEAVED if n != "Q4_K"])
@pytest.mark.parametrize("rows", [16, 17, 31, 32, 48, 70])
@pytest.mark.parametrize("k", [32, 64, 576, 1536])
def test_amx_tiles_give_the_vector_kernels_bits(amx, name, rows, k):
    """int8 linear over interleaved blocks with AMX tiles (whole tiles of 16 input rows; the rest on
    the vector kernel) == the same with AMX off == reference.linear_int8, extreme values included,
    with a bias and a second interleaved segment, for one block (K = 32), an odd and an even number
    of blocks (the alternating tile sets), and each row alone (the 1-row vector path)."""
    fmt, xfmt = BLOCK_FORMATS[name], INTERLEAVED[name]
    parts = [reference.interleave_blocks(extreme_blocks(name, 32, k, seed=rows), fmt, k),
             reference.interleave_blocks(random_blocks("Q4_1", 16, k, seed=rows + 1), 3, k)]
    g = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = torch.sign(x[0, :32])  # a whole block quantized to +-127
    b = torch.randn(48, generator=g)
    got = ops.linear(x, parts, [xfmt, 2003], b, activations=8)
    ops.cpu_amx(False)
    try:
        off = ops.linear(x, parts, [xfmt, 2003], b, activations=8)
    finally:
        ops.cpu_amx(True)
    assert torch.equal(got, off)
    assert torch.equal(got, reference.linear_int8(x, parts, [xfmt, 2003], b))
    if rows == 17:
        alone = torch.cat([ops.linear(x[i:i + 1], parts, [xfmt, 2003], b, activations=8) for i in range(rows)])
        assert torch.equal(got, alone)


def q4k_extremes(n: int, k: int, seed: int) -> torch.Tensor:
    """Q4_K super-blocks with random scale bytes (every 6-bit scale and min pattern) and every fourth
    row's quants all 15, the next row's all 0."""
    raw = random_blocks("Q4_K", n, k, seed=seed).reshape(n, k // 256, 144).clone()
    raw[0::4, :, 16:] = 0xFF
    raw[1::4, :, 16:] = 0x00
    return raw.reshape(n, -1)


@pytest.mark.parametrize("k", [256, 1536])
def test_q4k_interleave_layout_and_round_trip(k):
    """Q4_KX: per super-block of a 16-row group the rows' d, dmin, their packed scale bytes in
    three parts of 4 bytes a row, then 32 chunks of 4 quant bytes a row; C++ dequantize == GGUF's."""
    n = 32
    raw = random_blocks("Q4_K", n, k, seed=k)
    inter = reference.interleave_blocks(raw, 12, k)
    assert inter.shape == raw.shape and torch.equal(reference.deinterleave_blocks(inter, 2012, k), raw)
    blocks = raw.reshape(n, k // 256, 144)
    g, s_, i = 1, k // 256 - 1, 7
    part = inter.reshape(n // 16, k // 256, 16 * 144)[g, s_]
    row = blocks[16 + i, s_]
    assert torch.equal(part[2 * i:2 * i + 2], row[0:2]) and torch.equal(part[32 + 2 * i:34 + 2 * i], row[2:4])
    for t in range(3):
        assert torch.equal(part[64 + 64 * t + 4 * i:64 + 64 * t + 4 * i + 4], row[4 + 4 * t:8 + 4 * t])
    for c in range(32):
        assert torch.equal(part[256 + 64 * c + 4 * i:256 + 64 * c + 4 * i + 4], row[16 + 4 * c:20 + 4 * c])
    want = ops.dequantize(raw, 12, k).view(torch.int32)
    assert torch.equal(ops.dequantize(inter, 2012, k).view(torch.int32), want)
    assert torch.equal(reference.dequantize(inter, 2012, k).view(torch.int32), want)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_q4k_interleaved_int8_linear_matches_spec(isa, rows):
    """Q4_KX with int8 activations == reference.linear_int8 (per super-block: exact integers L and M,
    two fmas) on every path, beside a Q6_K segment in GGUF order, with a bias; close to exact."""
    k = 512
    inter = reference.interleave_blocks(q4k_extremes(32, k, seed=rows), 12, k)
    other = random_blocks("Q6_K", 5, k, seed=rows + 1)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(37, generator=g)
    got = ops.linear(x, [inter, other], [2012, 14], b, activations=8)
    assert torch.equal(got, reference.linear_int8(x, [inter, other], [2012, 14], b))
    exact = ops.linear(x, [reference.deinterleave_blocks(inter, 2012, k), other], [12, 14], b)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_q4k_interleaved_rows_isas_and_threads_give_identical_bits():
    k = 512
    inter = reference.interleave_blocks(random_blocks("Q4_K", 48, k, seed=3), 12, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    y = rows_alone_on_every_path(lambda rows: ops.linear(rows, [inter], [2012], activations=8), x)
    assert torch.equal(y, reference.linear_int8(x, [inter], [2012]))


def test_interleaved_layout_bad_input():
    raw = random_blocks("Q4_1", 16, 64)
    with pytest.raises(ValueError, match=r"interleave_blocks: format 14 has no interleaved layout; Q4_0 \(2\)"):
        reference.interleave_blocks(random_blocks("Q6_K", 16, 256), 14, 256)
    with pytest.raises(ValueError, match=r"N a multiple of 16, got torch.uint8 \[12, 40\]"):
        reference.interleave_blocks(raw[:12], 3, 64)
    with pytest.raises(ValueError, match=r"deinterleave_blocks: format 3 is not an interleaved format"):
        reference.deinterleave_blocks(raw, 3, 64)
    inter = reference.interleave_blocks(raw, 3, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"weights\[0\] has the interleaved format Q4_1X \(2003\), which only "
                                           r"activations=8 reads"):
        ops.linear(x, [inter], [2003])
    with pytest.raises(RuntimeError, match=r"weights\[0\] \(format 2003, interleaved\) holds rows in groups of 16, "
                                           r"got 12 rows"):
        torch.ops.turbospec.linear(x, [inter[:12]], [2003], None, 8)
    with pytest.raises(RuntimeError, match=r"dequantize: Q4_1X holds rows in groups of 16, got 12 rows"):
        torch.ops.turbospec.dequantize(inter[:12], 2003, 64)
