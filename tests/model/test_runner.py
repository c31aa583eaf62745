"""The fixed-shape verify path (``turbospec.model.runner``) that CUDA graphs capture.

On CPU the static path runs eagerly (``Engine(static_shapes=True)``): the same bucket padding,
packed tree masks, device-side prefix length and K/V slot writes as the graphs replay, so its
exactness is tested here without a GPU. The CUDA cases (graphs on vs off vs transformers) skip
without one.
"""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine
from turbospec import ops
from turbospec.model.runner import DEFAULT_BUCKETS, TargetRunner, chain_mask_packed

from helpers import N_NEW, PROMPT, engine, hf_greedy, make_head, make_tiny_model


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_chain_mask_packed():
    m = chain_mask_packed(64)[0].tolist()
    assert m[0] == 1 and m[1] == 3 and m[2] == 7 and m[62] == (1 << 63) - 1 and m[63] == -1
    # the same bits as build_tree's packed mask of a chain
    _, packed, _, _ = ops.build_tree(torch.arange(-1, 63)[None])
    assert packed[0].tolist() == m


@pytest.mark.parametrize("n", [1, 3, 8, 13, 64])
def test_forward_static_equals_forward(n):
    """Padded to its bucket, a random tree's logits and its K/V slots equal the dynamic forward's."""
    torch.manual_seed(n)
    target = turbospec.load_model(make_tiny_model("llama", seed=2))
    cache_a, cache_b = target.new_cache(200), target.new_cache(200 + 64)
    prompt = torch.randint(0, 256, (1, 40))
    pos = torch.arange(40)[None]
    target.forward(prompt, pos, cache_a, 0, logits="none")
    target.forward(prompt, pos, cache_b, 0, logits="none")
    parents = torch.tensor([[-1] + [int(torch.randint(0, i, ())) for i in range(1, n)]])
    mask, packed, depth, _ = ops.build_tree(parents)
    ids = torch.randint(0, 256, (1, n))
    ref = target.forward(ids, 40 + depth, cache_a, 40, mask)
    runner = TargetRunner(target, cache_b, static=True)
    out = runner.forward(ids, 40 + depth, 40, packed)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)  # another attention kernel: last bits differ
    assert (out.argmax(-1) == ref.argmax(-1)).all()
    for ka, kb in zip(cache_a.tensors(), cache_b.tensors()):
        torch.testing.assert_close(kb[:, :, : 40 + n], ka[:, :, : 40 + n], rtol=1e-5, atol=1e-5)
    # the dynamic runner derives the bool mask from the packed one
    dyn = TargetRunner(target, target.new_cache(200), static=False)
    dyn.cache.k, dyn.cache.v = cache_a.k, cache_a.v
    torch.testing.assert_close(dyn.forward(ids, 40 + depth, 40, packed), ref, rtol=0, atol=0)


def test_features_through_static_path():
    target = turbospec.load_model(make_tiny_model("llama", seed=3, num_hidden_layers=3))
    cache_a, cache_b = target.new_cache(100), target.new_cache(164)
    ids = torch.randint(0, 256, (1, 5))
    pos = torch.arange(5)[None]
    for spec in ("final", (0, 2)):
        ref_logits, ref_f = target.forward(ids, pos, cache_a, 0, features=spec)
        logits, f = TargetRunner(target, cache_b, features=spec, static=True).forward(ids, pos, 0)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(f, ref_f, rtol=1e-4, atol=1e-4)  # un-normed residual streams


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_engine_static_shapes_greedy_exact(kind, drafter):
    hf = make_tiny_model(kind, seed=4)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_greedy(hf, prompt, 50)
    eng = Engine(hf, drafter=drafter, max_seq_len=128, static_shapes=True)
    assert eng.runner.static and not eng.runner.graphs
    assert eng.generate(prompt, 50).token_ids == ref
    # up to the last slot of the cache: the bucket slack keeps padded steps inside it
    assert eng.generate(prompt, 128 - 30).token_ids[:50] == ref


@pytest.mark.parametrize("method,num_draft,tree", [
    ("eagle", 12, {}), ("eagle3", 12, {}), ("medusa", 12, {}),
    ("eagle", 63, {"depth": 8, "top_k": 8}),         # 64 nodes: the largest bucket, no padding
])
def test_engine_static_shapes_trees_exact(cyc, method, num_draft, tree):  # noqa: F811
    hf, target, ref, vocab = cyc
    eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=num_draft,
                 adaptive=False, tree=tree, static_shapes=True)
    g = eng.generate(PROMPT, N_NEW)
    assert g.token_ids == ref
    assert g.stats["tau"] > 1.05  # drafts were accepted: padded trees and compaction were exercised


