"""``verify``'s per-token logit processing: presence / frequency / repetition penalties, logit_bias,
min_p and a per-node allowed-token bitmask (``reference.verify``'s docstring has the semantics).

The contract: node i of a draft tree is processed with the counts of ITS OWN PATH (the request's
committed ``output_counts`` plus the drafts from the root to node i, node i included, the root
excluded), so verifying a tree equals walking it node by node with single-node verifies whose
counts include the path's tokens (``test_tree_equals_node_by_node_walk``): speculation on == off by
construction. Also here: the CPU kernel == the reference bit for bit (integer outputs) over random
trees, every feature alone and together, rows with different settings; hand-computed cases; the
repetition penalty against transformers' RepetitionPenaltyLogitsProcessor and min_p against its
MinPLogitsWarper; errors; ``SamplingParams``, ``LogitProcessingBuffers``, ``add_emitted_counts`` and
``path_logprobs``. The statistical test (chi-square, with a penalties-once-per-step negative control)
is in test_sampling_stats.py; the CUDA kernel's code on the emulator in test_cuda_emulated.py.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from turbospec import ops
    from turbospec.ops import reference
    from turbospec.ops.sampling import (LogitProcessingBuffers, SamplingParams, add_emitted_counts, path_logprobs,
                                        path_processed_logits)

from helpers import gen, make_verify_inputs, need_kernels

FEATURES = ["presence", "frequency", "repetition", "logit_bias", "min_p", "bitmask"]


def random_processing(bsz: int, n: int, vocab: int, features, g: torch.Generator, strength: float = 1.0,
                      neutral_rows=()) -> dict:
    """verify's processing keyword arguments with random per-row values for ``features`` (rows in
    ``neutral_rows`` get the neutral values): counts of a few tokens, a prompt mask, dense biases."""
    kw = {}
    counts = (torch.randint(1, 4, (bsz, vocab), generator=g) * (torch.rand(bsz, vocab, generator=g) < 0.15)).int()
    if {"presence", "frequency", "repetition"} & set(features):
        kw["output_counts"] = counts
    if "presence" in features:
        kw["presence_penalty"] = (torch.rand(bsz, generator=g, dtype=torch.float64) * 1.5 + 0.5) * strength
    if "frequency" in features:
        kw["frequency_penalty"] = (torch.rand(bsz, generator=g, dtype=torch.float64) * 1.5 + 0.2) * strength
    if "repetition" in features:
        kw["repetition_penalty"] = 1.0 + (torch.rand(bsz, generator=g, dtype=torch.float64) * 1.5 + 0.3) * strength
        kw["prompt_mask"] = torch.rand(bsz, vocab, generator=g) < 0.1
    if "logit_bias" in features:
        kw["logit_bias"] = torch.randn(bsz, vocab, generator=g) * 3.0 * (torch.rand(bsz, vocab, generator=g) < 0.3)
    if "min_p" in features:
        kw["min_p"] = torch.rand(bsz, generator=g, dtype=torch.float64) * 0.3 + 0.02
    if "bitmask" in features:
        kw["token_bitmask"] = reference.pack_token_bitmask(torch.rand(bsz, n, vocab, generator=g) < 0.8)
    for b in neutral_rows:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_p", 0.0)):
            if name in kw:
                kw[name][b] = neutral
        if "logit_bias" in kw:
            kw["logit_bias"][b] = 0.0
        if "token_bitmask" in kw:
            kw["token_bitmask"][b] = -1
    return kw


def both(inputs, params, kw):
    out = [t.clone() for t in ops.verify(*inputs, *params, **kw)]
    ref = reference.verify(*inputs, *params, **kw)
    return out, ref


def assert_same(out, ref, context=""):
    for name, a, r in zip(("accept_len", "accept_index", "output_token_ids"), out, ref):
        assert torch.equal(a, r), f"{name} differs {context}\nkernel    {a.tolist()}\nreference {r.tolist()}"


def row_params(bsz: int, greedy_rows, temperature: float = 0.9):
    t = torch.full((bsz,), temperature, dtype=torch.float64)
    t[list(greedy_rows)] = 0.0
    return t


# ----------------------------------------------------------------------------------------------
# kernel == reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("features", [[f] for f in FEATURES] + [FEATURES], ids=lambda f: "+".join(f))
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("kind", ["random", "chain", "wide"])
def test_kernel_matches_reference(features, with_q, kind):
    """Random trees, greedy and sampled rows side by side (rows 0 and 3 greedy), one row with neutral
    settings, top-k / top-p on some rows; the processing must change some outcome (not degenerate)."""
    need_kernels("cpu")
    changed = 0
    for trial, (bsz, n, vocab) in enumerate([(4, 9, 50), (4, 12, 300), (4, 6, 1500)]):
        seed = 100 * trial + 7 * len(features) + FEATURES.index(features[0]) + (50 if with_q else 0)
        g = gen(seed)
        inputs = make_verify_inputs(bsz, n, vocab, kind, with_q, 1.0, 0, 1.0, seed=seed, boost=2.0)
        temperature = row_params(bsz, (0, 3))
        top_k = torch.tensor([0, 0, 20, 0])
        top_p = torch.tensor([1.0, 0.9, 1.0, 1.0], dtype=torch.float64)
        kw = random_processing(bsz, n, vocab, features, g, neutral_rows=(1,))
        out, ref = both(inputs, (temperature, top_k, top_p), kw)
        assert_same(out, ref, f"({features}, B={bsz}, N={n}, V={vocab})")
        plain = reference.verify(*inputs, temperature, top_k, top_p)
        changed += sum(not torch.equal(a, p) for a, p in zip(ref, plain))
        assert (ref[0] >= 0).all()
        # the neutral row is exactly the row without processing
        for a, p in zip(ref, plain):
            assert torch.equal(a[1], p[1])
    assert changed > 0, "the processing never changed an outcome: the test has no power"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("vocab", [49_152, 128_256])
def test_kernel_matches_reference_large_vocab(device, vocab):
    """Every feature on a real vocabulary size (CPU: torch's softmax path; CUDA: processed rows skip
    the chunk pass, row 3 is neutral and uses it), greedy and sampled rows with top-k / top-p."""
    dev = need_kernels(device)
    g = gen(vocab % 1000)
    bsz, n = 4, 5
    inputs = make_verify_inputs(bsz, n, vocab, "random", False, 1.0, 0, 1.0, seed=vocab % 977, scale=4.0, boost=4.0, hot=8)
    kw = random_processing(bsz, n, vocab, FEATURES, g, neutral_rows=(3,))
    params = (row_params(bsz, (0,)), torch.tensor([0, 0, 40, 0]), torch.tensor([1.0, 0.9, 1.0, 0.95], dtype=torch.float64))
    ref = reference.verify(*inputs, *params, **kw)
    out = ops.verify(*[t.to(dev) if isinstance(t, torch.Tensor) else t for t in inputs],
                     *[t.to(dev) for t in params], **{k: v.to(dev) for k, v in kw.items()})
    assert_same([t.cpu() for t in out], ref, f"(V={vocab}, {device})")


@pytest.mark.parametrize("features", [["presence", "frequency", "repetition"], FEATURES], ids=lambda f: "+".join(f))
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
def test_cuda_kernel_matches_reference(features, with_q):
    """The CUDA kernel (a GPU) against the reference, as test_kernel_matches_reference on CPU."""
    dev = need_kernels("cuda")
    for trial, (bsz, n, vocab) in enumerate([(4, 9, 50), (4, 12, 300), (4, 6, 1500)]):
        seed = 500 + trial + len(features)
        inputs = make_verify_inputs(bsz, n, vocab, "random", with_q, 1.0, 0, 1.0, seed=seed, boost=2.0)
        kw = random_processing(bsz, n, vocab, features, gen(seed), neutral_rows=(1,))
        params = (row_params(bsz, (0, 3)), torch.tensor([0, 0, 20, 0]), torch.tensor([1.0, 0.9, 1.0, 1.0], dtype=torch.float64))
        ref = reference.verify(*inputs, *params, **kw)
        out = ops.verify(*[t.to(dev) if isinstance(t, torch.Tensor) else t for t in inputs],
                         *[t.to(dev) for t in params], **{k: v.to(dev) for k, v in kw.items()})
        assert_same([t.cpu() for t in out], ref, f"({features}, V={vocab}, cuda)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_reference_half_logits(dtype):
    need_kernels("cpu")
    g = gen(3)
    inputs = make_verify_inputs(4, 10, 200, "random", False, 1.0, 0, 1.0, seed=3, boost=2.0)
    inputs = (inputs[0].to(dtype),) + inputs[1:]
    kw = random_processing(4, 10, 200, FEATURES, g)
    out, ref = both(inputs, (row_params(4, (1,)), 0, 1.0), kw)
    assert_same(out, ref)


def test_neutral_values_and_no_arguments_agree():
    """Neutral values (bias 0, penalties 0 / 0 / 1, min_p 0, every token allowed) give exactly the
    result without any processing argument, for the kernel and the reference."""
    need_kernels("cpu")
    bsz, n, vocab = 3, 8, 100
    for temperature in (0.0, 0.8):
        inputs = make_verify_inputs(bsz, n, vocab, "random", True, 1.0, 0, 1.0, seed=21, boost=2.0)
        kw = random_processing(bsz, n, vocab, FEATURES, gen(21), neutral_rows=range(bsz))
        assert (kw["token_bitmask"] == -1).all()
        plain = reference.verify(*inputs, temperature, 0, 1.0)
        out, ref = both(inputs, (temperature, 0, 1.0), kw)
        assert_same(out, plain)
        assert_same(ref, plain)


# ----------------------------------------------------------------------------------------------
# the path property: tree == node-by-node walk
# ----------------------------------------------------------------------------------------------
def walk_node_by_node(verify_fn, logits, parents, tokens, draft_probs, uniform, temperature, kw, b):
    """Row b of a tree verify re-done one node at a time: at each node, a verify of that node and its
    children alone (a star; N = 1 when it has none) whose output_counts are the row's counts plus the
    drafts on the path to the node (node included, root excluded), whose bitmask row is the node's,
    with the same coins. Returns (accept_len, path, emitted)."""
    n = parents.shape[1]
    par = parents[b].tolist()
    counts = kw["output_counts"][b].clone() if "output_counts" in kw else None
    node, path, emitted = 0, [0], []
    while True:
        kids = [c for c in range(1, n) if par[c] == node and int(tokens[b, c]) >= 0]
        idx = [node] + kids
        sub = dict(kw)
        if counts is not None:
            sub["output_counts"] = counts[None].clone()
        for name in ("prompt_mask", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if name in kw:
                sub[name] = kw[name][b:b + 1]
        if "token_bitmask" in kw:
            sub["token_bitmask"] = kw["token_bitmask"][b:b + 1, idx]
        star = torch.tensor([[-1] + [0] * len(kids)])
        u = uniform[b:b + 1, idx].clone()
        u[0, 0] = uniform[b, 0]
        t = temperature[b:b + 1] if isinstance(temperature, torch.Tensor) else temperature
        a_len, a_idx, out = verify_fn(logits[b:b + 1, idx], star, tokens[b:b + 1, idx],
                                      None if draft_probs is None else draft_probs[b:b + 1, idx], u, t, 0, 1.0, **sub)
        if int(a_len[0]) < 0:
            return -1, [], []
        emitted.append(int(out[0, 0]))
        if int(a_len[0]) == 0:
            return len(path) - 1, path, emitted
        node = idx[int(a_idx[0, 1])]
        path.append(node)
        if counts is not None:
            counts[int(tokens[b, node])] += 1


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_equals_node_by_node_walk(temperature, with_q, impl):
    """The contract. Drafts repeat tokens (the penalties bite along paths); strong penalties."""
    if impl == "kernel":
        need_kernels("cpu")
    verify_fn = ops.verify if impl == "kernel" else reference.verify
    if temperature == 0.0 and with_q:
        pytest.skip("greedy ignores draft_probs")
    deep = 0
    for trial in range(6):
        bsz, n, vocab = 4, 12, 40
        g = gen(300 + trial)
        logits, parents, tokens, draft_probs, uniform = make_verify_inputs(
            bsz, n, vocab, ["random", "chain", "wide"][trial % 3], with_q, 1.0, 0, 1.0, seed=300 + trial, boost=1.5)
        # a small alphabet of drafts, each with the target's favour at its parent: paths repeat tokens
        tokens[:, 1:] = torch.randint(0, 4, (bsz, n - 1), generator=g)
        row_max = logits.amax(-1)
        for b in range(bsz):
            for i in range(1, n):
                p = int(parents[b, i])
                logits[b, p, int(tokens[b, i])] = row_max[b, p] + 5.0 + float(torch.rand(1, generator=g))
        kw = random_processing(bsz, n, vocab, FEATURES if trial % 2 else FEATURES[:4], g, strength=0.4)
        temp = torch.full((bsz,), temperature, dtype=torch.float64)
        a_len, a_idx, out = verify_fn(logits, parents, tokens, draft_probs, uniform, temp, 0, 1.0, **kw)
        for b in range(bsz):
            k, path, emitted = walk_node_by_node(verify_fn, logits, parents, tokens, draft_probs, uniform, temp, kw, b)
            assert int(a_len[b]) == k, f"trial {trial} row {b}"
            if k < 0:
                continue
            assert a_idx[b, :k + 1].tolist() == path and out[b, :k + 1].tolist() == emitted, f"trial {trial} row {b}"
            deep += k >= 2
    assert deep >= 3, "paths too short to test the path counts"


def test_greedy_walk_with_single_node_verifies():
    """Greedy, literally one node per verify (N = 1): the emitted argmax moves to the first child with
    that token; each single-node verify's counts include the path so far."""
    need_kernels("cpu")
    bsz, n, vocab = 4, 10, 30
    for seed in (9, 11):
        g = gen(seed)
        logits, parents, tokens, _, uniform = make_verify_inputs(bsz, n, vocab, "wide", False, 0.0, 0, 1.0, seed=seed)
        # drafts from a small alphabet, favoured at their parents: paths repeat tokens
        tokens[:, 1:] = torch.randint(0, 3, (bsz, n - 1), generator=g)
        row_max = logits.amax(-1)
        for b in range(bsz):
            for i in range(1, n):
                p = int(parents[b, i])
                logits[b, p, int(tokens[b, i])] = row_max[b, p] + 2.0 + 2.0 * float(torch.rand(1, generator=g))
        kw = random_processing(bsz, n, vocab, ["presence", "frequency", "repetition", "logit_bias", "bitmask"], g,
                               strength=0.4)
        kw["token_bitmask"][:, :, 0] |= 0b111  # the drafts' alphabet stays allowed everywhere
        a_len, a_idx, out = ops.verify(logits, parents, tokens, None, uniform, 0.0, **kw)
        assert int(a_len.max()) >= 2, "paths too short to test the path counts"
        for b in range(bsz):
            counts = kw["output_counts"][b].clone()
            node, path, emitted = 0, [0], []
            while True:
                sub = {k: v[b:b + 1] for k, v in kw.items() if k not in ("output_counts", "token_bitmask")}
                one = ops.verify(logits[b:b + 1, node:node + 1], torch.tensor([[-1]]), tokens[b:b + 1, node:node + 1],
                                 None, uniform[b:b + 1, :1], 0.0, output_counts=counts[None].clone(),
                                 token_bitmask=kw["token_bitmask"][b:b + 1, node:node + 1], **sub)
                t = int(one[2][0, 0])
                emitted.append(t)
                nxt = next((c for c in range(node + 1, n) if int(parents[b, c]) == node and int(tokens[b, c]) == t),
                           None)
                if nxt is None:
                    break
                path.append(nxt)
                counts[t] += 1
                node = nxt
            assert a_idx[b, :len(path)].tolist() == path and out[b, :len(emitted)].tolist() == emitted, (seed, b)
            assert int(a_len[b]) == len(path) - 1


