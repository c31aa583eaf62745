"""Op benchmarks: each turbospec op (compiled kernel) vs its pure-torch reference.

    python bench/bench_ops.py                  # CPU
    python bench/bench_ops.py --device cuda    # CUDA events, median of many

Times are medians over --iters runs after warm-up. The reference verify is a Python loop, so it is
timed with fewer iterations.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from turbospec import ops, reference  # noqa: E402


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    dev = args.device
    print(f"kernels: {ops.kernels_available()}  device: {dev}  torch {torch.__version__}")
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
    print(f"\n| op | kernel µs | reference µs | speedup |\n|---|---|---|---|")
    for name, k, r in rows:
        print(f"| {name} | {k * 1e6:.1f} | {r * 1e6:.1f} | {r / k:.1f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
