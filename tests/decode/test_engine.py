"""``turbospec.Engine`` end to end: greedy exactness against the same engine without speculation and
against ``transformers`` ``generate`` (tiny random models and SmolLM2-135M), tree drafts, EOS / stop
strings / streaming, sampling, statistics and input validation."""
from __future__ import annotations

import math

import pytest
import torch

import turbospec
from turbospec import Draft, Drafter, Engine, NonFiniteLogitsError
from turbospec.drafters.draft_model import layer_skip_draft
from turbospec.drafters.ngram import NgramDrafter
from turbospec.decode.batch import Request

from helpers import make_head, make_tiny_model, make_tiny_tokenizer


V = 256
REPEAT_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]  # n-gram lookup always finds a match
N_NEW = 40


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      do_sample=False, eos_token_id=eos_token_id,
                      pad_token_id=0 if eos_token_id is None else eos_token_id)
    return out[0, len(prompt):].tolist()


class OracleDrafter(Drafter):
    """Drafts from a known greedy continuation ``reference`` of a prompt of ``prompt_len`` tokens.

    Chain mode: the true continuation as a chain. Tree mode: at each depth a wrong sibling (and,
    when there is room, a wrong grandchild below it) comes first, then the true token, and the true
    path continues under the true token, so the accepted nodes are not contiguous (compact_kv has
    to move their K/V) and greedy verification must skip the wrong branches. With
    ``correct_cycle``, proposal i has only ``correct_cycle[i % len]`` true tokens on its true path,
    then a wrong one (partial acceptance)."""

    def __init__(self, prompt_len: int, reference: list[int], tree: bool, correct_cycle=None):
        self.prompt_len, self.reference, self.tree = prompt_len, reference, tree
        self.correct_cycle = correct_cycle
        self.calls = 0
        self.max_tokens_seen: list[int] = []

    def begin(self, prompt_ids):
        assert len(prompt_ids) == self.prompt_len
        self.calls = 0

    @staticmethod
    def wrong(t: int, d: int) -> int:
        return (t + 1 + d) % V

    def propose(self, tokens, max_tokens, params, generator):
        self.max_tokens_seen.append(max_tokens)
        pos = len(tokens) - self.prompt_len
        assert tokens[self.prompt_len:] == self.reference[:pos], "engine committed a wrong token"
        truth = self.reference[pos:]
        limit = len(truth)
        if self.correct_cycle is not None:
            limit = min(limit, self.correct_cycle[self.calls % len(self.correct_cycle)])
        self.calls += 1
        nodes, parents = [], []
        parent_true, d = 0, 0
        while len(nodes) < max_tokens and d < len(truth):
            tok = truth[d] if d < limit else self.wrong(truth[d], 7)
            if self.tree and len(nodes) + 2 <= max_tokens:
                nodes.append(self.wrong(truth[d], d))
                parents.append(parent_true)
                if len(nodes) >= 3 and len(nodes) + 2 <= max_tokens:  # a deeper wrong branch
                    nodes.append(self.wrong(truth[d], d + 1))
                    parents.append(len(nodes) - 1)
            nodes.append(tok)
            parents.append(parent_true)
            parent_true = len(nodes)
            d += 1
            if d > limit:
                break
        if not nodes:
            return None
        assert len(nodes) <= max_tokens
        return Draft(token_ids=nodes, parents=parents if self.tree else None)


# ------------------------------------------------------------------------------------------------
# Tiny models and their references
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """A 3-layer random Llama (GQA), its turbospec Transformer, and the greedy reference for
    REPEAT_PROMPT computed by transformers."""
    hf = make_tiny_model("llama", seed=3, num_hidden_layers=3)
    target = turbospec.load_model(hf)
    ref = hf_greedy(hf, REPEAT_PROMPT, N_NEW)
    return hf, target, ref


@pytest.fixture(scope="module")
def bigram():
    """A random Llama whose attention outputs are zeroed: each token depends only on the previous
    one, so greedy output cycles and n-gram drafts are accepted."""
    hf = make_tiny_model("llama", seed=1, num_hidden_layers=3)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    target = turbospec.load_model(hf)
    ref = hf_greedy(hf, REPEAT_PROMPT, N_NEW)
    return hf, target, ref


