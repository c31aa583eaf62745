"""Automatic prefix caching (``model.prefix_cache``): a prompt's cached prefix gives the same bits
as prefilling it again (K/V, the drafter's features, the output), alone, in a batch and with
chunked prefill; a finished request's generated tokens, written by verify passes over trees, are
the bits a prefill of prompt + answer writes, so they are cached too; blocks are shared by prompts
that start the same way and evicted least recently used under the byte budget."""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine, Request
from turbospec.decode.engine import DEFAULTS
from turbospec.model.prefix_cache import PrefixCache
from turbospec.decode.step import TargetStep

from helpers import PROMPT, counting_forwards, engine, hf_greedy, make_head, make_tiny_model, prompts_mixed
from test_engine import OracleDrafter


@pytest.fixture(scope="module")
def tiny():
    hf = make_tiny_model("llama", seed=31)
    return hf, turbospec.load_model(hf)


def _system(n=40, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("features", [None, "final", (0, 1)])
def test_cached_prefix_gives_the_bits_of_a_full_prefill(tiny, features):
    """A second prompt sharing 3 blocks of a first: its slot's K/V and its prompt features equal,
    bit for bit, those of prefilling it whole without a cache; only the uncached tail is computed."""
    _, target = tiny
    sys_ids = _system(50)
    a, b = sys_ids + [7, 8, 9], sys_ids[:48] + [11, 12, 13, 14]
    cached = TargetStep(target, 128, features=features, prefix_cache=PrefixCache(1 << 30))
    plain = TargetStep(target, 128, features=features)
    cached.prefill(0, a)
    with counting_forwards(target) as calls:
        n, f, hit = cached.prefill(0, b)
    assert hit == 48 and calls == [len(b) - 1 - 48]  # 3 blocks of 16 copied, 3 tokens computed
    n_ref, f_ref, hit_ref = plain.prefill(0, b)
    assert n == n_ref and hit_ref == 0
    for t, r in zip(cached.cache.tensors(), plain.cache.tensors()):
        assert torch.equal(t[:, :, :n], r[:, :, :n])
    if features is None:
        assert f is None and f_ref is None
    else:
        assert torch.equal(f, f_ref)


def test_a_partial_last_block_is_reused_by_prompts_that_extend_it(tiny):
    """A prompt's last partial block (4 tokens past 3 full ones) is kept as a leaf: a prompt that
    continues the same text reuses all 52 tokens (bit for bit as a whole prefill), one that leaves
    it inside the partial block reuses the 48 of the full blocks only."""
    _, target = tiny
    a = _system(53, seed=6)
    cached = TargetStep(target, 128, prefix_cache=PrefixCache(1 << 30))
    cached.prefill(0, a)
    assert len(cached.prefix_cache) == 4
    longer = a[:52] + [3, 1, 4, 1, 5]
    n, _, hit = cached.prefill(0, longer)
    assert hit == 52
    plain = TargetStep(target, 128)
    plain.prefill(0, longer)
    for t, r in zip(cached.cache.tensors(), plain.cache.tensors()):
        assert torch.equal(t[:, :, :n], r[:, :, :n])
    assert cached.prefill(0, a[:50] + [9, 9, 9])[2] == 48
    assert cached.prefill(0, a)[2] == 52  # its own leaf, found again (no duplicate stored)
    assert len(cached.prefix_cache) == 4 + 1 + 1  # longer's leaf of 8 tokens past 48, the third prompt's


def test_engine_output_and_stats_with_the_cache(tiny):
    """Turns of a chat (each prompt extends the last one): the same tokens as with the cache off and
    as HF; the stats say how many prompt tokens came from the cache."""
    hf, target = tiny
    sys_ids = _system(60, seed=2)
    on = Engine(target, drafter="ngram", max_seq_len=256)
    off = Engine(target, drafter="ngram", max_seq_len=256, prefix_cache=0)
    prompt = sys_ids
    for turn in range(3):
        g_on, g_off = on.generate(prompt, 16), off.generate(prompt, 16)
        assert g_on.token_ids == g_off.token_ids == hf_greedy(hf, prompt, 16), turn
        assert g_off.stats["cached_prompt_tokens"] == 0
        if turn == 0:
            assert g_on.stats["cached_prompt_tokens"] == 0
        else:
            # the earlier prompt and its answer, its last partial block included (the answer's last
            # token, the next root, is not in the cache)
            assert g_on.stats["cached_prompt_tokens"] == len(last) + 16 - 1, turn
        last = prompt
        prompt = prompt + g_on.token_ids + [5, 6, 7]


def test_eagle3_batch_and_chunked_prefill_with_the_cache(cyc):  # noqa: F811
    """EAGLE-3 reads the prompt's features: requests sharing a system prompt, batched with chunked
    prefill (prefill_chunk=5) and alone, give the same tokens and acceptance as with the cache off."""
    hf, target, ref, vocab = cyc
    head = make_head("eagle3", target, vocab=vocab)
    sys_ids = PROMPT + ref[:20]
    prompts = [sys_ids + p[:5] for p in prompts_mixed(4, seed=7)]
    outs = {}
    for mb in (0, 64):
        eng = engine(target, "eagle3", head, vocab, max_seq_len=256, max_batch=3, num_draft=6, adaptive=False,
                     prefix_cache=mb)
        sched = eng.scheduler(prefill_chunk=5)
        jobs = [eng.job(Request(p, max_new_tokens=12), index=i) for i, p in enumerate(prompts)]
        got = {i: [] for i in range(4)}
        sched.add(jobs[0])
        for step in range(300):
            if step == 1:
                for j in jobs[1:]:
                    sched.add(j)
            if not sched.busy:
                break
            for o in sched.step():
                assert o.job.error is None
                got[o.job.index].extend(o.tokens)
        gens = [eng.generation(j, got[j.index]) for j in jobs]
        alone = [eng.generate(p, 12) for p in prompts]
        outs[mb] = ([g.token_ids for g in gens], [g.stats["tau"] for g in gens],
                    [g.token_ids for g in alone], [g.stats["cached_prompt_tokens"] for g in gens])
    assert outs[64][:3] == outs[0][:3]
    assert outs[0][2] == outs[0][0]
    assert sum(outs[64][3]) >= 3 * 32 and sum(outs[0][3]) == 0  # the later requests reused the system prompt


class _FeatureOracle(OracleDrafter):
    """The oracle tree drafter reading the target's features (as EAGLE does), recording them."""

    def __init__(self, *args, features=None, **kw):
        super().__init__(*args, **kw)
        self.features = features

    def begin(self, prompt_ids, features=None):
        super().begin(prompt_ids)

    def observe(self, tokens, num_accepted, features=None):
        pass


@pytest.mark.parametrize("dtype,static,features", [("float32", False, None), ("float32", True, (0, 1)),
                                                   ("bfloat16", False, "final"), ("bfloat16", True, None)])
def test_generated_tokens_have_the_bits_of_a_prefill(tiny, dtype, static, features):
    """After a generation whose verify passes accepted tree nodes that are not contiguous (compact_kv
    moves them), the slot's K/V of prompt + answer, and the features the steps gave, equal bit for
    bit those of prefilling prompt + answer whole: what makes caching generated tokens exact. Fails
    if a verify pass computed a node's K/V with other numbers than a prefill (or compact_kv moved
    the wrong rows)."""
    hf, target = tiny
    prompt = _system(30, seed=4)
    ref = Engine(target, drafter="none", dtype=dtype, max_seq_len=128, prefix_cache=0).generate(prompt, 24).token_ids
    oracle = _FeatureOracle(len(prompt), ref, tree=True, correct_cycle=[3, 1, 4, 0, 2], features=features)
    eng = Engine(target, drafter=oracle, num_draft=8, adaptive=False, dtype=dtype, max_seq_len=128,
                 static_shapes=static)
    seq, it = eng._run(prompt, False, dict(DEFAULTS, max_new_tokens=24), {})
    out = [t for kept in it for t in kept]
    assert out == ref
    assert seq.steps < 20  # drafts were accepted
    n = min(seq.cache_len, len(seq.tokens))
    assert n == len(prompt) + 24 - 1
    whole = TargetStep(eng.target, 128, features=features)
    n_ref, f_ref, _ = whole.prefill(0, seq.tokens[:n + 1])
    assert n_ref == n
    for t, r in zip(eng.cache.rows(0, 1).tensors(), whole.cache.tensors()):
        assert torch.equal(t[:, :, :n], r[:, :, :n])
    if features is not None:
        assert torch.equal(torch.cat(seq.written_features)[:n], f_ref)


@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])
def test_chat_turns_reuse_the_answer_alone_and_batched(tiny, drafter):
    """The next turn of a chat resends the answer: with the cache on, it is served from the cache
    (alone and through the batch scheduler; with EAGLE-3, the answer's features too), and the output
    equals the cache off and HF."""
    hf, target = tiny
    sys_ids = _system(37, seed=5)
    head = make_head("eagle3", target) if drafter == "eagle3" else None
    for batched in (False, True):
        if head is None:
            on = Engine(target, drafter="ngram", max_seq_len=256)
            off = Engine(target, drafter="ngram", max_seq_len=256, prefix_cache=0)
        else:
            on = engine(target, "eagle3", head, max_seq_len=256, num_draft=6, adaptive=False)
            off = engine(target, "eagle3", head, max_seq_len=256, num_draft=6, adaptive=False, prefix_cache=0)
        prompt = sys_ids
        for turn in range(3):
            if batched:
                g_on, other = on.generate([prompt, sys_ids[:20]], 20)
                g_off, _ = off.generate([prompt, sys_ids[:20]], 20)
            else:
                g_on, g_off = on.generate(prompt, 20), off.generate(prompt, 20)
            assert g_on.token_ids == g_off.token_ids == hf_greedy(hf, prompt, 20), (batched, turn)
            assert g_on.stats["tau"] == g_off.stats["tau"]  # the drafter saw the same features
            if turn:
                assert g_on.stats["cached_prompt_tokens"] == len(last) + 20 - 1, (batched, turn)
            last = prompt
            prompt = prompt + g_on.token_ids + [1, 2]


