"""HybridDrafter: a head's tree with a prompt-lookup chain merged in as a trie."""
from __future__ import annotations

import pytest
import torch

from turbospec import Engine
from turbospec import ops
from turbospec.drafters.base import Draft
from turbospec.drafters.hybrid import HybridDrafter, merge_chain

from helpers import N_NEW, PROMPT, engine, hf_greedy, make_head


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
