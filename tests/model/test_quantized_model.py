"""A GGUF model kept quantized computes exactly what the same model dequantized to float32 computes,
and every token's numbers are independent of how many tokens share the pass (batch invariance):
prefill == token-by-token decode, a 64-token chain or a 64-node tree == each token decoded alone,
bit for bit, in float32, bfloat16, float16 and quantized weights."""
import pytest
import torch

import turbospec
from turbospec.model import loader
from turbospec import ops
from turbospec.model.transformer import Transformer

from helpers import make_tiny_model, on_every_isa


pytestmark = pytest.mark.skipif(not ops.has_op("llama_layers"), reason="turbospec._C not built")


@pytest.fixture(scope="module")
def smollm2_q(smollm2_dir):
    """SmolLM2-135M-Instruct with the GGUF's Q4_1 / Q8_0 blocks kept as stored."""
    model = loader.load_model(turbospec.default_model_path())
    assert model.quantized
    fmts = {f for layer in model.layers for lin in layer.linears() for f in lin.formats}
    # Q4_1 layers, Q8_0 tied embedding / LM head; grouped (1000 + id) where the AVX-512 kernels run
    g = 1000 if ops.cpu_isa() == "avx512" else 0
    assert fmts == {3 + g} and model.lm_head.formats == [8 + g]
    return model


def test_gguf_quantized_equals_dequantized_float32(smollm2_q, smollm2):
    """Same logits and KV cache, bit for bit, as the model transformers dequantizes (and un-permutes)."""
    dense, tok = smollm2
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Italy is")])
    n = ids.shape[1]
    mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    runs = []
    for model in (smollm2_q, dense):
        cache = model.new_cache(64)
        a = model.forward(ids, torch.arange(n)[None], cache, 0)
        b = model.forward(ids[:, :4], torch.tensor([[n, n + 1, n + 1, n + 2]]), cache, n, mask)
        runs.append([a, b] + cache.tensors())
    for x, y in zip(*runs):
        assert torch.equal(x, y)


def _model(kind: str, weights: str, dtype: torch.dtype, activations: str = "exact") -> Transformer:
    hf = make_tiny_model(kind, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2)
    return loader.load_model(hf, dtype=dtype, weights=weights, activations=activations)


VARIANTS = [("llama", "auto", torch.float32, "exact"), ("qwen2", "auto", torch.float32, "exact"),
            ("llama", "auto", torch.bfloat16, "exact"), ("llama", "q8_0", torch.float32, "exact"),
            ("qwen2", "q4_0", torch.float32, "exact"), ("llama", "q4_0", torch.bfloat16, "exact"),
            ("llama", "q4_0", torch.float32, "int8"), ("qwen2", "q8_0", torch.float32, "int8"),
            ("llama", "auto", torch.float16, "exact"), ("qwen2", "q8_0", torch.float16, "exact")]


@pytest.mark.parametrize("kind,weights,dtype,activations", VARIANTS)
def test_prefill_equals_token_by_token(kind, weights, dtype, activations):
    """A 100-token prompt in one call (passes of 64) == the same tokens one at a time: logits and cache."""
    model = _model(kind, weights, dtype, activations)
    n = 100
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))
    c1, c2 = model.new_cache(128), model.new_cache(128)
    full = model.forward(ids, torch.arange(n)[None], c1, 0)
    steps = torch.cat([model.forward(ids[:, i:i + 1], torch.tensor([[i]]), c2, i) for i in range(n)], dim=1)
    assert torch.equal(full, steps)
    for a, b in zip(c1.tensors(), c2.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind,weights,dtype,activations", VARIANTS)
def test_tree_node_equals_its_path_decoded_alone(kind, weights, dtype, activations):
    """Every node of a 64-node tree (many branches) verified in one pass has the logits of the same
    token decoded alone after its own path, bit for bit."""
    model = _model(kind, weights, dtype, activations)
    prefix = 30
    ids = torch.randint(0, 256, (1, prefix), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 64)]
    tokens = torch.randint(0, 256, (1, 64), generator=g)
    tree_mask, _, depth, _ = ops.build_tree(torch.tensor([parents]))
    cache = model.new_cache(160)
    model.forward(ids, torch.arange(prefix)[None], cache, 0)
    tree_logits = model.forward(tokens, prefix + depth, cache, prefix, tree_mask)
    for node in range(64):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        solo = model.new_cache(160)
        model.forward(ids, torch.arange(prefix)[None], solo, 0)
        for j, p in enumerate(path):
            out = model.forward(tokens[:, p:p + 1], torch.tensor([[prefix + j]]), solo, prefix + j)
        assert torch.equal(out[0, 0], tree_logits[0, node]), f"node {node} (depth {len(path) - 1})"


