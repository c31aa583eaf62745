"""Every architecture turbospec supports beyond the original Llama / Qwen2 tests, through the whole
engine (issue 37's "what supported means"): on a tiny random model built from the architecture's
real ``transformers`` config,

* fp32 greedy: plain decoding == every drafter (``factory.DRAFTERS``: a drafter added later joins
  automatically) == an oracle tree == HF ``generate``, token for token;
* bfloat16: speculative == plain bit for bit (n-gram, draft model, EAGLE-3 tree);
* the batched engine: a mixed batch == each request alone (greedy and seeded sampling);
* each of those on the CPU's dynamic path, its fixed-shape path (what CUDA graphs capture), for the
  mixtures of experts that path with the experts' GPU dispatch (``moe_dispatch="masked"``: fixed
  shapes, no host read) in the Python layer loop, and a GPU where there is one (on CUDA a batch's
  greedy rows are held to HF's greedy output instead);
* heads train on it (a few steps of ``turbospec train``), save, load and draft exactly.

(The forward against HF, the C++ layer loop against its Python specification and GGUF tensor names
are in tests/model.)"""
from __future__ import annotations

import copy

import pytest
import torch

import turbospec
from turbospec import Engine, Request, cli
from turbospec.drafters.draft_model import layer_skip_draft
from turbospec.drafters.factory import DRAFTERS

from helpers import make_head, make_tiny_model, make_tiny_tokenizer

from test_engine import REPEAT_PROMPT, OracleDrafter, hf_greedy

ARCHS = ["qwen3", "phi3", "olmo2", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "olmoe"]
N_NEW = 30


def _cyclic(kind: str, seed: int = 1, layers: int = 3):
    """A target whose attention outputs are zeroed: greedy output cycles, so every drafter (n-gram,
    suffix, heads) gets drafts accepted and the accepted path really is exercised."""
    hf = make_tiny_model(kind, seed=seed, num_hidden_layers=layers)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return hf


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    hf = _cyclic(request.param)
    target = turbospec.load_model(hf)
    ref = hf_greedy(hf, REPEAT_PROMPT, N_NEW)
    return request.param, hf, target, ref


def _drafter_options(name: str, kind: str, target) -> dict:
    if name == "draft_model":
        return dict(draft_model=make_tiny_model(kind, seed=5, num_hidden_layers=1))
    if name in ("eagle", "hybrid"):
        return dict(head=make_head("eagle3", target, seed=2), tree={"depth": 3, "top_k": 3})
    if name == "medusa":
        return dict(head=make_head("medusa", target, seed=2), tree={"num_nodes": 12})
    return {}


# where an engine runs: the CPU's dynamic path, its fixed-shape path (what CUDA graphs capture, run
# eagerly on CPU; for a mixture of experts also with the dispatch a GPU runs) and, where there is one, a GPU
MODES = ["cpu", "cpu-static", "cpu-static-masked", "cuda"]


def _on(mode: str, hf, target) -> tuple[object, dict]:
    """(the target to give Engine, its device options) for ``mode``."""
    if mode == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return hf, dict(device="cuda")  # Engine loads the transformers model onto the GPU
    if mode == "cpu-static-masked":
        if not target.cfg.num_experts:
            pytest.skip("a dense model: no experts to dispatch (the same path as cpu-static)")
        target = copy.copy(target)  # (the module's target keeps its own dispatch)
        target.moe_dispatch = "masked"
    return target, (dict(static_shapes=True) if mode == "cpu-static" else {})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [d for d in DRAFTERS if d != "auto"])
def test_greedy_every_drafter_equals_hf(arch, name, mode):
    kind, hf, target, ref = arch
    tgt, where = _on(mode, hf, target)
    g = Engine(tgt, drafter=name, num_draft=8, adaptive=False, max_seq_len=96, **where,
               **_drafter_options(name, kind, target)).generate(REPEAT_PROMPT, N_NEW)
    assert g.token_ids == ref, (kind, name)
    if name not in ("none", "draft_model"):
        assert g.stats["draft_proposed"] > 0, g.stats  # drafts were verified (acceptance: the oracle test)


