"""turbospec's own Transformer against transformers' modeling code, tree-masked attention, the static
KV cache, and the loader (in-memory models, directories, bad inputs, bf16)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import turbospec
from turbospec.model import loader
from turbospec import ops
from turbospec.model.transformer import ModelConfig, Transformer

from helpers import make_tiny_model


ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}

CONFIGS = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa-3layers": ("llama", dict(num_key_value_heads=1, num_hidden_layers=3)),
    "llama3-rope-scaling": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "linear-rope-scaling": ("llama", dict(rope_parameters=LINEAR_ROPE)),
    "qwen2-bias": ("qwen2", {}),
    "qwen2-bias-3layers-tied": ("qwen2", dict(num_hidden_layers=3, tie_word_embeddings=True)),
    "mistral": ("mistral", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied-3layers": ("qwen3", dict(tie_word_embeddings=True, num_hidden_layers=3)),
    "phi3": ("phi3", {}),
    "phi3-mha-tied": ("phi3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "olmo2": ("olmo2", {}),
    "olmo2-mha-3layers": ("olmo2", dict(num_key_value_heads=4, num_hidden_layers=3)),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {}),
    "gemma3-4layers-untied": ("gemma3_text", dict(num_hidden_layers=4, tie_word_embeddings=False)),
    "mixtral": ("mixtral", {}),
    "qwen3-moe-3layers": ("qwen3_moe", dict(num_hidden_layers=3)),
    "olmoe": ("olmoe", {}),
}


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


def full_forward(model: Transformer, ids: torch.Tensor, max_seq_len: int = 128) -> torch.Tensor:
    cache = model.new_cache(max_seq_len)
    n = ids.shape[1]
    return model.forward(ids, torch.arange(n)[None], cache, 0)


@pytest.fixture(scope="module")
def tiny():
    """(hf model, turbospec model) for the default tiny Llama (3 layers, GQA)."""
    hf = make_tiny_model("llama", seed=3, num_hidden_layers=3)
    return hf, turbospec.load_model(hf)


# ------------------------------------------------------------------------------------------------
# Forward vs transformers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_transformers(name):
    kind, overrides = CONFIGS[name]
    hf = make_tiny_model(kind, seed=1, **overrides)
    model = turbospec.load_model(hf)
    cfg = model.cfg
    assert cfg.model_type == kind
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.qk_norm == {"qwen3": "head", "olmo2": "full", "gemma3_text": "head", "qwen3_moe": "head",
                           "olmoe": "full"}.get(kind)
    assert bool(cfg.num_experts) == (kind in ("mixtral", "qwen3_moe", "olmoe"))
    assert cfg.norm_layout == {"olmo2": "post", "gemma2": "sandwich", "gemma3_text": "sandwich"}.get(kind, "pre")
    assert cfg.head_dim == (getattr(hf.config, "head_dim", None) or cfg.hidden_size // cfg.num_heads)
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    if "rope_parameters" in overrides:
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == \
            overrides["rope_parameters"]["rope_type"]
    # 48 positions: beyond the llama3 config's original context of 16, so the scaling matters.
    ids = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(hf, ids)
    out = full_forward(model, ids)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    # logits="last" is the last row of "all"; "none" returns nothing
    last = model.forward(ids, torch.arange(48)[None], model.new_cache(64), 0, logits="last")
    torch.testing.assert_close(last, out[:, -1:], atol=ATOL, rtol=1e-4)
    assert model.forward(ids, torch.arange(48)[None], model.new_cache(64), 0, logits="none") is None


def test_rope_scaling_changes_the_logits():
    """Guards the scaled-rope comparison above against being vacuous."""
    plain = turbospec.load_model(make_tiny_model("llama", seed=1))
    scaled = turbospec.load_model(make_tiny_model("llama", seed=1, rope_parameters=LLAMA3_ROPE))
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    assert (full_forward(plain, ids) - full_forward(scaled, ids)).abs().max() > 1e-2


def test_q8_0_on_load_is_close_to_dense(tiny):
    """weights="q8_0" / "q4_0" quantize every linear (and the LM head) on load: the logits move by
    the quantization error only."""
    hf, model = tiny
    q8 = loader.load_model(hf, weights="q8_0")
    assert q8.quantized and not model.quantized
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    q4 = loader.load_model(hf, weights="q4_0")
    a, b, c = full_forward(q8, ids), full_forward(model, ids), full_forward(q4, ids)
    assert not torch.equal(a, b)
    cos8 = torch.nn.functional.cosine_similarity(a, b, dim=-1).min()
    cos4 = torch.nn.functional.cosine_similarity(c, b, dim=-1).min()
    assert cos8 > 0.99 and cos4 < cos8  # 8-bit blocks are close, 4-bit ones less so


# ------------------------------------------------------------------------------------------------
# KV cache: incremental decoding, tree attention, overflow
# ------------------------------------------------------------------------------------------------
def test_incremental_decode_equals_full_forward(tiny):
    hf, model = tiny
    n = 40
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids)
    cache = model.new_cache(64)
    rows, pos = [], 0
    for chunk in (7, 1, 1, 5, 1, 3, 1, 1, 10, 1, 9):  # prefill, single-token decode and chunks
        x = ids[:, pos:pos + chunk]
        rows.append(model.forward(x, torch.arange(pos, pos + chunk)[None], cache, pos))
        pos += chunk
    assert pos == n
    torch.testing.assert_close(torch.cat(rows, dim=1), ref, atol=ATOL, rtol=1e-4)


def test_stale_cache_entries_beyond_cache_len_are_ignored(tiny):
    """Entries past cache_len (rejected drafts of an earlier step) must not influence attention."""
    _, model = tiny
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (1, 12), generator=g)
    junk = torch.randint(0, 256, (1, 6), generator=g)
    cache = model.new_cache(32)
    model.forward(ids[:, :8], torch.arange(8)[None], cache, 0, logits="none")
    model.forward(junk, torch.arange(8, 14)[None], cache, 8, logits="none")  # to be overwritten
    out = model.forward(ids[:, 8:], torch.arange(8, 12)[None], cache, 8)
    torch.testing.assert_close(out, full_forward(model, ids)[:, 8:], atol=ATOL, rtol=1e-4)


TREES = {
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, 0, 0, 0, 0, 0],
    "mixed": [-1, 0, 0, 1, 1, 2, 3, 3, 6, 0, 9, 5],
    "deep-and-wide": [-1, 0, 1, 2, 3, 4, 0, 6, 1, 8, 2, 10, 7, 12, 12, 14],
}


@pytest.mark.parametrize("prefix_len", [0, 1, 9])
@pytest.mark.parametrize("tree", list(TREES))
def test_tree_masked_forward_equals_each_path_run_causally(tiny, tree, prefix_len):
    """The core property of tree verification: with the tree mask and depth-based positions, each
    node's logits are exactly those of its root-to-node path run causally after the prefix."""
    _, model = tiny
    parents = torch.tensor([TREES[tree]])
    n = parents.shape[1]
    g = torch.Generator().manual_seed(n + prefix_len)
    prefix = torch.randint(0, 256, (1, prefix_len), generator=g)
    nodes = torch.randint(0, 256, (1, n), generator=g)
    tree_mask, _, depth, retrieve = ops.build_tree(parents)
    cache = model.new_cache(64)
    if prefix_len:
        model.forward(prefix, torch.arange(prefix_len)[None], cache, 0, logits="none")
    out = model.forward(nodes, prefix_len + depth, cache, prefix_len, tree_mask)
    assert out.shape == (1, n, 256)
    for i in range(n):
        d = int(depth[0, i])
        path = retrieve[0, i, : d + 1]
        assert int(path[0]) == 0 and int(path[-1]) == i
        seq = torch.cat([prefix, nodes[:, path]], dim=1)
        expect = full_forward(model, seq)[0, -1]
        torch.testing.assert_close(out[0, i], expect, atol=ATOL, rtol=1e-4,
                                   msg=lambda m: f"node {i} (path {path.tolist()}): {m}")