def test_plain_engine_matches_transformers(tiny):
    hf, target, ref = tiny
    g = Engine(target, drafter="none", max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    assert g.token_ids == ref
    assert g.prompt_token_ids == REPEAT_PROMPT
    assert g.finish_reason == "length" and g.text is None
    assert g.stats["verify_steps"] == N_NEW and g.stats["tau"] == 1.0
    # an in-memory transformers model as target gives the same
    assert Engine(hf, drafter="none", max_seq_len=128).generate(REPEAT_PROMPT, N_NEW).token_ids == ref


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("num_draft", [1, 3, 8])
def test_ngram_greedy_exact(tiny, num_draft, adaptive):
    _, target, ref = tiny
    g = Engine(target, drafter="ngram", num_draft=num_draft, adaptive=adaptive,
               max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    assert g.token_ids == ref
    assert g.stats["accept_per_position"][0] is not None  # drafts were proposed (and verified)


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("num_draft", [2, 6])
def test_ngram_greedy_exact_with_acceptance(bigram, num_draft, adaptive):
    _, target, ref = bigram
    plain = Engine(target, drafter="none", max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    g = Engine(target, drafter="ngram", num_draft=num_draft, adaptive=adaptive,
               max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    assert plain.token_ids == ref
    assert g.token_ids == ref
    assert g.stats["accept_per_position"][0] is not None
    if not adaptive:  # (the adaptive budget's choices depend on measured timings)
        assert g.stats["tau"] > 1.3
        assert g.stats["verify_steps"] < N_NEW


@pytest.mark.parametrize("draft", ["separate-llama", "separate-qwen2", "layer-skip-1", "layer-skip-all"])
@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("num_draft", [2, 5])
def test_draft_model_greedy_exact(tiny, draft, adaptive, num_draft):
    _, target, ref = tiny
    if draft == "separate-llama":
        dm = make_tiny_model("llama", seed=9, num_hidden_layers=1)  # a transformers model
    elif draft == "separate-qwen2":
        dm = turbospec.load_model(make_tiny_model("qwen2", seed=10, num_hidden_layers=2))
    else:
        dm = layer_skip_draft(target, 1 if draft == "layer-skip-1" else target.cfg.num_layers)
    eng = Engine(target, drafter="draft_model", draft_model=dm, num_draft=num_draft, adaptive=adaptive,
                 max_seq_len=128)
    g = eng.generate(REPEAT_PROMPT, N_NEW)
    assert g.token_ids == ref
    assert g.stats["accept_per_position"][0] is not None
    if draft == "layer-skip-all":
        # the draft is the target: greedy acceptance is total, every step emits num_draft + 1
        # tokens (fewer only at the end, where drafts are capped by the tokens left)
        assert all(a in (None, 1.0) for a in g.stats["accept_per_position"])
        if not adaptive:
            assert g.stats["verify_steps"] == math.ceil(N_NEW / (num_draft + 1))
    # a second generation on the same engine (cache and drafter state reused) is identical
    assert eng.generate(REPEAT_PROMPT, N_NEW).token_ids == ref


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("num_draft", [2, 5, 8, 13])
def test_tree_drafter_greedy_exact(tiny, num_draft, adaptive):
    """A custom Drafter proposing trees (true continuation on a later branch, wrong tokens on
    earlier ones): exercises build_tree, tree-masked verification and compact_kv in the engine."""
    _, target, ref = tiny
    drafter = OracleDrafter(len(REPEAT_PROMPT), ref, tree=True)
    g = Engine(target, drafter=drafter, num_draft=num_draft, adaptive=adaptive,
               max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    assert g.token_ids == ref
    assert drafter.max_tokens_seen and max(drafter.max_tokens_seen) <= num_draft
    if not adaptive:  # (the adaptive budget's choices depend on measured timings)
        assert g.stats["tau"] > 1.5
        assert g.stats["verify_steps"] < N_NEW


def test_qwen2_target_exact_with_all_drafters():
    hf = make_tiny_model("qwen2", seed=4, num_hidden_layers=2, tie_word_embeddings=True)
    target = turbospec.load_model(hf)
    ref = hf_greedy(hf, REPEAT_PROMPT, 30)
    for kw in (dict(drafter="none"), dict(drafter="ngram"),
               dict(drafter="draft_model", draft_model=layer_skip_draft(target, 1)),
               dict(drafter="draft_model", draft_model=make_tiny_model("qwen2", seed=5, num_hidden_layers=1)),
               dict(drafter=OracleDrafter(len(REPEAT_PROMPT), ref, tree=True))):
        g = Engine(target, num_draft=6, max_seq_len=96, **kw).generate(REPEAT_PROMPT, 30)
        assert g.token_ids == ref, kw["drafter"]


@pytest.mark.parametrize("tree", [True, False])
def test_oracle_with_partial_acceptance_exact(tiny, tree):
    """Drafts that are right for 0..3 tokens then wrong: acceptance stops mid-draft, the target's
    correction is emitted, the rejected entries are overwritten."""
    _, target, ref = tiny
    drafter = OracleDrafter(len(REPEAT_PROMPT), ref, tree=tree, correct_cycle=[0, 3, 1, 2])
    g = Engine(target, drafter=drafter, num_draft=8, adaptive=False,
               max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    assert g.token_ids == ref
    assert 1.0 < g.stats["tau"] < 4.0


@pytest.mark.parametrize("tree", [True, False])
def test_max_new_tokens_reached_mid_accepted_path(tiny, tree):
    """The drafter could extend far beyond max_new_tokens; output stops exactly there."""
    _, target, ref = tiny
    for n in (1, 2, 3, 7, 10, 11):
        drafter = OracleDrafter(len(REPEAT_PROMPT), ref, tree=tree)
        g = Engine(target, drafter=drafter, num_draft=8, adaptive=False,
                   max_seq_len=64).generate(REPEAT_PROMPT, n)
        assert g.token_ids == ref[:n], n
        assert g.finish_reason == "length" and g.stats["new_tokens"] == n
        assert all(k <= n - 1 for k in drafter.max_tokens_seen)


def test_prompt_plus_max_new_tokens_equal_to_max_seq_len_fits(tiny):
    _, target, ref = tiny
    n = 20
    max_seq_len = len(REPEAT_PROMPT) + n
    for drafter in ("none", "ngram", OracleDrafter(len(REPEAT_PROMPT), ref, tree=True)):
        g = Engine(target, drafter=drafter, num_draft=8, max_seq_len=max_seq_len).generate(REPEAT_PROMPT, n)
        assert g.token_ids == ref[:n]
    dm = Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 3), num_draft=8,
                adaptive=False, max_seq_len=max_seq_len)
    assert dm.generate(REPEAT_PROMPT, n).token_ids == ref[:n]


def test_single_token_prompt(tiny):
    hf, target, _ = tiny
    ref = hf_greedy(hf, [42], 12)
    for drafter in ("none", "ngram"):
        assert Engine(target, drafter=drafter, max_seq_len=32).generate([42], 12).token_ids == ref


def test_engine_is_reusable_across_prompts(tiny):
    hf, target, ref = tiny
    other = [3, 1, 4, 1, 5, 9, 2, 6]
    ref_other = hf_greedy(hf, other, 16)
    for drafter in ("ngram", "draft_model"):
        eng = Engine(target, drafter=drafter, draft_model=layer_skip_draft(target, 2), max_seq_len=128)
        assert eng.generate(REPEAT_PROMPT, N_NEW).token_ids == ref
        assert eng.generate(other, 16).token_ids == ref_other
        assert eng.generate(REPEAT_PROMPT, 1).token_ids == ref[:1]
        assert eng.generate(other, 16).token_ids == ref_other
        assert eng.generate(torch.tensor(REPEAT_PROMPT), N_NEW).token_ids == ref  # tensor prompt


# ------------------------------------------------------------------------------------------------
# EOS, stats, sampling
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["none", "ngram", "oracle-chain", "oracle-tree"])
def test_eos_stops_generation(tiny, drafter):
    hf, _, ref = tiny
    j = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])  # first occurrence, mid-output
    eos = ref[j]
    hf_eos = make_tiny_model("llama", seed=3, num_hidden_layers=3, eos_token_id=eos)
    assert hf_greedy(hf_eos, REPEAT_PROMPT, N_NEW, eos_token_id=eos) == ref[: j + 1]
    target = turbospec.load_model(hf_eos)
    if drafter.startswith("oracle"):
        drafter = OracleDrafter(len(REPEAT_PROMPT), ref, tree=drafter.endswith("tree"))
    g = Engine(target, drafter=drafter, num_draft=8, adaptive=False,
               max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    assert g.finish_reason == "eos"
    assert g.token_ids == ref[: j + 1]  # the EOS token is the last one returned
    assert g.stats["new_tokens"] == j + 1 and g.stats["finish_reason"] == "eos"


@pytest.mark.parametrize("drafter", ["none", "ngram", "suffix", "hybrid", "oracle-tree"])
def test_stop_token_ids_end_like_eos(tiny, drafter):
    """stop_token_ids end a generation at the first of them (kept as its last token, finish "eos"),
    with every drafter as without, alone and batched; bad ids are refused naming them."""
    _, target, ref = tiny
    j = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    kw = dict(drafter=OracleDrafter(len(REPEAT_PROMPT), ref, tree=True)) if drafter == "oracle-tree" else \
        dict(drafter=drafter)
    if drafter == "hybrid":  # an EAGLE-3 head and suffix decoding in one tree
        kw["head"] = make_head("eagle3", target, seed=2)
    eng = Engine(target, num_draft=8, adaptive=False, max_seq_len=128, **kw)
    g = eng.generate(REPEAT_PROMPT, N_NEW, stop_token_ids=[ref[j], 255 if ref[j] != 255 else 254])
    assert g.token_ids == ref[: j + 1] and g.finish_reason == "eos"
    assert eng.generate(REPEAT_PROMPT, N_NEW).token_ids == ref  # per request: the next one runs on
    if drafter != "oracle-tree":  # (the oracle holds one request's state)
        b = Engine(target, num_draft=8, adaptive=False, max_seq_len=128, max_batch=2, **kw)
        outs = b.generate([REPEAT_PROMPT, Request(REPEAT_PROMPT, stop_token_ids=None)], N_NEW,
                          stop_token_ids=[ref[j]])
        assert outs[0].token_ids == ref[: j + 1] and outs[1].token_ids == ref[: j + 1]
        outs = b.generate([Request(REPEAT_PROMPT, stop_token_ids=[ref[j]]), REPEAT_PROMPT], N_NEW)
        assert outs[0].token_ids == ref[: j + 1] and outs[1].token_ids == ref
    for bad in ([V], [-1], "5", [1.5]):
        with pytest.raises(ValueError, match="stop_token_ids"):
            eng.generate(REPEAT_PROMPT, 4, stop_token_ids=bad)


def test_eos_from_tokenizer_is_honoured(tiny):
    _, target, ref = tiny
    j = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    tok = make_tiny_tokenizer(eos_token=f"w{ref[j]}")
    g = Engine(target, drafter="ngram", tokenizer=tok, max_seq_len=128).generate(REPEAT_PROMPT, N_NEW)
    assert g.finish_reason == "eos" and g.token_ids == ref[: j + 1]
    assert g.text == tok.decode(ref[:j], skip_special_tokens=True)  # special EOS not in the text


def check_stats(g, num_draft: int, max_new_tokens: int):
    s = g.stats
    assert s["new_tokens"] == len(g.token_ids) <= max_new_tokens
    assert s["prompt_tokens"] == len(g.prompt_token_ids)
    assert s["finish_reason"] == g.finish_reason
    assert 1 <= s["verify_steps"] <= s["new_tokens"]
    assert s["tau"] == pytest.approx(s["new_tokens"] / s["verify_steps"])
    assert 1.0 <= s["tau"] <= num_draft + 1
    assert len(s["accept_per_position"]) == num_draft
    assert all(a is None or 0.0 <= a <= 1.0 for a in s["accept_per_position"])
    for key in ("prefill_s", "draft_s", "verify_s", "total_s"):
        assert s[key] >= 0.0, key
    assert s["prefill_s"] + s["draft_s"] + s["verify_s"] <= s["total_s"] * 1.001 + 1e-6
    assert s["tokens_per_s"] == pytest.approx(s["new_tokens"] / s["total_s"])
    assert s["decode_tokens_per_s"] >= s["tokens_per_s"]


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model"])
def test_stats_consistent(bigram, drafter):
    _, target, _ = bigram
    eng = Engine(target, drafter=drafter, draft_model=layer_skip_draft(target, 2), num_draft=4,
                 max_seq_len=128)
    g = eng.generate(REPEAT_PROMPT, N_NEW)
    check_stats(g, 4, N_NEW)
    if drafter == "none":
        assert g.stats["verify_steps"] == N_NEW
        assert g.stats["accept_per_position"] == [None] * 4
    g = eng.generate(REPEAT_PROMPT, 9, temperature=0.8, seed=1)
    check_stats(g, 4, 9)


def all_drafters(target, ref):
    return {"none": dict(drafter="none"), "ngram": dict(drafter="ngram"),
            "draft_model": dict(drafter="draft_model", draft_model=layer_skip_draft(target, 1)),
            "draft_model_self": dict(drafter="draft_model", draft_model=layer_skip_draft(target, 3)),
            "tree": dict(drafter=OracleDrafter(len(REPEAT_PROMPT), ref, tree=True))}


@pytest.mark.parametrize("which", ["none", "ngram", "draft_model", "draft_model_self", "tree"])
def test_sampling_smoke_and_seed_reproducibility(tiny, which):
    _, target, ref = tiny
    kw = all_drafters(target, ref)[which]
    if which == "tree":  # the oracle asserts greedy commits; sampling leaves its path: use a plain tree
        kw = dict(drafter=TreeOfGuesses())
    eng = Engine(target, num_draft=4, max_seq_len=128, **kw)
    runs = [eng.generate(REPEAT_PROMPT, 24, temperature=0.7, top_p=0.9, seed=s) for s in (1, 1, 2, 3)]
    for g in runs:
        assert len(g.token_ids) == 24 and g.finish_reason == "length"
        assert all(isinstance(t, int) and 0 <= t < V for t in g.token_ids)
        check_stats(g, 4, 24)
    assert runs[0].token_ids == runs[1].token_ids  # same seed, same tokens
    if which != "tree":  # a fresh engine (fresh drafter state) reproduces it too
        fresh = Engine(target, num_draft=4, max_seq_len=128, **all_drafters(target, ref)[which])
        assert fresh.generate(REPEAT_PROMPT, 24, temperature=0.7, top_p=0.9, seed=1).token_ids == runs[0].token_ids
    assert len({tuple(g.token_ids) for g in runs[1:]}) > 1  # different seeds differ
    # temperature > 0 with top_k=1 (or a tiny top_p) is a point mass on the argmax: exactly greedy
    assert eng.generate(REPEAT_PROMPT, N_NEW, temperature=0.9, top_k=1, seed=5).token_ids == ref
    assert eng.generate(REPEAT_PROMPT, N_NEW, temperature=1.3, top_p=1e-6, seed=6).token_ids == ref


class TreeOfGuesses(Drafter):
    """A tree drafter independent of the sampling: node 1 guesses root token + 1; node 2, its
    sibling, starts the continuation of the root token's first occurrence, which goes on below it."""

    def propose(self, tokens, max_tokens, params, generator):
        if max_tokens < 2:
            return None
        a = tokens.index(tokens[-1]) + 1
        cont = tokens[a:a + max_tokens - 1] or [tokens[0]]
        return Draft(token_ids=[(tokens[-1] + 1) % V] + cont, parents=[0, 0] + list(range(2, len(cont) + 1)))


def test_seed_none_sampling_runs(tiny):
    _, target, _ = tiny
    g = Engine(target, drafter="ngram", max_seq_len=128).generate(REPEAT_PROMPT, 8, temperature=1.0)
    assert len(g.token_ids) == 8 and all(0 <= t < V for t in g.token_ids)


# ------------------------------------------------------------------------------------------------
# Non-finite logits
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model"])
def test_nan_logits_raise(drafter, temperature):
    hf = make_tiny_model("llama", seed=21)
    target = turbospec.load_model(hf)
    eng = Engine(target, drafter=drafter, draft_model=layer_skip_draft(target, 1), max_seq_len=64)
    eng.target.norm.fill_(float("nan"))  # the draft shares it too
    with pytest.raises(NonFiniteLogitsError, match="non-finite"):
        eng.generate(REPEAT_PROMPT, 10, temperature=temperature, seed=0)


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_nan_mid_generation_emits_only_good_tokens(drafter):
    """A token whose embedding is NaN: it is emitted (its own logits were fine), then the next
    step's logits are NaN and the stream stops with NonFiniteLogitsError, having yielded exactly
    the clean greedy prefix."""
    hf = make_tiny_model("llama", seed=22)
    target = turbospec.load_model(hf)
    tok = make_tiny_tokenizer()
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ref = Engine(target, drafter="none", max_seq_len=64).generate(prompt, 20).token_ids
    j = next(i for i in range(3, 20) if ref[i] not in ref[:i] + prompt)
    eng = Engine(target, drafter=drafter, tokenizer=tok, max_seq_len=64)
    eng.target.embed[ref[j]] = float("nan")
    pieces = []
    with pytest.raises(NonFiniteLogitsError):
        for piece in eng.stream(prompt, 20, chat=False):
            pieces.append(piece)
    assert "".join(pieces).split() == [f"w{t}" for t in ref[: j + 1]]
    with pytest.raises(NonFiniteLogitsError):
        eng.generate(prompt, 20)


def test_nan_draft_model_does_not_break_generation(tiny):
    """Only the (separate) draft produces NaN: drafting stops, the output is still exact."""
    _, target, ref = tiny
    bad_draft = turbospec.load_model(make_tiny_model("llama", seed=23, num_hidden_layers=1))
    bad_draft.norm.fill_(float("nan"))
    eng = Engine(target, drafter="draft_model", draft_model=bad_draft, max_seq_len=128)
    assert eng.generate(REPEAT_PROMPT, N_NEW).token_ids == ref
    g = eng.generate(REPEAT_PROMPT, 10, temperature=0.7, seed=0)
    assert len(g.token_ids) == 10 and all(0 <= t < V for t in g.token_ids)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tiny):
    _, target, _ = tiny
    return Engine(target, drafter="ngram", tokenizer=make_tiny_tokenizer(), max_seq_len=64)


@pytest.mark.parametrize("prompt", ["", [], torch.tensor([], dtype=torch.int64)])
def test_empty_prompt(tiny_engine, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_engine.generate(prompt, 4)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(temperature=-0.5), r"temperature.*-0\.5"),
    (dict(temperature=float("nan")), r"temperature.*nan"),
    (dict(top_p=0.0), r"top_p.*0\.0"),
    (dict(top_p=1.5), r"top_p.*1\.5"),
    (dict(top_k=-1), r"top_k.*-1"),
    (dict(top_k=2.5), r"top_k.*2\.5"),
    (dict(max_new_tokens=0), r"max_new_tokens.*0"),
    (dict(max_new_tokens=-3), r"max_new_tokens.*-3"),
    (dict(max_new_tokens=2.0), r"max_new_tokens.*2\.0"),
    (dict(stop=""), r"stop"),
    (dict(stop=["ok", 3]), r"stop"),
])
def test_bad_generation_parameters(tiny_engine, kwargs, pattern):
    kw = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        tiny_engine.generate([1, 2, 3], **kw)
    with pytest.raises(ValueError, match=pattern):
        next(tiny_engine.stream([1, 2, 3], **kw))


