"""One target step for one request and for many (``decode.step.TargetStep``).

A request alone is a batch of one row (slot 0); a batch runs the fixed-shape forward over its rows,
padded on the static path to a (rows, nodes) bucket (what CUDA graphs capture, one graph per
bucket). Here, on CPU: the static path's row buckets and their padding rows (idle slots and a slot
whose prompt is being prefilled in chunks) leave every request's numbers as they are alone, and the
one-slot cache grows when a batch first needs it. The CUDA cases (graphs on == off == CPU for
batches, buckets captured between steps) skip without a GPU.
"""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine, Request
from turbospec.decode.step import TargetStep
from turbospec.drafters.base import Draft
from turbospec.ops.sampling import SamplingParams

from helpers import PROMPT, engine, hf_greedy, make_head, make_tiny_model, prompts_mixed

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Row:
    """What ``TargetStep.step`` reads of a request: its tokens (the last is the root), cache length,
    planned draft, sampling, log-probabilities wanted, coins (greedy: zeros)."""

    def __init__(self, tokens, cache_len, draft=None):
        self.tokens, self.cache_len, self.draft = list(tokens), cache_len, draft
        self.ids = list(tokens)
        self.params, self.logprobs, self.constraint = SamplingParams(), None, None

    def uniform(self):
        return torch.zeros(1 + (0 if self.draft is None else len(self.draft)))


@pytest.fixture(scope="module")
def target():
    return turbospec.load_model(make_tiny_model("llama", seed=21))


def _continuation(target, prompt, n):
    return Engine(target, drafter="none", max_seq_len=128).generate(prompt, n).token_ids


def _drafts(target, prompts):
    """Per prompt a draft: a chain of the target's own next tokens (mostly accepted), a tree whose
    first branch is wrong and second right, and no draft."""
    out = []
    for i, p in enumerate(prompts):
        nxt = _continuation(target, p, 4)
        if i % 3 == 0:
            out.append(Draft(nxt[:3]))
        elif i % 3 == 1:
            out.append(Draft([(nxt[0] + 1) % 256, nxt[0], nxt[1]], parents=[0, 0, 2]))
        else:
            out.append(None)
    return out


def _alone(target, prompt, draft):
    step = TargetStep(target, 96)
    n = step.prefill(0, prompt)[0]
    return step.step({0: Row(prompt, n, draft)})[0], step


@pytest.mark.parametrize("static", [False, True])
def test_rows_equal_each_row_alone_with_padding_and_a_parked_prompt(target, static):
    """Slots 0..2 decode (a chain, a tree, no draft) while slot 3 holds half of a prompt being
    prefilled in chunks: on the static path the pass runs the 4-row bucket with slot 3 as a padding
    row, on CPU's eager path 3 rows. Each row emits what it emits alone; slot 3's prefix is
    untouched; each row's cache after the step (compacted) equals its cache alone."""
    prompts = prompts_mixed(4, seed=3)
    prompts = [p + PROMPT[:6] for p in prompts]
    drafts = _drafts(target, prompts[:3])
    step = TargetStep(target, 96, max_batch=4, static=static)
    assert step.slots == 1
    step.reserve(4)
    assert step.slots == 4
    assert step.runner.row_buckets == ((1, 2, 4) if static else None)
    lens = [step.prefill(b, p)[0] for b, p in enumerate(prompts[:3])]
    step.prefill_part(3, prompts[3], 0, 5)
    parked_kv = [t[3, :, :5].clone() for t in step.cache.tensors()]
    rows = {b: Row(p, lens[b], d) for b, (p, d) in enumerate(zip(prompts[:3], drafts))}
    seen = []
    real_forward = type(target).forward_static

    def spy(self, *a, **kw):
        seen.append(kw.get("nodes"))
        return real_forward(self, *a, **kw)

    import unittest.mock as mock
    with mock.patch.object(type(target), "forward_static", spy):
        got = step.step(rows, parked={3: 5})
    # CPU's eager pass is ragged: each row its own nodes (a chain and a tree of 3 + the root, a root
    # alone; the parked slot 3 is past the pass's 3 rows); the static path computes its fixed shape
    assert len(seen) == 1 and (seen[0] is None if static else seen[0].tolist() == [4, 4, 1])
    for t, before in zip(step.cache.tensors(), parked_kv):
        assert torch.equal(t[3, :, :5], before)
    for b in range(3):
        want, alone = _alone(target, prompts[b], drafts[b])
        assert got[b].tokens == want.tokens and got[b].accepted == want.accepted, b
        m = lens[b] + want.accepted + 1
        for t, a in zip(step.cache.tensors(), alone.cache.tensors()):
            torch.testing.assert_close(t[b, :, :m], a[0, :, :m], rtol=1e-5, atol=1e-5)  # static: another attention kernel
    assert got[0].accepted == 3 and got[1].accepted == 2  # the drafts were really verified


def test_one_step_class_for_alone_and_batch(target):
    """The Engine has one TargetStep: a request alone uses slot 0 of a one-slot cache; the first
    batch grows it to max_batch slots; requests alone after it still equal HF."""
    hf = make_tiny_model("llama", seed=21)
    eng = Engine(target, drafter="ngram", max_seq_len=128, max_batch=3)
    prompts = prompts_mixed(3, seed=4)
    ref = [hf_greedy(hf, p, 20) for p in prompts]
    assert eng.target_step.slots == 1
    assert eng.generate(prompts[0], 20).token_ids == ref[0]
    out = eng.generate(prompts, max_new_tokens=20)
    assert eng.target_step.slots == 3 and eng.cache is eng.target_step.cache
    assert [g.token_ids for g in out] == ref
    assert [eng.generate(p, 20).token_ids for p in prompts] == ref


