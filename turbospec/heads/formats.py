"""Saving, loading and exporting draft heads, in turbospec's own format and in the published ones.

``load_head(path)`` reads a local directory (nothing is ever downloaded) and tells the layout from its
files; ``export_head(head, out_dir, layout)`` writes one. Layouts:

- ``"turbospec"``: ``config.json`` = ``{"turbospec_head": HeadConfig, "turbospec_extra": {...}}`` and
  ``model.safetensors`` = the head's own state dict (names as in ``eagle.py`` / ``medusa.py``).

- ``"eagle"`` (EAGLE-1/2). Read by SafeAILab/EAGLE ``eagle/model/ea_model.py`` (``EaModel``: config
  via ``configs.EConfig``, ``bias`` key, ``pytorch_model.bin`` else ``model.safetensors``, loaded
  non-strictly into ``cnets1.Model``), vLLM ``vllm/model_executor/models/llama_eagle.py``
  (``EagleLlamaForCausalLM``; ``transformers_utils/configs/eagle.py`` renames the architecture
  ``X`` to ``EagleX``) and SGLang ``python/sglang/srt/models/llama_eagle.py``
  (``LlamaForCausalLMEagle``). ``config.json`` is a Llama config (``model_type`` "llama",
  ``num_hidden_layers`` 1, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``,
  ``vocab_size``, ``bias`` = fc has a bias). Tensors: ``fc.weight`` [H, 2H] (+ ``fc.bias``) over
  cat(embedding, feature), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.post_attention_layernorm.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``.
  Exported with ``architectures`` ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]: SGLang
  resolves the first, vLLM (whose rename leaves names starting with "Eagle" alone) the second.
  A head without fc bias is written with ``bias: false`` plus an all-zero ``fc.bias``: the EAGLE repo
  (non-strict) and vLLM (no fc bias; unknown names skipped) ignore it, SGLang (whose fc always has a
  bias) needs it. Note that vLLM's EAGLE-1 fc has no bias at all, so a head whose fc bias is not
  zero is only served exactly by the EAGLE repo and SGLang.

- ``"eagle3"``. Read by SafeAILab/EAGLE ``eagle/model/cnets.py`` (``Model``: ``midlayer`` =
  ``LlamaDecoderLayeremb``, ``d2t``/``t2d`` buffers), vLLM
  ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``, registered under
  "LlamaForCausalLMEagle3" too; ``midlayer.`` -> ``layers.0.``, ``d2t`` -> ``draft_id_to_target_id``,
  ``t2d`` skipped) and SGLang ``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``;
  ``d2t`` -> hot token ids). ``config.json``: Llama fields as above plus ``architectures``
  ["LlamaForCausalLMEagle3"], ``draft_vocab_size``, ``vocab_size`` (the target's), ``target_hidden_size``,
  ``tie_word_embeddings`` false, ``bias`` false (vLLM also reads it as the attention bias),
  ``norm_before_residual`` false, and the feature layers twice, in each reader's convention (see
  ``eagle3_default_feature_layers``): top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM,
  ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``: id j = the residual stream entering layer j)
  and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang ``model_runner`` ->
  ``LlamaForCausalLM.set_eagle3_layers_to_capture``, which adds 1: 0-based layer outputs).
  Tensors: ``fc.weight`` [H, 3H], ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2H], ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` [draft_vocab, H],
  ``d2t`` int64 [draft_vocab] (target id = draft id + d2t[draft id]), ``t2d`` bool [vocab].
  On import ``layers.0.*`` is accepted for ``midlayer.*`` (as vLLM does).

- ``"medusa"``. Read by FasterDecoding/Medusa ``medusa/model/medusa_model.py`` (``MedusaConfig``;
  ``MedusaModelABC.from_pretrained`` loads ``medusa_lm_head.pt`` non-strictly into ``medusa_head`` =
  ModuleList of Sequential(ResBlock x medusa_num_layers, Linear(H, V, bias=False))) and written by
  ``medusa/train/train_legacy.py`` (``medusa_lm_head.safetensors``). ``config.json``:
  ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path`` (we add ``hidden_size``,
  ``vocab_size``). Tensors: ``{i}.{j}.linear.weight`` [H, H] / ``.bias`` [H] for j < medusa_num_layers
  and ``{i}.{medusa_num_layers}.weight`` [V, H], head i's own LM head (absent in the legacy layout,
  ``medusa_model_legacy.py``, which uses the target's). vLLM's ``models/medusa.py`` uses other names
  (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``) and is not targeted.

Foreign checkpoints do not carry turbospec's HeadConfig: it is rebuilt from config.json and the tensor
shapes; every tensor is checked against it (ValueError naming the file, tensor, shape and the
expectation). ``check_head_compatible(head, target_cfg)`` checks a head against a target.
"""
from __future__ import annotations