def test_lru_eviction_under_the_budget(tiny):
    _, target = tiny
    step = TargetStep(target, 256, prefix_cache=PrefixCache(1 << 30))
    step.prefill(0, _system(33))
    per_block = step.prefix_cache.nbytes // 2
    pc = PrefixCache(5 * per_block)
    step = TargetStep(target, 256, prefix_cache=pc)
    a, b = _system(49, seed=1), _system(49, seed=2)
    step.prefill(0, a)  # 3 blocks
    assert len(pc) == 3 and pc.nbytes == 3 * per_block
    step.prefill(0, b)  # 3 more: a's deepest block goes first (its head stays reachable)
    assert len(pc) == 5 and pc.nbytes <= pc.budget_bytes
    assert len(pc.match(a, 48)) == 2 and len(pc.match(b, 48)) == 3
    step.prefill(0, a[:32] + [1] * 17)  # a's head blocks used again: b's tail is evicted next
    assert len(pc.match(a, 48)) == 2
    # a block larger than the whole budget is not kept; nothing breaks
    tiny_pc = PrefixCache(per_block - 1)
    TargetStep(target, 256, prefix_cache=tiny_pc).prefill(0, a)
    assert len(tiny_pc) == 0


def test_bad_settings_are_named(tiny):
    _, target = tiny
    with pytest.raises(ValueError, match=r"prefix_cache must be an integer >= 0 \(MiB"):
        Engine(target, drafter="none", prefix_cache=-1)
    with pytest.raises(ValueError, match="budget_bytes must be an integer >= 0"):
        PrefixCache(1.5)
    with pytest.raises(ValueError, match="block_tokens must be an integer >= 1"):
        PrefixCache(100, block_tokens=0)


