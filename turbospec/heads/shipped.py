"""Draft heads shipped inside the package for the default model (SmolLM2-135M-Instruct).

They live in ``turbospec/heads_data/<name>/`` (turbospec's checkpoint format: config.json +
model.safetensors); each config.json's ``turbospec_extra`` records the exact command, data, run time
and machine that produced it, and the Engine options (tree shape, draft vocabulary) it was tuned for.
"""
from __future__ import annotations

import json
import os

HEADS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "heads_data")
#: the drafter the default model uses when a shipped head exists for it, best first
PREFERENCE = ("eagle3", "eagle", "medusa")


def shipped_heads() -> dict[str, str]:
    """method -> checkpoint directory, for the heads present in the installed package."""
    out: dict[str, str] = {}
    if not os.path.isdir(HEADS_DIR):
        return out
    for name in sorted(os.listdir(HEADS_DIR)):
        d = os.path.join(HEADS_DIR, name)
        cfg = os.path.join(d, "config.json")
        if os.path.isfile(cfg) and os.path.isfile(os.path.join(d, "model.safetensors")):
            with open(cfg) as f:
                method = json.load(f).get("turbospec_head", {}).get("method")
            if method and method not in out:
                out[method] = d
    return out


def best_shipped_head(default_only: bool = False) -> tuple[str, str] | None:
    """(method, directory) of the preferred shipped head, or None when none is shipped. With
    ``default_only``, only heads whose config marks them ``"use_by_default": true`` (set when the
    benchmark shows the head beating n-gram lookup on the default model) count."""
    heads = shipped_heads()
    for m in PREFERENCE:
        if m in heads:
            if default_only:
                with open(os.path.join(heads[m], "config.json")) as f:
                    if not json.load(f).get("turbospec_extra", {}).get("use_by_default", False):
                        continue
            return m, heads[m]
    return None
