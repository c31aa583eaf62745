"""``logprobs`` / ``top_logprobs`` (issue 38 §1): each emitted token's log-probability under the
distribution it was drawn from (greedy: log_softmax of the target's logits; sampling: the log of
``logits_to_probs``, what ``verify`` samples from), exact under speculation:

* fp32 greedy: every token's logprob and its top alternatives == log_softmax of HF's logits from one
  forward over prompt + output (1e-5), and == turbospec's own full forward bit for bit;
* speculative == plain (``drafter="none"``) bit for bit, for every drafter (n-gram, suffix,
  lookahead, draft model, EAGLE / EAGLE-3 / Medusa trees, an oracle tree whose accepted nodes are
  not contiguous, the lazy LM head on a quantized target), alone and in a batch with neighbours;
* seeded sampling (T=0.7, top-p 0.9; and top-k): each logprob == the processed distribution's,
  recomputed from the target's logits of that prefix (turbospec's: exactly; HF's: 1e-4);
* ``stream`` gives the same numbers; bad values are refused naming the field; a request without
  logprobs computes none (the step's device work and its host reads are unchanged)."""
from __future__ import annotations

import math

import pytest
import torch

import turbospec
from turbospec import Engine, Request
from turbospec.decode import batch as batch_mod
from turbospec.decode import step as step_mod
from turbospec.drafters.draft_model import layer_skip_draft
from turbospec.model import loader
from turbospec.ops import reference
from turbospec.ops.sampling import TokenLogprob, check_logprobs

from helpers import N_NEW, PROMPT, engine, make_head, make_tiny_model, make_tiny_tokenizer

from test_engine import OracleDrafter

TOP = 5
SPEC = ["ngram", "suffix", "lookahead", "draft_model", "eagle", "eagle3", "medusa", "hybrid", "oracle_tree"]


def spec_engine(name: str, target, ref: list[int], vocab: list[int], **kw) -> Engine:
    """An engine drafting with ``name`` on a cyclic tiny target (drafts get accepted)."""
    kw = dict(max_seq_len=256, num_draft=8, adaptive=False, **kw)
    if name in ("eagle", "eagle3", "medusa"):
        head = make_head(name, target, vocab=vocab)
        kw["num_draft"] = 12
        return engine(target, name, head, vocab=vocab, **kw)
    if name == "draft_model":
        return Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 2), **kw)
    if name == "hybrid":
        return Engine(target, drafter="hybrid", head=make_head("eagle3", target, vocab=vocab), **dict(kw, num_draft=12))
    if name == "oracle_tree":
        return Engine(target, drafter=OracleDrafter(len(PROMPT), ref, tree=True), **kw)
    return Engine(target, drafter=name, **kw)


def own_logits(target, ids: list[int]) -> torch.Tensor:
    """turbospec's logits [n, V] over ``ids`` in one forward (batch-invariant kernels: the bits each
    token gets when decoded)."""
    cache = target.new_cache(len(ids) + 1)
    with torch.inference_mode():
        return target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache, 0, logits="all")[0]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def check_shape(g, top: int) -> None:
    assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids)
    for e, t in zip(g.logprobs, g.token_ids):
        assert isinstance(e, TokenLogprob) and e.token_id == t and math.isfinite(e.logprob) and e.logprob <= 0
        assert len(e.top) <= top
        lps = [lp for _, lp in e.top]
        assert lps == sorted(lps, reverse=True)


# ------------------------------------------------------------------------------------------------
# greedy: against HF's logits and turbospec's own forward
# ------------------------------------------------------------------------------------------------
def test_greedy_logprobs_equal_hf_log_softmax(cyc):
    hf, target, ref, _ = cyc
    g = Engine(target, drafter="none", max_seq_len=256).generate(PROMPT, N_NEW, logprobs=True, top_logprobs=TOP)
    assert g.token_ids == ref
    check_shape(g, TOP)
    start = len(PROMPT) - 1  # the logits at position start + j predict output token j
    want = torch.log_softmax(hf_logits(hf, PROMPT + ref), -1)[start: start + len(ref)]
    own = torch.log_softmax(own_logits(target, PROMPT + ref), -1)[start: start + len(ref)]
    for j, e in enumerate(g.logprobs):
        assert abs(e.logprob - float(want[j, e.token_id])) < 1e-5, j
        assert e.logprob == float(own[j, e.token_id]), j  # the same bits as a full forward's row
        vals, ids = torch.topk(want[j], TOP)
        assert [t for t, _ in e.top] == ids.tolist(), j
        for (t, lp), v in zip(e.top, vals.tolist()):
            assert abs(lp - v) < 1e-5
        assert e.top[0] == (e.token_id, e.logprob)  # greedy: the token is the likeliest