def test_prompt_too_long_refused_before_any_work(tiny):
    _, target, _ = tiny
    eng = Engine(target, drafter="ngram", max_seq_len=32)
    prompt = list(range(30))
    with pytest.raises(ValueError) as ei:
        eng.generate(prompt, 3)
    msg = str(ei.value)
    assert "30" in msg and "3" in msg and "max_seq_len 32" in msg
    assert all(not t.any() for t in eng.cache.tensors())  # nothing was written to the cache
    with pytest.raises(ValueError, match="max_seq_len 32"):
        eng.generate(list(range(40)), 1)
    assert all(not t.any() for t in eng.cache.tensors())
    assert len(eng.generate(prompt, 2).token_ids) == 2  # 30 + 2 == 32 fits


@pytest.mark.parametrize("bad", [256, 1000, -1])
def test_token_id_out_of_vocab(tiny_engine, bad):
    with pytest.raises(ValueError, match=rf"{bad}.*\[0, 256\)"):
        tiny_engine.generate([1, bad, 3], 4)


def test_text_prompt_needs_tokenizer_and_stream_needs_tokenizer(tiny):
    _, target, _ = tiny
    eng = Engine(target, drafter="none", max_seq_len=32)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.generate("hello", 4)
    with pytest.raises(ValueError, match="tokenizer"):
        next(eng.stream([1, 2], 4))
    with pytest.raises(ValueError, match="tokenizer"):
        eng.generate([1, 2], 4, stop="x")


