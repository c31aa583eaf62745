"""Serving benchmark: closed-loop clients at concurrency 1..32 against the batched engine.

Each client sends a Spec-Bench prompt (first turn, chat template), streams the answer, and sends the
next as soon as it ends. Per concurrency level and mode (speculation off / fixed length / auto, the
load-aware budget) it reports output tok/s, requests/s, time to first token and inter-token
latency (p50 / p99; a chunk of several accepted tokens spreads its gap over its tokens), and tau.
The peer is Hugging Face ``generate`` on left-padded batches of the same prompts (one batch per
level: what a static-batch server does). Everything runs in one process, one run, same machine.

The clients drive ``turbospec.serve.AsyncEngine`` in-process (the engine the HTTP server wraps),
so the figures are the engine's, without HTTP/JSON costs.

    python bench/bench_serve.py --concurrency 1 2 4 8 16 32 --temperature 0 0.7 --out bench/out/serve
    python bench/bench_serve.py --device cuda --dtype bfloat16 --model /tmp/turbospec_carry/model \
        --data /tmp/turbospec_carry/data/specbench_dev.jsonl --concurrency 1 2 4 8 16 32 64   # the GPU machine
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "specbench_dev.jsonl")


def load_prompts(path: str, n: int) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out.append(row["turns"][0])
            if len(out) == n:
                break
    return out


def draft_model(spec: str | None, model: str):
    """--draft-model: None, a model path, or layer-skip:N (the target's first N layers, loaded once)."""
    if spec is None or not spec.startswith("layer-skip:"):
        return spec
    import turbospec
    from turbospec.drafters.draft_model import layer_skip_draft
    from turbospec.model import loader
    path = loader.default_model_path() if model == "default" else model
    return layer_skip_draft(turbospec.load_model(path, torch.float32), int(spec.split(":", 1)[1]))


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def closed_loop(served, prompts: list[str], concurrency: int, n_requests: int, max_new: int,
                      temperature: float, speculate: bool) -> dict:
    from turbospec import Request
    queue = list(range(n_requests))
    ttft, itl, tokens, steps = [], [], 0, 0
    t_start = time.perf_counter()

    async def client():
        nonlocal tokens, steps
        while queue:
            i = queue.pop(0)
            req = Request(prompts[i % len(prompts)], max_new_tokens=max_new, temperature=temperature,
                          speculate=speculate)
            t0 = last = time.perf_counter()
            first = True
            async for d in served.stream(req):
                now = time.perf_counter()
                if d.token_ids:
                    if first:
                        ttft.append(now - t0)
                        first = False
                    else:
                        itl.extend([(now - last) / len(d.token_ids)] * len(d.token_ids))
                    last = now
                    tokens += len(d.token_ids)
                if d.generation is not None:
                    steps += d.generation.stats["verify_steps"]
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t_start
    return dict(tok_s=tokens / wall, req_s=n_requests / wall, ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99),
                itl_p50=pct(itl, 0.5), itl_p99=pct(itl, 0.99), tau=tokens / max(steps, 1), tokens=tokens,
                wall_s=wall)


def run_mode(engine, prompts, levels, max_new, temperature, speculate, requests_per_level,
             prefill_chunk: int | None = 64) -> dict:
    """One mode at every level. The engine steps on this (the main) thread, as ``turbospec serve``
    does; the clients' event loop runs on another thread."""
    import threading

    from turbospec.serve import AsyncEngine
    served = AsyncEngine(engine, max_waiting=1024, prefill_chunk=prefill_chunk).start(thread=False)
    out, failed = {}, []

    async def clients():
        # warm-up (allocations, the budget's first measurements), not timed
        await closed_loop(served, prompts, min(4, max(levels)), min(4, max(levels)), 16, temperature, speculate)
        for c in levels:
            n = max(requests_per_level * c, 4)
            out[c] = await closed_loop(served, prompts, c, n, max_new, temperature, speculate)
            r = out[c]
            print(f"  c={c:2d}: {r['tok_s']:7.1f} tok/s  {r['req_s']:.2f} req/s  ttft p50 {r['ttft_p50']*1e3:6.0f} ms "
                  f"p99 {r['ttft_p99']*1e3:6.0f} ms  itl p50 {r['itl_p50']*1e3:5.1f} ms p99 {r['itl_p99']*1e3:6.1f} ms"
                  f"  tau {r['tau']:.2f}", flush=True)

    def drive():
        try:
            asyncio.run(clients())
        except BaseException as e:
            failed.append(e)
        finally:
            served.close()

    thread = threading.Thread(target=drive, name="bench-clients")
    thread.start()
    served.work()
    thread.join()
    if failed:
        raise failed[0]
    return out