def test_engine_static_shapes_sampling_matches_dynamic():
    """Same seed, same draws: the static path's probabilities equal the dynamic path's closely
    enough that the sampled tokens are the same (a tiny target with well-separated logits)."""
    hf = make_tiny_model("llama", seed=6)
    prompt = list(range(10, 40))
    a = Engine(hf, drafter="ngram", max_seq_len=128).generate(prompt, 40, temperature=0.8, seed=3).token_ids
    b = Engine(hf, drafter="ngram", max_seq_len=128, static_shapes=True).generate(
        prompt, 40, temperature=0.8, seed=3).token_ids
    assert a == b


def test_runner_and_engine_arguments():
    target = turbospec.load_model(make_tiny_model("llama"))
    cache = target.new_cache(100)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the target on a CUDA device"):
        TargetRunner(target, cache, graphs=True)
    with pytest.raises(ValueError, match="buckets must be token counts in \\[1, 64\\]"):
        TargetRunner(target, cache, static=True, buckets=(0, 4))
    with pytest.raises(ValueError, match="does not fit the largest bucket"):
        TargetRunner(target, cache, static=True, buckets=(1, 2)).bucket(3)
    assert TargetRunner(target, cache, static=True).buckets == DEFAULT_BUCKETS
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'"):
        Engine(target, drafter="none", cuda_graphs=True)
    with pytest.raises(ValueError, match="device='cuda:0', but the target Transformer is on cpu"):
        Engine(target, drafter="none", device="cuda:0")
    with pytest.raises(ValueError, match="'tpu' is not a torch device|'tpu' is not supported"):
        Engine(make_tiny_model("llama"), drafter="none", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            Engine(make_tiny_model("llama"), drafter="none", device="cuda")


# ---------------------------------------------------------------------------------------------
# On a GPU
@CUDA
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_cuda_graphs_greedy_fp32_exact(drafter):
    """fp32 on CUDA: graphs on == graphs off == transformers greedy on the CPU."""
    hf = make_tiny_model("llama", seed=7)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = hf_greedy(hf, prompt, 60)
    on = Engine(hf, drafter=drafter, device="cuda", max_seq_len=128)
    off = Engine(hf, drafter=drafter, device="cuda", max_seq_len=128, cuda_graphs=False)
    assert on.runner.graphs and not off.runner.graphs
    assert on.generate(prompt, 60).token_ids == ref
    assert off.generate(prompt, 60).token_ids == ref


@CUDA
def test_cuda_graphs_trees_exact(cyc):  # noqa: F811
    hf, target, ref, vocab = cyc
    gpu = turbospec.load_model(hf, device="cuda")
    for method in ("eagle", "medusa"):
        head = make_head(method, target, vocab=vocab).cuda()
        eng = engine(gpu, method, head, vocab, num_draft=12, adaptive=False)
        assert eng.runner.graphs
        g = eng.generate(PROMPT, N_NEW)
        assert g.token_ids == ref, method
        assert g.stats["tau"] > 1.05


@CUDA
def test_cuda_bf16_greedy_mismatch_measured():
    """bf16 on CUDA vs fp32: differences are expected (near-ties); measured and printed, and the
    output is always valid tokens of the requested length."""
    hf = make_tiny_model("llama", seed=8)
    prompts = [torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(8)]
    fp32 = Engine(hf, drafter="none", device="cuda", max_seq_len=128)
    bf16 = Engine(hf, drafter="ngram", device="cuda", dtype="bfloat16", max_seq_len=128)
    same = first = 0
    for p in prompts:
        a, b = fp32.generate(p, 64).token_ids, bf16.generate(p, 64).token_ids
        assert len(b) == 64 and all(0 <= t < 256 for t in b)
        same += a == b
        first += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 64)
    print(f"bf16 vs fp32 greedy on CUDA: {same}/{len(prompts)} identical, first difference at "
          f"{first / len(prompts):.1f} of 64 tokens on average")


def test_engine_static_shapes_draft_model_exact():
    """A separate draft model on the static path (its own runner) drafts and verifies exactly."""
    hf = make_tiny_model("llama", seed=9)
    draft = make_tiny_model("llama", seed=9, num_hidden_layers=1)
    prompt = list(range(50, 80))
    ref = hf_greedy(hf, prompt, 40)
    eng = Engine(hf, drafter="draft_model", draft_model=draft, max_seq_len=128, static_shapes=True,
                 adaptive=False, num_draft=4)
    assert eng.drafter.runner is not None and eng.drafter.runner.static
    g = eng.generate(prompt, 40)
    assert g.token_ids == ref
