"""The CUDA kernels' logic, run on the CPU: csrc/cuda/*.cu compiled against tests/ops/cuda_emu/emu.h
(one fiber per CUDA thread, real barriers, emulated warp shuffles) and compared with
``turbospec.reference`` like the kernels in test_ops.py.

This is what runs the CUDA code paths (radix top-k / top-p selection, block scans, the chunked KV
move, invalid-row marking, tree attention's tensor-core fragments and split-K merge) on a machine
without a GPU; test_ops.py runs the real kernels when a GPU
is present. Blocks are small here (32-96 threads) to keep the emulation fast; the kernels accept
any multiple of 32. Building the emulator takes ~30 s; set TURBOSPEC_SKIP_CUDA_EMU=1 to skip.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from turbospec.ops import reference

from helpers import (ROWS, SAMPLING, assert_close, assert_row_equals_alone, gen, make_inputs, make_verify_inputs, ragged_batch, random_parents, random_paths)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def emu():
    if os.environ.get("TURBOSPEC_SKIP_CUDA_EMU") == "1":
        pytest.skip("TURBOSPEC_SKIP_CUDA_EMU=1")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the CUDA emulator")
    from torch.utils.cpp_extension import load
    # The name carries a hash of every file compiled in, so that an edit always rebuilds.
    files = sorted([*ROOT.glob("csrc/cuda/*"), *ROOT.glob("tests/ops/cuda_emu/*"), ROOT / "csrc" / "checks.h"])
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in files if f.is_file())).hexdigest()[:10]
    return load(name=f"turbospec_cuda_emu_{digest}", sources=[str(ROOT / "tests" / "ops" / "cuda_emu" / "emu_ops.cpp")],
                extra_cflags=["-O1", "-std=c++20"], verbose=False)


PROCESSING_ARGS = ("output_counts", "prompt_mask", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "logit_bias", "min_p", "token_bitmask")


def verify_emu(emu, threads, logits, parents, tokens, draft_probs, uniform, temperature, top_k, top_p, chunk=-1,
               **processing):
    """The CUDA entry point on the emulator; Python numbers are broadcast to the op's per-row tensors
    (float64 / int64 / float64) as the wrapper does. ``chunk``: -1 the real choice (no chunk pass below
    8192 logits), 0 none, > 0 verify_stats_kernel with chunks of that many logits. ``processing``:
    verify's optional logit-processing arguments (numbers broadcast to float64 [B])."""
    bsz, n = parents.shape
    outs = (torch.empty(bsz, dtype=torch.int64), torch.empty(bsz, n, dtype=torch.int64),
            torch.empty(bsz, n, dtype=torch.int64))
    params = [v if isinstance(v, torch.Tensor) else torch.full((bsz,), v, dtype=dtype)
              for v, dtype in ((temperature, torch.float64), (top_k, torch.int64), (top_p, torch.float64))]
    extra = [processing.get(name) for name in PROCESSING_ARGS]
    extra = [v if v is None or isinstance(v, torch.Tensor) else torch.full((bsz,), float(v), dtype=torch.float64)
             for v in extra]
    emu.set_block_threads(threads)
    emu.set_verify_chunk(chunk)
    emu.verify(logits, parents, tokens, draft_probs, uniform, *params, *outs, *extra)
    return outs


def assert_same(out, ref, context=""):
    for name, a, r in zip(("accept_len", "accept_index", "output_token_ids"), out, ref):
        assert torch.equal(a, r), f"{name} differs {context}\nemulated  {a.tolist()}\nreference {r.tolist()}"


@pytest.mark.parametrize("kind", ["random", "chain", "star"])
def test_build_tree(emu, kind):
    for bsz, n in [(1, 1), (3, 7), (2, 64)]:
        parents = random_parents(bsz, n, kind, gen(n))
        outs = (torch.empty(bsz, n, n, dtype=torch.bool), torch.empty(bsz, n, dtype=torch.int64),
                torch.empty(bsz, n, dtype=torch.int64), torch.empty(bsz, n, n, dtype=torch.int64))
        emu.build_tree(parents, *outs)
        for a, r in zip(outs, reference.build_tree(parents)):
            assert torch.equal(a, r)