# ----------------------------------------------------------------------------------------------
# hand-computed cases
# ----------------------------------------------------------------------------------------------
BASE = [1.0, 2.0, 0.5, -1.0, 0.0, 1.9]   # argmax 1, then 5


def greedy_tokens(logits_rows, parents, tokens, **kw):
    """Greedy verify of one row (kernel and reference agree), returning the emitted tokens."""
    logits = torch.tensor([logits_rows])
    args = (logits, torch.tensor([parents]), torch.tensor([tokens]), None, torch.zeros(1, len(parents)), 0.0, 0, 1.0)
    ref = reference.verify(*args, **kw)
    if ops.kernels_available()["cpu"]:
        out = ops.verify(*args, **kw)
        assert_same(out, ref)
    return ref[2][0].tolist()


def counts_of(*tokens, vocab=6):
    c = torch.zeros(1, vocab, dtype=torch.int32)
    for t in tokens:
        c[0, t] += 1
    return c


@pytest.mark.parametrize("name,kw,want", [
    # presence: token 1 generated once: 2.0 - 0.2 = 1.8 < 1.9
    ("presence", dict(output_counts=counts_of(1), presence_penalty=0.2), [1.0, 1.8, 0.5, -1.0, 0.0, 1.9]),
    # frequency: token 1 twice: 2.0 - 2 * 0.25 = 1.5; token 3 once: -1 - 0.25
    ("frequency", dict(output_counts=counts_of(1, 1, 3), frequency_penalty=0.25), [1.0, 1.5, 0.5, -1.25, 0.0, 1.9]),
    # negative presence rewards: token 4 gets 0 + 2 = 2
    ("presence<0", dict(output_counts=counts_of(4), presence_penalty=-2.0), [1.0, 2.0, 0.5, -1.0, 2.0, 1.9]),
    # repetition: output token 1 (2 / 2 = 1), prompt token 3 (-1 * 2 = -2); token 5 unseen
    ("repetition", dict(output_counts=counts_of(1), prompt_mask=torch.tensor([[False, False, False, True, False, False]]),
                        repetition_penalty=2.0), [1.0, 1.0, 0.5, -2.0, 0.0, 1.9]),
    # presence / frequency ignore prompt-only tokens
    ("prompt-only", dict(output_counts=counts_of(), prompt_mask=torch.ones(1, 6, dtype=torch.bool),
                         presence_penalty=1.0, frequency_penalty=1.0), BASE),
    # all three, in order: (2 / 1.25 = 1.6) - 0.5 * 2 - 0.25 = 0.35
    ("all", dict(output_counts=counts_of(1, 1), repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=0.25),
     [1.0, 0.35, 0.5, -1.0, 0.0, 1.9]),
    ("logit_bias", dict(logit_bias=torch.tensor([[0.0, -1.5, 0.0, 5.0, 0.0, 0.0]])), [1.0, 0.5, 0.5, 4.0, 0.0, 1.9]),
    # bitmask 0b110101: tokens 0, 2, 4, 5 allowed
    ("bitmask", dict(token_bitmask=torch.tensor([[[0b110101]]], dtype=torch.int32)),
     [1.0, float("-inf"), 0.5, float("-inf"), 0.0, 1.9]),
])
def test_hand_computed_processing(name, kw, want):
    got = reference.verify_processed_logits(torch.tensor([[BASE]]), torch.tensor([[-1]]), torch.tensor([[0]]), **kw)
    assert got[0, 0].tolist() == pytest.approx(want, abs=1e-6), name
    # greedy verify (kernel and reference) emits the processed argmax
    want_t = max(range(6), key=lambda v: (want[v], -v))
    assert greedy_tokens([BASE], [-1], [0], **kw) == [want_t], name


