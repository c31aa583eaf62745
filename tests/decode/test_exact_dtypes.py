"""Speculative output == plain greedy output of the same engine, token for token, in bfloat16,
float16 and with quantized weights (not only float32): every drafter — n-gram lookup, a draft model,
EAGLE / EAGLE-3 / Medusa trees — on tiny random targets (near-ties everywhere, so any difference
between a token verified inside a multi-token pass and the same token decoded alone shows), and the
real default model with bfloat16 activations and its shipped heads on Spec-Bench prompts.
bench/bench_exact.py runs the same comparison over the whole Spec-Bench sample."""
from __future__ import annotations

import functools
import json

import pytest
import torch

import turbospec
from turbospec import Engine
from turbospec.drafters.draft_model import layer_skip_draft
from turbospec.drafters.ngram import NgramDrafter
from turbospec.model import loader

from helpers import make_head, make_tiny_model, shared_data

V = 256
REPEAT_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]
RANDOM_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]
N_NEW = 48

#: (weights, dtype, activations, K/V cache dtype): dense 16-bit weights, GGUF blocks under 16-bit / int8
#: activations (int8's own cache: bfloat16, attention rounding q and P to bfloat16), and 16-bit / float32
#: K/V caches under float32 and int8 activations
CONFIGS = [("auto", torch.bfloat16, "exact", "auto"), ("auto", torch.float16, "exact", "auto"),
           ("q4_0", torch.bfloat16, "exact", "auto"), ("q8_0", torch.float16, "exact", "auto"),
           ("q4_0", torch.float32, "int8", "auto"), ("auto", torch.float32, "exact", "bfloat16"),
           ("q4_0", torch.float32, "int8", "float16"), ("q4_0", torch.float32, "int8", "float32")]
CONFIG_IDS = ["bf16", "fp16", "q4_0-bf16", "q8_0-fp16", "q4_0-int8", "fp32-bf16kv", "q4_0-int8-fp16kv",
              "q4_0-int8-fp32kv"]


def _cache_dtype(dtype, activations, kv):
    """The K/V cache dtype a target of these settings makes (int8 activations: bfloat16 for "auto")."""
    if kv != "auto":
        return getattr(torch, kv)
    return torch.bfloat16 if activations == "int8" else dtype


def _target(weights, dtype, activations, kv, cyclic: bool, kind: str = "llama"):
    hf = make_tiny_model(kind, seed=1, num_hidden_layers=3)
    if cyclic:  # attention outputs zeroed: the greedy continuation cycles, so lookup drafts are accepted
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    return loader.load_model(hf, dtype=dtype, weights=weights, activations=activations).set_kv_cache_dtype(kv)


def _check_same(plain, spec: Engine, prompt, need_accepted: bool, what: str):
    """plain: an Engine, or a function of the prompt giving plain greedy's result."""
    a = plain.generate(prompt, max_new_tokens=N_NEW) if isinstance(plain, Engine) else plain(prompt)
    b = spec.generate(prompt, max_new_tokens=N_NEW)
    assert b.stats["draft_proposed"] > 0, f"{what}: nothing was drafted, so nothing was checked"
    if need_accepted:
        assert b.stats["draft_accepted"] > 0, f"{what}: no draft token was accepted"
    assert b.token_ids == a.token_ids, f"{what}: first difference at " + str(
        next(i for i, (x, y) in enumerate(zip(a.token_ids + [-1], b.token_ids + [-1])) if x != y))
    return b