def test_tree_mask_is_not_causal_mask(tiny):
    """Guards the tree test: for a non-chain tree the causal mask gives different logits."""
    _, model = tiny
    parents = torch.tensor([TREES["star"]])
    nodes = torch.randint(0, 256, (1, parents.shape[1]), generator=torch.Generator().manual_seed(5))
    tree_mask, _, depth, _ = ops.build_tree(parents)
    tree_out = model.forward(nodes, depth, model.new_cache(16), 0, tree_mask)
    causal_out = model.forward(nodes, torch.arange(parents.shape[1])[None], model.new_cache(16), 0)
    assert (tree_out[0, 2:] - causal_out[0, 2:]).abs().max() > 1e-2


def test_kv_cache_overflow_raises(tiny):
    _, model = tiny
    cache = model.new_cache(16)
    ids = torch.randint(0, 256, (1, 10))
    model.forward(ids, torch.arange(10)[None], cache, 0, logits="none")
    with pytest.raises(ValueError, match="cache overflow.*max_seq_len 16"):
        model.forward(ids[:, :7], torch.arange(10, 17)[None], cache, 10)
    # exactly filling the cache is fine
    out = model.forward(ids[:, :6], torch.arange(10, 16)[None], cache, 10)
    assert out.shape == (1, 6, 256)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.new_cache(0)


def test_cache_shapes_and_dtype(tiny):
    _, model = tiny
    cache = model.new_cache(33)
    cfg = model.cfg
    assert len(cache.tensors()) == 2 * cfg.num_layers
    for t in cache.tensors():
        assert t.shape == (1, cfg.num_kv_heads, 33, cfg.head_dim) and t.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# Loader
# ------------------------------------------------------------------------------------------------
def test_load_from_saved_directory_matches_in_memory(tmp_path):
    hf = make_tiny_model("qwen2", seed=4)
    hf.save_pretrained(tmp_path)
    from_dir = turbospec.load_model(str(tmp_path))
    from_mem = turbospec.load_model(hf)
    assert from_dir.cfg == from_mem.cfg
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(full_forward(from_dir, ids), hf_logits(hf, ids), atol=ATOL, rtol=1e-4)
    # an os.PathLike works as well as a str
    assert turbospec.load_model(tmp_path).cfg == from_mem.cfg


