"""Multi-turn chat benchmark: prefix caching, turbospec serve against llama-server, same GGUF.

Each chat resends its whole conversation every turn (a system prompt, then user / assistant turns,
the assistant's answers being the server's own), as chat clients do. Per server and cache setting it
records, per turn, the time to first token (TTFT) and the time to the whole answer, streamed over
HTTP with the OpenAI chat API, greedy, ``--max-tokens`` per answer; chats run one after another.
Servers, each started here (bench/http_peers.py) on the same model and thread count:

* turbospec serve, prefix cache on (default) and off (``--prefix-cache-mb 0``);
* llama-server (``--llama-server PATH``), ``cache_prompt`` true and false per request;
* vLLM's CPU build (``--vllm [VENV]``) on the GGUF dequantized to fp32 safetensors,
  ``--enable-prefix-caching`` and ``--no-enable-prefix-caching``.

    python bench/bench_multiturn.py --chats 6 --turns 4 --llama-server ~/.cache/turbospec-peers/llama.cpp/build/bin/llama-server \
        --vllm --out bench/out/multiturn
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/http_peers.py

import http_peers  # noqa: E402
from http_peers import free_port, stream_chat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "specbench_dev.jsonl")
SYSTEM = ("You are a helpful, concise assistant. Answer in plain sentences. Keep every answer short, "
          "friendly and to the point, and say so when you do not know something. " * 3)
FOLLOW_UPS = ["Can you say that more simply?", "Give one example.", "What is the most important point?",
              "Summarise our conversation in one sentence.", "Why does that matter?"]


def chat_turn(base: str, model: str, messages: list, max_tokens: int, extra: dict) -> tuple[str, float, float]:
    """One streamed answer: (text, TTFT s, total s)."""
    return stream_chat(base, model, messages, max_tokens, extra)


def run_chats(base: str, model: str, questions: list[str], turns: int, max_tokens: int, extra: dict) -> dict:
    per_turn = [[] for _ in range(turns)]
    totals = [[] for _ in range(turns)]
    answers = []
    for q in questions:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        chat = []
        for t in range(turns):
            text, ttft, total = chat_turn(base, model, messages, max_tokens, extra)
            per_turn[t].append(ttft)
            totals[t].append(total)
            chat.append(text)
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
        answers.append(chat)
    return {"ttft_ms_median_by_turn": [round(1000 * statistics.median(x), 1) for x in per_turn],
            "answer_ms_median_by_turn": [round(1000 * statistics.median(x), 1) for x in totals],
            "ttft_ms_median_turns_2_on": round(1000 * statistics.median([v for x in per_turn[1:] for v in x]), 1),
            "answers": answers}


def setups(args, gguf: str) -> list[tuple[str, str, dict]]:
    """(label, server key, request fields) per measured setting; setups sharing a key share a server."""
    out = [("turbospec, prefix cache on", "turbospec-cache", {}),
           ("turbospec, prefix cache off", "turbospec-nocache", {})]
    if args.llama_server:
        out += [("llama-server, cache_prompt on", "llama", {"cache_prompt": True}),
                ("llama-server, cache_prompt off", "llama", {"cache_prompt": False})]
    if args.vllm:
        out += [("vllm, prefix caching on", "vllm-cache", {}),
                ("vllm, prefix caching off", "vllm-nocache", {})]
    return out


def server_spec(key: str, args, gguf: str, port: int) -> http_peers.ServerSpec:
    """One chat at a time: one slot each, the same GGUF (vLLM: its fp32 safetensors) and threads."""
    if key.startswith("turbospec"):
        flags = ["--drafter", args.drafter, "--prefix-cache-mb", "512" if key == "turbospec-cache" else "0"]
        return http_peers.turbospec_spec(gguf, port, args.threads, 1, 4096, flags, name=key)
    if key == "llama":
        return http_peers.llama_spec(args.llama_server, gguf, port, args.threads, 1, 8192, name=key)
    if key.startswith("vllm"):
        return http_peers.vllm_spec(args.vllm, args.hf_dir, port, args.threads, 1, 4096,
                                    prefix_caching=key == "vllm-cache", dtype=args.vllm_dtype, name=key)
    raise ValueError(key)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--drafter", default="auto")
    p.add_argument("--llama-server", default=None, help="path of llama-server (left out: no llama-server)")
    p.add_argument("--vllm", nargs="?", const=http_peers.DEFAULT_VLLM_VENV, default=None, metavar="VENV",
                   help=f"also vLLM's CPU build from this venv (default {http_peers.DEFAULT_VLLM_VENV}), prefix "
                        "caching on and off")
    p.add_argument("--hf-dir", default=http_peers.DEFAULT_HF_DIR,
                   help="the safetensors directory vLLM loads (written once from the GGUF)")
    p.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--data", default=DATA)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from turbospec.model.loader import default_model_path
    gguf = default_model_path()
    if args.vllm:
        args.hf_dir = http_peers.ensure_hf_dir(gguf, args.hf_dir)
    questions = []
    with open(args.data) as f:
        for line in f:
            questions.append(json.loads(line)["turns"][0][:400])
            if len(questions) == args.chats:
                break
    results, servers = {}, {}
    running: tuple[str, http_peers.Server] | None = None
    try:
        for name, key, extra in setups(args, gguf):
            if running is None or running[0] != key:
                if running is not None:
                    running[1].stop()
                port = free_port()
                spec = server_spec(key, args, gguf, port)
                servers[key] = spec.describe()
                running = (key, http_peers.Server(spec, port).__enter__())
            srv = running[1]
            chat_turn(srv.base, srv.model, [{"role": "user", "content": "warm up"}], 4, extra)
            print(f"[multiturn] {name}", flush=True)
            results[name] = run_chats(srv.base, srv.model, questions, args.turns, args.max_tokens, extra)
            print(f"  TTFT median by turn (ms): {results[name]['ttft_ms_median_by_turn']}; "
                  f"answer (ms): {results[name]['answer_ms_median_by_turn']}", flush=True)
    finally:
        if running is not None:
            running[1].stop()
    info = http_peers.machine_info()
    out = {"date": info["date"], "machine": info["machine"], "avx512f": info["avx512f"], "commit": info["commit"],
           "command": info["command"], "gguf": gguf, "threads": args.threads, "chats": args.chats,
           "turns": args.turns, "max_tokens": args.max_tokens, "servers": servers, "results": results}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
