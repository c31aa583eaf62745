"""CPU benchmark against llama.cpp, same machine, same run, same GGUF, same threads.

  python bench/bench_cpu.py                      # SmolLM2-135M Q4_1 as shipped, F32, BF16; 2 threads
  python bench/bench_cpu.py --model X.gguf --formats q --spec-prompts 3

Sections (each system measured back to back, so only same-run ratios are compared):
  1. plain decode tok/s per weight format: turbospec (the GGUF's blocks kept quantized; F32 / BF16:
     the model dequantized to that dtype) vs llama.cpp ``llama-bench -p 0 -n N`` on the same GGUF
     (F32 / BF16 GGUFs made once with ``llama-quantize --allow-requantize``);
  2. the verify cost curve: time of an N-token pass / a 1-token step, N = 1..64, per format, for
     turbospec (a causal chain at a fixed context) and llama.cpp (``llama-bench -p N``: a batch of N
     prompt tokens / its tg per-token time);
  3. speculation on the Spec-Bench sample: decode tok/s (prefill excluded, as llama.cpp prints it) of
     turbospec plain / n-gram / the shipped EAGLE-3 head + n-gram on the quantized GGUF vs
     ``llama-lookup`` (llama.cpp's prompt-lookup speculation) on the same chat-templated prompts;
     turbospec's outputs are checked equal to its plain greedy output; llama.cpp's plain decode on
     the same prompts is ``llama-bench -d <prompt length> -n <max new tokens>`` per prompt;
  4. prefill (the time to the first token): tok/s of one forward over a --prefill-token prompt
     into an empty cache (turbospec: the last token's logits) vs ``llama-bench -p N -n 0``, the two
     alternated round by round.
llama.cpp is found with ../shared/tools/build_llama_cpp.sh (built once per machine, ~8 min; never
in CI); without it the turbospec columns are still measured. Writes bench/out/cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_SCRIPT = os.path.join(ROOT, "..", "shared", "tools", "build_llama_cpp.sh")
PEER_HOME = os.path.join(os.path.expanduser("~"), ".cache", "turbospec-peers")
VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "?"
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split()) if "flags" in text else set()
    want = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
            if f in flags]
    return f"{model.group(1) if model else '?'}; {' '.join(want)}"


def llama_bin(path: str | None) -> str | None:
    """The llama.cpp bin folder: --llama-bin, or the build script's (only if already built)."""
    if path:
        return path
    cand = os.path.join(PEER_HOME, "llama.cpp", "build", "bin")
    return cand if os.path.isfile(os.path.join(cand, "llama-bench")) else None


class PeerFailed(RuntimeError):
    """A llama.cpp tool exited with an error or died of a signal (llama.cpp's AMX build crashed in its
    prompt processing on a 2026-12-02 Intel AMX machine): the run records it and goes on."""


def run_peer(cmd: list[str], with_stderr: bool = False) -> str:
    """Run a llama.cpp tool; its stdout (and then its stderr: the examples log there), or PeerFailed
    naming the tool, the exit status or signal and the last line of its stderr."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        how = f"signal {signal.Signals(-r.returncode).name}" if r.returncode < 0 else f"exit status {r.returncode}"
        tail = (r.stderr or "").strip().splitlines()[-1:] or [""]
        raise PeerFailed(f"{os.path.basename(cmd[0])} ({' '.join(cmd[1:])}) failed: {how} {tail[0]}".rstrip())
    return r.stdout + (r.stderr if with_stderr else "")


def guarded(errors: list[str], fn):
    """fn()'s result, or None with a llama.cpp failure appended to ``errors`` (printed as it happens)."""
    try:
        return fn()
    except PeerFailed as e:
        print(f"peer failed: {e}", flush=True)
        errors.append(str(e))
        return None


def peer_row(out: dict, name: str, errors: list[str], fn) -> None:
    """out[name] = fn() (a llama.cpp row of the speculation table), printed; a failure goes to errors."""
    r = guarded(errors, fn)
    if r is not None:
        out[name] = r
        print(f"spec {name}: {r}", flush=True)