def test_hand_computed_path_counts():
    """A chain root -> 1 (token 1) -> 2 (token 5). Node 1's logits predict the token after token 1, so
    token 1 is in its counts; node 2's counts hold tokens 1 and 5; the root (token 0) is the caller's."""
    rows = [BASE, BASE, BASE]
    kw = dict(output_counts=counts_of(), presence_penalty=0.5)
    got = reference.verify_processed_logits(torch.tensor([rows]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 5]]), **kw)
    assert got[0, 0].tolist() == pytest.approx(BASE)
    assert got[0, 1].tolist() == pytest.approx([1.0, 1.5, 0.5, -1.0, 0.0, 1.9])
    assert got[0, 2].tolist() == pytest.approx([1.0, 1.5, 0.5, -1.0, 0.0, 1.4])
    # greedy: root argmax 1 == draft (accepted); at node 1 token 1 is penalised: argmax 5 == draft;
    # at node 2 both are (1.5 vs 1.4): the bonus is token 1
    assert greedy_tokens(rows, [-1, 0, 1], [0, 1, 5], **kw) == [1, 5, 1]
    # without the penalty the walk accepts token 1 then emits 1 again (the draft 5 is rejected)
    assert greedy_tokens(rows, [-1, 0, 1], [0, 1, 5]) == [1, 1, -1]
    # a sibling branch does not count: node 2 is a second child of the root (token 5)
    got = reference.verify_processed_logits(torch.tensor([rows]), torch.tensor([[-1, 0, 0]]), torch.tensor([[0, 1, 5]]), **kw)
    assert got[0, 2].tolist() == pytest.approx([1.0, 2.0, 0.5, -1.0, 0.0, 1.4])