@pytest.mark.parametrize("activations", ["exact", "int8"])
def test_isa_paths_give_identical_model_outputs(activations):
    """The whole forward (linears, attention, norms) on the scalar path equals the best path."""
    model = _model("llama", "q4_0", torch.float32, activations)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    outs = on_every_isa(lambda: model.forward(ids, torch.arange(20)[None], model.new_cache(32), 0))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_int8_activations_change_logits_a_little_and_switch_back():
    """int8 activations are a different (llama.cpp-like) arithmetic: logits differ from the exact
    model's, but only by activation rounding; switching back restores the exact logits."""
    model = _model("llama", "q8_0", torch.float32)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    run = lambda: model.forward(ids, torch.arange(12)[None], model.new_cache(16), 0)
    exact = run()
    model.set_activations("int8")
    assert model.lm_head.activations == 8 and all(l.activations == 8 for l in model.layers[0].linears())
    int8 = run()
    assert not torch.equal(int8, exact)
    assert (int8 - exact).abs().max() < 0.1 * exact.abs().max()  # rounding, not garbage (random weights)
    assert torch.equal(model.set_activations("exact") and run(), exact)
    with pytest.raises(ValueError, match="activations must be one of exact, int8, got 'int4'"):
        model.set_activations("int4")


TREE = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)


def _prefill_and_tree(model):
    """A 66-token prompt in one call (passes of 64), then a 4-node tree verify: ([logits, logits], cache)."""
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(80)
    a = model.forward(ids[:, :66], torch.arange(66)[None], cache, 0)
    b = model.forward(ids[:, 66:70], torch.tensor([[66, 67, 67, 68]]), cache, 66, TREE)
    return [a, b], cache


def test_int8_attention_rounds_to_bfloat16_over_its_bfloat16_cache():
    """int8 activations make a bfloat16 K/V cache by default ("auto") and attention over it rounds q and
    P to bfloat16 (tree_attention's bf16_products): the C++ layer loop and the Python loop (its
    specification) give the same logits and caches, prefill and a tree verify; a float32 cache, asked
    for, keeps float32 attention (other logits); exact activations keep the model's own cache."""
    model = _model("llama", "q4_0", torch.float32, "int8")
    assert model.new_cache(4).k[0].dtype == torch.bfloat16 and model.attn_bf16_products(model.new_cache(4).k[0])

    def run():
        logits, cache = _prefill_and_tree(model)
        return logits + cache.tensors()
    runs = {}
    for use_cpp in (True, False):
        model.use_cpp_layers = use_cpp
        runs[use_cpp] = run()
    model.use_cpp_layers = True
    for x, y in zip(runs[True], runs[False]):
        assert torch.equal(x, y)
    model.set_kv_cache_dtype("float32")
    assert not model.attn_bf16_products(model.new_cache(4).k[0])
    wide = run()
    assert not torch.equal(wide[0], runs[True][0])
    # rounding, not garbage: on this random model a float16 cache moves the logits as much (1.1 of 17.5),
    # int8 activations themselves by 2.7
    assert (wide[0] - runs[True][0]).abs().max() < 0.1 * wide[0].abs().max()
    model.set_kv_cache_dtype("auto").set_activations("exact")
    assert model.new_cache(4).k[0].dtype == torch.float32


