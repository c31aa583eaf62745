"""A draft model's prompt K/V from its own prefix cache: chats with a target + draft-model pair,
the draft's cache on and off (the target's on in both), in one process, one run.

Each chat resends its whole conversation every turn (a system prompt, the user's turns and the
answers), greedy, ``--max-tokens`` per answer. Per setting and turn: the prefill time (the target's
prompt, and the draft model reading it: ``Generation.stats["prefill_s"]``) and the draft tokens
proposed / accepted; the answers must be identical in both settings (the same drafts: a cached
prefix has the bits of reading it again).

    python bench/bench_draft_cache.py --model ~/.cache/turbospec-peers/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --draft-model ~/.cache/turbospec-peers/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --chats 3 --turns 4
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "..", "shared", "data", "specbench_dev.jsonl")
SYSTEM = "You are a careful programming assistant. Answer briefly and precisely. " * 4
FOLLOW_UPS = ["Can you make it shorter?", "Add one comment.", "What does it return for an empty input?",
              "Summarise in one sentence."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--chats", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=DATA)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    from turbospec import Engine
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(args.data)]
    questions = [r["turns"][0] for r in rows if r.get("category") in ("mt_bench", "qa")][:args.chats]
    eng = Engine(args.model, drafter="draft_model", draft_model=args.draft_model, num_draft=args.num_draft,
                 adaptive=False, max_seq_len=4096)
    eng.generate("Hello", max_new_tokens=4)  # warm-up
    pc = eng.drafter.prefix_cache
    results = {}
    for setting in ("draft cache on", "draft cache off"):
        eng.drafter.prefix_cache = pc if setting == "draft cache on" else None
        eng.target_step.prefix_cache.clear()
        if pc is not None:
            pc.clear()
        prefill = [[] for _ in range(args.turns)]
        answers, proposed, accepted = [], 0, 0
        for q in questions:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for t in range(args.turns):
                g = eng.generate(messages, max_new_tokens=args.max_tokens)
                prefill[t].append(g.stats["prefill_s"])
                proposed += g.stats["draft_proposed"]
                accepted += g.stats["draft_accepted"]
                answers.append(g.token_ids)
                messages = messages + [{"role": "assistant", "content": g.text},
                                       {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
        results[setting] = {"prefill_ms_median_by_turn": [round(1000 * statistics.median(x), 1) for x in prefill],
                            "prefill_ms_median_turns_2_on": round(1000 * statistics.median(
                                [v for x in prefill[1:] for v in x]), 1),
                            "draft_proposed": proposed, "draft_accepted": accepted, "answers": answers}
        print(setting, {k: v for k, v in results[setting].items() if k != "answers"}, flush=True)
    same = results["draft cache on"]["answers"] == results["draft cache off"]["answers"]
    print(f"answers identical: {same}", flush=True)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
                       "machine": platform.processor() or platform.machine(), "command": " ".join(sys.argv),
                       "answers_identical": same, "results": results}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