def test_load_sharded_safetensors(tmp_path):
    hf = make_tiny_model("llama", seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = turbospec.load_model(tmp_path)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(full_forward(model, ids), hf_logits(hf, ids), atol=ATOL, rtol=1e-4)


def test_load_pytorch_bin_checkpoint(tmp_path):
    hf = make_tiny_model("llama", seed=6)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model = turbospec.load_model(tmp_path)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(full_forward(model, ids), hf_logits(hf, ids), atol=ATOL, rtol=1e-4)


def test_unsupported_architecture_saved_dir_raises(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as ei:
        turbospec.load_model(tmp_path)
    msg = str(ei.value)
    assert "gpt2" in msg
    for supported in ("llama", "mistral", "qwen2"):
        assert supported in msg


WINDOWED = {  # name: (kind, config overrides): every layer windowed, or a mix (Qwen2/3's layer_types)
    "mistral": ("mistral", dict(sliding_window=8)),
    "phi3": ("phi3", dict(sliding_window=8)),
    "qwen2-mixed": ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1, num_hidden_layers=3)),
    "qwen3-mixed": ("qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=2, num_hidden_layers=3)),
}


@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_window_matches_transformers_past_the_window(name):
    """Sliding-window attention (issue 37: a window of 24 used to be ignored, then refused): logits of
    48 positions with a window of 8 against HF, prefilled at once and decoded token by token, through
    the C++ layer loop and its Python specification (bit-identical)."""
    kind, overrides = WINDOWED[name]
    hf = make_tiny_model(kind, seed=4, **overrides)
    model = turbospec.load_model(hf)
    assert model.cfg.sliding_window == 8 and any(model.windows)
    if name.endswith("mixed"):
        assert 0 in model.windows  # the layers before max_window_layers attend everything
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(hf, ids)
    out = full_forward(model, ids)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    cache = model.new_cache(64)
    steps = torch.cat([model.forward(ids[:, i:i + 1], torch.tensor([[i]]), cache, i) for i in range(48)], dim=1)
    assert torch.equal(steps, out)  # batch-invariant: one token at a time == the whole prompt
    model.use_cpp_layers = False
    assert torch.equal(full_forward(model, ids), out)
    # the window matters here: without it the logits differ
    plain = turbospec.load_model(make_tiny_model(kind, seed=4, **{**overrides, "sliding_window": None,
                                                                  "use_sliding_window": False}))
    assert (full_forward(plain, ids) - out).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_window_generation_every_drafter_equals_hf(name):
    """Generations 3x longer than the window equal HF generate with every drafter, trees included; a
    batch equals each request alone; bf16 speculative equals bf16 plain."""
    kind, overrides = WINDOWED[name]
    hf = make_tiny_model(kind, seed=4, **overrides)
    target = turbospec.load_model(hf)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8]
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                      pad_token_id=0)[0, len(prompt):].tolist()
    from helpers import make_head
    runs = {"none": {}, "ngram": {}, "suffix": {},
            "draft_model": dict(draft_model=make_tiny_model(kind, seed=5, **{**overrides, "num_hidden_layers": 1})),
            "eagle": dict(head=make_head("eagle3", target, seed=2), tree={"depth": 3, "top_k": 3}),
            "medusa": dict(head=make_head("medusa", target, seed=2), tree={"num_nodes": 12})}
    for drafter, kw in runs.items():
        eng = turbospec.Engine(target, drafter=drafter, num_draft=8, adaptive=False, max_seq_len=64, **kw)
        assert eng.generate(prompt, 24).token_ids == ref, drafter
    out = eng.generate([prompt, prompt[3:], [9, 1, 200, 3]], max_new_tokens=24)
    assert out[0].token_ids == ref
    for p, g in zip([prompt, prompt[3:], [9, 1, 200, 3]], out):
        assert g.token_ids == eng.generate(p, 24).token_ids
    bf = turbospec.load_model(hf, dtype=torch.bfloat16)
    plain = turbospec.Engine(bf, drafter="none", max_seq_len=64).generate(prompt, 24).token_ids
    spec = turbospec.Engine(bf, drafter="eagle", head=make_head("eagle3", bf, seed=2), tree={"depth": 3, "top_k": 3},
                            num_draft=8, adaptive=False, max_seq_len=64).generate(prompt, 24)
    assert spec.stats["draft_proposed"] > 0 and spec.token_ids == plain


def test_sliding_window_in_self_distillation_and_unused_windows():
    """Batched self-distillation (left-padded rows through SDPA) applies the window too: its greedy
    continuations equal the engine's, past the window. Configs whose window is unused are unaffected."""
    from turbospec.train import data as distill
    target = turbospec.load_model(make_tiny_model("mistral", seed=4, sliding_window=24))
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [4]]
    got = distill.answer_batch(target, prompts, 40, set())
    eng = turbospec.Engine(target, drafter="none", max_seq_len=64)
    for p, (resp, why) in zip(prompts, got):
        assert resp == eng.generate(p, 40).token_ids and why == "length"
    assert ModelConfig.from_hf(make_tiny_model("qwen2", sliding_window=24).config).sliding_window is None
    assert ModelConfig.from_hf(make_tiny_model("mistral").config).sliding_window is None
    q = make_tiny_model("qwen2", sliding_window=24, use_sliding_window=True, max_window_layers=0).config
    assert ModelConfig.from_hf(q).sliding_window == 24