def test_bad_engine_arguments(tiny):
    _, target, _ = tiny
    with pytest.raises(ValueError, match="drafter 'jacobi'"):
        Engine(target, drafter="jacobi")
    with pytest.raises(ValueError, match="drafter='medusa' needs head="):
        Engine(target, drafter="medusa")
    with pytest.raises(ValueError, match="num_draft.*64"):
        Engine(target, num_draft=64)
    with pytest.raises(ValueError, match="num_draft.*-1"):
        Engine(target, num_draft=-1)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        Engine(target, dtype="int8")
    with pytest.raises(ValueError, match="max_seq_len.*1"):
        Engine(target, max_seq_len=1)
    with pytest.raises(ValueError, match="draft_model"):
        Engine(target, drafter="draft_model")
    assert Engine(target, num_draft=63).num_draft == 63  # the boundary is allowed


def test_draft_model_with_different_vocab_refused(tiny):
    _, target, _ = tiny
    other = make_tiny_model("llama", seed=30, vocab_size=300)
    with pytest.raises(ValueError, match=r"vocab_size 300 != target vocab_size 256"):
        Engine(target, drafter="draft_model", draft_model=other)


def test_draft_tokenizer_different_from_target_refused(tiny):
    _, target, _ = tiny
    tok = make_tiny_tokenizer()
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 1), tokenizer=tok,
               draft_tokenizer=make_tiny_tokenizer(swap=(10, 11)))
    # an equal tokenizer is accepted
    eng = Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 1), tokenizer=tok,
                 draft_tokenizer=make_tiny_tokenizer(), max_seq_len=64)
    assert len(eng.generate([1, 2, 3], 3).token_ids) == 3


