"""The lazy LM head of a CPU verify pass (``decode.step.LazyLogits``) gives exactly what ``verify``
gives over every node's logits: greedy and sampled, chains and trees whose accepted path leaves the
first-child chain, and non-finite rows on and off the path; and it computes fewer rows when the
path is short."""
import pytest
import torch

from turbospec import ops
from turbospec.decode import step as step_mod
from turbospec.decode.step import LazyLogits, TargetStep
from turbospec.model import loader
from turbospec.ops.sampling import SamplingParams

from helpers import SAMPLING, gen, make_tiny_model, random_parents

pytestmark = pytest.mark.skipif(not ops.has_op("linear"), reason="turbospec._C not built")


@pytest.fixture(scope="module")
def model():
    hf = make_tiny_model("llama", vocab_size=512)
    return loader.load_model(hf, dtype=torch.float32, weights="q8_0")


def _tree(logits: torch.Tensor, kind: str, temperature: float, top_k: int, top_p: float, seed: int):
    """A tree over the target's own logits [1, n, V] whose drafts are often accepted: each node's
    token is the argmax at its parent (greedy) or a sample there, else a random token."""
    g = gen(seed)
    n, vocab = logits.shape[1:]
    parents = random_parents(1, n, kind, g)
    if temperature > 0:
        probs = ops.reference.logits_to_probs(logits[0], temperature, top_k, top_p)
    tokens = torch.randint(0, vocab, (1, n), generator=g)
    for i in range(1, n):
        p = int(parents[0, i])
        if torch.rand((), generator=g) < 0.7:
            tokens[0, i] = (int(logits[0, p].argmax()) if temperature == 0
                            else int(torch.multinomial(probs[p], 1, generator=g)))
    return parents, tokens, torch.rand(1, n, generator=g)


@pytest.mark.parametrize("sampling", ["greedy", "sample", "top_k_top_p"])
@pytest.mark.parametrize("kind", ["chain", "random", "wide"])
def test_lazy_equals_verify_over_every_row(model, kind, sampling):
    temperature, top_k, top_p = SAMPLING[sampling]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    lazy = LazyLogits(model)
    total = 0
    for seed in range(12):
        n = 5 + seed * 3 % 28
        hidden = torch.randn(1, n, model.cfg.hidden_size, generator=gen(seed)) * 20  # peaked: deep paths
        logits = model.lm_head(hidden).float()
        parents, tokens, uniform = _tree(logits, kind, temperature, top_k, top_p, seed)
        want = ops.verify(logits, parents, tokens, None, uniform, temperature, top_k, top_p)
        got = lazy.verify(hidden, parents, tokens, None, uniform, params)
        for a, b in zip(want, got):
            assert torch.equal(a, b), (kind, sampling, seed)
        total += n
    # rows were saved, and some walks needed more than one round (the path went past the first
    # LAZY_ROWS rows of the first-child chain, or left it)
    assert lazy.rows < total
    assert lazy.rounds > 12, (lazy.rows, total)


def test_lazy_non_finite_rows(model):
    """A NaN row off the accepted path is never computed or reported; on the path it is reported
    (accept_len -1) as by verify over every row."""
    n = 9
    hidden = torch.randn(1, n, model.cfg.hidden_size, generator=gen(1)) * 3
    logits = model.lm_head(hidden).float()
    parents = torch.arange(-1, n - 1)[None]  # a chain
    tokens = torch.zeros(1, n, dtype=torch.int64)
    tokens[0, 1] = int(logits[0, 0].argmax())  # node 1 accepted, node 2 rejected
    tokens[0, 2] = (int(logits[0, 1].argmax()) + 1) % model.cfg.vocab_size
    uniform = torch.zeros(1, n)
    params = SamplingParams()
    for bad, expect_error in ((6, False), (1, True)):
        h = hidden.clone()
        h[0, bad] = float("nan")
        full = model.lm_head(h).float()
        want = ops.verify(full, parents, tokens, None, uniform, 0.0, 0, 1.0)
        assert (int(want[0][0]) < 0) == expect_error
        lazy = LazyLogits(model)
        lazy._buf = torch.full((1, 64, model.cfg.vocab_size), float("nan"))  # stale rows: non-finite
        got = lazy.verify(h, parents, tokens, None, uniform, params)
        for a, b in zip(want, got):
            assert torch.equal(a, b), bad


def test_step_lazy_only_on_quantized_cpu_lm_head(model):
    dense = loader.load_model(make_tiny_model("llama"), dtype=torch.float32)
    assert TargetStep(model, 64)._lazy is not None
    assert TargetStep(dense, 64)._lazy is None  # a dense LM head is read once for all rows


def test_engine_lazy_equals_eager(model, monkeypatch):
    """Wide trees through the engine: the same tokens with the lazy LM head as with every row."""
    import turbospec
    from helpers import make_head
    head = make_head("eagle3", model, seed=3)
    prompt = [5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9]
    outs = {}
    for lazy_rows in (1000, 4):
        monkeypatch.setattr(step_mod, "LAZY_ROWS", lazy_rows)
        eng = turbospec.Engine(model, drafter="eagle", head=head, num_draft=24, adaptive=False,
                               tree={"depth": 6, "top_k": 4}, max_seq_len=256)
        outs[lazy_rows] = [eng.generate(prompt, max_new_tokens=40).token_ids,
                           eng.generate(prompt, max_new_tokens=40, temperature=0.8, seed=7).token_ids]
        if lazy_rows == 4:
            assert eng.target_step._lazy.rows > 0
    assert outs[4] == outs[1000]
