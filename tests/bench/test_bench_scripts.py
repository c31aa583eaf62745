"""Smoke tests of the GPU benchmark and profiling scripts, on CPU.

* ``bench/bench_gpu.py --device cpu --tiny`` runs every section's code (bandwidth, random-model
  builders, step times through ``engine.runner``, end-to-end turbospec vs HF ``generate``, the
  report) on a tiny config; the report must hold every section with finite numbers.
* ``bench/profile_nsys.sh`` / ``bench/profile_ncu.sh``: bash syntax, a clear message and a non-zero
  exit without nsys / ncu, and their command lines checked against stub nsys / ncu executables
  (nothing here has a GPU or the Nsight tools).
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_GPU = os.path.join(ROOT, "bench", "bench_gpu.py")
NSYS_SH = os.path.join(ROOT, "bench", "profile_nsys.sh")
NCU_SH = os.path.join(ROOT, "bench", "profile_ncu.sh")
BASH = shutil.which("bash") or "/bin/bash"
TINY_TIMEOUT_S = 180  # the run takes ~10 s alone; the machine is shared


def _load_bench(name: str):
    """A bench/ script imported as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench_gpu = _load_bench("bench_gpu")


def missing_engine_api() -> list[str]:
    """The pieces of the GPU engine API bench_gpu.py relies on that this checkout lacks."""
    import turbospec
    missing = []
    params = inspect.signature(turbospec.Engine.__init__).parameters
    missing += [f"Engine({p}=)" for p in ("device", "cuda_graphs") if p not in params]
    if not importlib.util.find_spec("turbospec.ops.nvtx"):
        missing.append("turbospec.ops.nvtx")
    if not missing:
        model = bench_gpu.build_random_llama(bench_gpu.tiny_config(False), "cpu", torch.float32)
        engine = turbospec.Engine(model, drafter="none", device="cpu", max_seq_len=32)
        if not callable(getattr(getattr(engine, "runner", None), "forward", None)):
            missing.append("engine.runner.forward")
    return missing