def test_layer_skip_draft_bounds(tiny):
    _, target, _ = tiny
    for bad in (0, target.cfg.num_layers + 1):
        with pytest.raises(ValueError, match=f"num_layers.*{bad}"):
            layer_skip_draft(target, bad)


def test_tiny_text_prompt_and_stream(tiny):
    """Text in, text out with a tokenizer (no chat template): stream pieces concatenate to text."""
    _, target, ref = tiny
    tok = make_tiny_tokenizer()
    eng = Engine(target, drafter="ngram", tokenizer=tok, max_seq_len=128)
    text_prompt = " ".join(f"w{t}" for t in REPEAT_PROMPT)
    g = eng.generate(text_prompt, 20)
    assert g.prompt_token_ids == REPEAT_PROMPT and g.token_ids == ref[:20]
    assert g.text == tok.decode(ref[:20])
    assert "".join(eng.stream(text_prompt, 20)) == g.text
    stop = f"w{ref[6]}"
    g = eng.generate(text_prompt, 20, stop=stop)
    assert g.finish_reason == "stop" and stop not in g.text
    assert tok.decode(ref[:20]).startswith(g.text)
    assert "".join(eng.stream(text_prompt, 20, stop=stop)) == g.text


def test_stream_holds_back_possible_stop_prefix_then_flushes(tiny):
    """The output ends with the start of a stop string that never completes: streaming must hold
    that text back while it might still become the stop string, and deliver it at the end."""
    _, target, ref = tiny
    tok = make_tiny_tokenizer()
    eng = Engine(target, drafter="ngram", tokenizer=tok, max_seq_len=128)
    n = 12
    full = tok.decode(ref[:n])
    stop = f"{full.split()[-1]} w999"
    g = eng.generate(REPEAT_PROMPT, n, stop=stop)
    assert g.finish_reason == "length" and g.text == full
    pieces = list(eng.stream(REPEAT_PROMPT, n, stop=stop))
    assert "".join(pieces) == full and len(pieces) > 1


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# ------------------------------------------------------------------------------------------------
SMOL_PROMPTS = {
    "count": ("List the numbers from 1 to 20 separated by commas.", 64),
    "code": ("Write a Python function that returns the sum of a list.", 48),
}


