"""Where a target step's GPU time goes: every kernel of ``runner.forward`` (CUDA graphs off, so the
profiler sees each launch), grouped by kernel name, as device µs per step; plus the kernel-only
device time of the turbospec ops (verify, tree_attention) that bench_ops.py times with their host
overhead included.

    python bench/profile_step.py                           # SmolLM2- and Llama-3-8B-shaped, CUDA
    python bench/profile_step.py --models smollm2_135m --tokens 1,64
    python bench/profile_step.py --device cpu --tiny       # smoke run

Timing: torch.profiler (CUPTI) device time of each kernel, summed over ``--steps`` calls and divided
by that count; "sum of kernels" is the GPU-busy time of a step, "wall" the CUDA-event time of the
same call with the graph replayed (graphs on) when on CUDA. The gap between the two is launch and
idle time that a CUDA graph does not remove (it removes the host's part only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_gpu as bg  # noqa: E402


def kernel_table(fn, steps: int, device: str) -> list[tuple[str, float, float]]:
    """(kernel name, calls per step, device µs per step), slowest first."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for _ in range(3):
        fn()
    bg.synchronize(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        bg.synchronize(device)
    rows = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if device == "cuda" and getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if device != "cuda" and not e.name.startswith("aten::"):
            continue
        r = rows[e.name]
        r[0] += 1
        r[1] += e.time_range.elapsed_us()  # µs, this launch (kernel) alone
    out = [(name, c / steps, t / steps) for name, (c, t) in rows.items()]
    return sorted(out, key=lambda r: -r[2])


def print_table(title: str, table, top: int) -> float:
    total = sum(t for _, _, t in table)
    calls = sum(c for _, c, _ in table)
    print(f"\n### {title}\n\n{calls:.0f} kernels per step, sum {total:.1f} µs\n")
    print("| kernel | calls/step | µs/step | % |\n|---|---|---|---|")
    for name, c, t in table[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| `{short}` | {c:.0f} | {t:.1f} | {100 * t / max(total, 1e-9):.0f} |")
    return total


def profile_model(name: str, args) -> None:
    config = bg.model_config(name, args.tiny)
    dtype = getattr(torch, args.dtype)
    model = bg.build_random_llama(config, args.device, dtype)
    cache_len = args.cache_len
    gen = torch.Generator().manual_seed(0)
    for graphs in ([False, True] if args.device == "cuda" else [False]):
        engine = bg.make_engine(model, args, graphs, cache_len + 64 + 8)
        runner = engine.runner
        for n in args.tokens:
            ids, pos, packed = bg.step_inputs(n, cache_len, "tree" if n > 1 else "chain", config.vocab_size,
                                              args.device, gen)
            fn = lambda: runner.forward(ids, pos, cache_len, packed)  # noqa: E731
            wall = statistics.median(bg.time_calls(fn, args.device, args.iters, 5)) * 1e6
            label = f"{name} n={n} cache_len={cache_len} graphs={'on' if graphs else 'off'}"
            if graphs:
                print(f"\n{label}: wall {wall:.1f} µs per step (CUDA events, graph replay)")
            else:
                total = print_table(f"{label}", kernel_table(fn, args.steps, args.device), args.top)
                print(f"\nwall {wall:.1f} µs per step (CUDA events, graphs off); sum of kernels {total:.1f} µs")
        del engine, runner
        bg.free_memory(args.device)
    del model
    bg.free_memory(args.device)


def profile_ops(args) -> None:
    from turbospec import ops
    dev = args.device
    g = torch.Generator().manual_seed(0)
    print("\n## Op kernels alone (device time per call, launch overhead excluded)\n")
    print("| op | kernels | device µs/call |\n|---|---|---|")
    vocabs = (256,) if args.tiny else (49152, 128256)
    for vocab in vocabs:
        for n, temp in ((1, 0.0), (8, 0.0), (8, 0.7), (64, 0.7)):
            logits = torch.randn(1, n, vocab, generator=g).to(dev)
            parents = torch.arange(-1, n - 1)[None].to(dev)
            draft = torch.randint(0, vocab, (1, n), generator=g).to(dev)
            uniform = torch.rand(1, n, generator=g).to(dev)
            tab = kernel_table(lambda: ops.verify(logits, parents, draft, None, uniform, temp, 0, 1.0), args.steps, dev)
            print(f"| verify V={vocab} N={n} T={temp} | {', '.join(k[:40] for k, _, _ in tab[:3])} | "
                  f"{sum(t for _, _, t in tab):.1f} |")
    hq, hkv, d = (4, 2, 16) if args.tiny else (32, 8, 128)
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    for prefix in ((16,) if args.tiny else (512, 2048, 8192)):
        seq = prefix + 128
        kc = torch.randn(1, hkv, seq, d, generator=g).to(dtype).to(dev)
        vc = torch.randn(1, hkv, seq, d, generator=g).to(dtype).to(dev)
        for n in (1, 16, 64):
            q = torch.randn(1, n, hq, d, generator=g).to(dtype).to(dev)
            packed = ops.build_tree(torch.arange(-1, n - 1)[None].to(dev))[1]
            cl = torch.tensor([prefix], device=dev)
            out = torch.empty_like(q)
            tab = kernel_table(lambda: ops.tree_attention(q, kc, vc, cl, packed, d ** -0.5, out=out), args.steps, dev)
            kv_bytes = 2 * hkv * (prefix + n) * d * q.element_size()
            t = sum(x for _, _, x in tab)  # µs
            print(f"| tree_attention Hq={hq} Hkv={hkv} D={d} prefix={prefix} n={n} | "
                  f"{', '.join(k[:40] for k, _, _ in tab[:2])} | {t:.1f} ({kv_bytes / max(t, 1e-9) / 1e3:.0f} GB/s "
                  f"of K/V) |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--models", default="smollm2_135m,llama3_8b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--cache-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="profiled calls per shape")
    p.add_argument("--iters", type=int, default=20, help="CUDA-event timed calls per shape")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sections", default="steps,ops")
    args = p.parse_args()
    args.tokens = [int(x) for x in args.tokens.split(",")]
    args.static_shapes = "auto"
    if args.tiny:
        args.cache_len = min(args.cache_len, 32)
    print(f"# profile_step: {bg.device_name(args.device)}, torch {torch.__version__}, dtype {args.dtype}")
    if "steps" in args.sections:
        for name in args.models.split(","):
            profile_model(name, args)
    if "ops" in args.sections:
        profile_ops(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