def parse_llama_bench(stdout: str) -> dict:
    """llama-bench -o json -> {("pp" | "tg", n): mean tok/s}."""
    out = {}
    for row in json.loads(stdout):
        kind = "pp" if row["n_prompt"] > 0 else "tg"
        out[(kind, row["n_prompt"] or row["n_gen"])] = float(row["avg_ts"])
    return out


def llama_bench(bin_dir: str, gguf: str, threads: int, reps: int, prompt: str, gen: int) -> dict:
    """``llama-bench -p <prompt> -n <gen>`` on ``gguf`` -> {("pp" | "tg", n): mean tok/s}."""
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-r", str(reps), "-p", str(prompt),
           "-n", str(gen), "-o", "json"]
    return parse_llama_bench(run_peer(cmd))


def alternated(rounds: int, turbospec_fn, llama_fn, errors: list[str] | None = None) -> dict:
    """Rounds of turbospec then llama.cpp (llama_fn None: turbospec only), alternated (this
    machine's speed drifts by tens of percent over minutes): the median of each system, the median
    of the per-round ratios, and the rounds. A llama.cpp failure goes to ``errors`` (its row then has
    turbospec's figures only) and llama.cpp is not run again in this row."""
    runs: dict = {"turbospec": [], "llama.cpp": []}
    for _ in range(rounds):
        runs["turbospec"].append(turbospec_fn())
        if llama_fn is not None:
            got = guarded(errors if errors is not None else [], llama_fn)
            if got is None:
                llama_fn, runs["llama.cpp"] = None, []
            else:
                runs["llama.cpp"].append(got)
    row = {k: statistics.median(v) for k, v in runs.items() if v}
    if runs["llama.cpp"]:
        row["ratio"] = statistics.median(t / c for t, c in zip(runs["turbospec"], runs["llama.cpp"]))
    row["rounds"] = runs
    return row


def llama_plain_at_depths(bin_dir: str, gguf: str, depths: list[int], n_gen: int, threads: int) -> dict:
    """llama.cpp's plain decode on the same prompts' context lengths: ``llama-bench -d <each prompt's
    length> -n n_gen`` (tg after that many cached tokens, one run each; the depth's prefill is not
    timed), summed over the prompts as tokens / seconds. Decode slows as the context grows (attention
    reads the whole KV cache), so this, not tg at depth 0, is the plain baseline for the prompts."""
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-r", "1", "-p", "0",
           "-n", str(n_gen), "-d", ",".join(str(d) for d in depths), "-o", "json"]
    rows = json.loads(run_peer(cmd))
    by_depth = {int(r["n_depth"]): n_gen / float(r["avg_ts"]) for r in rows}  # seconds per depth
    seconds = sum(by_depth[d] for d in depths)
    return {"tok_s": n_gen * len(depths) / seconds, "tokens": n_gen * len(depths), "depths": len(by_depth)}


def parse_llama_lookup(text: str) -> dict:
    """llama-lookup's log -> {"decoded": tokens, "seconds", "tok_s", "n_drafted", "n_accept"}."""
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    if not m:
        raise ValueError("no 'decoded N tokens in X seconds' line in llama-lookup's output")
    out = {"decoded": int(m.group(1)), "seconds": float(m.group(2)), "tok_s": float(m.group(3))}
    for key in ("n_drafted", "n_accept"):
        k = re.search(rf"{key}\s*=\s*(\d+)", text)
        out[key] = int(k.group(1)) if k else None
    return out


def peer_gguf(bin_dir: str, src: str, fmt: str) -> str:
    """``src`` re-quantized to F32 / BF16 (made once, cached)."""
    os.makedirs(os.path.join(PEER_HOME, "models"), exist_ok=True)
    dst = os.path.join(PEER_HOME, "models", f"{os.path.splitext(os.path.basename(src))[0]}.{fmt.upper()}.gguf")
    if not os.path.isfile(dst):
        subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--allow-requantize", src, dst, fmt.upper()],
                       check=True, capture_output=True)
    return dst


