"""Batched decoding (``Engine.generate([...])``, turbospec.decode.batch): every request of a mixed
batch equals the same request decoded alone (greedy fp32: token for token, and HF's greedy;
seeded sampling: the same tokens as alone with the same seed), with requests joining and leaving
the batch between steps."""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine, Request
from turbospec.decode import batch as batch_mod

from helpers import (N_NEW, PROMPT, engine, hf_greedy, make_head, make_tiny_model, make_tiny_tokenizer,
                     prompts_mixed)


@pytest.fixture(scope="module")
def tiny():
    hf = make_tiny_model("llama", seed=3)
    return hf, turbospec.load_model(hf)


def test_greedy_batch_of_16_equals_alone_and_hf(cyc):  # noqa: F811
    hf, target, ref, _ = cyc  # a target whose continuations cycle: n-gram drafts get accepted
    eng = Engine(target, drafter="ngram", max_seq_len=256, max_batch=5)
    prompts = [(PROMPT + ref)[i: i + 4 + 3 * (i % 5)] for i in range(0, 48, 3)]
    reqs = [Request(p, max_new_tokens=8 + 3 * (i % 5), speculate=i % 4 != 3) for i, p in enumerate(prompts)]
    out = eng.generate(reqs)
    assert len(out) == 16
    drafted = 0
    for r, g in zip(reqs, out):
        alone = eng.generate(r.prompt, max_new_tokens=r.max_new_tokens)
        assert g.token_ids == alone.token_ids
        assert g.token_ids == hf_greedy(hf, r.prompt, r.max_new_tokens)
        assert g.finish_reason == "length" and len(g.token_ids) == r.max_new_tokens
        assert g.prompt_token_ids == r.prompt
        drafted += g.stats["tau"] > 1.0
        if not r.speculate:
            assert g.stats["tau"] == 1.0  # speculation off for this request
    assert drafted >= 4  # drafts were accepted inside the batch


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_greedy_batch_with_head_trees_equals_alone(cyc, method):  # noqa: F811
    hf, target, ref, vocab = cyc
    head = make_head(method, target, vocab=vocab)
    eng = engine(target, method, head, vocab=vocab, max_seq_len=256, max_batch=3, num_draft=12, adaptive=False)
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:], PROMPT[:12], PROMPT[2:9]]
    out = eng.generate(prompts, max_new_tokens=N_NEW)
    assert out[0].token_ids == ref
    for p, g in zip(prompts, out):
        assert g.token_ids == eng.generate(p, max_new_tokens=N_NEW).token_ids
    assert out[0].stats["tau"] > 1.05  # tree drafts were accepted inside the batch


def test_seeded_sampling_in_a_batch_equals_alone(tiny):
    _, target = tiny
    eng = Engine(target, drafter="ngram", max_seq_len=256, max_batch=4)
    prompts = prompts_mixed(7, seed=1)
    settings = [dict(temperature=0.8, top_k=0, top_p=1.0), dict(temperature=1.3, top_k=20, top_p=1.0),
                dict(temperature=0.0, top_k=0, top_p=1.0), dict(temperature=1.0, top_k=0, top_p=0.7)]
    reqs = [Request(p, max_new_tokens=16, seed=100 + i, **settings[i % 4]) for i, p in enumerate(prompts)]
    out = eng.generate(reqs)
    for r, g in zip(reqs, out):
        alone = eng.generate(r.prompt, max_new_tokens=16, temperature=r.temperature, top_k=r.top_k,
                             top_p=r.top_p, seed=r.seed)
        assert g.token_ids == alone.token_ids
    # a different seed gives a different sample (the seed is really used)
    other = eng.generate([Request(prompts[0], max_new_tokens=16, seed=999, **settings[0])])[0]
    assert other.token_ids != out[0].token_ids


def test_requests_join_and_leave_between_steps(tiny, monkeypatch):
    _, target = tiny
    eng = Engine(target, drafter="ngram", max_seq_len=256, max_batch=2)
    joins = []
    real = batch_mod.TargetStep.prefill

    def spy(self, slot, ids):
        joins.append(slot)
        return real(self, slot, ids)

    monkeypatch.setattr(batch_mod.TargetStep, "prefill", spy)
    prompts = prompts_mixed(5, seed=2)
    lengths = [3, 20, 5, 9, 2]
    out = eng.generate([Request(p, max_new_tokens=m) for p, m in zip(prompts, lengths)])
    assert [len(g.token_ids) for g in out] == lengths
    assert len(joins) == 5 and set(joins) == {0, 1}  # 5 requests through 2 slots: slots were reused
    for p, m, g in zip(prompts, lengths, out):
        assert g.token_ids == eng.generate(p, max_new_tokens=m).token_ids


def test_batch_eos_ends_each_request_as_alone():
    hf = make_tiny_model("llama", seed=3, eos_token_id=7)
    target = turbospec.load_model(hf)
    eng = Engine(target, drafter="ngram", max_seq_len=256, max_batch=3)
    prompts = prompts_mixed(6, seed=4)
    out = eng.generate(prompts, max_new_tokens=40)
    for p, g in zip(prompts, out):
        alone = eng.generate(p, max_new_tokens=40)
        assert g.token_ids == alone.token_ids and g.finish_reason == alone.finish_reason


def test_batch_text_prompts_and_stop_strings(tiny):
    _, target = tiny
    tok = make_tiny_tokenizer()
    eng = Engine(target, drafter="ngram", tokenizer=tok, max_seq_len=256, max_batch=3)
    texts = [" ".join(f"w{t}" for t in p) for p in prompts_mixed(5, seed=5)]
    free = [eng.generate(t, 24) for t in texts]
    stops = [f"w{g.token_ids[4]}" for g in free]  # a word each continuation reaches
    out = eng.generate([Request(t, stop=s) for t, s in zip(texts, stops)], max_new_tokens=24)
    for t, s, g in zip(texts, stops, out):
        alone = eng.generate(t, 24, stop=s)
        assert g.text == alone.text and g.token_ids == alone.token_ids
        assert g.finish_reason == "stop" and s not in g.text


