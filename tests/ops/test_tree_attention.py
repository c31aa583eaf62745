"""turbospec::tree_attention (the verify pass's attention) against ``reference.tree_attention``, the
reference against torch's SDPA with an explicit mask, and ``merge_attention``.

Kernel cases are parametrized by device and dtype; CUDA cases skip without a GPU, and every kernel
case skips when the extension has no kernel for its device (the wrapper would run the reference
itself). test_cuda_emulated.py runs the CUDA kernel's code on the CPU.
"""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from turbospec import ops
    from turbospec.ops import reference

from helpers import assert_close, gen, make_inputs, on_every_isa, random_parents

DEVICES = ["cpu", "cuda"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def need_op(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not ops.kernels_available().get(device, False) or not ops.has_op("tree_attention", device.upper()):
        pytest.skip(f"turbospec._C has no {device} tree_attention kernel (build with `pip install -e .`)")
    return torch.device(device)


def run_op(dev, q, k, v, cache_len, packed, scale, include_prefix=True):
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), 123.0, device=dev)
    out, lse = ops.tree_attention(q.to(dev), k.to(dev), v.to(dev), cache_len.to(dev), packed.to(dev), scale,
                                  include_prefix, lse=lse)
    return out.cpu(), lse.cpu()


CASES = {  # name: (B, n, Hq, Hkv, S, D, cache_len, tree kind)
    "n1": (3, 1, 4, 4, 40, 32, [0, 7, 39], "chain"),
    "chain_gqa2": (3, 8, 4, 2, 160, 64, [0, 17, 100], "chain"),
    "tree_gqa4": (2, 17, 8, 2, 120, 64, [45, 103], "random"),
    "wide_gqa4_d128": (2, 12, 4, 1, 300, 128, [260, 3], "wide"),
    "n64_d128": (2, 64, 2, 2, 200, 128, [130, 5], "random"),
    "n64_gqa4": (1, 64, 4, 1, 140, 32, [70], "random"),
    "d80": (1, 5, 3, 1, 50, 80, [20], "star"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("include_prefix", [True, False], ids=["prefix", "tree_only"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(device, dtype, include_prefix, case):
    dev = need_op(device)
    bsz, n, hq, hkv, seq, d, cache_len, kind = CASES[case]
    inputs = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, dtype, seed=len(case))
    scale = 1 / math.sqrt(d)
    out, lse = run_op(dev, *inputs, scale, include_prefix)
    ref_out, ref_lse = reference.tree_attention(*inputs, scale, include_prefix)
    assert_close(out, lse, ref_out, ref_lse, dtype, case)


@pytest.mark.parametrize("device", DEVICES)
def test_long_prefix_many_tiles(device):
    """A prefix of ~1-2k keys: many key tiles (CPU) and several splits (CUDA)."""
    dev = need_op(device)
    inputs = make_inputs(2, 6, 8, 2, 2100, 64, [2000, 1031], "random", seed=3)
    out, lse = run_op(dev, *inputs, 0.125)
    assert_close(out, lse, *reference.tree_attention(*inputs, 0.125), torch.float32)


def test_cpu_scores_kept_or_recomputed_give_the_same_bits():
    """Pass 1 keeps the scores for pass 2 while they fit (1M floats per work item); a 64-token chain
    behind a 9k-key prefix with 4 query heads per kv head (256 rows, 128 per item on 2 threads) does
    not fit and recomputes them. Each of its rows must equal the same token attended alone (kept scores), bit for bit,
    in float32 and bfloat16 caches."""
    dev = need_op("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, cache_len, _ = make_inputs(1, 64, 4, 1, 9100, 16, [9000], "chain", dtype, seed=5)
        packed = reference.build_tree(torch.arange(-1, 63)[None])[1]  # a chain: token i sees 0..i
        out, lse = run_op(dev, q, k, v, cache_len, packed, 0.25)
        assert_close(out, lse, *reference.tree_attention(q, k, v, cache_len, packed, 0.25), dtype)
        for i in (0, 17, 63):
            alone, alone_lse = run_op(dev, q[:, i:i + 1], k, v, cache_len + i, torch.tensor([[1]]), 0.25)
            assert torch.equal(alone, out[:, i:i + 1]) and torch.equal(alone_lse, lse[:, :, i:i + 1]), (dtype, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["n1", "tree_gqa4", "n64_gqa4", "d80"])
def test_cpu_every_isa_gives_the_same_bits(dtype, case):
    """The scalar, AVX2 and AVX-512 paths (each the CPU has) give the same bits: the exponentials'
    vector code and its scalar tail (key tiles of odd lengths) compute what the scalar one does, with
    rows attending nothing (a tree-only pass with an empty mask row) among them."""
    need_op("cpu")
    bsz, n, hq, hkv, seq, d, cache_len, kind = CASES[case]
    q, k, v, lens, packed = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, dtype, seed=11)
    packed = packed.clone()
    packed[0, -1] = 0  # the last query of row 0 attends no new key: nothing at all without the prefix
    for include_prefix in (True, False):
        runs = on_every_isa(lambda: run_op(torch.device("cpu"), q * 4, k, v, lens, packed, 1 / math.sqrt(d),
                                           include_prefix))
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), (case, include_prefix)
        assert_close(runs[0][0], runs[0][1], *reference.tree_attention(q * 4, k, v, lens, packed, 1 / math.sqrt(d),
                                                                      include_prefix), dtype, case)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_float32_queries_over_16bit_caches(cache_dtype, case):
    """float32 q over a 16-bit cache (a float32 model with a float16 / bfloat16 K/V cache): the values
    widened exactly, so the result is the bits of float32 q over the same values in a float32 cache,
    on every ISA path."""
    dev = need_op("cpu")
    bsz, n, hq, hkv, seq, d, cache_len, kind = CASES[case]
    q, k, v, lens, packed = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, torch.float32, seed=13)
    k16, v16 = k.to(cache_dtype), v.to(cache_dtype)
    for include_prefix in (True, False):
        runs = on_every_isa(lambda: run_op(dev, q, k16, v16, lens, packed, 1 / math.sqrt(d), include_prefix))
        wide = run_op(dev, q, k16.float(), v16.float(), lens, packed, 1 / math.sqrt(d), include_prefix)
        for out, lse in runs:
            assert out.dtype == torch.float32
            assert torch.equal(out, wide[0]) and torch.equal(lse, wide[1]), (case, include_prefix)


def _bf16_runs(fn) -> list:
    """fn() on every CPU path, and on the AVX-512 path also with and without vdpbf16ps where the CPU
    has AVX-512 BF16 (ops.cpu_bf16_dot): the results in order (scalar, avx2, [avx512 without, with])."""
    runs = []
    try:
        for dot in (False, True):
            ops.cpu_bf16_dot(dot)
            if dot and not ops.cpu_bf16_dot():
                break  # no AVX-512 BF16 here: the float32 kernels only
            runs += on_every_isa(fn) if not dot else [fn()]
    finally:
        ops.cpu_bf16_dot("default")
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_bf16_products_every_path_gives_the_same_bits(case):
    """bf16_products (the int8 mode's attention over a bfloat16 cache): q and P rounded to bfloat16, so
    vdpbf16ps (where the CPU has AVX-512 BF16; D a multiple of 32) and the float32 kernels of every ISA
    path give the same bits, under float32 and bfloat16 queries; within bfloat16 rounding of the
    reference, and not the float32 attention over the same caches (the flag acts)."""
    dev = need_op("cpu")
    bsz, n, hq, hkv, seq, d, cache_len, kind = CASES[case]
    q, k, v, lens, packed = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, torch.float32, seed=17)
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    packed = packed.clone()
    packed[0, -1] = 0  # a row attending no new key (nothing at all without the prefix)
    for qq in (q * 3, (q * 3).to(torch.bfloat16)):
        for include_prefix in (True, False):
            def run():
                lse = torch.full((bsz, hq, n), 5.0)
                return ops.tree_attention(qq, k16, v16, lens, packed, 1 / math.sqrt(d), include_prefix, lse=lse,
                                          bf16_products=True)
            runs = _bf16_runs(run)
            for out, lse in runs[1:]:
                assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), (case, qq.dtype, include_prefix)
            ref_o, ref_l = reference.tree_attention(qq, k16, v16, lens, packed, 1 / math.sqrt(d), include_prefix,
                                                    bf16_products=True)
            torch.testing.assert_close(runs[0][0].float(), ref_o.float(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(runs[0][1], ref_l, atol=1e-3, rtol=1e-4)
            if include_prefix and qq.dtype == torch.float32:  # (a tree-only row of one key is v either way)
                wide = run_op(dev, qq, k16, v16, lens, packed, 1 / math.sqrt(d), include_prefix)
                assert not torch.equal(wide[0], runs[0][0]), case


def test_cpu_bf16_products_token_in_tree_equals_token_alone():
    """Each row's bits depend on its own keys only: a 64-token chain behind a prefix of 2,000 keys (many
    tiles; scores kept) and behind 9,000 (4 query heads a kv head: scores recomputed in pass 2), every
    token of it equal to the same token attended alone, with vdpbf16ps and without."""
    need_op("cpu")
    for prefix, d in ((2000, 64), (9000, 32)):
        q, k, v, cache_len, _ = make_inputs(1, 64, 4, 1, prefix + 100, d, [prefix], "chain", torch.float32, seed=6)
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        packed = reference.build_tree(torch.arange(-1, 63)[None])[1]
        for dot in (True, False):
            ops.cpu_bf16_dot(dot)
            try:
                lse = torch.empty(1, 4, 64)
                out, lse = ops.tree_attention(q, k, v, cache_len, packed, 0.2, lse=lse, bf16_products=True)
                for i in (0, 31, 63):
                    l1 = torch.empty(1, 4, 1)
                    alone, l1 = ops.tree_attention(q[:, i:i + 1], k, v, cache_len + i, torch.tensor([[1]]), 0.2,
                                                   lse=l1, bf16_products=True)
                    assert torch.equal(alone, out[:, i:i + 1]) and torch.equal(l1, lse[:, :, i:i + 1]), (prefix, dot, i)
            finally:
                ops.cpu_bf16_dot("default")


def test_cpu_bf16_products_tiny_values_read_as_zero():
    """Values below 2^-50 in magnitude (in q after scaling, in the caches, denormals among them) read as
    +0 on every path, so vdpbf16ps, which flushes denormals, and the float32 kernels agree: the result
    is that of the same inputs with those values zeroed, bit for bit."""
    need_op("cpu")
    q, k, v, lens, packed = make_inputs(2, 9, 4, 2, 100, 64, [40, 70], "random", torch.float32, seed=8)
    g = torch.Generator().manual_seed(9)
    tiny = lambda t: torch.where(torch.rand(t.shape, generator=g) < 0.2, t * 2.0 ** -60, t)
    q, k, v = tiny(q), tiny(k).to(torch.bfloat16), tiny(v).to(torch.bfloat16)
    k[0, 0, 3, :4] = torch.tensor([1e-39, -1e-40, 2.0 ** -126, 2.0 ** -51], dtype=torch.bfloat16)  # denormals
    zero = lambda t: torch.where(t.float().abs() < 2.0 ** -50, torch.zeros((), dtype=t.dtype), t)
    args = lambda qq, kk, vv: (qq, kk, vv, lens, packed, 0.125)
    runs = _bf16_runs(lambda: ops.tree_attention(*args(q, k, v), bf16_products=True, lse=torch.empty(2, 4, 9)))
    q0 = torch.where((q * 0.125 * math.log2(math.e)).abs() < 2.0 ** -50, torch.zeros(()), q)
    clean = ops.tree_attention(*args(q0, zero(k), zero(v)), bf16_products=True, lse=torch.empty(2, 4, 9))
    for out, lse in runs:
        assert torch.equal(out, clean[0]) and torch.equal(lse, clean[1])


def test_bf16_products_needs_bfloat16_caches():
    """bf16_products over a float32 or float16 cache (or with float16 q) is refused by the kernel and the
    reference, naming the rule."""
    q, k, v, lens, packed = make_inputs(1, 3, 2, 1, 20, 32, [5], "chain", torch.float32, seed=1)
    for kk, qq in ((k, q), (k.half(), q), (k.bfloat16(), q.half())):
        vv = v.to(kk.dtype)
        with pytest.raises(ValueError, match="bf16_products=True needs bfloat16 caches"):
            reference.tree_attention(qq, kk, vv, lens, packed, 0.2, bf16_products=True)
        if ops.has_op("tree_attention", "CPU"):  # (float16 q over bfloat16 caches: refused by the dtype check)
            with pytest.raises(RuntimeError, match="bf16_products=True needs bfloat16 caches|k_cache must be float16"):
                ops.tree_attention(qq, kk, vv, lens, packed, 0.2, bf16_products=True)


@pytest.mark.parametrize("d", [1, 5, 20])
def test_cpu_odd_head_dims(d):
    """The CPU kernel takes any D <= 256 (the CUDA kernel needs a multiple of 8)."""
    dev = need_op("cpu")
    inputs = make_inputs(2, 6, 4, 2, 30, d, [0, 21], "random", seed=d)
    out, lse = run_op(dev, *inputs, 0.7)
    assert_close(out, lse, *reference.tree_attention(*inputs, 0.7), torch.float32)


def test_cpu_row_split_across_threads():
    """Fewer (row, kv head) pairs than threads: the CPU kernel splits the query rows of a pair."""
    dev = need_op("cpu")
    inputs = make_inputs(1, 40, 8, 1, 90, 48, [37], "random", seed=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out, lse = run_op(dev, *inputs, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert_close(out, lse, *reference.tree_attention(*inputs, 0.2), torch.float32)


def test_cpu_row_split_gives_the_bits_of_one_thread():
    """3 kv heads do not share out evenly among 2 threads, nor 2 among 3 or 4: the kernel splits each
    pair's rows (a 64-token chain, 192 rows per kv head) into chunks. Every thread count gives the
    bits of one thread, and each token those it gets attended alone."""
    dev = need_op("cpu")
    q, k, v, cache_len, _ = make_inputs(1, 64, 9, 3, 300, 64, [150], "chain", torch.float32, seed=7)
    packed = reference.build_tree(torch.arange(-1, 63)[None])[1]
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3, 4):
            torch.set_num_threads(t)
            results.append(run_op(dev, q, k, v, cache_len, packed, 0.125))
    finally:
        torch.set_num_threads(threads)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    for i in (0, 31, 63):
        alone, alone_lse = run_op(dev, q[:, i:i + 1], k, v, cache_len + i, torch.tensor([[1]]), 0.125)
        assert torch.equal(alone, results[0][0][:, i:i + 1]) and torch.equal(alone_lse, results[0][1][:, :, i:i + 1])


def test_cpu_items_handed_out_longest_first_give_the_bits_of_one_thread():
    """Batch rows of very different lengths: the CPU kernel hands its (row, kv head) items to threads
    as they free up, longest first. Every thread count gives the bits of one thread."""
    dev = need_op("cpu")
    inputs = make_inputs(7, 3, 6, 3, 700, 32, [650, 3, 0, 400, 97, 64, 200], "random", seed=9)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3, 4):
            torch.set_num_threads(t)
            results.append(run_op(dev, *inputs, 0.17))
    finally:
        torch.set_num_threads(threads)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    assert_close(*results[0], *reference.tree_attention(*inputs, 0.17), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_given_out(device):
    """q a transposed view, caches narrowed views of larger buffers; out and lse are written in place."""
    dev = need_op(device)
    bsz, n, hq, hkv, seq, d = 2, 5, 4, 2, 50, 32
    g = gen(6)
    q = torch.randn(bsz, hq, n, d, generator=g).transpose(1, 2)            # [B, n, Hq, D], non-contiguous
    big_k = torch.randn(bsz, hkv + 1, seq + 10, d, generator=g)
    big_v = torch.randn(bsz, hkv + 1, seq + 10, d, generator=g)
    k, v = big_k[:, 1:, 3:seq + 3], big_v[:, :hkv, :seq]
    cache_len = torch.tensor([12, 44])
    packed = reference.build_tree(random_parents(bsz, n, "random", g))[1]
    out = torch.empty(bsz, n, hq, d, device=dev)
    lse = torch.empty(bsz, hq, n, device=dev)
    ret = ops.tree_attention(q.to(dev), k.to(dev), v.to(dev), cache_len.to(dev), packed.to(dev), 0.3, out=out, lse=lse)
    assert ret[0] is out and ret[1] is lse
    assert_close(out.cpu(), lse.cpu(), *reference.tree_attention(q, k, v, cache_len, packed, 0.3), torch.float32)
    out2, lse2 = ops.tree_attention(q.to(dev), k.to(dev), v.to(dev), cache_len.to(dev), packed.to(dev), 0.3)
    assert lse2 is None and torch.allclose(out2.cpu(), out.cpu(), atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("include_prefix", [True, False], ids=["prefix", "tree_only"])
def test_rows_attending_nothing(device, include_prefix):
    """A query whose mask row is empty (and no prefix) attends nothing: out 0, lse -inf."""
    dev = need_op(device)
    q, k, v, cache_len, packed = make_inputs(2, 3, 2, 1, 20, 16, [0, 5], "chain", seed=7)
    packed[:, 1] = 0
    out, lse = run_op(dev, q, k, v, cache_len, packed, 0.25, include_prefix)
    ref_out, ref_lse = reference.tree_attention(q, k, v, cache_len, packed, 0.25, include_prefix)
    assert_close(out, lse, ref_out, ref_lse, torch.float32)
    empty = [(0, 1)] if include_prefix else [(0, 1), (1, 1)]
    for b, i in empty:
        assert (out[b, i] == 0).all() and torch.isneginf(lse[b, :, i]).all()
    assert torch.isfinite(lse[1, :, 1]).all() == include_prefix


def prefix_attention(q, k, v, cache_len, scale):
    """(out, lse) of each query over the prefix keys [0, cache_len) only, in plain torch."""
    bsz, n, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(bsz, n, hq, d)
    lse = torch.full((bsz, hq, n), float("-inf"))
    for b in range(bsz):
        length = int(cache_len[b])
        if length == 0:
            continue
        keys = k[b, :, :length].float().repeat_interleave(group, 0)
        values = v[b, :, :length].float().repeat_interleave(group, 0)
        scores = torch.einsum("ihd,hkd->hik", q[b].float(), keys) * scale
        lse[b] = torch.logsumexp(scores, -1)
        out[b] = torch.einsum("hik,hkd->ihd", torch.softmax(scores, -1), values)
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_prefix_and_tree_parts(device, dtype):
    """merge(prefix part over [0, cache_len), tree part with include_prefix=False) == the full op."""
    dev = need_op(device)
    q, k, v, cache_len, packed = make_inputs(3, 9, 6, 2, 90, 32, [0, 40, 81], "random", dtype, seed=8)
    scale = 1 / math.sqrt(32)
    o_tree, lse_tree = run_op(dev, q, k, v, cache_len, packed, scale, include_prefix=False)
    o_pre, lse_pre = prefix_attention(q, k, v, cache_len, scale)
    o, lse = ops.merge_attention(o_pre, lse_pre, o_tree.float(), lse_tree)
    full_out, full_lse = run_op(dev, q, k, v, cache_len, packed, scale, include_prefix=True)
    assert_close(o.to(dtype), lse, full_out, full_lse, dtype)
    ref_out, ref_lse = reference.tree_attention(q, k, v, cache_len, packed, scale)
    assert_close(o.to(dtype), lse, ref_out, ref_lse, dtype)


def test_merge_attention_edge_cases():
    o1, o2 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    ninf = float("-inf")
    lse1 = torch.tensor([[[ninf, 0.5]]])
    lse2 = torch.tensor([[[ninf, ninf]]])
    o, lse = reference.merge_attention(o1, lse1, o2, lse2)
    assert (o[0, 0] == 0).all() and torch.isneginf(lse[0, 0, 0])        # both sides empty
    assert torch.allclose(o[0, 1], o1[0, 1]) and lse[0, 0, 1].item() == pytest.approx(0.5)
    o, lse = reference.merge_attention(o1, torch.tensor([[[1.0, 2.0]]]), o2, torch.tensor([[[1.0, 1000.0]]]))
    assert torch.allclose(o[0, 0], (o1[0, 0] + o2[0, 0]) / 2)
    assert lse[0, 0, 0].item() == pytest.approx(1 + math.log(2)) and torch.allclose(o[0, 1], o2[0, 1])


def sdpa_with_mask(q, k, v, cache_len, packed, scale):
    """Torch SDPA over the whole cache with an explicit boolean mask (prefix + allowed tree keys)."""
    bsz, n = q.shape[:2]
    seq = k.shape[2]
    tree = reference.unpack_tree_mask(packed, n)
    mask = torch.zeros(bsz, 1, n, seq, dtype=torch.bool)
    for b in range(bsz):
        length = int(cache_len[b])
        mask[b, 0, :, :length] = True
        mask[b, 0, :, length:length + n] = tree[b]
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.float(), v.float(), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kind", ["chain", "random", "wide"])
def test_reference_matches_sdpa(kind):
    inputs = make_inputs(3, 11, 8, 2, 70, 16, [0, 23, 59], kind, seed=9)
    out, _ = reference.tree_attention(*inputs, 0.3)
    torch.testing.assert_close(out, sdpa_with_mask(*inputs, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "random"])
def test_kernel_matches_sdpa(device, kind):
    dev = need_op(device)
    inputs = make_inputs(2, 20, 6, 3, 100, 64, [33, 80], kind, seed=10)
    out, _ = run_op(dev, *inputs, 0.125)
    torch.testing.assert_close(out, sdpa_with_mask(*inputs, 0.125), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# sliding window
# ----------------------------------------------------------------------------------------------
def window_attention_brute(q, k, v, cache_len, packed, scale, window):
    """Sliding-window tree attention written out key by key, from token positions (the specification
    in plain terms): query i of row b sits at position cache_len + depth_i and attends the prefix slots
    s and its tree keys j (mask bit set) whose position (s, or cache_len + depth_j) is > its own - window."""
    bsz, n, hq, d = q.shape
    group = hq // k.shape[1]
    tree = reference.unpack_tree_mask(packed, n)
    depth = tree.sum(-1) - 1
    out = torch.zeros(bsz, n, hq, d)
    for b in range(bsz):
        L = int(cache_len[b])
        for i in range(n):
            me = L + int(depth[b, i])
            keys = [s for s in range(L) if s > me - window] + \
                   [L + j for j in range(n) if tree[b, i, j] and L + int(depth[b, j]) > me - window]
            for h in range(hq):
                kk, vv = k[b, h // group, keys].float(), v[b, h // group, keys].float()
                p = torch.softmax(kk @ q[b, i, h].float() * scale, 0)
                out[b, i, h] = p @ vv
    return out


@pytest.mark.parametrize("window", [1, 2, 5, 30, 1000])
@pytest.mark.parametrize("kind", ["chain", "random", "wide"])
def test_reference_window_matches_brute_force(window, kind):
    inputs = make_inputs(2, 13, 4, 2, 70, 16, [0, 41], kind, seed=window)
    out, _ = reference.tree_attention(*inputs, 0.3, window=window)
    torch.testing.assert_close(out, window_attention_brute(*inputs, 0.3, window), atol=1e-5, rtol=1e-5)
    if window >= 70:  # a window longer than every sequence changes nothing
        torch.testing.assert_close(out, reference.tree_attention(*inputs, 0.3)[0], atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("include_prefix", [True, False], ids=["prefix", "tree_only"])
@pytest.mark.parametrize("window", [1, 3, 9, 40, 130])
@pytest.mark.parametrize("case", ["chain_gqa2", "tree_gqa4", "n64_gqa4"])
def test_window_matches_reference(device, dtype, include_prefix, window, case):
    dev = need_op(device)
    bsz, n, hq, hkv, seq, d, cache_len, kind = CASES[case]
    inputs = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, dtype, seed=window)
    lse = torch.full((bsz, hq, n), 123.0)
    out, lse = ops.tree_attention(*[t.to(dev) for t in inputs], 0.2, include_prefix, lse=lse.to(dev), window=window)
    ref_out, ref_lse = reference.tree_attention(*inputs, 0.2, include_prefix, window=window)
    out, lse = out.cpu(), lse.cpu()
    assert_close(out, lse, ref_out, ref_lse, dtype, f"{case} window {window}")


def test_cpu_window_token_in_tree_equals_token_alone():
    """The bits a query gets inside a tree (its window starts at its own position) are the bits it gets
    alone after its path: the batch-invariance speculative decoding relies on, with a window."""
    need_op("cpu")
    q, k, v, cache_len, _ = make_inputs(1, 6, 4, 2, 80, 32, [50], seed=4)
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    packed = reference.build_tree(parents)[1]
    tree_out, _ = ops.tree_attention(q, k, v, cache_len, packed, 0.2, window=20)
    for i, path in ((4, [0, 1, 3, 4]), (5, [0, 2, 5])):
        # alone: the path's tokens laid out as a chain after the prefix, then the query at its end
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 50:50 + len(path)], v2[:, :, 50:50 + len(path)] = k[:, :, [50 + j for j in path]], \
            v[:, :, [50 + j for j in path]]
        chain = reference.build_tree(torch.arange(-1, len(path) - 1)[None])[1]
        alone, _ = ops.tree_attention(q[:, path], k2, v2, cache_len, chain, 0.2, window=20)
        assert torch.equal(alone[0, -1], tree_out[0, i])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("case", ["chain_gqa2", "tree_gqa4"])
def test_softcap_matches_reference(device, dtype, window, case):
    """Attention logit soft-capping (Gemma 2): the kernel (log2 units) against the reference, and the
    reference against the scores capped by hand through SDPA-free attention."""
    dev = need_op(device)
    bsz, n, hq, hkv, seq, d, cache_len, kind = CASES[case]
    inputs = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, dtype, seed=7)
    lse = torch.full((bsz, hq, n), 123.0, device=dev)
    out, lse = ops.tree_attention(*[t.to(dev) for t in inputs], 0.5, lse=lse, window=window, softcap=2.0)
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = reference.tree_attention(*inputs, 0.5, window=window, softcap=2.0)
    assert_close(out, lse, ref_out, ref_lse, dtype, f"{case} softcap")
    plain, _ = reference.tree_attention(*inputs, 0.5, window=window)
    assert (plain.float() - ref_out.float()).abs().max() > 1e-2  # the cap matters at this scale


def test_reference_softcap_is_tanh_of_the_scores():
    q, k, v, cache_len, packed = make_inputs(1, 3, 2, 2, 12, 8, [5], "chain", seed=2)
    out, _ = reference.tree_attention(q, k, v, cache_len, packed, 0.7, softcap=1.5)
    for i in range(3):
        keys = list(range(5)) + [5 + j for j in range(i + 1)]
        for h in range(2):
            s = (k[0, h, keys] @ q[0, i, h]) * 0.7
            p = torch.softmax(1.5 * torch.tanh(s / 1.5), 0)
            torch.testing.assert_close(out[0, i, h], p @ v[0, h, keys], atol=1e-5, rtol=1e-5)


def test_window_must_not_be_negative():
    need_op("cpu")
    inputs = make_inputs(1, 2, 2, 2, 10, 8, [3], seed=1)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.tree_attention(*inputs, 0.3, window=-1)
    with pytest.raises(ValueError, match="window must be >= 0"):
        reference.tree_attention(*inputs, 0.3, window=-1)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ops.tree_attention(*inputs, 0.3, softcap=-1.0)


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------
def test_bad_arguments_raise():
    need_op("cpu")
    q, k, v, cache_len, packed = make_inputs(2, 3, 4, 2, 10, 8, [0, 7], seed=11)
    call = lambda **kw: ops.tree_attention(**{**dict(q=q, k_cache=k, v_cache=v, cache_len=cache_len,  # noqa: E731
                                                    tree_mask_packed=packed, scale=0.5), **kw})
    cases = [
        (dict(q=q.double()),
         "tree_attention: q must be float32, bfloat16 or float16 [B, n, Hq, D], got float64 [2, 3, 4, 8]"),
        (dict(q=q[0]), "tree_attention: q must be float32, bfloat16 or float16 [B, n, Hq, D], got float32 [3, 4, 8]"),
        (dict(k_cache=k.double()), "tree_attention: k_cache must be float32, float16 or bfloat16 (float32 q) "
                                   "[B, Hkv, S, D] with B = 2 and D = 8 (the sizes of q), got float64"),
        (dict(q=q.half(), k_cache=k.float()), "tree_attention: k_cache must be float16 (q's dtype) [B, Hkv, S, D]"),
        (dict(k_cache=k[..., :4]), "tree_attention: k_cache must be float32, float16 or bfloat16 (float32 q) "
                                   "[B, Hkv, S, D] with B = 2 and D = 8"),
        (dict(v_cache=v[:, :, :9]), "tree_attention: v_cache must be float32 [B, Hkv, S, D] = [2, 2, 10, 8], "
                                    "got float32 [2, 2, 9, 8]"),
        (dict(k_cache=k.half()), "tree_attention: v_cache must be float16 [B, Hkv, S, D] = [2, 2, 10, 8], "
                                 "got float32"),
        (dict(k_cache=k[:, :1].expand(2, 3, 10, 8), v_cache=v[:, :1].expand(2, 3, 10, 8)),
         "tree_attention: the query heads Hq = 4 must be a multiple of the kv heads Hkv = 3 (GQA)"),
        (dict(cache_len=cache_len.int()), "tree_attention: cache_len must be int64 [B] = [2], got int32 [2]"),
        (dict(cache_len=torch.tensor([0, 8])), "tree_attention: cache_len[1] = 8 with n = 3 new tokens: needs "
                                               "0 <= cache_len and cache_len + n <= S = 10"),
        (dict(cache_len=torch.tensor([-1, 0])), "tree_attention: cache_len[0] = -1 with n = 3"),
        (dict(tree_mask_packed=packed[:, :2]), "tree_attention: tree_mask_packed must be int64 [B, n] = [2, 3], "
                                               "got int64 [2, 2]"),
        (dict(out=torch.empty(2, 3, 4, 8, dtype=torch.bfloat16)), "tree_attention: out must be float32 [B, n, Hq, D]"),
        (dict(out=torch.empty(2, 4, 3, 8).transpose(1, 2)), "tree_attention: output out must be contiguous"),
        (dict(lse=torch.empty(2, 3, 4)), "tree_attention: lse must be float32 [B, Hq, n] = [2, 4, 3], "
                                         "got float32 [2, 3, 4]"),
        (dict(scale=float("inf")), "tree_attention: scale must be a finite number"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call(**kwargs)
    with pytest.raises(RuntimeError, match=re.escape("tree_attention: q must be contiguous in its last dim (D)")):
        call(q=torch.randn(2, 3, 4, 16)[..., ::2])
    long_q = torch.randn(1, 65, 2, 8)
    with pytest.raises(RuntimeError, match=re.escape("q must have n in [1, 64] new tokens, got n = 65")):
        ops.tree_attention(long_q, torch.randn(1, 2, 80, 8), torch.randn(1, 2, 80, 8), torch.tensor([0]),
                           torch.zeros(1, 65, dtype=torch.int64), 0.5)
    with pytest.raises(ValueError, match=re.escape("cache_len must be on cpu (the device of q), got meta")):
        call(cache_len=cache_len.to("meta"))


def test_reference_bad_cache_len_raises():
    q, k, v, _, packed = make_inputs(1, 3, 2, 1, 10, 8, [0], seed=12)
    with pytest.raises(ValueError, match=re.escape("cache_len[0] = 8 with n = 3 new tokens")):
        reference.tree_attention(q, k, v, torch.tensor([8]), packed, 0.5)


def test_cuda_specific_arguments():
    dev = need_op("cuda")
    q, k, v, cache_len, packed = make_inputs(2, 3, 4, 2, 10, 12, [0, 7], seed=13)
    op = torch.ops.turbospec.tree_attention.default
    out = torch.empty(2, 3, 4, 12, device=dev)
    with pytest.raises(RuntimeError, match=re.escape("tree_attention: the CUDA kernel needs a head dim D that is a "
                                                     "multiple of 8 (128-bit loads), got D = 12")):
        op(q.to(dev), k.to(dev), v.to(dev), cache_len.to(dev), packed.to(dev), 0.5, True, out, None)
    q, k, v, cache_len, packed = make_inputs(3, 3, 4, 2, 10, 16, [0, 7, 8], seed=13)
    out = torch.empty(3, 3, 4, 16, device=dev)
    with pytest.raises(RuntimeError, match=re.escape("tree_attention: cache_len must be on cuda")):
        op(q.to(dev), k.to(dev), v.to(dev), cache_len, packed.to(dev), 0.5, True, out, None)
    # cache_len + n > S (or < 0) on CUDA: no raise (no host sync); the row attends nothing.
    lse = torch.empty(3, 4, 3, device=dev)
    cache_len = torch.tensor([0, 8, -1])
    op(q.to(dev), k.to(dev), v.to(dev), cache_len.to(dev), packed.to(dev), 0.5, True, out, lse)
    assert (out[1:] == 0).all() and torch.isneginf(lse[1:]).all()
    ref_out, ref_lse = reference.tree_attention(q[:1], k[:1], v[:1], cache_len[:1], packed[:1], 0.5)
    assert_close(out[:1].cpu(), lse[:1].cpu(), ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replay_with_new_cache_len(dtype):
    """The op reads no device value on the host: captured once, replayed with other cache lengths."""
    dev = need_op("cuda")
    q, k, v, cache_len, packed = make_inputs(2, 7, 8, 2, 3000, 128, [100, 2000], "random", dtype, seed=14)
    q, k, v, packed = q.to(dev), k.to(dev), v.to(dev), packed.to(dev)
    lens = cache_len.to(dev)
    out = torch.empty(q.shape, dtype=dtype, device=dev)
    lse = torch.empty(2, 8, 7, device=dev)
    ops.tree_attention(q, k, v, lens, packed, 0.1, out=out, lse=lse)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.tree_attention(q, k, v, lens, packed, 0.1, out=out, lse=lse)
    for new in ([100, 2000], [0, 2990], [2500, 3], [1, 1]):
        lens.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.tree_attention(q.cpu(), k.cpu(), v.cpu(), torch.tensor(new), packed.cpu(), 0.1)
        assert_close(out.cpu(), lse.cpu(), *ref, dtype, f"cache_len={new}")


# ----------------------------------------------------------------------------------------------
# opcheck: schema, autograd registration, fake kernel
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    dev = need_op(device)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for dtype, with_lse, include_prefix in ((torch.float32, True, True), (torch.bfloat16, False, False)):
        q, k, v, cache_len, packed = (t.to(dev) for t in make_inputs(2, 5, 4, 2, 30, 16, [3, 20], dtype=dtype, seed=15))
        out = torch.empty(q.shape, dtype=dtype, device=dev)
        lse = torch.empty(2, 4, 5, device=dev) if with_lse else None
        torch.library.opcheck(torch.ops.turbospec.tree_attention.default,
                              (q, k, v, cache_len, packed, 0.25, include_prefix, out, lse), test_utils=utils)
    if device == "cpu":  # bf16_products over bfloat16 caches (float32 q)
        q, k, v, cache_len, packed = make_inputs(2, 5, 4, 2, 30, 32, [3, 20], dtype=torch.float32, seed=16)
        torch.library.opcheck(torch.ops.turbospec.tree_attention.default,
                              (q, k.bfloat16(), v.bfloat16(), cache_len, packed, 0.25, True, torch.empty(q.shape),
                               torch.empty(2, 4, 5), 0, 0.0, True), test_utils=utils)