def test_gemma2_batched_self_distillation_equals_the_engine():
    """The SDPA layer loop of batched self-distillation has no soft-capping: it writes Gemma 2's capped
    attention out; its greedy continuations (left-padded rows, past the window) equal the engine's."""
    from turbospec.train import data as distill
    target = turbospec.load_model(make_tiny_model("gemma2", seed=2, num_hidden_layers=3))
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [4]]
    eng = turbospec.Engine(target, drafter="none", max_seq_len=64)
    for p, (resp, _) in zip(prompts, distill.answer_batch(target, prompts, 30, set())):
        assert resp == eng.generate(p, 30).token_ids


def test_softcap_refused_for_non_gemma_and_off_cpu():
    cfg = make_tiny_model("llama").config
    cfg.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 .llama. is not supported"):
        ModelConfig.from_hf(cfg)


def test_unsupported_architecture_in_memory_raises():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, mistral, qwen2, qwen3"):
        turbospec.load_model(model)
    with pytest.raises(ValueError, match="gpt2"):
        turbospec.Engine(model, drafter="none")


def test_unsupported_activation_and_rope_type_raise():
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf(make_tiny_model("llama", hidden_act="gelu").config)
    from transformers import LlamaConfig
    cfg = LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2),
                         "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="'dynamic'"):
        ModelConfig.from_hf(cfg)



def test_partial_rotary_refused():
    """Phi-4-mini's partial_rotary_factor 0.75 (rotary over part of each head) is not implemented."""
    cfg = make_tiny_model("phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}).config
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 .phi3. is not supported"):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("kind,flag", [("llama", "attention_bias"), ("qwen3", "attention_bias"),
                                       ("mistral", "attention_bias"), ("llama", "mlp_bias")])
def test_unimplemented_biases_refused(kind, flag):
    """attention_bias puts a bias on o_proj too (and mlp_bias on the MLP): not implemented, so such a
    model is refused instead of run without them (it would load and give other logits than HF)."""
    cfg = make_tiny_model(kind, **{flag: True}).config
    if not getattr(cfg, flag, False):
        pytest.skip(f"this transformers' {kind} config has no {flag}")
    with pytest.raises(ValueError, match=f"{flag}=True .*not implemented"):
        ModelConfig.from_hf(cfg)


def test_missing_model_path_raises_with_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as ei:
        turbospec.load_model(str(missing))
    assert str(missing) in str(ei.value)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        turbospec.Engine(str(missing))


def test_directory_without_weights_raises(tmp_path):
    make_tiny_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no weights.*safetensors"):
        turbospec.load_model(tmp_path)


def test_directory_without_config_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        turbospec.load_model(tmp_path)


def test_checkpoint_shape_mismatch_raises(tmp_path):
    hf = make_tiny_model("llama", seed=7)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["vocab_size"] = 300
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="embed_tokens has shape"):
        turbospec.load_model(tmp_path)


def test_non_gguf_file_raises(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="model.bin"):
        turbospec.load_model(f)


