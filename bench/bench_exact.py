"""Speculative == plain, token for token, in every dtype and weight format (the exactness issue).

For each configuration (weights x activation dtype) the target is loaded once; every prompt is
decoded greedily without speculation and then with each drafter (n-gram lookup, a draft model =
the target's first layers, the shipped EAGLE-3 and Medusa heads with their trees), all by the same
engine parts. A prompt counts as equal when the token ids are identical; the first divergence (if
any) is recorded. Optionally HF ``generate`` (greedy, the same dtype, the dequantized model) is run
on the first prompts too, for the mismatch rate against the engine people compare with.

Results go to ``OUT/exact.jsonl`` one line per (config, prompt, system) as they are produced (a run
that is cut off keeps what it did; ``--resume`` skips what is there) and a markdown table to
``OUT/exact.md``.

    python bench/bench_exact.py --configs q4_1-bf16 --prompts 240 --max-new-tokens 256
    python bench/bench_exact.py --configs bf16,fp16 --prompts 24 --hf-prompts 24
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
SPECBENCH = os.path.join(HERE, "..", "..", "shared", "data", "specbench_dev.jsonl")
#: name -> (weights, dtype, activations)
CONFIGS = {
    "f32": ("auto", "float32", "exact"),        # the GGUF's blocks, float32 activations (the default)
    "q4_1-bf16": ("auto", "bfloat16", "exact"),  # the GGUF's Q4_1 blocks, bfloat16 activations
    "q4_1-fp16": ("auto", "float16", "exact"),
    "q4_1-int8": ("auto", "float32", "int8"),    # the GGUF's blocks, int8 activations (llama.cpp's arithmetic)
    "bf16": ("dense", "bfloat16", "exact"),      # dequantized to bfloat16 weights
    "fp16": ("dense", "float16", "exact"),
}
SYSTEMS = ("ngram", "draft_model", "eagle3", "medusa")


def specbench_prompts(path: str, n: int) -> list[tuple[str, str]]:
    """The first turn of ``n`` Spec-Bench questions, categories interleaved (round robin in file
    order), so that a prefix of the list covers every category."""
    by_cat: dict[str, list[str]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            by_cat[row["category"]].append(row["turns"][0])
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        for cat, rows in by_cat.items():
            if i < len(rows) and len(out) < n:
                out.append((cat, rows[i]))
        i += 1
    return out


def engines(target, tokenizer, systems, max_seq_len: int) -> dict:
    import turbospec
    from turbospec.drafters.draft_model import layer_skip_draft
    from turbospec.heads.shipped import shipped_heads
    heads = shipped_heads()
    out = {"plain": turbospec.Engine(target, drafter="none", tokenizer=tokenizer, max_seq_len=max_seq_len)}
    for s in systems:
        if s == "ngram":
            out[s] = turbospec.Engine(target, drafter="ngram", tokenizer=tokenizer, max_seq_len=max_seq_len)
        elif s == "draft_model":
            out[s] = turbospec.Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 8),
                                      tokenizer=tokenizer, max_seq_len=max_seq_len)
        elif s in ("eagle3", "medusa"):
            if s not in heads:
                raise SystemExit(f"no shipped {s} head (turbospec.heads.shipped: {sorted(heads)})")
            kind = "eagle" if s == "eagle3" else "medusa"
            out[s] = turbospec.Engine(target, drafter=kind, head=heads[s], tokenizer=tokenizer,
                                      max_seq_len=max_seq_len)
        else:
            raise SystemExit(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    return out


def hf_greedy(src: str, dtype, prompt_ids: list[list[int]], max_new_tokens: int, eos: int) -> list[list[int]]:
    """HF ``generate`` greedy on the same prompt token ids (the checkpoint as turbospec resolves it, in ``dtype``)."""
    import torch
    from turbospec.model.loader import load_hf_model
    hf = load_hf_model(src, dtype)
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.inference_mode():
            g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos)
        out.append(g[0, x.shape[1]:].tolist())
    return out


def invariance_cost(src: str, dtypes: list[str], tokens: int, rounds: int) -> list[dict]:
    """What batch invariance costs: plain decode tok/s (decode-only, as llama-bench tg) and the time
    of an 8-token verify pass with turbospec's kernels (one reduction order per row, the default)
    against the same model with every linear through torch's ``F.linear`` and the Python layer loop
    (MKL / oneDNN: faster kernels chosen per shape, so a row's bits depend on the rows beside it).
    Dense weights in each dtype; rounds alternate the two paths; medians."""
    import statistics
    import torch
    import turbospec
    from turbospec.model.loader import parse_dtype

    def decode_tps(model) -> float:
        cache = model.new_cache(16 + tokens + 1)
        ids = torch.arange(8)[None] + 10
        tok = model.forward(ids, torch.arange(8)[None], cache, 0, logits="last")[0, -1].argmax()
        t = time.perf_counter()
        for i in range(tokens):
            tok = model.forward(tok.view(1, 1), torch.tensor([[8 + i]]), cache, 8 + i, logits="last")[0, -1].argmax()
        return tokens / (time.perf_counter() - t)

    def verify_ms(model, n: int = 8, reps: int = 10) -> float:
        cache = model.new_cache(160)
        model.forward(torch.arange(128)[None] % 1000 + 10, torch.arange(128)[None], cache, 0, logits="none")
        ids, pos = torch.arange(n)[None] + 20, torch.arange(n)[None] + 128
        model.forward(ids, pos, cache, 128)
        t = time.perf_counter()
        for _ in range(reps):
            model.forward(ids, pos, cache, 128)
        return (time.perf_counter() - t) / reps * 1e3

    def torch_path(model, on: bool):
        model.use_cpp_layers = not on
        for lin in [model.lm_head] + [m for layer in model.layers for m in layer.linears()]:
            lin.kernel = not on
            lin._dense = lin.dense() if on else None

    out = []
    for name in dtypes:
        model = turbospec.load_model(src, parse_dtype(name), weights="dense")
        runs = {"turbospec": [], "torch": [], "v_turbospec": [], "v_torch": []}
        ids = torch.arange(32)[None] * 7 % 1000 + 10
        logits = []
        for on in (False, True):  # the two paths compute the same model (not the same bits)
            torch_path(model, on)
            logits.append(model.forward(ids, torch.arange(32)[None], model.new_cache(32), 0).float())
        diff = float((logits[0] - logits[1]).abs().max())
        for _ in range(rounds):
            for key, on in (("turbospec", False), ("torch", True)):
                torch_path(model, on)
                try:
                    runs[key].append(decode_tps(model))
                    runs["v_" + key].append(verify_ms(model))
                except RuntimeError as e:  # e.g. a torch bf16 kernel this CPU lacks
                    runs[key].append(float("nan"))
                    runs["v_" + key].append(float("nan"))
                    print(f"{name} {key}: {str(e).splitlines()[0]}", flush=True)
        torch_path(model, False)
        row = {"dtype": name, **{k: statistics.median(v) for k, v in runs.items()}, "max_logit_diff": diff}
        # the kernels alone: one decoder layer's linears + the LM head, rows R = 1 and 8
        lins = [model.lm_head] + list(model.layers[0].linears())
        for rows in (1, 8):
            t = {"turbospec": 0.0, "torch": 0.0}
            for lin in lins:
                x = torch.randn(rows, lin.in_features).to(model.dtype)
                w = lin.dense()
                fns = {"turbospec": lambda: lin(x), "torch": lambda: torch.nn.functional.linear(x, w)}
                for key, fn in fns.items():
                    for _ in range(3):
                        fn()
                    best = float("inf")
                    for _ in range(rounds * 3):
                        t0 = time.perf_counter()
                        for _ in range(10):
                            fn()
                        best = min(best, (time.perf_counter() - t0) / 10)
                    t[key] += best * 1e6
            row[f"linears_us_r{rows}_turbospec"], row[f"linears_us_r{rows}_torch"] = t["turbospec"], t["torch"]
        row["ratio"] = row["turbospec"] / row["torch"]
        out.append(row)
        print(f"invariance cost {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if k != "dtype"),
              flush=True)
        del model
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(rows: list[dict]) -> str:
    by = defaultdict(list)
    for r in rows:
        by[(r["config"], r["system"])].append(r)
    lines = ["| config | system | prompts | equal to plain | tokens compared | first divergence (prompt #, position) | tok/s | τ |",
             "|---|---|---|---|---|---|---|---|"]
    for (cfg, sys_), rs in sorted(by.items()):
        eq = sum(r["equal"] for r in rs)
        toks = sum(r["compared"] for r in rs)
        div = [(r["prompt_index"], r["first_difference"]) for r in rs if not r["equal"]]
        secs = sum(r["seconds"] for r in rs)
        new = sum(r["new_tokens"] for r in rs)
        steps = sum(r.get("verify_steps", 0) for r in rs)
        tau = f"{new / steps:.2f}" if steps else "–"
        lines.append(f"| {cfg} | {sys_} | {len(rs)} | {eq} / {len(rs)} ({100 * eq / len(rs):.1f}%) | {toks} | "
                     f"{', '.join(f'#{i} @{p}' for i, p in div[:5]) or 'none'}{' …' if len(div) > 5 else ''} | "
                     f"{new / secs:.1f} | {tau} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a .gguf ('default': SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--configs", default="q4_1-bf16", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--prompts", type=int, default=240, help="Spec-Bench prompts (categories interleaved)")
    p.add_argument("--data", default=SPECBENCH)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--hf-prompts", type=int, default=0, help="also HF generate greedy on the first N prompts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cost", default="", help="only measure what invariance costs, for these dtypes "
                   "(comma list, e.g. float32,bfloat16); see invariance_cost")
    p.add_argument("--cost-rounds", type=int, default=3)
    p.add_argument("--cost-tokens", type=int, default=64, help="decode tokens per --cost round")
    p.add_argument("--shard", default="0/1", help="I/N: only prompts with index %% N == I (parallel processes)")
    p.add_argument("--resume", action="store_true", help="skip (config, prompt, system) already in OUT/exact.jsonl")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args()
    for c in args.configs.split(","):
        if c not in CONFIGS:
            p.error(f"--configs: unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--prompts and --max-new-tokens must be >= 1")
    try:
        shard, shards = (int(v) for v in args.shard.split("/"))
        assert 0 <= shard < shards
    except (ValueError, AssertionError):
        p.error(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
    if not args.cost and not os.path.isfile(args.data):
        p.error(f"--data: no such file {args.data!r} (the Spec-Bench sample, ../shared/data/specbench_dev.jsonl)")

    import torch
    import turbospec
    from turbospec.model.loader import load_tokenizer, parse_dtype
    torch.set_num_threads(args.threads)
    src = turbospec.default_model_path() if args.model == "default" else args.model
    if args.cost:
        rows = invariance_cost(src, args.cost.split(","), args.cost_tokens, args.cost_rounds)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "invariance_cost.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    prompts = specbench_prompts(args.data, args.prompts)
    tokenizer = load_tokenizer(src)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "exact.jsonl")
    done = set()
    if args.resume and os.path.isfile(path):
        with open(path) as f:
            done = {(r["config"], r["prompt_index"], r["system"]) for r in map(json.loads, f)}
    sink = open(path, "a" if args.resume else "w")
    print(f"# exactness run {time.strftime('%Y-%m-%d %H:%M')} UTC, {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens, kernels {turbospec.kernels_available()}", flush=True)

    for cfg in args.configs.split(","):
        weights, dtype, activations = CONFIGS[cfg]
        target = turbospec.load_model(src, parse_dtype(dtype), weights=weights, activations=activations)
        eng = engines(target, tokenizer, systems, args.max_seq_len)
        for i, (cat, prompt) in enumerate(prompts):
            if i % shards != shard or all((cfg, i, s) in done for s in ["plain", *systems]):
                continue
            t = time.perf_counter()
            ref = eng["plain"].generate(prompt, max_new_tokens=args.max_new_tokens)
            rows = [("plain", ref, time.perf_counter() - t)]
            for s in systems:
                t = time.perf_counter()
                g = eng[s].generate(prompt, max_new_tokens=args.max_new_tokens)
                rows.append((s, g, time.perf_counter() - t))
            for s, g, secs in rows:
                d = first_difference(ref.token_ids, g.token_ids)
                rec = {"config": cfg, "prompt_index": i, "category": cat, "system": s, "equal": d is None,
                       "first_difference": d, "compared": min(len(ref.token_ids), len(g.token_ids)),
                       "new_tokens": len(g.token_ids), "seconds": secs,
                       "verify_steps": g.stats.get("verify_steps", 0),
                       "draft_proposed": g.stats.get("draft_proposed", 0),
                       "draft_accepted": g.stats.get("draft_accepted", 0)}
                sink.write(json.dumps(rec) + "\n")
            sink.flush()
            print(f"{cfg} {i + 1}/{len(prompts)} {cat}: " + " ".join(
                f"{s}={'=' if first_difference(ref.token_ids, g.token_ids) is None else 'DIFF'}" for s, g, _ in rows[1:]),
                flush=True)
        if args.hf_prompts > 0:
            refs = [eng["plain"].generate(q, max_new_tokens=args.max_new_tokens) for _, q in prompts[: args.hf_prompts]]
            t = time.perf_counter()
            hf = hf_greedy(src, parse_dtype(dtype), [r.prompt_token_ids for r in refs], args.max_new_tokens,
                           target.cfg.eos_token_ids[0])
            secs = (time.perf_counter() - t) / len(refs)
            for i, (r, h) in enumerate(zip(refs, hf)):
                eos = set(target.cfg.eos_token_ids)
                mine = [t for t in r.token_ids if t not in eos]  # EOS kept or not: compare the text tokens
                h = [t for t in h if t not in eos]
                d = first_difference(mine, h)
                sink.write(json.dumps({"config": cfg, "prompt_index": i, "category": prompts[i][0], "system": "hf_generate",
                                       "equal": d is None, "first_difference": d, "compared": min(len(mine), len(h)),
                                       "new_tokens": len(h), "seconds": secs, "verify_steps": 0}) + "\n")
            sink.flush()
        del eng, target
    sink.close()
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    md = summarize([r for r in rows if r["system"] != "plain"])
    with open(os.path.join(args.out, "exact.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
