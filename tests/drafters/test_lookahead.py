"""Lookahead decoding (``drafter="lookahead"``): the draft tree (trunk + diagonals + pooled
candidates, within the node budget), the Jacobi step and the n-gram pool, the verify step's
per-node argmax (alone and batched: the target's own greedy token at every node, accepted or not),
and exactness: greedy output equals plain decoding and HF generate alone and batched, seeded
sampling in a batch equals alone, sampling passes the distribution audit (with its biased control
rejected in the same run)."""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine, Request
from turbospec.drafters.base import Drafter
from turbospec.drafters.factory import lookahead_drafter_builder
from turbospec.drafters.lookahead import LookaheadDrafter
from turbospec.ops.sampling import SamplingParams

from helpers import PROMPT, hf_greedy, make_tiny_model, prompts_mixed

GREEDY = SamplingParams(0.0, 0, 1.0)


def paths(d):
    """Each draft node's tokens from the root (node 0) down to it."""
    out = [[]]
    for t, p in zip(d.token_ids, d.parents):
        out.append(out[p] + [t])
    return out[1:]


def check_tree(d, budget):
    assert 1 <= len(d) <= budget and len(d.parents) == len(d)
    assert all(0 <= p <= i for i, p in enumerate(d.parents))  # topological
    ps = paths(d)
    assert len(set(map(tuple, ps))) == len(ps)  # a trie: no two nodes with one context
    assert d.draft_probs is None  # point masses


# ---------------------------------------------------------------------------------------------
# The draft tree and the Jacobi step, in isolation
def test_tree_layout_trunk_and_diagonals():
    """W = 3, N = 3: diagonal 0 hangs off the root, the trunk chains the level-0 guesses of
    diagonals 1 and 2, each diagonal's level 1 hangs off its trunk node."""
    d = LookaheadDrafter(window=3, ngram=3, guesses=2, pool_from_context=False)
    tokens = [1, 2, 3]
    d.diags = {2: [99, 10], 3: [20, 21], 4: [30, 31]}  # by absolute start (the root is at 2)
    draft = d.propose(tokens, 16, GREEDY, None)
    assert draft.token_ids == [10, 20, 21, 30, 31]
    assert draft.parents == [0, 0, 2, 2, 4]
    assert paths(draft) == [[10], [20], [20, 21], [20, 30], [20, 30, 31]]


def test_jacobi_step_pools_ngrams_and_advances_the_window():
    d = LookaheadDrafter(window=3, ngram=3, guesses=2, pool_from_context=False)
    tokens = [1, 2, 3]
    d.diags = {2: [99, 10], 3: [20, 21], 4: [30, 31]}
    d.propose(tokens, 16, GREEDY, None)
    # the target's argmax at root, 10, 20, 21, 30, 31; nothing accepted, the bonus token is 40
    d.observe(tokens + [40], 0, node_argmax=[40, 11, 22, 23, 32, 33])
    assert d.jacobi_ngrams == 3
    # n-grams: (diagonal's first token, its guesses, the target's token after them)
    assert list(d.pool[3]) == [(10, 11)] and list(d.pool[20]) == [(21, 23)] and list(d.pool[30]) == [(31, 33)]
    # each diagonal advanced one Jacobi step (oldest guess out, prediction in), one position on
    assert d.diags[3] == [10, 11] and d.diags[4] == [21, 23] and d.diags[5] == [31, 33]
    # the next proposal: diagonal 0 starts at the new root (40), the pooled n-gram for it is none
    nxt = d.propose(tokens + [40], 16, GREEDY, None)
    assert paths(nxt)[:5] == [[11], [21], [21, 23], [21, 31], [21, 31, 33]]
    # 2 accepted tokens: the window realigns (absolute positions): the diagonal that started 3
    # after the old root, advanced one step, starts at the new root
    d.observe(tokens + [40, 21, 23, 5], 2, node_argmax=[0] * (len(nxt) + 1))
    assert d.jacobi_ngrams == 6 and list(d.pool[40]) == [(11, 0)]
    assert d.diags[6] == [33, 0]
    nxt2 = d.propose(tokens + [40, 21, 23, 5], 16, GREEDY, None)
    assert nxt2.token_ids[0] == 0 and nxt2.parents[0] == 0  # its guess after the root
    # an argmax list that is not this proposal's pass (another length) is not used
    d.observe(tokens + [40, 21, 23, 5, 6], 0, node_argmax=[1, 2])
    assert d.jacobi_ngrams == 6


