"""The batched scheduler in process, without HTTP: where a serving level's time goes (CPU).

Requests from the serving benchmark's prompts (``bench_serve.load_prompts``, categories interleaved,
the same order its HTTP levels use) go into one ``Engine.scheduler`` of ``--concurrency`` slots, all
queued at once (continuous batching keeps every slot busy, as closed-loop clients would), greedy,
``--max-new-tokens`` each. Reported: output tok/s, verify steps, the time in prefill (joining
prompts, in chunks of ``--prefill-chunk`` while others decode), drafting and the verify passes, and
per pass its requests, its real tokens (each request's root + draft) and the tokens a pass padded to
its longest draft would hold (rows x the longest) — a ragged pass (CPU's eager path) computes the
first only.

    python bench/bench_batch.py --concurrency 16 --requests 48
    PYTHONPATH=/path/to/other/tree python bench/bench_batch.py ...   # another tree, same run: alternate
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/bench_serve.py

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--activations", default="int8", choices=["exact", "int8"])
    p.add_argument("--concurrency", type=int, default=16, help="slots (requests decoded at once)")
    p.add_argument("--requests", type=int, default=None, help="requests (default: 3 x --concurrency)")
    p.add_argument("--skip", type=int, default=4, help="prompts skipped first (bench_serve's warm-up ones)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=256, help="0: whole prompts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.concurrency < 1 or (args.requests is not None and args.requests < 1):
        raise SystemExit(f"--concurrency and --requests must be >= 1, got {args.concurrency}, {args.requests}")
    torch.set_num_threads(args.threads)
    import turbospec
    from turbospec.decode import batch
    from turbospec.decode.batch import Request
    from bench_serve import DATA, load_prompts

    eng = turbospec.Engine(args.model, drafter=args.drafter, max_batch=args.concurrency, max_seq_len=2048,
                           activations=args.activations)
    n_req = args.requests or 3 * args.concurrency
    prompts = load_prompts(DATA, 1 << 30, interleave=True)[args.skip: args.skip + n_req]
    sched = eng.scheduler(prefill_chunk=args.prefill_chunk or None)
    seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
    passes: list[tuple[int, int, int, float]] = []  # requests, real tokens, padded tokens, seconds

    def timed(fn, key):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seconds[key] += time.perf_counter() - t
        return call

    step = sched.batch.step

    def verify(rows, *a, **kw):
        t = time.perf_counter()
        out = step(rows, *a, **kw)
        dt = time.perf_counter() - t
        seconds["verify"] += dt
        sizes = [1 + (0 if s.draft is None else len(s.draft)) for s in rows.values()]
        passes.append((len(sizes), sum(sizes), (max(rows) + 1) * max(sizes), dt))
        return out

    sched._prefill = timed(sched._prefill, "prefill")
    sched.batch.step = verify
    drive = batch.drive
    batch.drive = timed(drive, "draft")
    try:
        for i, text in enumerate(prompts[:2]):  # warm-up (allocations, the budget's first measurements)
            sched.add(eng.job(Request(text, max_new_tokens=8), index=i))
        while sched.busy:
            sched.step()
        for k in seconds:
            seconds[k] = 0.0
        passes.clear()
        t0 = time.perf_counter()
        for i, text in enumerate(prompts):
            sched.add(eng.job(Request(text, max_new_tokens=args.max_new_tokens), index=i))
        tokens = 0
        while sched.busy:
            tokens += sum(len(o.tokens) for o in sched.step())
        wall = time.perf_counter() - t0
    finally:
        batch.drive = drive
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.processor() or platform.machine(),
               threads=args.threads, args=vars(args), requests=len(prompts), tokens=tokens, wall_s=wall,
               tok_s=tokens / wall, passes=len(passes),
               share={k: v / wall for k, v in seconds.items()},
               mean_requests=statistics.mean(x[0] for x in passes) if passes else 0.0,
               mean_tokens=statistics.mean(x[1] for x in passes) if passes else 0.0,
               mean_padded_tokens=statistics.mean(x[2] for x in passes) if passes else 0.0,
               mean_pass_ms=1e3 * statistics.mean(x[3] for x in passes) if passes else 0.0)
    print(f"{res['date']}; {res['machine']}; {args.threads} threads; {args.activations}; drafter {args.drafter}; "
          f"c = {args.concurrency}, {len(prompts)} requests x <= {args.max_new_tokens} tokens")
    print(f"{tokens} tokens in {wall:.2f} s: {res['tok_s']:.1f} tok/s, {len(passes)} verify passes")
    print("time: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in res["share"].items()))
    print(f"per pass: {res['mean_requests']:.1f} requests, {res['mean_tokens']:.1f} tokens "
          f"({res['mean_padded_tokens']:.1f} padded to the longest draft), {res['mean_pass_ms']:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