def test_int8_attention_stores_tiny_keys_and_values_as_it_reads_them():
    """bf16_products read a cache value below 2^-50 in magnitude as +0; the C++ layer loop stores it so
    (and skips that flush at every read), the Python loop too: with K and V channels of about 1e-18
    (a Qwen2 bias, its weight rows zero) both loops give the same logits and caches, the tiny values
    stored as +0; the public op reading a cache that holds them raw gives the same output as over the
    flushed cache (it flushes at the read)."""
    hf = make_tiny_model("qwen2", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[3:5] = 0.0
                proj.bias[3:5] = torch.tensor([1e-18, -3e-19])
    model = loader.load_model(hf, dtype=torch.float32, weights="q8_0", activations="int8")
    runs = {}
    for use_cpp in (True, False):
        model.use_cpp_layers = use_cpp
        runs[use_cpp] = _prefill_and_tree(model)
    model.use_cpp_layers = True
    (lc, cc), (lp, cp) = runs[True], runs[False]
    for x, y in zip(lc + cc.tensors(), lp + cp.tensors()):
        assert torch.equal(x, y)
    v = cc.v[0][0, 0, :70, 3:5].float()  # V is not rotated: the tiny channels themselves
    assert bool((v == 0).all()) and not bool(torch.signbit(v).any())  # +0
    k = cc.k[0][0, :, :70].float()
    assert bool(((k == 0) | (k.abs() >= 2.0 ** -50)).all())
    # the public op over the raw values (as a writer that does not flush leaves them) == over the flushed
    raw_k, raw_v = cc.k[0].clone(), cc.v[0].clone()
    raw_v[0, 0, :70, 3] = torch.tensor(1e-18).to(torch.bfloat16)
    raw_k[0, 1, :70, 7] = torch.tensor(-2e-17).to(torch.bfloat16)
    flushed_k = raw_k.masked_fill(raw_k.abs() < 2.0 ** -50, 0)
    flushed_v = raw_v.masked_fill(raw_v.abs() < 2.0 ** -50, 0)
    q = torch.randn(1, 4, 4, 32)
    lens = torch.tensor([66])
    tree = torch.tensor([[1, 3, 5, 11]], dtype=torch.int64)  # ancestors-and-self bits of the mask above
    a, _ = ops.tree_attention(q, raw_k, raw_v, lens, tree, 0.17, bf16_products=True)  # TREE's rows
    b, _ = ops.tree_attention(q, flushed_k, flushed_v, lens, tree, 0.17, bf16_products=True)
    assert torch.equal(a, b)


def test_int8_speculative_equals_plain_greedy():
    """Batch invariance holds in int8 mode too: a draft model and n-gram drafting give the tokens of
    plain greedy decoding with int8 activations."""
    model = _model("llama", "q4_0", torch.float32, "int8")
    draft = _model("llama", "q4_0", torch.float32, "int8")
    prompt = [5, 9, 11, 5, 9, 11, 5, 9, 30, 31, 32, 5, 9, 11]
    plain = turbospec.Engine(model, drafter="none", activations="int8", max_seq_len=128).generate(prompt, max_new_tokens=40)
    for opts in (dict(drafter="ngram"), dict(drafter="draft_model", draft_model=draft, num_draft=4)):
        g = turbospec.Engine(model, activations="int8", max_seq_len=128, **opts).generate(prompt, max_new_tokens=40)
        assert g.token_ids == plain.token_ids, opts
        assert g.stats["verify_steps"] < 40 or opts["drafter"] == "ngram"


def test_weights_argument_is_checked():
    hf = make_tiny_model("llama")
    with pytest.raises(ValueError, match="weights 'q3' is not supported; choose one of auto, dense, q8_0, q4_0"):
        loader.load_model(hf, weights="q3")


@pytest.mark.parametrize("kind,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("phi3", "phi3"),
                                       ("olmo2", "olmo2"), ("gemma3_text", "gemma3"), ("qwen3_moe", "qwen3moe"),
                                       ("gemma2", "gemma2")])
