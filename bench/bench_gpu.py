"""GPU benchmarks for turbospec: copy bandwidth and the weight-read floor, target step times (plain
decode and tree verify), and end-to-end tok/s against HF ``generate``, all in one run.

    python bench/bench_gpu.py                                   # everything, on CUDA (H100/H200)
    python bench/bench_gpu.py --models smollm2_135m --sections steps,e2e
    python bench/bench_gpu.py --models llama3_8b --systems hf_plain,ts_graphs
    python bench/bench_gpu.py --tau ts_ngram_cpu_bf16=TAU@9    # + projected speculative tok/s (SmolLM2)
    python bench/bench_gpu.py --device cpu --tiny               # smoke run of every code path (< 20 s)

Sections (``--sections``, default all):

* ``bandwidth``: ``dst.copy_(src)`` of a large device buffer, timed with CUDA events (median of
  ``--copy-iters``). Reported as (bytes read + bytes written) / time. That same figure is used as the
  device's read bandwidth: HBM's bytes/s are shared by reads and writes, so a copy's total traffic is
  the rate at which a pure weight-read stream can be served. A read-only reduction (``sum``) is
  reported beside it as a cross-check only.
* models: Llama-3-8B-shaped and SmolLM2-135M-shaped ``LlamaForCausalLM`` with random weights
  (normal, std 0.02; RMSNorm weights 1), built directly on the device in ``--dtype``. The
  weight-read floor of one decode step = bytes of every ``nn.Linear`` weight (q/k/v/o, gate/up/down
  in every layer, and lm_head; a tied lm_head counted once) / the read bandwidth above. The
  embedding table (only gathered), the RMSNorm weights and the KV cache are not counted.
* ``steps``: ``engine.runner.forward`` (the target forward turbospec runs every step) over
  n in ``--tokens`` new tokens as a chain and as a random tree (``ops.build_tree`` of random
  parents) at each cache length in ``--cache-lens``, with CUDA graphs on and off. Each call is timed
  with a pair of CUDA events and a synchronize after it (one step from an idle GPU, as the engine
  runs it: it reads ``accept_len`` on the host every step); median of ``--step-iters`` after
  ``--warmup``. Reports µs, the ratio to the 1-token step at the same cache length, and for the
  1-token step the % of the weight-read floor (floor time / step time).
* ``e2e``: greedy generation of ``--max-new-tokens`` after the same random ``--prompt-len``-token
  prompt: turbospec without speculation with CUDA graphs (``ts_graphs``) and without
  (``ts_eager``), HF ``generate`` with its dynamic cache (``hf_plain``), with
  prompt lookup decoding (``hf_lookup``, 10 draft tokens), with
  ``cache_implementation="static"`` (``hf_static``) and with the static cache plus
  ``torch.compile(model.forward, mode="reduce-overhead")`` (``hf_static_compile``). One full
  warm-up run per system, then the median wall time of ``--repeats`` runs (prefill included,
  synchronized). Also: ``ts_ngram`` and ``ts_eagle`` / ``ts_medusa`` (the heads shipped for SmolLM2;
  SmolLM2-shaped models only), for profiling the speculative path; on random weights their τ means
  nothing. Failures are reported as "failed: <reason>", never hidden.

With ``--real-model DIR`` the SmolLM2-shaped model gets real weights (SmolLM2-135M-Instruct: on the
GPU machine the directory ``bench/gpu_carry.py`` joins) and the e2e section runs the Spec-Bench sample
(``--spec-per-category`` first turns per category, chat template): τ and the speculative systems' tok/s
are then real.

Random weights read the same bytes as real ones, so step times and plain tok/s are real; acceptance
(τ) is not, so ``--tau LABEL=TAU@NODES`` takes τ measured on CPU with real weights and projects the
speculative tok/s of the SmolLM2-shaped model as TAU / (tree-verify step time at NODES tokens), drafting
excluded: an upper bound, labelled as such.

Output: a markdown report printed and written to ``--out`` (default bench/out/gpu_<device>.md) and a
JSON file beside it with every number. ``--device cpu --tiny`` runs the same code with a tiny config
(perf_counter timing) as a smoke test; the HF torch.compile system is skipped on CPU unless
``--hf-compile on``.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)  # run from a checkout

SECTIONS = ("bandwidth", "steps", "e2e")
MODELS = ("llama3_8b", "smollm2_135m")
TS_PLAIN = ("ts_graphs", "ts_eager")
TS_SPEC = ("ts_ngram", "ts_eagle", "ts_medusa")
HF_SYSTEMS = ("hf_plain", "hf_lookup", "hf_static", "hf_static_compile")
DEFAULT_SYSTEMS = ("hf_plain", "ts_graphs", "ts_eager", "hf_static", "hf_static_compile")

#: defaults: (full run, --tiny run)
DEFAULTS = {
    "copy_mib": (2048, 64), "copy_iters": (30, 5),
    "step_iters": (50, 5), "warmup": (10, 2),
    "cache_lens": ("256,1024,4096", "16,64"), "tokens": ("1,2,4,8,16,32,64", "1,2,4,8"),
    "prompt_len": (128, 16), "max_new_tokens": (256, 24), "repeats": (3, 1),
}

#: the issue's targets (batch 1, bf16, H100/H200): thresholds, not results
TARGET_FLOOR_PCT = 85.0
TARGET_TREE64_RATIO = 1.15
TARGET_SMOLLM2_TOK_S = 2000.0
TARGET_SMOLLM2_SPEEDUP = 5.0


# ---------------------------------------------------------------------------------------------
# timing
def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn, device: str, iters: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn()``, ``iters`` samples after ``warmup`` untimed calls.

    CUDA: a start/end event pair around each call, synchronized after it (GPU time from an idle
    queue, launch latency included). CPU: ``time.perf_counter`` around each call."""
    cuda = device.startswith("cuda")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


