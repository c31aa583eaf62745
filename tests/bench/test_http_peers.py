"""bench/http_peers.py and the HTTP peer modes of bench_serve.py / bench_multiturn.py, without vLLM,
llama-server or a model: SSE parsing, per-chunk token counts, the latency / throughput summary, the
servers' command lines and environments (equal threads everywhere), the ratios and tables, and the
closed-loop clients end to end against a stub OpenAI server started (and stopped) by ``Server``."""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


def _load(name: str):
    """bench/<name>.py as module ``name`` (registered: its dataclasses need it, and bench_serve imports
    http_peers by that name)."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", "") == os.path.join(BENCH, name + ".py"):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


http_peers = _load("http_peers")
bench_serve = _load("bench_serve")
bench_multiturn = _load("bench_multiturn")


def test_sse_parsing():
    ev = http_peers.parse_sse_line('data: {"choices": [{"delta": {"content": "Hi"}}]}')
    assert http_peers.chunk_text(ev) == "Hi"
    assert http_peers.parse_sse_line("data: [DONE]") is None
    assert http_peers.parse_sse_line(": keep-alive") is None and http_peers.parse_sse_line("") is None
    assert http_peers.chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert http_peers.chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""


def test_chunk_token_counts():
    words = lambda text: len(text.split())  # noqa: E731  a stand-in tokenizer: one token per word
    assert http_peers.chunk_token_counts(["a", " b", " c d e", " f"], words) == [1, 1, 3, 1]
    # a chunk that only completes a word still arrived: it counts one
    assert http_peers.chunk_token_counts(["ab", "cd", " e"], words) == [1, 1, 1]
    assert http_peers.chunk_token_counts(["x", "y"]) == [1, 1]


def test_summarise():
    Trace = http_peers.Trace
    # request 1: sent at 0, chunks at 0.1 (1 token), 0.2 (1), 0.5 (3 tokens); usage says 5
    # request 2: sent at 0, chunks at 0.3, 0.4; no usage: 2 counted tokens
    traces = [Trace(0.0, [0.1, 0.2, 0.5], ["a", " b", " c d e"], 5, 0.5, prompt_tokens=10),
              Trace(0.0, [0.3, 0.4], ["x", " y"], None, 0.4, prompt_tokens=20)]
    r = http_peers.summarise(traces, 2.0, lambda t: len(t.split()))
    assert r["tokens"] == 7 and r["requests"] == 2 and r["chunks"] == 5
    assert r["tok_s"] == pytest.approx(3.5) and r["req_s"] == pytest.approx(1.0)
    assert r["ttft_p50"] == pytest.approx(0.1) and r["ttft_p99"] == pytest.approx(0.3)
    # ITL samples: 0.1 (1 token), 0.1 x 3 (0.3 s over 3 tokens), 0.1: all 0.1
    assert r["itl_p50"] == pytest.approx(0.1) and r["itl_p99"] == pytest.approx(0.1)
    # TPOT: (0.5 - 0.1) / 4 = 0.1; (0.4 - 0.3) / 1 = 0.1
    assert r["tpot_p50"] == pytest.approx(0.1)
    assert r["prompt_tokens_mean"] == pytest.approx(15)
    empty = http_peers.summarise([], 1.0)
    assert empty["tokens"] == 0 and math.isnan(empty["ttft_p50"])


def http_args(*extra: str) -> argparse.Namespace:
    return bench_serve.http_defaults(bench_serve.build_parser().parse_args(
        ["--servers", "turbospec", "vllm", "vllm-ngram", "llama-server", "--concurrency", "1", "4", "8", *extra]))


def test_http_args_and_commands(tmp_path):
    args = http_args("--vllm-venv", str(tmp_path), "--llama-server", "/x/llama-server")
    assert args.threads == 2 and args.servers == ["turbospec", "vllm", "vllm-ngram", "llama-server"]
    assert bench_serve.requests_at(args, 1) == 4 and bench_serve.requests_at(args, 8) == 16
    assert bench_serve.requests_at(http_args("--requests", "5"), 8) == 5
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    specs = {n: bench_serve.server_spec(n, args, 1234, "/m/model.gguf") for n in args.servers}

    ts = specs["turbospec"].cmd
    assert ts[ts.index("--threads") + 1] == "2" and ts[ts.index("--max-batch") + 1] == "8"
    assert ts[ts.index("--max-seq-len") + 1] == "2048" and ts[ts.index("--model") + 1] == "/m/model.gguf"

    ll = specs["llama-server"]
    assert ll.cmd[0] == "/x/llama-server" and ll.extra == {"cache_prompt": True}
    assert ll.cmd[ll.cmd.index("-t") + 1] == "2" and ll.cmd[ll.cmd.index("-tb") + 1] == "2"
    assert ll.cmd[ll.cmd.index("-np") + 1] == "8" and ll.cmd[ll.cmd.index("-c") + 1] == str(8 * 2048)

    for name in ("vllm", "vllm-ngram"):
        v = specs[name]
        assert v.cmd[0] == os.path.join(str(tmp_path), "bin", "python")
        assert v.cmd[v.cmd.index("--max-num-seqs") + 1] == "8" and v.cmd[v.cmd.index("--max-model-len") + 1] == "2048"
        assert "--enable-prefix-caching" in v.cmd and "--enforce-eager" in v.cmd
        assert v.cmd[v.cmd.index("--dtype") + 1] == "float32"
        assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and v.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
        assert str(tmp_path / "lib" / "libiomp5.so") in v.env["LD_PRELOAD"].split(":")
    assert "--speculative-config" not in specs["vllm"].cmd
    bf16 = bench_serve.server_spec("vllm-bf16", args, 1, "/m.gguf").cmd
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16" and "--speculative-config" not in bf16
    sc = json.loads(specs["vllm-ngram"].cmd[specs["vllm-ngram"].cmd.index("--speculative-config") + 1])
    assert sc == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

    four = http_args("--threads", "4", "--vllm-venv", str(tmp_path), "--vllm-omp-bind", "auto",
                     "--turbospec-flags", "--weights dense --drafter none")
    assert bench_serve.server_spec("vllm", four, 1, "/m.gguf").env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert http_peers.vllm_env(str(tmp_path), 4)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    ts4 = bench_serve.server_spec("turbospec", four, 1, "/m.gguf").cmd
    assert ts4[-4:] == ["--weights", "dense", "--drafter", "none"] and ts4[ts4.index("--threads") + 1] == "4"
    with pytest.raises(ValueError):
        bench_serve.server_spec("sglang", args, 1, "/m.gguf")


def test_multiturn_setups():
    args = argparse.Namespace(llama_server="/x/llama-server", vllm="/v", hf_dir="/hf", threads=2, drafter="auto",
                              vllm_dtype="float32")
    names = [s[0] for s in bench_multiturn.setups(args, "/m.gguf")]
    assert names == ["turbospec, prefix cache on", "turbospec, prefix cache off", "llama-server, cache_prompt on",
                     "llama-server, cache_prompt off", "vllm, prefix caching on", "vllm, prefix caching off"]
    on = bench_multiturn.server_spec("vllm-cache", args, "/m.gguf", 1).cmd
    off = bench_multiturn.server_spec("vllm-nocache", args, "/m.gguf", 1).cmd
    assert "--enable-prefix-caching" in on and "--no-enable-prefix-caching" in off
    assert on[on.index("--max-num-seqs") + 1] == "1"
    ts = bench_multiturn.server_spec("turbospec-nocache", args, "/m.gguf", 1).cmd
    assert ts[ts.index("--prefix-cache-mb") + 1] == "0" and ts[ts.index("--threads") + 1] == "2"
    plain = argparse.Namespace(**{**vars(args), "llama_server": None, "vllm": None})
    assert len(bench_multiturn.setups(plain, "/m.gguf")) == 2


def test_ratios_and_table():
    results = {"turbospec": {"1": {"tok_s": 100.0}, "4": {"tok_s": 300.0}},
               "vllm": {"1": {"tok_s": 25.0}, "4": {"tok_s": 100.0}},
               "llama-server": {"1": {"tok_s": 50.0}, "error": "RuntimeError: died"},
               "broken": {"error": "RuntimeError: the server exited (1)"}}
    assert bench_serve.ratios(results) == {"vllm": {"1": 4.0, "4": 3.0}, "llama-server": {"1": 2.0}}
    table = bench_serve.http_table(results, [1, 4]).splitlines()
    assert table[0] == "| server | c=1 | c=4 |"
    assert "| turbospec | 100.0 | 300.0 |" in table and "| llama-server | 50.0 | – |" in table
    assert "| broken | – | – |" in table


STUB = textwrap.dedent('''
    """A stub OpenAI chat server: streams "w0 w1 ... w{n-1}" two words per chunk, then usage."""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a):
            pass
        def _json(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health":
                self._json({"status": "ok"})
            elif self.path == "/v1/models":
                self._json({"data": [{"id": "stub"}]})
            else:
                self.send_error(404)
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["model"] == "stub" and body["stream"] and body["temperature"] == 0
            n = body["max_tokens"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            words = [f" w{i}" for i in range(n)]
            for i in range(0, n, 2):
                ev = {"choices": [{"index": 0, "delta": {"content": "".join(words[i:i + 2])}}]}
                self.wfile.write(f"data: {json.dumps(ev)}\\n\\n".encode())
                self.wfile.flush()
                time.sleep(0.002)
            ev = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(ev)}\\n\\ndata: [DONE]\\n\\n".encode())
            self.wfile.flush()

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def test_closed_loop_against_a_stub_server(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    port = http_peers.free_port()
    spec = http_peers.ServerSpec("stub", [sys.executable, str(stub), str(port)])
    with http_peers.Server(spec, port, str(tmp_path / "stub.log"), timeout_s=60) as srv:
        assert srv.model == "stub"
        traces, wall = asyncio.run(http_peers.closed_loop(srv.base, srv.model, ["p0", "p1", "p2"], 2, 5, 6))
        text, ttft, total = http_peers.stream_chat(srv.base, srv.model, [{"role": "user", "content": "hi"}], 4)
        proc = srv.proc
    assert proc.poll() is not None  # stopped on leaving the block
    assert text == " w0 w1 w2 w3" and 0 < ttft <= total
    assert len(traces) == 5 and all(t.completion_tokens == 6 and len(t.pieces) == 3 for t in traces)
    r = http_peers.summarise(traces, wall, lambda t: len(t.split()))
    assert r["tokens"] == 30 and r["requests"] == 5 and r["chunks"] == 15 and r["prompt_tokens_mean"] == 7
    assert r["tok_s"] > 0 and 0 < r["ttft_p50"] <= r["ttft_p99"] and 0 < r["itl_p50"] <= r["itl_p99"]


def test_server_that_exits_is_reported(tmp_path):
    port = http_peers.free_port()
    spec = http_peers.ServerSpec("dies", [sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match="exited"):
        with http_peers.Server(spec, port, timeout_s=30):
            pass


def test_machine_info():
    info = http_peers.machine_info()
    assert set(info) >= {"date", "machine", "cpu_flags", "avx512f", "avx2", "commit", "command"}
    assert isinstance(info["avx512f"], bool) and info["date"].endswith("UTC")


def test_prompts_interleave_categories(tmp_path):
    """The Spec-Bench sample is sorted by category: interleaved, every slice of the prompts (one
    concurrency level's) mixes the categories instead of taking one kind (all the long articles)."""
    serve = _load("bench_serve")
    path = tmp_path / "s.jsonl"
    rows = [{"category": c, "turns": [f"{c}{i}"]} for c in ("a", "b", "c") for i in range(3)] + \
        [{"category": "d", "turns": ["d0"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert serve.load_prompts(str(path), 4) == ["a0", "a1", "a2", "b0"]
    assert serve.load_prompts(str(path), 100, interleave=True) == \
        ["a0", "b0", "c0", "d0", "a1", "b1", "c1", "a2", "b2", "c2"]
