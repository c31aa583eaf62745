"""``turbospec audit`` / ``turbospec.audit``: passes on the real speculative path (greedy identical,
sampling not rejected, the biased control rejected in the same run); fails when the acceptance rule
is biased or the speculative path changes a greedy token; bad arguments get clear errors."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import turbospec
from turbospec import auditing
from turbospec.decode import loop

from helpers import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# repeats itself: prompt lookup drafts from the first step
REPEATING = [5, 6, 7, 8, 9] * 4 + [5, 6, 7]
GREEDY = [[3, 14, 15, 92, 65, 35, 89, 79], REPEATING, [10, 20, 30, 10, 20, 30, 10]]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", seed=7)


def run(tiny, **kw):
    args = dict(prompts=GREEDY, max_new_tokens=24, sampling_prompt=REPEATING, samples=150, k=2, seed=1,
                max_seq_len=256)
    args.update(kw)
    return turbospec.audit(tiny, "ngram", **args)


def test_real_path_passes(tiny):
    r = run(tiny)
    assert r.greedy.ok and r.greedy.prompts == 3 and r.greedy.tokens_compared == 3 * 24
    s = r.sampling
    assert s.draft_tokens_proposed > 0 and s.draft_tokens_accepted > 0  # drafts took part
    assert not s.rejected, r.table()
    assert s.control_rejected, r.table()  # the test has power here: it rejects the biased rule
    assert r.ok and "RESULT: PASS" in r.table()
    assert len(s.positions) == len(s.control) == 2
    for t in s.positions:  # (the plug-in TV of two finite samples sits above 0 even when equal: null p95)
        assert 0 <= t.tv_ci[0] <= t.tv_ci[1] <= 1 and 0 <= t.tv <= 1 and t.p_value > s.level


def test_biased_acceptance_fails(tiny):
    """The whole speculative arm under the biased rule: the test rejects it, the audit fails."""
    with auditing.biased_acceptance():
        r = run(tiny, greedy=False)
    assert r.sampling.rejected and not r.ok
    assert "RESULT: FAIL" in r.table()
    assert min(t.p_value for t in r.sampling.positions) < 1e-6


def test_greedy_divergence_is_reported(tiny, monkeypatch):
    """A (simulated) bug in the speculative path that changes one token: the first divergence is
    reported with the prompt, the position, both tokens and the target's logits of both."""
    real = loop.Sequence.commit

    def buggy(self, result, verify_seconds=None):
        new = result.tokens
        if self.drafter is not None and self.emitted <= 5 < self.emitted + len(new):
            new = list(new)
            new[5 - self.emitted] = (new[5 - self.emitted] + 1) % 256
        return real(self, result._replace(tokens=new), verify_seconds)

    monkeypatch.setattr(loop.Sequence, "commit", buggy)
    r = run(tiny, sampling=False, prompts=GREEDY[:2])
    assert not r.ok and len(r.greedy.divergences) == 2
    d = r.greedy.divergences[0]
    assert d.prompt_index == 0 and d.position == 5 and d.spec_token == (d.plain_token + 1) % 256
    assert d.plain_logit > d.spec_logit  # greedy picked the plain token: it has the larger logit
    assert "first divergence at token 5" in r.table()


@pytest.mark.parametrize("kw, word", [(dict(k=1), "k must be"), (dict(temperature=0.0), "temperature"),
                                      (dict(top_p=0.0), "top_p"), (dict(samples=5), "samples"),
                                      (dict(alpha=0.7), "alpha"), (dict(prompts=[]), "prompts"),
                                      (dict(greedy=False, sampling=False), "nothing to audit"),
                                      (dict(prompts="/nonexistent.jsonl"), "no such file")])
def test_bad_arguments(tiny, kw, word):
    with pytest.raises((ValueError, FileNotFoundError), match=word):
        run(tiny, **kw)
    with pytest.raises(ValueError, match="drafter"):
        turbospec.audit(tiny, "none")


