"""Saving, loading and exporting draft heads, in turbospec's own format and in the published ones.

``load_head(path)`` reads a local directory (nothing is ever downloaded) and tells the layout from its
files; ``export_head(head, out_dir, layout)`` writes one. Layouts, one module each (whose docstring
describes the files, the config fields and tensor names, and which public code reads them):

- ``"turbospec"`` (``native.py``): ``config.json`` = ``{"turbospec_head": HeadConfig, "turbospec_extra":
  {...}}`` and ``model.safetensors`` = the head's own state dict; written by ``save_head``.
- ``"eagle"`` (``eagle.py``): EAGLE-1/2 heads as the EAGLE repo, vLLM and SGLang read them: a Llama
  ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``.
- ``"eagle3"`` (``eagle3.py``): EAGLE-3 heads, likewise, with a draft vocabulary (``d2t`` / ``t2d``) and
  the target layers they fuse (``eagle3_default_feature_layers`` when the config does not name them).
- ``"medusa"`` (``medusa.py``): FasterDecoding/Medusa heads, ``medusa_lm_head.safetensors`` or
  ``medusa_lm_head.pt``.

``common.py`` holds what they share (file and tensor IO, Llama config fields, the checked ``fill``).

Foreign checkpoints do not carry turbospec's HeadConfig: it is rebuilt from config.json and the tensor
shapes; every tensor is checked against it (ValueError naming the file, tensor, shape and the
expectation). ``check_head_compatible(head, target_cfg)`` checks a head against a target.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from ..config import HeadConfig, check_head_compatible
from ...model.transformer import ModelConfig
from .common import CONFIG, EAGLE_WEIGHTS, WEIGHTS, check_dir, find_file, load_tensors, read_config
from .eagle import export_eagle, load_eagle
from .eagle3 import eagle3_default_feature_layers, export_eagle3, load_eagle3
from .medusa import MEDUSA_WEIGHTS, export_medusa, load_medusa
from .native import build_head, load_turbospec, save_head

__all__ = ["LAYOUTS", "EXPORT_LAYOUTS", "CONFIG", "WEIGHTS", "EAGLE_WEIGHTS", "MEDUSA_WEIGHTS", "build_head",
           "save_head", "load_head", "export_head", "detect_layout", "eagle3_default_feature_layers"]

LAYOUTS = ("turbospec", "eagle", "eagle3", "medusa")
EXPORT_LAYOUTS = ("eagle", "eagle3", "medusa")


def _detect(path: str, raw: dict, cfg_file: str) -> tuple[str, str | None, dict | None]:
    """(layout, weights file, tensors) — tensors are loaded here for the EAGLE layouts."""
    if "turbospec_head" in raw:
        return "turbospec", None, None
    if "medusa_num_heads" in raw or any(os.path.isfile(os.path.join(path, n)) for n in MEDUSA_WEIGHTS):
        return "medusa", None, None
    try:
        w_file = find_file(path, EAGLE_WEIGHTS, "eagle/eagle3")
    except FileNotFoundError:
        raise FileNotFoundError(f"head checkpoint {path!r}: missing weights; expected {WEIGHTS} (turbospec, EAGLE, "
                                f"EAGLE-3), pytorch_model.bin (EAGLE, EAGLE-3) or {' / '.join(MEDUSA_WEIGHTS)} "
                                f"(Medusa)") from None
    state = load_tensors(w_file)
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
    check_dir(path)
    raw, cfg_file = read_config(path)
    return _detect(path, raw, cfg_file)[0]


def load_head(path: str, dtype: torch.dtype = torch.float32, target_cfg: ModelConfig | None = None,
              layout: str | None = None) -> nn.Module:
    """Load a draft head from the local directory ``path``: turbospec's format, or an EAGLE-1/2,
    EAGLE-3 or Medusa checkpoint as the public tools write them (layout detected unless given).

    ``target_cfg``: the target the head will draft for. Required for EAGLE-3 checkpoints that do not
    name their feature layers (EAGLE-3's default depends on the target's depth); when given, the head
    is also checked against it (``check_head_compatible``). The returned head is in eval mode, floats in
    ``dtype``; ``head.extra`` records where it came from (and what was ignored)."""
    check_dir(path)
    raw, cfg_file = read_config(path)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown head layout {layout!r}; known layouts: {', '.join(LAYOUTS)}")
    detected, w_file, state = _detect(path, raw, cfg_file)
    if layout is not None and layout != detected:
        if {layout, detected} == {"eagle", "eagle3"} and state is not None:
            detected = layout
        else:
            raise ValueError(f"head checkpoint {path!r} looks like the {detected!r} layout, not {layout!r}")
    if detected == "turbospec":
        head = load_turbospec(path, raw, cfg_file)
    elif detected == "medusa":
        head = load_medusa(path, raw, cfg_file, target_cfg)
    elif detected == "eagle":
        head = load_eagle(path, raw, cfg_file, state, w_file, target_cfg)
    else:
        head = load_eagle3(path, raw, cfg_file, state, w_file, target_cfg)
    if target_cfg is not None:
        try:
            check_head_compatible(head, target_cfg)
        except ValueError as e:
            raise ValueError(f"head checkpoint {path!r}: {e}") from None
    return head.to(dtype).eval()


def export_head(head: nn.Module, out_dir: str, layout: str, *, target_cfg: ModelConfig | None = None,
                dtype: torch.dtype | None = None, medusa_lm_head: Tensor | None = None,
                medusa_file: str = MEDUSA_WEIGHTS[0]) -> str:
    """Write ``head`` to ``out_dir`` in a published layout (see the layout modules' docstrings): "eagle"
    (an EAGLE-1/2 head), "eagle3" (an EAGLE-3 head with exactly 3 feature layers) or "medusa".

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
        export_eagle(head, out_dir, target_cfg, dtype)
    elif layout == "eagle3":
        export_eagle3(head, out_dir, target_cfg, dtype)
    else:
        export_medusa(head, out_dir, dtype, medusa_lm_head, medusa_file)
    return out_dir
