"""int8-activation mode: the attention's arithmetic by K/V cache, same run (CPU).

With ``activations="int8"`` the default K/V cache is bfloat16 and attention rounds q and P to bfloat16
(``tree_attention(bf16_products=True)``, vdpbf16ps on AVX-512 BF16). This script times the target's
layers (``logits="none"``) over the three caches a user can pick — float32 (float32 attention, the
default before 2026-12-02), float16 (float32 attention over widened values) and "auto" (bfloat16,
bf16 products) — for decode steps, verify passes and batched decode over long caches, the three
alternated within each round (medians). ``--quality``: teacher-forced top-1 agreement and KL of each
against the exact float32 model along its own greedy answers to Spec-Bench prompts.

    python bench/bench_int8_attention.py --threads 2
    python bench/bench_int8_attention.py --quality --per-category 2 --max-new-tokens 96
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DEFAULT_SPEC_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                  "shared", "data", "specbench_dev.jsonl")
CACHES = ("float32", "float16", "auto")
SHAPES = [(1, 300, 1), (1, 300, 17), (1, 300, 64), (1, 1500, 17), (16, 500, 1), (16, 1500, 1), (4, 1500, 5)]


def prefilled(model, kv: str, batch: int, ctx: int, extra: int):
    model.set_kv_cache_dtype(kv)
    cache = model.new_cache(ctx + extra + 8, batch_size=batch)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(0))
    for s in range(0, ctx, 64):
        e = min(ctx, s + 64)
        model.forward(ids[:, s:e], torch.arange(s, e)[None].expand(batch, -1), cache, s, logits="none")
    return cache


def timings(model, rounds: int) -> list[str]:
    lines = ["| pass | float32 cache (float32 attention) | float16 cache | bfloat16 cache, bf16 products (default) "
             "| float32 / default |", "|---|---|---|---|---|"]
    for batch, ctx, n in SHAPES:
        caches = {kv: prefilled(model, kv, batch, ctx, n) for kv in CACHES}
        x = torch.randint(0, model.cfg.vocab_size, (batch, n), generator=torch.Generator().manual_seed(1))
        pos = (ctx + torch.arange(n))[None].expand(batch, -1)
        ts: dict[str, list[float]] = {kv: [] for kv in CACHES}
        for r in range(rounds + 1):  # round 0 warms up; the order alternates between rounds
            for kv in (CACHES if r % 2 == 0 else CACHES[::-1]):
                model.set_kv_cache_dtype(kv)
                t = time.perf_counter()
                model.forward(x, pos, caches[kv], ctx, logits="none")
                if r:
                    ts[kv].append(time.perf_counter() - t)
        med = {kv: 1e3 * statistics.median(v) for kv, v in ts.items()}
        lines.append(f"| B = {batch}, {ctx} cached, {n} new | {med['float32']:.2f} ms | {med['float16']:.2f} ms | "
                     f"{med['auto']:.2f} ms | {med['float32'] / med['auto']:.2f}× |")
        print(lines[-1], flush=True)
    model.set_kv_cache_dtype("auto")
    return lines


def quality(engine, path: str, per_category: int, max_new: int) -> list[str]:
    by: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            by.setdefault(q["category"], []).append(q["turns"][0])
    texts = [t for v in by.values() for t in v[:per_category]]
    model = engine.target
    model.set_activations("exact").set_kv_cache_dtype("auto")
    seqs = []
    for t in texts:
        ids = engine.encode(t)
        seqs.append((ids, engine.generate(ids, max_new_tokens=max_new).token_ids))

    def logits(ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids])
        return model.forward(x, torch.arange(len(ids))[None], model.new_cache(len(ids) + 8), 0).float()[0]
    runs = {}
    for label, act, kv in (("exact", "exact", "auto"), ("int8, float32 cache", "int8", "float32"),
                           ("int8, float16 cache", "int8", "float16"), ("int8, bfloat16 cache + bf16 products", "int8", "auto")):
        model.set_activations(act).set_kv_cache_dtype(kv)
        runs[label] = [logits(ids + out)[len(ids) - 1:-1] for ids, out in seqs]
    model.set_activations("exact").set_kv_cache_dtype("auto")
    lines = [f"{len(texts)} Spec-Bench prompts, the exact model's greedy answers ({max_new} tokens), teacher-forced", "",
             "| int8 mode | top-1 == exact float32 | mean KL(exact ‖ it) per token |", "|---|---|---|"]
    for label in list(runs)[1:]:
        agree = total = 0
        kl = 0.0
        for a, b in zip(runs["exact"], runs[label]):
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            kl += float(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                                   reduction="sum"))
        lines.append(f"| {label} | {agree / total:.4f} ({total} positions) | {kl / total:.5f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--quality", action="store_true", help="the agreement check instead of the timings")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--spec-bench", default=DEFAULT_SPEC_BENCH)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import turbospec
    from turbospec import ops
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}; "
          f"{args.threads} threads; kernels {ops.kernels_available()}", flush=True)
    if args.quality:
        print("\n".join(quality(turbospec.Engine(drafter="none", max_seq_len=2048), args.spec_bench,
                                args.per_category, args.max_new_tokens)))
        return 0
    model = turbospec.load_model(turbospec.default_model_path(), torch.float32).set_activations("int8")
    timings(model, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