def test_a_draft_models_prompt_comes_from_its_own_prefix_cache(tiny):
    """A draft model keeps its prompt K/V in a prefix cache of its own (shared by an engine's
    drafters): a second prompt sharing 3 blocks reads only its tail, its draft cache holds the bits
    of reading it whole, and it drafts the same tokens."""
    from turbospec.drafters.draft_model import DraftModelDrafter
    from turbospec.ops.sampling import SamplingParams
    from turbospec.ops.lockstep import drive
    _, target = tiny
    draft = turbospec.load_model(make_tiny_model("llama", seed=5, num_hidden_layers=1))
    sys_ids = _system(50, seed=9)
    a, b = sys_ids + [7, 8, 9], sys_ids[:48] + [11, 12, 13, 14]
    pc = PrefixCache(1 << 30)
    first = DraftModelDrafter(draft, 128, prefix_cache=pc)
    first.begin(a)
    first.prepare(a)
    cached, plain = DraftModelDrafter(draft, 128, prefix_cache=pc), DraftModelDrafter(draft, 128)
    with counting_forwards(draft) as calls:
        cached.begin(b)
        cached.prepare(b)
    assert calls == [len(b) - 1 - 48] and pc.hits == 48  # 3 blocks copied, the rest read
    plain.begin(b)
    plain.prepare(b)
    n = len(b) - 1
    for t, r in zip(cached.cache.tensors(), plain.cache.tensors()):
        assert torch.equal(t[:, :, :n], r[:, :, :n])
    greedy = SamplingParams()
    d1, d2 = drive([cached.propose_steps(b, 4, greedy, None), plain.propose_steps(b, 4, greedy, None)])
    assert d1.token_ids == d2.token_ids and len(d1.token_ids) == 4


