"""``reference.logits_to_probs`` (temperature, top-k, top-p) is the oracle of the verify kernels' tests,
the statistical tests and the auditor, so it is itself checked: against hand-computed
distributions, and against an independent implementation, transformers' logits processors in
``generate``'s order (temperature, top-k, top-p)."""
from __future__ import annotations

import math

import pytest
import torch

from turbospec.ops.reference import logits_to_probs


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


@pytest.mark.parametrize("logits, temperature, top_k, top_p, want", [
    ([2.0, 1.0, 0.0, -1.0], 1.0, 0, 1.0, _softmax([2, 1, 0, -1])),
    ([1.0, 0.0], 0.5, 0, 1.0, _softmax([2, 0])),                          # temperature divides
    ([2.0, 1.0, 0.0, -1.0], 1.0, 2, 1.0, _softmax([2, 1]) + [0, 0]),      # top-k keeps the 2 largest
    # softmax [.6439, .2369, .0871, .0321]: mass before token 1 is .6439 < .7, before token 2 .8808
    ([2.0, 1.0, 0.0, -1.0], 1.0, 0, 0.7, _softmax([2, 1]) + [0, 0]),
    ([2.0, 1.0, 0.0, -1.0], 1.0, 0, 0.6, [1.0, 0, 0, 0]),                 # .6439 >= .6: one token
    ([1.0, 1.0, 0.0], 1.0, 1, 1.0, [0.5, 0.5, 0.0]),                       # ties at the k-th: kept together
    ([1.0, 1.0, 0.0], 1.0, 0, 0.4, [0.5, 0.5, 0.0]),                       # ties at the top-p cut: together
    ([3.0, 0.0, 0.0, -2.0], 2.0, 3, 0.8, _softmax([1.5, 0.0, 0.0]) + [0]),  # all three, in order
])
def test_hand_computed(logits, temperature, top_k, top_p, want):
    got = logits_to_probs(torch.tensor([logits]), temperature, top_k, top_p)[0]
    assert got.tolist() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
@pytest.mark.parametrize("top_k", [0, 1, 5, 50])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.8, 0.3])
def test_matches_transformers_processors(temperature, top_k, top_p):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    g = torch.Generator().manual_seed(int(temperature * 100) + top_k * 7 + int(top_p * 1000))
    logits = torch.randn(16, 300, generator=g) * 3.0  # continuous: no ties
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    ref = torch.softmax(procs(torch.zeros(16, 1, dtype=torch.long), logits.clone()), dim=-1)
    got = logits_to_probs(logits, temperature, top_k, top_p)
    assert torch.equal(got > 0, ref > 0)  # the same tokens kept
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-5)
