"""EAGLE-3 heads (layout ``"eagle3"``): loading and exporting, and EAGLE-3's default feature layers.

Read by SafeAILab/EAGLE ``eagle/model/cnets.py`` (``Model``: ``midlayer`` = ``LlamaDecoderLayeremb``,
``d2t``/``t2d`` buffers), vLLM ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``,
registered under "LlamaForCausalLMEagle3" too; ``midlayer.`` -> ``layers.0.``, ``d2t`` ->
``draft_id_to_target_id``, ``t2d`` skipped) and SGLang ``python/sglang/srt/models/llama_eagle3.py``
(``LlamaForCausalLMEagle3``; ``d2t`` -> hot token ids). ``config.json``: the Llama fields of the
"eagle" layout (``eagle.py``) plus ``architectures`` ["LlamaForCausalLMEagle3"], ``draft_vocab_size``,
``vocab_size`` (the target's), ``target_hidden_size``, ``tie_word_embeddings`` false, ``bias`` false
(vLLM also reads it as the attention bias), ``norm_before_residual`` false, and the feature layers
twice, in each reader's convention (see ``eagle3_default_feature_layers``): top-level
``eagle_aux_hidden_state_layer_ids`` (vLLM, ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``: id j =
the residual stream entering layer j) and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang
``model_runner`` -> ``LlamaForCausalLM.set_eagle3_layers_to_capture``, which adds 1: 0-based layer
outputs).

Tensors: ``fc.weight`` [H, 3H], ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2H], ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` [draft_vocab, H],
``d2t`` int64 [draft_vocab] (target id = draft id + d2t[draft id]), ``t2d`` bool [vocab].
On import ``layers.0.*`` is accepted for ``midlayer.*`` (as vLLM does).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ..config import HeadConfig
from ..eagle import EagleHead
from ...model.transformer import ModelConfig
from .common import (CONFIG, cast, check_llama_head_config, describe, fill, llama_dims, llama_export_config,
                     pop_zero_bias, save_tensors, write_json)


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


def load_eagle3(path: str, raw: dict, cfg_file: str, state: dict, w_file: str,
                target_cfg: ModelConfig | None) -> nn.Module:
    """The EAGLE-3 head in ``path``: ``raw`` is its config.json (read from ``cfg_file``), ``state`` the
    tensors of its weights file ``w_file``; ``target_cfg`` gives the default feature layers."""
    check_llama_head_config(raw, cfg_file, "eagle3")
    if raw.get("norm_before_residual"):
        raise ValueError(f"{cfg_file}: norm_before_residual = true is not supported (turbospec's EAGLE-3 layer "
                         f"adds the un-normed fc output as the residual)")
    dims = llama_dims(raw, cfg_file)
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
    pop_zero_bias(state, "fc.bias", w_file, "turbospec's EAGLE-3 fc has no bias")

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
    head = EagleHead(cfg)
    fill(head, state, w_file, f"EAGLE-3 head ({describe(cfg)}, from {CONFIG})")
    head.extra = {"source_layout": "eagle3", "source": os.path.abspath(path), "ignored_tensors": ignored,
                  "feature_layers_from": source}
    return head


def export_eagle3(head: nn.Module, out_dir: str, target_cfg: ModelConfig | None, dtype: torch.dtype) -> None:
    """Write the EAGLE-3 ``head`` (3 distinct feature layers) to the existing directory ``out_dir``, floats
    in ``dtype``."""
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
    conf = {"architectures": ["LlamaForCausalLMEagle3"], **llama_export_config(cfg, target_cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
            "target_hidden_size": cfg.hidden_size,
            "bias": False,
            "norm_before_residual": False,
            # vLLM: the stream entering layer j (= output of layer j-1); SGLang / SpecForge: layer outputs.
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True}}
    save_tensors(cast(state, dtype), os.path.join(out_dir, "model.safetensors"))
    write_json(conf, os.path.join(out_dir, CONFIG))

