"""turbospec's own head format (layout ``"turbospec"``).

``config.json`` = ``{"turbospec_head": HeadConfig, "turbospec_extra": {...}}`` and
``model.safetensors`` = the head's own state dict (names as in ``heads/eagle.py`` / ``heads/medusa.py``).
A Medusa head with LM heads of its own stores them as ``lm_heads.{i}.weight``.
"""
from __future__ import annotations

import json
import os

from torch import nn

from ..config import HeadConfig
from ..eagle import EagleHead
from ..medusa import MedusaHeads
from .common import CONFIG, WEIGHTS, describe, fill, find_file, load_tensors, make_lm_heads, save_tensors, write_json


def build_head(cfg: HeadConfig) -> nn.Module:
    """A fresh (uninitialised) head module for ``cfg``."""
    if cfg.method == "medusa":
        return MedusaHeads(cfg)
    return EagleHead(cfg)


def save_head(head: nn.Module, out_dir: str, extra: dict | None = None) -> str:
    """Write ``head`` (an EagleHead or MedusaHeads) to ``out_dir`` in turbospec's format; ``extra``
    (e.g. training provenance) is stored in config.json next to the head config."""
    os.makedirs(out_dir, exist_ok=True)
    save_tensors(dict(head.state_dict()), os.path.join(out_dir, WEIGHTS))
    cfg = json.loads(head.cfg.to_json())
    if extra:
        cfg["turbospec_extra"] = extra
    write_json(cfg, os.path.join(out_dir, CONFIG))
    return out_dir


def load_turbospec(path: str, raw: dict, cfg_file: str) -> nn.Module:
    """The head saved by ``save_head`` in ``path`` (``raw``: its config.json, read from ``cfg_file``)."""
    w_file = find_file(path, (WEIGHTS,), "turbospec")
    try:
        cfg = HeadConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_file}: invalid turbospec head config: {e}") from None
    head = build_head(cfg)
    state = load_tensors(w_file)
    lm = sorted(k for k in state if k.startswith("lm_heads."))
    if cfg.method == "medusa" and lm:
        rows = state[lm[0]].shape[0]
        make_lm_heads(head, len(lm), cfg.hidden_size, rows)
    fill(head, state, w_file, f"turbospec {cfg.method} head ({describe(cfg)})")
    head.extra = raw.get("turbospec_extra", {})
    return head