def run_bench(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, str, dict, float]:
    out = tmp_path / "report.md"
    cmd = [sys.executable, BENCH_GPU, "--device", "cpu", "--tiny", "--out", str(out), *extra]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TINY_TIMEOUT_S)
    elapsed = time.perf_counter() - t
    assert proc.returncode == 0, f"bench_gpu.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out) as f:
        md = f.read()
    with open(tmp_path / "report.json") as f:
        data = json.load(f)
    return proc, md, data, elapsed


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One full tiny CPU run (all sections, both model stand-ins, a τ projection), in float32: there
    turbospec's output must equal HF's token for token."""
    return run_bench(tmp_path_factory.mktemp("bench_gpu"), "--tau", "cpu_test=1.5@4", "--dtype", "float32")


def _floats(obj):
    if isinstance(obj, float):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _floats(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _floats(v)


# ---------------------------------------------------------------------------------------------
def test_tiny_run_report_has_every_section(tiny_run):
    proc, md, data, elapsed = tiny_run
    for heading in ("## Copy bandwidth", "## Models and the weight-read floor",
                    "## Step times — llama3_8b", "## Step times — smollm2_135m", "## End to end — llama3_8b",
                    "## End to end — smollm2_135m", "Projected speculative tok/s for smollm2_135m", "## Targets"):
        assert heading in md, f"report lacks {heading!r}"
    assert md in proc.stdout  # printed as well as written
    assert set(data) >= {"env", "bandwidth", "models", "targets"}
    assert data["env"]["tiny"] is True and data["env"]["torch"] == torch.__version__
    print(f"tiny run: {elapsed:.1f} s")


def test_tiny_run_numbers_are_finite(tiny_run):
    _, _, data, _ = tiny_run
    values = list(_floats(data))
    assert values and all(math.isfinite(v) for v in values)
    bw = data["bandwidth"]
    assert bw["copy_gb_s"] > 0 and bw["read_gb_s"] == bw["copy_gb_s"] and bw["sum_read_gb_s"] > 0
    for name in bench_gpu.MODELS:
        s = data["models"][name]["summary"]
        assert s["linear_weight_bytes"] > 0 and s["floor_s"] > 0
        assert s["floor_s"] == pytest.approx(s["linear_weight_bytes"] / (bw["read_gb_s"] * 1e9))


def test_tiny_run_step_times(tiny_run):
    assert not missing_engine_api()
    _, _, data, _ = tiny_run
    for name in bench_gpu.MODELS:
        steps = data["models"][name]["steps"]
        assert steps["cache_lens"] == [16, 64] and steps["tokens"] == [1, 2, 4, 8]
        (run,) = steps["runs"].values()  # CPU: one run, graphs off
        assert run["status"] == "ok" and run["graphs"] is False
        keys = {(r["cache_len"], r["n"], r["kind"]) for r in run["rows"]}
        want = {(c, n, k) for c in (16, 64) for n in (1, 2, 4, 8) for k in ("chain", "tree") if n > 1 or k == "chain"}
        assert keys == want
        for r in run["rows"]:
            assert r["median_s"] > 0 and r["finite"]
            assert (r["n"] == 1) == ("floor_pct" in r)
            if r["n"] == 1:
                assert r["ratio"] == 1.0
    (proj,) = data["models"]["smollm2_135m"]["projection"]
    assert proj["status"] == "ok" and proj["verify_n"] == 4
    assert proj["projected_tok_s"] == pytest.approx(1.5 / proj["verify_s"])


def test_tiny_run_end_to_end(tiny_run):
    _, md, data, _ = tiny_run
    assert not missing_engine_api()
    for name in bench_gpu.MODELS:
        e2e = data["models"][name]["e2e"]
        systems = e2e["systems"]
        assert list(systems)[0] == "hf_plain"
        assert systems["hf_static_compile"]["status"].startswith("skipped")
        for sys_name in ("hf_plain", "hf_static", "ts_graphs", "ts_eager"):
            r = systems[sys_name]
            assert r["status"] == "ok", (name, sys_name, r["status"])
            assert r["new_tokens"] == e2e["max_new_tokens"] == 24
            assert r["tok_s"] > 0 and r["speedup_vs_hf_plain"] > 0
            # CPU, float32: every system's greedy output is HF plain's, token for token
            assert r["match_hf_plain"] == 1.0, (name, sys_name, r["match_hf_plain"])
            assert "token_ids" not in r  # counts in the JSON, not the tokens
        assert systems["ts_eager"]["tau"] == 1.0 and systems["ts_eager"]["graphs"] is False


def test_tiny_static_shapes_path(tmp_path):
    """The fixed-bucket path CUDA graphs capture, run eagerly on CPU (Engine(static_shapes=True))."""
    assert not missing_engine_api()
    _, md, data, _ = run_bench(tmp_path, "--static-shapes", "on", "--sections", "steps,e2e", "--models",
                               "smollm2_135m", "--systems", "hf_plain,ts_eager")
    m = data["models"]["smollm2_135m"]
    (run,) = m["steps"]["runs"].values()
    assert run["status"] == "ok" and all(r["finite"] for r in run["rows"])
    assert m["e2e"]["systems"]["ts_eager"]["status"] == "ok"


# ---------------------------------------------------------------------------------------------
def test_linear_weight_bytes_counts_lm_head_once():
    for tie in (False, True):
        model = bench_gpu.build_random_llama(bench_gpu.tiny_config(tie), "cpu", torch.bfloat16)
        c = model.config
        hd = c.hidden_size // c.num_attention_heads
        per_layer = c.hidden_size * (c.num_attention_heads * hd * 2 + 2 * c.num_key_value_heads * hd) \
            + 3 * c.hidden_size * c.intermediate_size
        want = 2 * (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size)  # bf16; lm_head once
        assert bench_gpu.linear_weight_bytes(model) == want
        for name, p in model.named_parameters():
            assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()
            if p.dim() == 1:
                assert (p == 1).all(), name


def test_model_configs_have_the_published_shapes():
    big = bench_gpu.llama3_8b_config()
    assert (big.hidden_size, big.intermediate_size, big.num_hidden_layers, big.num_attention_heads,
            big.num_key_value_heads, big.vocab_size, big.max_position_embeddings,
            big.tie_word_embeddings) == (4096, 14336, 32, 32, 8, 128256, 8192, False)
    small = bench_gpu.smollm2_135m_config()
    assert (small.hidden_size, small.intermediate_size, small.num_hidden_layers, small.num_attention_heads,
            small.num_key_value_heads, small.vocab_size, small.max_position_embeddings,
            small.tie_word_embeddings) == (576, 1536, 30, 9, 3, 49152, 8192, True)
    from turbospec.model.transformer import ModelConfig
    assert ModelConfig.from_hf(big).rope_theta == 500000.0
    assert ModelConfig.from_hf(small).rope_theta == 100000.0
    assert big.eos_token_id is None and small.eos_token_id is None  # random models never stop early


def test_helpers():
    assert bench_gpu.common_prefix_fraction([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert bench_gpu.common_prefix_fraction([1, 2], [1, 2]) == 1.0
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 17, 64):
        parents = bench_gpu.random_parents(n, gen)
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    assert bench_gpu._parse_tau("ts_ngram=1.51@9") == ("ts_ngram", 1.51, 9)
    with pytest.raises(ValueError, match="LABEL=TAU@NODES"):
        bench_gpu._parse_tau("1.51")
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--device", "cpu", "--tokens", "2,4"])  # the 1-token step is the baseline


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [NSYS_SH, NCU_SH])
def test_profile_script_syntax_and_help(script):
    subprocess.run([BASH, "-n", script], check=True)
    proc = subprocess.run([BASH, script, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:")
    proc = subprocess.run([BASH, script, "--no-such-option"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown argument" in proc.stderr


@pytest.mark.parametrize("script,tool", [(NSYS_SH, "nsys"), (NCU_SH, "ncu")])
def test_profile_script_without_the_tool(tmp_path, script, tool):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}  # an empty directory: no nsys, no ncu
    proc = subprocess.run([BASH, script], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode != 0
    assert f"'{tool}'" in proc.stderr and "not found" in proc.stderr
    assert "Nothing was profiled" in proc.stderr


def _stub(path, body: str) -> None:
    path.write_text("#!" + BASH + "\n" + textwrap.dedent(body))
    path.chmod(0o755)


def _value_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_profile_nsys_command_lines(tmp_path):
    """With a stub nsys: one profile per system with the right tracing options, a bench_gpu.py
    command line that bench_gpu accepts, and the stats reports for each."""
    bindir, out = tmp_path / "bin", tmp_path / "out"
    bindir.mkdir()
    log = tmp_path / "nsys.log"
    _stub(bindir / "nsys", """\
        printf '%s\\n' "$*" >> "$STUB_LOG"
        prev=""; out=""; rep=""
        for a in "$@"; do
          [ "$prev" = --output ] && out="$a"; [ "$prev" = --report ] && rep="$a"; prev="$a"
        done
        case "$1" in
          profile) touch "$out.nsys-rep" ;;
          stats) if [ -n "$out" ]; then printf 'Range,Total\\n:verify,1\\n:accept,1\\n' > "${out}_${rep}.csv"; fi ;;
        esac
        """)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "STUB_LOG": str(log),
           "PYTHON": sys.executable}
    proc = subprocess.run([BASH, NSYS_SH, "--out-dir", str(out), "--max-new-tokens", "8"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    profiles = [c for c in calls if c[0] == "profile"]
    assert [_value_after(c, "--systems") for c in profiles] == ["ts_graphs", "ts_eagle"]
    for c in profiles:
        assert {"--trace=cuda,nvtx,osrt", "--cuda-graph-trace=node", "--capture-range=cudaProfilerApi"} <= set(c)
        argv = c[c.index(BENCH_GPU.replace(ROOT + os.sep, "")) + 1:]
        assert "--cuda-profiler-range" in argv and _value_after(argv, "--device") == "cuda"
        argv = [a for a in argv if a != "--cuda-profiler-range"]
        argv[argv.index("--device") + 1] = "cpu"
        args = bench_gpu.parse_args(argv)  # bench_gpu accepts what the script passes
        assert args.sections == ["e2e"] and args.models == ["smollm2_135m"] and args.max_new_tokens == 8
    reports = {_value_after(c, "--report") for c in calls if c[0] == "stats" and "csv" in c}
    assert {"nvtx_sum", "cuda_gpu_kern_sum", "nvtx_gpu_proj_sum"} <= reports
    assert "engine NVTX ranges found: verify accept; missing: draft compact" in proc.stdout


def test_profile_ncu_command_lines(tmp_path):
    """With a stub ncu (and a stub python that passes the kernel check): the kernel filter, the
    bench_ops.py command line, and the CSV exports."""
    bindir, out = tmp_path / "bin", tmp_path / "out"
    bindir.mkdir()
    log = tmp_path / "ncu.log"
    _stub(bindir / "ncu", """\
        printf '%s\\n' "$*" >> "$STUB_LOG"
        prev=""
        for a in "$@"; do [ "$prev" = --export ] && touch "$a.ncu-rep"; prev="$a"; done
        [ "$1" = --import ] && echo '"Kernel Name","Metric"'
        exit 0
        """)
    _stub(bindir / "fakepython", 'cat > /dev/null; printf "%s\\n" "$*" >> "$STUB_LOG"; exit 0\n')
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "STUB_LOG": str(log),
           "PYTHON": str(bindir / "fakepython")}
    proc = subprocess.run([BASH, NCU_SH, "--out-dir", str(out), "--launch-count", "7"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    (profile,) = [c for c in calls if "--export" in c]
    assert _value_after(profile, "--kernel-name") == "regex:verify|build_tree|compact_kv|tree_attention"
    assert _value_after(profile, "--launch-count") == "7" and _value_after(profile, "--set") == "full"
    assert profile[-5:] == ["bench/bench_ops.py", "--device", "cuda", "--iters", "1"]
    for name in ("ncu_ops.ncu-rep", "ncu_ops_details.csv", "ncu_ops_summary.csv", "ncu_ops_key_metrics.csv"):
        assert (out / name).exists(), name


def test_profile_ncu_refuses_without_cuda_kernels(tmp_path):
    """The real python here has no GPU: the script must say so instead of profiling nothing."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _stub(bindir / "ncu", "exit 0\n")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    proc = subprocess.run([BASH, NCU_SH, "--out-dir", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA device" in proc.stderr or "CUDA kernels are not built" in proc.stderr