def test_hand_computed_min_p():
    """min_p after temperature: probabilities of [2, 1, 0, -3] / 1 are [.6439, .2369, .0871, .0321]
    (max .6439): min_p 0.2 keeps tokens 0, 1 (0.2369 >= 0.1288), 0.4 keeps token 0 only; at
    temperature 2 the scaled logits flatten ([.4718, .2862, .1736, .0684]) and min_p 0.2 keeps 0, 1, 2."""
    x = torch.tensor([2.0, 1.0, 0.0, -3.0])
    assert (reference.logits_to_probs(x, 1.0, min_p=0.2) > 0).tolist() == [True, True, False, False]
    assert (reference.logits_to_probs(x, 1.0, min_p=0.4) > 0).tolist() == [True, False, False, False]
    assert (reference.logits_to_probs(x, 2.0, min_p=0.2) > 0).tolist() == [True, True, True, False]
    p = reference.logits_to_probs(x, 1.0, min_p=0.2)
    assert p.tolist() == pytest.approx([0.7311, 0.2689, 0, 0], abs=1e-4)
    # before top-p: min_p 0.2 leaves [.7311, .2689]; top_p 0.7 then keeps one token
    assert (reference.logits_to_probs(x, 1.0, top_p=0.7, min_p=0.2) > 0).tolist() == [True, False, False, False]
    # in verify: a draft min_p drops is always rejected (p = 0), even with a coin of 0
    need_kernels("cpu")
    logits = x.repeat(1, 2, 1)
    for draft, accepted in ((1, 1), (2, 0)):
        for fn in (ops.verify, reference.verify):
            a_len, _, out = fn(logits, torch.tensor([[-1, 0]]), torch.tensor([[0, draft]]), None, torch.zeros(1, 2),
                               1.0, 0, 1.0, min_p=0.2)
            assert int(a_len[0]) == accepted
            if not accepted:
                assert int(out[0, 0]) in (0, 1)