def test_top_logprobs_zero_and_off(cyc):
    _, target, ref, _ = cyc
    eng = Engine(target, drafter="ngram", max_seq_len=256)
    g = eng.generate(PROMPT, 12, logprobs=True)
    assert len(g.logprobs) == 12 and all(e.top == () for e in g.logprobs)
    with_top = eng.generate(PROMPT, 12, logprobs=True, top_logprobs=20)
    assert [e.logprob for e in with_top.logprobs] == [e.logprob for e in g.logprobs]
    assert all(len(e.top) == 20 for e in with_top.logprobs)
    assert eng.generate(PROMPT, 12).logprobs is None
    assert eng.generate(PROMPT, 12, logprobs=False).logprobs is None


# ------------------------------------------------------------------------------------------------
# speculative == plain, bit for bit
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SPEC)
def test_speculative_equals_plain_bit_for_bit(cyc, name):
    hf, target, ref, vocab = cyc
    plain = Engine(target, drafter="none", max_seq_len=256).generate(PROMPT, N_NEW, logprobs=True, top_logprobs=TOP)
    eng = spec_engine(name, target, ref, vocab)
    g = eng.generate(PROMPT, N_NEW, logprobs=True, top_logprobs=TOP)
    assert g.token_ids == plain.token_ids == ref
    assert g.stats["draft_accepted"] > 0, g.stats  # accepted drafts' and bonus tokens' logprobs are read
    assert g.logprobs == plain.logprobs, name


@pytest.mark.parametrize("name", [n for n in SPEC if n != "oracle_tree"])  # (an instance drafts one request)
def test_speculative_batch_equals_plain_alone(cyc, name):
    """A batch of requests with and without logprobs, joining and leaving: each request's logprobs
    equal plain decoding alone, bit for bit; a request without them gets None."""
    hf, target, ref, vocab = cyc
    plain = Engine(target, drafter="none", max_seq_len=256)
    eng = spec_engine(name, target, ref, vocab, max_batch=3)
    reqs = [Request(PROMPT, N_NEW, logprobs=True, top_logprobs=TOP),
            Request(PROMPT[:9], 20),
            Request(PROMPT[4:], 25, logprobs=True, top_logprobs=2),
            Request(PROMPT[2:], 18, logprobs=True),
            Request(PROMPT[6:], 22, logprobs=True, top_logprobs=TOP, speculate=False)]
    out = eng.generate(reqs)
    assert out[0].token_ids == ref
    assert sum(g.stats["draft_accepted"] for g in out) > 0
    for r, g in zip(reqs, out):
        alone = plain.generate(r.prompt, r.max_new_tokens, logprobs=bool(r.logprobs), top_logprobs=r.top_logprobs or 0)
        assert g.token_ids == alone.token_ids
        assert g.logprobs == alone.logprobs, r
    assert out[1].logprobs is None


def test_lazy_lm_head_logprobs_equal_plain():
    """A quantized LM head on CPU runs lazily over wide trees (only the rows the walk reads): the
    accepted path's rows are exactly those, and the logprobs equal plain decoding's."""
    if not turbospec.ops.has_op("linear"):
        pytest.skip("turbospec._C not built")
    hf = make_tiny_model("llama", seed=1, num_hidden_layers=3, vocab_size=512)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    target = loader.load_model(hf, dtype=torch.float32, weights="q8_0")
    prompt = [5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9]
    plain = Engine(target, drafter="none", max_seq_len=256)
    eng = Engine(target, drafter="eagle", head=make_head("eagle3", target, seed=3), num_draft=24, adaptive=False,
                 tree={"depth": 6, "top_k": 4}, max_seq_len=256)
    for kw in (dict(), dict(temperature=0.7, top_p=0.9, seed=3)):
        g = eng.generate(prompt, 40, logprobs=True, top_logprobs=TOP, **kw)
        check_shape(g, TOP)
        if not kw:
            assert g.logprobs == plain.generate(prompt, 40, logprobs=True, top_logprobs=TOP).logprobs
        else:  # sampled: each logprob is the processed distribution's at its prefix
            logits = own_logits(target, prompt + g.token_ids)[len(prompt) - 1:]
            for j, e in enumerate(g.logprobs):
                p = reference.logits_to_probs(logits[j], 0.7, 0, 0.9)
                assert e.logprob == math.log(float(p[e.token_id])), j
    lazy = eng.target_step._lazy
    assert lazy is not None and lazy.rows > 0
    assert g.stats["tau"] > 1.0


