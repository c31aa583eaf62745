"""Suffix decoding (``drafter="suffix"``): the draft tree from counted continuations, the shared cache
across requests with bounded memory (least recently used sequences dropped), and exactness: greedy
output equals plain decoding alone and batched, sampling passes the distribution audit (with its
biased control rejected in the same run)."""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine
from turbospec.drafters.factory import suffix_drafter_builder
from turbospec.drafters.suffix import SuffixCache, SuffixDrafter, build_tree
from turbospec.ops.sampling import SamplingParams

from helpers import make_tiny_model

GREEDY = SamplingParams(0.0, 0, 1.0)


def _check_tree(d, budget):
    assert 1 <= len(d) <= budget and len(d.parents) == len(d)
    assert all(0 <= p <= i for i, p in enumerate(d.parents))  # topological: a parent comes first
    for i, p in enumerate(d.parents):  # no two siblings with the same token
        sibs = [d.token_ids[j] for j, q in enumerate(d.parents) if q == p]
        assert len(sibs) == len(set(sibs)), (i, d)


def test_tree_keeps_the_most_likely_nodes():
    # continuations after the match: 4 5 1 (x2), 4 6, 7
    d = build_tree([[4, 5, 1], [4, 5, 1], [4, 6], [7]], budget=8, min_prob=0.0)
    _check_tree(d, 8)
    # scores: 4 .75, 4-5 .5, 4-5-1 .5, 7 .25, 4-6 .25
    assert d.token_ids == [4, 5, 1, 6, 7] and d.parents == [0, 1, 2, 1, 0]
    d = build_tree([[4, 5, 1], [4, 5, 1], [4, 6], [7]], budget=3, min_prob=0.0)
    assert d.token_ids == [4, 5, 1] and d.parents == [0, 1, 2]
    d = build_tree([[4, 5, 1], [4, 5, 1], [4, 6], [7]], budget=8, min_prob=0.3)
    assert d.token_ids == [4, 5, 1]  # 7 and 6 score 0.25
    assert build_tree([[4]], budget=4, min_prob=0.9).token_ids == [4]
    assert build_tree([[9], [8]], budget=4, min_prob=0.6) is None


def test_drafts_from_its_own_context_and_earlier_requests():
    cache = SuffixCache(max_ngram=4, min_ngram=2)
    a = SuffixDrafter(cache)
    a.begin([1, 2, 3, 4, 5])
    # its own context: "2 3" occurred, followed by 4 5
    d = a.propose([1, 2, 3, 4, 5, 9, 2, 3], 8, GREEDY, None)
    assert d.token_ids[:3] == [4, 5, 9] and d.parents[:3] == [0, 1, 2]
    # another request sees what the first one wrote, the same prompt asked again drafts its answer
    b = SuffixDrafter(cache)
    b.begin([1, 2, 3])
    d = b.propose([1, 2, 3], 8, GREEDY, None)
    assert d.token_ids[:4] == [4, 5, 9, 2]
    # nothing matches
    assert SuffixDrafter(cache).propose([40, 41, 42], 8, GREEDY, None) is None
    assert b.propose([1, 2, 3], 0, GREEDY, None) is None