def test_bitmask_per_node_and_nothing_allowed():
    """The bitmask is per node; a node whose bitmask allows nothing makes the row invalid (accept_len
    -1, nothing emitted), only when it is visited; the other rows are unaffected."""
    need_kernels("cpu")
    vocab = 40
    logits = torch.zeros(2, 3, vocab)
    logits[:, 0, 7] = 5.0   # root: 7, the draft of node 1
    logits[:, 1, 9] = 5.0   # node 1: 9
    parents, tokens = torch.tensor([[-1, 0, 0], [-1, 0, 0]]), torch.tensor([[0, 7, 8], [0, 7, 8]])
    allowed = torch.ones(2, 3, vocab, dtype=torch.bool)
    allowed[0, 1, 9] = False          # row 0: node 1 forbids 9 (its argmax): the next best, token 0
    allowed[1, 2] = False             # row 1: node 2 allows nothing, but it is never visited
    mask = reference.pack_token_bitmask(allowed)
    assert mask.shape == (2, 3, 2) and mask.dtype == torch.int32
    for fn in (ops.verify, reference.verify):
        a_len, _, out = fn(logits, parents, tokens, None, torch.zeros(2, 3), 0.0, 0, 1.0, token_bitmask=mask)
        assert a_len.tolist() == [1, 1] and out[:, :2].tolist() == [[7, 0], [7, 9]]
        a_len, _, out = fn(logits, parents, tokens, None, torch.zeros(2, 3), 1.0, 0, 1.0, token_bitmask=mask)
        assert a_len.tolist() == [1, 1] and int(out[0, 1]) != 9
    allowed[1, 1] = False             # row 1: node 1 (visited) allows nothing
    mask = reference.pack_token_bitmask(allowed)
    for temperature in (0.0, 1.0):
        for fn in (ops.verify, reference.verify):
            a_len, a_idx, out = fn(logits, parents, tokens, None, torch.zeros(2, 3), temperature, 0, 1.0,
                                   token_bitmask=mask)
            assert a_len.tolist()[1] == -1 and (out[1] == -1).all() and (a_idx[1] == -1).all()
            assert int(a_len[0]) == 1


def test_bitmask_words_and_sign_bit():
    """Token 31 is the sign bit of word 0; bits past V in the last word are ignored."""
    allowed = torch.zeros(1, 40, dtype=torch.bool)
    allowed[0, 31] = allowed[0, 32] = True
    mask = reference.pack_token_bitmask(allowed)
    assert mask.tolist() == [[-2 ** 31, 1]]
    assert torch.equal(reference.unpack_token_bitmask(mask, 40), allowed)
    assert torch.equal(reference.unpack_token_bitmask(mask | torch.tensor([0, -256], dtype=torch.int32), 40), allowed)


