"""Op benchmarks: each turbospec op (compiled kernel) vs its pure-torch reference.

    python bench/bench_ops.py                  # CPU
    python bench/bench_ops.py --device cuda    # CUDA events, median of many

Times are medians over --iters runs after warm-up. The reference verify is a Python loop, so it is
timed with fewer iterations. Rows "(vs SDPA)" compare tree_attention with torch's SDPA instead.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from turbospec import ops
from turbospec.ops import reference  # noqa: E402


def timeit(fn, device: str, iters: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def chain_parents(n: int) -> torch.Tensor:
    return torch.arange(-1, n - 1)[None]


def bench_tree_attention(dev: str, iters: int, g: torch.Generator) -> list[tuple[str, float, float]]:
    """tree_attention over a chain of n new tokens after a prefix, in a static cache of S = the longest
    prefix + 128 positions: vs the reference, and (CPU) vs torch SDPA with an explicit boolean mask
    over [0, prefix + n), the call it may replace in the verify pass."""
    if dev == "cuda":
        dtype, hq, hkv, d, prefixes = torch.bfloat16, 32, 8, 128, (512, 2048, 8192)
    else:
        dtype, hq, hkv, d, prefixes = torch.float32, 9, 3, 64, (512, 2048)  # SmolLM2-135M's attention
    seq = max(prefixes) + 128
    kc = torch.randn(1, hkv, seq, d, generator=g).to(dtype).to(dev)
    vc = torch.randn(1, hkv, seq, d, generator=g).to(dtype).to(dev)
    scale = d ** -0.5
    name = str(dtype).removeprefix("torch.")
    rows = []
    for prefix in prefixes:
        for n in (1, 16, 64):
            q = torch.randn(1, n, hq, d, generator=g).to(dtype).to(dev)
            cache_len = torch.tensor([prefix], device=dev)
            packed = ops.build_tree(chain_parents(n).to(dev))[1]
            out = torch.empty_like(q)
            label = f"tree_attention {name} Hq={hq} Hkv={hkv} D={d} prefix={prefix} n={n}"
            kern = timeit(lambda: ops.tree_attention(q, kc, vc, cache_len, packed, scale, out=out), dev, iters)
            ref = timeit(lambda: reference.tree_attention(q, kc, vc, cache_len, packed, scale), dev,
                         max(3, iters // 10))
            rows.append((label, kern, ref))
            if dev == "cpu":
                total = prefix + n
                mask = torch.ones(1, 1, n, total, dtype=torch.bool)
                mask[0, 0, :, prefix:] = torch.ones(n, n, dtype=torch.bool).tril()
                qt, keys, values = q.transpose(1, 2), kc[:, :, :total], vc[:, :, :total]
                sdpa = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, keys, values, attn_mask=mask, scale=scale, enable_gqa=True), dev, iters)
                rows.append((f"{label} (vs SDPA)", kern, sdpa))
    return rows


def bench_batch_attention(iters: int) -> list[tuple[str, float, float]]:
    """CPU: one layer's tree_attention in a serving decode step: 16 rows at prefixes of 100-1,400
    cached tokens (seeded), n = 1 / 2 / 4 / 17 new tokens each, SmolLM2-135M's heads; float16 and
    bfloat16 caches against the float32 cache (the "reference" column here is the float32 cache)."""
    g = torch.Generator().manual_seed(0)
    bsz, hq, hkv, d, seq = 16, 9, 3, 64, 1536
    lens = torch.randint(100, 1400, (bsz,), generator=g)
    k = torch.randn(bsz, hkv, seq, d, generator=g)
    v = torch.randn(bsz, hkv, seq, d, generator=g)
    rows = []
    for n in (1, 2, 4, 17):
        q = torch.randn(bsz, n, hq, d, generator=g)
        packed = ops.build_tree(chain_parents(n).expand(bsz, n).contiguous())[1]
        out = torch.empty_like(q)
        times = {}
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            kc, vc = k.to(dt), v.to(dt)
            times[dt] = timeit(lambda: ops.tree_attention(q, kc, vc, lens, packed, d ** -0.5, out=out), "cpu", iters)
        label = f"tree_attention B={bsz} prefixes 100-1,400 Hq={hq} Hkv={hkv} D={d} n={n}"
        rows.append((f"{label} (float32 cache)", times[torch.float32], times[torch.float32]))
        for dt in (torch.float16, torch.bfloat16):
            rows.append((f"{label} ({str(dt).removeprefix('torch.')} cache vs float32)", times[dt], times[torch.float32]))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--only", choices=["batch-attention"], default=None,
                   help="batch-attention: only the serving decode step's attention rows (CPU)")
    args = p.parse_args()
    dev = args.device
    print(f"kernels: {ops.kernels_available()}  device: {dev}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    if args.only == "batch-attention":
        return report(bench_batch_attention(args.iters))
    rows = []
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 128256):
        for n, temp in ((1, 0.0), (8, 0.0), (8, 0.7)):
            logits = torch.randn(1, n, vocab, generator=g).to(dev)
            parents = chain_parents(n).to(dev)
            draft = torch.randint(0, vocab, (1, n), generator=g).to(dev)
            uniform = torch.rand(1, n, generator=g).to(dev)
            kern = timeit(lambda: ops.verify(logits, parents, draft, None, uniform, temp, 0, 1.0), dev, args.iters)
            ref = timeit(lambda: reference.verify(logits.cpu(), parents.cpu(), draft.cpu(), None, uniform.cpu(),
                                                  temp, 0, 1.0), "cpu", max(3, args.iters // 10))
            rows.append((f"verify V={vocab} N={n} T={temp}", kern, ref))
    for n in (8, 64):
        parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, n)]], device=dev)
        kern = timeit(lambda: ops.build_tree(parents), dev, args.iters)
        ref = timeit(lambda: reference.build_tree(parents.cpu()), "cpu", args.iters)
        rows.append((f"build_tree N={n}", kern, ref))
    caches = [torch.randn(1, 3, 2048, 64, device=dev) for _ in range(60)]
    prefix = torch.tensor([1000], device=dev)
    idx = torch.tensor([[0, 2, 5, 9, -1, -1, -1, -1, -1, -1]], device=dev)
    alen = torch.tensor([3], device=dev)
    kern = timeit(lambda: ops.compact_kv(caches, prefix, idx, alen), dev, args.iters)
    ref = timeit(lambda: reference.compact_kv(caches, prefix.cpu(), idx.cpu(), alen.cpu()) if dev == "cpu"
                 else None, dev, args.iters)
    rows.append(("compact_kv 60 tensors [1,3,2048,64], 3 accepted", kern, ref))
    rows += bench_tree_attention(dev, args.iters, g)
    if dev == "cpu":
        rows += bench_batch_attention(args.iters)
    return report(rows)


def report(rows: list[tuple[str, float, float]]) -> int:
    print(f"\n| op | kernel µs | reference µs | speedup |\n|---|---|---|---|")
    for name, k, r in rows:
        print(f"| {name} | {k * 1e6:.1f} | {r * 1e6:.1f} | {r / k:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
