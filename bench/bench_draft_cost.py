"""What a draft head costs beside the verify pass, by how its weights are stored (``draft_weights``).

For each head (``--method``: the default model's shipped EAGLE-3 / Medusa heads) and each storage in
``--draft-weights`` (dense in ``--draft-dtype``, q8_0, q4_0), the Spec-Bench sample is decoded
greedily with a fixed node budget (adaptive off, so every step drafts the same tree size and the
drafting cost is measured at every step; the head alone, without the n-gram chain it ships with), or
with ``--adaptive`` under the adaptive budget (``--nodes`` its most), as ``drafter="eagle"`` runs by
default; ``--ngram`` adds n-gram lookup (adaptive) as a reference.
Recorded per system: seconds of drafting per verify step (``stats["draft_s"]``), seconds of the
verify step, τ, acceptance by draft position (the first round's mean over prompts of
``stats["accept_per_position"]``) and decode tok/s; every output is checked equal to plain greedy decoding. The
systems run in turns, ``--rounds`` times (medians reported), so slow phases of a shared machine
spread over all of them; plain decoding runs in the same turns as the reference.

    python bench/bench_draft_cost.py --method eagle3 --method medusa --draft-weights dense,q8_0,q4_0 \\
        --draft-dtype float32 --nodes 4 --per-category 2 --max-new-tokens 64 --rounds 3
    python bench/bench_draft_cost.py --method eagle3 --head v16k=/work/train/all16k/head --draft-weights q4_0
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


def prompts(path: str, per_category: int) -> list[str]:
    by: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            by.setdefault(q["category"], []).append(q["turns"][0])
    return [t for texts in by.values() for t in texts[:per_category]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", action="append", choices=["eagle3", "medusa"], default=None,
                   help="shipped head(s) to measure (repeatable; default: eagle3)")
    p.add_argument("--head", action="append", default=None, metavar="NAME=DIR",
                   help="(repeatable) a trained head folder to measure as NAME, with the tree options of "
                        "its own shipped engine settings, else those of the shipped head of its method")
    p.add_argument("--draft-weights", default="dense,q8_0,q4_0",
                   help="comma list of head weight storages; a quantized one + '+int8' (q4_0+int8) drafts with "
                        "int8 activations (draft_activations='int8'), else exact ones")
    p.add_argument("--activations", default="exact", choices=["exact", "int8"],
                   help="the target's activations (Engine(activations=...))")
    p.add_argument("--draft-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--nodes", type=int, default=4, help="draft nodes per step (fixed: adaptive off)")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adaptive", action="store_true",
                   help="the heads draft under the adaptive budget (--nodes: its most nodes) instead of a fixed size")
    p.add_argument("--ngram", action="store_true", help="also n-gram lookup (drafter='ngram', adaptive) as a reference")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--spec-bench", default=DEFAULT_SPEC_BENCH)
    p.add_argument("--out", default=os.path.join("bench", "out", "draft_cost.json"))
    args = p.parse_args(argv)
    weights = [w for w in args.draft_weights.split(",") if w]
    named = []
    for spec in args.head or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"--head {spec!r}: expected NAME=DIR with a head's config.json in DIR")
        named.append((name, path))
    torch.set_num_threads(args.threads)

    import turbospec
    from turbospec.heads.formats import load_head
    from turbospec.heads.shipped import shipped_heads
    target = turbospec.load_model(turbospec.default_model_path(), torch.float32)
    tok = turbospec.load_tokenizer(turbospec.default_model_path())
    texts = prompts(args.spec_bench, args.per_category)
    heads = shipped_heads()
    systems: dict[str, dict] = {"plain": dict(drafter="none", activations=args.activations)}
    if args.ngram:
        systems["ngram"] = dict(drafter="ngram", num_draft=args.nodes, activations=args.activations)
    shipped_engine: dict = {}  # method -> its shipped head's engine settings (loaded once)

    def tree_of(head):
        engine = head.extra.get("engine")
        if not engine:
            m = head.cfg.method
            if m not in shipped_engine:
                shipped_engine[m] = load_head(heads[m], target_cfg=target.cfg).extra["engine"]
            engine = shipped_engine[m]
        return {k: v for k, v in engine.get("tree", {}).items() if k != "ngram"}

    todo = [(m, load_head(heads[m], target_cfg=target.cfg)) for m in args.method or ([] if named else ["eagle3"])]
    todo += [(name, load_head(path, target_cfg=target.cfg)) for name, path in named]
    for label, head in todo:
        for w in weights:
            storage, _, acts = w.partition("+")
            if acts not in ("", "int8"):
                raise SystemExit(f"--draft-weights {w!r}: expected a storage, optionally + '+int8'")
            systems[f"{label}_{w}"] = dict(drafter="medusa" if head.cfg.method == "medusa" else "eagle", head=head,
                                           tree=tree_of(head), num_draft=args.nodes, adaptive=args.adaptive,
                                           draft_weights=storage, draft_activations=acts or "exact",
                                           draft_dtype=args.draft_dtype, activations=args.activations)
    engines = {name: turbospec.Engine(target, tokenizer=tok, max_seq_len=2048, **kw) for name, kw in systems.items()}
    encoded = [engines["plain"].encode(t) for t in texts]  # the chat template applied
    for eng in engines.values():  # warm-up: first-call costs out of the measurement
        eng.generate(encoded[0], max_new_tokens=8)
    ref = [engines["plain"].generate(ids, max_new_tokens=args.max_new_tokens).token_ids for ids in encoded]
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            draft = verify = 0.0
            steps = tokens = 0
            equal = True
            acc: dict[int, list[float]] = {}
            for ids, want in zip(encoded, ref):
                g = eng.generate(ids, max_new_tokens=args.max_new_tokens)
                s = g.stats
                draft += s["draft_s"]
                verify += s["verify_s"]
                steps += s["verify_steps"]
                tokens += s["new_tokens"]
                equal &= g.token_ids == want
                for i, a in enumerate(s.get("accept_per_position") or []):
                    if a is not None:
                        acc.setdefault(i, []).append(a)
            runs[name].append(dict(draft_ms=1e3 * draft / steps, verify_ms=1e3 * verify / steps, tau=tokens / steps,
                                   tok_s=tokens / (draft + verify), equal=equal,
                                   accept=[sum(v) / len(v) for _, v in sorted(acc.items())]))
            print(f"{name}: {runs[name][-1]}", flush=True)
    rows = []
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("draft_ms", "verify_ms", "tau", "tok_s")}
        rows.append(dict(system=name, **med, equal=all(r["equal"] for r in rs), accept=rs[0]["accept"]))
    plain = next(r for r in rows if r["system"] == "plain")["tok_s"]
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}; "
             f"{args.threads} threads; {len(encoded)} prompts x {args.max_new_tokens} tokens; "
             f"{'at most ' if args.adaptive else ''}{args.nodes} nodes{' (adaptive budget)' if args.adaptive else ''}; "
             f"draft dtype {args.draft_dtype}; target activations {args.activations}; {args.rounds} rounds (medians)",
             "",
             "| system | draft ms / step | verify ms / step | τ | acceptance by position | decode tok/s | × plain | "
             "output == plain |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " / ".join(f"{a:.2f}" for a in r["accept"]) or "–"
        lines.append(f"| {r['system']} | {r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['tau']:.3f} | {acc} | "
                     f"{r['tok_s']:.1f} | {r['tok_s'] / plain:.2f}× | {r['equal']} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), rows=rows, runs=runs, table="\n".join(lines)), f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
