"""turbospec's compiled ops (turbospec._C) against their specification, ``turbospec.reference``.

Every test is parametrized by device; the CUDA cases skip themselves without a GPU, and every case
skips (with the reason) when the extension has no kernels for its device, because the wrappers in
``turbospec.ops`` would then run the reference itself. Integer outputs must be equal; inputs are
random with fixed seeds and scales chosen so that no decision sits within float rounding of a tie.
Without a GPU, test_cuda_emulated.py runs the CUDA kernels' code on the CPU against the same checks.
"""
from __future__ import annotations

import re
import warnings
import zlib

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "extension not built": the tests skip themselves then
    from turbospec import ops
    from turbospec.ops import reference

from helpers import SAMPLING, gen, make_verify_inputs, need_kernels, random_parents, random_paths

DEVICES = ["cpu", "cuda"]
FLOAT_DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------------------------
# build_tree
# ----------------------------------------------------------------------------------------------
def _bits(*nodes: int) -> int:
    v = sum(1 << j for j in nodes)
    return v - (1 << 64) if v >= 1 << 63 else v  # int64 two's complement


HAND_TREES = [
    # parents, depth, packed, retrieve (rows = root-to-node paths)
    ([-1], [0], [_bits(0)], [[0]]),
    ([-1, 0, 1, 2], [0, 1, 2, 3], [_bits(0), _bits(0, 1), _bits(0, 1, 2), _bits(0, 1, 2, 3)],
     [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3]]),
    ([-1, 0, 0, 1], [0, 1, 1, 2], [0b1, 0b11, 0b101, 0b1011],
     [[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1], [0, 1, 3, -1]]),
    ([-1, 0, 0, 2, 1, 3], [0, 1, 1, 2, 2, 3],
     [_bits(0), _bits(0, 1), _bits(0, 2), _bits(0, 2, 3), _bits(0, 1, 4), _bits(0, 2, 3, 5)],
     [[0, -1, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1], [0, 2, -1, -1, -1, -1], [0, 2, 3, -1, -1, -1],
      [0, 1, 4, -1, -1, -1], [0, 2, 3, 5, -1, -1]]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(HAND_TREES)))
def test_build_tree_hand_drawn(device, case):
    dev = need_kernels(device)
    parents, depth, packed, retrieve = HAND_TREES[case]
    n = len(parents)
    mask, packed_out, depth_out, retrieve_out = ops.build_tree(torch.tensor([parents], device=dev))
    expected_mask = torch.tensor([[[bool((packed[i] >> j) & 1) for j in range(n)] for i in range(n)]])
    assert torch.equal(mask.cpu(), expected_mask)
    assert packed_out.cpu().tolist() == [packed]
    assert depth_out.cpu().tolist() == [depth]
    assert retrieve_out.cpu().tolist() == [retrieve]


@pytest.mark.parametrize("device", DEVICES)
def test_build_tree_64_nodes_sign_bit(device):
    dev = need_kernels(device)
    chain = torch.tensor([[-1] + list(range(63))], device=dev)
    star = torch.tensor([[-1] + [0] * 63], device=dev)
    _, packed, depth, retrieve = ops.build_tree(torch.cat([chain, star]))
    assert packed[0, 63].item() == -1                       # all 64 bits set
    assert packed[0, 62].item() == (1 << 63) - 1
    assert packed[1, 63].item() == _bits(0, 63)
    assert depth[0].cpu().tolist() == list(range(64))
    assert retrieve[0, 63].cpu().tolist() == list(range(64))
    assert retrieve[1, 63].cpu().tolist() == [0, 63] + [-1] * 62


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "chain", "star", "wide"])
@pytest.mark.parametrize("bsz,n", [(1, 1), (2, 2), (3, 7), (4, 17), (1, 64), (4, 64)])
def test_build_tree_matches_reference(device, kind, bsz, n):
    dev = need_kernels(device)
    parents = random_parents(bsz, n, kind, gen(1000 * n + bsz))
    out = ops.build_tree(parents.to(dev))
    ref = reference.build_tree(parents)
    for name, a, r in zip(("tree_mask", "tree_mask_packed", "depth", "retrieve_index"), out, ref):
        assert a.dtype == r.dtype, name
        assert torch.equal(a.cpu(), r), name