# ------------------------------------------------------------------------------------------------
# sampling: the processed distribution's logprob at the emitted token
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["none", "ngram", "eagle3", "draft_model"])
@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=4)])
def test_sampled_logprobs_are_the_processed_distributions(cyc, name, settings):
    hf, target, ref, vocab = cyc
    eng = Engine(target, drafter="none", max_seq_len=256) if name == "none" else spec_engine(name, target, ref, vocab)
    t, k, p = settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0)
    outs = eng.generate([Request(PROMPT, N_NEW, seed=11, logprobs=True, top_logprobs=TOP, **settings),
                         Request(PROMPT[3:], 20, seed=12, logprobs=True, top_logprobs=TOP, **settings)])
    outs.append(eng.generate(PROMPT[1:], 30, seed=13, logprobs=True, top_logprobs=TOP, **settings))
    prompts = [PROMPT, PROMPT[3:], PROMPT[1:]]
    filtered = 0
    for prompt, g in zip(prompts, outs):
        check_shape(g, TOP)
        ids = prompt + g.token_ids
        own = own_logits(target, ids)[len(prompt) - 1:]
        theirs = hf_logits(hf, ids)[len(prompt) - 1:]
        for j, e in enumerate(g.logprobs):
            probs = reference.logits_to_probs(own[j], t, k, p)
            assert e.logprob == math.log(float(probs[e.token_id])), (j, e)
            hf_probs = reference.logits_to_probs(theirs[j], t, k, p)
            assert abs(e.logprob - math.log(float(hf_probs[e.token_id]))) < 1e-4, j
            kept = int((probs > 0).sum())
            want = torch.topk(probs, min(TOP, kept))
            assert [a for a, _ in e.top] == want.indices.tolist(), j
            assert [lp for _, lp in e.top] == [math.log(v) for v in want.values.tolist()]
            filtered += kept < TOP  # filtered-out tokens (probability 0) are not listed
    if k:
        assert filtered > 0


def test_seeded_sampled_batch_equals_alone(cyc):
    hf, target, ref, vocab = cyc
    eng = spec_engine("ngram", target, ref, vocab, max_batch=2)
    reqs = [Request(PROMPT[i:], 20, temperature=0.8, top_p=0.9, seed=i, logprobs=True, top_logprobs=3)
            for i in range(4)]
    for r, g in zip(reqs, eng.generate(reqs)):
        alone = eng.generate(r.prompt, 20, temperature=0.8, top_p=0.9, seed=r.seed, logprobs=True, top_logprobs=3)
        assert g.token_ids == alone.token_ids and g.logprobs == alone.logprobs


# ------------------------------------------------------------------------------------------------
# stream, stop conditions, validation
# ------------------------------------------------------------------------------------------------
def test_stream_and_cut_tokens(cyc):
    _, target, ref, _ = cyc
    tok = make_tiny_tokenizer()
    eng = Engine(target, drafter="ngram", tokenizer=tok, max_seq_len=256)
    text = " ".join(f"w{t}" for t in PROMPT)
    g = eng.generate(text, 25, chat=False, logprobs=True, top_logprobs=3)
    pieces = list(eng.stream(text, 25, chat=False, logprobs=True, top_logprobs=3))
    assert all(isinstance(p, tuple) for p in pieces)
    assert "".join(p for p, _ in pieces) == g.text
    assert [e for _, lps in pieces for e in lps] == g.logprobs
    assert all(isinstance(p, str) for p in eng.stream(text, 5, chat=False))  # without: text only
    # a stop token cuts the step's tokens, and their logprobs with them
    stop = g.token_ids[7]
    cut = eng.generate(text, 25, chat=False, logprobs=True, stop_token_ids=[stop])
    j = g.token_ids.index(stop)
    assert cut.token_ids == g.token_ids[: j + 1]
    assert [e.logprob for e in cut.logprobs] == [e.logprob for e in g.logprobs[: j + 1]]


