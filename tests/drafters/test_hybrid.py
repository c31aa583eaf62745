"""HybridDrafter: a head's tree with a prompt-lookup chain merged in as a trie; HeadSuffixDrafter
(drafter="hybrid"): a head's tree and suffix decoding's merged by calibrated confidence."""
from __future__ import annotations

import pytest
import torch

from turbospec import Engine
from turbospec import ops
from turbospec.drafters.base import Draft
from turbospec.drafters.hybrid import Calibration, HeadSuffixDrafter, HybridDrafter, merge_chain, merge_scored
from turbospec.drafters.suffix import SuffixDrafter

from helpers import N_NEW, PROMPT, engine, hf_greedy, make_head, make_tiny_model


def paths(d: Draft) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a draft."""
    parents = d.parents if d.parents is not None else list(range(len(d)))
    out, seq = set(), {0: ()}
    for i, (t, p) in enumerate(zip(d.token_ids, parents)):
        seq[i + 1] = seq[p] + (t,)
        out.add(seq[i + 1])
    return out


def test_merge_chain_shares_prefixes():
    tree = Draft(token_ids=[5, 6, 7, 8], parents=[0, 0, 1, 1])  # 5 -> {7, 8}; 6
    m = merge_chain(tree, [5, 8, 9, 10], 10)
    assert m.token_ids == [5, 6, 7, 8, 9, 10] and m.parents == [0, 0, 1, 1, 4, 5]
    assert paths(m) == paths(tree) | {(5, 8, 9), (5, 8, 9, 10)}
    # a new first token starts a new branch from the root
    m = merge_chain(tree, [1, 2], 10)
    assert m.parents[-2:] == [0, 5] and m.token_ids[-2:] == [1, 2]
    # a chain draft is a tree too; the node budget cuts the merged chain
    m = merge_chain(Draft(token_ids=[3, 4]), [3, 9, 9, 9], 4)
    assert m.token_ids == [3, 4, 9, 9] and m.parents == [0, 1, 1, 3]
    assert merge_chain(None, [], 5) is None
    assert merge_chain(None, [2, 2], 5).parents == [0, 1]
    # the merged tree is valid for build_tree (topological parents)
    ops.build_tree(torch.tensor([[-1] + merge_chain(tree, [5, 8, 9, 10], 10).parents]))


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_hybrid_greedy_exact(cyc, method):  # noqa: F811
    hf, target, ref, vocab = cyc
    eng = engine(target, method, make_head(method, target, seed=5), tree={"ngram": 6}, num_draft=12,
                 adaptive=False)
    assert isinstance(eng.drafter, HybridDrafter) and eng.drafter.name.endswith("+ngram")
    g = eng.generate(PROMPT, N_NEW)
    assert g.token_ids == ref
    # the continuation repeats a token: lookup finds it where the random head does not
    plain_head = engine(target, method, make_head(method, target, seed=5), num_draft=12, adaptive=False)
    lookup = Engine(target, drafter="ngram", num_draft=6, adaptive=False)
    assert g.stats["tau"] > plain_head.generate(PROMPT, N_NEW).stats["tau"]
    assert lookup.generate(PROMPT, N_NEW).stats["tau"] > 1.2 and g.stats["tau"] > 1.2
    # (Each merged tree holds the lookup chain as a path (test_merge_chain), so on the same committed
    # sequence it accepts at least what lookup alone does; over a whole generation the paths differ,
    # so the two taus are not ordered.)
    assert eng.generate(PROMPT[5:], 17).token_ids == hf_greedy(hf, PROMPT[5:], 17)


def test_hybrid_sampling_drafts_with_the_head_alone(cyc):  # noqa: F811
    _, target, _, vocab = cyc
    eng = engine(target, "eagle", make_head("eagle", target, vocab=vocab), vocab, tree={"ngram": 6},
                 num_draft=8, adaptive=False)
    g = eng.generate(PROMPT, 20, temperature=0.8, seed=1)
    assert len(g.token_ids) == 20
    with pytest.raises(ValueError, match="ngram_tokens must be an integer in \\[1, 62\\]"):
        HybridDrafter(eng.drafter.head, ngram_tokens=0)


# ---------------------------------------------------------------------------------------------
# drafter="hybrid": an EAGLE head and suffix decoding in one tree


def test_merge_scored_dedupes_and_keeps_the_likeliest_nodes():
    head = Draft(token_ids=[5, 6, 7, 8], parents=[0, 0, 1, 3], scores=[0.6, 0.3, 0.4, 0.1])  # 5-7-8; 6
    suffix = Draft(token_ids=[5, 7, 9], parents=[0, 1, 2], scores=[0.5, 0.5, 0.5])           # 5-7-9
    m = merge_scored([head, suffix], 10)
    assert paths(m) == paths(head) | paths(suffix)  # the union, the shared prefix 5-7 drafted once
    assert len(m) == 5
    got = dict(zip(sorted(paths(m), key=len), [None] * 5))
    parents = m.parents
    seq = {0: ()}
    for i, (t, p) in enumerate(zip(m.token_ids, parents)):
        seq[i + 1] = seq[p] + (t,)
        got[seq[i + 1]] = m.scores[i]
    # held by both: 1 - (1 - a)(1 - b); held by one: its own score, never above the parent's
    assert got[(5,)] == pytest.approx(1 - 0.4 * 0.5) and got[(5, 7)] == pytest.approx(1 - 0.6 * 0.5)
    assert got[(5, 7, 9)] == pytest.approx(0.5) and got[(5, 7, 8)] == pytest.approx(0.1)
    assert got[(6,)] == pytest.approx(0.3)
    # by depth, siblings best first: the likeliest path is each node's first child
    assert m.token_ids[:2] == [5, 6] and m.token_ids[3:] == [9, 8]
    # the budget keeps the best nodes, ancestor-closed: 5, 5-7, 5-7-9
    m3 = merge_scored([head, suffix], 3)
    assert paths(m3) == {(5,), (5, 7), (5, 7, 9)}
    assert all(p < i + 1 for i, p in enumerate(m3.parents))
    ops.build_tree(torch.tensor([[-1] + m.parents]))
    assert merge_scored([None, None], 4) is None
    with pytest.raises(ValueError, match="Draft.scores"):
        merge_scored([Draft(token_ids=[1])], 4)
    with pytest.raises(ValueError, match="point masses"):
        merge_scored([Draft(token_ids=[1], parents=[0], draft_probs=torch.ones(2, 4), scores=[1.0])], 4)


def test_calibration_learns_how_far_a_source_is_right():
    cal = Calibration({"suffix": 0.5})
    tree = Draft(token_ids=[4, 5, 6], parents=[0, 1, 2], scores=[1.0, 1.0, 1.0])
    keys = [("suffix", 1)] * 3
    assert cal.ratio(("suffix", 1)) == pytest.approx(0.5) and cal.ratio(("head", 1)) == pytest.approx(1.0)
    assert cal.apply(tree, keys).scores == pytest.approx([0.5, 0.25, 0.125])
    for _ in range(20):  # the target always emits the remembered continuation
        cal.record(tree, keys, [4, 5, 6, 7])
    assert cal.ratio(("suffix", 1)) > 0.95
    cal2 = Calibration({"suffix": 0.5})
    for _ in range(20):  # ... or never its first token
        cal2.record(tree, keys, [9, 5])
    assert cal2.ratio(("suffix", 1)) < 0.05
    # a head's conditional probabilities: two children of 0.5 each, the target takes one of them
    head = Draft(token_ids=[1, 2], parents=[0, 0], scores=[0.5, 0.5])
    cal3 = Calibration()
    for _ in range(30):
        cal3.record(head, [("head", 1)] * 2, [1])
    assert cal3.ratio(("head", 1)) == pytest.approx(1.0)  # calibrated: mass 1 drafted, 1 hit a step
    assert cal3.apply(head, [("head", 1)] * 2).scores == pytest.approx([0.5, 0.5])


def _hybrid(target, method, seed=5, **kw):
    return Engine(target, drafter="hybrid", head=make_head(method, target, seed=seed), max_seq_len=256, **kw)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_suffix_greedy_exact_and_at_least_the_better_source(cyc, method):  # noqa: F811
    """Greedy == HF, first and repeated; τ at least the better of the head alone and suffix decoding
    alone on the same requests (a random head: suffix decoding is the better source here, and the
    calibration must learn to trust it over the head's confident wrong guesses)."""
    hf, target, ref, _ = cyc
    kw = dict(num_draft=12, adaptive=False)
    eng = _hybrid(target, method, **kw)
    assert isinstance(eng.drafter, HeadSuffixDrafter) and eng.drafter.name.endswith("+suffix")
    head = engine(target, method, make_head(method, target, seed=5), max_seq_len=256, **kw)
    suffix = Engine(target, drafter="suffix", max_seq_len=256, **kw)
    prompts = [PROMPT, PROMPT[4:], PROMPT]  # the third asks the first again
    taus = {}
    for name, e in (("hybrid", eng), ("head", head), ("suffix", suffix)):
        outs = [e.generate(p, N_NEW) for p in prompts]
        assert [g.token_ids for g in outs] == [hf_greedy(hf, p, N_NEW) for p in prompts], name
        taus[name] = sum(g.stats["new_tokens"] for g in outs) / sum(g.stats["verify_steps"] for g in outs)
    assert taus["hybrid"] >= max(taus["head"], taus["suffix"]) - 1e-9, taus
    assert outs[2].stats["tau"] > 3  # suffix decoding alone: the repeated request from its answer
    assert eng.generate(PROMPT, N_NEW).stats["tau"] >= outs[2].stats["tau"]


def test_head_suffix_skips_the_head_where_the_suffix_tree_fills_the_budget(cyc):  # noqa: F811
    """A request asked again: suffix decoding's remembered answer fills the budget with near-certain
    nodes, so the head is not run for those steps (counted; the default, 0.9), and the output is
    still HF's; with skip_head_at None the head drafts every step; a bad value is named."""
    hf, target, ref, _ = cyc
    kw = dict(num_draft=8, adaptive=False)
    eng = _hybrid(target, "eagle3", **kw)  # the default: 0.9
    always = _hybrid(target, "eagle3", tree={"skip_head_at": None}, **kw)
    for e in (eng, always):
        calls = []
        real = e.drafter.head.propose_steps

        def spy(*a, _real=real, **k):
            calls.append(1)
            return (yield from _real(*a, **k))

        e.drafter.head.propose_steps = spy
        for _ in range(3):  # the first pass, then asked again twice (the calibration learns to trust it)
            assert e.generate(PROMPT, N_NEW).token_ids == ref
        e.calls = len(calls)
    assert eng.drafter.head_skipped > 0 and eng.calls < always.calls
    assert always.drafter.head_skipped == 0
    with pytest.raises(ValueError, match=r"skip_head_at must be None or a number in \(0, 1\], got 1.5"):
        _hybrid(target, "eagle3", tree={"skip_head_at": 1.5})


def test_head_suffix_batched_equals_alone(cyc):  # noqa: F811
    hf, target, ref, _ = cyc
    prompts = [PROMPT, PROMPT[4:], PROMPT[::-1], PROMPT, PROMPT[2:]]
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    eng = _hybrid(target, "eagle3", num_draft=10, adaptive=False, max_batch=3)
    outs = eng.generate(prompts, max_new_tokens=24)
    assert [g.token_ids for g in outs] == refs
    assert max(g.stats["tau"] for g in outs) > 2


def test_head_suffix_sampling_passes_the_audit():
    """Sampling: point-mass merged trees where suffix decoding matches (a repetitive prompt: it always
    does), verified exactly; the distribution test passes and its biased control is rejected."""
    import turbospec
    rep = [5, 6, 7, 8, 9] * 4 + [5, 6, 7]
    tiny = make_tiny_model("llama", seed=7)
    head = make_head("eagle3", turbospec.load_model(tiny), seed=3)
    r = turbospec.audit(tiny, "hybrid", prompts=[rep], max_new_tokens=24, sampling_prompt=rep, samples=150,
                        k=2, seed=1, max_seq_len=256, head=head)
    s = r.sampling
    assert r.greedy.ok and s.draft_tokens_proposed > 0 and s.draft_tokens_accepted > 0
    assert not s.rejected and s.control_rejected, r.table()


def test_head_suffix_bad_options_name_the_parameter(cyc):  # noqa: F811
    _, target, _, _ = cyc
    with pytest.raises(ValueError, match=r"tree options \['ngram'\] are not hybrid options"):
        _hybrid(target, "eagle3", tree={"ngram": 4})
    with pytest.raises(ValueError, match="not suffix options"):
        _hybrid(target, "eagle3", tree={"suffix": {"top_k": 2}})
    with pytest.raises(ValueError, match="tree\\['suffix'\\] must be a dict"):
        _hybrid(target, "eagle3", tree={"suffix": 3})
    with pytest.raises(ValueError, match="needs an eagle or eagle3 head, got a 'medusa' head"):
        Engine(target, drafter="hybrid", head=make_head("medusa", target), max_seq_len=64)
    with pytest.raises(ValueError, match="drafter='hybrid' needs head="):
        Engine(target, drafter="hybrid", max_seq_len=64)
    with pytest.raises(ValueError, match="needs an EAGLE / EAGLE-3 head drafter"):
        HeadSuffixDrafter(SuffixDrafter(), SuffixDrafter())
    eng = _hybrid(target, "eagle3", tree={"depth": 3, "top_k": 2, "suffix": {"depth": 8, "cache_tokens": 1000}})
    assert eng.drafter.head.depth == 3 and eng.drafter.suffix.depth == 8 and eng.drafter.suffix.cache.max_tokens == 1000