def test_build_tree_empty_batch():
    need_kernels("cpu")
    out = ops.build_tree(torch.empty(0, 5, dtype=torch.int64))
    assert [tuple(t.shape) for t in out] == [(0, 5, 5), (0, 5), (0, 5), (0, 5, 5)]


@pytest.mark.parametrize("parents,where", [
    ([[-1, 0, 1], [0, 0, 1]], "parents[1, 0] = 0"),
    ([[-1, 0, 2]], "parents[0, 2] = 2"),
    ([[-1, 0, 0, -1]], "parents[0, 3] = -1"),
    ([[-1, 0, 0], [-1, 5, 0]], "parents[1, 1] = 5"),
])
def test_build_tree_invalid_parents_raise(parents, where):
    need_kernels("cpu")
    with pytest.raises(RuntimeError, match=re.escape(where)):
        ops.build_tree(torch.tensor(parents))
    with pytest.raises(ValueError):
        reference.build_tree(torch.tensor(parents))


def test_build_tree_invalid_parents_marked_on_cuda():
    dev = need_kernels("cuda")
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 7], [5, 0, 0]], device=dev)
    mask, packed, depth, retrieve = ops.build_tree(parents)
    assert depth[0].tolist() == [0, 1, 2]
    for b in (1, 2):  # a row with an invalid parent: depth -1, empty mask, no paths
        assert depth[b].tolist() == [-1, -1, -1]
        assert not mask[b].any() and not packed[b].any()
        assert (retrieve[b] == -1).all()


def test_build_tree_bad_arguments_raise():
    need_kernels("cpu")
    op = torch.ops.turbospec.build_tree.default
    p = torch.tensor([[-1, 0, 0]])
    bufs = lambda: (torch.empty(1, 3, 3, dtype=torch.bool), torch.empty(1, 3, dtype=torch.int64),  # noqa: E731
                    torch.empty(1, 3, dtype=torch.int64), torch.empty(1, 3, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"build_tree: parents must be int64 \[B, N\], got int32 \[1, 3\]"):
        op(p.int(), *bufs())
    with pytest.raises(RuntimeError, match=r"build_tree: parents must have N in \[1, 64\] nodes, got N = 65"):
        op(torch.zeros(1, 65, dtype=torch.int64), *bufs())
    m, pk, d, r = bufs()
    with pytest.raises(RuntimeError, match=re.escape("build_tree: tree_mask must be bool [B, N, N] = [1, 3, 3], "
                                                     "got int64 [1, 3, 3]")):
        op(p, torch.empty(1, 3, 3, dtype=torch.int64), pk, d, r)
    with pytest.raises(RuntimeError, match=re.escape("build_tree: depth must be int64 [B, N] = [1, 3], "
                                                     "got int64 [3]")):
        op(p, m, pk, torch.empty(3, dtype=torch.int64), r)
    with pytest.raises(RuntimeError, match="build_tree: output retrieve_index must be contiguous"):
        op(p, m, pk, d, torch.empty(1, 3, 3, dtype=torch.int64).transpose(1, 2))


def run_both(device, dtype, logits, parents, tokens, draft_probs, uniform, temperature, top_k, top_p):
    dev = torch.device(device)
    logits = logits.to(dtype)
    draft_probs = None if draft_probs is None else draft_probs.to(dtype)
    out = ops.verify(logits.to(dev), parents.to(dev), tokens.to(dev),
                     None if draft_probs is None else draft_probs.to(dev), uniform.to(dev),
                     temperature, top_k, top_p)
    ref = reference.verify(logits, parents, tokens, draft_probs, uniform, temperature, top_k, top_p)
    return [t.cpu() for t in out], ref


def assert_same(out, ref, context=""):
    for name, a, r in zip(("accept_len", "accept_index", "output_token_ids"), out, ref):
        assert a.dtype == torch.int64
        assert torch.equal(a, r), f"{name} differs {context}\nkernel    {a.tolist()}\nreference {r.tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("kind", ["random", "chain", "star", "wide"])
def test_verify_matches_reference(device, dtype, mode, with_q, kind):
    need_kernels(device)
    if mode == "greedy" and with_q:
        pytest.skip("greedy ignores draft_probs (covered by the point case)")
    temperature, top_k, top_p = SAMPLING[mode]
    seed = zlib.crc32(f"{mode}-{with_q}-{kind}".encode()) % 10_000
    for trial, (bsz, n, vocab) in enumerate([(1, 1, 17), (2, 5, 50), (3, 12, 300), (4, 33, 1000), (2, 64, 128)]):
        inputs = make_verify_inputs(bsz, n, vocab, kind, with_q, temperature, top_k, top_p, seed + trial,
                                    boost=2.0 if trial % 2 else None)
        out, ref = run_both(device, dtype, *inputs, temperature, top_k, top_p)
        assert_same(out, ref, f"(B={bsz}, N={n}, V={vocab})")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [49_152, 128_256])
