"""bench/bench_cpu.py: the parsers of llama.cpp's output and the turbospec measurements, on a tiny
model (the llama.cpp runs themselves need the peer built, never in CI)."""
import importlib.util
import json
import os

import pytest
import torch

from conftest import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("bench_cpu", os.path.join(ROOT, "bench", "bench_cpu.py"))
bench_cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_cpu)


def test_parse_llama_bench_json():
    rows = [{"n_prompt": 0, "n_gen": 96, "avg_ts": 113.8}, {"n_prompt": 8, "n_gen": 0, "avg_ts": 250.5}]
    assert bench_cpu.parse_llama_bench(json.dumps(rows)) == {("tg", 96): 113.8, ("pp", 8): 250.5}


def test_parse_llama_lookup_log():
    log = ("0.02.315.695 I encoded   18 tokens in    0.307 seconds, speed:  175.874 t/s\n"
           "0.02.315.696 I decoded   36 tokens in    1.541 seconds, speed:   23.367 t/s\n"
           "0.02.315.698 I n_drafted    = 32\n0.02.315.701 I n_accept     = 4\n")
    assert bench_cpu.parse_llama_lookup(log) == {"decoded": 36, "seconds": 1.541, "tok_s": 23.367,
                                                 "n_drafted": 32, "n_accept": 4}
    with pytest.raises(ValueError, match="no 'decoded N tokens"):
        bench_cpu.parse_llama_lookup("error: model not found")


def test_turbospec_measurements_on_a_tiny_model():
    from turbospec import loader
    model = loader.load_model(make_tiny_model("llama"), weights="q8_0")
    assert bench_cpu.ts_decode_tps(model, 4) > 0
    curve = bench_cpu.ts_verify_curve(model, context=16, reps=1)
    assert sorted(curve) == list(bench_cpu.VERIFY_TOKENS) and all(v > 0 for v in curve.values())
    md = bench_cpu.markdown({"cpu": "x", "threads": 1, "date": "d", "kernels": {"cpu_isa": "avx2"}},
                            {"plain": {"q": {"turbospec": 50.0, "llama.cpp": 100.0}},
                             "curve": {"q": {"turbospec": curve}}, "spec": {}})
    assert "| q | 50.0 | 100.0 | 0.50x |" in md and "N=64" in md
