"""bench/bench_cpu.py: the parsers of llama.cpp's output and the turbospec measurements, on a tiny
model (the llama.cpp runs themselves need the peer built, never in CI)."""
import importlib.util
import json
import os

import pytest

from helpers import make_tiny_model


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("bench_cpu", os.path.join(ROOT, "bench", "bench_cpu.py"))
bench_cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_cpu)


def test_parse_llama_bench_json():
    rows = [{"n_prompt": 0, "n_gen": 96, "avg_ts": 113.8}, {"n_prompt": 8, "n_gen": 0, "avg_ts": 250.5}]
    assert bench_cpu.parse_llama_bench(json.dumps(rows)) == {("tg", 96): 113.8, ("pp", 8): 250.5}


def test_llama_plain_at_depths_sums_seconds_per_prompt(tmp_path):
    """One llama-bench run over the prompts' lengths (-d); tokens / seconds over the prompts, each
    prompt weighted by its own decode time (a repeated length counts twice)."""
    rows = [{"n_prompt": 0, "n_gen": 10, "n_depth": 100, "avg_ts": 100.0},
            {"n_prompt": 0, "n_gen": 10, "n_depth": 500, "avg_ts": 50.0}]
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\ncat <<'EOF'\n" + json.dumps(rows) + "\nEOF\n")
    fake.chmod(0o755)
    got = bench_cpu.llama_plain_at_depths(str(tmp_path), "m.gguf", [100, 500, 100], 10, 2)
    assert got["tok_s"] == pytest.approx(30 / (0.1 + 0.2 + 0.1)) and got["tokens"] == 30 and got["depths"] == 2
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-d") + 1] == "100,500,100" and args[args.index("-n") + 1] == "10"


def test_llama_bench_command_and_alternated_rounds(tmp_path):
    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 200.0}]
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\ncat <<'EOF'\n" + json.dumps(rows) + "\nEOF\n")
    fake.chmod(0o755)
    assert bench_cpu.llama_bench(str(tmp_path), "m.gguf", 2, 1, "512", 0) == {("pp", 512): 200.0}
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-p") + 1] == "512" and args[args.index("-n") + 1] == "0" and args[args.index("-t") + 1] == "2"
    ts, lc = iter([10.0, 30.0, 20.0]), iter([10.0, 10.0, 40.0])
    row = bench_cpu.alternated(3, lambda: next(ts), lambda: next(lc))
    assert row["turbospec"] == 20.0 and row["llama.cpp"] == 10.0 and row["ratio"] == 1.0  # median of 1, 3, 0.5
    assert row["rounds"] == {"turbospec": [10.0, 30.0, 20.0], "llama.cpp": [10.0, 10.0, 40.0]}
    alone = bench_cpu.alternated(2, lambda: 5.0, None)
    assert alone == {"turbospec": 5.0, "rounds": {"turbospec": [5.0, 5.0], "llama.cpp": []}}