def test_bf16_load_close_to_fp32(tiny):
    hf, fp32 = tiny
    bf16 = turbospec.load_model(hf, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    # A 16-bit model's KV cache holds its own dtype (tests/decode/test_kv_cache_dtype.py: the bits of a
    # float32 cache on CPU)
    assert all(t.dtype == torch.bfloat16 for t in bf16.new_cache(8).tensors())
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    a = full_forward(fp32, ids)
    b = full_forward(bf16, ids)
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    err = (a - b).abs()
    scale = a.std()
    assert err.mean() < 0.1 * scale, (err.mean(), scale)
    assert err.max() < 0.6 * scale, (err.max(), scale)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    # the model was not changed by loading a bf16 copy (fp32 weights are not aliased as bf16)
    torch.testing.assert_close(full_forward(fp32, ids), a)


def test_default_model_loads(smollm2_dir, smollm2):
    model, tok = smollm2
    assert os.path.isfile(os.path.join(smollm2_dir, "config.json"))
    cfg = model.cfg
    assert (cfg.model_type, cfg.num_layers, cfg.vocab_size) == ("llama", 30, 49152)
    assert cfg.tie_word_embeddings
    assert tok.eos_token_id in cfg.eos_token_ids
    # resolving again hits the cache (no re-conversion)
    assert loader.resolve_model_dir(turbospec.default_model_path()) == smollm2_dir


def test_resolve_keeps_another_process_finished_entry(smollm2_dir, tmp_path, monkeypatch):
    """Two processes converting the same GGUF at once (test workers do): the one that finds the other's
    finished entry when it goes to rename its own keeps that entry, removes its own copy, and returns
    the same directory (before, it removed the finished entry under the other's feet)."""
    path = turbospec.default_model_path()
    monkeypatch.setenv("TURBOSPEC_CACHE", str(tmp_path))
    first = loader.resolve_model_dir(path)
    cfg = os.path.join(first, "config.json")
    inode = os.stat(cfg).st_ino
    real, calls = loader._converted, []

    def missed_once(out, gguf):  # the entry appears between this process's check and its rename
        calls.append(out)
        return False if len(calls) == 1 else real(out, gguf)

    monkeypatch.setattr(loader, "_converted", missed_once)
    assert loader.resolve_model_dir(path) == first
    assert len(calls) == 2 and os.stat(cfg).st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == [os.path.basename(first)]  # no copy left over


@pytest.mark.parametrize("cache_dtype", [None, "model", "float16", "bfloat16"],
                         ids=["float32-cache", "model-dtype-cache", "float16-cache", "bfloat16-cache"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
                                  "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_layer_loop_bit_identical_to_python(kind, dtype, cache_dtype):
    """turbospec::llama_layers (C++) computes what Transformer.layers_python computes, rounding where it
    rounds: prefill, a tree-masked verify and a decode step give identical logits and identical caches.
    Every cache runs the raw-buffer loop: float32, the model's own dtype (the default), and float16 /
    bfloat16 caches (``set_kv_cache_dtype``) under any model."""
    from turbospec.ops import has_op
    if not has_op("llama_layers"):
        pytest.skip("turbospec._C with llama_layers is not built")
    if cache_dtype == "model" and dtype == torch.float32:
        pytest.skip("the float32 model's cache is float32 either way")
    hf = make_tiny_model(kind)
    model = turbospec.load_model(hf, dtype=dtype)
    assert model._flat is not None
    model.set_kv_cache_dtype({None: "float32", "model": "auto"}.get(cache_dtype, cache_dtype))
    assert model.new_cache(4).k[0].dtype == (torch.float32 if cache_dtype is None else
                                             dtype if cache_dtype == "model" else getattr(torch, cache_dtype))
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                          [1, 0, 1, 0, 1]]], dtype=torch.bool)
    runs = {}
    for use_cpp in (False, True):
        model.use_cpp_layers = use_cpp
        cache = model.new_cache(64)
        a = model.forward(ids[:, :30], torch.arange(30)[None], cache, 0)
        b = model.forward(ids[:, 30:35], torch.tensor([[30, 31, 31, 32, 32]]), cache, 30, mask)
        c, feats = model.forward(ids[:, 35:36], torch.tensor([[33]]), cache, 35, features=[0, 1])
        # two sequences in one pass (B = 2), with one rotary table row per sequence
        cache2 = model.new_cache(64, batch_size=2)
        two = torch.cat([ids[:, :12], ids[:, 12:24]])
        d = model.forward(two, torch.arange(12).expand(2, 12), cache2, 0)
        runs[use_cpp] = [a, b, c, feats, d] + cache.tensors() + cache2.tensors()
    for x, y in zip(runs[False], runs[True]):
        assert torch.equal(x, y)


def _rows_case(kind, dtype, kv, seed, lens, n=4):
    """A tiny model (the C++ loop built) and a 3-row static pass's inputs: per row a prompt of lens[b]
    tokens and n new token ids."""
    from turbospec.ops import has_op
    if not has_op("llama_layers"):
        pytest.skip("turbospec._C with llama_layers is not built")
    model = turbospec.load_model(make_tiny_model(kind), dtype=dtype).set_kv_cache_dtype(kv)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (1, int(s)), generator=g) for s in lens]
    return model, prompts, torch.randint(0, 256, (3, n), generator=g)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
                                  "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["auto", "float16"])
def test_cpp_layer_loop_per_row_prefix_lengths(kind, dtype, kv):
    """Transformer.forward_static (a batch of rows at different prefix lengths, the serving path) runs
    the C++ layer loop with per-row cache lengths on CPU: logits, features and every cache slot are
    identical to the Python loop (its specification), and each row's K/V lands at its own slots."""
    lens, n = torch.tensor([7, 0, 23]), 4
    model, prompts, ids = _rows_case(kind, dtype, kv, 5, lens, n)
    packed = torch.tensor([[1, 3, 5, 11], [1, 3, 7, 15], [1, 2, 4, 8]])  # a tree, a chain, padding rows
    positions = lens[:, None] + torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3], [0, 0, 0, 0]])
    runs = {}
    for use_cpp in (False, True):
        model.use_cpp_layers = use_cpp
        cache = model.new_cache(40, batch_size=3)
        for b, p in enumerate(prompts):
            if p.shape[1]:
                model.forward(p, torch.arange(p.shape[1])[None], cache.rows(b, b + 1), 0, logits="none")
        logits, feats = model.forward_static(ids, positions, cache, lens, packed, features=[0, 1])
        runs[use_cpp] = [logits, feats] + cache.tensors()
    for x, y in zip(runs[False], runs[True]):
        assert torch.equal(x, y)
    # row b's new K/V sit at [lens[b], lens[b] + n): later slots are untouched (zero)
    k0 = runs[True][2]
    for b, s in enumerate(lens.tolist()):
        assert k0[b, :, s: s + n].abs().sum() > 0 and k0[b, :, s + n:].abs().sum() == 0
    with pytest.raises(RuntimeError, match="cache overflow"):
        model.forward_static(ids, positions, cache, torch.tensor([7, 0, 37]), packed)
    with pytest.raises(RuntimeError, match="cache_lens must be an int64 CPU tensor"):
        model.forward_static(ids, positions, cache, torch.tensor([7, 0]), packed)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "olmo2", "gemma2", "gemma3_text", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