def wall_time(fn, device: str) -> tuple[float, object]:
    """(seconds, result) of one synchronized call: for whole generations."""
    synchronize(device)
    t = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t, out


def nvtx_range(name: str, device: str):
    """An NVTX range on CUDA (seen by nsys), nothing on CPU."""
    if device.startswith("cuda"):
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# a. copy bandwidth
def measure_bandwidth(device: str, nbytes: int, iters: int, warmup: int) -> dict:
    """Device copy ``dst.copy_(src)`` of ``nbytes`` (one read + one write of every byte) and a
    read-only float32 ``sum`` over the same buffer, medians of ``iters``.

    ``copy_gb_s`` = 2 * nbytes / t_copy (read + written); ``read_gb_s`` (the read bandwidth the
    floor uses) is the same number; ``sum_read_gb_s`` = nbytes / t_sum (cross-check only)."""
    nbytes -= nbytes % 4
    src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = statistics.median(time_calls(lambda: dst.copy_(src), device, iters, warmup))
    as_f32 = src.view(torch.float32)
    sum_s = statistics.median(time_calls(lambda: as_f32.sum(), device, iters, warmup))
    del src, dst, as_f32
    free_memory(device)
    copy_gb_s = 2 * nbytes / copy_s / 1e9
    return {"bytes": nbytes, "copy_s": copy_s, "copy_gb_s": copy_gb_s, "read_gb_s": copy_gb_s,
            "sum_s": sum_s, "sum_read_gb_s": nbytes / sum_s / 1e9,
            "definition": "copy_gb_s = (bytes read + bytes written) / t of dst.copy_(src); read_gb_s = "
                          "copy_gb_s (HBM bytes/s are shared by reads and writes); sum_read_gb_s = bytes / t "
                          "of a float32 sum over the buffer (cross-check only)"}


# ---------------------------------------------------------------------------------------------
# b. model builders
def _llama_config(**kw):
    from transformers import LlamaConfig
    # No special tokens: a random model must never stop early on an EOS, in HF or in turbospec.
    return LlamaConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None, hidden_act="silu",
                       attention_bias=False, mlp_bias=False, initializer_range=0.02, **kw)


def llama3_8b_config():
    """Llama-3-8B shapes (hidden 4096, 32 layers, 32 heads / 8 KV heads, vocab 128256, untied)."""
    return _llama_config(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)


def smollm2_135m_config():
    """SmolLM2-135M shapes (hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied)."""
    return _llama_config(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True)


def tiny_config(tie: bool):
    """The smoke-test stand-in for either model (same code paths, same tying)."""
    return _llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, rope_theta=10000.0,
                         max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tie)


def model_config(name: str, tiny: bool):
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not known; choose from {', '.join(MODELS)}")
    if tiny:
        return tiny_config(tie=name == "smollm2_135m")
    return llama3_8b_config() if name == "llama3_8b" else smollm2_135m_config()


def build_random_llama(config, device: str, dtype: torch.dtype, seed: int = 0, std: float = 0.02):
    """``LlamaForCausalLM(config)`` allocated directly on ``device`` in ``dtype`` (no CPU copy),
    then every matrix drawn from N(0, std²) and every RMSNorm weight set to 1 on the device; raises
    if any weight is not finite."""
    from transformers import LlamaForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights (the model has no biases)
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
            if not bool(torch.isfinite(p).all()):
                raise RuntimeError(f"random weight {name} is not finite")
    return model.eval()


def linear_weight_bytes(model) -> int:
    """Bytes one decode step reads from weights: every ``nn.Linear``'s weight (and bias), lm_head
    included; shared tensors counted once; the embedding table (gathered, not read) excluded."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for t in (module.weight, module.bias):
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def model_summary(name: str, model, bandwidth: dict | None) -> dict:
    cfg = model.config
    wbytes = linear_weight_bytes(model)
    out = {"name": name, "params": sum(p.numel() for p in model.parameters()), "linear_weight_bytes": wbytes,
           "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
           "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
           "tied": bool(cfg.tie_word_embeddings), "dtype": str(next(model.parameters()).dtype)}
    if bandwidth is not None:
        out["floor_s"] = wbytes / (bandwidth["read_gb_s"] * 1e9)
        out["floor_tok_s"] = 1.0 / out["floor_s"]
    return out


# ---------------------------------------------------------------------------------------------
# turbospec engines
def make_engine(target, args, graphs: bool, max_seq_len: int, drafter="none", **kw):
    """A turbospec Engine on ``args.device`` in ``args.dtype`` with CUDA graphs on or off (always off
    on CPU, where the Engine refuses them); ``--static-shapes on/off`` is passed on, ``auto`` leaves
    the Engine's default (the fixed-bucket path off CPU)."""
    import turbospec
    if args.static_shapes != "auto":
        kw["static_shapes"] = args.static_shapes == "on"
    return turbospec.Engine(target, drafter=drafter, dtype=args.dtype, device=args.device,
                            cuda_graphs=graphs and args.device.startswith("cuda"), max_seq_len=max_seq_len, **kw)


