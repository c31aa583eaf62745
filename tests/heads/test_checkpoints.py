"""Draft-head checkpoints: turbospec's format and the published EAGLE-1/2, EAGLE-3 and Medusa layouts.

Foreign checkpoints are written by hand here, with the tensor names and config fields the public tools
write (SafeAILab/EAGLE, SpecForge / vLLM / SGLang for EAGLE-3, FasterDecoding/Medusa), then loaded with
``load_head``: the parameters must be the tensors written, and the head's forward must match a small
reference of the published architecture written from scratch below. Round trips go through
``export_head``. CPU only, tiny shapes.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from turbospec.heads.config import HeadConfig, check_head_compatible
from turbospec.heads.formats import (detect_layout, eagle3_default_feature_layers,
                                   export_head, load_head, save_head)
from turbospec.model.transformer import ModelConfig

H, NH, NKV, HD, I, V = 64, 4, 2, 16, 128, 256
MF = "medusa_lm_head.safetensors"


def tiny_cfg(num_layers: int = 6, **kw) -> ModelConfig:
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=num_layers, num_heads=NH,
                num_kv_heads=NKV, head_dim=HD, rms_norm_eps=1e-6, rope_theta=10000.0)
    base.update(kw)
    return ModelConfig(**base)


def rnd(*shape, seed: int, scale: float = 0.2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g)


def norm_w(seed: int) -> torch.Tensor:
    return 1.0 + rnd(H, seed=seed, scale=0.2)


def llama_config(**extra) -> dict:
    """A config.json as the EAGLE repo ships them (a Llama config of the one-layer head)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": H, "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
           "vocab_size": V, "max_position_embeddings": 2048, "torch_dtype": "float16",
           "transformers_version": "4.28.1", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    cfg.update(extra)
    return cfg


def layer_tensors(prefix: str, in_dim: int, seed: int) -> dict:
    return {f"{prefix}self_attn.q_proj.weight": rnd(NH * HD, in_dim, seed=seed),
            f"{prefix}self_attn.k_proj.weight": rnd(NKV * HD, in_dim, seed=seed + 1),
            f"{prefix}self_attn.v_proj.weight": rnd(NKV * HD, in_dim, seed=seed + 2),
            f"{prefix}self_attn.o_proj.weight": rnd(H, NH * HD, seed=seed + 3),
            f"{prefix}post_attention_layernorm.weight": norm_w(seed + 4),
            f"{prefix}mlp.gate_proj.weight": rnd(I, H, seed=seed + 5),
            f"{prefix}mlp.up_proj.weight": rnd(I, H, seed=seed + 6),
            f"{prefix}mlp.down_proj.weight": rnd(H, I, seed=seed + 7)}


def eagle1_tensors(bias: bool = True) -> dict:
    t = {"fc.weight": rnd(H, 2 * H, seed=1), "embed_tokens.weight": rnd(V, H, seed=2)}
    if bias:
        t["fc.bias"] = rnd(H, seed=3)
    t.update(layer_tensors("layers.0.", H, seed=10))
    return t


def draft_ids(dv: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.sort(torch.randperm(V, generator=g)[:dv]).values


def eagle3_tensors(dv: int = 96, prefix: str = "midlayer.") -> dict:
    ids = draft_ids(dv)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t = {"fc.weight": rnd(H, 3 * H, seed=21), "norm.weight": norm_w(22), "lm_head.weight": rnd(dv, H, seed=23),
         "d2t": ids - torch.arange(dv), "t2d": t2d, "embed_tokens.weight": rnd(V, H, seed=24),
         f"{prefix}input_layernorm.weight": norm_w(25), f"{prefix}hidden_norm.weight": norm_w(26)}
    t.update(layer_tensors(prefix, 2 * H, seed=30))
    return t


def eagle3_config(dv: int = 96, **extra) -> dict:
    """As SpecForge / the EAGLE-3 releases write it."""
    cfg = llama_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv, tie_word_embeddings=False)
    cfg.update(extra)
    return cfg


def read_json(dirpath) -> dict:
    with open(os.path.join(dirpath, "config.json")) as f:
        return json.load(f)


