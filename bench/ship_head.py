"""Package a trained head for the default model: copy it into turbospec/heads_data/<name>/ with the
draft vocabulary (the most frequent tokens of the self-distilled responses, for EAGLE-1/2 and
Medusa heads that share the target's LM head) and the Engine options it was tuned for, recorded in
its config.json ``turbospec_extra`` next to the training provenance.

    python bench/ship_head.py --head /work/train/eagle3 --samples WORK/gen-*/samples.jsonl \\
        --name smollm2-eagle3 --engine '{"num_draft": 8, "draft_dtype": "bfloat16",
        "tree": {"depth": 4, "top_k": 2}}'
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from turbospec.heads.layers import draft_vocab_from_counts  # noqa: E402
from turbospec.heads.shipped import HEADS_DIR  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", required=True, help="trained head directory (turbospec format)")
    p.add_argument("--samples", required=True, help="the distillation samples.jsonl the head was trained on")
    p.add_argument("--name", required=True, help="folder name under turbospec/heads_data/")
    p.add_argument("--draft-vocab", type=int, default=8192, help="0: the full vocabulary")
    p.add_argument("--engine", default="{}", help="JSON: Engine options (num_draft, draft_dtype, tree)")
    p.add_argument("--use-by-default", action="store_true",
                   help="let Engine(drafter='auto') pick this head for the default model (only when the "
                        "benchmark shows it beating n-gram lookup)")
    p.add_argument("--store-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype of the shipped floating-point weights (bfloat16 halves the package; a head "
                        "that drafts in bfloat16 computes exactly the same either way)")
    args = p.parse_args()
    with open(os.path.join(args.head, "config.json")) as f:
        cfg = json.load(f)
    head_cfg = cfg["turbospec_head"]
    extra = cfg.setdefault("turbospec_extra", {})
    if args.draft_vocab and head_cfg["method"] != "eagle3":
        counts = torch.zeros(head_cfg["vocab_size"], dtype=torch.int64)
        total = 0
        with open(args.samples) as f:
            for line in f:
                ids = torch.tensor(json.loads(line)["response_ids"], dtype=torch.int64)
                counts += torch.bincount(ids, minlength=counts.numel())
                total += ids.numel()
        vocab = draft_vocab_from_counts(counts, args.draft_vocab)
        extra["draft_vocab"] = vocab.tolist()
        extra["draft_vocab_coverage"] = float(counts[vocab].sum()) / max(total, 1)
    extra["engine"] = json.loads(args.engine)
    extra["use_by_default"] = bool(args.use_by_default)
    out = os.path.join(HEADS_DIR, args.name)
    os.makedirs(out, exist_ok=True)
    from safetensors.torch import load_file, save_file
    state = load_file(os.path.join(args.head, "model.safetensors"))
    dt = getattr(torch, args.store_dtype)
    save_file({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()},
              os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"wrote {out} ({os.path.getsize(os.path.join(out, 'model.safetensors')) / 2**20:.1f} MB weights)"
          + (f", draft vocab {len(extra['draft_vocab'])} ids covering {extra['draft_vocab_coverage']:.1%} "
             f"of response tokens" if "draft_vocab" in extra else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