def test_build_tree_invalid_rows_marked(emu):
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 7], [5, 0, 0]])
    mask, packed, depth, retrieve = (torch.empty(3, 3, 3, dtype=torch.bool), torch.empty(3, 3, dtype=torch.int64),
                                     torch.empty(3, 3, dtype=torch.int64), torch.empty(3, 3, 3, dtype=torch.int64))
    emu.build_tree(parents, mask, packed, depth, retrieve)
    assert depth.tolist() == [[0, 1, 2], [-1, -1, -1], [-1, -1, -1]]
    assert not mask[1:].any() and not packed[1:].any() and (retrieve[1:] == -1).all()


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("chunk", [0, 64], ids=["scan", "chunk64"])
def test_verify(emu, mode, with_q, chunk):
    """Both ways to find a node's max / argmax: the row's block scanning (chunk 0) and the chunk pass
    (verify_stats_kernel; V = 300 in 5 chunks, the last ragged; chunks of 5 and 29 logits below)."""
    if mode == "greedy" and with_q:
        pytest.skip("greedy ignores draft_probs")
    temperature, top_k, top_p = SAMPLING[mode]
    cases = [(1, 1, 17, "chain", 32), (2, 6, 50, "random", 64), (3, 12, 300, "wide", 32)]
    for trial, (bsz, n, vocab, kind, threads) in enumerate(cases):
        inputs = make_verify_inputs(bsz, n, vocab, kind, with_q, temperature, top_k, top_p, seed=40 + trial,
                                    boost=2.0 if trial else None)
        out = verify_emu(emu, threads, *inputs, temperature, top_k, top_p, chunk=chunk)
        ref = reference.verify(*inputs, temperature, top_k, top_p)
        assert_same(out, ref, f"(B={bsz}, N={n}, V={vocab}, {threads} threads, chunk {chunk})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunk", [0, 64], ids=["scan", "chunk64"])
def test_verify_half_logits(emu, dtype, chunk):
    """bfloat16 / float16 logits (the chunk pass has a kernel per logits type), with ties: bf16
    rounding makes equal maxima common, and the first index must win across chunks."""
    for mode in ("greedy", "sample"):
        temperature, top_k, top_p = SAMPLING[mode]
        logits, parents, tokens, _, uniform = make_verify_inputs(2, 6, 300, "chain", False, temperature, top_k,
                                                                 top_p, seed=17, boost=2.0)
        logits = (logits * 2).round().to(dtype)   # many equal values
        logits[0, :, 250] = logits[0, :, :250].max(-1).values  # the max again, in a later chunk
        args = (logits, parents, tokens, None, uniform, temperature, top_k, top_p)
        assert_same(verify_emu(emu, 32, *args, chunk=chunk), reference.verify(*args), f"({mode}, chunk {chunk})")


@pytest.mark.parametrize("mode,with_q", [("top_k_top_p", True), ("top_p", False), ("sample", True)])
def test_verify_many_tiles(emu, mode, with_q):
    """V = 5000 with 96 threads: many scan tiles, deep radix descents."""
    temperature, top_k, top_p = SAMPLING[mode]
    inputs = make_verify_inputs(2, 4, 5000, "random", with_q, temperature, top_k, top_p, seed=5, boost=3.0)
    out = verify_emu(emu, 96, *inputs, temperature, top_k, top_p)
    assert_same(out, reference.verify(*inputs, temperature, top_k, top_p))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("chunk", [0, 5], ids=["scan", "chunk5"])