def test_pool_candidates_are_verified_and_merged():
    d = LookaheadDrafter(window=2, ngram=3, guesses=3, pool_from_context=False)
    tokens = [1, 2, 3]
    d.diags = {2: [99, 10], 3: [20, 21]}
    d._add(3, (10, 12))  # shares node "10" with diagonal 0
    d._add(3, (50, 51))
    draft = d.propose(tokens, 16, GREEDY, None)
    check_tree(draft, 16)
    ps = paths(draft)
    assert [10, 12] in ps and [50, 51] in ps and [10] in ps
    assert len(draft) == 6  # 10, 20, 21 + 12, 50, 51 (10 merged)
    # the pool keeps the latest `guesses` n-grams per first token, re-adding one refreshes it
    for c in ((1, 1), (2, 2), (10, 12)):
        d._add(3, c)
    assert list(d.pool[3]) == [(1, 1), (2, 2), (10, 12)]


@pytest.mark.parametrize("window,ngram,guesses", [(5, 4, 5), (1, 2, 1), (8, 6, 8), (3, 2, 4)])
def test_budget_is_respected_by_shrinking_the_window(window, ngram, guesses):
    d = LookaheadDrafter(window=window, ngram=ngram, guesses=guesses)
    tokens = [5, 6, 7, 8, 9] * 6 + [5, 6, 3, 5, 6, 7, 5, 6, 8]  # several n-grams pooled for 8 and 5
    for budget in list(range(1, 20)) + [40, 63]:
        d.begin(tokens)
        draft = d.propose(tokens, budget, GREEDY, None)
        if draft is None:  # N = 2, W = 1: diagonal 0 is the root alone; no candidate for 8
            assert ngram == 2 and window == 1
            continue
        check_tree(draft, budget)
        pending = d._pending
        fed = pending[2]
        assert fed and fed[0][0] == len(tokens) - 1  # diagonal 0 always advances (root's argmax)
        full = (ngram - 2) + (window - 1) * (ngram - 1)
        if budget >= full + guesses * (ngram - 1):
            assert all(f == ngram - 1 for _, _, f, _ in fed) and len(fed) == window  # the whole window


def test_bad_options_name_the_parameter():
    for kw, word in ((dict(window=0), "window"), (dict(window=2.5), "window"), (dict(ngram=1), "ngram"),
                     (dict(ngram=True), "ngram"), (dict(guesses=0), "guesses"), (dict(window=65), "window"),
                     (dict(pool_from_context="yes"), "pool_from_context")):
        with pytest.raises(ValueError, match=word):
            LookaheadDrafter(**kw)
    with pytest.raises(ValueError, match="not lookahead options"):
        lookahead_drafter_builder({"depth": 3})
    target = turbospec.load_model(make_tiny_model("llama", seed=2))
    with pytest.raises(ValueError, match=r"lookahead ngram .* got 1"):
        Engine(target, drafter="lookahead", tree={"ngram": 1}, max_seq_len=64)


def test_drafters_without_node_argmax_still_work():
    """The base class drops ``node_argmax`` for an observe that does not take it, and refuses a
    drafter that asks for it without taking it."""
    seen = []

    class Plain(Drafter):
        def observe(self, tokens, num_accepted):
            seen.append(num_accepted)

    Plain().observe([1, 2], 0, features=None, node_argmax=[3])
    assert seen == [0]

    class Wrong(Plain):
        wants_node_argmax = True

        def observe(self, tokens, num_accepted):
            pass

    with pytest.raises(TypeError, match="node_argmax"):
        Wrong().observe([1, 2], 0, node_argmax=[3])


# ---------------------------------------------------------------------------------------------
# With a real target
@pytest.fixture(scope="module")
def tiny():
    hf = make_tiny_model("llama", seed=11, num_hidden_layers=2)
    return hf, turbospec.load_model(hf)


@pytest.fixture(scope="module")
def bigram():
    """A target whose next token depends on the current one only (attention outputs zeroed): its
    continuations repeat, Jacobi iteration converges on them."""
    hf = make_tiny_model("llama", seed=1, num_hidden_layers=4)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return hf, turbospec.load_model(hf)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 2 + [5, 6], [3, 14, 15, 92, 65, 35, 89, 79], [10, 20, 30, 10, 20, 30, 10]]