def test_a_crashed_llama_cpp_tool_is_recorded_and_the_run_goes_on(tmp_path):
    """llama.cpp's AMX build died of SIGSEGV / SIGILL in its prompt processing on an Intel AMX machine
    (2026-12-02): the tool's failure names the tool and the signal, the alternated row keeps
    turbospec's rounds, a speculation-table row is left out, and the report lists the failures."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'ggml: about to crash' >&2\nkill -SEGV $$\n")
    fake.chmod(0o755)
    with pytest.raises(bench_cpu.PeerFailed, match=r"llama-bench .*failed: signal SIGSEGV ggml: about to crash"):
        bench_cpu.llama_bench(str(tmp_path), "m.gguf", 2, 1, "512", 0)
    errors, calls = [], []

    def llama():
        calls.append(1)
        return bench_cpu.llama_bench(str(tmp_path), "m.gguf", 2, 1, "512", 0)[("pp", 512)]
    row = bench_cpu.alternated(3, lambda: 7.0, llama, errors)
    assert row == {"turbospec": 7.0, "rounds": {"turbospec": [7.0, 7.0, 7.0], "llama.cpp": []}}
    assert len(calls) == 1 and len(errors) == 1 and "SIGSEGV" in errors[0]  # not run again after it failed
    out = {}
    bench_cpu.peer_row(out, "llama_plain", errors, lambda: bench_cpu.llama_plain_at_depths(str(tmp_path), "m.gguf",
                                                                                           [10], 4, 2))
    assert out == {} and len(errors) == 2
    fake.write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(bench_cpu.PeerFailed, match="exit status 3"):
        bench_cpu.llama_bench(str(tmp_path), "m.gguf", 2, 1, "0", 16)
    res = {"plain": {"q": {"turbospec": 7.0}}, "curve": {}, "prefill": {}, "spec": {}, "pair": {}, "peer_errors": errors}
    md = bench_cpu.markdown({"cpu": "x", "threads": 2, "date": "d", "kernels": {}}, res)
    assert "| q | 7.0 | - | - |" in md and md.count("SIGSEGV") == 2 and "llama.cpp failures" in md


def test_llama_decode_reads_the_log_on_stderr(tmp_path):
    fake = tmp_path / "llama-lookup"
    fake.write_text("#!/bin/sh\necho 'I decoded   36 tokens in    1.500 seconds, speed:   24.000 t/s' >&2\n"
                    "echo 'I n_drafted    = 32' >&2\necho 'I n_accept     = 4' >&2\n")
    fake.chmod(0o755)
    got = bench_cpu.llama_decode([str(fake), "-m", "m.gguf"], ["a", "b"])
    assert got == {"tok_s": 72 / 3.0, "tokens": 72, "accept": 8 / 64}


def test_parse_llama_lookup_log():
    log = ("0.02.315.695 I encoded   18 tokens in    0.307 seconds, speed:  175.874 t/s\n"
           "0.02.315.696 I decoded   36 tokens in    1.541 seconds, speed:   23.367 t/s\n"
           "0.02.315.698 I n_drafted    = 32\n0.02.315.701 I n_accept     = 4\n")
    assert bench_cpu.parse_llama_lookup(log) == {"decoded": 36, "seconds": 1.541, "tok_s": 23.367,
                                                 "n_drafted": 32, "n_accept": 4}
    with pytest.raises(ValueError, match="no 'decoded N tokens"):
        bench_cpu.parse_llama_lookup("error: model not found")


def test_turbospec_measurements_on_a_tiny_model():
    from turbospec.model import loader
    model = loader.load_model(make_tiny_model("llama"), weights="q8_0")
    assert bench_cpu.ts_decode_tps(model, 4) > 0
    curve = bench_cpu.ts_verify_curve(model, context=16, reps=1)
    assert set(curve) == {"turbospec", "turbospec, lazy LM head"}  # q8_0: a quantized LM head
    for c in curve.values():
        assert sorted(c) == list(bench_cpu.VERIFY_TOKENS) and all(v > 0 for v in c.values())
    assert bench_cpu.ts_prefill_tps(model, 20) > 0
    md = bench_cpu.markdown({"cpu": "x", "threads": 1, "date": "d", "kernels": {"cpu_isa": "avx2"}},
                            {"plain": {"q": {"turbospec": 50.0, "llama.cpp": 100.0, "ratio": 0.5}},
                             "curve": {"q": curve}, "spec": {},
                             "prefill": {"q": {"turbospec": 300.0, "llama.cpp": 200.0, "ratio": 1.5, "tokens": 512}}})
    assert "| q | 50.0 | 100.0 | 0.50x |" in md and "N=64" in md and "| q | turbospec, lazy LM head | 1.00 |" in md
    assert "| q | 512 | 300.0 | 200.0 | 1.50x |" in md
    dense = loader.load_model(make_tiny_model("llama"))
    assert set(bench_cpu.ts_verify_curve(dense, context=16, reps=1)) == {"turbospec"}


def test_target_draft_systems_on_tiny_models():
    """The pair section's turbospec rows: a draft model at fixed lengths and adaptive, each output
    compared with plain greedy (the draft is the target itself, so every draft token is accepted)."""
    from turbospec.model import loader
    target = loader.load_model(make_tiny_model("llama", seed=1), weights="q8_0")
    draft = loader.load_model(make_tiny_model("llama", seed=1), weights="q8_0")  # the same model
    args = bench_cpu.argparse.Namespace(max_new_tokens=12)
    encoded = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 1, 4, 1, 5, 9, 2, 6]]
    systems = {"ts_plain": dict(drafter="none"),
               "ts_draft_k3": dict(drafter="draft_model", draft_model=draft, num_draft=3, adaptive=False),
               "ts_draft_adaptive": dict(drafter="draft_model", draft_model=draft, num_draft=3)}
    out = bench_cpu.ts_systems(target, None, encoded, systems, args)
    assert set(out) == set(systems)
    assert all(r["equal_to_plain"] is True and r["tokens"] == 24 and r["tok_s"] > 0 for r in out.values())
    assert out["ts_plain"]["tau"] == 1.0 and out["ts_draft_k3"]["tau"] > 3.0
    md = bench_cpu.markdown({"cpu": "x", "threads": 1, "date": "d", "kernels": {"cpu_isa": "avx2"}},
                            {"plain": {}, "curve": {}, "spec": {}, "pair": out})
    assert "Target + draft model" in md and "| ts_plain |" in md and "| 1.00x |" in md