def test_forward_static_ragged_rows_skip_padding(kind, dtype, kv):
    """``forward_static(nodes=...)``: row b's new tokens are its first nodes[b] (the batched step's
    shorter drafts and free slots). The real tokens' logits, features and K/V are the bits of the pass
    without ``nodes`` (in the C++ loop and the Python loop alike); padding logits are 0; the C++ loop
    computes no padding: nothing is written for it (a free slot's cache is untouched)."""
    lens, n = torch.tensor([9, 21, 5]), 4
    model, prompts, ids = _rows_case(kind, dtype, kv, 6, lens, n)
    # row 0: a chain of 3 then a padding node; row 1: a tree of 4; row 2: a free slot (padding only)
    packed = torch.tensor([[1, 3, 7, 8], [1, 3, 5, 11], [1, 2, 4, 8]])
    positions = lens[:, None] + torch.tensor([[0, 1, 2, 0], [0, 1, 1, 2], [0, 0, 0, 0]])
    nodes = torch.tensor([3, 4, 0])
    real = torch.arange(n)[None] < nodes[:, None]
    runs = {}
    for use_cpp in (False, True):
        model.use_cpp_layers = use_cpp
        for ragged in (False, True):
            cache = model.new_cache(40, batch_size=3)
            for b, p in enumerate(prompts):
                model.forward(p, torch.arange(p.shape[1])[None], cache.rows(b, b + 1), 0, logits="none")
            before = [t.clone() for t in cache.tensors()]
            logits, feats = model.forward_static(ids, positions, cache, lens, packed, features=[0, 1],
                                                 nodes=nodes if ragged else None)
            runs[use_cpp, ragged] = logits, feats, cache.tensors(), before
    for use_cpp in (False, True):
        (l0, f0, c0, _), (l1, f1, c1, before) = runs[use_cpp, False], runs[use_cpp, True]
        assert torch.equal(l1[real], l0[real]) and torch.equal(f1[real], f0[real])
        assert (l1[~real] == 0).all()
        for t0, t1, t_before in zip(c0, c1, before):
            for b, s in enumerate(lens.tolist()):
                k = int(nodes[b])
                assert torch.equal(t1[b, :, : s + k], t0[b, :, : s + k])  # the prefix and the real tokens
                if use_cpp:  # the padding computed nothing: its slots as they were
                    assert torch.equal(t1[b, :, s + k:], t_before[b, :, s + k:])
    # the C++ loop's real rows are the Python loop's (its specification)
    assert torch.equal(runs[True, True][0], runs[False, True][0])
    assert torch.equal(runs[True, True][1][real], runs[False, True][1][real])
    if dtype == torch.float32:
        assert (runs[True, True][1][~real] == 0).all()  # the C++ loop's padding features: 0
    with pytest.raises(RuntimeError, match=r"nodes\[1\] = 5 must be in \[0, 4\]"):
        model.forward_static(ids, positions, model.new_cache(40, batch_size=3), lens, packed, nodes=torch.tensor([1, 5, 0]))
    with pytest.raises(ValueError, match="nodes must be an int64 CPU tensor"):
        model.forward_static(ids, positions, model.new_cache(40, batch_size=3), lens, packed, nodes=torch.tensor([1.0, 2.0, 0.0]))


