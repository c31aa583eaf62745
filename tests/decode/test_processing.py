"""Penalties, logit_bias and min_p through the Engine: applied per token along each draft path inside
``verify``, so greedy speculative output equals plain decoding bit for bit and equals a reference
that applies vLLM's rules token by token to transformers' logits; batched equals alone; the
log-probabilities are those of the processed distribution, the same with speculation on and off."""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine, Request
from turbospec.drafters.draft_model import layer_skip_draft

from helpers import PROMPT, engine, make_head, make_tiny_model

SETTINGS = {
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.4),
    "all": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={7: 3.0, 9: -50.0}),
    "bias": dict(logit_bias={5: 8.0, 6: 2.5}),
}


@pytest.fixture
def tiny(cyc):  # noqa: F811 - a target whose greedy continuation cycles: the n-gram drafters are accepted
    return cyc[0], cyc[1]


def reference_greedy(hf, prompt: list[int], n: int, presence_penalty=0.0, frequency_penalty=0.0,
                     repetition_penalty=1.0, logit_bias=None) -> list[int]:
    """Greedy decoding with vLLM's rules applied to transformers' logits one token at a time:
    logit_bias added, repetition penalty over prompt + output tokens (positive / r, negative * r),
    then frequency (x count) and presence (x seen) penalties over output tokens."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1].double()
        for tok, b in (logit_bias or {}).items():
            x[tok] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=x.numel()).double()
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.tensor(ids)] = True
        x = torch.where(seen, torch.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
        x = x - frequency_penalty * counts - presence_penalty * (counts > 0).double()
        t = int(x.argmax())
        out.append(t)
        ids.append(t)
    return out


def _drafters(target, vocab=None):
    return {
        "ngram": dict(drafter="ngram"),
        "suffix": dict(drafter="suffix"),
        "lookahead": dict(drafter="lookahead"),
        "draft_model": dict(drafter="draft_model", draft_model=layer_skip_draft(target, 1)),
    }


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_spec_equals_plain_and_the_reference(tiny, setting):
    hf, target = tiny
    kw = SETTINGS[setting]
    prompt = PROMPT * 2  # repeats: the n-gram drafters propose, the penalties bite
    ref = reference_greedy(hf, prompt, 40, **kw)
    plain = Engine(target, drafter="none", max_seq_len=256).generate(prompt, 40, logprobs=True, **kw)
    assert plain.token_ids == ref
    raw = Engine(target, drafter="none", max_seq_len=256).generate(prompt, 40, logprobs=True)
    assert any(abs(a.logprob - b.logprob) > 1e-4 for a, b in zip(plain.logprobs, raw.logprobs))  # it bites
    accepted = 0
    for name, opts in _drafters(target).items():
        g = Engine(target, max_seq_len=256, num_draft=6, adaptive=False, **opts).generate(prompt, 40, **kw)
        assert g.token_ids == ref, name
        accepted += g.stats["draft_accepted"]
    assert accepted > 0  # drafts were judged under the penalties, not only plain steps


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_head_trees_with_penalties_equal_plain(cyc, method):  # noqa: F811
    """Tree drafts: each node judged with its own path's tokens counted."""
    hf, target, ref, vocab = cyc
    kw = SETTINGS["all"]
    want = Engine(target, drafter="none", max_seq_len=256).generate(PROMPT, 30, **kw)
    eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=12, adaptive=False,
                 max_seq_len=256)
    g = eng.generate(PROMPT, 30, **kw)
    assert g.token_ids == want.token_ids
    assert g.stats["tau"] > 1.0 and eng.generate(PROMPT, 30).stats["tau"] > 1.1  # trees were verified


def test_batch_with_mixed_settings_equals_alone(tiny):
    _, target = tiny
    eng = Engine(target, drafter="ngram", max_seq_len=256, max_batch=4)
    prompts = [PROMPT * 2, PROMPT[3:] * 2, PROMPT[::-1] * 2, PROMPT]
    reqs = [Request(prompts[0], 30, **SETTINGS["presence"]), Request(prompts[1], 30),
            Request(prompts[2], 30, **SETTINGS["all"]), Request(prompts[3], 30, temperature=0.8, seed=3, min_p=0.1)]
    out = eng.generate(reqs)
    for r, g in zip(reqs, out):
        alone = eng.generate(r.prompt, 30, temperature=r.temperature or 0.0, seed=r.seed,
                             presence_penalty=r.presence_penalty or 0.0, frequency_penalty=r.frequency_penalty or 0.0,
                             repetition_penalty=r.repetition_penalty or 1.0, min_p=r.min_p or 0.0,
                             logit_bias=r.logit_bias)
        assert g.token_ids == alone.token_ids
    # the same slot's next request starts from fresh counts
    again = eng.generate([Request(prompts[1], 30, **SETTINGS["presence"]), Request(prompts[0], 30)])
    assert again[0].token_ids == eng.generate(prompts[1], 30, **SETTINGS["presence"]).token_ids
    assert again[1].token_ids == eng.generate(prompts[0], 30).token_ids


def test_logprobs_under_the_processed_distribution(tiny):
    """Greedy with penalties: each token's logprob is the log_softmax of the penalized logits at
    its prefix (the reference), bit for bit the same with speculation on and off."""
    hf, target = tiny
    processing = dict(repetition_penalty=1.05, frequency_penalty=0.05, logit_bias={7: 3.0})  # drafts still accepted
    kw = dict(processing, logprobs=True, top_logprobs=3)
    plain = Engine(target, drafter="none", max_seq_len=256).generate(PROMPT * 2, 20, **kw)
    spec = Engine(target, drafter="ngram", max_seq_len=256, num_draft=6, adaptive=False).generate(PROMPT * 2, 20, **kw)
    assert spec.token_ids == plain.token_ids and spec.stats["tau"] > 1.0
    assert [(a.token_id, a.logprob, a.top) for a in spec.logprobs] == [(a.token_id, a.logprob, a.top)
                                                                          for a in plain.logprobs]
    raw = Engine(target, drafter="none", max_seq_len=256).generate(PROMPT * 2, 20, logprobs=True)
    assert any(abs(a.logprob - b.logprob) > 1e-3 for a, b in zip(plain.logprobs, raw.logprobs))  # really processed
    # against the reference: the first token's processed log_softmax
    with torch.no_grad():
        x = hf(torch.tensor([PROMPT * 2])).logits[0, -1].double()
    x[7] += 3.0
    seen = torch.zeros_like(x, dtype=torch.bool)
    seen[torch.tensor(PROMPT)] = True
    x = torch.where(seen, torch.where(x > 0, x / 1.05, x * 1.05), x)
    assert abs(plain.logprobs[0].logprob - float(torch.log_softmax(x, -1)[plain.token_ids[0]])) < 1e-4


def test_bad_values_are_named(tiny):
    _, target = tiny
    eng = Engine(target, drafter="none", max_seq_len=64)
    for kw, msg in ((dict(presence_penalty=3.0), "presence_penalty must be a number in \\[-2, 2\\]"),
                    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
                    (dict(min_p=1.5), "min_p must be a number in \\[0, 1\\]"),
                    (dict(logit_bias={3: 200}), "logit_bias\\[3\\] must be a number in \\[-100, 100\\]"),
                    (dict(logit_bias={300: 1.0}), "logit_bias: token id 300 is not in the vocabulary \\[0, 256\\)")):
        with pytest.raises(ValueError, match=msg):
            eng.generate(PROMPT, 4, **kw)
        with pytest.raises(ValueError, match="prompt 0: " + msg):
            eng.generate([Request(PROMPT, 4, **kw)])