@pytest.fixture(scope="module")
def smol_refs(smollm2, smollm2_hf):
    """prompt name -> (prompt ids, engine greedy ids without speculation, HF greedy ids)."""
    target, tok = smollm2
    plain = Engine(target, drafter="none", tokenizer=tok)
    refs = {}
    for name, (prompt, n) in SMOL_PROMPTS.items():
        g = plain.generate(prompt, n)
        refs[name] = (g.prompt_token_ids, g.token_ids, hf_greedy(smollm2_hf, g.prompt_token_ids, n, 2))
    return refs


def test_smollm2_plain_matches_transformers(smol_refs):
    for name, (_, plain, hf) in smol_refs.items():
        assert plain == hf, name


@pytest.mark.parametrize("name", list(SMOL_PROMPTS))
def test_smollm2_ngram_exact(smollm2, smol_refs, name):
    target, tok = smollm2
    ids, plain, hf = smol_refs[name]
    prompt, n = SMOL_PROMPTS[name]
    adaptive = name != "count"  # fixed draft length on "count", to check acceptance too
    # (on "count", 1-token matches (", " -> the next number's first token) are what repeats)
    drafter = "ngram" if adaptive else NgramDrafter(min_ngram=1)
    g = Engine(target, drafter=drafter, tokenizer=tok, adaptive=adaptive).generate(prompt, n)
    assert g.prompt_token_ids == ids
    assert g.token_ids == plain == hf
    assert g.text == tok.decode(hf, skip_special_tokens=True)
    assert g.stats["accept_per_position"][0] is not None
    if not adaptive:
        assert g.stats["tau"] > 1.2  # "1, 2, 3, ..." is full of repeated n-grams