import json
import os
import re
import warnings

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .config import HeadConfig, check_head_compatible
from .eagle import EagleHead
from .medusa import MedusaHeads
from ..model.rope import rope_parameters
from ..model.transformer import ModelConfig

LAYOUTS = ("turbospec", "eagle", "eagle3", "medusa")
EXPORT_LAYOUTS = ("eagle", "eagle3", "medusa")

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # EAGLE's loader tries the .bin first
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")

# Exported EAGLE configs need a max_position_embeddings; SGLang refuses a draft whose derived
# context length is shorter than the target's and vLLM caps the draft length by it, so be generous.
# (RoPE tables are computed on the fly; the number has no other effect.)
_EXPORT_MAX_POSITIONS = 131072


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------

def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"head checkpoint {path!r} {what} (a head is a directory with {CONFIG} "
                                f"and its weights)")


def _read_config(path: str) -> tuple[dict, str]:
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


def _find_file(path: str, names: tuple[str, ...], layout: str) -> str:
    for name in names:
        p = os.path.join(path, name)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"head checkpoint {path!r} ({layout} layout): missing weights, expected one of "
                            f"{', '.join(names)}")


def _load_tensors(file: str) -> dict[str, Tensor]:
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


def _save_tensors(state: dict[str, Tensor], file: str) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if file.endswith(".safetensors"):
        save_file(state, file, metadata={"format": "pt"})
    else:
        torch.save(state, file)


def _write_json(obj: dict, file: str) -> None:
    with open(file, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# turbospec's own format
# ----------------------------------------------------------------------------------------------

def build_head(cfg: HeadConfig) -> nn.Module:
    """A fresh (uninitialised) head module for ``cfg``."""
    if cfg.method == "medusa":
        return MedusaHeads(cfg)
    return EagleHead(cfg)


def save_head(head: nn.Module, out_dir: str, extra: dict | None = None) -> str:
    """Write ``head`` (an EagleHead or MedusaHeads) to ``out_dir`` in turbospec's format; ``extra``
    (e.g. training provenance) is stored in config.json next to the head config."""
    os.makedirs(out_dir, exist_ok=True)
    _save_tensors(dict(head.state_dict()), os.path.join(out_dir, WEIGHTS))
    cfg = json.loads(head.cfg.to_json())
    if extra:
        cfg["turbospec_extra"] = extra
    _write_json(cfg, os.path.join(out_dir, CONFIG))
    return out_dir


def _load_turbospec(path: str, raw: dict, cfg_file: str) -> nn.Module:
    w_file = _find_file(path, (WEIGHTS,), "turbospec")
    try:
        cfg = HeadConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_file}: invalid turbospec head config: {e}") from None
    head = build_head(cfg)
    state = _load_tensors(w_file)
    lm = sorted(k for k in state if k.startswith("lm_heads."))
    if cfg.method == "medusa" and lm:
        rows = state[lm[0]].shape[0]
        _make_lm_heads(head, len(lm), cfg.hidden_size, rows)
    _fill(head, state, w_file, f"turbospec {cfg.method} head ({_describe(cfg)})")
    head.extra = raw.get("turbospec_extra", {})
    return head


# ----------------------------------------------------------------------------------------------
# config translation
# ----------------------------------------------------------------------------------------------