@pytest.mark.parametrize("weights,dtype,activations,kv", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_ngram_and_draft_model_equal_plain(weights, dtype, activations, kv, kind):
    cyc = _target(weights, dtype, activations, kv, cyclic=True, kind=kind)
    plain = Engine(cyc, drafter="none")
    _check_same(plain, Engine(cyc, drafter="ngram", num_draft=6, adaptive=False), REPEAT_PROMPT, True, "ngram")
    rnd = _target(weights, dtype, activations, kv, cyclic=False, kind=kind)
    plain = Engine(rnd, drafter="none")
    draft = layer_skip_draft(rnd, 2)  # 2 of 3 layers: close enough to be accepted often
    _check_same(plain, Engine(rnd, drafter="draft_model", draft_model=draft, num_draft=4, adaptive=False),
                RANDOM_PROMPT, True, "draft_model")
    _check_same(plain, Engine(rnd, drafter="ngram", num_draft=8, adaptive=False), RANDOM_PROMPT + RANDOM_PROMPT[:6],
                False, "ngram (random target)")


@pytest.mark.parametrize("weights,dtype,activations,kv", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_head_trees_equal_plain(weights, dtype, activations, kv, method):
    """Trees of up to 16 nodes (many branches): the target rows of every node come from one pass."""
    target = _target(weights, dtype, activations, kv, cyclic=False)
    assert target.new_cache(2).k[0].dtype == _cache_dtype(dtype, activations, kv)
    head = make_head(method, target, seed=3)
    tree = {"depth": 4, "top_k": 4} if method != "medusa" else {"num_nodes": 16}
    spec = Engine(target, drafter="medusa" if method == "medusa" else "eagle", head=head, tree=tree, num_draft=16,
                  adaptive=False)
    _check_same(Engine(target, drafter="none"), spec, RANDOM_PROMPT, False, method)


# ---- the default model (SmolLM2-135M-Instruct, GGUF Q4_1 blocks) with bfloat16 activations ----------


@pytest.fixture(scope="module")
def smol_bf16(smollm2_dir):
    src = turbospec.default_model_path()
    return turbospec.load_model(src, torch.bfloat16), turbospec.load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def smol_bf16_plain(smol_bf16):
    """Plain greedy on the bfloat16 model, each prompt decoded once for all the drafters' tests."""
    target, tok = smol_bf16
    plain = Engine(target, drafter="none", tokenizer=tok, max_seq_len=1024)
    return functools.cache(lambda prompt: plain.generate(prompt, max_new_tokens=N_NEW))


def _prompts() -> list[str]:
    spec = shared_data("specbench_dev.jsonl")
    if spec is not None:  # a summarization and a translation prompt: drafts get accepted
        rows = [json.loads(line) for line in open(spec)]
        pick = [next(r for r in rows if r["category"] == c) for c in ("summarization", "translation")]
        return [r["turns"][0] for r in pick]
    return ["Translate to French: The weather is nice today and we are going to the beach, then to the market.",
            "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples, pears."]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle3", "medusa"])
def test_smollm2_bf16_speculative_equals_plain(smol_bf16, smol_bf16_plain, drafter):
    from turbospec.heads.shipped import shipped_heads
    target, tok = smol_bf16
    name, kw = drafter, {}
    if drafter == "ngram":  # 1-token matches too: the short fallback prompts' outputs repeat little
        drafter = functools.partial(NgramDrafter, min_ngram=1)
    elif drafter == "draft_model":
        kw = dict(draft_model=layer_skip_draft(target, 8))
    elif drafter in ("eagle3", "medusa"):
        heads = shipped_heads()
        if drafter not in heads:
            pytest.skip(f"no shipped {drafter} head")
        kw = dict(head=heads[drafter])
        drafter = "eagle" if drafter == "eagle3" else "medusa"
    # a fixed draft length: the adaptive budget may stop drafting on a loaded machine (timings)
    spec = Engine(target, drafter=drafter, tokenizer=tok, max_seq_len=1024, adaptive=False, **kw)
    accepted = 0
    for p in _prompts():
        accepted += _check_same(smol_bf16_plain, spec, p, False, f"{name}: {p[:40]!r}").stats["draft_accepted"]
    if name != "draft_model":  # 8 of 30 layers: rarely accepted (exactness is checked all the same)
        assert accepted > 0, f"{name}: no draft token accepted on either prompt"