def test_tree_grows_with_the_match():
    cache = SuffixCache(max_ngram=8, min_ngram=1)
    seq = [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    d = SuffixDrafter(cache, nodes_per_match=2.0, min_prob=0.0)
    d.begin(seq)
    short = d.propose(seq + [20, 1], 16, GREEDY, None)           # 1-token match: 2 nodes
    long_ = d.propose(seq + [20, 1, 2, 3, 4, 5], 16, GREEDY, None)  # 5-token match: 10 nodes
    assert len(short) == 2 and len(long_) == 10


def test_cache_memory_is_bounded_least_recently_used_first():
    cache = SuffixCache(max_tokens=30, max_ngram=3, min_ngram=2)
    s1 = cache.new_sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    s2 = cache.new_sequence([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    # s1 is used (its continuation drafted), so s2 is the least recently used one
    assert cache.continuations([0, 1, 2], 4, 8) == (2, [[3, 4, 5, 6]])
    cache.new_sequence(list(range(21, 36)))  # 35 tokens held > 30: one must go
    assert s2 not in cache.seqs and s1 in cache.seqs and cache.tokens == 25
    assert cache.continuations([0, 11, 12], 4, 8) == (0, [])  # dropped: never proposed
    assert cache.continuations([0, 1, 2], 4, 8)[1] == [[3, 4, 5, 6]]
    # 1,000 sequences pass through: the index is rebuilt whenever dropped sequences' entries pile
    # up, so what it holds stays bounded (3,000 dead entries without the rebuild)
    for k in range(1000):
        cache.new_sequence([1000 + k, 3000 + k, 5000 + k, 7000 + k])
    dead = sum(1 for v in cache.index.values() for sid, _ in v if sid not in cache.seqs)
    assert cache.tokens <= 30 and dead <= 4 * 30 + 1024


def test_bad_options_name_the_parameter():
    for kw, word in ((dict(depth=0), "depth"), (dict(min_prob=1.5), "min_prob"),
                     (dict(max_occurrences=0), "max_occurrences"), (dict(nodes_per_match=0), "nodes_per_match")):
        with pytest.raises(ValueError, match=word):
            SuffixDrafter(**kw)
    with pytest.raises(ValueError, match="min_ngram"):
        SuffixCache(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="not suffix options"):
        suffix_drafter_builder({"top_k": 2})
    with pytest.raises(ValueError, match="max_tokens"):
        suffix_drafter_builder({"cache_tokens": 0})
    cache = SuffixCache()
    sid = cache.new_sequence([1, 2, 3])
    with pytest.raises(ValueError, match="only grows"):
        cache.extend(sid, [1, 9, 3, 4])


# ---------------------------------------------------------------------------------------------
# Exactness with a real target
@pytest.fixture(scope="module")
def target():
    return turbospec.load_model(make_tiny_model("llama", seed=11, num_hidden_layers=2))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 2 + [5, 6], [3, 14, 15, 92, 65, 35, 89, 79], [10, 20, 30, 10, 20, 30, 10]]


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_plain_and_the_repeated_prompt_drafts_its_answer(target, adaptive):
    plain = Engine(target, drafter="none", max_seq_len=256)
    refs = [plain.generate(p, 48).token_ids for p in PROMPTS]
    eng = Engine(target, drafter="suffix", num_draft=16, adaptive=adaptive, max_seq_len=256)
    first = [eng.generate(p, 48) for p in PROMPTS]
    again = [eng.generate(p, 48) for p in PROMPTS]  # the same prompts asked again
    for g, r in zip(first + again, refs + refs):
        assert g.token_ids == r
    if not adaptive:  # the adaptive budget's choices depend on measured timings
        # the second time, the whole answer is in the cache
        taus = [g.stats["tau"] for g in again]
        assert min(taus) >= 3.0, taus
        assert sum(g.stats["tau"] for g in again) > sum(g.stats["tau"] for g in first)


def test_batched_greedy_equals_alone(target):
    plain = Engine(target, drafter="none", max_seq_len=256)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS] + PROMPTS
    refs = [plain.generate(p, 32).token_ids for p in prompts]
    eng = Engine(target, drafter="suffix", num_draft=8, max_seq_len=256, max_batch=4, adaptive=False)
    out = eng.generate(prompts, max_new_tokens=32)
    assert [g.token_ids for g in out] == refs
    assert any(g.stats["tau"] > 1.5 for g in out[-3:])  # the repeats drafted from the earlier ones


def test_sampling_passes_the_audit():
    """The distribution test on the speculative path (and its biased control rejected in the same
    run, so the test had the power to see a wrong rule)."""
    rep = [5, 6, 7, 8, 9] * 4 + [5, 6, 7]
    tiny = make_tiny_model("llama", seed=7)  # tests/test_audit.py's: it continues the repetition often
    r = turbospec.audit(tiny, "suffix", prompts=[rep], max_new_tokens=24, sampling_prompt=rep, samples=150,
                        k=2, seed=1, max_seq_len=256)
    s = r.sampling
    assert r.greedy.ok and s.draft_tokens_proposed > 0 and s.draft_tokens_accepted > 0
    assert not s.rejected and s.control_rejected, r.table()
