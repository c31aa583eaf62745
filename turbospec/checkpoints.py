"""Saving and loading draft heads.

turbospec's own format is a directory with ``config.json`` (``{"turbospec_head": HeadConfig}``) and
``model.safetensors`` (the head's state dict, parameter names as in ``eagle.py`` / ``medusa.py``).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .heads import HeadConfig


def build_head(cfg: HeadConfig) -> nn.Module:
    """A fresh (uninitialised) head module for ``cfg``."""
    if cfg.method == "medusa":
        from .medusa import MedusaHeads
        return MedusaHeads(cfg)
    from .eagle import EagleHead
    return EagleHead(cfg)


def save_head(head: nn.Module, out_dir: str, extra: dict | None = None) -> str:
    """Write ``head`` (an EagleHead or MedusaHeads) to ``out_dir`` in turbospec's format; ``extra``
    (e.g. training provenance) is stored in config.json next to the head config."""
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    cfg = json.loads(head.cfg.to_json())
    if extra:
        cfg["turbospec_extra"] = extra
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def load_head(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a head saved by ``save_head``."""
    cfg_path = os.path.join(path, "config.json")
    w_path = os.path.join(path, "model.safetensors")
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"head checkpoint {path!r}: missing {os.path.basename(p)}")
    with open(cfg_path) as f:
        raw = json.load(f)
    cfg = HeadConfig.from_dict(raw)
    head = build_head(cfg)
    state = load_file(w_path)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"head checkpoint {path!r} does not match its config ({cfg.method}): missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    head.extra = raw.get("turbospec_extra", {})
    return head.to(dtype).eval()