def shipped_head_kwargs(method: str, hf_config) -> dict:
    """Engine options for the head shipped for SmolLM2 (``method`` "eagle" or "medusa"), with the
    tree options it was tuned for; raises if none is shipped or it does not fit the model."""
    from turbospec.heads.formats import load_head
    from turbospec.model.transformer import ModelConfig
    from turbospec.heads.shipped import shipped_heads
    heads = shipped_heads()
    # "eagle": the shipped EAGLE-3 head when there is one (what Engine(drafter="eagle") picks)
    path = next((heads[m] for m in (("eagle3", "eagle") if method == "eagle" else (method,)) if m in heads), None)
    if path is None:
        raise LookupError(f"no {method} head is shipped in turbospec/heads_data")
    head = load_head(path, target_cfg=ModelConfig.from_hf(hf_config))
    opts = dict(getattr(head, "extra", {}).get("engine", {}))
    kw = {"drafter": method, "head": head}
    for key in ("num_draft", "tree", "draft_dtype"):
        if opts.get(key) is not None:
            kw[key] = opts[key]
    return kw


def ts_system_engine(system: str, model, args, max_seq_len: int):
    """The Engine a ``ts_*`` system runs."""
    if system == "ts_graphs":
        return make_engine(model, args, True, max_seq_len)
    if system == "ts_eager":
        return make_engine(model, args, False, max_seq_len)
    if system == "ts_ngram":
        return make_engine(model, args, True, max_seq_len, drafter="ngram")
    if system in ("ts_eagle", "ts_medusa"):
        return make_engine(model, args, True, max_seq_len, **shipped_head_kwargs(system[3:], model.config))
    raise ValueError(f"unknown turbospec system {system!r}")


# ---------------------------------------------------------------------------------------------
# c. step times
def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random tree of n nodes: node 0 the root, node i's parent uniform in [0, i)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def step_inputs(n: int, cache_len: int, kind: str, vocab: int, device: str, gen: torch.Generator):
    """(node_ids [1, n], positions [1, n], tree_mask_packed [1, n] or None) for a chain or a tree."""
    from turbospec import ops
    node_ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
    if kind == "chain":
        positions = torch.arange(cache_len, cache_len + n, device=device)[None]
        return node_ids, positions, None
    parents = torch.tensor([random_parents(n, gen)], dtype=torch.int64, device=device)
    _, packed, depth, _ = ops.build_tree(parents)
    return node_ids, cache_len + depth, packed


def measure_steps(runner, vocab: int, device: str, cache_lens, ns, iters: int, warmup: int,
                  seed: int = 0) -> list[dict]:
    """Median seconds of ``runner.forward(node_ids, positions, cache_len, tree_mask_packed)`` per
    (cache_len, n, kind): kind "chain" (causal, no mask) and, for n > 1, "tree" (a random tree).
    ``ratio`` = time / the 1-token step at the same cache length. K/V contents are whatever the cache
    holds: they do not change the time."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for cache_len in cache_lens:
        for n in ns:
            for kind in ("chain", "tree") if n > 1 else ("chain",):
                node_ids, positions, packed = step_inputs(n, cache_len, kind, vocab, device, gen)
                logits = runner.forward(node_ids, positions, cache_len, packed)
                if tuple(logits.shape) != (1, n, vocab):
                    raise RuntimeError(f"runner.forward returned logits of shape {tuple(logits.shape)}, "
                                       f"expected (1, {n}, {vocab})")
                finite = bool(torch.isfinite(logits).all())  # before replays reuse the output buffer
                times = time_calls(lambda: runner.forward(node_ids, positions, cache_len, packed), device,
                                   iters, warmup)
                rows.append({"cache_len": cache_len, "n": n, "kind": kind, "median_s": statistics.median(times),
                             "min_s": min(times), "finite": finite})
    for r in rows:
        one = next(x for x in rows if x["cache_len"] == r["cache_len"] and x["n"] == 1)
        r["ratio"] = r["median_s"] / one["median_s"]
    return rows


def steps_for_engine(engine, vocab: int, device: str, cache_lens, ns, args, floor_s: float | None) -> dict:
    """Step times of one engine's runner, with the graph settings it reports."""
    runner = engine.runner
    with nvtx_range(f"bench:steps:graphs={bool(runner.graphs)}", device):
        rows = measure_steps(runner, vocab, device, cache_lens, ns, args.step_iters, args.warmup, args.seed)
    if floor_s is not None:
        for r in rows:
            if r["n"] == 1:
                r["floor_pct"] = 100.0 * floor_s / r["median_s"]
    return {"status": "ok", "graphs": bool(runner.graphs), "buckets": list(getattr(runner, "buckets", ()) or ()),
            "rows": rows}


def steps_section(model, name: str, args, floor_s: float | None) -> dict:
    """Step times with CUDA graphs on and off (on CPU: once, graphs do not apply)."""
    cfg = model.config
    ns = [n for n in args.tokens if n <= 64]
    cache_lens = [c for c in args.cache_lens if c + max(ns) <= cfg.max_position_embeddings]
    skipped = sorted(set(args.cache_lens) - set(cache_lens))
    modes = args.step_graphs if args.device.startswith("cuda") else [False]
    out = {"cache_lens": cache_lens, "tokens": ns, "cache_lens_skipped": skipped, "runs": {}}
    if not cache_lens:
        out["runs"]["graphs_off"] = {"status": f"skipped: no cache length fits max_position "
                                               f"{cfg.max_position_embeddings}"}
        return out
    for graphs in modes:
        key = "graphs_on" if graphs else "graphs_off"
        engine = None
        try:
            engine = make_engine(model, args, graphs, max(cache_lens) + max(ns))
            out["runs"][key] = steps_for_engine(engine, cfg.vocab_size, args.device, cache_lens, ns, args, floor_s)
        except Exception as e:  # noqa: BLE001 - reported, and re-raised with --strict
            out["runs"][key] = failure(e, args, f"steps {name} {key}")
        finally:
            del engine
            free_memory(args.device)
    return out


