"""Soak run: many concurrent clients against a real ``turbospec serve`` process for minutes.

Each of ``--streams`` clients loops until ``--minutes`` have passed, sending one request at a time,
chosen by its own seeded RNG: chat or completions, streamed or not, greedy or sampled, 8-128 new
tokens, sometimes with penalties / logit_bias / a JSON schema / a regex; some streams are cancelled
after a few chunks (the client closes the connection), some requests are malformed on purpose (an
unknown field, a bad value: the answer must be a 400 naming it). Every request must end: with its
answer, with the intended 400, or cancelled by the client; anything else (a 5xx, a hang past
``--timeout``, a malformed answer, a JSON answer that does not match its schema) counts as an
error of its kind, and "lost" is a request that never answered.

Recorded: requests by outcome, errors by kind, inter-token latency p50 / p99 (streamed answers: the
gaps between chunks that carry text), time to first token, and the server's RSS every minute (with
the RSS at the end of the first minute as the warm-up baseline).

    python bench/bench_soak.py --minutes 10 --streams 16 --out bench/out/soak
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import subprocess
import sys
import time

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/http_peers.py
from http_peers import free_port, wait_up  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["a lighthouse", "the moon", "a recipe for bread", "prime numbers", "a short poem about rain",
          "how a bicycle works", "three colours", "the history of tea", "a haiku", "a friendly email"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "count"], "additionalProperties": False}
BAD = [({"temprature": 0.5}, "temprature"), ({"max_tokens": -3}, "max_tokens"), ({"n": 99}, "n"),
       ({"presence_penalty": 9}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
       ({"response_format": {"type": "xml"}}, "response_format"), ({"tools": [{"type": "function"}]}, "tools")]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Stats:
    def __init__(self):
        self.outcomes: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.itl: list[float] = []
        self.ttft: list[float] = []
        self.tokens = 0

    def count(self, outcome: str, error: str | None = None) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if error is not None:
            self.errors[error] = self.errors.get(error, 0) + 1


def make_request(rng: random.Random) -> tuple[str, dict, dict]:
    """(path, body, what to check): a random request of the mix."""
    chat = rng.random() < 0.6
    topic = rng.choice(TOPICS)
    body: dict = {"model": MODEL, "max_tokens": rng.choice([8, 16, 32, 64, 128]),
                  "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]), "stream": rng.random() < 0.7}
    if body["temperature"]:
        body["seed"] = rng.randrange(1 << 30)
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell me about {topic}."}]
    else:
        body["prompt"] = f"Here is a note about {topic}:"
    check: dict = {"cancel_after": rng.randint(1, 4) if body["stream"] and rng.random() < 0.1 else None}
    r = rng.random()
    if r < 0.08:
        extra, param = rng.choice(BAD)
        body.update(extra)
        check["bad"] = param
    elif r < 0.18:
        body.update(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"28": -5})
    elif r < 0.26 and chat:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
        body["max_tokens"] = 64
        check["schema"] = True
    elif r < 0.30 and not chat:
        body["guided_regex"] = "(yes|no|maybe)"
        check["regex"] = "(yes|no|maybe)"
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, check


async def one(client: httpx.AsyncClient, base: str, rng: random.Random, stats: Stats, timeout: float) -> None:
    path, body, check = make_request(rng)
    chat = "messages" in body
    t0 = time.perf_counter()
    try:
        if not body["stream"]:
            r = await asyncio.wait_for(client.post(base + path, json=body), timeout)
            if check.get("bad"):
                ok = r.status_code == 400 and r.json()["error"].get("param") == check["bad"]
                stats.count("refused as intended" if ok else "error", None if ok else f"bad request got {r.status_code}")
                return
            if r.status_code != 200:
                stats.count("error", f"HTTP {r.status_code}")
                return
            data = r.json()
            text = data["choices"][0]["message"]["content"] if chat else data["choices"][0]["text"]
            stats.tokens += data["usage"]["completion_tokens"]
            stats.count(*_judge(text, data["choices"][0]["finish_reason"], check))
            return
        async with client.stream("POST", base + path, json=body, timeout=timeout) as r:
            if check.get("bad"):
                data = json.loads(await r.aread())
                ok = r.status_code == 400 and data["error"].get("param") == check["bad"]
                stats.count("refused as intended" if ok else "error", None if ok else f"bad request got {r.status_code}")
                return
            if r.status_code != 200:
                stats.count("error", f"HTTP {r.status_code}")
                return
            text, last, chunks, finish = "", None, 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    stats.count("error", "error event in the stream")
                    return
                ch = ev["choices"][0] if ev.get("choices") else None
                piece = None if ch is None else (ch.get("delta", {}).get("content") if chat else ch.get("text"))
                if piece:
                    now = time.perf_counter()
                    if last is None:
                        stats.ttft.append(now - t0)
                    else:
                        stats.itl.append(now - last)
                    last = now
                    text += piece
                    chunks += 1
                if ch is not None and ch.get("finish_reason"):
                    finish = ch["finish_reason"]
                if check.get("cancel_after") and chunks >= check["cancel_after"]:
                    stats.count("cancelled by the client")
                    return  # leaving the block closes the connection mid-stream
            stats.tokens += max(1, chunks)
            stats.count(*_judge(text, finish, check))
    except (asyncio.TimeoutError, httpx.TimeoutException):
        stats.count("lost", "no answer before the timeout")
    except (httpx.HTTPError, ValueError, KeyError) as e:
        stats.count("error", type(e).__name__)


def _judge(text: str, finish: str | None, check: dict) -> tuple[str, str | None]:
    if finish not in ("stop", "length"):
        return "error", f"finish_reason {finish!r}"
    if check.get("schema"):
        import jsonschema
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            if finish != "length":
                return "error", "JSON answer does not match its schema"
    if check.get("regex") and not re.fullmatch(check["regex"], text):
        return "error", "answer does not match its regex"
    return "completed", None


async def soak(base: str, streams: int, seconds: float, timeout: float, server: psutil.Process, log) -> dict:
    stats = Stats()
    rss: list[tuple[float, int]] = []
    end = time.perf_counter() + seconds
    t_start = time.perf_counter()

    async def worker(i: int):
        rng = random.Random(1000 + i)
        async with httpx.AsyncClient(timeout=timeout) as client:
            while time.perf_counter() < end:
                await one(client, base, rng, stats, timeout)

    async def sampler():
        while time.perf_counter() < end:
            await asyncio.sleep(min(60.0, max(0.0, end - time.perf_counter())))
            mem = server.memory_info().rss + sum(c.memory_info().rss for c in server.children(recursive=True))
            rss.append((round(time.perf_counter() - t_start, 1), mem))
            log(f"[{rss[-1][0]:>6.0f} s] RSS {mem / 2**20:.0f} MiB, outcomes {stats.outcomes}, errors {stats.errors}")

    await asyncio.gather(sampler(), *(worker(i) for i in range(streams)))
    return {"outcomes": stats.outcomes, "errors": stats.errors, "requests": sum(stats.outcomes.values()),
            "completion_tokens_approx": stats.tokens,
            "itl_ms": {"p50": _ms(pct(stats.itl, 0.5)), "p99": _ms(pct(stats.itl, 0.99)), "n": len(stats.itl)},
            "ttft_ms": {"p50": _ms(pct(stats.ttft, 0.5)), "p99": _ms(pct(stats.ttft, 0.99)), "n": len(stats.ttft)},
            "rss_mib": [(t, round(m / 2**20)) for t, m in rss]}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--drafter", default="auto")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take before it counts as lost")
    p.add_argument("--out", default=None, help="write <out>.json")
    args = p.parse_args(argv)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "turbospec.cli", "serve", "--port", str(port), "--max-batch", str(args.max_batch),
           "--drafter", args.drafter, "--max-waiting", str(4 * args.streams), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_up(base, proc, timeout_s=300)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}") from None
        print(f"[soak] {args.streams} streams for {args.minutes} min against {' '.join(cmd[2:])}", flush=True)
        result = asyncio.run(soak(base, args.streams, 60 * args.minutes, args.timeout, psutil.Process(proc.pid),
                                  lambda m: print(m, flush=True)))
        alive = httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    rss = [m for _, m in result["rss_mib"]]
    result.update(server_alive_at_end=alive, streams=args.streams, minutes=args.minutes, command=" ".join(cmd[2:]),
                  machine=platform.processor() or platform.machine(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  rss_growth_after_first_minute_mib=(rss[-1] - rss[0]) if len(rss) > 1 else None)
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
    return 0 if alive and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