@pytest.mark.parametrize("kind", ["llama", "olmo2", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_layer_loop_row_work_split_among_threads(kind, dtype):
    """From 64 rows the C++ loop splits its row-wise work between the linears (norms, rotary embedding
    and cache stores, the gate's product, residual adds) among the threads: a 100-token prefill and a
    70-token pass give the same logits and caches with 1 and 2 threads, and the Python loop's."""
    from turbospec.ops import has_op
    if not has_op("llama_layers"):
        pytest.skip("turbospec._C with llama_layers is not built")
    model = turbospec.load_model(make_tiny_model(kind), dtype=dtype)
    ids = torch.randint(0, 256, (1, 170), generator=torch.Generator().manual_seed(8))
    runs = []
    before = torch.get_num_threads()
    try:
        for use_cpp, threads in ((False, 1), (True, 1), (True, 2)):
            model.use_cpp_layers = use_cpp
            torch.set_num_threads(threads)
            cache = model.new_cache(180)
            a = model.forward(ids[:, :100], torch.arange(100)[None], cache, 0)
            b = model.forward(ids[:, 100:], torch.arange(100, 170)[None], cache, 100)
            runs.append([a, b] + cache.tensors())
    finally:
        torch.set_num_threads(before)
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x, y)


@pytest.mark.parametrize("cut", [10, 3000, 50_000_000])
def test_truncated_or_corrupt_gguf_names_the_file(tmp_path, cut):
    """A GGUF cut short (in its header, or in its tensor data) or overwritten is refused with a
    ValueError naming the file and what is wrong, before any conversion."""
    src = turbospec.default_model_path()
    bad = tmp_path / f"cut{cut}.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(cut))
    for load in (turbospec.load_model, loader.resolve_model_dir):
        with pytest.raises(ValueError, match=r"cut%d\.gguf: (not a GGUF|corrupt or truncated|truncated)" % cut):
            load(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ValueError, match=r"junk\.gguf: corrupt or truncated GGUF header"):
        loader.read_gguf_weights(str(junk), None, torch.float32)



# ------------------------------------------------------------------------------------------------
# A GGUF's config (read once into the cache) and tokenizer (from its metadata) (issue 37: first load)
# ------------------------------------------------------------------------------------------------
_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
           "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def _fields(cfg) -> dict:
    return {k: getattr(cfg, k, None) for k in _FIELDS}


def test_default_gguf_config_and_tokenizer_equal_transformers_conversion(tmp_path, monkeypatch):
    """resolve_model_dir builds the config from the GGUF's metadata itself and load_tokenizer the
    tokenizer (gguf_tokenizer; tests/model/test_gguf_tokenizer.py compares it in depth): the same
    config fields, and the same ids, text and chat template as AutoConfig / AutoTokenizer(gguf_file=...)
    give."""
    from transformers import AutoConfig, AutoTokenizer
    from turbospec.model.gguf import read_gguf
    path = turbospec.default_model_path()
    d, f = os.path.split(path)
    meta, tensors = read_gguf(path)
    mine = loader.gguf_hf_config(meta, tensors)
    assert mine is not None and _fields(mine) == _fields(AutoConfig.from_pretrained(d, gguf_file=f))
    monkeypatch.setenv("TURBOSPEC_CACHE", str(tmp_path))
    tok = turbospec.load_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(d, gguf_file=f)
    texts = ["Hello world!", "  two spaces\n\ttab 1234567 ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>",
             "def f(x):\n    return x ** 2  # ok\n", "<|endoftext|> trailing   ", ""]
    for t in texts:
        assert tok.encode(t) == ref.encode(t), t
        assert tok.decode(tok.encode(t)) == ref.decode(ref.encode(t)), t
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(ref, name), name
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_config_from_metadata_equals_transformers(tmp_path, arch):
    """A GGUF written the way llama.cpp writes one (metadata only matters here): turbospec's config
    has the fields transformers' conversion gives; RoPE scaling and Mistral-named files are left to
    transformers (None)."""
    import gguf
    import numpy as np
    from transformers import AutoConfig
    from turbospec.model.gguf import read_gguf

    def write(name: str, extra=None, untied: bool = False) -> str:
        path = str(tmp_path / name)
        w = gguf.GGUFWriter(path, arch)
        w.add_name(name)
        w.add_context_length(512)
        w.add_embedding_length(64)
        w.add_block_count(2)
        w.add_feed_forward_length(96)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(50000.0)
        if arch == "qwen3":
            w.add_key_length(32)
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(40)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        for k, v in (extra or {}).items():
            w.add_string(k, v) if isinstance(v, str) else w.add_float32(k, v)
        w.add_tensor("token_embd.weight", np.zeros((40, 64), dtype=np.float32))
        if untied:
            w.add_tensor("output.weight", np.zeros((40, 64), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    for untied in (False, True):
        path = write(f"m{int(untied)}.gguf", untied=untied)
        mine = loader.gguf_hf_config(*read_gguf(path))
        ref = AutoConfig.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
        got, want = _fields(mine), _fields(ref)
        if arch == "qwen3":  # the file's attention.key_length; transformers' conversion ignores it (its
            assert got["head_dim"] == 32 and want["head_dim"] == 128  # default, 128, is right for real Qwen3)
            got["head_dim"] = want["head_dim"] = None
        assert got == want
        assert mine.tie_word_embeddings == (not untied)
    scaled = write("scaled.gguf", {f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": 2.0})
    assert loader.gguf_hf_config(*read_gguf(scaled)) is None
    if arch == "llama":
        assert loader.gguf_hf_config(*read_gguf(write("Mistral-7B.gguf"))) is None


def test_converted_gguf_loads_without_transformers_config_classes(tmp_path):
    """The first load and later ones read the GGUF's config without importing a transformers config
    class (~2.3 s of imports); the config.json saved for it reads back through AutoConfig to the
    same fields, and through read_model_config to the same ModelConfig; load_hf_config gives
    transformers' own config class (what its model classes take)."""
    import subprocess
    import sys
    from transformers import AutoConfig
    from turbospec.model.transformer import ModelConfig
    env = {**os.environ, "TURBOSPEC_CACHE": str(tmp_path),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    code = ("import sys, turbospec; e = turbospec.Engine(drafter='none', max_seq_len=64); "
            "print(e.generate('Hi', 3).token_ids); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and 'configuration' in m))")
    for run in ("first", "again"):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == "[]", (run, r.stdout)
    cache = [p for p in tmp_path.iterdir() if p.name.endswith("-meta")]
    assert len(cache) == 1
    mine = loader.read_model_config(str(cache[0]))
    assert isinstance(mine, loader.GGUFConfig)
    from transformers import PretrainedConfig
    assert isinstance(loader.load_hf_config(str(cache[0])), PretrainedConfig)
    assert loader.load_hf_model(turbospec.default_model_path()) is not None  # (transformers' model class)
    ref = AutoConfig.from_pretrained(str(cache[0]))
    assert _fields(mine) == _fields(ref)
    assert ModelConfig.from_hf(mine) == ModelConfig.from_hf(ref)


# ------------------------------------------------------------------------------------------------
# A GGUF's tensors mapped as stored (issue 37: peak memory at most ~the file)
# ------------------------------------------------------------------------------------------------
def test_gguf_tensors_are_views_of_the_file_and_the_embedding_stays_quantized():
    """load_model keeps a GGUF's embedding blocks where the file maps them and looks up its rows from
    them (no dense table until ``embed`` is asked for), both exactly the dense table's values; the
    linears' weights end in the process's own memory (``own_weights``: kernels read anonymous pages),
    none left a view of the file; release_pages leaves a tensor's values as they were (its pages
    come back from the file)."""
    from turbospec.model import gguf
    from turbospec.model.quant import QuantWeight
    path = turbospec.default_model_path()
    model = loader.load_model(path)
    blocks = model._embed_blocks
    assert isinstance(blocks, QuantWeight) and model._embed is None
    lo, hi = next((a, b) for a, b, ref in gguf._MAPPINGS if ref() is not None and a <= blocks.data.data_ptr() < b)
    assert blocks.data.data_ptr() + blocks.data.numel() <= hi
    lins = [lin for layer in model.layers for lin in layer.linears()] + [model.lm_head]
    assert not any(gguf.is_mapped(w) for lin in lins for w in lin.weights)
    ids = torch.tensor([[0, 1, 2, 49151, 7, 7], [300, 12000, 2, 5, 6, 40000]])
    rows = model.embedding(ids)
    model.forward(ids[:1], torch.arange(6)[None], model.new_cache(8), 0)
    assert model._embed is None  # a forward pass made no dense table
    before = blocks.data.clone()
    gguf.release_pages(blocks.data)
    assert torch.equal(blocks.data, before)
    assert torch.equal(rows, model.embed[ids])  # the dense table, made now
    assert model.lm_head_weight is model.embed  # (tied)


def test_gguf_load_holds_about_the_file(tmp_path):
    """load_model's peak memory (a new process, after its imports) stays under twice the GGUF's size:
    the blocks are mapped, a copy made for a kernel layout (merged q/k/v parts, grouped blocks)
    releases the pages it was read from, and no dense embedding or LM head is made (copying every
    tensor, or a dense embedding, went over: 98 MB file, ~4x before)."""
    import subprocess
    import sys
    code = ("import os, turbospec; from turbospec.model import loader; import turbospec.ops\n"
            "def status(k):\n"
            "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(k + ':'))\n"
            "p = turbospec.default_model_path(); loader.resolve_model_dir(p)\n"
            "base = status('VmRSS'); m = loader.load_model(p)\n"
            "print((status('VmHWM') - base) * 1024 / os.path.getsize(p))")
    env = {**os.environ, "TURBOSPEC_CACHE": str(tmp_path),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.strip().splitlines()[-1]) < 2.0, r.stdout


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_torch_matmuls_are_the_kernels_within_rounding(kind):
    """``use_torch_matmuls`` (the head-training feature stage's fast forward): torch matmuls over
    dense weights and one SDPA pass over a whole causal sequence (here 100 > 64 tokens), then
    token-at-a-time steps over its cache, give the kernels' logits and features up to float32
    rounding; a bfloat16 copy (what ``--feature-matmuls torch-bf16`` runs) is about as near float32's
    as the kernels' own bfloat16 model.
    It is no longer the kernels' path: the C++ loop is off, and a tree mask past 64 tokens is
    still refused."""
    from turbospec.model.transformer import MAX_TREE_NODES
    overrides = {"sliding_window": 40} if kind == "mistral" else {}
    hf = make_tiny_model(kind, seed=7, **overrides)
    ref, fast = turbospec.load_model(hf), turbospec.load_model(hf).use_torch_matmuls()
    assert fast.matmuls == "torch" and not fast._cpp_loop() and ref._cpp_loop() == ops.has_op("llama_layers")
    assert fast.use_torch_matmuls() is fast
    half = turbospec.load_model(hf, dtype=torch.bfloat16).use_torch_matmuls()
    half_kernels = turbospec.load_model(hf, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    B, n, more = 3, 100, 4
    ids = torch.randint(0, hf.config.vocab_size, (B, n + more), generator=g)
    pos = torch.arange(n + more)[None].expand(B, -1)
    outs = {}
    for name, m in (("ref", ref), ("fast", fast), ("half", half), ("half_kernels", half_kernels)):
        cache = m.new_cache(n + more, B)
        lg, ft = m.forward(ids[:, :n], pos[:, :n], cache, 0, logits="all", features=(0, 1))
        steps = [m.forward(ids[:, n + i:n + i + 1], pos[:, n + i:n + i + 1], cache, n + i, logits="all").float()
                 for i in range(more)]
        outs[name] = (lg.float(), ft.float(), torch.cat(steps, dim=1))
    for a, b in zip(outs["ref"], outs["fast"]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
    for a, b, c in zip(outs["ref"], outs["half"], outs["half_kernels"]):  # as near as the kernels' bfloat16
        rel, rel_kernels = ((b - a).norm() / a.norm()).item(), ((c - a).norm() / a.norm()).item()
        assert 0 < rel < 2 * rel_kernels + 1e-3 and rel < 0.1, (rel, rel_kernels)
    with pytest.raises(ValueError, match="tree_mask covers at most"):
        tm = torch.ones(1, MAX_TREE_NODES + 1, MAX_TREE_NODES + 1, dtype=torch.bool).tril()
        fast.forward(ids[:1, :MAX_TREE_NODES + 1], pos[:1, :MAX_TREE_NODES + 1], fast.new_cache(n, 1), 0,
                     tree_mask=tm)
