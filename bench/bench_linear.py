"""Same-run A/B of the ``linear`` op alone between checkouts: time per call by weight format,
shape and input rows (a kernel change's check before the whole-model bench_ab.py).

  python bench/bench_linear.py --tree before=/work/before --tree after=. --rounds 8
  python bench/bench_linear.py --tree after=. --format bf16 --shape 1536x576 --rows 16,64,256

Each round runs every checkout once, in turn, each in its own process importing that checkout's
``turbospec`` (its own built ``_C``). Per case the child reports the fastest of its calls (the
least disturbed by a shared machine); the parent prints each checkout's fastest over the rounds
and the median of the per-round ratios to the first checkout. Formats: ``bf16`` (bfloat16 weights
and bfloat16-valued inputs: the AVX-512 BF16 dot products where the CPU has them), ``f32``, and the
GGUF block formats ``q4_0`` / ``q4_1`` / ``q8_0`` (float32 inputs, quantized from seeded normal
weights by the ``gguf`` package). ``--activations int8``: the block formats with int8 activations;
``q4_0x`` / ``q4_1x`` / ``q8_0x``: the same blocks interleaved by 16 rows (int8 activations only, the
layout a model takes in int8 mode). Only same-run ratios mean anything.

  python bench/bench_linear.py --tree after=. --format q4_1 --activations int8 --rows 1,4,16,64,256
  python bench/bench_linear.py --tree after=. --format q4_1x --rows 1,4,16,64,256
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ab import run_in_tree  # noqa: E402

CHILD = r"""
import json, sys, time, torch
from turbospec import ops
fmt, shapes, rows, threads, work = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
acts = int(sys.argv[6]) if len(sys.argv) > 6 else 0
torch.set_num_threads(threads)
out = {}
for shape in shapes.split(","):
    n, k = map(int, shape.split("x"))
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == "bf16":
        weights, code = w.bfloat16(), 30
    elif fmt == "f32":
        weights, code = w, 0
    else:
        from gguf import GGMLQuantizationType, quants
        base = fmt.rstrip("x")
        qt = GGMLQuantizationType[base.upper()]
        weights = torch.from_numpy(quants.quantize(w.numpy(), qt).copy())
        code = {"q4_0": 2, "q4_1": 3, "q8_0": 8}[base]
        if fmt.endswith("x"):
            from turbospec.ops import reference
            weights, code = reference.interleave_blocks(weights, code, k), 2000 + code
    for r in map(int, rows.split(",")):
        x = torch.randn(r, k, generator=g)
        if fmt == "bf16":
            x = x.bfloat16()
        call = lambda: ops.linear(x, [weights], [code], None, activations=acts)
        for _ in range(3):
            call()
        best = float("inf")
        for _ in range(max(5, int(work / (2 * n * k * r)))):
            s = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - s)
        out[f"{shape} rows {r}"] = best * 1e6
print(json.dumps(out))
"""


def run(tree: str, args) -> dict:
    acts = 8 if args.activations == "int8" or args.format.endswith("x") else 0
    return run_in_tree(tree, CHILD, [args.format, args.shape, args.rows, args.threads, args.work, acts], args.threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout with _C built")
    p.add_argument("--format", default="bf16", choices=["bf16", "f32", "q4_0", "q4_1", "q8_0", "q4_0x", "q4_1x", "q8_0x"])
    p.add_argument("--activations", default="exact", choices=["exact", "int8"],
                   help="int8: the block formats with int8 activations (the x formats always)")
    p.add_argument("--shape", default="1536x576,576x1536,576x576,8192x576",
                   help="comma list of OUTxIN weight shapes (default: SmolLM2's layers and a draft LM head)")
    p.add_argument("--rows", default="16,64,256", help="comma list of input rows")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=float, default=6e8, help="multiply-adds x 2 timed per case and round")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, path in trees:
            runs[name].append(run(path, args))
    first = trees[0][0]
    cases = list(runs[first][0])
    print(f"linear, {args.format}, {args.threads} threads, {args.rounds} rounds; us per call (fastest), "
          f"GFLOPS, median per-round ratio to {first}")
    result = {"machine": platform.processor() or platform.machine(), "args": vars(args), "cases": {}}
    for case in cases:
        shape, _, r = case.split()
        n, k = map(int, shape.split("x"))
        row = {}
        for name, _ in trees:
            best = min(x[case] for x in runs[name])
            ratio = statistics.median(x[case] / y[case] for x, y in zip(runs[name], runs[first]))
            row[name] = {"us": best, "gflops": 2 * n * k * int(r) / best / 1e3, "ratio": ratio}
        result["cases"][case] = row
        print(f"  {case:>22}: " + "  ".join(f"{name} {v['us']:9.1f} us {v['gflops']:6.1f} GF x{v['ratio']:.3f}"
                                             for name, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
