"""bench/bench_exact.py run small on the default model: the JSONL rows and the table, sharding,
resuming, the invariance-cost mode, and bad arguments."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "bench_exact.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


def rows(out) -> list[dict]:
    with open(os.path.join(out, "exact.jsonl")) as f:
        return [json.loads(line) for line in f]


def write_data(tmp_path) -> str:
    """A Spec-Bench-shaped file (the shared sample may not be on this machine)."""
    path = tmp_path / "sample.jsonl"
    rows = [("qa", "What is the capital of France? Answer in one sentence."),
            ("translation", "Translate to German: the cat sleeps on the warm windowsill."),
            ("qa", "Name three primary colors.")]
    path.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in rows))
    return str(path)


def test_small_run_shard_and_resume(smollm2_dir, tmp_path):
    out, data = str(tmp_path / "o"), write_data(tmp_path)
    r = run("--configs", "f32", "--systems", "ngram,medusa", "--prompts", "3", "--max-new-tokens", "8",
            "--shard", "1/2", "--data", data, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    got = rows(out)
    assert sorted({x["prompt_index"] for x in got}) == [1]  # shard 1 of 2 over prompts 0..2
    assert sorted(x["system"] for x in got) == ["medusa", "ngram", "plain"]
    assert all(x["equal"] and x["first_difference"] is None and x["compared"] > 0 for x in got)
    table = open(os.path.join(out, "exact.md")).read()
    assert "| f32 | ngram | 1 | 1 / 1 (100.0%)" in table and "| f32 | medusa |" in table
    # resume: shard 0 adds prompts 0 and 2, keeps prompt 1's rows
    r = run("--configs", "f32", "--systems", "ngram,medusa", "--prompts", "3", "--max-new-tokens", "8",
            "--shard", "0/2", "--resume", "--data", data, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted({x["prompt_index"] for x in rows(out)}) == [0, 1, 2]
    assert len(rows(out)) == 9


def test_invariance_cost_mode(smollm2_dir, tmp_path):
    out = str(tmp_path / "c")
    r = run("--cost", "float32", "--cost-rounds", "1", "--cost-tokens", "2", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.load(open(os.path.join(out, "invariance_cost.json")))
    assert row["dtype"] == "float32"
    for key in ("turbospec", "torch", "v_turbospec", "v_torch", "linears_us_r1_turbospec", "linears_us_r8_torch"):
        assert row[key] > 0, key
    assert 0 < row["max_logit_diff"] < 1e-2  # the same model by two kernels: close, not bit-identical


@pytest.mark.parametrize("args,message", [
    (["--configs", "fp8"], "unknown config 'fp8'"),
    (["--systems", "lookahead", "--prompts", "1"], "unknown system 'lookahead'"),
    (["--shard", "2/2"], "--shard: expected I/N"),
    (["--prompts", "0"], "--prompts and --max-new-tokens must be >= 1"),
    (["--data", "/nonexistent/specbench.jsonl"], "--data: no such file"),
])
def test_bad_arguments(args, message, tmp_path):
    r = run(*args, "--out", str(tmp_path))
    assert r.returncode != 0
    assert message in r.stderr
