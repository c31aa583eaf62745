"""Same-run A/B of plain decode speed between two checkouts (a regression check for a change).

  python bench/bench_ab.py --tree before=/work/before --tree after=. --rounds 5

Each round runs every checkout once, in turn (A B A B ...), each in its own process importing that
checkout's ``turbospec`` (its own built ``_C``): ``--model`` (default: SmolLM2-135M-Instruct, the
GGUF's Q4_1 blocks as stored) decoding ``--tokens`` greedy tokens after a short chat prompt, plain
(no drafts), at ``--threads`` threads, per ``--dtype`` (``--weights dense``: dequantized to it); a
verify pass of ``--nodes`` tokens; a prefill pass of 256 tokens; with ``--long N`` a prefill of N
tokens in one call and the verify pass after them. ``--activations int8`` (repeatable, with
``exact``): the GGUF's linears take int8 activations (``Engine(activations="int8")``).
Then speculative decoding through the whole step at fixed lengths (n-gram chains of 8, the shipped
EAGLE-3 head's 16-node trees) on a rewrite prompt. Prints each checkout's medians and their
ratios; writes JSON with --out. Only same-run ratios mean anything (machines and their load differ).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, torch
import turbospec, turbospec.heads.shipped
from turbospec import Engine
dtype, tokens, threads, nodes, weights = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
acts = sys.argv[6] if len(sys.argv) > 6 else "exact"
model = sys.argv[7] if len(sys.argv) > 7 else "default"
long_n = int(sys.argv[8]) if len(sys.argv) > 8 else 0
torch.set_num_threads(threads)
eng = Engine(model, drafter="none", dtype=dtype, max_seq_len=max(512, long_n + nodes), weights=weights, activations=acts)
prompt = "Explain in a few sentences why the sky is blue."
eng.generate(prompt, max_new_tokens=8)  # warm-up
g = eng.generate(prompt, max_new_tokens=tokens)
t = eng.target
cache = t.new_cache(256)
ids = torch.randint(0, t.cfg.vocab_size, (1, 100))
t.forward(ids, torch.arange(100)[None], cache, 0, logits="none")
x = torch.randint(0, t.cfg.vocab_size, (1, nodes))
pos = torch.arange(100, 100 + nodes)[None]
times = []
for _ in range(7):
    s = time.perf_counter()
    t.forward(x, pos, cache, 100, logits="normed")
    times.append(time.perf_counter() - s)
# prefill: one pass of 256 prompt tokens into an empty cache (no LM head)
pre = torch.randint(0, t.cfg.vocab_size, (1, 256))
ptimes = []
for _ in range(5):
    s = time.perf_counter()
    t.forward(pre, torch.arange(256)[None], cache, 0, logits="none")
    ptimes.append(time.perf_counter() - s)
out = {"tok_s": g.stats["decode_tokens_per_s"], "tokens": len(g.token_ids),
       "verify_ms": sorted(times)[3] * 1e3, "prefill_tok_s": 256 / sorted(ptimes)[2], "ids": g.token_ids[:16]}
if long_n:  # a long prompt: one prefill call of long_n tokens, then a verify pass of `nodes` after them
    big = t.new_cache(long_n + nodes)
    pre = torch.randint(0, t.cfg.vocab_size, (1, long_n))
    ltimes, vtimes = [], []
    for _ in range(3):
        s = time.perf_counter()
        t.forward(pre, torch.arange(long_n)[None], big, 0, logits="none")
        ltimes.append(time.perf_counter() - s)
    pos = torch.arange(long_n, long_n + nodes)[None]
    for _ in range(5):
        s = time.perf_counter()
        t.forward(x, pos, big, long_n, logits="normed")
        vtimes.append(time.perf_counter() - s)
    out["long_prefill_tok_s"] = long_n / sorted(ltimes)[1]
    out["long_verify_ms"] = sorted(vtimes)[2] * 1e3
# speculative decoding through the whole step (drafts, tree verify, lazy LM head, compaction):
# n-gram chains and the shipped EAGLE-3 head's 16-node trees, fixed lengths
rewrite = "Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, limes."
spec = [("ngram", dict(drafter="ngram", num_draft=8))]
if model == "default":  # the shipped head is SmolLM2's
    spec.append(("eagle3", dict(drafter="eagle", head=turbospec.heads.shipped.shipped_heads()["eagle3"], num_draft=16)))
for name, kw in spec:
    e = Engine(model, dtype=dtype, max_seq_len=512, adaptive=False, weights=weights, activations=acts, **kw)
    e.generate(rewrite, max_new_tokens=8)
    s = e.generate(rewrite, max_new_tokens=tokens)
    out[name + "_tok_s"], out[name + "_ids"] = s.stats["decode_tokens_per_s"], s.token_ids[:16]
print(json.dumps(out))
"""


