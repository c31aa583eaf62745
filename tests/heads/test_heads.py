"""EAGLE (1/2, 3) and Medusa drafters in the Engine: greedy fp32 exactness against the plain engine
and transformers, tree edge cases, the head's own KV rollback, exact sampling (a chi-square test of
the first two emitted tokens against the target's distribution), and bad heads.

Random heads are rarely right, so to exercise accepted paths (compact_kv, gathering the accepted
nodes' features, rolling the head's KV back) the tests use a target whose greedy output cycles
through a few tokens (attention zeroed: each token depends on the previous one only) and restrict
the draft vocabulary to the tokens of that cycle, so a random head's top-k often holds the target's
token; every such test asserts that drafts were actually accepted (tau > 1).
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

import turbospec
from turbospec import Engine
from turbospec.heads.formats import build_head, save_head
from turbospec.heads.config import HeadConfig
from turbospec.heads.layers import init_weights
from turbospec.ops.reference import logits_to_probs

from helpers import N_NEW, PROMPT, engine, hf_greedy, make_head, make_tiny_model


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_exact_with_acceptance(cyc, method, adaptive):
    hf, target, ref, vocab = cyc
    plain = Engine(target, drafter="none").generate(PROMPT, N_NEW).token_ids
    assert plain == ref  # the plain engine equals transformers
    eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=12, adaptive=adaptive)
    g = eng.generate(PROMPT, N_NEW)
    assert g.token_ids == ref
    if not adaptive:
        assert g.stats["tau"] > 1.05, g.stats  # drafts were accepted: the tree paths were exercised
    # the engine is reusable: a second prompt starts from a clean head state
    g2 = eng.generate(PROMPT[5:], 17)
    assert g2.token_ids == hf_greedy(hf, PROMPT[5:], 17)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_greedy_exact_random_head_full_vocab(cyc, method):
    """A random head over the whole vocabulary: nearly everything is rejected; still exact."""
    _, target, ref, _ = cyc
    eng = engine(target, method, make_head(method, target, seed=5), num_draft=10, adaptive=False)
    assert eng.generate(PROMPT, N_NEW).token_ids == ref


@pytest.mark.parametrize("method,num_draft,tree", [
    ("eagle", 1, {}),                               # a single draft node
    ("eagle", 63, {"depth": 8, "top_k": 8}),        # 64 nodes with the root
    ("medusa", 63, {"num_nodes": 63}),
    ("medusa", 1, {}),
    ("eagle3", 63, {"depth": 10, "top_k": 7}),
])
def test_tree_sizes(cyc, method, num_draft, tree):
    _, target, ref, _ = cyc
    kw = {"medusa_num_heads": 5} if method == "medusa" else {}
    eng = engine(target, method, make_head(method, target, **kw), num_draft=num_draft, adaptive=False, tree=tree)
    sizes = []
    orig = eng.drafter.propose

    def spy(*a, **k):
        d = orig(*a, **k)
        sizes.append(0 if d is None else len(d))
        return d
    eng.drafter.propose = spy
    g = eng.generate(PROMPT, 100)  # long enough that the first steps may use all num_draft nodes
    assert g.token_ids == Engine(target, drafter="none").generate(PROMPT, 100).token_ids
    assert g.token_ids[:N_NEW] == ref
    assert max(sizes) == num_draft and all(s <= num_draft for s in sizes)


@pytest.mark.parametrize("num_draft,top_k,want", [
    (16, None, 8), (8, None, 4), (5, None, 2), (2, None, 2), (40, None, 8),  # half the budget, 2-8
    (16, 3, 3), (4, 6, 6),                                                     # an explicit top_k wins
])
def test_top_k_follows_the_node_budget(cyc, monkeypatch, num_draft, top_k, want):
    """tree={"top_k": None} (the default): every expansion draws half the step's node budget of
    children, within [2, 8] (the budget: num_draft, fewer when fewer tokens are left); an explicit
    top_k is kept; the output stays the plain engine's."""
    import turbospec.drafters.eagle as eagle_mod
    from turbospec.drafters.eagle import budget_top_k
    assert [budget_top_k(n) for n in (1, 4, 5, 8, 9, 16, 17, 63)] == [2, 2, 2, 4, 4, 8, 8, 8]
    _, target, ref, vocab = cyc
    seen = []
    orig, orig_greedy = eagle_mod.choose_children, eagle_mod.greedy_children

    def spy(logits, k, params, generator):
        seen.append(k)
        return orig(logits, k, params, generator)

    def spy_greedy(logits, k):  # greedy rounds draw the whole frontier's children in one call
        seen.append(k)
        return orig_greedy(logits, k)
    monkeypatch.setattr(eagle_mod, "choose_children", spy)
    monkeypatch.setattr(eagle_mod, "greedy_children", spy_greedy)
    tree = {} if top_k is None else {"top_k": top_k}
    eng = engine(target, "eagle3", make_head("eagle3", target, vocab=vocab), num_draft=num_draft, adaptive=False,
                 tree=tree)
    assert eng.generate(PROMPT, N_NEW).token_ids == ref
    # the first proposals get the whole budget (the last ones less: fewer tokens left to generate)
    assert seen[0] == want and max(seen) == want, seen
    if top_k is None:
        assert min(seen) < want or num_draft <= 5  # the budget shrank near the end, and top_k with it