CONFIGS = [({}, 16), ({}, 3), ({"window": 2, "ngram": 2, "guesses": 1}, 8),
           ({"window": 7, "ngram": 5, "guesses": 6, "pool_from_context": False}, 40)]


@pytest.mark.parametrize("tree,nodes", CONFIGS)
def test_greedy_equals_plain_and_hf(tiny, tree, nodes):
    hf, target = tiny
    plain = Engine(target, drafter="none", max_seq_len=256)
    eng = Engine(target, drafter="lookahead", num_draft=nodes, adaptive=False, max_seq_len=256, tree=tree)
    for p in PROMPTS:
        ref = plain.generate(p, 40).token_ids
        assert ref == hf_greedy(hf, p, 40)
        g = eng.generate(p, 40)
        assert g.token_ids == ref
        assert g.stats["draft_proposed"] > 0


def test_greedy_adaptive_budget_equals_plain(tiny):
    _, target = tiny
    plain = Engine(target, drafter="none", max_seq_len=256)
    eng = Engine(target, drafter="lookahead", num_draft=12, max_seq_len=256)
    for p in PROMPTS:
        assert eng.generate(p, 32).token_ids == plain.generate(p, 32).token_ids


class Recording(LookaheadDrafter):
    """Keeps (committed tokens before the step, the draft, the node argmax read back)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log = []

    def propose(self, tokens, max_tokens, params, generator):
        self._ctx = list(tokens)
        self._draft = super().propose(tokens, max_tokens, params, generator)
        return self._draft

    def observe(self, tokens, num_accepted, node_argmax=None):
        if node_argmax is not None and self._pending is not None:
            self.log.append((self._ctx, self._draft, list(node_argmax), num_accepted))
        super().observe(tokens, num_accepted, node_argmax=node_argmax)


def check_node_argmax(hf, log):
    """Every node's argmax read back is the HF model's greedy token after that node's context
    (the committed tokens and the node's path), accepted or not."""
    checked = off_path = 0
    for ctx, draft, amax, n_acc in log:
        ps = [[]] + ([] if draft is None else paths(draft))
        assert len(amax) == len(ps)
        seqs = [ctx + p for p in ps]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        with torch.no_grad():
            logits = hf(ids, attention_mask=(torch.arange(width)[None] < torch.tensor([[len(s)] for s in seqs])
                                             ).long()).logits
        for i, s in enumerate(seqs):
            row = logits[i, len(s) - 1]
            best = int(row.argmax())
            # equal, or a near tie between two kernels' roundings
            assert amax[i] == best or float(row[best] - row[amax[i]]) < 1e-4, (i, amax[i], best)
            checked += 1
            off_path += i > n_acc
    return checked, off_path


def test_node_argmax_is_the_targets_greedy_token_at_every_node(tiny):
    hf, target = tiny
    rec = Recording()
    eng = Engine(target, drafter=rec, num_draft=16, adaptive=False, max_seq_len=256)
    eng.generate(PROMPTS[0], 12)
    checked, off_path = check_node_argmax(hf, rec.log)
    assert checked > 50 and off_path > 30  # rejected nodes too, not just the accepted path


def test_fixed_shape_path(tiny):
    """The fixed-shape verify forward (what CUDA graphs capture; on CPU with static_shapes=True):
    the same output, and the node argmax read back from its padded logits."""
    hf, target = tiny
    rec = Recording()
    eng = Engine(target, drafter=rec, num_draft=16, adaptive=False, max_seq_len=256, static_shapes=True)
    assert eng.generate(PROMPTS[1], 16).token_ids == hf_greedy(hf, PROMPTS[1], 16)
    checked, off_path = check_node_argmax(hf, rec.log)
    assert checked > 50 and off_path > 30


def test_quantized_lm_head_computes_every_row():
    """A GGUF-style quantized LM head on CPU is computed lazily (the accepted path only) for other
    drafters; for lookahead every row is computed, so every node's argmax is the model's own."""
    from turbospec.model import loader
    q8 = loader.load_model(make_tiny_model("llama", seed=5, vocab_size=512), dtype=torch.float32, weights="q8_0")
    if not (q8.lm_head.kernel and q8.lm_head.quantized):
        pytest.skip("no quantized LM-head kernel in this build")
    rec = Recording()
    eng = Engine(q8, drafter=rec, num_draft=16, adaptive=False, max_seq_len=256)
    ref = Engine(q8, drafter="none", max_seq_len=256).generate(PROMPTS[0], 16).token_ids
    assert eng.generate(PROMPTS[0], 16).token_ids == ref
    assert eng.target_step._lazy is not None and eng.target_step._lazy.rows == 0  # never lazy
    with torch.no_grad():  # the node argmax against a plain forward of each node's context
        for ctx, draft, amax, _ in rec.log:
            for i, p in enumerate([[]] + paths(draft)):
                seq = ctx + p
                cache = q8.new_cache(64)
                logits = q8.forward(torch.tensor([seq]), torch.arange(len(seq))[None], cache, 0)
                row = logits[0, -1]
                assert amax[i] == int(row.argmax()) or float(row.max() - row[amax[i]]) < 1e-4


def test_node_argmax_in_a_batch(tiny):
    hf, target = tiny
    made = []

    def build():
        made.append(Recording(window=3))
        return made[-1]

    eng = Engine(target, drafter=build, num_draft=10, adaptive=False, max_seq_len=256, max_batch=3)
    eng.generate(PROMPTS, max_new_tokens=8)
    logs = [entry for d in made for entry in d.log]
    checked, off_path = check_node_argmax(hf, logs)
    assert checked > 50 and off_path > 20


def test_the_pool_fills_and_its_ngrams_are_accepted(bigram):
    """Without the context's n-grams in the pool, every accepted candidate comes from the Jacobi
    iteration; a repetitive target gets them accepted (tau > 1)."""
    hf, target = bigram
    ref = hf_greedy(hf, PROMPT, 40)
    eng = Engine(target, drafter="lookahead", num_draft=16, adaptive=False, max_seq_len=256,
                 tree={"pool_from_context": False})
    g = eng.generate(PROMPT, 40)
    assert g.token_ids == ref
    d = eng.drafter
    assert d.jacobi_ngrams > 40 and d.pool
    assert d.pool_tokens_accepted >= 5, d.pool_tokens_accepted
    assert g.stats["tau"] > 1.5, g.stats["tau"]
    # with the context pooled as well (the default) it is at least as good here
    both = Engine(target, drafter="lookahead", num_draft=16, adaptive=False, max_seq_len=256).generate(PROMPT, 40)
    assert both.token_ids == ref and both.stats["tau"] > 1.5


def test_batched_greedy_equals_alone(tiny, bigram):
    for hf, target in (tiny, bigram):
        plain = Engine(target, drafter="none", max_seq_len=256)
        prompts = PROMPTS + [p[::-1] for p in PROMPTS] + [PROMPT]
        refs = [plain.generate(p, 24).token_ids for p in prompts]
        eng = Engine(target, drafter="lookahead", num_draft=12, max_seq_len=256, max_batch=4, adaptive=False)
        out = eng.generate(prompts, max_new_tokens=24)
        assert [g.token_ids for g in out] == refs
        alone = [eng.generate(p, 24) for p in prompts]
        assert [g.stats["verify_steps"] for g in out] == [g.stats["verify_steps"] for g in alone]
    assert out[-1].token_ids == hf_greedy(hf, PROMPT, 24) and out[-1].stats["tau"] > 1.2


def test_seeded_sampling_in_a_batch_equals_alone(tiny):
    _, target = tiny
    eng = Engine(target, drafter="lookahead", max_seq_len=256, max_batch=3, num_draft=10)
    prompts = prompts_mixed(5, seed=2)
    reqs = [Request(p, max_new_tokens=16, seed=7 + i, temperature=0.9 if i % 3 else 0.0) for i, p in enumerate(prompts)]
    out = eng.generate(reqs)
    for r, g in zip(reqs, out):
        alone = eng.generate(r.prompt, max_new_tokens=16, temperature=r.temperature, seed=r.seed)
        assert g.token_ids == alone.token_ids


def test_sampling_passes_the_audit():
    """The distribution test on the speculative path (and its biased control rejected in the same
    run, so the test had the power to see a wrong rule)."""
    rep = [5, 6, 7, 8, 9] * 4 + [5, 6, 7]
    tiny = make_tiny_model("llama", seed=7)  # tests/test_audit.py's: it continues the repetition often
    r = turbospec.audit(tiny, "lookahead", prompts=[rep, PROMPT], max_new_tokens=24, sampling_prompt=rep,
                        samples=150, k=3, seed=1, max_seq_len=256)
    s = r.sampling
    assert r.greedy.ok and s.draft_tokens_proposed > 0 and s.draft_tokens_accepted > 0
    assert not s.rejected and s.control_rejected, r.table()