def run_in_tree(tree: str, child: str, argv: list, threads: int) -> dict:
    """Run the ``child`` script in its own process importing checkout ``tree``'s turbospec; its
    last stdout line is JSON (bench_linear.py uses this too)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", child, *map(str, argv)],
                         env=env, cwd=os.path.abspath(tree), capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(tree: str, dtype: str, args) -> dict:
    """``dtype``: "float32" or "float32/int8" (the dtype and the activations)."""
    d, _, acts = dtype.partition("/")
    return run_in_tree(tree, CHILD, [d, args.tokens, args.threads, args.nodes, args.weights, acts or "exact",
                                     args.model, args.long], args.threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout with _C built")
    p.add_argument("--dtype", action="append", default=None, help="float32 / bfloat16 (default: both)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--nodes", type=int, default=16, help="tokens of the timed verify pass")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="auto", choices=["auto", "dense"],
                   help="auto: the GGUF's blocks as stored; dense: dequantized to --dtype")
    p.add_argument("--model", default="default", help="'default' (SmolLM2 Q4_1) or a GGUF / model path; "
                   "another model's rows leave out the shipped EAGLE-3 head")
    p.add_argument("--activations", action="append", default=None, choices=["exact", "int8"],
                   help="exact (default) and / or int8 (the GGUF linears' int8 activations)")
    p.add_argument("--long", type=int, default=0, metavar="N",
                   help="also time a prefill of N prompt tokens in one call and the verify pass after them "
                        "(attention over a long context; 0: skip)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    if any(len(t) != 2 for t in trees):
        p.error("--tree takes NAME=PATH")
    dtypes = [d if a == "exact" else f"{d}/{a}" for d in (args.dtype or ["float32", "bfloat16"])
              for a in (args.activations or ["exact"])]
    res = {d: {name: [] for name, _ in trees} for d in dtypes}
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in range(args.rounds):
        for d in dtypes:
            for name, path in trees:
                res[d][name].append(run(path, d, args))
                print(f"round {r + 1} {d} {name}: {res[d][name][-1]['tok_s']:.1f} tok/s, "
                      f"verify {res[d][name][-1]['verify_ms']:.2f} ms", flush=True)
    summary = {}
    for d in dtypes:
        base = None
        for name, _ in trees:
            runs = res[d][name]
            if len({tuple(x["ids"]) for x in runs}) != 1:
                raise SystemExit(f"{name} {d}: the rounds decoded different tokens")
            tok = statistics.median(x["tok_s"] for x in runs)
            ver = statistics.median(x["verify_ms"] for x in runs)
            pre = statistics.median(x["prefill_tok_s"] for x in runs)
            spec = {k: statistics.median(x[k + "_tok_s"] for x in runs) for k in ("ngram", "eagle3")
                    if k + "_tok_s" in runs[0]}
            longs = {k: statistics.median(x[k] for x in runs) for k in ("long_prefill_tok_s", "long_verify_ms")
                     if k in runs[0]}
            base = base or (tok, ver, spec, pre, longs)
            summary[f"{d} {name}"] = {"tok_s": tok, "verify_ms": ver, "tok_s_ratio": tok / base[0],
                                      "verify_ratio": ver / base[1], "prefill_tok_s": pre,
                                      "prefill_ratio": pre / base[3],
                                      **longs, **{k.replace("_tok_s", "").replace("_ms", "") + "_ratio": v / base[4][k]
                                                  for k, v in longs.items()},
                                      **{f"{k}_tok_s": v for k, v in spec.items()},
                                      **{f"{k}_ratio": v / base[2][k] for k, v in spec.items()}}
            print(f"{d:9s} {name:10s} decode {tok:7.1f} tok/s ({tok / base[0]:.3f}x)  "
                  f"verify {args.nodes} nodes {ver:6.2f} ms ({ver / base[1]:.3f}x)  "
                  f"prefill 256 {pre:7.1f} tok/s ({pre / base[3]:.3f}x)  "
                  + "  ".join(f"{k} {v:6.1f} tok/s ({v / base[2][k]:.3f}x)" for k, v in spec.items())
                  + "".join(f"  {k} {v:7.1f} ({v / base[4][k]:.3f}x)" for k, v in longs.items()))
        for key in ("ids", "ngram_ids", "eagle3_ids"):
            if key not in res[d][trees[0][0]][0]:
                continue
            ids = {name: res[d][name][0][key] for name, _ in trees}
            if len({tuple(v) for v in ids.values()}) != 1:
                print(f"WARNING {d} {key}: the checkouts decoded different tokens: {ids}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": start, "machine": platform.processor() or
                       platform.machine(), "summary": summary, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