@pytest.mark.parametrize("kw, field", [
    (dict(logprobs="yes"), "logprobs"), (dict(logprobs=1), "logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=2.0), "top_logprobs"), (dict(logprobs=True, top_logprobs=True), "top_logprobs"),
    (dict(top_logprobs=3), "top_logprobs"),  # alternatives without logprobs
])
def test_bad_values_are_refused(cyc, kw, field):
    _, target, _, _ = cyc
    eng = Engine(target, drafter="none", max_seq_len=64)
    with pytest.raises(ValueError, match=field):
        eng.generate(PROMPT, 4, **kw)
    with pytest.raises(ValueError, match=f"prompt 1: .*{field}"):
        eng.generate([Request(PROMPT, 4), Request(PROMPT, 4, **kw)])
    with pytest.raises(ValueError, match=field):
        check_logprobs(kw.get("logprobs", False), kw.get("top_logprobs", 0))


# ------------------------------------------------------------------------------------------------
# no extra work when not asked; one host read when asked
# ------------------------------------------------------------------------------------------------
def test_no_logprob_work_when_not_asked(cyc, monkeypatch):
    _, target, ref, vocab = cyc
    calls = []
    real = step_mod.path_logprobs

    def spy(logits, tokens, params, top):
        calls.append(tuple(logits.shape))
        return real(logits, tokens, params, top)
    monkeypatch.setattr(step_mod, "path_logprobs", spy)
    eng = spec_engine("ngram", target, ref, vocab, max_batch=3)
    g = eng.generate(PROMPT, 20)
    assert g.logprobs is None and calls == []
    out = eng.generate([Request(PROMPT, 20), Request(PROMPT[3:], 20, temperature=0.8, seed=1)])
    assert all(o.logprobs is None for o in out) and calls == []
    # asked by one request of a batch: computed for that row only, over its path's rows
    out = eng.generate([Request(PROMPT, 20), Request(PROMPT[3:], 20, logprobs=True)])
    assert out[0].logprobs is None and len(out[1].logprobs) == 20
    steps = out[1].stats["verify_steps"]
    assert len(calls) == steps and all(n <= 9 for n, _ in calls)  # at most num_draft + 1 rows


def test_logprobs_ride_the_steps_one_host_read(cyc, monkeypatch):
    """The step's reads of tensor values (tolist / item / int / float / bool) are the same in number
    with logprobs as without: the logprobs come back in the one read of accept_len."""
    _, target, ref, vocab = cyc
    counts = {"n": 0}
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **kw):
            counts["n"] += 1
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    for batch in (False, True):
        reads = []
        for kw in (dict(), dict(logprobs=True, top_logprobs=TOP)):
            eng = spec_engine("ngram", target, ref, vocab, max_batch=2)
            counts["n"] = 0
            if batch:
                out = eng.generate([Request(PROMPT, N_NEW, **kw), Request(PROMPT[2:], N_NEW, **kw)])
            else:
                out = [eng.generate(PROMPT, N_NEW, **kw)]
            reads.append(counts["n"])
            assert all(g.token_ids[:len(ref)] == ref[:len(g.token_ids)] for g in out[:1])
        assert reads[0] == reads[1], (batch, reads)


def test_fixed_shape_path_equals_plain(cyc):
    """The fixed-shape verify forward (what CUDA graphs capture; on CPU with static_shapes=True)."""
    _, target, ref, vocab = cyc
    plain = Engine(target, drafter="none", max_seq_len=256).generate(PROMPT, N_NEW, logprobs=True, top_logprobs=TOP)
    for name in ("ngram", "eagle3"):
        g = spec_engine(name, target, ref, vocab, static_shapes=True).generate(PROMPT, N_NEW, logprobs=True,
                                                                              top_logprobs=TOP)
        assert g.stats["draft_accepted"] > 0
        assert g.logprobs == plain.logprobs, name


def test_smollm2_gguf_shipped_head_equals_plain_and_hf(smollm2_hf):
    """The default model as users run it: its GGUF's quantized LM head (computed lazily over the
    shipped EAGLE head's trees), a byte-level BPE tokenizer. Speculative == plain bit for bit; ==
    HF's log_softmax within 1e-4; the tokens' bytes make up the text, split characters included."""
    from turbospec.decode.text import TokenPieces
    prompt = "List the numbers from 1 to 20 separated by commas."
    from turbospec.heads.shipped import shipped_heads
    spec = Engine("default", drafter="eagle", head=shipped_heads()["eagle3"], max_seq_len=512, adaptive=False)
    assert spec.target_step._lazy is not None
    g = spec.generate(prompt, 48, logprobs=True, top_logprobs=TOP)
    assert spec.target_step._lazy.rows > 0 and g.stats["tau"] > 1.5
    plain = Engine(spec.target, drafter="none", tokenizer=spec.tokenizer, max_seq_len=512)
    want = plain.generate(prompt, 48, logprobs=True, top_logprobs=TOP)
    assert g.token_ids == want.token_ids and g.logprobs == want.logprobs
    ids = g.prompt_token_ids + g.token_ids
    theirs = torch.log_softmax(hf_logits(smollm2_hf, ids), -1)[len(g.prompt_token_ids) - 1:]
    worst = max(abs(e.logprob - float(theirs[j, e.token_id])) for j, e in enumerate(g.logprobs))
    assert worst < 1e-4, worst
    pieces = TokenPieces(spec.tokenizer)
    assert pieces.byte_level
    for text in (spec.tokenizer.decode(g.token_ids), "naïve 日本語 ✓ <|im_end|>"):
        toks = spec.tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(pieces.bytes(t) for t in toks).decode("utf-8") == text
    split = [t for t in spec.tokenizer.encode("日本語", add_special_tokens=False) if len(pieces.bytes(t)) < 3]
    assert split and all("\ufffd" in pieces.text(t) for t in split)  # part of a character: its bytes