def test_greedy_layer_skip_eagle1_and_oracle_tree_equal_hf(arch):
    kind, hf, target, ref = arch
    runs = {"layer-skip": dict(drafter="draft_model", draft_model=layer_skip_draft(target, 2)),
            "eagle-1": dict(drafter="eagle", head=make_head("eagle", target, seed=4), tree={"depth": 3, "top_k": 2}),
            "oracle-tree": dict(drafter=OracleDrafter(len(REPEAT_PROMPT), ref, tree=True))}
    for what, kw in runs.items():
        g = Engine(target, num_draft=8, adaptive=False, max_seq_len=96, **kw).generate(REPEAT_PROMPT, N_NEW)
        assert g.token_ids == ref, (kind, what)
    assert g.stats["tau"] > 3  # the oracle's true path is accepted through its wrong branches


def test_bfloat16_speculative_equals_plain_bit_for_bit(arch):
    kind, hf, _, _ = arch
    target = turbospec.load_model(hf, dtype=torch.bfloat16)
    plain = Engine(target, drafter="none", max_seq_len=96).generate(REPEAT_PROMPT, N_NEW)
    for name, kw in (("ngram", {}), ("draft_model", dict(draft_model=layer_skip_draft(target, 2))),
                     ("eagle", dict(head=make_head("eagle3", target, seed=2), tree={"depth": 3, "top_k": 3}))):
        g = Engine(target, drafter=name, num_draft=8, adaptive=False, max_seq_len=96, **kw).generate(REPEAT_PROMPT,
                                                                                                      N_NEW)
        assert g.stats["draft_proposed"] > 0, name
        assert g.token_ids == plain.token_ids, (kind, name)


@pytest.mark.parametrize("mode", MODES)
def test_batch_equals_alone(arch, mode):
    kind, hf, target, ref = arch
    tgt, where = _on(mode, hf, target)
    eng = Engine(tgt, drafter="eagle", head=make_head("eagle3", target, seed=2), tree={"depth": 3, "top_k": 3},
                 num_draft=8, adaptive=False, max_seq_len=96, max_batch=3, **where)
    prompts = [REPEAT_PROMPT, REPEAT_PROMPT[:9], REPEAT_PROMPT[4:], [7, 1, 200, 3, 99]]
    reqs = [Request(p, max_new_tokens=N_NEW - 3 * i) for i, p in enumerate(prompts)]
    reqs += [Request(REPEAT_PROMPT[2:], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)]
    out = eng.generate(reqs)
    assert out[0].token_ids == ref
    for r, g in zip(reqs, out):
        if mode == "cuda":  # cuBLAS may round differently by row count: greedy rows against HF's greedy
            assert len(g.token_ids) == r.max_new_tokens
            if not r.temperature:
                assert g.token_ids == hf_greedy(hf, r.prompt, r.max_new_tokens), r
            continue
        alone = eng.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature or 0.0,
                             top_p=r.top_p or 1.0, seed=r.seed)
        assert g.token_ids == alone.token_ids, r


@pytest.mark.parametrize("kind", ARCHS)
def test_head_trains_saves_loads_and_drafts_exactly(tmp_path, kind):
    vocab = 64
    hf = make_tiny_model(kind, seed=0, vocab_size=vocab)
    hf.save_pretrained(str(tmp_path / "model"))
    make_tiny_tokenizer(vocab).save_pretrained(str(tmp_path / "model"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "w{i % vocab} w{(3 * i) % vocab} w{(7 * i + 1) % vocab}"}}\n'
                               for i in range(24)))
    out = tmp_path / "head"
    argv = ["train", "--method", "eagle3", "--target", str(tmp_path / "model"), "--data", str(prompts),
            "--out", str(out), "--work-dir", str(tmp_path / "work"), "--num-prompts", "24", "--max-new-tokens",
            "16", "--epochs", "2", "--batch-size", "8", "--eval-samples", "4", "--draft-vocab", "48",
            "--threads", "1"]
    assert cli.main(argv) == 0
    head = turbospec.heads.formats.load_head(str(out))
    assert head.cfg.method == "eagle3" and head.extra["total_steps"] > 0
    target = turbospec.load_model(str(tmp_path / "model"))
    prompt = [5, 9, 2, 5, 9, 2, 5, 9]
    g = Engine(target, drafter="eagle", head=str(out), num_draft=6, adaptive=False, max_seq_len=64).generate(
        prompt, 20)
    assert g.stats["draft_proposed"] > 0
    assert g.token_ids == hf_greedy(hf, prompt, 20)
