"""Does a trained draft head underfit or overfit? Its acceptance on samples it trained on, on samples
of the same generation it never saw, and on its held-out split, in one run.

    python bench/head_fit.py --head /work/train/gpu-eagle3 \
        --samples /work/train/gpu-eagle3/samples.jsonl --trained 3400 --per-set 48

``--samples`` is the generation's samples.jsonl (the order ``turbospec train`` split and sharded
it in); ``--trained N``: the head trained on the first N train samples (a time-budgeted feature
stage stops part way; the rest were never seen). The held-out split is the last ``--eval-samples``.
Acceptance is ``turbospec train``'s held-out metric (greedy chains of 3 drafts on response
positions), computed by the same code on each set.

If seen >> unseen, the head memorizes: more distinct data (or regularization) is the lever. If seen
~= unseen, it underfits at this size: capacity or the objective is.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--samples", required=True, help="the generation's samples.jsonl")
    ap.add_argument("--trained", type=int, required=True, help="the head trained on the first N train samples")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--per-set", type=int, default=48, help="samples drawn from each of seen / unseen")
    ap.add_argument("--target", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--amp", choices=["none", "bfloat16"], default="none",
                    help="bfloat16 autocast around the eval, as `turbospec train` runs it where bf16 is fast")
    ap.add_argument("--topk", type=int, default=0,
                    help="also record the target's top-K next tokens: the eval adds the sampled (T = 1) "
                         "acceptance of the first draft, sum min(p, q) over them")
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from turbospec.heads.formats import load_head
    from turbospec.model.loader import default_model_path, load_model
    from turbospec.train import data as distill
    from turbospec.train.config import TrainConfig
    from turbospec.train.objectives import Method, format_eval, frozen_parts

    source = default_model_path() if a.target == "default" else a.target
    target = load_model(source, torch.float32)
    head = load_head(a.head, target_cfg=target.cfg).float().eval()
    samples = sorted(distill.read_samples(a.samples), key=lambda s: s["index"])  # the order train splits
    train, held = distill.split(samples, a.eval_samples)
    if a.trained > len(train):
        raise SystemExit(f"--trained {a.trained} is more than the {len(train)} train samples")
    rng = random.Random(a.seed)
    sets = {"seen": rng.sample(train[:a.trained], min(a.per_set, a.trained)),
            "unseen": rng.sample(train[a.trained:], min(a.per_set, len(train) - a.trained)),
            "held_out": held}
    frozen = frozen_parts(target, head, torch.device("cpu"))
    spec = tuple(head.cfg.feature_layers) if head.cfg.method == "eagle3" else "final"
    method = Method(head, frozen, TrainConfig(method=head.cfg.method, out=""), 1.0)
    result = {"head": a.head, "samples": a.samples, "trained": a.trained, "per_set": a.per_set, "seed": a.seed,
              "amp": a.amp, "topk": a.topk}
    for name, group in sets.items():
        if not group:
            continue
        t0 = time.perf_counter()
        rows = distill._tensors_in_order(target, group, spec, torch.bfloat16, 8, a.topk)
        t = distill._pack(rows, group)
        order = sorted(range(len(group)), key=lambda i: len(group[i]["response_ids"]))
        batches = [distill.collate(t, order[b:b + 16]) for b in range(0, len(order), 16)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp == "bfloat16"):
            ev = method.evaluate(batches, torch.device("cpu"))
        ev.pop("rank_accuracy", None)
        ev["samples"] = len(group)
        ev["seconds"] = round(time.perf_counter() - t0, 1)
        result[name] = ev
        print(f"{name:9s} ({len(group)} samples): {format_eval(ev)}", file=sys.stderr, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: (v["acceptance"] if isinstance(v, dict) else v) for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
