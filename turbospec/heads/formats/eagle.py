"""EAGLE-1/2 heads (layout ``"eagle"``): loading and exporting.

Read by SafeAILab/EAGLE ``eagle/model/ea_model.py`` (``EaModel``: config via ``configs.EConfig``,
``bias`` key, ``pytorch_model.bin`` else ``model.safetensors``, loaded non-strictly into
``cnets1.Model``), vLLM ``vllm/model_executor/models/llama_eagle.py`` (``EagleLlamaForCausalLM``;
``transformers_utils/configs/eagle.py`` renames the architecture ``X`` to ``EagleX``) and SGLang
``python/sglang/srt/models/llama_eagle.py`` (``LlamaForCausalLMEagle``). ``config.json`` is a Llama
config (``model_type`` "llama", ``num_hidden_layers`` 1, ``hidden_size``, ``intermediate_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``,
``rope_scaling``, ``vocab_size``, ``bias`` = fc has a bias). Tensors: ``fc.weight`` [H, 2H]
(+ ``fc.bias``) over cat(embedding, feature), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.post_attention_layernorm.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``.

Exported with ``architectures`` ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]: SGLang resolves
the first, vLLM (whose rename leaves names starting with "Eagle" alone) the second. A head without
fc bias is written with ``bias: false`` plus an all-zero ``fc.bias``: the EAGLE repo (non-strict) and
vLLM (no fc bias; unknown names skipped) ignore it, SGLang (whose fc always has a bias) needs it.
Note that vLLM's EAGLE-1 fc has no bias at all, so a head whose fc bias is not zero is only served
exactly by the EAGLE repo and SGLang.
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from ..config import HeadConfig
from ..eagle import EagleHead
from ...model.transformer import ModelConfig
from .common import (CONFIG, cast, check_llama_head_config, describe, fill, llama_dims, llama_export_config,
                     pop_zero_bias, save_tensors, write_json)


def load_eagle(path: str, raw: dict, cfg_file: str, state: dict, w_file: str,
               target_cfg: ModelConfig | None) -> nn.Module:
    """The EAGLE-1/2 head in ``path``: ``raw`` is its config.json (read from ``cfg_file``), ``state``
    the tensors of its weights file ``w_file``."""
    check_llama_head_config(raw, cfg_file, "eagle")
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
            pop_zero_bias(state, "fc.bias", w_file, f"{CONFIG} says bias = false")
    else:
        fc_bias = "fc.bias" in state

    dims = llama_dims(raw, cfg_file)
    vocab = raw.get("vocab_size") or (target_cfg.vocab_size if target_cfg else None)
    if vocab is None:
        raise ValueError(f"{cfg_file}: missing field 'vocab_size' (or pass target_cfg)")
    cfg = HeadConfig(method="eagle", vocab_size=int(vocab), fc_bias=fc_bias,
                     target=str(raw.get("base_model_name_or_path") or ""), **dims)
    head = EagleHead(cfg)
    fill(head, state, w_file, f"EAGLE head ({describe(cfg)}, from {CONFIG})")
    head.extra = {"source_layout": "eagle", "source": os.path.abspath(path), "ignored_tensors": ignored}
    return head


def export_eagle(head: nn.Module, out_dir: str, target_cfg: ModelConfig | None, dtype: torch.dtype) -> None:
    """Write the EAGLE-1/2 ``head`` to the existing directory ``out_dir``, floats in ``dtype``."""
    cfg = head.cfg
    state = {k: v for k, v in head.state_dict().items()}
    if not cfg.fc_bias:  # see the module docstring: zeros for SGLang, ignored elsewhere
        state["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)
    conf = {"architectures": ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"],
            **llama_export_config(cfg, target_cfg, dtype), "bias": bool(cfg.fc_bias)}
    save_tensors(cast(state, dtype), os.path.join(out_dir, "model.safetensors"))
    write_json(conf, os.path.join(out_dir, CONFIG))