def test_read_gguf_weights_keeps_blocks_and_undoes_llama_permutation(tmp_path, kind, arch):
    """A GGUF written the way llama.cpp's converter writes it (Q8_0 blocks; for "llama" the q/k rows
    permuted for its rotary layout) reads back as the HF weights' blocks in HF row order."""
    import gguf
    import numpy as np
    from gguf import quants

    from turbospec.model.transformer import ModelConfig
    from turbospec.model.quant import QuantWeight
    hf = make_tiny_model(kind, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         **(dict(mlp_only_layers=[], moe_intermediate_size=64) if kind == "qwen3_moe" else {}))
    cfg = ModelConfig.from_hf(hf.config)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}

    def permute(w, heads):  # llama.cpp's convert_hf_to_gguf permutation of q / k rows
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    q8 = lambda w: quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    path = str(tmp_path / "tiny.gguf")
    wr = gguf.GGUFWriter(path, arch)
    wr.add_tensor("token_embd.weight", q8(sd["model.embed_tokens.weight"]), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    wr.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        wr.add_tensor("output.weight", q8(sd["lm_head.weight"]), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    p = "model.layers.0."
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    if kind == "olmo2":  # post-norm layers: the norms of the attention's and the MLP's outputs
        names = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    shift = 0.0
    if kind in ("gemma2", "gemma3_text"):  # sandwich norms, stored by llama.cpp as 1 + weight (HF's: 1 + weight)
        names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
        shift = 1.0
        sd = {k: (v + shift if k.endswith("norm.weight") else v) for k, v in sd.items()}
    for g, h in names.items():
        wr.add_tensor(f"blk.0.{g}.weight", sd[p + h + ".weight"])
    linears = (("attn_q", "self_attn.q_proj", cfg.num_heads), ("attn_k", "self_attn.k_proj", cfg.num_kv_heads),
               ("attn_v", "self_attn.v_proj", None), ("attn_output", "self_attn.o_proj", None),
               ("ffn_gate", "mlp.gate_proj", None), ("ffn_up", "mlp.up_proj", None), ("ffn_down", "mlp.down_proj", None))
    if kind == "phi3":  # llama.cpp's Phi-3 layout: attn_qkv, and ffn_up holding gate and up
        linears = (("attn_qkv", "self_attn.qkv_proj", None), ("attn_output", "self_attn.o_proj", None),
                   ("ffn_up", "mlp.gate_up_proj", None), ("ffn_down", "mlp.down_proj", None))
    if kind == "qwen3_moe":  # the router and 3-D expert tensors [E, N, K], each expert's rows in turn
        linears = linears[:4]
        wr.add_tensor("blk.0.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
        half = gate_up.shape[1] // 2
        for g, w in (("gate", gate_up[:, :half]), ("up", gate_up[:, half:]), ("down", down)):
            wr.add_tensor(f"blk.0.ffn_{g}_exps.weight", q8(w), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for g, h, heads in linears:
        w = sd[p + h + ".weight"]
        if heads is not None and arch == "llama":
            w = permute(w, heads)
        wr.add_tensor(f"blk.0.{g}.weight", q8(w), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        if kind == "qwen2" and g in ("attn_q", "attn_k", "attn_v"):
            wr.add_tensor(f"blk.0.{g}.bias", sd[p + h + ".bias"])
    if kind in ("qwen3", "olmo2", "gemma3_text", "qwen3_moe"):  # llama.cpp's names for the q / k norms
        wr.add_tensor("blk.0.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
        wr.add_tensor("blk.0.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()

    got = loader.read_gguf_weights(path, cfg, torch.float32)
    parts = (("qkv_proj",) if kind == "phi3" else ("q_proj", "k_proj", "v_proj"))
    assert len(got["layers.0.qkv"]) == len(parts)
    for part, h in zip(got["layers.0.qkv"], parts):
        assert isinstance(part, QuantWeight) and part.fmt == 8
        assert np.array_equal(part.data.numpy(), q8(sd[p + f"self_attn.{h}.weight"]))  # HF order, blocks intact
    if "lm_head.weight" in sd:
        assert np.array_equal(got["lm_head"].data.numpy(), q8(sd["lm_head.weight"]))
    for g, h in names.items():  # every norm, under its turbospec name, as stored
        assert torch.equal(got["layers.0." + loader._GGUF_NORMS[cfg.norm_layout][g]], torch.from_numpy(sd[p + h + ".weight"]))
    if kind == "qwen2":
        want = torch.cat([torch.from_numpy(sd[p + f"self_attn.{x}_proj.bias"]) for x in "qkv"])
        assert torch.equal(got["layers.0.qkv_bias"], want)
    if kind in ("qwen3", "olmo2", "gemma3_text", "qwen3_moe"):
        for x in "qk":
            assert torch.equal(got[f"layers.0.{x}_norm"], torch.from_numpy(sd[p + f"self_attn.{x}_norm.weight"]))
    if kind in ("gemma2", "gemma3_text"):
        assert cfg.norm_layout == "sandwich"
    if kind == "qwen3_moe":
        e1 = got["layers.0.experts.1.gate_up"]
        assert len(e1) == 2 and all(isinstance(w, QuantWeight) for w in e1)
        assert np.array_equal(e1[1].data.numpy(), q8(gate_up[1, half:]))  # expert 1's up rows, blocks intact
    if kind in ("qwen3", "phi3", "olmo2", "gemma2", "gemma3_text", "qwen3_moe"):
        # and the model built from the GGUF's tensors computes what HF computes on the Q8_0 weights
        model = Transformer(cfg, got)
        ref = make_tiny_model(kind, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                              **(dict(mlp_only_layers=[], moe_intermediate_size=64) if kind == "qwen3_moe" else {}))
        ref.load_state_dict(loader.hf_state_dict(got, cfg), strict=False)
        ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
        out = model.forward(ids, torch.arange(6)[None], model.new_cache(8), 0)
        torch.testing.assert_close(out, ref(ids).logits.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
def test_int8_interleaved_layout_matches_spec_on_every_path(quant):
    """With int8 activations the Q4_0 / Q8_0 linears hold their blocks interleaved by 16 rows (the
    int8 kernels' layout): the bytes de-interleave to the exact model's, a linear of a layer equals
    reference.linear_int8, the whole forward is the same on every ISA path, and "exact" restores
    the exact model's logits."""
    from turbospec.ops import reference
    model = _model("llama", quant, torch.float32)
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    run = lambda: model.forward(ids, torch.arange(ids.shape[1])[None], model.new_cache(16), 0)
    exact = run()
    lin = model.layers[0].linears()[0]
    fmt0, w0 = lin.formats[0], lin.weights[0].clone()  # grouped (1000 + id) on the AVX-512 path
    base = {"q4_0": 2, "q8_0": 8}[quant]
    model.set_activations("int8")
    assert lin.formats == [2000 + base] and lin.weights[0].shape == w0.shape
    plain = reference.deinterleave_blocks(lin.weights[0], 2000 + base, lin.in_features)
    assert torch.equal(plain, reference.ungroup_blocks(w0, fmt0, lin.in_features) if fmt0 != base else w0)
    x = torch.randn(5, lin.in_features)
    assert torch.equal(lin(x), reference.linear_int8(x, lin.weights, lin.formats, lin.bias))
    outs = on_every_isa(run)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    assert not torch.equal(outs[0], exact)
    model.set_activations("exact")
    assert torch.equal(run(), exact)


def test_grouped_layout_follows_isa_and_activations():
    """The linears hold Q4_0 / Q8_0 blocks grouped (1000 + id) when built on the AVX-512 path with
    exact activations, in GGUF order on the other paths, interleaved (2000 + id) after
    ``set_activations("int8")`` on every path, back grouped after "exact"; the bytes are the same
    (ungrouped == as built on the AVX2 path) and so are the logits of every layout and path."""
    from turbospec.ops import reference
    if ops.cpu_isa() != "avx512":
        pytest.skip("grouped weights are used on the AVX-512 path only; this CPU has none")
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])

    def run(model):
        cache = model.new_cache(16)
        return model.forward(ids, torch.arange(ids.shape[1])[None], cache, 0)

    fmts = lambda m: [f for layer in m.layers for lin in layer.linears() for f in lin.formats] + m.lm_head.formats
    built = {}
    try:
        for isa in ("avx2", "avx512"):
            ops.cpu_isa(isa)
            built[isa] = _model("llama", "q4_0", torch.float32)
    finally:
        ops.cpu_isa("default")
    plain, grouped = built["avx2"], built["avx512"]
    assert set(fmts(plain)) == {2} and set(fmts(grouped)) == {1002}
    for lp, lg in zip([l for layer in plain.layers for l in layer.linears()],
                      [l for layer in grouped.layers for l in layer.linears()]):
        for wp, wg in zip(lp.weights, lg.weights):
            assert torch.equal(reference.ungroup_blocks(wg, 1002, lg.in_features), wp)
    want = run(plain)
    assert torch.equal(run(grouped), want)
    grouped.set_activations("int8")
    assert set(fmts(grouped)) == {2002}
    try:
        ops.cpu_isa("avx2")
        plain.set_activations("int8")
    finally:
        ops.cpu_isa("default")
    assert set(fmts(plain)) == {2002}
    assert torch.equal(run(grouped), run(plain))
    grouped.set_activations("exact")
    assert set(fmts(grouped)) == {1002}
    assert torch.equal(run(grouped), want)
