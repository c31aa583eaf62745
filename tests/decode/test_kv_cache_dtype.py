"""16-bit K/V caches on CPU (``kv_cache_dtype``): the target's cache holds float16 / bfloat16, the
attention kernel reads it under float32 queries. The contract is the one every other mode keeps:
speculative output equals plain decoding with the same cache dtype (tests/decode/test_exact_dtypes.py
runs every drafter that way), a batched request equals it alone, a cached prefix equals prefilling it;
the C++ layer loop equals the Python one (tests/model/test_model.py)."""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine, Request, cli
from turbospec.decode.step import TargetStep
from turbospec.model.prefix_cache import PrefixCache

from helpers import PROMPT, N_NEW, engine, make_head, make_tiny_model, prompts_mixed


@pytest.fixture(scope="module")
def tiny16():
    hf = make_tiny_model("llama", seed=3)
    return turbospec.load_model(hf).set_kv_cache_dtype("float16")


def test_the_cache_holds_the_dtype_and_changes_the_output_only_by_rounding(tiny16):
    target = tiny16
    assert all(t.dtype == torch.float16 for t in target.new_cache(8, 2).tensors())
    g16 = Engine(target, drafter="none", max_seq_len=128).generate(PROMPT, N_NEW)
    target.set_kv_cache_dtype("auto")
    try:
        assert target.new_cache(8).k[0].dtype == torch.float32
        g32 = Engine(target, drafter="none", max_seq_len=128).generate(PROMPT, N_NEW)
    finally:
        target.set_kv_cache_dtype("float16")
    # a random tiny model is all near-ties: the rounded K/V may change late tokens, not the first ones
    assert g16.token_ids[:4] == g32.token_ids[:4]


def test_batched_requests_equal_alone(tiny16):
    """Greedy and seeded sampled requests of different lengths, n-gram lookup and an EAGLE-3 tree,
    several requests in one batch: each equals itself alone."""
    target = tiny16
    prompts = prompts_mixed(6, seed=2)
    for eng in (Engine(target, drafter="ngram", max_seq_len=256, max_batch=4),
                engine(target, "eagle3", make_head("eagle3", target, seed=4), max_seq_len=256, max_batch=3,
                       num_draft=8, adaptive=False)):
        reqs = [Request(p, max_new_tokens=12 + 2 * i) for i, p in enumerate(prompts)]
        reqs += [Request(prompts[1], max_new_tokens=16, temperature=0.9, seed=11)]
        out = eng.generate(reqs)
        for r, g in zip(reqs, out):
            alone = eng.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature or 0.0,
                                 seed=r.seed)
            assert g.token_ids == alone.token_ids, r


def test_cached_prefix_gives_the_bits_of_a_full_prefill_in_half_the_bytes(tiny16):
    target = tiny16
    ids = torch.randint(0, 256, (53,), generator=torch.Generator().manual_seed(1)).tolist()
    other = ids[:48] + [3, 4, 5]
    cached = TargetStep(target, 128, prefix_cache=PrefixCache(1 << 30))
    cached.prefill(0, ids)
    n, _, hit = cached.prefill(0, other)
    assert hit == 48
    plain = TargetStep(target, 128)
    n_ref, _, _ = plain.prefill(0, other)
    assert n == n_ref
    for t, r in zip(cached.cache.tensors(), plain.cache.tensors()):
        assert t.dtype == torch.float16 and torch.equal(t[:, :, :n], r[:, :, :n])
    cfg = target.cfg
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, 2 bytes each
    # 3 blocks of 16 shared, each prompt's partial last block: 52 - 48 and 50 - 48 tokens
    assert cached.prefix_cache.nbytes == (48 + 4 + 2) * per_token


def test_bad_values_are_named(tiny16):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, float16, bfloat16, got 'fp8'"):
        Engine(tiny16, drafter="none", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .* got 'int8'"):
        tiny16.set_kv_cache_dtype("int8")
    assert tiny16.kv_cache_dtype == "float16"  # unchanged by the refused call


def test_cli_flag(smollm2_dir, capsys):
    prompt = "Repeat exactly: red green blue red green blue"
    args = ["generate", prompt, "--model", smollm2_dir, "--max-new-tokens", "12", "--threads", "1",
            "--activations", "int8", "--kv-cache-dtype", "float16"]
    assert cli.main(args + ["--drafter", "ngram"]) == 0
    spec, _ = capsys.readouterr()
    ref = Engine(smollm2_dir, drafter="none", activations="int8", kv_cache_dtype="float16",
                 max_seq_len=4096).generate(prompt, 12).text
    assert spec.rstrip("\n") == ref
    with pytest.raises(SystemExit) as exit_:  # argparse refuses a value outside the choices
        cli.main(["generate", "hi", "--model", smollm2_dir, "--kv-cache-dtype", "fp8"])
    assert exit_.value.code == 2 and "--kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr()[1]


def test_engine_keeps_a_passed_targets_settings_unless_told():
    """Engine(target) with no activations / kv_cache_dtype keeps what the target was set to (before,
    its defaults silently reset a model loaded with int8 activations to exact ones); given, they are
    set on it."""
    from turbospec.model import loader
    target = loader.load_model(make_tiny_model("llama", seed=1, num_hidden_layers=2), weights="q4_0",
                               activations="int8").set_kv_cache_dtype("bfloat16")
    eng = Engine(target, drafter="none")
    assert target.activations == eng.activations == "int8" and target.kv_cache_dtype == "bfloat16"
    assert eng.target_step.cache.k[0].dtype == torch.bfloat16
    Engine(target, drafter="none", activations="exact", kv_cache_dtype="auto")
    assert target.activations == "exact" and target.kv_cache_dtype == "auto"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_a_16bit_models_own_cache_gives_the_bits_of_a_float32_one(kind, dtype):
    """"auto" caches a 16-bit model's K/V in its own dtype: the values are already rounded to it and
    the kernel widens them under float32 queries, so logits (prefill and a tree verify), the C++ and
    Python layer loops, and speculative decoding give the bits of a float32 cache."""
    from helpers import make_tiny_model
    target = turbospec.load_model(make_tiny_model(kind, seed=2), dtype=dtype)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    runs = {}
    for kv in ("float32", "auto"):
        target.set_kv_cache_dtype(kv)
        for cpp in (True, False):
            target.use_cpp_layers = cpp
            cache = target.new_cache(64)
            a = target.forward(ids[:, :30], torch.arange(30)[None], cache, 0)
            b = target.forward(ids[:, 30:34], torch.tensor([[30, 31, 31, 32]]), cache, 30, tree)
            runs[kv, cpp] = (a, b, cache.k[0].dtype)
        g = Engine(target, drafter="ngram", num_draft=6, adaptive=False, max_seq_len=128).generate(PROMPT, N_NEW)
        runs[kv] = g.token_ids
    target.use_cpp_layers = True
    assert runs["auto", True][2] == dtype and runs["float32", True][2] == torch.float32
    for key in (("auto", True), ("auto", False), ("float32", False)):
        ref = runs["float32", True]
        assert torch.equal(runs[key][0], ref[0]) and torch.equal(runs[key][1], ref[1])
    assert runs["auto"] == runs["float32"]