def test_eagle_tree_options_refused(cyc):
    _, target, _, vocab = cyc
    for tree, bad in (({"top_k": 0}, "top_k=0"), ({"top_k": 2.5}, "top_k=2.5"), ({"depth": 0}, "depth=0")):
        with pytest.raises(ValueError, match=bad):
            engine(target, "eagle3", make_head("eagle3", target, vocab=vocab), num_draft=8, tree=tree)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_max_new_tokens_mid_path_and_eos_inside_path(cyc, method):
    hf, target, ref, vocab = cyc
    eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=12, adaptive=False)
    for n in (1, 2, 5, 7):
        assert eng.generate(PROMPT, n).token_ids == ref[:n]
    # EOS: a token the greedy continuation reaches after a few steps
    eos = ref[6]
    eng.eos_token_ids = {eos}
    g = eng.generate(PROMPT, N_NEW)
    first = ref.index(eos)
    assert g.token_ids == ref[: first + 1] and g.finish_reason == "eos"
    assert g.token_ids == hf_greedy(hf, PROMPT, N_NEW, eos_token_id=eos)


def test_head_kv_is_rolled_back(cyc):
    """The head's committed KV equals what a fresh head computes from the target's true features
    for the committed tokens: the tree slots of rejected drafts leave no trace."""
    _, target, _, vocab = cyc
    head = make_head("eagle", target, vocab=vocab)
    eng = engine(target, "eagle", head, vocab, num_draft=12, adaptive=False)
    g = eng.generate(PROMPT, 25)
    assert g.stats["tau"] > 1.05
    dr = eng.drafter
    n = dr._cached
    toks = PROMPT + g.token_ids
    cache = target.new_cache(128)
    _, feats = target.forward(torch.tensor([toks[:n]]), torch.arange(n)[None], cache, 0, logits="none",
                              features="final")
    with torch.inference_mode():
        out = head(feats, target.embed[torch.tensor(toks[1:n + 1])][None], torch.arange(n)[None])
        from turbospec.heads.layers import head_cache
        kv = head_cache(head.cfg, 128)
        out2 = head(feats, target.embed[torch.tensor(toks[1:n + 1])][None], torch.arange(n)[None], kv, 0)
    # without a cache: SDPA; over one on CPU: the tree_attention kernel, rounded differently (outputs
    # reach ~70 here; each path is within 3e-4 of a float64 forward)
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5 * float(out.abs().max()))
    torch.testing.assert_close(dr.kv.k[0][:, :, :n], kv.k[0][:, :, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dr.kv.v[0][:, :, :n], kv.v[0][:, :, :n], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Sampling: the first two emitted tokens follow the target exactly
# ------------------------------------------------------------------------------------------------
SMALL_V = 12


@pytest.fixture(scope="module")
def small():
    hf = make_tiny_model("llama", seed=2, num_hidden_layers=2, vocab_size=SMALL_V)
    return turbospec.load_model(hf)


def _target_joint(target, prompt, t, top_p):
    """P(x1, x2 | prompt) under the target's filtered sampling distribution, [V, V]."""
    cache = target.new_cache(64)
    n = len(prompt)
    lg = target.forward(torch.tensor([prompt]), torch.arange(n)[None], cache, 0)[0, -1]
    p1 = logits_to_probs(lg, t, 0, top_p).double()
    joint = torch.zeros(SMALL_V, SMALL_V, dtype=torch.float64)
    for a in range(SMALL_V):
        if p1[a] == 0:
            continue
        c = target.new_cache(64)
        lg2 = target.forward(torch.tensor([prompt + [a]]), torch.arange(n + 1)[None], c, 0)[0, -1]
        joint[a] = p1[a] * logits_to_probs(lg2, t, 0, top_p).double()
    return joint


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    assert obs[exp == 0].sum() == 0, "a sequence of target probability 0 was emitted"
    order = torch.argsort(exp)
    # pool the smallest cells until each pooled cell expects >= 5
    cells_o, cells_e, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        if exp[i] == 0:
            continue
        acc_o += float(obs[i])
        acc_e += float(exp[i])
        if acc_e >= 5:
            cells_o.append(acc_o)
            cells_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        cells_o[-1] += acc_o
        cells_e[-1] += acc_e
    o, e = torch.tensor(cells_o), torch.tensor(cells_e)
    stat = float(((o - e) ** 2 / e).sum())
    return float(chi2.sf(stat, len(cells_o) - 1))


def _sample_counts(eng, prompt, t, top_p, n=2000):
    counts = torch.zeros(SMALL_V, SMALL_V)
    accepted = 0
    gen = torch.Generator().manual_seed(1234)
    for _ in range(n):
        g = eng.generate(prompt, 3, temperature=t, top_p=top_p, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
        counts[g.token_ids[0], g.token_ids[1]] += 1
        accepted += g.stats["verify_steps"] < 3
    return counts, accepted


@pytest.mark.parametrize("method,t,top_p,weights", [
    ("eagle", 0.7, 0.9, "dense"), ("eagle", 1.0, 1.0, "dense"), ("eagle3", 1.0, 0.8, "dense"),
    ("medusa", 0.7, 0.9, "dense"), ("medusa", 1.0, 1.0, "dense"),
    ("eagle3", 0.7, 0.9, "q4_0"), ("medusa", 1.0, 0.8, "q4_0"),  # quantized heads (the CPU default)
    ("eagle3", 1.0, 1.0, "q4_0+int8")])  # ... with int8 activations
def test_sampling_first_two_tokens_follow_target(small, method, t, top_p, weights):
    """2,000 generations of three tokens (at most two drafts per step) with the head drafting a tree; the (x1, x2) counts against
    the exact target joint: chi-square p > 1e-5 (pooled cells, expected >= 5 each). A drafter
    that ignored q (treated drafts as point masses) is shown to fail the same test on its own
    data in tests/ops/test_sampling_stats.py; here the head's q comes from a random head at a
    different temperature than the target's, so acceptance and residual sampling both occur."""
    target = small
    prompt = [1, 5, 7, 2, 9, 4]
    joint = _target_joint(target, prompt, t, top_p)
    # a small init keeps the head's q spread out, so it is often accepted and often rejected
    head = make_head(method, target, seed=11, std=0.05, **({"medusa_num_heads": 3} if method == "medusa" else {}))
    weights, _, acts = weights.partition("+")
    eng = engine(target, method, head, num_draft=8, adaptive=False, draft_weights=weights,
                 draft_activations=acts or "exact",
                 tree={"depth": 3, "top_k": 3} if method != "medusa" else {"num_nodes": 8})
    assert all(lin.quantized == (weights != "dense") for lin in head_linears(eng.drafter))
    assert all(lin.activations == (8 if acts else 0) for lin in head_linears(eng.drafter) if lin.quantized)
    counts, accepted = _sample_counts(eng, prompt, t, top_p)
    p = _chi2_pvalue(counts, joint)
    assert p > 1e-5, p
    assert accepted > 50  # both tokens came from one verify step often enough: acceptance was exercised


def test_sampling_negative_control_drafts_not_drawn_from_q(small, monkeypatch):
    """Power of the test above: a drafter that reports q but picks its children as the top-k of q
    instead of drawing them from q (the reported q is then not the distribution the drafts came
    from) is biased, and the same test must reject it."""
    import turbospec.drafters.eagle as eagle_mod
    from turbospec.ops.sampling import SamplingParams
    target = small
    prompt = [1, 5, 7, 2, 9, 4]
    joint = _target_joint(target, prompt, 1.0, 1.0)
    real = eagle_mod.choose_children

    def topk_but_report_q(logits, k, params, generator):
        idx, lq, q = real(logits, k, params, generator)
        gidx, _, _ = real(logits, k, SamplingParams(), None)  # greedy top-k
        return gidx, torch.log(q[gidx]), q
    monkeypatch.setattr(eagle_mod, "choose_children", topk_but_report_q)
    eng = engine(target, "eagle", make_head("eagle", target, seed=11, std=0.05), num_draft=8, adaptive=False,
                 tree={"depth": 3, "top_k": 3})
    counts, _ = _sample_counts(eng, prompt, 1.0, 1.0)
    assert _chi2_pvalue(counts, joint) <= 1e-5


# ------------------------------------------------------------------------------------------------
# Quantized head weights (draft_weights; "auto" = q4_0 on CPU, the default)
# ------------------------------------------------------------------------------------------------
def head_linears(drafter) -> list:
    """The turbospec ``Linear``s a head drafter computes with: its head copy's (``inference_copy``
    binds each nn.Linear's forward to one) and its draft LM heads."""
    from turbospec.drafters.medusa import MedusaDrafter
    from turbospec.model.transformer import Linear
    module = drafter.heads if isinstance(drafter, MedusaDrafter) else drafter.head
    out = [m.forward.__self__ for m in module.modules() if isinstance(m, torch.nn.Linear)]
    lms = getattr(drafter, "lms", None) or [getattr(drafter, "lm", None)]
    out += [lm.linear for lm in lms if lm is not None]
    assert out and all(isinstance(lin, Linear) for lin in out)
    return out


@pytest.mark.parametrize("weights", [None, "q8_0", "q4_0"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_quantized_head_drafts_exactly(cyc, method, weights):
    """A head whose linears are Q8_0 / Q4_0 blocks (quantized from its float weights) drafts, and
    the output is the plain engine's and transformers' token for token; None is the default, q4_0
    on CPU. (Exact sampling with quantized heads: the chi-square cases above; batch == alone:
    tests/drafters/test_lockstep.py.)"""
    hf, target, ref, vocab = cyc
    head = make_head(method, target, vocab=vocab)
    eng = engine(target, method, head, vocab, num_draft=12, adaptive=False, draft_weights=weights)
    lins = head_linears(eng.drafter)
    want = weights or ("q4_0" if turbospec.kernels_available() else "dense")
    assert eng.drafter.weights == want
    assert all(lin.quantized == (want != "dense") for lin in lins)
    g = eng.generate(PROMPT, N_NEW)
    assert g.token_ids == ref
    assert g.stats["draft_proposed"] > 0


@pytest.mark.parametrize("weights", ["dense", "q4_0"])
def test_medusa_with_its_own_lm_heads_drafts_exactly(cyc, weights):
    """A Medusa checkpoint with per-head LM heads: they draft as ``DraftLMHead``s in the storage
    asked for (the head copy's own LM-head modules are not converted: they are never called)."""
    _, target, ref, _ = cyc
    head = make_head("medusa", target, medusa_num_heads=3)
    torch.manual_seed(7)
    head.lm_heads = torch.nn.ModuleList(torch.nn.Linear(target.cfg.hidden_size, target.cfg.vocab_size, bias=False)
                                        for _ in range(3))
    eng = engine(target, "medusa", head, num_draft=8, adaptive=False, draft_weights=weights)
    assert len(eng.drafter.lms) == 3 and all(lm.linear.quantized == (weights == "q4_0") for lm in eng.drafter.lms)
    assert all(lin.forward.__func__ is torch.nn.Linear.forward for lin in eng.drafter.heads.lm_heads)
    assert eng.drafter.heads.blocks[0][0].linear.forward.__func__ is not torch.nn.Linear.forward
    assert eng.generate(PROMPT, N_NEW).token_ids == ref


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_int8_activation_head_drafts_exactly(cyc, method):
    """draft_activations="int8": a quantized head's linears take int8 activations (blocks in the int8
    kernels' interleaved layout where they hold whole groups of 16 rows); the output is still the
    plain engine's and transformers' token for token."""
    from turbospec.ops import reference
    hf, target, ref, vocab = cyc
    if not turbospec.kernels_available():
        pytest.skip("quantized heads need the CPU kernels")
    head = make_head(method, target, vocab=vocab)
    eng = engine(target, method, head, vocab, num_draft=12, adaptive=False, draft_weights="q4_0",
                 draft_activations="int8")
    assert eng.drafter.activations == "int8"
    lins = head_linears(eng.drafter)
    assert all(lin.activations == 8 for lin in lins if lin.quantized)
    assert any(f == 2002 for lin in lins for f in lin.formats)
    assert all(f in (2, 2002) for lin in lins if lin.quantized for f in lin.formats)
    assert all((f == 2002) == (w.shape[0] % reference.INTERLEAVE_ROWS == 0)
               for lin in lins if lin.quantized for f, w in zip(lin.formats, lin.weights))
    g = eng.generate(PROMPT, N_NEW)
    assert g.token_ids == ref
    assert g.stats["draft_proposed"] > 0


def test_quantized_head_computes_close_to_dense(cyc):
    """The quantized copy is the head's own weights rounded (not a different head): its output
    stays within the rounding of Q8_0 / Q4_0 of the float head's, Q8_0 closer than Q4_0."""
    from turbospec.drafters.tree import inference_copy
    _, target, _, _ = cyc
    head = make_head("eagle3", target, std=0.05)
    torch.manual_seed(3)
    n, h = 5, target.cfg.hidden_size
    feats = torch.randn(1, n, len(head.cfg.feature_layers) * h)
    emb = torch.randn(1, n, h)
    pos = torch.arange(n)[None]
    with torch.inference_mode():
        ref = head.logits(head(feats, emb, pos))
        errs = {}
        for w in ("q8_0", "q4_0"):
            q = inference_copy(head, torch.float32, weights=w)
            out = q.logits(q(feats, emb, pos))
            errs[w] = float((out - ref).norm() / ref.norm())
    assert 0 < errs["q8_0"] < 0.02 and errs["q8_0"] < errs["q4_0"] < 0.2, errs


def test_draft_weights_refusals(cyc):
    """Bad draft_weights get a clear error naming the value; a request that cannot be honoured is
    refused, never ignored."""
    from turbospec.drafters.tree import head_weights
    _, target, _, vocab = cyc
    assert head_weights("dense", "cpu") == "dense" and head_weights("auto", "cuda") == "dense"
    with pytest.raises(ValueError, match="draft_weights 'q5_k'"):
        head_weights("q5_k", "cpu")
    with pytest.raises(ValueError, match="run on CPU only"):
        head_weights("q4_0", "cuda")
    with pytest.raises(ValueError, match=r"draft_weights must be one of .* got 'int4'"):
        Engine(target, drafter="eagle", head=make_head("eagle", target), draft_weights="int4")
    for d in ("ngram", "suffix", "none"):
        with pytest.raises(ValueError, match=f"draft_weights='q4_0': drafter='{d}' has no weights"):
            Engine(target, drafter=d, draft_weights="q4_0")
    # a layer whose inputs are not whole 32-value blocks: refused when asked for, dense under auto
    head = make_head("eagle3", target, vocab=vocab, intermediate_size=48)
    with pytest.raises(ValueError, match=r"draft_weights='q4_0': midlayer\.mlp\.down_proj has K = 48"):
        engine(target, "eagle3", head, draft_weights="q4_0")
    eng = engine(target, "eagle3", head, draft_weights="auto")
    down = eng.drafter.head.midlayer.mlp.down_proj.forward.__self__
    if turbospec.kernels_available():
        assert not down.quantized and eng.drafter.head.midlayer.mlp.up_proj.forward.__self__.quantized
    # int8 activations need quantized weights; a bad value names itself
    with pytest.raises(ValueError, match=r"draft_activations='int8': a head takes int8 activations with quantized "
                                         r"weights only .* got draft_weights='dense'"):
        engine(target, "eagle", make_head("eagle", target), draft_weights="dense", draft_activations="int8")
    with pytest.raises(ValueError, match=r"draft_activations must be 'exact', 'int8' or None"):
        Engine(target, drafter="eagle", head=make_head("eagle", target), draft_activations="int4")


# ------------------------------------------------------------------------------------------------
# Bad heads
# ------------------------------------------------------------------------------------------------
def test_mismatched_head_refused(cyc, tmp_path):
    _, target, _, _ = cyc
    bad_hidden = HeadConfig.for_target("eagle", target.cfg, hidden_size=32, num_heads=2, num_kv_heads=1,
                                       head_dim=16)
    save_head(build_head(bad_hidden), str(tmp_path / "h"))
    with pytest.raises(ValueError, match="hidden_size 32"):
        Engine(target, drafter="eagle", head=str(tmp_path / "h"))
    bad_vocab = HeadConfig.for_target("medusa", target.cfg, vocab_size=999)
    with pytest.raises(ValueError, match="vocab"):
        Engine(target, drafter="medusa", head=build_head(bad_vocab))
    with pytest.raises(ValueError, match="needs head="):
        Engine(target, drafter="eagle")
    with pytest.raises(ValueError, match="needs a eagle or eagle3 head"):
        Engine(target, drafter="eagle", head=build_head(HeadConfig.for_target("medusa", target.cfg)))
    with pytest.raises(ValueError, match="not eagle options"):
        Engine(target, drafter="eagle", head=build_head(HeadConfig.for_target("eagle", target.cfg)),
               tree={"choices": [[0]]})
    with pytest.raises(ValueError, match="has no parent"):
        Engine(target, drafter="medusa", head=build_head(HeadConfig.for_target("medusa", target.cfg)),
               tree={"choices": [[0], [1, 0]]})
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text('{"turbospec_head": {"method": "eagle"}}')
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"corrupt.config\.json: invalid turbospec head config"):
        Engine(target, drafter="eagle", head=str(tmp_path / "corrupt"))
    # a valid config beside weights that are junk, or cut short: ValueError naming the weights file
    good = tmp_path / "good"
    save_head(build_head(HeadConfig.for_target("eagle", target.cfg)), str(good))
    whole = (good / "model.safetensors").read_bytes()
    for junk in (b"not a safetensors file", whole[:100], whole[: len(whole) // 2]):
        (good / "model.safetensors").write_bytes(junk)
        with pytest.raises(ValueError, match=r"model\.safetensors: cannot read this safetensors weights file"):
            Engine(target, drafter="eagle", head=str(good))


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M with random heads (fp32 greedy exactness on the real model) and the CLI
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_smollm2_random_heads_exact(smollm2, method):
    smollm2, tok = smollm2
    plain = Engine(smollm2, drafter="none", tokenizer=tok, max_seq_len=256)
    ids = plain.encode("Write a haiku about a lighthouse.")
    ref = plain.generate(ids, 24).token_ids
    kw = {"draft_vocab_size": 2048} if method == "eagle3" else {}
    head = build_head(HeadConfig.for_target(method, smollm2.cfg, **kw))
    init_weights(head, 0.02)
    tree = {} if method == "eagle3" else {"draft_vocab": list(range(2048))}
    eng = Engine(smollm2, drafter="medusa" if method == "medusa" else "eagle", head=head, tree=tree,
                 num_draft=10, adaptive=False, max_seq_len=256)
    assert eng.generate(ids, 24).token_ids == ref


def test_cli_generate_with_head(smollm2_dir, smollm2, tmp_path, capsys):
    from turbospec.cli import main
    head = build_head(HeadConfig.for_target("medusa", smollm2[0].cfg))
    head.init_identity()
    save_head(head, str(tmp_path / "medusa"))
    args = ["generate", "Say hello.", "--model", smollm2_dir, "--max-new-tokens", "12", "--drafter", "medusa",
            "--head", str(tmp_path / "medusa"), "--num-draft", "6"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "drafter medusa" in out.err and "tok/s" in out.err
    assert main(["generate", "Say hello.", "--model", smollm2_dir, "--max-new-tokens", "12", "--drafter", "none"]) == 0
    plain = capsys.readouterr()
    assert out.out == plain.out  # greedy: the same text with and without the head
    assert main(["generate", "Say hello.", "--model", smollm2_dir, "--drafter", "eagle"]) == 2
    assert "needs head=" in capsys.readouterr().err


def test_bench_summary_acceptance_table_and_plots(tmp_path):
    from turbospec.benchmark import acceptance_markdown, plots, summarize
    rows = lambda secs, acc: [{"id": f"p{i}", "category": c, "new_tokens": 10, "seconds": secs, "steps": 5,
                               "token_ids": [1] * 10, "peak_rss_mb": 100.0, "accept_per_position": acc}
                              for i, c in enumerate(["qa", "rag", "qa"])]
    results = {"hf_plain": rows(1.0, None), "ts_eagle": rows(0.25, [0.8, 0.5, None])}
    summary = summarize(results)
    assert summary["ts_eagle"]["overall"]["speedup"] == pytest.approx(4.0)
    assert summary["ts_eagle"]["overall"]["accept_by_position"] == pytest.approx([0.8, 0.5])
    md = acceptance_markdown(summary)
    assert "| ts_eagle | 0.80 | 0.50 | – |" in md
    pngs = plots(summary, str(tmp_path / "e2e"), {"dtype": "float32", "prompts": 3})
    assert len(pngs) == 2
    for p in pngs:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_steps_without_a_proposal_keep_the_head_in_sync(cyc, monkeypatch):
    """When the budget chooses plain decoding for some steps, the committed tokens' features queue
    up and the next proposal feeds them all (regression: they were dropped)."""
    from turbospec.drafters import budget
    _, target, ref, vocab = cyc
    calls = {"n": 0}

    def alternate(self):
        calls["n"] += 1
        return 0 if calls["n"] % 3 else self.max_draft
    monkeypatch.setattr(budget.DraftBudget, "choose", alternate)
    for method in ("eagle", "eagle3", "medusa"):
        eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=8)
        g = eng.generate(PROMPT, N_NEW)
        assert g.token_ids == ref
        assert g.stats["verify_steps"] < N_NEW  # some proposals were accepted


def test_a_proposal_after_a_plain_stretch_feeds_a_window(cyc, monkeypatch):
    """After steps without a proposal, EAGLE heads feed only the last CATCH_UP_WINDOW committed
    pairs (the slots skip the positions between); drafting every step they feed all. Either way the
    output is the plain engine's, and drafts after the window are still accepted."""
    from turbospec.drafters import budget
    from turbospec.drafters.eagle import EagleDrafter
    _, target, ref, vocab = cyc
    monkeypatch.setattr(EagleDrafter, "CATCH_UP_WINDOW", 3)
    real = EagleDrafter.propose_steps
    for method in ("eagle", "eagle3"):
        monkeypatch.setattr(EagleDrafter, "propose_steps", real)
        calls = {"n": 0}

        def stretch(self):  # draft, then 8 plain steps, then draft again
            calls["n"] += 1
            return 0 if 2 <= calls["n"] <= 9 else self.max_draft
        monkeypatch.setattr(budget.DraftBudget, "choose", stretch)
        eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=8)
        g = eng.generate(PROMPT, N_NEW)
        assert g.token_ids == ref
        dr = eng.drafter
        assert dr._cached - dr._fill >= 8 + 1 - 3  # the stretch's pairs but the window's were skipped
        assert g.stats["draft_accepted"] > 0
        monkeypatch.setattr(budget.DraftBudget, "choose", lambda self: self.max_draft)
        eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=8)
        assert eng.generate(PROMPT, N_NEW).token_ids == ref
        assert eng.drafter._fill == eng.drafter._cached  # drafting every step: every pair fed
        # a generation that starts with plain steps: its first proposal feeds a window of the
        # prompt and those steps too
        calls["n"] = 0

        def late(self):
            calls["n"] += 1
            return 0 if calls["n"] <= 5 else self.max_draft
        monkeypatch.setattr(budget.DraftBudget, "choose", late)
        eng = engine(target, method, make_head(method, target, vocab=vocab), vocab, num_draft=8)
        seen = []

        def spy(self, tokens, *a, **kw):
            seen.append((self._cached, self._fill))
            return (yield from real(self, tokens, *a, **kw))
        monkeypatch.setattr(EagleDrafter, "propose_steps", spy)
        assert eng.generate(PROMPT, N_NEW).token_ids == ref
        assert seen[0] == (0, 0) and seen[1] == (len(PROMPT) - 1 + 5, 3)  # fed: the last 3 of 24 pairs


def test_shipped_head_loads_and_drafts_exactly(smollm2):
    """The EAGLE-3 head in the package fits the default model, records its provenance, is what
    --drafter eagle uses on the default model, and drafts exactly; 'auto' picks it only when its
    config says the benchmark showed it beating n-gram lookup."""
    from turbospec.heads.formats import load_head
    from turbospec.heads.shipped import best_shipped_head, shipped_heads
    model, tok = smollm2
    heads = shipped_heads()
    assert "eagle3" in heads
    head = load_head(heads["eagle3"], target_cfg=model.cfg)
    assert "turbospec train" in head.extra["command"] and head.extra["eval"]["acceptance"][0] > 0.5
    assert head.cfg.method == "eagle3" and head.draft_vocab_ids().numel() == 8192
    auto = Engine("default", max_seq_len=256)
    best = best_shipped_head(default_only=True)
    assert auto.drafter.name == ("ngram" if best is None else ("medusa" if best[0] == "medusa" else "eagle"))
    eng = Engine("default", drafter="eagle", max_seq_len=256)
    tree = head.extra["engine"]["tree"]
    drafter = eng.drafter.head if tree.get("ngram") else eng.drafter  # shipped with prompt lookup merged in
    assert eng.drafter.name == ("eagle+ngram" if tree.get("ngram") else "eagle")
    assert drafter.depth == tree["depth"] and drafter.top_k == tree["top_k"]
    ids = eng.encode("Name three colours of the rainbow.")
    g = eng.generate(ids, 32)
    assert g.token_ids == Engine(model, drafter="none", max_seq_len=256).generate(ids, 32).token_ids
    assert g.stats["tau"] > 1.0  # the trained head is accepted at least sometimes


def test_benchmark_runs_shipped_heads_alone_and_hybrid(smollm2):
    """turbospec bench's default head systems: each shipped head alone, merged with prompt lookup
    when it ships that way (or --head-ngram asks), and an EAGLE head with suffix decoding (hybrid)."""
    import argparse
    from turbospec.benchmark import head_systems
    model, _ = smollm2
    args = argparse.Namespace(head=[], head_draft=None, head_ngram=0, model="default")
    systems = head_systems(args, model)
    assert "ngram" not in systems["ts_eagle3"][1]["tree"]
    assert systems["ts_eagle3_ngram"][1]["tree"]["ngram"] == 8 and "ts_medusa" in systems
    # the EAGLE head and suffix decoding in one tree; a Medusa head has no hybrid
    assert systems["ts_hybrid_eagle3"][1]["drafter"] == "hybrid" and "ngram" not in systems["ts_hybrid_eagle3"][1]["tree"]
    assert "ts_hybrid_medusa" not in systems
    args.head_ngram = 4
    systems = head_systems(args, model)
    assert systems["ts_medusa_ngram"][1]["tree"] == {"num_nodes": 16, "ngram": 4}


def test_with_draft_vocab_carries_the_rows_it_keeps(cyc):
    """EagleHead.with_draft_vocab: a token in both vocabularies keeps its LM-head row bit for bit (its
    logit to within the GEMM's rounding: BLAS may block a wider matrix differently), a new token's
    row is the mean of the old rows, every other weight is the same; the engine drafts with
    the result exactly as with any head; bad ids and EAGLE-1/2 heads are refused."""
    _, target, ref, vocab = cyc
    head = make_head("eagle3", target, seed=4, vocab=vocab)
    old_ids = head.draft_vocab_ids()
    extra_ids = [t for t in range(target.cfg.vocab_size) if t not in set(old_ids.tolist())][:5]
    ids = torch.sort(torch.cat((old_ids[1:], torch.tensor(extra_ids)))).values  # one dropped, five new
    wide = head.with_draft_vocab(ids)
    assert wide.cfg.draft_vocab_size == ids.numel() and torch.equal(wide.draft_vocab_ids(), ids)
    assert bool(wide.t2d[ids].all()) and int(wide.t2d.sum()) == ids.numel()
    out = torch.randn(7, target.cfg.hidden_size)
    with torch.no_grad():
        a, b = head.logits(out), wide.logits(out)
    pos_old = {int(t): i for i, t in enumerate(old_ids)}
    for j, t in enumerate(ids.tolist()):
        if t in pos_old:
            assert torch.equal(wide.lm_head.weight[j], head.lm_head.weight[pos_old[t]])
            torch.testing.assert_close(b[:, j], a[:, pos_old[t]], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(wide.lm_head.weight[j], head.lm_head.weight.mean(0))
    for name, t in head.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(wide.state_dict()[name], t), name
    eng = engine(target, "eagle3", wide, num_draft=8, adaptive=False)
    assert eng.generate(PROMPT, N_NEW).token_ids == ref
    with pytest.raises(ValueError, match="distinct ascending target ids"):
        head.with_draft_vocab(torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="distinct ascending target ids"):
        head.with_draft_vocab(torch.tensor([0, target.cfg.vocab_size]))
    with pytest.raises(ValueError, match="EAGLE-3 head's draft vocabulary"):
        make_head("eagle", target).with_draft_vocab(ids)


def test_draft_vocab_from_counts_keeps_the_given_ids():
    """The most frequent ids, ties to the lower id; ``keep``'s ids come first (all of them when
    growing, the most frequent of them when shrinking)."""
    from turbospec.heads.layers import draft_vocab_from_counts
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    assert draft_vocab_from_counts(counts, 3).tolist() == [2, 3, 5]
    assert draft_vocab_from_counts(counts, 5, keep=torch.tensor([1, 6])).tolist() == [1, 2, 3, 5, 6]
    assert draft_vocab_from_counts(counts, 2, keep=torch.tensor([4, 7, 1])).tolist() == [4, 7]
    assert draft_vocab_from_counts(counts, 20).tolist() == list(range(8))


@pytest.mark.parametrize("width", ["none", "new", "tree", "full"])
def test_head_attention_kernel_equals_sdpa(width, monkeypatch):
    """A head's attention over its cache: on CPU turbospec's tree_attention kernel (queries padded to the
    mask's width), else SDPA with the mask widened to the whole cache; both attend the same keys, so
    they agree to rounding, for no mask (causal), a mask over the new tokens, one over a tree's slots
    after a fully attended prefix, and a full mask."""
    from turbospec.heads import layers
    if not layers.has_op("tree_attention"):
        pytest.skip("turbospec._C not built")
    torch.manual_seed(0)
    cfg = HeadConfig(method="eagle", hidden_size=64, vocab_size=32, intermediate_size=96, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0)
    attn = layers.Attention(cfg, 64)
    rot = layers.Rotary(cfg)
    cache_len, n, tree = 20, 3, 5  # the last `tree` slots before the new tokens are a tree's
    mask = torch.rand(1, n, tree + n) < 0.5
    mask[..., tree:] |= torch.eye(n, dtype=torch.bool)  # each attends itself
    full = torch.ones(1, n, cache_len + n, dtype=torch.bool)
    full[..., cache_len - tree:] = mask
    m = {"none": None, "new": mask[..., tree:], "tree": mask, "full": full}[width]
    q, k, v = torch.randn(1, n, 64), torch.randn(1, n, 32), torch.randn(1, n, 32)
    cos, sin = rot(torch.arange(cache_len, cache_len + n)[None], torch.float32)
    prefix_k, prefix_v = torch.randn(1, 2, cache_len, 16), torch.randn(1, 2, cache_len, 16)
    outs = []
    for kernel in (True, False):
        monkeypatch.setattr(layers, "has_op", lambda op, key="CPU", _k=kernel: _k)
        kv = layers.head_cache(cfg, 64)
        kv.k[0][:, :, :cache_len], kv.v[0][:, :, :cache_len] = prefix_k, prefix_v
        with torch.no_grad():
            outs.append(attn.attend(q, k, v, cos, sin, kv, cache_len, m))
        assert torch.equal(kv.k[0][:, :, :cache_len], prefix_k)  # the new K/V go after the prefix
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    if width == "new":  # the same keys as a full mask whose prefix is all attended
        with torch.no_grad():
            kv = layers.head_cache(cfg, 64)
            kv.k[0][:, :, :cache_len], kv.v[0][:, :, :cache_len] = prefix_k, prefix_v
            full_new = torch.ones(1, n, cache_len + n, dtype=torch.bool)
            full_new[..., cache_len:] = m
            torch.testing.assert_close(attn.attend(q, k, v, cos, sin, kv, cache_len, full_new), outs[0],
                                       rtol=1e-5, atol=1e-6)


def test_head_attention_mask_width_is_checked():
    from turbospec.heads import layers
    cfg = HeadConfig(method="eagle", hidden_size=64, vocab_size=32, intermediate_size=96, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0)
    attn = layers.Attention(cfg, 64)
    cos, sin = layers.Rotary(cfg)(torch.arange(2)[None], torch.float32)
    q, k, v = torch.randn(1, 2, 64), torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    with pytest.raises(ValueError, match=r"mask width must be in \[2, 7\]"):
        attn.attend(q, k, v, cos, sin, layers.head_cache(cfg, 16), 5, torch.ones(1, 2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="without a cache the mask covers the n = 2 new tokens"):
        attn.attend(q, k, v, cos, sin, None, 0, torch.ones(1, 2, 3, dtype=torch.bool))


@pytest.mark.parametrize("weights", ["dense", "q4_0"])
def test_drafting_copy_fuses_projections_bit_for_bit(cyc, weights):
    """A drafting copy (``inference_copy``) computes q/k/v and gate/up as one linear each; every output
    row's dot product is the separate linear's, so the head's output is the same bits without them."""
    from turbospec.drafters.tree import inference_copy
    _, target, _, vocab = cyc
    head = make_head("eagle3", target, vocab=vocab)
    if weights != "dense" and not turbospec.ops.has_op("linear"):
        pytest.skip("turbospec._C not built")
    fast = inference_copy(head, torch.float32, weights=weights, activations="exact")
    a, mlp = fast.midlayer.self_attn, fast.midlayer.mlp
    assert a.qkv_fused is not None and mlp.gate_up_fused is not None
    torch.manual_seed(1)
    n = 5
    feats = torch.randn(1, n, len(head.cfg.feature_layers) * head.cfg.hidden_size)
    emb = torch.randn(1, n, head.cfg.hidden_size)
    with torch.no_grad():
        fused = fast(feats, emb, torch.arange(n)[None])
        a.qkv_fused = mlp.gate_up_fused = None
        separate = fast(feats, emb, torch.arange(n)[None])
    assert torch.equal(fused, separate)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("weights, activations", [("dense", "exact"), ("q4_0", "exact"), ("q4_0", "int8")])
def test_row_kernels_equal_the_python_head_bit_for_bit(cyc, method, weights, activations):
    """A drafting copy's row-wise parts as one turbospec op each (``bind_row_kernels``: eagle_input /
    eagle_output) give the bits of the Python parts they replace (``_input`` / ``_output`` without
    them), for the features' and the fused (head-output) input, and the ops equal their references."""
    from turbospec import ops
    from turbospec.drafters.tree import inference_copy
    from turbospec.ops import reference
    if not ops.has_op("eagle_input"):
        pytest.skip("turbospec._C not built")
    _, target, _, vocab = cyc
    head = make_head(method, target, vocab=vocab)
    fast = inference_copy(head, torch.float32, weights=weights, activations=activations)
    assert fast.bind_row_kernels()
    kernels = fast._row_kernels
    torch.manual_seed(2)
    h, n = head.cfg.hidden_size, 7
    f = len(head.cfg.feature_layers) * h if method == "eagle3" else h
    a = fast.layer.self_attn
    rows_in = {False: torch.randn(n, f + h), True: torch.randn(n, 2 * h)}
    rows_out = torch.randn(n, a.nh * a.d + h)
    with torch.no_grad():
        got = {fused: fast._input(rows_in[fused], fused) for fused in (False, True)}
        got_out = fast._output(rows_out)
        fast._row_kernels = None
        want = {fused: fast._input(rows_in[fused], fused) for fused in (False, True)}
        want_out = fast._output(rows_out)
    for fused in (False, True):
        assert torch.equal(got[fused], want[fused]), fused
    assert torch.equal(got_out, want_out)
    mode = 1 if method == "eagle3" else 0
    spec = reference.eagle_input(rows_in[False], kernels["input"], kernels["fc_bias"], kernels["norms"], h,
                                 head.cfg.rms_norm_eps, mode)
    spec_out = reference.eagle_output(rows_out, kernels["output"], kernels["norm"], head.cfg.rms_norm_eps)
    assert torch.equal(got[False], spec) and torch.equal(got_out, spec_out)


def test_row_kernel_bad_input_names_the_argument():
    from turbospec import ops
    if not ops.has_op("eagle_input"):
        pytest.skip("turbospec._C not built")
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="eagle_input: mode must be 0"):
        torch.ops.turbospec.eagle_input(torch.randn(2, 64), [w, w], [0, 0], [1, 1], [0, 0], None, [], 32, 1e-6, 3)
    with pytest.raises(RuntimeError, match="eagle_output: rows must be a float32 CPU tensor"):
        torch.ops.turbospec.eagle_output(torch.randn(2, 8, dtype=torch.float64), [w, w, w], [0, 0, 0], [1, 1, 1],
                                         [0, 0, 0], torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="eagle_output: counts and activations must have 3 entries"):
        torch.ops.turbospec.eagle_output(torch.randn(2, 64), [w, w], [0, 0], [1, 1], [0, 0], torch.ones(32), 1e-6)