def test_overflow_to_inf_is_invalid():
    """A repetition penalty < 1 that overflows a huge logit to +inf makes the node invalid, as a +inf
    logit would."""
    need_kernels("cpu")
    logits = torch.zeros(1, 1, 4)
    logits[0, 0, 2] = 3e38
    kw = dict(output_counts=counts_of(2, vocab=4), repetition_penalty=0.5)
    for fn in (ops.verify, reference.verify):
        args = (logits, torch.tensor([[-1]]), torch.tensor([[0]]), None, torch.zeros(1, 1), 0.0, 0, 1.0)
        assert fn(*args, **kw)[0].tolist() == [-1]
        assert fn(*args)[0].tolist() == [0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_raw_logits_are_still_checked(temperature):
    """A NaN / +inf raw logit makes the node invalid even where the bitmask disallows that token, and
    all -inf raw logits stay invalid whatever the bias (the model is broken, not the request)."""
    need_kernels("cpu")
    vocab = 40
    logits = torch.randn(3, 1, vocab, generator=gen(2))
    logits[0, 0, 5] = float("nan")
    logits[1, 0, 6] = float("inf")
    logits[2, 0] = float("-inf")
    allowed = torch.ones(3, 1, vocab, dtype=torch.bool)
    allowed[0, 0, 5] = allowed[1, 0, 6] = False
    kw = dict(token_bitmask=reference.pack_token_bitmask(allowed), logit_bias=torch.full((3, vocab), 2.0))
    args = (logits, torch.full((3, 1), -1), torch.zeros(3, 1, dtype=torch.int64), None, torch.zeros(3, 1),
            temperature, 0, 1.0)
    for fn in (ops.verify, reference.verify):
        assert fn(*args, **kw)[0].tolist() == [-1, -1, -1]


# ----------------------------------------------------------------------------------------------
# transformers' processors
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [0.5, 1.1, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    """Bit for bit: HF penalises every token of input_ids (prompt + output), positive logits divided."""
    from transformers import RepetitionPenaltyLogitsProcessor
    g = gen(int(penalty * 10))
    vocab = 300
    logits = torch.randn(4, vocab, generator=g) * 3.0
    ids = torch.randint(0, vocab, (4, 30), generator=g)
    prompt, output = ids[:, :18], ids[:, 18:]
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    counts = torch.zeros(4, vocab, dtype=torch.int64).scatter_add_(1, output, torch.ones_like(output))
    prompt_mask = torch.zeros(4, vocab, dtype=torch.bool).scatter_(1, prompt, True)
    got = reference.process_logits(logits, counts, prompt_mask, repetition_penalty=torch.full((4,), penalty))
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)
    # and the kernel, through greedy verify on each row (argmax of the processed logits)
    if ops.kernels_available()["cpu"]:
        kw = dict(output_counts=counts.int(), prompt_mask=prompt_mask, repetition_penalty=penalty)
        out = ops.verify(logits[:, None], torch.full((4, 1), -1), torch.zeros(4, 1, dtype=torch.int64), None,
                         torch.zeros(4, 1), 0.0, **kw)
        assert out[2][:, 0].tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.1, 0.3, 0.9])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_min_p_matches_transformers(min_p, temperature):
    """The kept set equals MinPLogitsWarper's after TemperatureLogitsWarper (vLLM's order too: min_p
    right after temperature), and so do the probabilities."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper
    g = gen(int(min_p * 1000 + temperature * 10))
    logits = torch.randn(16, 500, generator=g) * 3.0
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature), MinPLogitsWarper(min_p)])
    want = torch.softmax(procs(torch.zeros(16, 1, dtype=torch.long), logits.clone()), -1)
    got = reference.logits_to_probs(logits, temperature, min_p=min_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert bool((got == 0).any()) or min_p < 0.05


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------
def _small():
    logits, parents, tokens, _, uniform = make_verify_inputs(2, 4, 40, "chain", False, 1.0, 0, 1.0, seed=3)
    return (logits, parents, tokens, None, uniform)


BAD_ROW_VALUES = [  # (argument, per-row values, bad row, printed, rule)
    ("presence_penalty", [0.0, 2.5], 1, "2.5", "in [-2, 2] (0 = off)"),
    ("frequency_penalty", [-3.0, 0.0], 0, "-3", "in [-2, 2] (0 = off)"),
    ("repetition_penalty", [1.0, 0.0], 1, "0", "a finite number > 0 (1 = off)"),
    ("repetition_penalty", [float("inf"), 1.0], 0, "inf", "a finite number > 0 (1 = off)"),
    ("min_p", [0.5, 1.5], 1, "1.5", "in [0, 1] (0 = off)"),
    ("min_p", [float("nan"), 0.0], 0, "nan", "in [0, 1] (0 = off)"),
]


@pytest.mark.parametrize("name,values,row,printed,rule", BAD_ROW_VALUES, ids=[f"{b[0]}-{b[1]}" for b in BAD_ROW_VALUES])
def test_bad_row_value_raises_naming_parameter_value_and_row(name, values, row, printed, rule):
    need_kernels("cpu")
    inputs = _small()
    kw = {name: torch.tensor(values, dtype=torch.float64), "output_counts": torch.zeros(2, 40, dtype=torch.int32)}
    with pytest.raises(RuntimeError, match=re.escape(f"verify: {name} must be {rule}, got {printed} at {name}[{row}]")):
        ops.verify(*inputs, 1.0, **kw)
    with pytest.raises(ValueError, match=re.escape(f"verify: {name} must be {rule}, got ") + ".* " + re.escape(f"at {name}[{row}]")):
        reference.verify(*inputs, 1.0, 0, 1.0, **kw)
    # a bad Python number: the wrapper's check, before any kernel
    kw[name] = values[row]
    with pytest.raises(RuntimeError, match=re.escape(f"verify: {name} must be {rule}, got")):
        ops.verify(*inputs, 1.0, **kw)


def test_negative_counts_and_penalty_without_counts_raise():
    need_kernels("cpu")
    inputs = _small()
    counts = torch.zeros(2, 40, dtype=torch.int32)
    counts[1, 17] = -1
    with pytest.raises(RuntimeError, match=re.escape("verify: output_counts must be >= 0 (how often each token was "
                                                     "generated), got -1 at output_counts[1, 17]")):
        ops.verify(*inputs, 1.0, output_counts=counts, presence_penalty=0.5)
    with pytest.raises(ValueError, match=re.escape("got -1 at output_counts[1, 17]")):
        reference.verify(*inputs, 1.0, 0, 1.0, output_counts=counts, presence_penalty=0.5)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        msg = re.escape(f"verify: {name} needs output_counts (int32 [B, V]")
        with pytest.raises(RuntimeError, match=msg):
            ops.verify(*inputs, 1.0, **{name: 1.5})
        with pytest.raises(RuntimeError, match=msg):
            ops.verify(*inputs, 1.0, **{name: torch.full((2,), 1.5, dtype=torch.float64)})
        with pytest.raises(ValueError, match=msg):
            reference.verify(*inputs, 1.0, 0, 1.0, **{name: 1.5})


BAD_TENSORS = [
    ("output_counts", torch.zeros(2, 40, dtype=torch.int64), "verify: output_counts must be int32 [B, V] = [2, 40], got int64 [2, 40]"),
    ("output_counts", torch.zeros(2, 41, dtype=torch.int32), "verify: output_counts must be int32 [B, V] = [2, 40], got int32 [2, 41]"),
    ("prompt_mask", torch.zeros(2, 40, dtype=torch.uint8), "verify: prompt_mask must be bool [B, V] = [2, 40], got uint8 [2, 40]"),
    ("logit_bias", torch.zeros(2, 40, dtype=torch.float64), "verify: logit_bias must be float32 [B, V] = [2, 40], got float64 [2, 40]"),
    ("token_bitmask", torch.zeros(2, 4, 1, dtype=torch.int32),
     "verify: token_bitmask must be int32 [B, N, ceil(V / 32)] = [2, 4, 2], got int32 [2, 4, 1]"),
    ("min_p", torch.zeros(3, dtype=torch.float64), "verify: min_p must be float32 or float64 [B] = [2], got float64 [3]"),
    ("presence_penalty", torch.zeros(2, dtype=torch.int64), "verify: presence_penalty must be float32 or float64 [B] = [2], got int64 [2]"),
    ("logit_bias", torch.zeros(2, 40, device="meta"), "verify: logit_bias must be on cpu (the device of target_logits), got meta"),
]


@pytest.mark.parametrize("name,value,message", BAD_TENSORS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_TENSORS)])
def test_bad_tensor_raises_in_kernel_and_fake(name, value, message):
    need_kernels("cpu")
    inputs = _small()
    outs = (torch.empty(2, dtype=torch.int64), torch.empty(2, 4, dtype=torch.int64), torch.empty(2, 4, dtype=torch.int64))
    params = (torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2))
    kw = {"output_counts": torch.zeros(2, 40, dtype=torch.int32), name: value}
    op = torch.ops.turbospec.verify.default
    if value.device.type != "meta":
        with pytest.raises(RuntimeError, match=re.escape(message)):
            op(*inputs, *params, *outs, **kw)
    mode = FakeTensorMode()
    fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (inputs, params, outs, kw))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        with mode:
            op(*fake[0], *fake[1], *fake[2], **fake[3])


def test_processing_traces_under_fake_mode():
    need_kernels("cpu")
    inputs = _small()
    kw = random_processing(2, 4, 40, FEATURES, gen(1))
    outs = (torch.empty(2, dtype=torch.int64), torch.empty(2, 4, dtype=torch.int64), torch.empty(2, 4, dtype=torch.int64))
    params = (torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2))
    mode = FakeTensorMode()
    fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (inputs, params, outs, kw))
    with mode:
        assert torch.ops.turbospec.verify.default(*fake[0], *fake[1], *fake[2], **fake[3]) is None


# ----------------------------------------------------------------------------------------------
# SamplingParams, the buffers, the counts, path_logprobs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2] (0 = off), got 2.5"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be a number in [-2, 2] (0 = off), got -2.01"),
    (dict(frequency_penalty="1"), "frequency_penalty must be a number in [-2, 2] (0 = off), got '1'"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0 (1 = off), got 0.0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number > 0 (1 = off), got nan"),
    (dict(min_p=-0.1), "min_p must be a number in [0, 1] (0 = off), got -0.1"),
    (dict(min_p=True), "min_p must be a number in [0, 1] (0 = off), got True"),
    (dict(logit_bias={5: 100.5}), "logit_bias[5] must be a number in [-100, 100], got 100.5"),
    (dict(logit_bias={"5": 1.0}), "logit_bias: token ids must be integers >= 0, got '5'"),
    (dict(logit_bias={-3: 1.0}), "logit_bias: token ids must be integers >= 0, got -3"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a {token_id: bias} mapping"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(0.5, **kwargs)


def test_sampling_params_fields():
    p = SamplingParams(0.5, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.5, min_p=1,
                       logit_bias={9: -100, 2: 100})
    assert p.logit_bias == ((2, 100.0), (9, -100.0)) and p.penalized and p.processed
    assert hash(p) == hash(SamplingParams(0.5, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.5,
                                          min_p=1, logit_bias=[(9, -100), (2, 100)]))
    assert not SamplingParams().processed and not SamplingParams(0.7, 5, 0.9).penalized
    assert SamplingParams(min_p=0.1).processed and not SamplingParams(min_p=0.1).penalized


def test_buffers_feed_verify_and_count_emitted_tokens():
    """set_row fills the per-row tensors from SamplingParams (prompt mask, bias, penalties); verify with
    them equals verify with tensors built by hand; add_emitted adds exactly tokens[0 .. accept_len]."""
    need_kernels("cpu")
    vocab, n = 40, 6
    params = [SamplingParams(0.0, presence_penalty=1.5, logit_bias={3: 4.0}),
              SamplingParams(0.8, top_k=10, repetition_penalty=1.7, min_p=0.05),
              SamplingParams(0.9)]
    prompts = [[1, 2, 2], [5], []]
    buf = LogitProcessingBuffers(4, vocab, max_nodes=n)
    for b, (p, ids) in enumerate(zip(params, prompts)):
        buf.set_row(b, p, ids, output_ids=[7, 7] if b == 0 else [])
    assert buf.output_counts[0, 7] == 2 and buf.prompt_mask[0].nonzero().flatten().tolist() == [1, 2]
    assert buf.logit_bias[0, 3] == 4.0 and buf.repetition_penalty.tolist() == [1.0, 1.7, 1.0, 1.0]
    kw = buf.verify_kwargs(3)
    assert all(t.data_ptr() == getattr(buf, k).data_ptr() for k, t in kw.items() if t is not None)  # views
    inputs = make_verify_inputs(3, n, vocab, "random", False, 1.0, 0, 1.0, seed=4, boost=2.0)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    top_k = torch.tensor([p.top_k for p in params])
    by_hand = dict(output_counts=buf.output_counts[:3].clone(), prompt_mask=buf.prompt_mask[:3].clone(),
                   presence_penalty=[1.5, 0.0, 0.0], frequency_penalty=[0.0] * 3, repetition_penalty=[1.0, 1.7, 1.0],
                   logit_bias=torch.zeros(3, vocab), min_p=[0.0, 0.05, 0.0])
    by_hand["logit_bias"][0, 3] = 4.0
    by_hand = {k: torch.tensor(v, dtype=torch.float64) if isinstance(v, list) else v for k, v in by_hand.items()}
    a_len, _, out = ops.verify(*inputs, temperature, top_k, 1.0, **kw)
    assert_same((a_len, _, out), reference.verify(*inputs, temperature, top_k, 1.0, **by_hand))
    before = buf.output_counts.clone()
    buf.add_emitted(out, a_len)
    want = before.clone()
    for b in range(3):
        for t in out[b, :int(a_len[b]) + 1].tolist():
            want[b, t] += 1
    assert torch.equal(buf.output_counts, want)
    assert int((buf.output_counts - before).sum()) == int((a_len + 1).sum())
    # the allocating twin, with an invalid row (accept_len -1) counting nothing
    counts = before.clone()
    a_len2 = a_len.clone()
    a_len2[1] = -1
    add_emitted_counts(counts, out, a_len2)
    assert torch.equal(counts[1], before[1]) and torch.equal(counts[0], want[0])
    # clear_row: neutral again; rows nobody processes are not passed at all
    buf.clear_row(0)
    assert buf.output_counts[0].sum() == 0 and buf.repetition_penalty[0] == 1.0
    assert buf.verify_kwargs(1) == {k: None for k in kw}
    assert all(v is not None for v in buf.verify_kwargs(1, every=True).values())
    with pytest.raises(ValueError, match=re.escape("logit_bias: token id 40 is not in the vocabulary [0, 40)")):
        buf.set_row(0, SamplingParams(logit_bias={40: 1.0}))
    with pytest.raises(ValueError, match=re.escape("prompt_ids holds 45, not a token id in [0, 40)")):
        buf.set_row(0, SamplingParams(), [1, 45])


def test_path_logprobs_use_the_processed_distribution():
    """path_logprobs over an accepted path equals the distribution verify drew from at each node:
    the reference's processed logits of those nodes (greedy: their log_softmax; sampling:
    logits_to_probs with min_p), computed for the whole tree at once; and differs from the raw one."""
    vocab, n = 30, 8
    g = gen(5)
    logits, parents, tokens, _, uniform = make_verify_inputs(1, n, vocab, "chain", False, 1.0, 0, 1.0, seed=5, boost=3.0)
    tokens[0, 1:] = torch.tensor([4, 4, 9, 4, 9, 2, 4])
    row_max = logits.amax(-1)
    for i in range(1, n):
        logits[0, i - 1, int(tokens[0, i])] = row_max[0, i - 1] + 12.0
    counts = torch.zeros(1, vocab, dtype=torch.int32)
    counts[0, 4] = 1
    prompt = torch.zeros(1, vocab, dtype=torch.bool)
    prompt[0, 9] = True
    bitmask = reference.pack_token_bitmask(torch.rand(1, n, vocab, generator=g) < 0.85)
    for b_ in range(n - 1):  # keep the drafts allowed so that the path goes deep
        bitmask[0, b_] |= reference.pack_token_bitmask(torch.nn.functional.one_hot(tokens[0, b_ + 1], vocab).bool())
    for params in (SamplingParams(0.0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                                  logit_bias={2: 1.0}),
                   SamplingParams(0.9, top_k=12, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                                  min_p=0.05, logit_bias={2: 1.0})):
        bias = torch.zeros(1, vocab)
        bias[0, 2] = 1.0
        kw = dict(output_counts=counts, prompt_mask=prompt, presence_penalty=params.presence_penalty,
                  frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
                  logit_bias=bias, min_p=params.min_p, token_bitmask=bitmask)
        a_len, a_idx, out = reference.verify(logits, parents, tokens, None, uniform, params.temperature, params.top_k,
                                             1.0, **kw)
        m = int(a_len[0]) + 1
        assert m >= 4, "path too short"
        rows = a_idx[0, :m]
        got = path_logprobs(logits[0, rows], out[0, :m], params, 3, output_counts=counts[0], prompt_mask=prompt[0],
                            token_bitmask=bitmask[0, rows])
        tree = reference.verify_processed_logits(logits, parents, tokens, **{k: v for k, v in kw.items() if k != "min_p"})
        x = tree[0, rows]
        want = (torch.log_softmax(x, -1) if params.greedy
                else reference.logits_to_probs(x, params.temperature, params.top_k, 1.0, params.min_p))
        assert torch.equal(got.view(m, -1)[:, 0], want.gather(1, out[0, :m, None])[:, 0].double())
        assert torch.equal(path_processed_logits(logits[0, rows], out[0, :m], params, counts[0], prompt[0], None,
                                                 bitmask[0, rows]), x)
        raw = path_logprobs(logits[0, rows], out[0, :m], SamplingParams(params.temperature, params.top_k), 3)
        assert not torch.equal(raw, got)
    with pytest.raises(ValueError, match="penalties need output_counts"):
        path_logprobs(logits[0, :2], out[0, :2], SamplingParams(presence_penalty=1.0), 0)
