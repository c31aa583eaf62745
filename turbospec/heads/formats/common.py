"""What the checkpoint layouts share: file names, reading and writing directories, config files and
tensors, the Llama config fields of the EAGLE layouts, and the checked copy of tensors into a head
(``fill``). Nothing here knows one layout from another.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..config import HeadConfig
from ...model.rope import rope_parameters
from ...model.transformer import ModelConfig
from ...ops.checks import is_int

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # EAGLE's loader tries the .bin first

# Exported EAGLE configs need a max_position_embeddings; SGLang refuses a draft whose derived
# context length is shorter than the target's and vLLM caps the draft length by it, so be generous.
# (RoPE tables are computed on the fly; the number has no other effect.)
_EXPORT_MAX_POSITIONS = 131072


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------

def check_dir(path: str) -> None:
    """FileNotFoundError unless ``path`` is a directory."""
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"head checkpoint {path!r} {what} (a head is a directory with {CONFIG} "
                                f"and its weights)")


def read_config(path: str) -> tuple[dict, str]:
    """(the JSON object in ``path``/config.json, that file's path)."""
    cfg_file = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"head checkpoint {path!r}: missing {CONFIG}")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(raw).__name__}")
    return raw, cfg_file


def find_file(path: str, names: tuple[str, ...], layout: str) -> str:
    """The first of ``names`` present in ``path``; FileNotFoundError if none is."""
    for name in names:
        p = os.path.join(path, name)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"head checkpoint {path!r} ({layout} layout): missing weights, expected one of "
                            f"{', '.join(names)}")


def load_tensors(file: str) -> dict[str, Tensor]:
    """All tensors of a safetensors or PyTorch pickle file; a ValueError naming the file if it cannot
    be read (corrupt, truncated, not a state dict)."""
    try:
        if file.endswith(".safetensors"):
            state = load_file(file)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors' SafetensorError, zip / unpickling errors, ...
        kind = "safetensors" if file.endswith(".safetensors") else "PyTorch"
        raise ValueError(f"{file}: cannot read this {kind} weights file, it is corrupt or not a "
                         f"{kind} file ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{file}: expected a dict of named tensors, got {type(state).__name__}")
    return state


def save_tensors(state: dict[str, Tensor], file: str) -> None:
    """Write ``state`` (contiguous, on the CPU) as safetensors or, for any other suffix, a PyTorch pickle."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if file.endswith(".safetensors"):
        save_file(state, file, metadata={"format": "pt"})
    else:
        torch.save(state, file)


def write_json(obj: dict, file: str) -> None:
    with open(file, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def cast(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """``state`` with its floating tensors in ``dtype`` (integer and bool tensors as they are)."""
    return {k: v.to(dtype) if v.dtype.is_floating_point else v for k, v in state.items()}


# ----------------------------------------------------------------------------------------------
# config translation
# ----------------------------------------------------------------------------------------------

def get_int(raw: dict, key: str, cfg_file: str, default: int | None = None) -> int:
    """``raw[key]`` (else ``default``), checked to be a non-negative integer."""
    v = raw.get(key, default)
    if v is None:
        raise ValueError(f"{cfg_file}: missing field {key!r}")
    if not is_int(v) or v < 0:
        raise ValueError(f"{cfg_file}: field {key!r} = {v!r}, expected a non-negative integer")
    return v


def _rope(raw: dict, cfg_file: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling in turbospec's form) from a HF config (see ``rope_parameters``)."""
    try:
        return rope_parameters(raw)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None


def _rope_export(cfg: HeadConfig) -> dict | None:
    sc = cfg.rope_scaling
    if not sc:
        return None
    if sc.get("rope_type") == "linear":
        # EAGLE's EConfig accepts exactly {"type", "factor"}; transformers reads "type" as rope_type.
        return {"type": "linear", "factor": float(sc["factor"])}
    return dict(sc)


