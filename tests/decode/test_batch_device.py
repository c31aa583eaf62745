"""The batched path on each device (issue 12 §3: its CUDA tests): mixed per-row sampling
parameters, ragged drafts (``prompts_mixed``: some prompts repeat themselves, so n-gram lookup drafts
for some rows and not others), requests joining and leaving, on CPU and, where there is one, on CUDA.

On CUDA the dense linears are cuBLAS matmuls whose reduction order may depend on the row count, so
these tests hold greedy float32 rows to transformers' greedy output (the bar of the single-request
CUDA tests) and sampled rows to being valid and of the requested length; on CPU every row also
equals the request decoded alone (tests/decode/test_batch.py holds the full CPU bar)."""
from __future__ import annotations

import pytest
import torch

import turbospec
from turbospec import Engine, Request

from helpers import hf_greedy, make_tiny_model, prompts_mixed

DEVICES = ["cpu", "cuda"]


def need(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", seed=5)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_greedy_fp32_equals_hf_on(device, tiny):
    need(device)
    eng = Engine(tiny, drafter="ngram", device=device, max_seq_len=128, max_batch=4)
    prompts = prompts_mixed(7, seed=6)
    lengths = [12, 5, 20, 9, 16, 3, 11]
    out = eng.generate([Request(p, max_new_tokens=m) for p, m in zip(prompts, lengths)])
    for p, m, g in zip(prompts, lengths, out):
        assert g.token_ids == hf_greedy(tiny, p, m)
        assert g.finish_reason == "length"
        if device == "cpu":
            assert g.token_ids == eng.generate(p, max_new_tokens=m).token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_batch_mixed_sampling_params_on(device, tiny):
    """Greedy, temperature, top-k and top-p rows in one batch: greedy rows equal transformers',
    sampled rows are valid tokens of the requested length, a seed is reproducible within the engine."""
    need(device)
    eng = Engine(tiny, drafter="ngram", device=device, max_seq_len=128, max_batch=4)
    prompts = prompts_mixed(8, seed=7)
    settings = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.2, top_k=20),
                dict(temperature=1.0, top_p=0.7)]
    reqs = [Request(p, max_new_tokens=14, seed=200 + i, **settings[i % 4]) for i, p in enumerate(prompts)]
    out = eng.generate(reqs)
    again = eng.generate(reqs)
    for r, g, h in zip(reqs, out, again):
        assert len(g.token_ids) == 14 and all(0 <= t < 256 for t in g.token_ids)
        if r.temperature == 0.0:
            assert g.token_ids == hf_greedy(tiny, r.prompt, 14)
        if device == "cpu":
            assert g.token_ids == h.token_ids  # same seeds, same batch: same tokens


@pytest.mark.parametrize("device", DEVICES)
def test_batch_join_and_leave_on(device, tiny):
    """Six requests through two slots: each leaves when done and the next one takes its slot."""
    need(device)
    eng = Engine(tiny, drafter="ngram", device=device, max_seq_len=128, max_batch=2)
    prompts = prompts_mixed(6, seed=8)
    lengths = [2, 18, 4, 7, 1, 10]
    out = eng.generate([Request(p, max_new_tokens=m) for p, m in zip(prompts, lengths)])
    assert [len(g.token_ids) for g in out] == lengths
    for p, m, g in zip(prompts, lengths, out):
        assert g.token_ids == hf_greedy(tiny, p, m)


def test_batch_on_cuda_runs_the_fused_static_path(tiny):
    """On CUDA the batch step's target pass is forward_static with the fused layer kernels."""
    need("cuda")
    if not turbospec.ops.kernels_available()["cuda"]:
        pytest.skip("no CUDA kernels built")
    eng = Engine(tiny, drafter="ngram", device="cuda", max_seq_len=64, max_batch=2)
    assert eng.target._fused_static(eng.target.new_cache(8))