def write(dirpath, config: dict | None, tensors: dict | None, weights: str = "model.safetensors"):
    os.makedirs(dirpath, exist_ok=True)
    if config is not None:
        with open(os.path.join(dirpath, "config.json"), "w") as f:
            json.dump(config, f)
    if tensors is not None:
        path = os.path.join(dirpath, weights)
        if weights.endswith(".safetensors"):
            from safetensors.torch import save_file
            save_file({k: v.clone().contiguous() for k, v in tensors.items()}, path)  # no shared storage
        else:
            torch.save(tensors, path)
    return str(dirpath)


# ---- a from-scratch reference of the published architectures (EAGLE's cnets / cnets1, Medusa) ----

def ref_rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_layer(t: dict, p: str, attn_in: torch.Tensor, residual: torch.Tensor, pos: torch.Tensor):
    b, n, _ = attn_in.shape
    q = (attn_in @ t[p + "self_attn.q_proj.weight"].T).view(b, n, NH, HD).transpose(1, 2)
    k = (attn_in @ t[p + "self_attn.k_proj.weight"].T).view(b, n, NKV, HD).transpose(1, 2)
    v = (attn_in @ t[p + "self_attn.v_proj.weight"].T).view(b, n, NKV, HD).transpose(1, 2)
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]

    def rot(x):
        return torch.cat((-x[..., HD // 2:], x[..., :HD // 2]), -1)

    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(HD)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, NH * HD) @ t[p + "self_attn.o_proj.weight"].T
    h = residual + o
    m = ref_rms(h, t[p + "post_attention_layernorm.weight"])
    m = (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
        @ t[p + "mlp.down_proj.weight"].T
    return h + m


def ref_eagle1(t, feat, emb, pos):
    g = torch.cat((emb, feat), -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
    return ref_layer(t, "layers.0.", g, g, pos)  # layer 0: no input norm


def ref_eagle3(t, feats, emb, pos):
    g = feats @ t["fc.weight"].T
    x = torch.cat((ref_rms(emb, t["midlayer.input_layernorm.weight"]),
                   ref_rms(g, t["midlayer.hidden_norm.weight"])), -1)
    out = ref_layer(t, "midlayer.", x, g, pos)
    return out, ref_rms(out, t["norm.weight"]) @ t["lm_head.weight"].T


def inputs(feat_dim: int, n: int = 5, seed: int = 99):
    return rnd(1, n, feat_dim, seed=seed, scale=1.0), rnd(1, n, H, seed=seed + 1, scale=1.0), \
        torch.arange(n)[None]


def assert_state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def random_head(cfg: HeadConfig, seed: int = 0):
    from turbospec.heads.formats import build_head
    head = build_head(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g) + (1.0 if "norm" in name else 0.0))
    if cfg.method == "eagle3" and (cfg.draft_vocab_size or V) < V:
        head.set_draft_vocab(draft_ids(cfg.draft_vocab_size))
    return head.eval()


# ---------------------------------------------------------------------------------------------------
# EAGLE-1/2
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights,bias", [("pytorch_model.bin", True), ("model.safetensors", False)])
def test_load_eagle1(tmp_path, weights, bias):
    t = eagle1_tensors(bias=bias)
    cfg = llama_config() if bias else llama_config(bias=False)  # EAGLE's default is bias=True
    path = write(tmp_path / "e1", cfg, t, weights)
    assert detect_layout(path) == "eagle"
    head = load_head(path, target_cfg=tiny_cfg())
    assert head.cfg.method == "eagle" and head.cfg.fc_bias == bias
    sd = head.state_dict()
    for k, v in t.items():
        if k != "embed_tokens.weight":  # the target's embedding is used
            assert torch.equal(sd[k], v), k
    assert "embed_tokens.weight" in head.extra["ignored_tensors"]
    feat, emb, pos = inputs(H)
    with torch.no_grad():
        out = head(feat, emb, pos)
    torch.testing.assert_close(out, ref_eagle1(t, feat, emb, pos), rtol=1e-5, atol=1e-5)
    # the same head built by hand gives bit-identical outputs
    direct = random_head(HeadConfig.for_target("eagle", tiny_cfg(), fc_bias=bias))
    direct.load_state_dict({k: v for k, v in t.items() if k != "embed_tokens.weight"})
    with torch.no_grad():
        assert torch.equal(out, direct(feat, emb, pos))


def test_eagle1_input_layernorm_ignored_with_warning(tmp_path):
    t = eagle1_tensors()
    t["layers.0.input_layernorm.weight"] = norm_w(5)
    path = write(tmp_path / "e1", llama_config(), t)
    with pytest.warns(UserWarning, match="input_layernorm"):
        head = load_head(path)
    assert "layers.0.input_layernorm.weight" in head.extra["ignored_tensors"]
    feat, emb, pos = inputs(H)
    with torch.no_grad():
        torch.testing.assert_close(head(feat, emb, pos), ref_eagle1(t, feat, emb, pos), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fc_bias", [True, False])
def test_roundtrip_eagle(tmp_path, fc_bias):
    head = random_head(HeadConfig.for_target("eagle", tiny_cfg(), fc_bias=fc_bias))
    out = export_head(head, str(tmp_path / "x"), "eagle", target_cfg=tiny_cfg())
    conf = read_json(out)
    assert conf["architectures"][0] == "LlamaForCausalLMEagle" and "EagleLlamaForCausalLM" in conf["architectures"]
    assert conf["num_hidden_layers"] == 1 and conf["model_type"] == "llama" and conf["bias"] is fc_bias
    from safetensors.torch import load_file
    written = load_file(os.path.join(out, "model.safetensors"))
    assert "fc.bias" in written  # zeros when the head has none (SGLang's fc always has a bias)
    loaded = load_head(out, target_cfg=tiny_cfg())
    assert loaded.cfg == head.cfg
    assert_state_equal(head, loaded)
    feat, emb, pos = inputs(H)
    with torch.no_grad():
        assert torch.equal(head(feat, emb, pos), loaded(feat, emb, pos))


# ---------------------------------------------------------------------------------------------------
# EAGLE-3
# ---------------------------------------------------------------------------------------------------

def test_eagle3_default_feature_layers():
    # HF hidden_states indices [2, L//2, L-3] = outputs of layers [1, L//2-1, L-4]
    assert eagle3_default_feature_layers(32) == [1, 15, 28]
    assert eagle3_default_feature_layers(8) == [1, 3, 4]
    assert eagle3_default_feature_layers(7) == [1, 2, 3]
    for n in (4, 5, 6):
        with pytest.raises(ValueError, match="needs num_layers >= 7"):
            eagle3_default_feature_layers(n)
    # the same layers as HeadConfig.for_target picks for a deep target
    assert HeadConfig.for_target("eagle3", tiny_cfg(32)).feature_layers == [1, 15, 28]


@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0."])
def test_load_eagle3_default_layers(tmp_path, prefix):
    t = eagle3_tensors(prefix=prefix)
    path = write(tmp_path / "e3", eagle3_config(), t)
    assert detect_layout(path) == "eagle3"
    target = tiny_cfg(8)
    head = load_head(path, target_cfg=target)
    assert head.cfg.method == "eagle3" and head.cfg.feature_layers == [1, 3, 4]
    assert head.cfg.draft_vocab_size == 96
    sd = head.state_dict()
    t = {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in t.items()}
    for k, v in t.items():
        if k != "embed_tokens.weight":
            assert torch.equal(sd[k], v), k
    assert torch.equal(head.draft_vocab_ids(), draft_ids())
    feats, emb, pos = inputs(3 * H)
    with torch.no_grad():
        out = head(feats, emb, pos)
        logits = head.logits(out)
    ref_out, ref_logits = ref_eagle3(t, feats, emb, pos)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key,value,expected", [
    ("eagle_aux_hidden_state_layer_ids", [1, 3, 5], [0, 2, 4]),              # vLLM: stream entering layer j
    ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}, [0, 2, 4]),  # SGLang/SpecForge: outputs
    ("eagle_aux_hidden_state_layer_ids", [5, 1, 3], [0, 2, 4]),              # any order: captured in layer order
])
def test_load_eagle3_named_layers(tmp_path, key, value, expected):
    path = write(tmp_path / "e3", eagle3_config(**{key: value}), eagle3_tensors())
    head = load_head(path)  # no target_cfg needed: the checkpoint names its layers
    assert head.cfg.feature_layers == expected
    check_head_compatible(head, tiny_cfg(6))