def _get_int(raw: dict, key: str, cfg_file: str, default: int | None = None) -> int:
    v = raw.get(key, default)
    if v is None:
        raise ValueError(f"{cfg_file}: missing field {key!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
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


def _check_llama_head_config(raw: dict, cfg_file: str, layout: str) -> None:
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


def _llama_dims(raw: dict, cfg_file: str) -> dict:
    h = _get_int(raw, "hidden_size", cfg_file)
    nh = _get_int(raw, "num_attention_heads", cfg_file)
    if nh == 0:
        raise ValueError(f"{cfg_file}: num_attention_heads = 0, expected >= 1")
    nkv = raw.get("num_key_value_heads") or nh
    head_dim = raw.get("head_dim") or h // nh  # EAGLE's cnets always use hidden_size // heads
    theta, scaling = _rope(raw, cfg_file)
    return dict(hidden_size=h, intermediate_size=_get_int(raw, "intermediate_size", cfg_file),
                num_heads=nh, num_kv_heads=int(nkv), head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling)


def _llama_export_config(cfg: HeadConfig, target_cfg: ModelConfig | None, dtype: torch.dtype) -> dict:
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


def _describe(cfg: HeadConfig) -> str:
    if cfg.method == "medusa":
        return (f"hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}, medusa_num_heads="
                f"{cfg.medusa_num_heads}, medusa_num_layers={cfg.medusa_num_layers}")
    s = (f"hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, num_heads={cfg.num_heads}, "
         f"num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, vocab_size={cfg.vocab_size}")
    if cfg.method == "eagle3":
        s += f", draft_vocab_size={cfg.draft_vocab_size}, feature_layers={cfg.feature_layers}"
    return s


def _fill(head: nn.Module, state: dict[str, Tensor], w_file: str, what: str) -> None:
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


def _make_lm_heads(head: nn.Module, n: int, hidden: int, vocab: int) -> None:
    head.lm_heads = nn.ModuleList([nn.Linear(hidden, vocab, bias=False) for _ in range(n)])


def _pop_zero_bias(state: dict, key: str, w_file: str, why: str) -> None:
    t = state.pop(key, None)
    if t is not None and bool(t.count_nonzero()):
        raise ValueError(f"{w_file}: tensor {key!r} is not zero but {why}")


# ----------------------------------------------------------------------------------------------
# EAGLE-1/2
# ----------------------------------------------------------------------------------------------

def _load_eagle(path: str, raw: dict, cfg_file: str, state: dict, w_file: str,
                target_cfg: ModelConfig | None) -> nn.Module:
    _check_llama_head_config(raw, cfg_file, "eagle")
    state = dict(state)
    ignored = []
    # The head embeds tokens with the target's embedding (EAGLE itself overwrites the head's copy with
    # the base model's, cnets1.Model(load_emb=True)), so a stored copy is not needed.
    if "embed_tokens.weight" in state:
        ignored.append("embed_tokens.weight")
        state.pop("embed_tokens.weight")
    # EAGLE's layer 0 has no input norm (cnets1.LlamaDecoderLayer: ``if self.index != 0``); the EAGLE
    # repo loads non-strictly and vLLM / SGLang replace it by the identity, so a stored one is unused
    # by every public runtime: ignore it the same way, with a warning since it is unusual.
    if "layers.0.input_layernorm.weight" in state:
        ignored.append("layers.0.input_layernorm.weight")
        state.pop("layers.0.input_layernorm.weight")
        warnings.warn(f"{w_file}: ignoring layers.0.input_layernorm.weight; EAGLE's first decoder layer has no "
                      f"input norm (the EAGLE repo, vLLM and SGLang do not use it either)", stacklevel=3)
    for k in [k for k in state if k.endswith("rotary_emb.inv_freq")]:
        ignored.append(k)
        state.pop(k)
    for k in [k for k in state if k.startswith("layers.0.self_attn.") and k.endswith(".bias")]:
        raise ValueError(f"{w_file}: tensor {k!r}: attention biases are not supported by turbospec's EAGLE head")

    # fc bias: EaModel reads config["bias"], default True. A zero bias next to bias=false is what
    # export_head writes for SGLang's sake; it is dropped.
    if "bias" in raw:
        fc_bias = bool(raw["bias"])
        if fc_bias and "fc.bias" not in state:
            raise ValueError(f"{cfg_file}: bias = true but {os.path.basename(w_file)} has no 'fc.bias'")
        if not fc_bias:
            _pop_zero_bias(state, "fc.bias", w_file, f"{CONFIG} says bias = false")
    else:
        fc_bias = "fc.bias" in state

    dims = _llama_dims(raw, cfg_file)
    vocab = raw.get("vocab_size") or (target_cfg.vocab_size if target_cfg else None)
    if vocab is None:
        raise ValueError(f"{cfg_file}: missing field 'vocab_size' (or pass target_cfg)")
    cfg = HeadConfig(method="eagle", vocab_size=int(vocab), fc_bias=fc_bias,
                     target=str(raw.get("base_model_name_or_path") or ""), **dims)
    head = build_head(cfg)
    _fill(head, state, w_file, f"EAGLE head ({_describe(cfg)}, from {CONFIG})")
    head.extra = {"source_layout": "eagle", "source": os.path.abspath(path), "ignored_tensors": ignored}
    return head


def _export_eagle(head: nn.Module, out_dir: str, target_cfg: ModelConfig | None, dtype: torch.dtype) -> None:
    cfg = head.cfg
    state = {k: v for k, v in head.state_dict().items()}
    if not cfg.fc_bias:  # see the module docstring: zeros for SGLang, ignored elsewhere
        state["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)
    conf = {"architectures": ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"],
            **_llama_export_config(cfg, target_cfg, dtype), "bias": bool(cfg.fc_bias)}
    _save_tensors(_cast(state, dtype), os.path.join(out_dir, "model.safetensors"))
    _write_json(conf, os.path.join(out_dir, CONFIG))


# ----------------------------------------------------------------------------------------------
# EAGLE-3
# ----------------------------------------------------------------------------------------------

def eagle3_default_feature_layers(num_layers: int) -> list[int]:
    """The target layers (0-based, the layer whose output is taken) that EAGLE-3 fuses by default.

    Convention, checked in the public code: EAGLE-3 takes the residual stream at indices
    [2, L//2, L-3] of HF's ``output_hidden_states`` tuple (index 0 = the embeddings, index i = the
    output of decoder layer i-1). SafeAILab/EAGLE ``eagle/model/modeling_llama_kv.py`` (and
    ``traineagle3``) appends ``hidden_states`` *before* running layer idx when idx is 2, L//2 or L-3;
    vLLM ``models/llama.py`` (``LlamaModel.forward``) appends ``hidden_states + residual`` before layer
    idx for idx in ``aux_hidden_state_layers`` (default ``(2, L//2, L-3)``,
    ``get_eagle3_aux_hidden_state_layers``); SGLang ``models/llama.py`` likewise with
    ``layers_to_capture = [2, L//2, L-3]``. The residual stream entering layer idx is the output of
    layer idx-1, so in turbospec's convention (``HeadConfig.feature_layers``, the layers whose output
    ``Transformer.forward(features=...)`` captures) the default is [1, L//2 - 1, L - 4]. All three
    capture in layer order, so fc's input blocks are in ascending layer order.

    For a shallow target (L < 7) these capture points collide or hit the embeddings and the public
    runtimes capture fewer than the 3 features fc expects: ValueError.
    """
    hf = sorted({2, num_layers // 2, num_layers - 3})
    if len(hf) != 3 or hf[0] < 1 or hf[-1] > num_layers:
        raise ValueError(f"a target with {num_layers} layers has no EAGLE-3 default feature layers: the capture "
                         f"points [2, L//2, L-3] = {[2, num_layers // 2, num_layers - 3]} are not 3 distinct "
                         f"decoder layers (needs num_layers >= 7); the checkpoint must name its layers "
                         f"(eagle_aux_hidden_state_layer_ids)")
    return [i - 1 for i in hf]


def _eagle3_feature_layers(raw: dict, cfg_file: str, target_cfg: ModelConfig | None) -> tuple[list[int], str]:
    """(feature layers in turbospec's convention, where they came from)."""
    found = []
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:  # vLLM: id j = the stream entering layer j = the output of layer j-1
        found.append(("eagle_aux_hidden_state_layer_ids", [int(i) - 1 for i in top], list(top)))
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:  # SGLang / SpecForge: 0-based layer outputs (SGLang captures at id + 1)
        found.append(("eagle_config.eagle_aux_hidden_state_layer_ids", [int(i) for i in nested], list(nested)))
    if len(found) == 2 and sorted(found[0][1]) != sorted(found[1][1]):
        raise ValueError(f"{cfg_file}: eagle_aux_hidden_state_layer_ids = {found[0][2]} (vLLM's convention: "
                         f"layers {found[0][1]}) and eagle_config.eagle_aux_hidden_state_layer_ids = "
                         f"{found[1][2]} (SGLang's convention: layers {found[1][1]}) disagree")
    if found:
        key, layers, value = found[0]
        if min(layers) < 0:
            raise ValueError(f"{cfg_file}: {key} = {value}: id 0 (the embeddings) is not a decoder layer "
                             f"output; turbospec heads read decoder layer outputs only")
        if len(set(layers)) != len(layers):
            raise ValueError(f"{cfg_file}: {key} = {value} repeats a layer; expected distinct layers")
        return sorted(layers), f"{CONFIG} {key} = {value}"
    if target_cfg is None:
        raise ValueError(f"{cfg_file}: this EAGLE-3 checkpoint does not name its target layers "
                         f"(eagle_aux_hidden_state_layer_ids), so they follow EAGLE-3's default, which depends "
                         f"on the target's number of layers: pass target_cfg")
    layers = eagle3_default_feature_layers(target_cfg.num_layers)
    return layers, f"EAGLE-3's default for a {target_cfg.num_layers}-layer target"


def _load_eagle3(path: str, raw: dict, cfg_file: str, state: dict, w_file: str,
                 target_cfg: ModelConfig | None) -> nn.Module:
    _check_llama_head_config(raw, cfg_file, "eagle3")
    if raw.get("norm_before_residual"):
        raise ValueError(f"{cfg_file}: norm_before_residual = true is not supported (turbospec's EAGLE-3 layer "
                         f"adds the un-normed fc output as the residual)")
    dims = _llama_dims(raw, cfg_file)
    h = dims["hidden_size"]
    th = raw.get("target_hidden_size")
    if th is not None and th != h:
        raise ValueError(f"{cfg_file}: target_hidden_size = {th} != hidden_size = {h}: a draft narrower or wider "
                         f"than its target is not supported")
    state = dict(state)
    # vLLM renames midlayer.* to layers.0.* when loading and accepts either spelling; so do we.
    for k in [k for k in state if k.startswith("layers.0.")]:
        state["midlayer." + k[len("layers.0."):]] = state.pop(k)
    ignored = []
    if "embed_tokens.weight" in state:  # EAGLE-3 trains with the target's (frozen) embedding
        ignored.append("embed_tokens.weight")
        state.pop("embed_tokens.weight")
    for k in [k for k in state if k.endswith("rotary_emb.inv_freq")]:
        ignored.append(k)
        state.pop(k)
    _pop_zero_bias(state, "fc.bias", w_file, "turbospec's EAGLE-3 fc has no bias")

    vocab = raw.get("vocab_size") or (target_cfg.vocab_size if target_cfg else None)
    if vocab is None:
        raise ValueError(f"{cfg_file}: missing field 'vocab_size' (or pass target_cfg)")
    vocab = int(vocab)
    dv = int(raw.get("draft_vocab_size") or vocab)  # vLLM / SGLang: absent -> the full vocabulary
    if "lm_head.weight" not in state:
        tied = " (tie_word_embeddings: the embedding as LM head is not supported)" \
            if raw.get("tie_word_embeddings") else ""
        raise ValueError(f"{w_file}: missing tensor 'lm_head.weight' [draft_vocab_size={dv}, {h}]{tied}")
    if dv > vocab:
        raise ValueError(f"{cfg_file}: draft_vocab_size = {dv} > vocab_size = {vocab}")

    layers, source = _eagle3_feature_layers(raw, cfg_file, target_cfg)
    fc = state.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] != len(layers) * h:
        raise ValueError(f"{w_file}: tensor 'fc.weight' has shape {list(fc.shape)}: {fc.shape[1]} input features, "
                         f"expected {len(layers)} x hidden_size {h} = {len(layers) * h} for the feature layers "
                         f"{layers} ({source})")

    # Draft vocabulary: d2t (draft id -> target id offset) is what vLLM and SGLang use; t2d (a mask of
    # the target ids in the draft vocabulary) must agree with it. EAGLE drops both when the draft
    # vocabulary is the full one.
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is None:
        if dv != vocab:
            raise ValueError(f"{w_file}: missing tensor 'd2t' (draft_vocab_size {dv} < vocab_size {vocab} needs the "
                             f"draft -> target id map)")
        state["d2t"] = d2t = torch.zeros(dv, dtype=torch.int64)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (dv,):
        raise ValueError(f"{w_file}: tensor 'd2t' has shape {list(d2t.shape)} and dtype {d2t.dtype}, expected an "
                         f"integer tensor of shape [{dv}] (draft_vocab_size)")
    ids = torch.arange(dv) + d2t.to(torch.int64)
    if dv and (int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != dv):
        raise ValueError(f"{w_file}: tensor 'd2t' maps draft ids to target ids outside [0, {vocab}) or to the same "
                         f"target id twice (target id = draft id + d2t[draft id])")
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    if t2d is None:
        state["t2d"] = mask
    elif tuple(t2d.shape) != (vocab,):
        raise ValueError(f"{w_file}: tensor 't2d' has shape {list(t2d.shape)}, expected [{vocab}] (vocab_size)")
    elif not torch.equal(t2d.to(torch.bool), mask):
        raise ValueError(f"{w_file}: tensors 't2d' and 'd2t' disagree: t2d marks {int(t2d.to(torch.bool).sum())} "
                         f"target ids, d2t maps the {dv} draft ids to a different set")
    else:
        state["t2d"] = t2d.to(torch.bool)

    # draft_vocab_size 0 = the full vocabulary (HeadConfig's convention); fc_bias is unused by EAGLE-3.
    cfg = HeadConfig(method="eagle3", vocab_size=vocab, feature_layers=layers, draft_vocab_size=dv if dv < vocab else 0,
                     target=str(raw.get("base_model_name_or_path") or ""), **dims)
    head = build_head(cfg)
    _fill(head, state, w_file, f"EAGLE-3 head ({_describe(cfg)}, from {CONFIG})")
    head.extra = {"source_layout": "eagle3", "source": os.path.abspath(path), "ignored_tensors": ignored,
                  "feature_layers_from": source}
    return head


def _export_eagle3(head: nn.Module, out_dir: str, target_cfg: ModelConfig | None, dtype: torch.dtype) -> None:
    cfg = head.cfg
    layers = list(cfg.feature_layers)
    if len(layers) != 3 or len(set(layers)) != 3:
        raise ValueError(f"eagle3 export: the head fuses feature_layers {layers}; vLLM's and SGLang's EAGLE-3 "
                         f"drafts read exactly 3 distinct target layers (fc in_features = 3 x hidden_size)")
    if min(layers) < 0:
        raise ValueError(f"eagle3 export: feature_layers {layers} must be >= 0")
    state = {k: v for k, v in head.state_dict().items()}
    order = sorted(range(3), key=lambda i: layers[i])
    if order != [0, 1, 2]:  # the runtimes concatenate in layer order: permute fc's input blocks to match
        h = cfg.hidden_size
        state["fc.weight"] = torch.cat([state["fc.weight"][:, i * h:(i + 1) * h] for i in order], dim=1)
    layers = sorted(layers)
    conf = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_export_config(cfg, target_cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
            "target_hidden_size": cfg.hidden_size,
            "bias": False,
            "norm_before_residual": False,
            # vLLM: the stream entering layer j (= output of layer j-1); SGLang / SpecForge: layer outputs.
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True}}
    _save_tensors(_cast(state, dtype), os.path.join(out_dir, "model.safetensors"))
    _write_json(conf, os.path.join(out_dir, CONFIG))


# ----------------------------------------------------------------------------------------------
# Medusa
# ----------------------------------------------------------------------------------------------

_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _load_medusa(path: str, raw: dict, cfg_file: str, target_cfg: ModelConfig | None) -> nn.Module:
    w_file = _find_file(path, MEDUSA_WEIGHTS, "medusa")
    state = _load_tensors(w_file)
    n_layers = _get_int(raw, "medusa_num_layers", cfg_file, default=1)
    if n_layers < 1:
        raise ValueError(f"{cfg_file}: medusa_num_layers = {n_layers}, expected >= 1")
    mapped: dict[str, Tensor] = {}
    lm: dict[int, Tensor] = {}
    heads = set()
    for k, t in sorted(state.items()):
        m = _MEDUSA_KEY.match(k)
        if m is None:
            raise ValueError(f"{w_file}: unexpected tensor {k!r}; a Medusa head file holds "
                             f"'{{i}}.{{j}}.linear.weight', '{{i}}.{{j}}.linear.bias' (j < medusa_num_layers) and "
                             f"'{{i}}.{{medusa_num_layers}}.weight'")
        i, j, what = int(m.group(1)), int(m.group(2)), m.group(3)
        heads.add(i)
        if what == "weight" and j == n_layers:
            lm[i] = t
        elif what != "weight" and j < n_layers:
            # Medusa builds a head's blocks as ``[ResBlock(h)] * medusa_num_layers``: one shared module,
            # so its own checkpoints repeat the same tensors; loading them block by block is identical.
            mapped[f"blocks.{i}.{j}.{what}"] = t
        else:
            raise ValueError(f"{w_file}: unexpected tensor {k!r} for medusa_num_layers = {n_layers} ({CONFIG}): "
                             f"blocks are 0..{n_layers - 1}, the LM head is {n_layers}")
    if not heads:
        raise ValueError(f"{w_file}: no Medusa head tensors")
    k_heads = max(heads) + 1
    if sorted(heads) != list(range(k_heads)):
        raise ValueError(f"{w_file}: Medusa heads {sorted(heads)} are not numbered 0..{k_heads - 1}")
    declared = raw.get("medusa_num_heads")
    if declared is not None and declared != k_heads:
        # Medusa's own loader overrides the config too ("fix the uploaded config"): the weights decide.
        warnings.warn(f"{cfg_file}: medusa_num_heads = {declared} but {os.path.basename(w_file)} holds {k_heads} "
                      f"heads; using {k_heads}", stacklevel=3)
    if lm and len(lm) != k_heads:
        raise ValueError(f"{w_file}: only heads {sorted(lm)} have their own LM head "
                         f"('{{i}}.{n_layers}.weight'); expected all {k_heads} or none")

    first = mapped.get("blocks.0.0.linear.weight")
    h = raw.get("hidden_size") or (first.shape[1] if first is not None and first.dim() == 2 else None) \
        or (target_cfg.hidden_size if target_cfg else None)
    if h is None:
        raise ValueError(f"{w_file}: cannot tell the hidden size (no '0.0.linear.weight')")
    if lm:
        t0 = lm[0]
        vocab = t0.shape[0] if t0.dim() == 2 else None
    else:
        vocab = raw.get("vocab_size") or (target_cfg.vocab_size if target_cfg else None)
    if vocab is None:
        raise ValueError(f"{cfg_file}: cannot tell the vocabulary size of this Medusa head (no per-head LM heads, "
                         f"no vocab_size): pass target_cfg")
    cfg = HeadConfig(method="medusa", hidden_size=int(h), vocab_size=int(vocab), medusa_num_heads=k_heads,
                     medusa_num_layers=n_layers, target=str(raw.get("base_model_name_or_path") or ""))
    head = build_head(cfg)
    if lm:
        _make_lm_heads(head, k_heads, cfg.hidden_size, cfg.vocab_size)
        for i, t in lm.items():
            mapped[f"lm_heads.{i}.weight"] = t
    _fill(head, mapped, w_file, f"Medusa head ({_describe(cfg)})")
    head.extra = {"source_layout": "medusa", "source": os.path.abspath(path)}
    return head


def _export_medusa(head: nn.Module, out_dir: str, dtype: torch.dtype, medusa_lm_head: Tensor | None,
                   medusa_file: str) -> None:
    cfg = head.cfg
    n = cfg.medusa_num_layers
    state = {}
    for k, t in head.state_dict().items():
        m = re.match(r"^blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)$", k)
        if m:
            state[f"{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"] = t
        elif (m := re.match(r"^lm_heads\.(\d+)\.weight$", k)):
            state[f"{m.group(1)}.{n}.weight"] = t
        else:
            raise ValueError(f"medusa export: unexpected parameter {k!r} in the head")
    if head.lm_heads is None:
        if medusa_lm_head is not None:
            want = (cfg.vocab_size, cfg.hidden_size)
            if tuple(medusa_lm_head.shape) != want:
                raise ValueError(f"medusa export: medusa_lm_head has shape {list(medusa_lm_head.shape)}, expected "
                                 f"{list(want)} (vocab_size, hidden_size)")
            for i in range(cfg.medusa_num_heads):
                state[f"{i}.{n}.weight"] = medusa_lm_head.detach().clone()
        else:
            warnings.warn("medusa export: the head shares the target's LM head, so only the blocks are written "
                          "(Medusa's legacy layout). Medusa's current MedusaModel also loads a per-head LM head "
                          f"'{{i}}.{n}.weight'; pass medusa_lm_head=<the target's LM head weight> to write it.",
                          stacklevel=3)
    conf = {"medusa_num_heads": cfg.medusa_num_heads, "medusa_num_layers": n,
            "base_model_name_or_path": cfg.target, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "version": "2", "torch_dtype": str(dtype).replace("torch.", "")}
    _save_tensors(_cast(state, dtype), os.path.join(out_dir, medusa_file))
    _write_json(conf, os.path.join(out_dir, CONFIG))


# ----------------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------------

def _cast(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    return {k: v.to(dtype) if v.dtype.is_floating_point else v for k, v in state.items()}


def _detect(path: str, raw: dict, cfg_file: str) -> tuple[str, str | None, dict | None]:
    """(layout, weights file, tensors) — tensors are loaded here for the EAGLE layouts."""
    if "turbospec_head" in raw:
        return "turbospec", None, None
    if "medusa_num_heads" in raw or any(os.path.isfile(os.path.join(path, n)) for n in MEDUSA_WEIGHTS):
        return "medusa", None, None
    try:
        w_file = _find_file(path, EAGLE_WEIGHTS, "eagle/eagle3")
    except FileNotFoundError:
        raise FileNotFoundError(f"head checkpoint {path!r}: missing weights; expected {WEIGHTS} (turbospec, EAGLE, "
                                f"EAGLE-3), pytorch_model.bin (EAGLE, EAGLE-3) or {' / '.join(MEDUSA_WEIGHTS)} "
                                f"(Medusa)") from None
    state = _load_tensors(w_file)
    archs = [str(a).lower() for a in raw.get("architectures") or []]
    if (any(k.startswith("midlayer.") for k in state) or "d2t" in state or "layers.0.hidden_norm.weight" in state
            or any("eagle3" in a for a in archs) or "draft_vocab_size" in raw):
        return "eagle3", w_file, state
    if "fc.weight" in state and any(k.startswith("layers.0.") for k in state):
        return "eagle", w_file, state
    raise ValueError(f"head checkpoint {path!r}: cannot tell its layout from {CONFIG} and "
                     f"{os.path.basename(w_file)} (tensors {sorted(state)[:6]}); supported: {', '.join(LAYOUTS)}")


def detect_layout(path: str) -> str:
    """Which of ``LAYOUTS`` the head directory ``path`` is in."""
    _check_dir(path)
    raw, cfg_file = _read_config(path)
    return _detect(path, raw, cfg_file)[0]


def load_head(path: str, dtype: torch.dtype = torch.float32, target_cfg: ModelConfig | None = None,
              layout: str | None = None) -> nn.Module:
    """Load a draft head from the local directory ``path``: turbospec's format, or an EAGLE-1/2,
    EAGLE-3 or Medusa checkpoint as the public tools write them (layout detected unless given).

    ``target_cfg``: the target the head will draft for. Required for EAGLE-3 checkpoints that do not
    name their feature layers (EAGLE-3's default depends on the target's depth); when given, the head
    is also checked against it (``check_head_compatible``). The returned head is in eval mode, floats in
    ``dtype``; ``head.extra`` records where it came from (and what was ignored)."""
    _check_dir(path)
    raw, cfg_file = _read_config(path)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown head layout {layout!r}; known layouts: {', '.join(LAYOUTS)}")
    detected, w_file, state = _detect(path, raw, cfg_file)
    if layout is not None and layout != detected:
        if {layout, detected} == {"eagle", "eagle3"} and state is not None:
            detected = layout
        else:
            raise ValueError(f"head checkpoint {path!r} looks like the {detected!r} layout, not {layout!r}")
    if detected == "turbospec":
        head = _load_turbospec(path, raw, cfg_file)
    elif detected == "medusa":
        head = _load_medusa(path, raw, cfg_file, target_cfg)
    elif detected == "eagle":
        head = _load_eagle(path, raw, cfg_file, state, w_file, target_cfg)
    else:
        head = _load_eagle3(path, raw, cfg_file, state, w_file, target_cfg)
    if target_cfg is not None:
        try:
            check_head_compatible(head, target_cfg)
        except ValueError as e:
            raise ValueError(f"head checkpoint {path!r}: {e}") from None
    return head.to(dtype).eval()


def export_head(head: nn.Module, out_dir: str, layout: str, *, target_cfg: ModelConfig | None = None,
                dtype: torch.dtype | None = None, medusa_lm_head: Tensor | None = None,
                medusa_file: str = MEDUSA_WEIGHTS[0]) -> str:
    """Write ``head`` to ``out_dir`` in a published layout (see the module docstring): "eagle" (an
    EAGLE-1/2 head), "eagle3" (an EAGLE-3 head with exactly 3 feature layers) or "medusa".

    ``target_cfg``: checked against the head when given. ``dtype``: cast floating tensors (default:
    as they are). Medusa: ``medusa_lm_head`` (the target's LM head weight [V, H]) is written as every
    head's own LM head when the head shares the target's; ``medusa_file`` is
    "medusa_lm_head.safetensors" (what Medusa's trainer writes) or "medusa_lm_head.pt" (what
    ``MedusaModel.from_pretrained`` reads)."""
    if layout not in EXPORT_LAYOUTS:
        raise ValueError(f"unknown export layout {layout!r}; known layouts: {', '.join(EXPORT_LAYOUTS)} "
                         f"(use save_head for turbospec's own format)")
    cfg = getattr(head, "cfg", None)
    if not isinstance(cfg, HeadConfig):
        raise ValueError(f"export_head: expected an EagleHead or MedusaHeads (with a HeadConfig .cfg), got "
                         f"{type(head).__name__}")
    want = {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}[layout]
    if cfg.method != want:
        raise ValueError(f"export_head: layout {layout!r} needs a {want!r} head, this head's method is {cfg.method!r}")
    if medusa_file not in MEDUSA_WEIGHTS:
        raise ValueError(f"export_head: medusa_file {medusa_file!r}, expected one of {MEDUSA_WEIGHTS}")
    if target_cfg is not None:
        check_head_compatible(head, target_cfg)
    if dtype is None:
        dtype = next((p.dtype for p in head.parameters() if p.dtype.is_floating_point), torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    if layout == "eagle":
        _export_eagle(head, out_dir, target_cfg, dtype)
    elif layout == "eagle3":
        _export_eagle3(head, out_dir, target_cfg, dtype)
    else:
        _export_medusa(head, out_dir, dtype, medusa_lm_head, medusa_file)
    return out_dir