def hf_padded(source: str, tokenizer, prompts, levels, max_new, temperature, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> dict:
    """HF generate on left-padded batches: one batch of c prompts per level."""
    from turbospec.model.loader import load_hf_model
    model = load_hf_model(source, dtype, device)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = {}
    for c in levels:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in (prompts * (c // len(prompts) + 1))[:c]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        gen_kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id)
        gen_kw.update(do_sample=True, temperature=temperature) if temperature > 0 else gen_kw.update(do_sample=False)
        with torch.inference_mode():
            sync(device)
            t = time.perf_counter()
            model.generate(**enc, **gen_kw)
            sync(device)
            wall = time.perf_counter() - t
        out[c] = dict(tok_s=c * max_new / wall, req_s=c / wall, wall_s=wall)
        print(f"  c={c:2d}: {out[c]['tok_s']:7.1f} tok/s (HF padded batch)", flush=True)
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    temps = sorted({k[1] for k in results})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for (mode, t), per in sorted(results.items()):
            if t != temp:
                continue
            cs = sorted(per)
            ax.plot(cs, [per[c]["tok_s"] for c in cs], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"SmolLM2-135M, T = {temp}")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--draft-model", default=None,
                   help="with --drafter draft_model: a model path, or layer-skip:N (the target's first N layers)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--modes", nargs="+", default=["off", "fixed", "auto", "hf"],
                   choices=["off", "fixed", "auto", "hf"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=2, help="requests per client at each level")
    p.add_argument("--num-draft", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the engine and the HF peer)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per step while others decode (0: whole)")
    p.add_argument("--data", default=DATA)
    p.add_argument("--out", default=None, help="write <out>.json and <out>.png")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from turbospec import Engine, load_tokenizer
    from turbospec.model import loader
    prompts = load_prompts(args.data, 64)
    path = loader.default_model_path() if args.model == "default" else args.model
    tokenizer = load_tokenizer(path)
    max_batch = max(args.concurrency)
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.processor() or platform.machine(),
                cpu_flags=sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx", "fma", "f16c", "amx"))})
                if os.path.exists("/proc/cpuinfo") else [], threads=torch.get_num_threads(), args=vars(args))
    print(json.dumps(info), flush=True)
    results: dict = {}
    engines = {}
    for temp in args.temperature:
        for mode in args.modes:
            print(f"{mode} T={temp}", flush=True)
            if mode == "hf":
                results[(mode, temp)] = hf_padded(path, tokenizer, prompts, args.concurrency, args.max_new_tokens,
                                                  temp, args.device, getattr(torch, args.dtype))
                continue
            adaptive = mode != "fixed"
            if adaptive not in engines:
                # by name, so that drafter "auto" finds the default model's shipped head
                engines[adaptive] = Engine(args.model, drafter=args.drafter, num_draft=args.num_draft,
                                           max_batch=max_batch, max_seq_len=1024, adaptive=adaptive,
                                           draft_model=draft_model(args.draft_model, args.model),
                                           device=args.device, dtype=args.dtype)
                print(f"  drafter: {engines[adaptive].drafter.name if engines[adaptive].drafter else 'none'}, "
                      f"num_draft {engines[adaptive].num_draft}", flush=True)
            results[(mode, temp)] = run_mode(engines[adaptive], prompts, args.concurrency, args.max_new_tokens, temp,
                                             mode != "off", args.requests_per_level, args.prefill_chunk or None)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"info": info, "results": {f"{m}@T={t}": {str(c): r for c, r in per.items()}
                                                 for (m, t), per in results.items()}}, f, indent=1)
        plot(results, args.out + ".png")
    print("\n| T | mode | " + " | ".join(f"c={c}" for c in args.concurrency) + " |")
    print("|---|---|" + "---|" * len(args.concurrency))
    for (mode, temp), per in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {temp} | {mode} | " + " | ".join(f"{per[c]['tok_s']:.1f}" for c in args.concurrency) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
