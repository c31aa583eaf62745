"""Medusa heads (layout ``"medusa"``): loading and exporting.

Read by FasterDecoding/Medusa ``medusa/model/medusa_model.py`` (``MedusaConfig``;
``MedusaModelABC.from_pretrained`` loads ``medusa_lm_head.pt`` non-strictly into ``medusa_head`` =
ModuleList of Sequential(ResBlock x medusa_num_layers, Linear(H, V, bias=False))) and written by
``medusa/train/train_legacy.py`` (``medusa_lm_head.safetensors``). ``config.json``: ``medusa_num_heads``,
``medusa_num_layers``, ``base_model_name_or_path`` (we add ``hidden_size``, ``vocab_size``). Tensors:
``{i}.{j}.linear.weight`` [H, H] / ``.bias`` [H] for j < medusa_num_layers and
``{i}.{medusa_num_layers}.weight`` [V, H], head i's own LM head (absent in the legacy layout,
``medusa_model_legacy.py``, which uses the target's). vLLM's ``models/medusa.py`` uses other names
(``blocks.{i}.layers.{j}``, ``lm_heads.{i}``) and is not targeted.
"""
from __future__ import annotations

import os
import re
import warnings

import torch
from torch import Tensor, nn

from ..config import HeadConfig
from ..medusa import MedusaHeads
from ...model.transformer import ModelConfig
from .common import (CONFIG, cast, describe, fill, find_file, get_int, load_tensors, make_lm_heads, save_tensors,
                     write_json)

MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")

_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def load_medusa(path: str, raw: dict, cfg_file: str, target_cfg: ModelConfig | None) -> nn.Module:
    """The Medusa head in ``path`` (``raw``: its config.json, read from ``cfg_file``); ``target_cfg``
    supplies the hidden and vocabulary sizes the checkpoint does not tell."""
    w_file = find_file(path, MEDUSA_WEIGHTS, "medusa")
    state = load_tensors(w_file)
    n_layers = get_int(raw, "medusa_num_layers", cfg_file, default=1)
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
    head = MedusaHeads(cfg)
    if lm:
        make_lm_heads(head, k_heads, cfg.hidden_size, cfg.vocab_size)
        for i, t in lm.items():
            mapped[f"lm_heads.{i}.weight"] = t
    fill(head, mapped, w_file, f"Medusa head ({describe(cfg)})")
    head.extra = {"source_layout": "medusa", "source": os.path.abspath(path)}
    return head


def export_medusa(head: nn.Module, out_dir: str, dtype: torch.dtype, medusa_lm_head: Tensor | None,
                  medusa_file: str) -> None:
    """Write the Medusa ``head`` to the existing directory ``out_dir`` as ``medusa_file``, floats in ``dtype``
    (``medusa_lm_head``: see ``export_head``)."""
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
    save_tensors(cast(state, dtype), os.path.join(out_dir, medusa_file))
    write_json(conf, os.path.join(out_dir, CONFIG))