def test_smollm2_layer_skip_draft_exact(smollm2, smol_refs):
    target, tok = smollm2
    ids, plain, hf = smol_refs["count"]
    eng = Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 8), tokenizer=tok,
                 num_draft=4)
    g = eng.generate(SMOL_PROMPTS["count"][0], SMOL_PROMPTS["count"][1])
    assert g.token_ids == plain == hf
    assert g.stats["accept_per_position"][0] is not None


def test_smollm2_eos(smollm2):
    target, tok = smollm2
    eng = Engine(target, drafter="ngram", tokenizer=tok)
    g = eng.generate("What is the capital of France? Answer in one word.", 64)
    assert g.finish_reason == "eos"
    assert g.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in g.token_ids[:-1]
    assert len(g.token_ids) < 64
    assert "Paris" in g.text and tok.eos_token not in g.text
    assert "".join(eng.stream("What is the capital of France? Answer in one word.", 64)) == g.text


def test_smollm2_stop_strings_and_stream(smollm2, smol_refs):
    target, tok = smollm2
    _, plain, _ = smol_refs["count"]
    full = tok.decode(plain, skip_special_tokens=True)
    assert full.startswith("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11")  # what the cases below rely on
    prompt, n = SMOL_PROMPTS["count"]
    eng = Engine(target, drafter="ngram", tokenizer=tok)
    for stop in ("5,", ["11", "7,"], ", 1"):  # ", 1" first completes across tokens at ", 10"
        stops = [stop] if isinstance(stop, str) else stop
        end = min(full.find(s) for s in stops if s in full)
        g = eng.generate(prompt, n, stop=stop)
        assert g.finish_reason == "stop", stop
        assert g.text == full[:end], stop
        assert all(s not in g.text for s in stops)
        assert g.stats["finish_reason"] == "stop" and "stop_text_end" not in g.stats
        assert tok.decode(g.token_ids).startswith(g.text)
        assert len(g.token_ids) < n
        stats: dict = {}
        assert "".join(eng.stream(prompt, n, stop=stop, stats=stats)) == g.text
        assert stats["finish_reason"] == "stop" and "stop_text_end" not in stats
    # a stop string that never appears changes nothing
    g = eng.generate(prompt, n, stop="zebra")
    assert g.finish_reason == "length" and g.token_ids == plain


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_smollm2_stream_equals_generate(smollm2, drafter):
    target, tok = smollm2
    eng = Engine(target, drafter=drafter, draft_model=layer_skip_draft(target, 8), tokenizer=tok)
    prompt = "Say hello in French, Spanish and German."
    g = eng.generate(prompt, 32)
    stats: dict = {}
    pieces = list(eng.stream(prompt, 32, stats=stats))
    assert len(pieces) > 1 and "".join(pieces) == g.text
    assert stats["new_tokens"] == len(g.token_ids) and stats["finish_reason"] == g.finish_reason
    # sampled streams are reproducible with a seed and match generate with the same seed
    gs = eng.generate(prompt, 24, temperature=0.7, top_p=0.9, seed=7)
    assert "".join(eng.stream(prompt, 24, temperature=0.7, top_p=0.9, seed=7)) == gs.text


def test_smollm2_chat_flag_and_messages(smollm2):
    target, tok = smollm2
    eng = Engine(target, drafter="ngram", tokenizer=tok)
    text = "Hello there"
    assert eng.encode(text, chat=False) == tok.encode(text)
    chat_ids = eng.encode(text)
    assert chat_ids == eng.encode([{"role": "user", "content": text}])
    assert len(chat_ids) > len(tok.encode(text)) and chat_ids != tok.encode(text)


def test_smollm2_draft_tokenizer_mismatch(smollm2, smollm2_dir):
    target, tok = smollm2
    other = turbospec.load_tokenizer(smollm2_dir)
    other.add_tokens(["<definitely-not-in-smollm2>"])
    with pytest.raises(ValueError, match="draft tokenizer differs"):
        Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 2), tokenizer=tok,
               draft_tokenizer=other, max_seq_len=64)