def test_cli_default_model(smollm2, tmp_path):
    """``turbospec audit`` on the default model with n-gram lookup: table, JSON, exit 0; a bad
    argument exits 2 naming it."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Name three colors.\n\nCount from one to five.\n")
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "turbospec.cli", "audit", "--drafter", "ngram", "--prompts", str(prompts),
                        "--max-new-tokens", "12", "--samples", "80", "--threads", "1", "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "greedy: 2 prompts, 24 tokens compared: identical to plain decoding" in r.stdout
    assert "biased control" in r.stdout and "RESULT: PASS" in r.stdout
    import json
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["sampling"]["samples"] == 80
    bad = subprocess.run([sys.executable, "-m", "turbospec.cli", "audit", "--k", "1"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "k must be" in bad.stderr


def test_engine_options_reach_the_speculative_engine(tiny):
    """``engine_options`` go to the speculative engine (here a refusal proves it: draft_weights with
    n-gram lookup); the audit's own arguments cannot be passed twice."""
    with pytest.raises(ValueError, match="draft_weights='q4_0': drafter='ngram' has no weights"):
        run(tiny, engine_options={"draft_weights": "q4_0"})
    with pytest.raises(ValueError, match="engine_options: 'dtype' is the audit's own argument"):
        run(tiny, engine_options={"dtype": "bfloat16"})
    r = run(tiny, engine_options={"adaptive": False}, sampling=False)
    assert r.greedy.ok


def test_runs_ending_at_eos_count_as_ended():
    """A sampled run may end at EOS before k tokens: "ended" (-1) is a category of the later
    positions, in both arms alike, and the audit still passes."""
    import torch
    probe = make_tiny_model("llama", seed=7)
    with torch.no_grad():
        logits = probe(torch.tensor([REPEATING])).logits[0, -1]
    eos = int(logits.argmax())  # the likeliest first token ends the run
    assert torch.softmax(logits, -1)[eos] > 0.05  # 150 runs: about 14 end at once (P(none) < 1e-3)
    tiny_eos = make_tiny_model("llama", seed=7, eos_token_id=eos)
    r = turbospec.audit(tiny_eos, "ngram", greedy=False, sampling_prompt=REPEATING, samples=150, k=3, seed=2,
                        max_seq_len=256)
    assert r.ok, r.table()
    assert any(t.categories >= 2 for t in r.sampling.positions)


def test_penalties_bias_and_min_p_pass_the_audit(tiny):
    """Sampled with penalties, logit_bias and min_p (each draft judged with its own path counted):
    not rejected, with drafts accepted, while the biased control is rejected in the same run."""
    settings = dict(presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.05, min_p=0.02,
                    logit_bias={6: 0.5, 9: -2.0})
    r = run(tiny, settings=settings)
    s = r.sampling
    assert s.draft_tokens_accepted > 0 and r.greedy.ok
    assert not s.rejected and s.control_rejected, r.table()


def test_a_grammar_passes_the_audit(tiny):
    """Sampling under a grammar (a byte-level tokenizer; drafts from prompt lookup inside the
    grammar's alphabet): the constrained distribution is the same with speculation."""
    from helpers import make_byte_tokenizer
    text = "abcdefabcdefabcdefabcde"
    r = turbospec.audit(tiny, "ngram", prompts=[text], max_new_tokens=12, sampling_prompt=text, samples=150, k=2,
                        seed=3, max_seq_len=256, tokenizer=make_byte_tokenizer(),
                        settings=dict(grammar={"regex": "[a-f]{1,16}x"}))
    s = r.sampling
    assert r.greedy.ok and s.draft_tokens_accepted > 0
    assert not s.rejected and s.control_rejected, r.table()
    with pytest.raises(ValueError, match="settings: 'temperature' is the audit's own argument"):
        run(tiny, settings=dict(temperature=0.5))
