"""Multi-turn chat benchmark: prefix caching, turbospec serve against llama-server, same GGUF.

Each chat resends its whole conversation every turn (a system prompt, then user / assistant turns,
the assistant's answers being the server's own), as chat clients do. Per server and cache setting it
records, per turn, the time to first token (TTFT) and the time to the whole answer, streamed over
HTTP with the OpenAI chat API, greedy, ``--max-tokens`` per answer; chats run one after another
(``--concurrency`` at a time). Servers, each started here on the same GGUF and thread count:

* turbospec serve, prefix cache on (default) and off (``--prefix-cache-mb 0``);
* llama-server (``--llama-server PATH``), ``cache_prompt`` true and false per request.

    python bench/bench_multiturn.py --chats 6 --turns 4 --llama-server ~/.cache/turbospec-peers/llama.cpp/build/bin/llama-server \
        --out bench/out/multiturn
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "specbench_dev.jsonl")
SYSTEM = ("You are a helpful, concise assistant. Answer in plain sentences. Keep every answer short, "
          "friendly and to the point, and say so when you do not know something. " * 3)
FOLLOW_UPS = ["Can you say that more simply?", "Give one example.", "What is the most important point?",
              "Summarise our conversation in one sentence.", "Why does that matter?"]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_up(base: str, proc: subprocess.Popen, path: str = "/health") -> None:
    for _ in range(1200):
        try:
            if httpx.get(base + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        time.sleep(0.25)
    raise RuntimeError("the server did not come up")


def chat_turn(base: str, model: str, messages: list, max_tokens: int, extra: dict) -> tuple[str, float, float]:
    """One streamed answer: (text, TTFT s, total s)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    t0 = time.perf_counter()
    ttft, text = None, ""
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
    return text, (ttft if ttft is not None else time.perf_counter() - t0), time.perf_counter() - t0


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--drafter", default="auto")
    p.add_argument("--llama-server", default=None, help="path of llama-server (left out: turbospec only)")
    p.add_argument("--data", default=DATA)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from turbospec.model.loader import default_model_path
    gguf = default_model_path()
    questions = []
    with open(args.data) as f:
        for line in f:
            questions.append(json.loads(line)["turns"][0][:400])
            if len(questions) == args.chats:
                break
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    results = {}
    setups = [("turbospec, prefix cache on", ["--prefix-cache-mb", "512"], {}),
              ("turbospec, prefix cache off", ["--prefix-cache-mb", "0"], {})]
    if args.llama_server:
        setups += [("llama-server, cache_prompt on", None, {"cache_prompt": True}),
                   ("llama-server, cache_prompt off", None, {"cache_prompt": False})]
    procs = {}
    try:
        for name, flags, extra in setups:
            kind = "turbospec" if flags is not None else "llama"
            key = (kind, tuple(flags or ()))
            if key not in procs:
                for proc, _ in procs.values():
                    proc.terminate()
                    proc.wait(30)
                procs.clear()
                port = free_port()
                if kind == "turbospec":
                    cmd = [sys.executable, "-m", "turbospec.cli", "serve", "--model", gguf, "--port", str(port),
                           "--threads", str(args.threads), "--drafter", args.drafter, "--max-batch", "1",
                           "--log-level", "warning", *flags]
                else:
                    cmd = [args.llama_server, "-m", gguf, "--port", str(port), "-t", str(args.threads), "-c", "8192",
                           "-np", "1", "--log-disable"]
                    model = "x"  # llama-server serves its one model whatever the name
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                base = f"http://127.0.0.1:{port}"
                wait_up(base, proc)
                if kind == "turbospec":
                    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
                procs[key] = (proc, (base, model))
            base, model = procs[key][1]
            chat_turn(base, model, [{"role": "user", "content": "warm up"}], 4, extra)
            print(f"[multiturn] {name}", flush=True)
            results[name] = run_chats(base, model, questions, args.turns, args.max_tokens, extra)
            print(f"  TTFT median by turn (ms): {results[name]['ttft_ms_median_by_turn']}; "
                  f"answer (ms): {results[name]['answer_ms_median_by_turn']}", flush=True)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor(),
           "gguf": gguf, "threads": args.threads, "chats": args.chats, "turns": args.turns,
           "max_tokens": args.max_tokens, "results": results}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