def test_draft_model_chat_turns_with_the_cache(tiny):
    """Chat turns with a separate draft model: the same tokens and the same accepted drafts with the
    prefix caches on and off, equal to HF; the draft model's cache served the earlier turns' prompts
    and answers (kept when a request finishes), with the bits of reading them."""
    hf, target = tiny
    draft = turbospec.load_model(make_tiny_model("llama", seed=5, num_hidden_layers=1))
    kw = dict(drafter="draft_model", draft_model=draft, num_draft=3, adaptive=False, max_seq_len=256)
    on, off = Engine(target, **kw), Engine(target, prefix_cache=0, **kw)
    prompt = _system(40, seed=4)
    earlier_prompts = 0  # tokens of the earlier turns' prompts (all but their last token) a later turn finds
    for turn in range(3):
        if turn:
            earlier_prompts += len(prompt) - 15 - 1
        g_on, g_off = on.generate(prompt, 12), off.generate(prompt, 12)
        assert g_on.token_ids == g_off.token_ids == hf_greedy(hf, prompt, 12), turn
        for key in ("draft_proposed", "draft_accepted", "verify_steps"):
            assert g_on.stats[key] == g_off.stats[key], (turn, key)
        prompt = prompt + g_on.token_ids + [5, 6, 7]
    pc = on.drafter.prefix_cache
    assert pc is not None and off.drafter.prefix_cache is None
    # the later turns read from the cache the earlier turns' prompts and answers, not just the prompts
    # (prompts only: 93 tokens; with the answers 115: at least 8 of each 12-token answer)
    assert pc.hits >= earlier_prompts + 2 * 8, (pc.hits, earlier_prompts)
    # and its draft cache holds the bits of reading that prompt whole
    from turbospec.drafters.draft_model import DraftModelDrafter
    last = prompt[: -(12 + 3)]  # the last turn's prompt
    fresh = DraftModelDrafter(draft, 256)
    fresh.begin(last)
    fresh.prepare(last)
    n = len(last) - 1
    for t, r in zip(on.drafter.cache.tensors(), fresh.cache.tensors()):
        assert torch.equal(t[:, :, :n], r[:, :, :n])