def test_batch_bad_input_is_named(tiny):
    _, target = tiny
    eng = Engine(target, drafter="ngram", max_seq_len=64, max_batch=2)
    with pytest.raises(ValueError, match="prompt 1: max_new_tokens must be an integer >= 1"):
        eng.generate([[1, 2, 3], Request([4, 5], max_new_tokens=0)], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0: prompt length 3 \\+ max_new_tokens 100"):
        eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=100)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        Engine(target, drafter="ngram", max_batch=0)

    class Mine(turbospec.Drafter):
        def propose(self, tokens, max_tokens, params, generator):
            return None

    shared = Engine(target, drafter=Mine(), max_seq_len=64, max_batch=2)
    with pytest.raises(ValueError, match="a Drafter instance holds one request's state"):
        shared.generate([[1, 2], [3, 4]], max_new_tokens=3)
    # one request at a time through a Drafter instance is fine
    assert len(shared.generate([[1, 2], Request([3, 4], speculate=False)], max_new_tokens=3)) == 2
    # a callable returning a Drafter: one fresh drafter per concurrent request, so batches may draft
    made = []

    def factory():
        made.append(Mine())
        return made[-1]

    eng = Engine(target, drafter=factory, max_seq_len=64, max_batch=2)
    assert len(eng.generate([[1, 2], [3, 4]], max_new_tokens=3)) == 2
    assert len(made) >= 3 and len({id(d) for d in made}) == len(made)  # the solo one + one per slot
    with pytest.raises(TypeError, match="drafter: the callable .* returned int, expected a turbospec Drafter"):
        Engine(target, drafter=lambda: 3)


def test_chunked_prefill_ngram_equals_alone(tiny):
    """prefill_chunk=5 on a random target (attention live: a clobbered partial prompt would show)."""
    _, target = tiny
    eng = Engine(target, drafter="ngram", max_seq_len=256, max_batch=3, adaptive=False)
    chunked_prefill_run(eng, prompts_mixed(3, seed=5)[2] * 3 + PROMPT)


def test_chunked_prefill_eagle3_features(cyc, monkeypatch):  # noqa: F811
    """prefill_chunk=5 with EAGLE-3 (the head reads the target's features of the prompt): the
    features its drafter starts from are, bit for bit, those of the prompt prefilled alone."""
    from turbospec.decode.loop import Sequence
    _, target, ref, vocab = cyc
    eng = engine(target, "eagle3", make_head("eagle3", target, vocab=vocab), vocab=vocab, max_seq_len=256,
                 max_batch=3, num_draft=6, adaptive=False, prefix_cache=0)  # alone: recomputed
    started = {}
    real = Sequence.start

    def spy(self, cache_len, features, cached=0, **kw):
        started.setdefault(tuple(self.ids), []).append((cache_len, features))
        return real(self, cache_len, features, cached, **kw)

    monkeypatch.setattr(Sequence, "start", spy)
    jobs, out = chunked_prefill_run(eng, PROMPT + ref)  # (each request also ran alone: a second start)
    assert all(eng.generation(j, out[j.index]).stats["tau"] > 1.0 for j in (jobs[1], jobs[3]))  # drafts accepted
    for job in jobs:
        (n_a, f_a), (n_b, f_b) = started[tuple(job.seq.ids)]
        assert n_a == n_b == len(job.seq.ids) - 1 and f_a.shape[0] == n_a
        assert torch.equal(f_a, f_b)


def chunked_prefill_run(eng, base):
    """prefill_chunk=5: prompts joining a running batch go in 5 tokens per step (a slot being
    prefilled rides along in the verify pass as a padding row without touching its partial prompt);
    the rows already decoding get tokens at every one of those steps; every output and acceptance
    count equals the request decoded alone."""
    reqs = [Request(base[:6], max_new_tokens=N_NEW), Request(base[:29], max_new_tokens=N_NEW),
            Request(base[2:9], max_new_tokens=6), Request(base[3:26], max_new_tokens=N_NEW)]
    jobs = [eng.job(r, index=i) for i, r in enumerate(reqs)]
    sched = eng.scheduler(prefill_chunk=5)
    sched.add(jobs[0])
    sched.add(jobs[2])
    out = {i: [] for i in range(4)}
    chunked_steps = below = 0
    for step in range(400):
        if step == 2:
            sched.add(jobs[1])  # joins while two decode: 28 prompt tokens in chunks of 5
        if step == 6:
            sched.add(jobs[3])
        if not sched.busy:
            break
        was_prefilling = set(sched.prefilling)
        decoding_before = [s for s in sched.active if s not in sched.prefilling]
        outs = sched.step()
        for o in outs:
            assert o.job.error is None
            out[o.job.index].extend(o.tokens)
        if was_prefilling and decoding_before:
            chunked_steps += 1
            below += min(was_prefilling) < max(decoding_before)  # a partial prompt rode along as padding
            assert len([o for o in outs if o.tokens]) >= len(decoding_before)  # nobody stalled
    assert chunked_steps >= 8 and below >= 1
    for i, r in enumerate(reqs):
        alone = eng.generate(r.prompt, max_new_tokens=r.max_new_tokens)
        assert out[i] == alone.token_ids, i
        assert eng.generation(jobs[i], out[i]).stats["tau"] == alone.stats["tau"], i
    with pytest.raises(ValueError, match="prefill_chunk must be None or an integer >= 1"):
        eng.scheduler(prefill_chunk=0)
    return jobs, out