def test_reserve_and_slots_are_checked(target):
    step = TargetStep(target, 64, max_batch=2)
    with pytest.raises(ValueError, match=r"slots must be an integer in \[1, 2\] \(max_batch\), got 3"):
        step.reserve(3)
    with pytest.raises(ValueError, match=r"slot must be an integer in \[0, 1\) \(the slots reserved\), got 1"):
        step.prefill(1, PROMPT)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        TargetStep(target, 64, max_batch=0)
    n = step.prefill(0, PROMPT)[0]
    with pytest.raises(ValueError, match="slot 1 is past the 1 slots reserved"):
        step.step({1: Row(PROMPT, n)})


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_static_batch_row_buckets_equal_alone(cyc, method):  # noqa: F811
    """Engine(static_shapes=True) with max_batch 5 (row buckets 1, 2, 4, 5): batches of 3 (a
    padding row) and 5 requests with head trees equal each request alone and HF greedy."""
    hf, target, ref, vocab = cyc
    head = make_head(method, target, vocab=vocab)
    eng = engine(target, method, head, vocab, num_draft=10, adaptive=False, max_batch=5, static_shapes=True)
    rows_seen = []
    real = eng.target_step.runner.__class__.forward_rows

    def spy(self, ids, *a, **kw):
        rows_seen.append(ids.shape[0])
        return real(self, ids, *a, **kw)

    prompts = [PROMPT[i:] for i in range(5)]
    import unittest.mock as mock
    with mock.patch.object(eng.target_step.runner.__class__, "forward_rows", spy):
        out3 = eng.generate([Request(p, max_new_tokens=24) for p in prompts[:3]])
        out5 = eng.generate([Request(p, max_new_tokens=24) for p in prompts])
    assert eng.runner.row_buckets == (1, 2, 4, 5)
    assert 4 in rows_seen and 5 in rows_seen and 3 not in rows_seen  # 3 rows ran as the 4-row bucket
    alone = [eng.generate(p, 24).token_ids for p in prompts]
    assert [g.token_ids for g in out3] == alone[:3]
    assert [g.token_ids for g in out5] == alone
    assert out5[0].token_ids == ref[:24]


# On a GPU
@CUDA
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_cuda_batch_graphs_on_off_and_cpu_equal(drafter):
    """Batches on CUDA (rows 3 -> the 4-row bucket, then 5 and 2, new prefix lengths each step):
    graphs on == graphs off == the CPU == HF greedy, and each request alone."""
    hf = make_tiny_model("llama", seed=22)
    prompts = prompts_mixed(5, seed=6)
    ref = [hf_greedy(hf, p, 30) for p in prompts]
    on = Engine(hf, drafter=drafter, device="cuda", max_seq_len=128, max_batch=5)
    off = Engine(hf, drafter=drafter, device="cuda", max_seq_len=128, max_batch=5, cuda_graphs=False)
    cpu = Engine(hf, drafter=drafter, max_seq_len=128, max_batch=5)
    for group in (prompts[:3], prompts, prompts[3:]):
        want = [ref[prompts.index(p)] for p in group]
        for eng in (on, off, cpu):
            assert [g.token_ids for g in eng.generate(group, max_new_tokens=30)] == want
    assert on.runner.graphs and {(4, 1), (5, 1), (2, 1)} <= set(on.runner._graphs)
    assert [on.generate(p, 30).token_ids for p in prompts] == ref


@CUDA
def test_cuda_capture_between_steps_keeps_every_cache(cyc):  # noqa: F811
    """A bucket captured while requests are mid-generation (a new row count joins) writes only the
    cache's slack: every request still equals HF greedy."""
    hf, target, ref, vocab = cyc
    gpu = turbospec.load_model(hf, device="cuda")
    head = make_head("eagle3", target, vocab=vocab).cuda()
    eng = engine(gpu, "eagle3", head, vocab, num_draft=10, adaptive=False, max_batch=4)
    from turbospec.serve.async_engine import AsyncEngine  # requests join mid-generation
    import asyncio

    async def run():
        async with AsyncEngine(eng, prefill_chunk=None) as served:
            first = asyncio.ensure_future(served.generate(PROMPT, max_new_tokens=N_NEW_CUDA))
            await asyncio.sleep(0.05)
            rest = [served.generate(PROMPT[:-i], max_new_tokens=16) for i in (1, 2, 3)]
            return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(run())
    assert first.token_ids == ref[:N_NEW_CUDA]
    for i, g in zip((1, 2, 3), rest):
        assert g.token_ids == eng.generate(PROMPT[:-i], 16).token_ids


N_NEW_CUDA = 40


def test_context_length_error_is_a_type(target):
    """The server answers context_length_exceeded by the error's type, not its message text."""
    from turbospec import ContextLengthError
    eng = Engine(target, drafter="none", max_seq_len=32)
    with pytest.raises(ContextLengthError, match=r"exceeds the KV cache \(max_seq_len 32\)") as e:
        eng.generate(PROMPT, max_new_tokens=20)
    assert isinstance(e.value, ValueError)  # what callers caught before
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1") as e:
        eng.generate(PROMPT, max_new_tokens=0)
    assert not isinstance(e.value, ContextLengthError)