def project_speculation(steps: dict, taus: list[tuple[str, float, int]]) -> list[dict]:
    """tok/s ≈ τ / t_verify(n ≥ NODES tokens, tree, smallest cache length, graphs on if measured);
    drafting is excluded, so this is an upper bound. τ comes from CPU runs with real weights."""
    run = steps["runs"].get("graphs_on") or steps["runs"].get("graphs_off")
    out = []
    for label, tau, nodes in taus:
        row = None
        if run and run.get("status") == "ok":
            cands = [r for r in run["rows"] if r["cache_len"] == min(steps["cache_lens"]) and r["n"] >= nodes
                     and r["kind"] == ("tree" if r["n"] > 1 else "chain")]
            row = min(cands, key=lambda r: r["n"], default=None)
        if row is None:
            out.append({"label": label, "tau": tau, "nodes": nodes, "status": "no step time for that many nodes"})
            continue
        out.append({"label": label, "tau": tau, "nodes": nodes, "verify_n": row["n"], "cache_len": row["cache_len"],
                    "verify_s": row["median_s"], "projected_tok_s": tau / row["median_s"], "status": "ok"})
    return out


# ---------------------------------------------------------------------------------------------
# d. end to end
def common_prefix_fraction(a: list[int], b: list[int]) -> float:
    """Tokens identical before the first difference, as a fraction of len(b) (the reference)."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k / max(len(b), 1)


def hf_generate(model, prompt: torch.Tensor, max_new_tokens: int, static: bool, lookup: int = 0) -> list[int]:
    """Greedy HF ``generate``; ``static``: ``cache_implementation="static"`` with HF's own
    auto-compile disabled (compilation, when wanted, is the caller's torch.compile); ``lookup``:
    HF's prompt lookup decoding with that many draft tokens (``prompt_lookup_num_tokens``)."""
    kw = {"cache_implementation": "static", "disable_compile": True} if static else {}
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, prompt.shape[1]:].tolist()


@contextlib.contextmanager
def compiled_forward(model):
    """``model.forward = torch.compile(model.forward, mode="reduce-overhead")`` inside the block."""
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    try:
        yield
    finally:
        del model.forward  # the instance attribute; the class method is back
        torch._dynamo.reset()


def timed_runs(fn, device: str, repeats: int, label: str, profile: bool, warmup: bool = True
               ) -> tuple[list[float], object]:
    """One untimed warm-up call of ``fn`` (unless ``warmup`` is False), then ``repeats`` synchronized
    wall times (inside a CUDA profiler capture range when ``profile``)."""
    if warmup:
        with nvtx_range(f"bench:warmup:{label}", device):
            fn()
    times, out = [], None
    if profile:
        torch.cuda.profiler.start()
    try:
        for i in range(repeats):
            with nvtx_range(f"bench:run:{label}:{i}", device):
                dt, out = wall_time(fn, device)
            times.append(dt)
    finally:
        if profile:
            torch.cuda.profiler.stop()
    return times, out


def over_prompts(run_one, prompts: list, args, label: str) -> tuple[list[float], list]:
    """``run_one(prompt)`` on each prompt: a warm-up on the first, then ``--repeats`` timed runs of
    each; the median wall time and the output of each prompt."""
    walls, outs = [], []
    for i, prompt in enumerate(prompts):
        times, out = timed_runs(lambda: run_one(prompt), args.device, args.repeats, f"{label}:{i}",  # noqa: B023
                                args.cuda_profiler_range, warmup=i == 0)
        walls.append(statistics.median(times))
        outs.append(out)
    return walls, outs


def run_hf_system(system: str, model, prompts: list, args) -> dict:
    if system == "hf_static_compile" and not args.hf_compile_on:
        return {"status": "skipped: torch.compile off (--hf-compile off; the default on CPU)"}
    run_one = lambda prompt: hf_generate(model, prompt, args.max_new_tokens,  # noqa: E731
                                         static=system not in ("hf_plain", "hf_lookup"),
                                         lookup=10 if system == "hf_lookup" else 0)
    ctx = compiled_forward(model) if system == "hf_static_compile" else contextlib.nullcontext()
    with ctx:
        walls, tokens = over_prompts(run_one, prompts, args, system)
    n = sum(len(t) for t in tokens)
    return {"status": "ok", "wall_s": sum(walls), "wall_per_prompt_s": walls, "new_tokens": n,
            "tok_s": n / sum(walls), "token_ids": tokens}