def test_load_eagle3_full_vocab_without_d2t(tmp_path):
    t = eagle3_tensors(dv=V)
    del t["d2t"], t["t2d"]  # EAGLE drops them when draft vocab == vocab
    path = write(tmp_path / "e3", eagle3_config(dv=V), t)
    head = load_head(path, target_cfg=tiny_cfg(8))
    assert head.cfg.draft_vocab_size == 0  # HeadConfig's "full vocabulary"
    assert torch.equal(head.draft_vocab_ids(), torch.arange(V)) and bool(head.t2d.all())


def test_load_dtype(tmp_path):
    path = write(tmp_path / "e3", eagle3_config(), eagle3_tensors())
    head = load_head(path, dtype=torch.bfloat16, target_cfg=tiny_cfg(8))
    assert head.fc.weight.dtype == torch.bfloat16 and head.d2t.dtype == torch.int64 and head.t2d.dtype == torch.bool


@pytest.mark.parametrize("layers", [[1, 3, 4], [4, 0, 2]])
def test_roundtrip_eagle3(tmp_path, layers):
    head = random_head(HeadConfig.for_target("eagle3", tiny_cfg(8), feature_layers=layers, draft_vocab_size=96))
    out = export_head(head, str(tmp_path / "x"), "eagle3", target_cfg=tiny_cfg(8))
    conf = read_json(out)
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == 96
    assert conf["vocab_size"] == V and conf["target_hidden_size"] == H and conf["tie_word_embeddings"] is False
    s = sorted(layers)
    assert conf["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in s]
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == s
    loaded = load_head(out, target_cfg=tiny_cfg(8))
    assert loaded.cfg.feature_layers == s
    assert loaded.cfg == HeadConfig(**{**vars(head.cfg), "feature_layers": s})
    feats = {i: rnd(1, 5, H, seed=200 + i, scale=1.0) for i in range(8)}
    _, emb, pos = inputs(H)
    with torch.no_grad():
        a = head(torch.cat([feats[i] for i in layers], -1), emb, pos)
        b = loaded(torch.cat([feats[i] for i in s], -1), emb, pos)
    if layers == s:
        assert_state_equal(head, loaded)
        assert torch.equal(a, b)
        with torch.no_grad():
            assert torch.equal(head.logits(a), loaded.logits(b))
    else:  # fc's input blocks were permuted into layer order: same function, summed in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


# ---------------------------------------------------------------------------------------------------
# Medusa
# ---------------------------------------------------------------------------------------------------

def medusa_tensors(k: int = 3, n_layers: int = 1, lm: bool = True) -> dict:
    t = {}
    for i in range(k):
        w, b = rnd(H, H, seed=50 + i), rnd(H, seed=60 + i)
        for j in range(n_layers):  # Medusa's [ResBlock(h)] * n: the same module repeated
            t[f"{i}.{j}.linear.weight"], t[f"{i}.{j}.linear.bias"] = w, b
        if lm:
            t[f"{i}.{n_layers}.weight"] = rnd(V, H, seed=70 + i)
    return t


def ref_medusa(t, k, n_layers, x):
    outs, logits = [], []
    for i in range(k):
        y = x
        for j in range(n_layers):
            y = y + F.silu(y @ t[f"{i}.{j}.linear.weight"].T + t[f"{i}.{j}.linear.bias"])
        outs.append(y)
        if f"{i}.{n_layers}.weight" in t:
            logits.append(y @ t[f"{i}.{n_layers}.weight"].T)
    return torch.stack(outs), logits


@pytest.mark.parametrize("weights,n_layers", [("medusa_lm_head.safetensors", 1), ("medusa_lm_head.pt", 2)])
def test_load_medusa(tmp_path, weights, n_layers):
    t = medusa_tensors(3, n_layers)
    conf = {"medusa_num_heads": 3, "medusa_num_layers": n_layers, "base_model_name_or_path": "tiny/target",
            "transformers_version": "4.34.0"}  # Medusa's config has no hidden_size / vocab_size
    path = write(tmp_path / "m", conf, t, weights)
    assert detect_layout(path) == "medusa"
    head = load_head(path, target_cfg=tiny_cfg())
    assert head.cfg.medusa_num_heads == 3 and head.cfg.medusa_num_layers == n_layers
    assert head.cfg.hidden_size == H and head.cfg.vocab_size == V and head.cfg.target == "tiny/target"
    for i in range(3):
        for j in range(n_layers):
            assert torch.equal(head.blocks[i][j].linear.weight, t[f"{i}.{j}.linear.weight"])
            assert torch.equal(head.blocks[i][j].linear.bias, t[f"{i}.{j}.linear.bias"])
        assert torch.equal(head.lm_heads[i].weight, t[f"{i}.{n_layers}.weight"])
    x = rnd(1, 4, H, seed=5, scale=1.0)
    ref_out, ref_logits = ref_medusa(t, 3, n_layers, x)
    with torch.no_grad():
        out = head(x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        for i in range(3):
            torch.testing.assert_close(head.lm_heads[i](out[i]), ref_logits[i], rtol=1e-5, atol=1e-5)


def test_load_medusa_legacy_without_lm_heads(tmp_path):
    t = medusa_tensors(2, lm=False)
    path = write(tmp_path / "m", {"medusa_num_heads": 2, "medusa_num_layers": 1}, t, "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="cannot tell the vocabulary size.*pass target_cfg"):
        load_head(path)
    head = load_head(path, target_cfg=tiny_cfg())
    assert head.lm_heads is None and head.cfg.vocab_size == V


def test_medusa_config_head_count_is_overridden_by_weights(tmp_path):
    path = write(tmp_path / "m", {"medusa_num_heads": 2, "medusa_num_layers": 1}, medusa_tensors(4), MF)
    with pytest.warns(UserWarning, match="medusa_num_heads = 2 but .* holds 4 heads"):
        head = load_head(path, target_cfg=tiny_cfg())
    assert head.cfg.medusa_num_heads == 4


def test_roundtrip_medusa(tmp_path):
    cfg = HeadConfig.for_target("medusa", tiny_cfg(), medusa_num_heads=3, medusa_num_layers=2, target="t")
    head = random_head(cfg)
    lm = rnd(V, H, seed=3)
    x = rnd(2, 3, H, seed=4, scale=1.0)
    # shared target LM head -> written as every head's own LM head
    out = export_head(head, str(tmp_path / "a"), "medusa", medusa_lm_head=lm)
    conf = read_json(out)
    assert conf["medusa_num_heads"] == 3 and conf["medusa_num_layers"] == 2 and conf["base_model_name_or_path"] == "t"
    loaded = load_head(out, target_cfg=tiny_cfg())
    assert all(torch.equal(lin.weight, lm) for lin in loaded.lm_heads)
    with torch.no_grad():
        assert torch.equal(head(x), loaded(x))
    # a head with its own LM heads, through medusa_lm_head.pt
    out2 = export_head(loaded, str(tmp_path / "b"), "medusa", medusa_file="medusa_lm_head.pt")
    again = load_head(out2, target_cfg=tiny_cfg())
    assert_state_equal(loaded, again)
    # no LM head at all: the legacy layout, with a warning
    with pytest.warns(UserWarning, match="medusa_lm_head"):
        out3 = export_head(head, str(tmp_path / "c"), "medusa")
    legacy = load_head(out3, target_cfg=tiny_cfg())
    assert legacy.lm_heads is None
    assert_state_equal(head, legacy)


def test_turbospec_format_keeps_medusa_lm_heads(tmp_path):
    path = write(tmp_path / "m", {"medusa_num_heads": 2, "medusa_num_layers": 1}, medusa_tensors(2), MF)
    head = load_head(path)
    save_head(head, str(tmp_path / "own"), extra={"note": "x"})
    assert detect_layout(str(tmp_path / "own")) == "turbospec"
    again = load_head(str(tmp_path / "own"))
    assert_state_equal(head, again)
    assert again.extra == {"note": "x"}


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------

def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_head(str(tmp_path / "nope"))
    path = write(tmp_path / "a", None, eagle1_tensors())
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_head(path)
    path = write(tmp_path / "b", llama_config(), None)
    with pytest.raises(FileNotFoundError, match="missing weights.*model.safetensors"):
        load_head(path)
    path = write(tmp_path / "c", {"medusa_num_heads": 2}, None)
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors, medusa_lm_head.pt"):
        load_head(path)
    path = write(tmp_path / "d", {"turbospec_head": {"method": "eagle", "hidden_size": H, "vocab_size": V}}, None)
    with pytest.raises(FileNotFoundError, match="missing weights"):
        load_head(path)


def test_unknown_layouts(tmp_path):
    head = random_head(HeadConfig.for_target("eagle", tiny_cfg()))
    with pytest.raises(ValueError, match="unknown export layout 'hydra'.*eagle, eagle3, medusa"):
        export_head(head, str(tmp_path / "x"), "hydra")
    with pytest.raises(ValueError, match="layout 'eagle3' needs a 'eagle3' head.*'eagle'"):
        export_head(head, str(tmp_path / "x"), "eagle3")
    path = write(tmp_path / "e1", llama_config(), eagle1_tensors())
    with pytest.raises(ValueError, match="unknown head layout 'hydra'"):
        load_head(path, layout="hydra")
    path = write(tmp_path / "junk", {"foo": 1}, {"some.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="cannot tell its layout"):
        load_head(path)


def test_bad_config_and_corrupt_weights(tmp_path):
    path = write(tmp_path / "a", None, eagle1_tensors())
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_head(path)
    path = write(tmp_path / "b", llama_config(), None)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match=r"model.safetensors: cannot read this safetensors weights file, "
                                         r"it is corrupt"):
        load_head(path)
    # a truncated file (the last bytes of a valid one cut off)
    good = write(tmp_path / "c", llama_config(), eagle1_tensors())
    with open(os.path.join(good, "model.safetensors"), "rb") as f:
        blob = f.read()
    with open(os.path.join(good, "model.safetensors"), "wb") as f:
        f.write(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="cannot read this safetensors"):
        load_head(good)
    path = write(tmp_path / "d", {"medusa_num_heads": 2}, None)
    with open(os.path.join(path, "medusa_lm_head.pt"), "wb") as f:
        f.write(b"not a zip")
    with pytest.raises(ValueError, match="medusa_lm_head.pt: cannot read this PyTorch weights file"):
        load_head(path)


def test_wrong_shapes(tmp_path):
    t = eagle1_tensors()
    t["layers.0.self_attn.q_proj.weight"] = rnd(48, H, seed=1)
    path = write(tmp_path / "a", llama_config(), t)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'layers.0.self_attn.q_proj.weight' has shape "
                                         r"\[48, 64\], expected \[64, 64\]"):
        load_head(path)
    # config says hidden 128, weights are 64 wide
    path = write(tmp_path / "b", llama_config(hidden_size=128), eagle1_tensors())
    with pytest.raises(ValueError, match=r"tensor 'fc.weight' has shape \[64, 128\], expected \[128, 256\]"):
        load_head(path)
    t = eagle3_tensors()
    t["fc.weight"] = rnd(H, 2 * H, seed=1)
    path = write(tmp_path / "c", eagle3_config(), t)
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \[64, 128\]: 128 input features, expected 3 x "
                                         r"hidden_size 64 = 192"):
        load_head(path, target_cfg=tiny_cfg(8))
    t = eagle3_tensors()
    t["lm_head.weight"] = rnd(100, H, seed=1)
    path = write(tmp_path / "d", eagle3_config(), t)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \[100, 64\], expected \[96, 64\]"):
        load_head(path, target_cfg=tiny_cfg(8))
    t = medusa_tensors(2)
    t["1.0.linear.bias"] = rnd(H + 1, seed=1)
    path = write(tmp_path / "e", {"medusa_num_heads": 2, "medusa_num_layers": 1}, t, MF)
    with pytest.raises(ValueError, match=r"'blocks.1.0.linear.bias' has shape \[65\], expected \[64\]"):
        load_head(path)
    path = write(tmp_path / "f", {"medusa_num_heads": 2, "medusa_num_layers": 1}, medusa_tensors(2, n_layers=2), MF)
    with pytest.raises(ValueError, match=r"unexpected tensor '0\.1\.linear\.bias' for medusa_num_layers = 1"):
        load_head(path)
    t = eagle1_tensors()
    del t["layers.0.mlp.down_proj.weight"]
    path = write(tmp_path / "g", llama_config(), t)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['layers.0.mlp.down_proj.weight'\]"):
        load_head(path)


def test_unsupported_configs(tmp_path):
    path = write(tmp_path / "a", llama_config(num_hidden_layers=2), eagle1_tensors())
    with pytest.raises(ValueError, match="num_hidden_layers = 2, expected 1"):
        load_head(path)
    path = write(tmp_path / "b", llama_config(qkv_bias=True), eagle1_tensors())
    with pytest.raises(ValueError, match="qkv_bias"):
        load_head(path)
    path = write(tmp_path / "c", llama_config(bias=True), eagle1_tensors(bias=False))
    with pytest.raises(ValueError, match="bias = true but model.safetensors has no 'fc.bias'"):
        load_head(path)
    path = write(tmp_path / "d", llama_config(rope_scaling={"type": "dynamic", "factor": 2.0}), eagle1_tensors())
    with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported"):
        load_head(path)
    path = write(tmp_path / "e", eagle3_config(target_hidden_size=128), eagle3_tensors())
    with pytest.raises(ValueError, match="target_hidden_size = 128 != hidden_size = 64"):
        load_head(path, target_cfg=tiny_cfg(8))


def test_eagle3_feature_layer_errors(tmp_path):
    path = write(tmp_path / "a", eagle3_config(), eagle3_tensors())
    with pytest.raises(ValueError, match="does not name its target layers.*pass target_cfg"):
        load_head(path)
    with pytest.raises(ValueError, match="a target with 6 layers has no EAGLE-3 default feature layers"):
        load_head(path, target_cfg=tiny_cfg(6))
    path = write(tmp_path / "b", eagle3_config(eagle_aux_hidden_state_layer_ids=[2, 4, 6],
                                               eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}),
                 eagle3_tensors())
    with pytest.raises(ValueError, match="disagree"):
        load_head(path)
    path = write(tmp_path / "c", eagle3_config(eagle_aux_hidden_state_layer_ids=[1, 3, 9]), eagle3_tensors())
    with pytest.raises(ValueError, match=r"EAGLE-3 feature layer\(s\) \[8\] .* outside the target's 6 layers"):
        load_head(path, target_cfg=tiny_cfg(6))
    t = eagle3_tensors()
    t["t2d"] = t["t2d"].clone()
    t["t2d"][int(torch.nonzero(~t["t2d"])[0])] = True
    path = write(tmp_path / "d", eagle3_config(eagle_aux_hidden_state_layer_ids=[2, 3, 4]), t)
    with pytest.raises(ValueError, match="'t2d' and 'd2t' disagree"):
        load_head(path)
    t = eagle3_tensors()
    t["d2t"] = t["d2t"] + 200
    path = write(tmp_path / "e", eagle3_config(eagle_aux_hidden_state_layer_ids=[2, 3, 4]), t)
    with pytest.raises(ValueError, match="'d2t' maps draft ids to target ids outside"):
        load_head(path)
    head = random_head(HeadConfig.for_target("eagle3", tiny_cfg(6)))  # [1, 2]: only two distinct layers
    with pytest.raises(ValueError, match="exactly 3 distinct target layers"):
        export_head(head, str(tmp_path / "x"), "eagle3")


def test_check_head_compatible(tmp_path):
    big = tiny_cfg(30, hidden_size=576, vocab_size=49152)
    eagle = random_head(HeadConfig.for_target("eagle", tiny_cfg()))
    with pytest.raises(ValueError, match="head hidden_size 64 != target hidden_size 576"):
        check_head_compatible(eagle, big)
    with pytest.raises(ValueError, match="head vocab_size 256 != target vocab_size 300"):
        check_head_compatible(eagle, tiny_cfg(vocab_size=300))
    e3 = random_head(HeadConfig.for_target("eagle3", tiny_cfg(12), draft_vocab_size=96))
    check_head_compatible(e3, tiny_cfg(12))
    with pytest.raises(ValueError, match=r"EAGLE-3 feature layer\(s\) \[5, 8\] .* outside the target's 4 layers"):
        check_head_compatible(e3, tiny_cfg(4))
    med = load_head(write(tmp_path / "m", {"medusa_num_heads": 2}, medusa_tensors(2), MF))
    with pytest.raises(ValueError, match="head vocab_size 256 != target vocab_size 300"):
        check_head_compatible(med, tiny_cfg(vocab_size=300))
    # load_head and export_head check when given a target
    path = export_head(eagle, str(tmp_path / "e"), "eagle")
    with pytest.raises(ValueError, match="head hidden_size 64 != target hidden_size 576"):
        load_head(path, target_cfg=big)
    with pytest.raises(ValueError, match="head hidden_size 64 != target hidden_size 576"):
        export_head(eagle, str(tmp_path / "f"), "eagle", target_cfg=big)