@pytest.mark.parametrize("mode,with_q", [("greedy", False), ("sample", False), ("top_k_top_p", False),
                                         ("top_p", True), ("sample", True)])
def test_verify_large_vocab(device, vocab, mode, with_q):
    need_kernels(device)
    temperature, top_k, top_p = SAMPLING[mode]
    kind = "chain" if vocab < 100_000 else "random"
    inputs = make_verify_inputs(2, 4, vocab, kind, with_q, temperature, top_k, top_p, seed=vocab % 977,
                                scale=4.0, boost=4.0, hot=8)
    out, ref = run_both(device, torch.float32, *inputs, temperature, top_k, top_p)
    assert_same(out, ref, f"(V={vocab}, {mode})")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_verify_greedy_full_and_empty_acceptance(device, dtype):
    dev = need_kernels(device)
    bsz, n, vocab = 3, 6, 40
    g = gen(7)
    logits = torch.randn(bsz, n, vocab, generator=g).to(dtype)
    parents = random_parents(bsz, n, "chain", g)
    argmax = logits.float().argmax(-1)
    tokens = torch.zeros(bsz, n, dtype=torch.int64)
    tokens[:, 1:] = argmax[:, :-1]                     # drafts = the argmax chain: all accepted
    tokens[1, 1:] = (argmax[1, :-1] + 1) % vocab       # row 1: the first draft is wrong: none accepted
    uniform = torch.rand(bsz, n, generator=g)
    accept_len, accept_index, out = ops.verify(logits.to(dev), parents.to(dev), tokens.to(dev), None,
                                               uniform.to(dev), 0.0)
    assert accept_len.tolist() == [n - 1, 0, n - 1]
    for b in (0, 2):
        assert accept_index[b].tolist() == list(range(n))
        assert out[b].tolist() == argmax[b].tolist()   # n - 1 drafts, then the bonus token
    assert accept_index[1].tolist() == [0] + [-1] * (n - 1)
    assert out[1].tolist() == [int(argmax[1, 0])] + [-1] * (n - 1)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_greedy_hand_drawn_tree(device):
    dev = need_kernels(device)
    # node:      0  1  2  3  4
    parents = [-1, 0, 0, 1, 2]
    tokens = [9, 5, 6, 7, 8]
    vocab = 12
    logits = torch.zeros(1, 5, vocab)
    logits[0, 0, 6] = 3.0   # root: argmax 6 = node 2's token (node 1 holds 5: skipped)
    logits[0, 2, 8] = 3.0   # node 2: argmax 8 = node 4's token
    logits[0, 4, 1] = 3.0   # node 4 (a leaf): the bonus token is 1
    logits[0, 1, 7] = 5.0   # node 1 is never visited
    out = ops.verify(logits.to(dev), torch.tensor([parents], device=dev), torch.tensor([tokens], device=dev), None,
                     torch.zeros(1, 5, device=dev), 0.0)
    assert [t.cpu().tolist() for t in out] == [[2], [[0, 2, 4, -1, -1]], [[6, 8, 1, -1, -1]]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
def test_verify_sampling_hand_drawn(device, with_q):
    """Target mass only on token 6 at the root: the first child (token 5) is always rejected, the
    second (token 6) always accepted, whatever the coins; at node 2 the only child (token 3) has
    target probability 0: rejected, and the recovered token is sampled from the rest."""
    dev = need_kernels(device)
    parents = torch.tensor([[-1, 0, 0, 2]])
    tokens = torch.tensor([[9, 5, 6, 3]])
    vocab = 10
    logits = torch.full((1, 4, vocab), float("-inf"))
    logits[0, 0, 6] = 0.0
    logits[0, 2] = torch.arange(vocab, dtype=torch.float32) / 4
    logits[0, 2, 3] = float("-inf")
    logits[0, 1] = 0.0
    logits[0, 3] = 0.0
    draft_probs = torch.full((1, 4, vocab), 1.0 / vocab) if with_q else None
    for u in ([0.0, 0.0, 0.0, 0.0], [0.999, 0.999, 0.999, 0.999], [0.5, 0.3, 0.7, 0.2]):
        uniform = torch.tensor([u])
        out = ops.verify(logits.to(dev), parents.to(dev), tokens.to(dev),
                         None if draft_probs is None else draft_probs.to(dev), uniform.to(dev), 1.0)
        ref = reference.verify(logits, parents, tokens, draft_probs, uniform, 1.0, 0, 1.0)
        assert_same([t.cpu() for t in out], ref, f"u={u}")
        assert out[0].item() == 1 and out[1][0, :2].tolist() == [0, 2] and out[2][0, 0].item() == 6
        assert out[2][0, 1].item() not in (3, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sample", "top_k", "top_p"])
def test_verify_sampling_full_and_empty_acceptance(device, mode):
    need_kernels(device)
    temperature, top_k, top_p = SAMPLING[mode]
    bsz, n, vocab = 4, 5, 64
    g = gen(11)
    parents = random_parents(bsz, n, "chain", g)
    tokens = torch.randint(0, vocab, (bsz, n), generator=g)
    logits = torch.randn(bsz, n, vocab, generator=g)
    rows = torch.arange(bsz)
    for i in range(1, n):  # the draft at node i dominates its parent's logits: p(draft) == 1.0
        logits[rows, i - 1, tokens[:, i]] = 200.0
    logits[2:, 0, tokens[2:, 1]] = float("-inf")  # rows 2, 3: the first draft has p = 0: rejected
    uniform = torch.rand(bsz, n, generator=g)
    out, ref = run_both(device, torch.float32, logits, parents, tokens, None, uniform, temperature, top_k, top_p)
    assert_same(out, ref)
    assert out[0].tolist() == [n - 1, n - 1, 0, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_non_finite_logits(device, temperature):
    need_kernels(device)
    bsz, n, vocab = 6, 4, 32
    g = gen(5)
    parents = random_parents(bsz, n, "chain", g)
    logits = torch.randn(bsz, n, vocab, generator=g)
    tokens = torch.zeros(bsz, n, dtype=torch.int64)
    tokens[:, 1:] = logits.argmax(-1)[:, :-1]    # greedy accepts everything: every node is visited
    logits[0, 0, 3] = float("nan")
    logits[1, 0, 5] = float("inf")
    logits[2, 0] = float("-inf")
    logits[3, 2, 7] = float("nan")               # a NaN deeper on the accepted path
    logits[4, 0, :vocab - 1] = float("-inf")     # valid: one finite logit is left
    # row 5: valid
    uniform = torch.rand(bsz, n, generator=g) * 0.01  # sampling: accept most drafts too
    out, ref = run_both(device, torch.float32, logits, parents, tokens, None, uniform, temperature, 0, 1.0)
    assert_same(out, ref)
    accept_len, accept_index, output = out
    assert accept_len[:4].tolist() == [-1, -1, -1, -1]
    assert (accept_index[:4] == -1).all() and (output[:4] == -1).all()
    assert (accept_len[4:] >= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_verify_non_finite_draft_probs(device):
    need_kernels(device)
    bsz, n, vocab = 3, 3, 16
    inputs = list(make_verify_inputs(bsz, n, vocab, "chain", True, 1.0, 0, 1.0, seed=3))
    draft_probs = inputs[3]
    draft_probs[0, 0, 2] = float("nan")
    draft_probs[1, 0, 4] = -0.25
    draft_probs[2, n - 1, 0] = float("nan")   # the leaf's q is never used
    out, ref = run_both(device, torch.float32, *inputs, 1.0, 0, 1.0)
    assert_same(out, ref)
    assert out[0][:2].tolist() == [-1, -1] and out[0][2].item() >= 0


def test_verify_invalid_inputs_raise():
    need_kernels("cpu")
    logits = torch.randn(1, 3, 8)
    tokens = torch.tensor([[0, 1, 2]])
    uniform = torch.rand(1, 3)
    with pytest.raises(RuntimeError, match=re.escape("parents[0, 2] = 2")):
        ops.verify(logits, torch.tensor([[-1, 0, 2]]), tokens, None, uniform, 0.0)
    with pytest.raises(RuntimeError, match=re.escape("parents[0, 0] = 1")):
        ops.verify(logits, torch.tensor([[1, 0, 0]]), tokens, None, uniform, 1.0)
    with pytest.raises(RuntimeError, match=re.escape("draft_token_ids[0, 2] = 8")):
        ops.verify(logits, torch.tensor([[-1, 0, 0]]), torch.tensor([[0, 1, 8]]), None, uniform, 1.0)
    with pytest.raises(ValueError, match=re.escape("draft_token_ids[0, 1] = -1")):
        reference.verify(logits, torch.tensor([[-1, 0, 0]]), torch.tensor([[0, -1, 2]]), None, uniform, 1.0, 0, 1.0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.5), "verify: temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
    (dict(temperature=float("nan")), "verify: temperature must be a finite number >= 0"),
    (dict(top_k=-1), "verify: top_k must be >= 0 (0 disables top-k), got -1"),
    (dict(top_p=0.0), "verify: top_p must be in (0, 1] (1 disables top-p), got 0"),
    (dict(top_p=1.5), "verify: top_p must be in (0, 1] (1 disables top-p), got 1.5"),
])
def test_verify_bad_sampling_parameters_raise(kwargs, message):
    need_kernels("cpu")
    args = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.verify(torch.randn(1, 2, 5), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), None, torch.rand(1, 2),
                   **args)


def test_verify_bad_arguments_raise():
    need_kernels("cpu")
    logits = torch.randn(1, 5, 8)
    parents = torch.tensor([[-1, 0, 1, 2, 3]])
    tokens = torch.tensor([[0, 1, 2, 3, 4]])
    uniform = torch.rand(1, 5)
    with pytest.raises(RuntimeError, match=re.escape("verify: uniform must be float32 [B, N] = [1, 5], "
                                                     "got float64 [1, 5]")):
        ops.verify(logits, parents, tokens, None, uniform.double(), 1.0)
    with pytest.raises(RuntimeError, match=re.escape("verify: target_logits must be float32, bfloat16 or float16 "
                                                     "[B, N, V], got int64 [1, 5, 8]")):
        ops.verify(logits.long(), parents, tokens, None, uniform, 1.0)
    with pytest.raises(RuntimeError, match=re.escape("verify: draft_probs must be float32, bfloat16 or float16 "
                                                     "[B, N, V] = [1, 5, 8], got float32 [1, 5, 7]")):
        ops.verify(logits, parents, tokens, torch.rand(1, 5, 7), uniform, 1.0)
    with pytest.raises(RuntimeError, match=re.escape("verify: parents must be int64 [B, N] = [1, 5], "
                                                     "got int64 [1, 4]")):
        ops.verify(logits, parents[:, :4], tokens, None, uniform, 1.0)
    with pytest.raises(RuntimeError, match=re.escape("verify: accept_len must be int64 [B] = [1], got int32 [1]")):
        ops.verify(logits, parents, tokens, None, uniform, 1.0, accept_len=torch.empty(1, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_verify_float16_and_strided_logits(device):
    need_kernels(device)
    inputs = list(make_verify_inputs(3, 6, 200, "random", True, 0.8, 0, 1.0, seed=21))
    big = torch.randn(3, 9, 200)
    big[:, 2:8] = inputs[0]
    inputs[0] = big[:, 2:8]            # a [B, N, V] view with a row stride != N * V
    out, ref = run_both(device, torch.float16, *inputs, 0.8, 0, 1.0)
    assert_same(out, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layers,heads,head_dim", [(1, 1, 1), (4, 2, 16), (6, 3, 64)])
def test_compact_kv_matches_reference(device, dtype, layers, heads, head_dim):
    dev = need_kernels(device)
    g = gen(layers * 100 + head_dim)
    bsz, n, seq = 5, 8, 40
    accept_len = [3, -1, 0, 7, 5]
    prefix_len = torch.tensor([4, 9, 0, 30, 17])
    accept_index = random_paths(accept_len, n, g)
    accept_index[4, :6] = torch.tensor([0, 1, 2, 3, 5, 6])   # a path that starts with unmoved entries
    caches = [torch.randn(bsz, heads, seq, head_dim, generator=g).to(dtype) for _ in range(layers)]
    expected = [c.clone() for c in caches]
    reference.compact_kv(expected, prefix_len, accept_index, torch.tensor(accept_len))
    on_dev = [c.to(dev) for c in caches]
    ops.compact_kv(on_dev, prefix_len.to(dev), accept_index.to(dev), torch.tensor(accept_len, device=dev))
    for layer, (a, e) in enumerate(zip(on_dev, expected)):
        assert torch.equal(a.cpu(), e), f"layer {layer}"
    assert torch.equal(on_dev[0][1].cpu(), caches[0][1])     # accept_len -1: untouched


@pytest.mark.parametrize("device", DEVICES)
def test_compact_kv_after_verify(device):
    """The path verify accepts moves into place: position prefix + j holds node accept_index[j]."""
    dev = need_kernels(device)
    bsz, n, vocab, seq = 4, 12, 64, 32
    logits, parents, tokens, _, uniform = make_verify_inputs(bsz, n, vocab, "wide", False, 0.0, 0, 1.0, seed=9)
    accept_len, accept_index, _ = ops.verify(logits.to(dev), parents.to(dev), tokens.to(dev), None,
                                             uniform.to(dev), 0.0)
    prefix_len = torch.tensor([0, 5, 10, 20], device=dev)
    node_of = torch.arange(seq, dtype=torch.float32).expand(bsz, 2, seq).unsqueeze(-1).repeat(1, 1, 1, 8)
    caches = [node_of.clone().to(dev), (node_of + 0.5).to(dev)]
    ops.compact_kv(caches, prefix_len, accept_index, accept_len)
    for b in range(bsz):
        base, a = int(prefix_len[b]), int(accept_len[b])
        for j in range(a + 1):
            assert caches[0][b, :, base + j].eq(base + accept_index[b, j].item()).all()
            assert caches[1][b, :, base + j].eq(base + accept_index[b, j].item() + 0.5).all()


def test_compact_kv_bad_arguments_raise():
    need_kernels("cpu")
    caches = [torch.zeros(2, 1, 10, 4) for _ in range(2)]
    accept_index = torch.tensor([[0, 1, 2], [0, 2, -1]])
    with pytest.raises(RuntimeError, match=re.escape("compact_kv: accept_index[1, 1] = 2 with prefix_len[1] = 8")):
        ops.compact_kv(caches, torch.tensor([0, 8]), accept_index, torch.tensor([2, 1]))
    with pytest.raises(RuntimeError, match=re.escape("compact_kv: accept_len[0] = 3 must be < N = 3")):
        ops.compact_kv(caches, torch.tensor([0, 0]), accept_index, torch.tensor([3, 1]))
    with pytest.raises(RuntimeError, match=re.escape("compact_kv: caches[1] must have the dtype and shape of caches[0]")):
        ops.compact_kv([caches[0], torch.zeros(2, 1, 10, 5)], torch.tensor([0, 0]), accept_index, torch.tensor([2, 1]))
    with pytest.raises(RuntimeError, match=re.escape("compact_kv: prefix_len must be int64 [B] = [2], got int32 [2]")):
        ops.compact_kv(caches, torch.tensor([0, 0], dtype=torch.int32), accept_index, torch.tensor([2, 1]))


# ----------------------------------------------------------------------------------------------
# opcheck: schemas, autograd registration, fake (meta) kernels
# ----------------------------------------------------------------------------------------------
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _verify_samples():
    logits, parents, tokens, draft_probs, uniform = make_verify_inputs(2, 6, 30, "random", True, 1.0, 0, 1.0, 1)
    outs = lambda: (torch.empty(2, dtype=torch.int64), torch.empty(2, 6, dtype=torch.int64),  # noqa: E731
                    torch.empty(2, 6, dtype=torch.int64))
    rows = lambda t, k, p: (torch.full((2,), t, dtype=torch.float64), torch.full((2,), k),  # noqa: E731
                            torch.full((2,), p, dtype=torch.float64))  # the op takes per-row tensors
    padded = tokens.clone()
    padded[1, 4:] = -1  # row 1: two padding nodes
    return [(logits, parents, tokens, draft_probs, uniform, *rows(1.0, 5, 0.9), *outs()),
            (logits.bfloat16(), parents, tokens, None, uniform, *rows(0.0, 0, 1.0), *outs()),
            (logits, parents, padded, draft_probs, uniform, torch.tensor([0.0, 0.75]), torch.tensor([0, 3]),
             torch.tensor([1.0, 0.875]), *outs())]


def test_opcheck_build_tree():
    need_kernels("cpu")
    parents = random_parents(3, 9, "random", gen(2))
    args = (parents, torch.empty(3, 9, 9, dtype=torch.bool), torch.empty(3, 9, dtype=torch.int64),
            torch.empty(3, 9, dtype=torch.int64), torch.empty(3, 9, 9, dtype=torch.int64))
    torch.library.opcheck(torch.ops.turbospec.build_tree.default, args, test_utils=OPCHECK_UTILS)


def test_opcheck_verify():
    need_kernels("cpu")
    for args in _verify_samples():
        torch.library.opcheck(torch.ops.turbospec.verify.default, args, test_utils=OPCHECK_UTILS)


def test_opcheck_compact_kv():
    need_kernels("cpu")
    g = gen(4)
    caches = [torch.randn(2, 2, 12, 8, generator=g) for _ in range(3)]
    args = (caches, torch.tensor([1, 3]), torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]]), torch.tensor([2, 1]))
    torch.library.opcheck(torch.ops.turbospec.compact_kv.default, args, test_utils=OPCHECK_UTILS)