def test_verify_non_finite_and_invalid_rows(emu, temperature, chunk):
    bsz, n, vocab = 6, 4, 32
    g = gen(5)
    parents = random_parents(bsz, n, "chain", g)
    logits = torch.randn(bsz, n, vocab, generator=g)
    tokens = torch.zeros(bsz, n, dtype=torch.int64)
    tokens[:, 1:] = logits.argmax(-1)[:, :-1]
    logits[0, 0, 3] = float("nan")
    logits[1, 0, 5] = float("inf")
    logits[2, 0] = float("-inf")
    logits[3, 2, 7] = float("nan")
    logits[4, 0, :vocab - 1] = float("-inf")
    uniform = torch.rand(bsz, n, generator=g) * 0.01
    out = verify_emu(emu, 32, logits, parents, tokens, None, uniform, temperature, 0, 1.0, chunk=chunk)
    assert_same(out, reference.verify(logits, parents, tokens, None, uniform, temperature, 0, 1.0))
    assert out[0][:4].tolist() == [-1] * 4 and (out[0][4:] >= 0).all()
    # Invalid parents or token ids: the CPU kernel raises; the CUDA kernel marks the row.
    parents[1, 2] = 5
    tokens[2, 3] = vocab
    tokens[3, 1] = -1
    out = verify_emu(emu, 32, torch.randn(bsz, n, vocab, generator=g), parents, tokens, None, uniform,
                     temperature, 0, 1.0, chunk=chunk)
    assert out[0][1:4].tolist() == [-1, -1, -1]
    assert (out[1][1:4] == -1).all() and (out[2][1:4] == -1).all()
    assert (out[0][[0, 4, 5]] >= 0).all()


@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("vocab,threads,chunk", [(300, 32, 0), (1500, 64, 0), (300, 32, 29)])
def test_verify_mixed_rows_equal_rows_alone(emu, vocab, threads, chunk, with_q):
    """Per-row temperature / top_k / top_p (greedy and sampled rows) and ragged drafts (-1 padding with
    NaN logits and draft probs and a coin of 0): each row equals the row alone with scalar parameters,
    on the emulated kernel and the reference (test_verify_rows.py: the same batches on the CPU kernel)."""
    inputs, params, alone, num_real = ragged_batch(ROWS, vocab, with_q, seed=vocab + 3 * with_q)
    out = verify_emu(emu, threads, *inputs, *params, chunk=chunk)
    assert_same(out, reference.verify(*inputs, *params), f"(V={vocab})")
    for b, ((row, (t, k, p)), n_real) in enumerate(zip(alone, num_real)):
        assert_row_equals_alone(out, b, verify_emu(emu, threads, *row, t, k, p, chunk=chunk), n_real, "(emulated)")
        assert_row_equals_alone(out, b, reference.verify(*row, t, k, p), n_real, "(reference)")


@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
def test_verify_scalar_and_row_tensors_agree(emu, with_q):
    """float64 [B] tensors act as the scalars did; float32 tensors as the scalars they hold."""
    temperature, top_k, top_p = SAMPLING["top_k_top_p"]
    inputs = make_verify_inputs(3, 8, 200, "random", with_q, temperature, top_k, top_p, seed=8, boost=2.0)
    by_scalars = verify_emu(emu, 32, *inputs, temperature, top_k, top_p)
    assert_same(by_scalars, reference.verify(*inputs, temperature, top_k, top_p))
    f32 = (torch.full((3,), temperature), torch.full((3,), top_k), torch.full((3,), top_p))
    assert_same(verify_emu(emu, 32, *inputs, *f32),
                verify_emu(emu, 32, *inputs, float(f32[0][0]), top_k, float(f32[2][0])))