def ts_model(src: str, fmt: str):
    import torch
    import turbospec
    if fmt in ("q", "q-int8"):  # q-int8: the same blocks, int8 activations (llama.cpp's arithmetic)
        return turbospec.load_model(src, torch.float32, weights="auto",
                                    activations="int8" if fmt == "q-int8" else "exact")
    return turbospec.load_model(src, {"f32": torch.float32, "bf16": torch.bfloat16}[fmt], weights="dense")


def ts_decode_tps(model, tokens: int, context: int = 8) -> float:
    """Greedy decode-only tok/s: ``tokens`` one-token steps after a short prompt (llama-bench tg)."""
    import torch
    cache = model.new_cache(context + tokens + 1)
    ids = torch.arange(context)[None] + 10
    logits = model.forward(ids, torch.arange(context)[None], cache, 0, logits="last")
    tok = logits[0, -1].argmax()
    t = time.perf_counter()
    for i in range(tokens):
        logits = model.forward(tok.view(1, 1), torch.tensor([[context + i]]), cache, context + i, logits="last")
        tok = logits[0, -1].argmax()
    return tokens / (time.perf_counter() - t)


def ts_prefill_tps(model, tokens: int) -> float:
    """Prefill tok/s: one forward over ``tokens`` prompt tokens into an empty cache, the last token's
    logits (what a generation computes before its first token; llama-bench pp)."""
    import torch
    cache = model.new_cache(tokens + 1)
    ids = (torch.arange(tokens)[None] * 7919) % model.cfg.vocab_size  # spread over the vocabulary
    t = time.perf_counter()
    model.forward(ids, torch.arange(tokens)[None], cache, 0, logits="last")
    return tokens / (time.perf_counter() - t)