def run_ts_system(system: str, model, prompts: list, args) -> dict:
    # The cache holds exactly the longest prompt + new tokens, as HF's static cache does.
    engine = ts_system_engine(system, model, args, max(p.shape[1] for p in prompts) + args.max_new_tokens)
    run_one = lambda prompt: engine.generate(prompt[0].tolist(), max_new_tokens=args.max_new_tokens,  # noqa: E731
                                             temperature=0.0)
    try:
        walls, gens = over_prompts(run_one, prompts, args, system)
        runner = getattr(engine, "runner", None)
        graphs = getattr(runner, "graphs", None)
    finally:
        del engine
        free_memory(args.device)
    n = sum(len(g.token_ids) for g in gens)
    steps = sum(g.stats["verify_steps"] for g in gens)
    decode_s = [len(g.token_ids) / g.stats["decode_tokens_per_s"] for g in gens if g.stats.get("decode_tokens_per_s")]
    return {"status": "ok", "wall_s": sum(walls), "wall_per_prompt_s": walls, "new_tokens": n,
            "tok_s": n / sum(walls),
            "decode_tok_s": n / sum(decode_s) if len(decode_s) == len(gens) and sum(decode_s) > 0 else None,
            # τ over the prompts as the engine defines it per generation: tokens emitted / verify steps
            "tau": sum(g.stats["new_tokens"] for g in gens) / max(steps, 1),
            "verify_steps": steps, "graphs": graphs,
            "stats": [{k: g.stats.get(k) for k in ("tokens_per_s", "decode_tokens_per_s", "verify_steps", "tau",
                                                   "verify_s", "draft_s", "prefill_s", "total_s")} for g in gens],
            "token_ids": [list(g.token_ids) for g in gens]}


def e2e_prompts(model, name: str, args) -> tuple[list[torch.Tensor], str]:
    """The prompts of the e2e section: with --real-model on the SmolLM2-shaped model and
    --spec-per-category > 0, the Spec-Bench sample's first turns (chat template); else one random
    --prompt-len-token prompt."""
    if name == "smollm2_135m" and args.real_model and args.spec_per_category > 0:
        from turbospec import load_tokenizer
        from turbospec.benchmark import load_prompts
        from turbospec.decode.text import encode
        tok = load_tokenizer(args.real_model)
        rows = load_prompts(args.spec_bench, args.spec_per_category, 0)
        prompts = [torch.tensor([encode(tok, model.config.vocab_size, r["text"])], device=args.device) for r in rows]
        cats = sorted({r["category"] for r in rows})
        return prompts, (f"Spec-Bench sample: {len(rows)} prompts ({args.spec_per_category} per category: "
                         f"{', '.join(cats)}), first turn, chat template")
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=gen).to(args.device)
    return [prompt], f"random {args.prompt_len}-token prompt"


def e2e_section(model, name: str, args) -> dict:
    """Every selected system on the same prompts; hf_plain first (the baseline)."""
    prompts, desc = e2e_prompts(model, name, args)
    systems = sorted(args.systems, key=lambda s: s != "hf_plain")
    out = {"prompts": desc, "num_prompts": len(prompts), "prompt_len": args.prompt_len,
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "systems": {}}
    for system in systems:
        try:
            with nvtx_range(f"bench:e2e:{name}:{system}", args.device):
                if system in HF_SYSTEMS:
                    res = run_hf_system(system, model, prompts, args)
                else:
                    res = run_ts_system(system, model, prompts, args)
        except Exception as e:  # noqa: BLE001 - reported, and re-raised with --strict
            res = failure(e, args, f"e2e {name} {system}")
        free_memory(args.device)
        out["systems"][system] = res
    base = out["systems"].get("hf_plain", {})
    for system, res in out["systems"].items():
        if res.get("status") == "ok" and base.get("status") == "ok":
            res["speedup_vs_hf_plain"] = res["tok_s"] / base["tok_s"]
            res["match_hf_plain"] = statistics.mean(
                common_prefix_fraction(a, b) for a, b in zip(res["token_ids"], base["token_ids"]))
    return out


def failure(e: Exception, args, where: str) -> dict:
    """A failed measurement as a report entry (traceback on stderr); re-raised with --strict."""
    print(f"[bench_gpu] {where} failed:", file=sys.stderr)
    traceback.print_exc()
    if args.strict:
        raise e
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {"status": f"failed: {type(e).__name__}: {msg}"[:300]}


# ---------------------------------------------------------------------------------------------
# e. report
def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine() or 'unknown'})"


def environment(args) -> dict:
    import transformers
    import turbospec
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": args.device,
            "device_name": device_name(args.device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "kernels": turbospec.kernels_available(), "git": git_commit(), "tiny": args.tiny, "dtype": args.dtype,
            "command": " ".join(sys.argv)}


def check_targets(results: dict) -> list[dict]:
    """The issue's targets against this run's numbers (met True/False, or None when not measured)."""
    out = []
    for name, m in results["models"].items():
        steps = m.get("steps") or {}
        run = (steps.get("runs") or {}).get("graphs_on") or (steps.get("runs") or {}).get("graphs_off")
        rows = run["rows"] if run and run.get("status") == "ok" else []
        cl = min((r["cache_len"] for r in rows), default=None)
        one = next((r for r in rows if r["cache_len"] == cl and r["n"] == 1), None)
        if name == "llama3_8b":
            v = one.get("floor_pct") if one else None
            out.append({"target": f"{name}: plain decode step >= {TARGET_FLOOR_PCT:.0f}% of the weight-read floor",
                        "measured": None if v is None else f"{v:.1f}% (cache_len {cl})",
                        "met": None if v is None else v >= TARGET_FLOOR_PCT})
        tree = next((r for r in rows if r["cache_len"] == cl and r["n"] == 64 and r["kind"] == "tree"), None)
        out.append({"target": f"{name}: 64-token tree verify <= {TARGET_TREE64_RATIO}x the 1-token step",
                    "measured": None if tree is None else f"{tree['ratio']:.2f}x (cache_len {cl})",
                    "met": None if tree is None else tree["ratio"] <= TARGET_TREE64_RATIO})
        if name == "smollm2_135m":
            systems = (m.get("e2e") or {}).get("systems", {})
            ts = systems.get("ts_graphs", {})
            ok = ts.get("status") == "ok"
            dec = ts.get("decode_tok_s") if ok else None
            out.append({"target": f"{name}: plain decode >= {TARGET_SMOLLM2_TOK_S:.0f} tok/s with CUDA graphs",
                        "measured": None if dec is None else
                        f"{dec:.0f} tok/s decode ({ts['tok_s']:.0f} incl. prefill)",
                        "met": None if dec is None else dec >= TARGET_SMOLLM2_TOK_S})
            sp = ts.get("speedup_vs_hf_plain") if ok else None
            out.append({"target": f"{name}: >= {TARGET_SMOLLM2_SPEEDUP:.0f}x HF generate (plain)",
                        "measured": None if sp is None else f"{sp:.2f}x",
                        "met": None if sp is None else sp >= TARGET_SMOLLM2_SPEEDUP})
    return out


