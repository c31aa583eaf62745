"""τ (tokens per verify step) of draft heads and model-free drafters at fixed tree-node budgets, on
the Spec-Bench sample.

τ measured greedily at a fixed budget depends on the head and the prompts only (not on the machine,
the thread count or the timing), so heads compare here on any CPU: every head runs with
``adaptive=False`` (no draft-length or tree-depth budget), the same tree shape, greedy, and the
output of every run is checked against plain decoding token for token.

    python bench/bench_tau.py --head shipped=turbospec/heads_data/smollm2-eagle3 \\
        --head gpu=/work/train/gpu-eagle3 --nodes 8,16,32 --per-category 4 --max-new-tokens 96
    python bench/bench_tau.py --drafter ngram --drafter suffix --rounds 2 --nodes 16
    python bench/bench_tau.py --drafter ngram --drafter suffix --drafter lookahead --nodes 16
    python bench/bench_tau.py --workload multiturn --plain --drafter suffix --drafter hybrid \\
        --head shipped=turbospec/heads_data/smollm2-eagle3 --nodes 8,16,32

Workloads (``--workload``, see bench/workloads.py): ``specbench`` (the sample's first turns, by
category), ``multiturn`` (three-turn chats resending the model's own earlier answers; categories are
the turns) and ``codeedit`` (a snippet and an edit whose answer mostly copies it; categories are the
edit kinds). Prompts run in order on one engine per drafter and budget, so the suffix drafter's
cache holds the earlier requests (a chat's earlier turns).

Prints a markdown table (τ per Spec-Bench category and overall, per head and node budget) and
writes it with the per-prompt figures to --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/workloads.py

import torch  # noqa: E402


def main(argv=None) -> int:
    from turbospec.benchmark import DEFAULT_SPEC_BENCH, load_prompts
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", action="append", default=[],
                   help="NAME=PATH of a head checkpoint (repeat); PATH alone names it by its folder")
    p.add_argument("--drafter", action="append", default=[], choices=["ngram", "suffix", "lookahead", "hybrid"],
                   help="a model-free drafter to run too (repeat); hybrid: the EAGLE head of --hybrid-head "
                        "and suffix decoding in one tree")
    p.add_argument("--hybrid-skip-head-at", default="default",
                   help="--drafter hybrid: its skip_head_at tree option (a number in (0, 1], 'none': the head "
                        "always drafts; default: the drafter's)")
    p.add_argument("--hybrid-head", default=None,
                   help="the head of --drafter hybrid (default: the shipped EAGLE-3 head for the default model)")
    p.add_argument("--plain", action="store_true", help="also report plain decoding (tau 1 by definition) as a row")
    p.add_argument("--workload", default="specbench", choices=["specbench", "multiturn", "codeedit"],
                   help="the prompts (see bench/workloads.py)")
    p.add_argument("--conversations", type=int, default=8, help="multiturn: conversations (3 turns each)")
    p.add_argument("--codeedit", type=int, default=20, help="codeedit: prompts")
    p.add_argument("--rounds", type=int, default=1,
                   help="ask every prompt this many times on the same engine (a repeated workload: the "
                        "suffix drafter's cache holds the earlier answers); tau is reported per round")
    p.add_argument("--model", default="default", help="target: directory, .gguf or 'default'")
    p.add_argument("--nodes", default="16", help="comma list of tree-node budgets (num_draft)")
    p.add_argument("--adaptive", action="store_true",
                   help="let the draft budget choose the draft size each step (what users get) instead of "
                        "always drafting up to --nodes; the table then also reads as a speed comparison")
    p.add_argument("--depth", type=int, default=6, help="EAGLE tree: expansion rounds")
    p.add_argument("--top-k", type=int, default=None,
                   help="EAGLE tree: children per expanded node (default: the drafter's, half the node budget "
                        "within 2-8; runs before 2026-11-29 used 4)")
    p.add_argument("--spec-bench", default=DEFAULT_SPEC_BENCH)
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--humaneval", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--draft-dtype", default=None, help="the head's dtype (default: the target's)")
    p.add_argument("--draft-activations", default=None, choices=["exact", "int8"],
                   help="the heads' activations (default: the engine's)")
    p.add_argument("--draft-weights", default=None, choices=["auto", "dense", "q8_0", "q4_0"],
                   help="how the head's linears are stored for drafting (default: the engine's, q4_0 on CPU)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-timings", action="store_true",
                   help="leave the tok/s column out of the table (a shared machine: timings invalid)")
    p.add_argument("--out", default=os.path.join("bench", "out", "tau.json"))
    args = p.parse_args(argv)
    nodes = [int(x) for x in args.nodes.split(",") if x.strip()]
    from turbospec.ops.limits import MAX_TREE_NODES
    if not nodes or any(not 1 <= n < MAX_TREE_NODES for n in nodes):
        raise SystemExit(f"--nodes {args.nodes!r}: expected a comma list of integers in [1, {MAX_TREE_NODES - 1}] "
                         f"(drafts per step; a tree holds {MAX_TREE_NODES} rows with its root)")
    if not args.head and not args.drafter and not args.plain:
        raise SystemExit("nothing to run: pass --head, --drafter and / or --plain")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    heads = []
    for h in args.head:
        name, _, path = h.rpartition("=")
        path = path or h
        if not os.path.isdir(path):
            raise SystemExit(f"--head {h!r}: {path!r} is not a head folder")
        heads.append((name or os.path.basename(os.path.normpath(path)), path))
    if args.threads:
        torch.set_num_threads(args.threads)

    import turbospec
    from turbospec.model.loader import load_tokenizer
    source = turbospec.default_model_path() if args.model == "default" else args.model
    target = turbospec.load_model(source, getattr(torch, args.dtype))
    tok = load_tokenizer(source)
    plain = turbospec.Engine(target, drafter="none", tokenizer=tok, max_seq_len=2048)
    t_ref = time.perf_counter()
    prompts, ref = workload_prompts(args, plain, tok)
    ref_tok_s = sum(map(len, ref)) / (time.perf_counter() - t_ref)
    rows, per_prompt = [], []
    t0 = time.time()
    plain_row = {"head": "plain", "path": None, "nodes": 0, "round": 1, "tok_s": ref_tok_s,
                 "tau": {c: 1.0 for c in [q["category"] for q in prompts] + ["overall"]}}
    systems = [(name, path, dict(drafter="eagle", head=path, tree={"depth": args.depth, "top_k": args.top_k},
                                 draft_dtype=args.draft_dtype, draft_weights=args.draft_weights,
                                 draft_activations=args.draft_activations))
               for name, path in heads]
    for d in args.drafter:
        if d == "hybrid":
            from turbospec.heads.shipped import shipped_heads
            hpath = args.hybrid_head or (heads[0][1] if heads else shipped_heads().get("eagle3"))
            if hpath is None:
                raise SystemExit("--drafter hybrid needs --hybrid-head (or --head)")
            tree = {"depth": args.depth, "top_k": args.top_k}
            if args.hybrid_skip_head_at != "default":
                tree["skip_head_at"] = None if args.hybrid_skip_head_at == "none" else float(args.hybrid_skip_head_at)
            systems.append(("hybrid", hpath, dict(drafter="hybrid", head=hpath, draft_dtype=args.draft_dtype,
                                                  draft_weights=args.draft_weights,
                                                  draft_activations=args.draft_activations, tree=tree)))
        else:
            systems.append((d, None, dict(drafter=d)))
    for name, path, opts in systems:
        for n in nodes:
            eng = turbospec.Engine(target, num_draft=n, adaptive=args.adaptive, tokenizer=tok, max_seq_len=2048,
                                   **opts)
            for rnd in range(1, args.rounds + 1):
                emitted, steps = defaultdict(int), defaultdict(int)
                t_round = time.perf_counter()
                for q, want in zip(prompts, ref):
                    g = eng.generate(q["prompt"], max_new_tokens=args.max_new_tokens)
                    if g.token_ids != want:
                        raise SystemExit(f"{name} at {n} nodes: output differs from plain decoding on {q['id']}")
                    for cat in (q["category"], "overall"):
                        emitted[cat] += g.stats["new_tokens"]
                        steps[cat] += g.stats["verify_steps"]
                    per_prompt.append({"head": name, "nodes": n, "round": rnd, "id": q["id"], "tau": g.stats["tau"],
                                       "accept_per_position": g.stats.get("accept_per_position")})
                secs = time.perf_counter() - t_round
                rows.append({"head": name, "path": path, "nodes": n, "round": rnd,
                             "tau": {c: emitted[c] / max(steps[c], 1) for c in emitted},
                             "tok_s": emitted["overall"] / secs, "steps": steps["overall"]})
                skipped = getattr(eng.drafter, "head_skipped", None)  # the hybrid: steps drafted without the head
                if skipped is not None:
                    rows[-1]["head_skipped"] = skipped - sum(r.get("head_skipped", 0) for r in rows[:-1]
                                                             if r["head"] == name and r["nodes"] == n)
                print(f"{name} @ {n} nodes, round {rnd}: τ {rows[-1]['tau']['overall']:.3f}, "
                      f"{rows[-1]['tok_s']:.1f} tok/s (prefill included)"
                      + (f", head skipped at {rows[-1]['head_skipped']} of {steps['overall']} steps"
                         if skipped is not None else ""), file=sys.stderr)
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out + ".partial", "w") as f:  # what is done so far, should the run be cut
                    json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    if args.plain:
        rows.insert(0, plain_row)
    cats = [c for c in dict.fromkeys(q["category"] for q in prompts)] + ["overall"]
    timed = not args.no_timings
    lines = ["| drafter | nodes | round | " + " | ".join(cats) + (" | tok/s |" if timed else " |"),
             "|---|---|---|" + "---|" * (len(cats) + timed)]
    for r in rows:
        lines.append(f"| {r['head']} | {r['nodes']} | {r['round']} | "
                     + " | ".join(f"{r['tau'][c]:.2f}" for c in cats) + (f" | {r['tok_s']:.1f} |" if timed else " |"))
    table = "\n".join(lines)
    print(table)
    from turbospec.train.trainer import checkout_commit
    commit = checkout_commit() or ""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                   time.gmtime()), "machine": platform.processor() or platform.machine(),
                   "seconds": round(time.time() - t0, 1), "prompts": len(prompts),
                   "workload": args.workload, "max_new_tokens": args.max_new_tokens, "depth": args.depth, "top_k": args.top_k,
                   "adaptive": args.adaptive, "threads": torch.get_num_threads(),
                   "rows": rows, "per_prompt": per_prompt, "table": table}, f, indent=1)
    return 0


def workload_prompts(args, plain, tok) -> tuple[list[dict], list[list[int]]]:
    """The workload's prompts [{"id", "category", "prompt"}] and plain decoding's output for each
    (the reference every drafter must reproduce)."""
    from turbospec.benchmark import load_prompts
    from workloads import codeedit_prompts, multiturn_conversations, multiturn_prompts
    n = args.max_new_tokens
    if args.workload == "multiturn":
        answers: dict[int, list[int]] = {}

        def answer(messages):
            ids = plain.generate(messages, max_new_tokens=n).token_ids
            answers[len(answers)] = ids
            return tok.decode(ids, skip_special_tokens=True)
        prompts = multiturn_prompts(multiturn_conversations(args.spec_bench, args.conversations), answer)
        return prompts, [answers[i] for i in range(len(prompts))]
    if args.workload == "codeedit":
        prompts = codeedit_prompts(args.spec_bench, args.codeedit)
    else:
        prompts = [dict(q, prompt=q["text"]) for q in load_prompts(args.spec_bench, args.per_category, args.humaneval)]
    return prompts, [plain.generate(q["prompt"], max_new_tokens=n).token_ids for q in prompts]


if __name__ == "__main__":
    sys.exit(main())