# ---------------------------------------------------------------------------------------------
def _is_script(name: str) -> bool:  # (bench/workloads.py is a module the scripts import)
    with open(os.path.join(ROOT, "bench", name)) as f:
        return '__name__ == "__main__"' in f.read()


BENCH_PY = sorted(f for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py") and _is_script(f))


@pytest.mark.parametrize("script", BENCH_PY)
def test_bench_script_help(script):
    """``--help`` prints usage for every bench script (argparse help strings are %-formatted: a bare
    ``%`` in one crashed bench_exact.py's --help)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:200]


def test_bench_peak_tiny(tmp_path):
    """bench_peak.py on one small shape: finite, positive GFLOPS for every column; the instruction
    rates where the CPU has AVX2 (compiled with g++ here), AVX-512's where it has that."""
    out = tmp_path / "peak.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_peak.py"), "--threads", "1",
                           "--rows", "4", "--shapes", "64x64", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    (row,) = res["linear"]
    assert row["shape"] == "64x64" and row["rows"] == 4
    for col in ("torch_fp32", "torch_bf16", "turbospec_fp32", "turbospec_bf16", "turbospec_int8_q4_0"):
        assert row[col] > 0 and row[col] < 1e6, (col, row[col])
    if "skipped" not in res["rates"]:
        for k in ("fma_ymm", "maddubs_ymm", "maddubs_add_ymm") + (("fma_zmm",) if "fma_zmm_ns" in res["rates"] else ()):
            assert res["rates"][f"{k}_ns"] > 0 and res["rates"][f"{k}_peak_gops"] > 0, k