def test_verify_bad_row_parameters_and_ids_mark_rows(emu):
    """A bad per-row value, draft id (-2, V) or a real id after padding: the CPU kernel raises (no host
    sync here): the row is marked invalid (accept_len -1, nothing emitted), the others are verified."""
    bsz, n, vocab = 8, 4, 16
    logits, parents, tokens, _, uniform = make_verify_inputs(bsz, n, vocab, "chain", False, 1.0, 0, 1.0, seed=12)
    temperature = torch.tensor([1.0, -0.5, float("nan"), float("inf"), 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    top_k = torch.tensor([0, 0, 0, 0, -1, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.5, 1.0])
    out = verify_emu(emu, 32, logits, parents, tokens, None, uniform, temperature, top_k, top_p)
    assert out[0][1:7].tolist() == [-1] * 6 and out[0][0] >= 0 and out[0][7] >= 0
    assert (out[1][1:7] == -1).all() and (out[2][1:7] == -1).all()
    good = (temperature[[0, 7]], top_k[[0, 7]], top_p[[0, 7]].double())
    rows = [t[[0, 7]] for t in (logits, parents, tokens)]
    assert_same([o[[0, 7]] for o in out], reference.verify(*rows, None, uniform[[0, 7]], *good))
    tokens = tokens.clone()
    tokens[1, 2] = -2
    tokens[2, 3] = vocab
    tokens[3, 1:] = torch.tensor([-1, 5, -1])   # a real token after padding
    tokens[4, 2:] = -1                          # valid padding
    params = (torch.ones(bsz), torch.zeros(bsz, dtype=torch.int64), torch.ones(bsz))
    out = verify_emu(emu, 32, logits, parents, tokens, None, uniform, *params)
    assert out[0][1:4].tolist() == [-1, -1, -1] and (out[0][[0, 4, 5, 6, 7]] >= 0).all()
    assert_same([o[4:5, :2] if o.dim() == 2 else o[4:5] for o in out],
                reference.verify(logits[4:5, :2], parents[4:5, :2], tokens[4:5, :2], None, uniform[4:5, :2], 1.0, 0,
                                 1.0))
    assert out[1][4, 2:].tolist() == [-1, -1] and out[2][4, 2:].tolist() == [-1, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("layers,heads,head_dim", [(1, 1, 1), (4, 2, 16), (3, 3, 5)])
def test_compact_kv(emu, dtype, layers, heads, head_dim):
    g = gen(layers * 100 + head_dim)
    bsz, n, seq = 5, 8, 40
    accept_len = [3, -1, 0, 7, 5]
    prefix_len = torch.tensor([4, 9, 0, 30, 17])
    accept_index = random_paths(accept_len, n, g)
    accept_index[4, :6] = torch.tensor([0, 1, 2, 3, 5, 6])
    caches = [torch.randn(bsz, heads, seq, head_dim, generator=g).to(dtype) for _ in range(layers)]
    expected = [c.clone() for c in caches]
    reference.compact_kv(expected, prefix_len, accept_index, torch.tensor(accept_len))
    emu.compact_kv(caches, prefix_len, accept_index, torch.tensor(accept_len))
    for a, e in zip(caches, expected):
        assert torch.equal(a, e)


def test_compact_kv_strided_unordered_and_out_of_range(emu):
    accept_index = torch.tensor([[1, 0, 2], [0, 1, 2], [0, 9, -1]])
    accept_len = torch.tensor([2, 2, 1])
    prefix_len = torch.tensor([0, 1, 3])
    caches = [torch.randn(3, 3, 12, 6) for _ in range(2)]
    expected = [c.clone() for c in caches]
    # row 0: a path that does not increase (moved step by step); row 2: index outside the cache (skipped)
    reference.compact_kv(expected, prefix_len[:2], accept_index[:2], accept_len[:2])
    emu.compact_kv(caches, prefix_len, accept_index, accept_len)
    for a, e in zip(caches, expected):
        assert torch.equal(a, e)
    big = torch.randn(2, 2, 3, 12, 6)
    views = [big[:, 0], big[:, 1]]   # row stride != H * S * D
    expected = [v.clone() for v in views]
    reference.compact_kv(expected, prefix_len[:2], accept_index[1:], accept_len[1:])
    emu.compact_kv(views, prefix_len[:2], accept_index[1:], accept_len[1:])
    for a, e in zip(views, expected):
        assert torch.equal(a, e)


# ----------------------------------------------------------------------------------------------
# tree_attention: mma.sync is emulated lane by lane in the fragment layout of m16n8k16 (see
# attn_mma), cp.async is a plain copy. Splits and the minimum chunk are forced small so that a few
# dozen keys already span several blocks and the merge kernel.
# ----------------------------------------------------------------------------------------------
def attn_emu(emu, q, k, v, cache_len, packed, scale, include_prefix=True, sms=4, splits=0, min_chunk=0, window=0,
             softcap=0.0):
    bsz, n, hq, _ = q.shape
    out = torch.full(q.shape, 7.0, dtype=q.dtype)    # garbage: every entry must be written
    lse = torch.full((bsz, hq, n), 7.0)
    emu.set_tree_attention_splits(sms, splits, min_chunk)
    try:
        emu.tree_attention(q, k, v, cache_len, packed, scale, include_prefix, out, lse, window, softcap, False)
    finally:
        emu.set_tree_attention_splits(4, 0, 0)
    return out, lse


ATTN_CASES = [  # (B, n, Hq, Hkv, S, D, cache_len, kind, splits)
    (3, 5, 4, 2, 80, 40, [37, 3, 0], "random", 3),     # GQA 2, D padded to 64, 3 splits
    (2, 1, 4, 1, 50, 32, [49, 0], "chain", 2),         # n = 1, GQA 4
    (1, 20, 8, 2, 90, 16, [50], "random", 2),          # 80 rows: two row groups
    (2, 9, 2, 2, 70, 64, [61, 12], "wide", 1),         # one split: written directly
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case,include_prefix", [(0, True), (0, False), (1, True), (2, True), (2, False), (3, True)])
def test_tree_attention(emu, dtype, case, include_prefix):
    bsz, n, hq, hkv, seq, d, cache_len, kind, splits = ATTN_CASES[case]
    inputs = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, dtype, seed=case)
    scale = 1 / d ** 0.5
    out, lse = attn_emu(emu, *inputs, scale, include_prefix, splits=splits, min_chunk=32)
    assert_close(out, lse, *reference.tree_attention(*inputs, scale, include_prefix), dtype, f"case {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,softcap", [(3, 0.0), (20, 0.0), (0, 2.0), (9, 2.0)])
@pytest.mark.parametrize("case,include_prefix", [(0, True), (2, True), (2, False), (3, True)])
def test_tree_attention_window_and_softcap(emu, dtype, window, softcap, case, include_prefix):
    """Sliding windows (keys before a query's window masked; the prefix before the root's skipped,
    which moves the split boundaries) and Gemma 2's logit soft-capping, against the reference."""
    bsz, n, hq, hkv, seq, d, cache_len, kind, splits = ATTN_CASES[case]
    inputs = make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind, dtype, seed=case + window)
    scale = 1 / d ** 0.5 * (4.0 if softcap else 1.0)  # scores large enough for the cap to matter
    out, lse = attn_emu(emu, *inputs, scale, include_prefix, splits=splits, min_chunk=32, window=window,
                        softcap=softcap)
    want = reference.tree_attention(*inputs, scale, include_prefix, window=window, softcap=softcap)
    assert_close(out, lse, *want, dtype, f"case {case} window {window} softcap {softcap}")
    if softcap or include_prefix or window < n:  # (a tree of n tokens spans fewer than n positions)
        plain = reference.tree_attention(*inputs, scale, include_prefix)[0]
        assert (plain.float() - want[0].float()).abs().max() > 1e-3  # the window / cap changes the result


def test_tree_attention_float16_d128_and_split_heuristic(emu):
    """float16 with D = 128; the split count chosen by the real heuristic (4 SMs: 5 chunks of 64)."""
    inputs = make_inputs(1, 4, 2, 1, 300, 128, [255], "random", torch.float16, seed=7)
    out, lse = attn_emu(emu, *inputs, 0.09)
    assert_close(out, lse, *reference.tree_attention(*inputs, 0.09), torch.float16)


def test_tree_attention_head_dim_256(emu):
    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(1, 3, 2, 2, 40, 256, [30], "chain", dtype, seed=8)
        out, lse = attn_emu(emu, *inputs, 0.06, splits=2, min_chunk=32)
        assert_close(out, lse, *reference.tree_attention(*inputs, 0.06), dtype)


def test_tree_attention_unaligned_views(emu):
    """Caches whose rows are not 16-byte aligned (element-wise staging) and a misaligned q (copied)."""
    g = gen(9)
    big_q = torch.randn(2 * 3 * 4 * 16 + 1, generator=g)
    q = big_q[1:].view(2, 3, 4, 16)
    big_k, big_v = torch.randn(2, 2, 40, 17, generator=g), torch.randn(2, 2, 40, 17, generator=g)
    k, v = big_k[..., 1:], big_v[..., :16]     # row stride 17: not 16-byte aligned
    cache_len = torch.tensor([20, 37])
    packed = reference.build_tree(random_parents(2, 3, "random", g))[1]
    out, lse = attn_emu(emu, q, k, v, cache_len, packed, 0.25, splits=2, min_chunk=32)
    assert_close(out, lse, *reference.tree_attention(q, k, v, cache_len, packed, 0.25), torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_tree_attention_out_of_range_rows_attend_nothing(emu, splits):
    """cache_len < 0 or cache_len + n > S: no raise (no host sync), nothing read; out 0, lse -inf."""
    q, k, v, _, packed = make_inputs(4, 3, 2, 1, 12, 16, [0] * 4, "chain", seed=10)
    cache_len = torch.tensor([-1, 10, 9, 0])
    out, lse = attn_emu(emu, q, k, v, cache_len, packed, 0.25, splits=splits, min_chunk=32)
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()
    assert_close(out[2:], lse[2:], *reference.tree_attention(q[2:], k[2:], v[2:], cache_len[2:], packed[2:], 0.25),
                 torch.float32)


# ---------------------------------------------------------------------------------------------
# The fused decoder-layer ops (csrc/cuda/layer_ops.cu)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, k, threads", [(3, 100, 0), (5, 1024, 0), (2, 1100, 0), (2, 1100, 160),
                                              (2, 1100, 32), (2, 1100, 64)])
def test_add_rms_norm_emulated(emu, dtype, rows, k, threads):
    """K <= 1024: the warp-per-row kernel (5 rows: a partly filled block); longer rows: the
    block-per-row kernel, the row in registers (288 threads: 4 values each; 160: 7, the last partly
    filled) or by the loop (32 and 64 threads: more than 8 values per thread)."""
    x = (torch.randn(rows, k, generator=gen(40)) * 3).to(dtype)
    delta = torch.randn(rows, k, generator=gen(41)).to(dtype)
    w = (1 + 0.1 * torch.randn(k, generator=gen(42))).to(dtype)
    emu.set_block_threads(threads)
    try:
        for d in (None, delta):
            out, s = torch.empty_like(x), None if d is None else torch.empty_like(x)
            emu.add_rms_norm(x, d, w, 1e-5, out, s)
            ref_s, ref_y = reference.add_rms_norm(x, d, w, 1e-5)
            if d is not None:
                assert torch.equal(s, ref_s)
            rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
            torch.testing.assert_close(out.float(), ref_y.float(), rtol=rtol, atol=1e-5)
    finally:
        emu.set_block_threads(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [0, 160])
def test_add_rms_norm_registers_equal_loop(emu, dtype, threads):
    """The register kernel gives the loop kernel's bits (same values per thread, same order)."""
    x = (torch.randn(3, 1100, generator=gen(44)) * 3).to(dtype)
    delta = torch.randn(3, 1100, generator=gen(45)).to(dtype)
    w = (1 + 0.1 * torch.randn(1100, generator=gen(46))).to(dtype)
    emu.set_block_threads(threads)
    try:
        for d in (None, delta):
            outs = []
            for loop in (False, True):
                emu.set_norm_loop(loop)
                out, s = torch.empty_like(x), None if d is None else torch.empty_like(x)
                emu.add_rms_norm(x, d, w, 1e-5, out, s)
                outs.append((out, s))
            assert torch.equal(outs[0][0], outs[1][0])
            if d is not None:
                assert torch.equal(outs[0][1], outs[1][1])
    finally:
        emu.set_block_threads(0)
        emu.set_norm_loop(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_emulated(emu, dtype):
    gu = (torch.randn(2, 3, 40, generator=gen(43)) * 4).to(dtype)
    out = gu.new_empty(2, 3, 20)
    emu.silu_mul(gu, out)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out.float(), reference.silu_mul(gu).float(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_cache_emulated(emu, dtype):
    """Bit-identical to the spec, out-of-cache slots skipped."""
    bsz, n, heads, h_kv, d, seq = 3, 4, 4, 2, 16, 12
    qkv = torch.randn(bsz, n, heads + 2 * h_kv, d, generator=gen(44)).to(dtype)
    ang = torch.randn(bsz, n, 1, d // 2, generator=gen(45))
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
    kc, vc = torch.randn(bsz, h_kv, seq, d, generator=gen(46)).to(dtype), torch.randn(bsz, h_kv, seq, d).to(dtype)
    cache_len = torch.tensor([0, 10, -1])
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_q = reference.rope_cache(qkv, cos, sin, cache_len, heads, ref_k, ref_v)
    q = qkv.new_empty(bsz, n, heads, d)
    emu.rope_cache(qkv, cos, sin, cache_len, heads, q, kc, vc)
    assert torch.equal(q, ref_q) and torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


# ----------------------------------------------------------------------------------------------
# verify's logit processing (test_verify_processing.py: the same on the CPU kernel)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("features", [["presence", "frequency", "repetition"], ["logit_bias", "bitmask"], ["min_p"],
                                      ["presence", "frequency", "repetition", "logit_bias", "min_p", "bitmask"]],
                         ids=lambda f: "+".join(f))
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("chunk", [0, 64], ids=["scan", "chunk64"])
def test_verify_processing(emu, features, with_q, chunk):
    """Random trees, rows greedy (0) and sampled with top-k (2) / top-p (1), a neutral row (3): the
    emulated kernel (processed rows never use the chunk pass; the neutral row does) == reference."""
    from test_verify_processing import random_processing
    changed = 0
    for trial, (bsz, n, vocab, kind, threads) in enumerate([(4, 7, 50, "random", 32), (4, 10, 300, "wide", 64)]):
        seed = 60 + trial + 7 * len(features)
        inputs = make_verify_inputs(bsz, n, vocab, kind, with_q, 1.0, 0, 1.0, seed=seed, boost=2.0)
        temperature = torch.tensor([0.0, 0.9, 1.1, 0.8], dtype=torch.float64)
        top_k, top_p = torch.tensor([0, 0, 15, 0]), torch.tensor([1.0, 0.85, 1.0, 1.0], dtype=torch.float64)
        kw = random_processing(bsz, n, vocab, features, gen(seed), neutral_rows=(3,))
        out = verify_emu(emu, threads, *inputs, temperature, top_k, top_p, chunk=chunk, **kw)
        ref = reference.verify(*inputs, temperature, top_k, top_p, **kw)
        assert_same(out, ref, f"({features}, V={vocab})")
        plain = reference.verify(*inputs, temperature, top_k, top_p)
        changed += sum(not torch.equal(a, p) for a, p in zip(ref, plain))
    assert changed > 0


def test_verify_processing_path_counts_and_invalid_rows(emu):
    """Paths that repeat tokens (the path fix-up, one thread per path entry), a bitmask allowing nothing
    at a visited node (row invalid), a bad per-row value (row invalid, no exception)."""
    from test_verify_processing import random_processing
    bsz, n, vocab = 4, 12, 40
    g = gen(8)
    logits, parents, tokens, _, uniform = make_verify_inputs(bsz, n, vocab, "chain", False, 1.0, 0, 1.0, seed=8)
    tokens[:, 1:] = torch.randint(0, 3, (bsz, n - 1), generator=g)
    row_max = logits.amax(-1)
    for b in range(bsz):
        for i in range(1, n):
            logits[b, i - 1, int(tokens[b, i])] = row_max[b, i - 1] + 6.0
    kw = random_processing(bsz, n, vocab, ["presence", "frequency", "repetition", "bitmask"], g, strength=0.4)
    kw["token_bitmask"][:, :, :] = -1
    kw["token_bitmask"][2, 3] = 0           # row 2: node 3 allows nothing
    for temperature in (0.0, 1.0):
        ref = reference.verify(logits, parents, tokens, None, uniform, temperature, 0, 1.0, **kw)
        assert int(ref[0].max()) >= 2 and int(ref[0][2]) == -1  # deep paths; row 2 reaches node 3
        assert_same(verify_emu(emu, 32, logits, parents, tokens, None, uniform, temperature, 0, 1.0, **kw), ref)
    bad = dict(kw, presence_penalty=torch.tensor([0.5, 3.0, 0.5, 0.5], dtype=torch.float64))
    out = verify_emu(emu, 32, logits, parents, tokens, None, uniform, 1.0, 0, 1.0, **bad)
    assert int(out[0][1]) == -1 and (out[2][1] == -1).all()
    good = [0, 3]
    ref = reference.verify(logits[good], parents[good], tokens[good], None, uniform[good], 1.0, 0, 1.0,
                           **{k: v[good] for k, v in bad.items()})
    assert_same([o[good] for o in out], ref)