def check_llama_head_config(raw: dict, cfg_file: str, layout: str) -> None:
    """What turbospec's single-layer, bias-free Llama head cannot represent."""
    n = raw.get("num_hidden_layers", 1)
    if n != 1:
        raise ValueError(f"{cfg_file}: num_hidden_layers = {n!r}, expected 1 (turbospec's {layout} heads have "
                         f"exactly one decoder layer)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{cfg_file}: hidden_act = {act!r}, expected 'silu'")
    for key in ("qkv_bias", "attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ValueError(f"{cfg_file}: {key} = {raw[key]!r}: biases in the decoder layer are not supported "
                             f"(expected false or absent)")


def llama_dims(raw: dict, cfg_file: str) -> dict:
    """The HeadConfig fields of a Llama decoder layer, read from a HF Llama config."""
    h = get_int(raw, "hidden_size", cfg_file)
    nh = get_int(raw, "num_attention_heads", cfg_file)
    if nh == 0:
        raise ValueError(f"{cfg_file}: num_attention_heads = 0, expected >= 1")
    nkv = raw.get("num_key_value_heads") or nh
    head_dim = raw.get("head_dim") or h // nh  # EAGLE's cnets always use hidden_size // heads
    theta, scaling = _rope(raw, cfg_file)
    return dict(hidden_size=h, intermediate_size=get_int(raw, "intermediate_size", cfg_file),
                num_heads=nh, num_kv_heads=int(nkv), head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling)


def llama_export_config(cfg: HeadConfig, target_cfg: ModelConfig | None, dtype: torch.dtype) -> dict:
    """The HF Llama config fields of an exported EAGLE / EAGLE-3 head."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_export(cfg),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max(target_cfg.max_position_embeddings if target_cfg else 0,
                                       _EXPORT_MAX_POSITIONS),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def describe(cfg: HeadConfig) -> str:
    """``cfg``'s shape-defining fields, for error messages."""
    if cfg.method == "medusa":
        return (f"hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}, medusa_num_heads="
                f"{cfg.medusa_num_heads}, medusa_num_layers={cfg.medusa_num_layers}")
    s = (f"hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, num_heads={cfg.num_heads}, "
         f"num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, vocab_size={cfg.vocab_size}")
    if cfg.method == "eagle3":
        s += f", draft_vocab_size={cfg.draft_vocab_size}, feature_layers={cfg.feature_layers}"
    return s


# ----------------------------------------------------------------------------------------------
# tensors into a head
# ----------------------------------------------------------------------------------------------

def fill(head: nn.Module, state: dict[str, Tensor], w_file: str, what: str) -> None:
    """Copy ``state`` into ``head`` after checking names, shapes and dtype kinds."""
    expected = head.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        k = missing[0]
        raise ValueError(f"{w_file}: missing tensor(s) {missing[:6]} (e.g. {k!r} of shape "
                         f"{list(expected[k].shape)}) for a {what}")
    unexpected = sorted(k for k in state if k not in expected)
    if unexpected:
        raise ValueError(f"{w_file}: unexpected tensor(s) {unexpected[:6]} for a {what}")
    for k, ref in expected.items():
        t = state[k]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{w_file}: tensor {k!r} has shape {list(t.shape)}, expected {list(ref.shape)} "
                             f"for a {what}")
        if ref.dtype.is_floating_point != t.dtype.is_floating_point:
            raise ValueError(f"{w_file}: tensor {k!r} has dtype {t.dtype}, expected a "
                             f"{'floating' if ref.dtype.is_floating_point else 'integer/bool'} tensor")
    head.load_state_dict({k: state[k] for k in expected}, strict=True)


def make_lm_heads(head: nn.Module, n: int, hidden: int, vocab: int) -> None:
    """Give a Medusa head ``n`` LM heads of its own (hidden -> vocab), in place of the target's."""
    head.lm_heads = nn.ModuleList([nn.Linear(hidden, vocab, bias=False) for _ in range(n)])


def pop_zero_bias(state: dict, key: str, w_file: str, why: str) -> None:
    """Drop ``state[key]`` if present; ValueError (with ``why``) if it is not all zeros."""
    t = state.pop(key, None)
    if t is not None and bool(t.count_nonzero()):
        raise ValueError(f"{w_file}: tensor {key!r} is not zero but {why}")