def ts_verify_curve(model, context: int = 128, reps: int = 5) -> dict[str, dict[int, float]]:
    """ms of one forward over N new tokens (a chain) after ``context`` cached tokens: "turbospec"
    with every token's logits; "turbospec, lazy LM head" (when the engine's verify step computes
    it lazily: a quantized LM head on CPU) to the final norm, then the LM head over the first
    min(N, LAZY_ROWS) rows: what a step whose accepted path ends within them costs."""
    import torch
    from turbospec.decode.step import LAZY_ROWS, TargetStep
    cache = model.new_cache(context + max(VERIFY_TOKENS))
    model.forward(torch.arange(context)[None] % 1000 + 10, torch.arange(context)[None], cache, 0, logits="none")
    lazy = TargetStep(model, 8)._lazy is not None

    def lazy_pass(ids, pos):
        h = model.forward(ids, pos, cache, context, logits="normed")
        return model.lm_head(h[:, :LAZY_ROWS])

    runs = {"turbospec": lambda ids, pos: model.forward(ids, pos, cache, context)}
    if lazy:
        runs["turbospec, lazy LM head"] = lazy_pass
    out: dict[str, dict[int, float]] = {name: {} for name in runs}
    for n in VERIFY_TOKENS:
        ids = torch.arange(n)[None] + 20
        pos = torch.arange(n)[None] + context
        for name, fn in runs.items():
            fn(ids, pos)  # warm-up
            t = time.perf_counter()
            for _ in range(reps):
                fn(ids, pos)
            out[name][n] = (time.perf_counter() - t) / reps * 1e3
    # both against the same 1-token step (a lazy pass over one token is that step)
    for name in runs:
        out[name][1] = out["turbospec"][1]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a .gguf file ('default': SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--formats", default="q,q-int8,f32,bf16",
                   help="q (the GGUF as stored), q-int8 (the same, int8 activations), f32, bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96, help="decode tokens for the plain rows (llama-bench -n)")
    p.add_argument("--reps", type=int, default=3, help="llama-bench repetitions (verify cost curve)")
    p.add_argument("--rounds", type=int, default=5,
                   help="plain decode: rounds of turbospec then llama.cpp, alternated (medians reported)")
    p.add_argument("--no-curve", action="store_true", help="skip the verify cost curve")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill rows (0: skip)")
    p.add_argument("--prefill-rounds", type=int, default=2, help="prefill: rounds of each system, alternated")
    p.add_argument("--spec-prompts", type=int, default=2, help="Spec-Bench prompts per category (0: skip)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-weights", default="auto",
                   help="comma list: the shipped heads' stored weights in the Spec-Bench section (auto, dense, q8_0, "
                        "q4_0), one system each (an A/B in one run)")
    p.add_argument("--spec-activations", default="exact",
                   help="spec section: the target's activations, comma list of exact / int8 (int8 rows: _int8)")
    p.add_argument("--head-activations", default="auto",
                   help="spec section: the heads' activations, comma list of auto / exact / int8")
    p.add_argument("--draft-model", default=None,
                   help="a draft .gguf for --model (same tokenizer): adds the target/draft pair section")
    p.add_argument("--pair-fixed", default="2,3,4,6,8", help="fixed draft lengths for the pair section")
    p.add_argument("--pair-int8", action="store_true",
                   help="pair section: also plain / best fixed length / adaptive with int8 activations")
    p.add_argument("--llama-draft-max", default="4,8", help="llama-speculative-simple --spec-draft-n-max values")
    p.add_argument("--llama-bin", default=None, help="llama.cpp bin folder (default: the build script's)")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args()

    import torch
    import turbospec
    torch.set_num_threads(args.threads)
    src = turbospec.default_model_path() if args.model == "default" else args.model
    bin_dir = llama_bin(args.llama_bin)
    formats = args.formats.split(",")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_flags(), "threads": args.threads, "model": src,
            "kernels": turbospec.kernels_available(), "torch": torch.__version__, "llama_cpp": bin_dir}
    res: dict = {"plain": {}, "curve": {}, "prefill": {}, "spec": {}, "pair": {}, "peer_errors": []}
    errors = res["peer_errors"]
    print(f"# CPU benchmark {meta['date']}, {meta['cpu']}, {args.threads} threads", flush=True)

    for fmt in formats:
        model = ts_model(src, fmt)
        gguf = (src if fmt.startswith("q") else peer_gguf(bin_dir, src, fmt)) if bin_dir else None
        # Plain decode, the two systems alternated round by round
        row = alternated(args.rounds, lambda: ts_decode_tps(model, args.tokens),
                         (lambda: llama_bench(bin_dir, gguf, args.threads, 1, "0", args.tokens)[("tg", args.tokens)])
                         if gguf else None, errors)
        runs = row["rounds"]
        if not args.no_curve:
            res["curve"].setdefault(fmt, {}).update(ts_verify_curve(model))
        if args.prefill > 0:
            pre = alternated(args.prefill_rounds, lambda: ts_prefill_tps(model, args.prefill),
                             (lambda: llama_bench(bin_dir, gguf, args.threads, 1, str(args.prefill), 0)
                              [("pp", args.prefill)]) if gguf else None, errors)
            res["prefill"][fmt] = {**pre, "tokens": args.prefill}
            print(f"prefill {fmt}: " + ", ".join(f"{k} {v}" for k, v in pre["rounds"].items() if v), flush=True)
        del model
        if gguf and not args.no_curve:
            lb = guarded(errors, lambda: llama_bench(bin_dir, gguf, args.threads, args.reps,
                                                     ",".join(str(n) for n in VERIFY_TOKENS), args.tokens))
            if lb is not None:
                tg_ms = 1e3 / lb[("tg", args.tokens)]
                res["curve"][fmt]["llama.cpp"] = {n: (1e3 * n / lb[("pp", n)] if n > 1 else tg_ms) for n in VERIFY_TOKENS}
        res["plain"][fmt] = row
        print(f"plain decode {fmt}: " + ", ".join(f"{k} {v}" for k, v in runs.items() if v), flush=True)

    if args.spec_prompts > 0 and args.draft_model:
        res["pair"] = pair_run(src, args.draft_model, bin_dir, args, errors)
    elif args.spec_prompts > 0:
        res["spec"] = spec_run(src, bin_dir, args, errors)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu.json"), "w") as f:
        json.dump({"meta": meta, "results": res}, f, indent=1, default=str)
    md = markdown(meta, res)
    with open(os.path.join(args.out, "cpu.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def spec_prompts(tok, args) -> tuple[list[str], list[list[int]]]:
    """The Spec-Bench sample (args.spec_prompts per category), chat-templated: texts and ids."""
    from turbospec.benchmark import DEFAULT_SPEC_BENCH, load_prompts
    prompts = load_prompts(os.path.join(ROOT, DEFAULT_SPEC_BENCH), args.spec_prompts, 0)
    texts = [tok.apply_chat_template([{"role": "user", "content": p["text"]}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    return texts, [tok.encode(t, add_special_tokens=False) for t in texts]


def ts_systems(target, tok, encoded, systems: dict, args) -> dict:
    """Decode tok/s (prefill excluded), seconds end to end (prefill included: a draft model reading
    the prompt is part of it), tau and equality with plain greedy, per turbospec system;
    the first system must be plain decoding. Prompt by prompt, every system in turn (this machine's
    speed drifts over minutes: interleaving spreads the drift over all systems alike)."""
    import turbospec
    max_seq = max(map(len, encoded)) + args.max_new_tokens + 70
    engines = {name: turbospec.Engine(target, tokenizer=tok, max_seq_len=max_seq, **opts)
               for name, opts in systems.items()}
    for eng in engines.values():
        eng.generate(encoded[0][:16], max_new_tokens=8)  # warm-up
    sums = {name: {"toks": 0.0, "dec_s": 0.0, "total_s": 0.0, "steps": 0, "equal": True} for name in systems}
    for ids in encoded:
        plain_tokens = None
        for name, eng in engines.items():
            g = eng.generate(ids, max_new_tokens=args.max_new_tokens)
            r = sums[name]
            r["toks"] += len(g.token_ids)
            r["dec_s"] += g.stats["total_s"] - g.stats["prefill_s"]
            r["total_s"] += g.stats["total_s"]
            r["steps"] += g.stats["verify_steps"]
            if plain_tokens is None:
                plain_tokens = g.token_ids
            else:
                r["equal"] &= g.token_ids == plain_tokens
    out: dict = {}
    for name, r in sums.items():
        out[name] = {"tok_s": r["toks"] / r["dec_s"], "tau": r["toks"] / max(r["steps"], 1),
                     "equal_to_plain": r["equal"], "tokens": r["toks"], "total_s": r["total_s"]}
        print(f"spec {name}: {out[name]}", flush=True)
    return out


def llama_decode(cmd: list[str], texts: list[str]) -> dict:
    """Run a llama.cpp example (llama-lookup, llama-speculative-simple) once per prompt text;
    its decode tok/s summed over the prompts (the 'decoded N tokens in X seconds' lines)."""
    import tempfile
    toks = secs = drafted = accepted = 0
    for t in texts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(t)
        try:
            log = run_peer(cmd + ["-f", f.name], with_stderr=True)
        finally:
            os.unlink(f.name)
        parsed = parse_llama_lookup(log)
        toks += parsed["decoded"]
        secs += parsed["seconds"]
        drafted += parsed["n_drafted"] or 0
        accepted += parsed["n_accept"] or 0
    return {"tok_s": toks / secs, "tokens": toks, "accept": accepted / drafted if drafted else None}


def spec_run(src: str, bin_dir: str | None, args, errors: list[str]) -> dict:
    """Decode tok/s on Spec-Bench prompts: turbospec plain / ngram / suffix / shipped head + ngram (quantized
    GGUF; fp32 activations, and / or int8 ones: --spec-activations, systems suffixed _int8, each
    mode against its own plain row) and llama-lookup; turbospec outputs checked equal to plain greedy
    (of the same mode)."""
    import torch
    import turbospec
    from turbospec.benchmark import head_systems
    tok = turbospec.load_tokenizer(src)
    texts, encoded = spec_prompts(tok, args)
    out = {}
    for acts in args.spec_activations.split(","):
        target = turbospec.load_model(src, torch.float32, weights="auto", activations=acts)
        sfx = "" if acts == "exact" else "_" + acts
        base = {"activations": acts}
        systems = {"ts_plain" + sfx: dict(base, drafter="none"), "ts_ngram" + sfx: dict(base, drafter="ngram"),
                   "ts_suffix" + sfx: dict(base, drafter="suffix")}
        if args.model == "default":  # the shipped heads, as they ship (EAGLE-3 with prompt lookup merged in)
            shipped = argparse.Namespace(head=[], model="default", head_draft=None, head_ngram=0)
            weights = args.draft_weights.split(",")
            head_acts = args.head_activations.split(",")
            for name, (head, opts) in head_systems(shipped, target).items():
                for w in weights:  # the head's stored weights (--draft-weights; "auto": the engine's default)
                    for ha in head_acts:  # the head's activations (--head-activations; "auto": the default)
                        kw = {} if w == "auto" else {"draft_weights": w}
                        if ha != "auto":
                            kw["draft_activations"] = ha
                        label = name + (f"_{w}" if len(weights) > 1 else "") + (f"_h{ha}" if len(head_acts) > 1 else "")
                        systems[label + sfx] = dict(opts, head=head, **base, **kw)
        out.update(ts_systems(target, tok, encoded, systems, args))
        del target
    if bin_dir:
        peer_row(out, "llama_plain", errors, lambda: llama_plain_at_depths(
            bin_dir, src, [len(e) for e in encoded], args.max_new_tokens, args.threads))
        max_seq = max(map(len, encoded)) + args.max_new_tokens + 70
        peer_row(out, "llama_lookup", errors, lambda: llama_decode(
            [os.path.join(bin_dir, "llama-lookup"), "-m", src, "-n", str(args.max_new_tokens), "-t", str(args.threads),
             "--temp", "0", "--spec-draft-n-max", "8", "-c", str(max_seq + 64)], texts))
    return out


def pair_run(src: str, draft_src: str, bin_dir: str | None, args, errors: list[str]) -> dict:
    """A target GGUF with a draft-model GGUF (same tokenizer) on the Spec-Bench sample: turbospec
    plain, the draft model at fixed draft lengths and with the adaptive budget (outputs checked
    equal to plain greedy); llama.cpp plain (``llama-bench`` tg on the target) and
    ``llama-speculative-simple`` with the same two GGUFs. The draft computes with the engine's
    default draft activations (int8 on CPU) in every system, exact targets included."""
    import torch
    import turbospec
    target = turbospec.load_model(src, torch.float32, weights="auto")
    draft = turbospec.load_model(draft_src, torch.float32, weights="auto")
    tok = turbospec.load_tokenizer(src)
    texts, encoded = spec_prompts(tok, args)
    fixed = [int(k) for k in args.pair_fixed.split(",")]
    systems = {"ts_plain": dict(drafter="none")}
    for k in fixed:
        systems[f"ts_draft_k{k}"] = dict(drafter="draft_model", draft_model=draft, num_draft=k, adaptive=False)
    systems["ts_draft_adaptive"] = dict(drafter="draft_model", draft_model=draft, num_draft=max(fixed),
                                        adaptive=True)
    out = ts_systems(target, tok, encoded, systems, args)
    if args.pair_int8:  # the same with int8 activations (llama.cpp's arithmetic): its own plain baseline
        best = max(fixed, key=lambda k: out[f"ts_draft_k{k}"]["tok_s"])
        int8 = {"ts_plain": dict(drafter="none", activations="int8"),
                f"ts_draft_k{best}": dict(drafter="draft_model", draft_model=draft, num_draft=best, adaptive=False,
                                          activations="int8"),
                "ts_draft_adaptive": dict(drafter="draft_model", draft_model=draft, num_draft=max(fixed),
                                          activations="int8")}
        for name, r in ts_systems(target, tok, encoded, int8, args).items():
            out[name + "_int8"] = r
        target.set_activations("exact")
        draft.set_activations("exact")
    if bin_dir:
        peer_row(out, "llama_plain_tg", errors, lambda: {
            "tok_s": llama_bench(bin_dir, src, args.threads, args.reps, "0", args.tokens)[("tg", args.tokens)]})
        peer_row(out, "llama_plain", errors, lambda: llama_plain_at_depths(
            bin_dir, src, [len(e) for e in encoded], args.max_new_tokens, args.threads))
        max_seq = max(map(len, encoded)) + args.max_new_tokens + 70
        for n in (int(k) for k in args.llama_draft_max.split(",")):
            peer_row(out, f"llama_speculative_simple_n{n}", errors, lambda n=n: llama_decode(
                [os.path.join(bin_dir, "llama-speculative-simple"), "-m", src, "-md", draft_src,
                 "--spec-type", "draft-simple", "--spec-draft-n-max", str(n), "-n", str(args.max_new_tokens),
                 "-t", str(args.threads), "--temp", "0", "-c", str(max_seq + 64)], texts))
    return out


def markdown(meta: dict, res: dict) -> str:
    lines = [f"CPU: {meta['cpu']}; {meta['threads']} threads; {meta['date']}; turbospec ISA path "
             f"{meta['kernels'].get('cpu_isa')}, prefetch {meta['kernels'].get('cpu_prefetch')}", "",
             "| weights | turbospec tok/s | llama.cpp tok/s | ratio (median of rounds) |",
             "|---|---|---|---|"]
    for fmt, row in res["plain"].items():
        lc = row.get("llama.cpp")
        ts = row["turbospec"]
        lines.append(f"| {fmt} | {ts:.1f} | " + (f"{lc:.1f} | {row['ratio']:.2f}x |" if lc else "- | - |"))
    if res["curve"]:
        lines += ["", "Verify cost: time of an N-token pass / a 1-token step", "",
                  "| weights | system | " + " | ".join(f"N={n}" for n in VERIFY_TOKENS) + " |",
                  "|---|---|" + "---|" * len(VERIFY_TOKENS)]
        for fmt, systems in res["curve"].items():
            for name, c in systems.items():
                lines.append(f"| {fmt} | {name} | " + " | ".join(f"{c[n] / c[1]:.2f}" for n in VERIFY_TOKENS) + " |")
    if res.get("prefill"):
        lines += ["", "Prefill (one forward over an N-token prompt, empty cache): tok/s", "",
                  "| weights | N | turbospec tok/s | llama.cpp tok/s (pp) | ratio (median of rounds) |",
                  "|---|---|---|---|---|"]
        for fmt, row in res["prefill"].items():
            lc = row.get("llama.cpp")
            lines.append(f"| {fmt} | {row['tokens']} | {row['turbospec']:.1f} | "
                         + (f"{lc:.1f} | {row['ratio']:.2f}x |" if lc else "- | - |"))
    for key, title in (("spec", "Speculation"), ("pair", "Target + draft model")):
        if not res.get(key):
            continue
        # llama.cpp plain: at the prompts' context lengths when measured, else tg at depth 0
        llama = res[key].get("llama_plain", res[key].get("llama_plain_tg", {})).get("tok_s")
        lines += ["", f"{title}, Spec-Bench sample, decode tok/s (prefill excluded)", "",
                  "| system | tok/s | x turbospec plain (same activations) | x llama.cpp plain | tau | "
                  "output == plain greedy | end to end s (prefill + decode) |", "|---|---|---|---|---|---|---|"]
        for name, r in res[key].items():
            base = res[key].get("ts_plain_int8" if name.endswith("_int8") else "ts_plain", {}).get("tok_s")
            ratio = f"{r['tok_s'] / base:.2f}x" if base else "-"
            vs_llama = f"{r['tok_s'] / llama:.2f}x" if llama else "-"
            total = f"{r['total_s']:.1f}" if "total_s" in r else "-"
            lines.append(f"| {name} | {r['tok_s']:.1f} | {ratio} | {vs_llama} | {r.get('tau', float('nan')):.2f} | "
                         f"{r.get('equal_to_plain', '-')} | {total} |")
    if res.get("peer_errors"):
        lines += ["", "llama.cpp failures (their rows are missing above):", ""] + [f"- {e}" for e in res["peer_errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