def _fmt(v, spec: str = ".1f", suffix: str = "", none: str = "–") -> str:
    return none if v is None else format(v, spec) + suffix


def markdown_bandwidth(bw: dict) -> list[str]:
    return ["## Copy bandwidth", "",
            f"`dst.copy_(src)` of {bw['bytes'] / 2**30:.2f} GiB, median {bw['copy_s'] * 1e3:.3f} ms: "
            f"**{bw['copy_gb_s']:.0f} GB/s** counting bytes read + bytes written. Read bandwidth used for the "
            f"floor = the same {bw['read_gb_s']:.0f} GB/s (HBM's bytes/s are shared by reads and writes). "
            f"Cross-check, float32 `sum` over the buffer (read only): {bw['sum_read_gb_s']:.0f} GB/s.", ""]


def markdown_models(models: dict, tiny: bool) -> list[str]:
    lines = ["## Models and the weight-read floor", "",
             "Floor of one decode step = bytes of every `nn.Linear` weight (q/k/v/o, gate/up/down in every "
             "layer, lm_head; a tied lm_head counted once) / read bandwidth. The embedding table (gathered), "
             "RMSNorm weights and the KV cache are not counted.", "",
             "| model | weights | params | layers | hidden | heads / KV | vocab | tied | linear weight MB "
             "| floor µs | floor tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in models.items():
        s = m["summary"]
        label = name + (" (tiny stand-in)" if tiny else "")
        lines.append(f"| {label} | {s.get('weights', 'random')} | {s['params'] / 1e6:.1f}M | {s['layers']} | "
                     f"{s['hidden']} | {s['heads']} / {s['kv_heads']} | {s['vocab']} | {s['tied']} | "
                     f"{s['linear_weight_bytes'] / 1e6:.1f} | {_fmt(s.get('floor_s') and s['floor_s'] * 1e6)} | "
                     f"{_fmt(s.get('floor_tok_s'), '.0f')} |")
    return lines + [""]


def markdown_steps(name: str, steps: dict) -> list[str]:
    lines = [f"## Step times — {name}", "",
             "Median µs of `engine.runner.forward` over n new tokens (ratio to the 1-token step at the same "
             "cache length); chain = causal, tree = a random tree from `build_tree`. "
             f"Cache lengths skipped (beyond max_position): {steps['cache_lens_skipped'] or 'none'}.", ""]
    for key, run in steps["runs"].items():
        if run.get("status") != "ok":
            lines += [f"**{key}**: {run['status']}", ""]
            continue
        lines += [f"**{key}** (runner.graphs = {run['graphs']}, buckets {run['buckets'] or '–'})", "",
                  "| n | kind | " + " | ".join(f"cache {c}" for c in steps["cache_lens"]) + " |",
                  "|---|---|" + "---|" * len(steps["cache_lens"])]
        for n in steps["tokens"]:
            for kind in ("chain", "tree") if n > 1 else ("chain",):
                cells = []
                for c in steps["cache_lens"]:
                    r = next(x for x in run["rows"] if x["cache_len"] == c and x["n"] == n and x["kind"] == kind)
                    cell = f"{r['median_s'] * 1e6:.1f} ({r['ratio']:.2f}×)"
                    if "floor_pct" in r:
                        cell += f", {r['floor_pct']:.0f}% of floor"
                    cells.append(cell + ("" if r["finite"] else " NON-FINITE"))
                lines.append(f"| {n} | {kind} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def markdown_projection(name: str, proj: list[dict]) -> list[str]:
    lines = [f"Projected speculative tok/s for {name} (τ from CPU runs with real weights, NOT measured here; "
             "tok/s = τ / tree-verify step time, drafting excluded: an upper bound):", "",
             "| τ source | τ | nodes | verify n | verify µs | projected tok/s |", "|---|---|---|---|---|---|"]
    for p in proj:
        if p["status"] != "ok":
            lines.append(f"| {p['label']} (CPU) | {p['tau']} | {p['nodes']} | {p['status']} | | |")
        else:
            lines.append(f"| {p['label']} (CPU) | {p['tau']:.2f} | {p['nodes']} | {p['verify_n']} | "
                         f"{p['verify_s'] * 1e6:.1f} | {p['projected_tok_s']:.0f} |")
    return lines + [""]


def markdown_e2e(name: str, e2e: dict) -> list[str]:
    lines = [f"## End to end — {name}", "",
             f"Greedy, {e2e['prompts']}, {e2e['max_new_tokens']} new tokens; tok/s = new tokens / wall time "
             f"incl. prefill (summed over the prompts, each the median of {e2e['repeats']} after a warm-up run). "
             "Match = tokens identical to hf_plain before the first difference, mean over the prompts (bf16: "
             "differences are expected).", "",
             "| system | tok/s | decode tok/s | ms/token | speedup vs hf_plain | τ | match hf_plain | CUDA graphs "
             "| status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for system, r in e2e["systems"].items():
        if r.get("status") != "ok":
            lines.append(f"| {system} | | | | | | | | {r['status']} |")
            continue
        ms = 1e3 / r["decode_tok_s"] if r.get("decode_tok_s") else None
        match = None if r.get("match_hf_plain") is None else 100 * r["match_hf_plain"]
        lines.append(f"| {system} | {r['tok_s']:.1f} | {_fmt(r.get('decode_tok_s'))} | {_fmt(ms, '.3f')} | "
                     f"{_fmt(r.get('speedup_vs_hf_plain'), '.2f', '×')} | {_fmt(r.get('tau'), '.2f')} | "
                     f"{_fmt(match, '.0f', '%')} | {_fmt(r.get('graphs'), '')} | ok |")
    return lines + [""]


def markdown_report(results: dict) -> str:
    env = results["env"]
    lines = [f"# turbospec GPU benchmark — {env['device_name']}", "",
             f"{env['date']}; device {env['device']}; torch {env['torch']} (CUDA {env['cuda']}); transformers "
             f"{env['transformers']}; Python {env['python']}; git {env['git']}; turbospec kernels {env['kernels']}; "
             f"dtype {env['dtype']}.", f"Command: `{env['command']}`", ""]
    if env["tiny"]:
        lines += ["**Tiny smoke configuration** (hidden 64, 2 layers, vocab 256): numbers check the code, "
                  "not the hardware.", ""]
    if results.get("bandwidth"):
        lines += markdown_bandwidth(results["bandwidth"])
    if results["models"]:
        lines += markdown_models(results["models"], env["tiny"])
    for name, m in results["models"].items():
        if m.get("steps"):
            lines += markdown_steps(name, m["steps"])
        if m.get("projection"):
            lines += markdown_projection(name, m["projection"])
        if m.get("e2e"):
            lines += markdown_e2e(name, m["e2e"])
    lines += ["## Targets", ""]
    if env["tiny"]:
        lines += ["(tiny configuration: the checks below run, their verdicts mean nothing)", ""]
    lines += ["| target | measured | met |", "|---|---|---|"]
    for t in results["targets"]:
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['measured'] or 'not measured'} | {met} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model config and few iterations (smoke test)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list from {','.join(SECTIONS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list from {','.join(MODELS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--copy-mib", type=int, default=None, help="copy buffer MiB (default 2048; tiny 64)")
    p.add_argument("--copy-iters", type=int, default=None)
    p.add_argument("--step-iters", type=int, default=None, help="timed calls per step shape (default 50)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per step shape (default 10)")
    p.add_argument("--cache-lens", default=None, help="default 256,1024,4096 (those that fit max_position)")
    p.add_argument("--tokens", default=None, help="new tokens per step, <= 64; default 1,2,4,8,16,32,64")
    p.add_argument("--step-graphs", default="on,off", help="CUDA graph settings for the steps section")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"e2e systems, comma list from {','.join(HF_SYSTEMS + TS_PLAIN + TS_SPEC)}")
    p.add_argument("--prompt-len", type=int, default=None, help="random prompt tokens (default 128)")
    p.add_argument("--real-model", default=None,
                   help="real weights for the SmolLM2-shaped model: a model directory or .gguf (on the GPU "
                        "machine, the directory bench/gpu_carry.py joins); τ is then real")
    p.add_argument("--spec-bench", default=os.path.join(_ROOT, "..", "shared", "data", "specbench_dev.jsonl"),
                   help="Spec-Bench-format prompts for the e2e section with --real-model")
    p.add_argument("--spec-per-category", type=int, default=1,
                   help="with --real-model: prompts per Spec-Bench category in the e2e section (0: the random prompt)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 256")
    p.add_argument("--repeats", type=int, default=None, help="timed e2e runs per system (default 3)")
    p.add_argument("--hf-compile", default="auto", choices=["auto", "on", "off"],
                   help="run hf_static_compile (auto: on CUDA only)")
    p.add_argument("--tau", action="append", default=[], metavar="LABEL=TAU@NODES",
                   help="τ from a CPU run with real weights, for the SmolLM2 projection (repeatable)")
    p.add_argument("--cuda-profiler-range", action="store_true",
                   help="wrap the timed e2e runs in cudaProfilerStart/Stop (nsys --capture-range=cudaProfilerApi)")
    p.add_argument("--static-shapes", default="auto", choices=["auto", "on", "off"],
                   help="Engine(static_shapes=): the fixed-bucket path CUDA graphs capture (auto: the Engine's "
                        "default, on off CPU); 'on' with --device cpu runs the GPU code path eagerly on CPU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's; --tiny: 1, steadier on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="re-raise the first failure instead of reporting it")
    p.add_argument("--out", default=None, help="markdown path (JSON beside it); default bench/out/gpu_<device>.md")
    args = p.parse_args(argv)
    return resolve_args(p, args)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parse_tau(text: str) -> tuple[str, float, int]:
    m = re.fullmatch(r"([^=]+)=([0-9.]+)@([0-9]+)", text)
    if not m:
        raise ValueError(f"--tau {text!r}: expected LABEL=TAU@NODES, e.g. ts_ngram_cpu=1.51@9")
    return m.group(1), float(m.group(2)), int(m.group(3))


def resolve_args(p: argparse.ArgumentParser, args):
    """Defaults that depend on --tiny, lists parsed, everything validated."""
    tiny = int(args.tiny)
    for key, pair in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, pair[tiny])
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available (use --device cpu --tiny for a smoke run)")
    args.sections = [s for s in args.sections.split(",") if s]
    args.models = [m for m in args.models.split(",") if m]
    args.systems = [s for s in args.systems.split(",") if s]
    for value, allowed, flag in ((args.sections, SECTIONS, "--sections"), (args.models, MODELS, "--models"),
                                 (args.systems, HF_SYSTEMS + TS_PLAIN + TS_SPEC, "--systems")):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"{flag}: unknown {bad}; allowed: {', '.join(allowed)}")
    args.cache_lens = _int_list(args.cache_lens)
    args.tokens = _int_list(args.tokens)
    if not args.tokens or 1 not in args.tokens or max(args.tokens) > 64 or min(args.tokens) < 1:
        p.error(f"--tokens must include 1 and lie in [1, 64], got {args.tokens}")
    graphs = [g for g in args.step_graphs.split(",") if g]
    if not graphs or set(graphs) - {"on", "off"}:
        p.error(f"--step-graphs: comma list of on/off, got {args.step_graphs!r}")
    args.step_graphs = [g == "on" for g in graphs]
    try:
        args.tau = [_parse_tau(t) for t in args.tau]
    except ValueError as e:
        p.error(str(e))
    if args.real_model:
        if not os.path.exists(args.real_model):
            p.error(f"--real-model {args.real_model!r} does not exist")
        if "smollm2_135m" not in args.models or args.tiny:
            p.error("--real-model stands in for the smollm2_135m shape: list it in --models, without --tiny")
        if args.spec_per_category > 0 and not os.path.isfile(args.spec_bench):
            p.error(f"--spec-bench {args.spec_bench!r} does not exist (needed with --real-model and "
                    f"--spec-per-category {args.spec_per_category})")
    if args.spec_per_category < 0:
        p.error(f"--spec-per-category must be >= 0, got {args.spec_per_category}")
    args.hf_compile_on = args.hf_compile == "on" or (args.hf_compile == "auto" and args.device.startswith("cuda"))
    if args.cuda_profiler_range and not args.device.startswith("cuda"):
        p.error("--cuda-profiler-range needs --device cuda")
    if args.out is None:
        tag = re.sub(r"[^A-Za-z0-9]+", "_", device_name(args.device)).strip("_") or "device"
        args.out = os.path.join(_ROOT, "bench", "out", f"gpu_{tag}{'_tiny' if args.tiny else ''}.md")
    return args


def load_real_model(path: str, name: str, args):
    """--real-model: the transformers model of ``path`` on the device, checked against the shape it
    stands in for (a model directory whose weights are a GGUF needs no gguf package: see
    bench/gpu_carry.py, which brings SmolLM2's to the GPU machine)."""
    from turbospec.model.loader import load_hf_model
    model = load_hf_model(path, getattr(torch, args.dtype), args.device)
    want, got = model_config(name, args.tiny), model.config
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    if any(getattr(want, k) != getattr(got, k) for k in keys):
        raise ValueError(f"--real-model {path!r} is not {name}-shaped: "
                         f"{ {k: getattr(got, k) for k in keys} } vs { {k: getattr(want, k) for k in keys} }")
    return model


def run_model(name: str, args, bandwidth: dict | None) -> dict:
    """Build one model (random weights, or --real-model's for the SmolLM2 shape), then its step
    times, projection and end-to-end runs."""
    dtype = getattr(torch, args.dtype)
    real = bool(args.real_model) and name == "smollm2_135m"
    if real:
        model = load_real_model(args.real_model, name, args)
    else:
        model = build_random_llama(model_config(name, args.tiny), args.device, dtype, seed=args.seed)
    out = {"summary": model_summary(name, model, bandwidth)}
    out["summary"]["weights"] = f"real ({args.real_model})" if real else "random"
    floor_s = out["summary"].get("floor_s")
    try:
        if "steps" in args.sections:
            with nvtx_range(f"bench:steps:{name}", args.device):
                out["steps"] = steps_section(model, name, args, floor_s)
            if args.tau and name == "smollm2_135m":
                out["projection"] = project_speculation(out["steps"], args.tau)
        if "e2e" in args.sections:
            out["e2e"] = e2e_section(model, name, args)
    finally:
        del model
        free_memory(args.device)
    return out


def strip_tokens(results: dict) -> dict:
    """The JSON keeps token counts and match fractions, not the token lists themselves."""
    for m in results["models"].values():
        for r in (m.get("e2e") or {}).get("systems", {}).values():
            r.pop("token_ids", None)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads or args.tiny:
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(args.seed)
    results = {"env": environment(args), "bandwidth": None, "models": {}}
    if "bandwidth" in args.sections or "steps" in args.sections:  # the floor needs the bandwidth
        with nvtx_range("bench:bandwidth", args.device):
            results["bandwidth"] = measure_bandwidth(args.device, args.copy_mib * 2**20, args.copy_iters,
                                                     max(1, args.copy_iters // 5))
    if "steps" in args.sections or "e2e" in args.sections:
        for name in args.models:
            results["models"][name] = run_model(name, args, results["bandwidth"])
    results["targets"] = check_targets(results)
    report = markdown_report(results)
    print(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    json_path = os.path.splitext(args.out)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump(strip_tokens(results), f, indent=1, default=str)
    print(f"wrote {args.out} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