def test_check_vllm_head_counts_and_refusals(tmp_path):
    """check_vllm_head.py: vLLM's spec-decode counters -> τ and acceptance by position (the per-position
    vector may be longer than the chain; a run without drafts is an error, not τ 1); a venv without
    Python is refused before anything loads."""
    m = _load_bench("check_vllm_head")
    acc = m.vllm_acceptance({"vllm:spec_decode_num_drafts": 10.0, "vllm:spec_decode_num_draft_tokens": 30.0,
                             "vllm:spec_decode_num_accepted_tokens": 7.0,
                             "vllm:spec_decode_num_accepted_tokens_per_pos": [5.0, 2.0, 0.0, 0.0]}, 3)
    assert acc["tau"] == pytest.approx(1.7) and acc["drafts"] == 10 and acc["draft_tokens"] == 30
    assert acc["accept_per_position"] == pytest.approx([0.5, 0.2, 0.0])
    with pytest.raises(SystemExit, match="no drafts"):
        m.vllm_acceptance({"vllm:spec_decode_num_drafts": 0.0}, 3)
    with pytest.raises(SystemExit, match="has no bin/python"):
        m.main(["--vllm-venv", str(tmp_path)])
    with pytest.raises(SystemExit, match="--num-spec must be >= 1"):
        m.main(["--num-spec", "0", "--vllm-venv", str(tmp_path)])


def test_bench_tau_refuses_budgets_the_tree_cannot_hold():
    """--nodes past the tree's 63 drafts (64 rows with the root) is refused before any model loads,
    not after the smaller budgets have run."""
    m = _load_bench("bench_tau")
    for bad in ("8,64", "0", ""):
        with pytest.raises(SystemExit, match=r"--nodes .*\[1, 63\]"):
            m.main(["--nodes", bad, "--out", os.devnull])


def test_bench_draft_cost_head_option_refuses_bad_folders(tmp_path):
    """bench_draft_cost.py --head NAME=DIR names the option and the value before loading anything."""
    m = _load_bench("bench_draft_cost")
    for bad in ("nohead", "x=" + str(tmp_path), "=" + str(tmp_path)):
        with pytest.raises(SystemExit, match="--head .*expected NAME=DIR"):
            m.main(["--head", bad, "--out", os.devnull])
