"""Helpers shared by turbospec's tests (fixtures live in conftest.py).

* ``make_tiny_model``: tiny random Llama / Qwen2 / Mistral ``transformers`` models (vocab 256,
  hidden 64, GQA) whose weights are large enough (``initializer_range=0.3``) that logits are far
  from ties, so greedy decoding is decided identically by turbospec and transformers in fp32;
  ``make_tiny_tokenizer``: a word-level tokenizer over ``w0 .. w255``.
* ``on_every_isa``: run a function once per CPU kernel path this CPU has.
* Draft heads and engines on tiny targets: ``PROMPT``, ``N_NEW``, ``hf_greedy``, ``make_head``, ``engine``.
* Op inputs: ``gen``, ``random_parents``, ``random_paths``, ``make_verify_inputs`` (+ ``SAMPLING``),
  tree-attention ``make_inputs`` / ``assert_close``, ragged verify batches (``ragged_batch``,
  ``assert_row_equals_alone``).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "extension not built": the reference ops are used then
    from turbospec import Engine, ops
    from turbospec.heads.config import HeadConfig
    from turbospec.heads.formats import build_head
    from turbospec.heads.layers import init_weights
    from turbospec.ops import reference


# ---- from conftest.py

TINY_DEFAULTS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                     max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                     eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)



def make_tiny_model(kind: str = "llama", seed: int = 0, randomize_norms: bool = True, **overrides):
    """A tiny random ``transformers`` causal LM (eval mode, fp32).

    kind: "llama", "qwen2" (q/k/v biases), "mistral", "qwen3" (per-head q/k norms, head_dim 32) "phi3" (q/k/v and gate/up fused in the checkpoint), "olmo2" (post-norm
    layers, q/k norms over the whole projection) or "gemma3_text" (Gemma 3: sandwich norms of
    1 + weight, GeLU, scaled embeddings, sliding and full layers with their own rotary tables); mixtures of
    experts "mixtral", "qwen3_moe" (a dense first layer) and "olmoe" (4 experts, 2 per token). ``overrides`` go to the config (e.g.
    ``num_hidden_layers=3``, ``rope_parameters={...}``, ``eos_token_id=7``). Norm weights and
    biases (HF initialises them to 1 / 0) are randomised too, so that they are really tested."""
    import transformers
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
               "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
               "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
               "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
               "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM)}
    cfg_cls, model_cls = classes[kind]
    kw = {**TINY_DEFAULTS, **overrides}
    if kind == "mistral":
        kw.setdefault("sliding_window", None)
    if kind == "qwen3":  # q/k norms per head; head_dim decoupled from hidden / heads (4 x 32 != 64)
        kw.setdefault("head_dim", 32)
    if kind in ("mixtral", "qwen3_moe", "olmoe"):  # 4 experts, 2 per token
        kw.setdefault("num_local_experts" if kind == "mixtral" else "num_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        if kind == "mixtral":
            kw.setdefault("sliding_window", None)
        if kind == "qwen3_moe":  # a dense first layer, then experts; narrower expert MLPs; renormalised top-k
            kw.setdefault("head_dim", 32)
            kw.setdefault("moe_intermediate_size", 48)
            kw.setdefault("mlp_only_layers", [0])
            kw.setdefault("norm_topk_prob", True)
    if kind in ("gemma2", "gemma3_text"):  # sliding (window 8; Gemma 3: own rotary table) and full layers
        kw.setdefault("head_dim", 16)
        kw.setdefault("query_pre_attn_scalar", 24)
        kw.setdefault("sliding_window", 8)
        kw.setdefault("layer_types", ["full_attention" if i % 2 else "sliding_attention"
                                      for i in range(kw["num_hidden_layers"])])
    if kind == "gemma2":  # soft-capped attention and logits (caps low enough to matter)
        kw.setdefault("attn_logit_softcapping", 3.0)
        kw.setdefault("final_logit_softcapping", 5.0)
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



def make_byte_tokenizer():
    """A byte-level tokenizer over 256 tokens, token i = byte i (GPT-2's byte-to-character map, no
    merges): any text encodes, one token per byte. Byte 0 (never in JSON or the tests' patterns) is
    its end-of-sequence token. For structured output on the tiny models (vocab 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[0])


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



# ---- from test_heads.py

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]



N_NEW = 40



def hf_greedy(hf, prompt, n, eos_token_id=None):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=eos_token_id, pad_token_id=0 if eos_token_id is None else eos_token_id)
    return out[0, len(prompt):].tolist()



def make_head(method, target, seed=0, vocab=None, std=0.3, **kw):
    torch.manual_seed(seed)
    if method == "eagle3" and vocab is not None:
        kw["draft_vocab_size"] = len(vocab)
    head = build_head(HeadConfig.for_target(method, target.cfg, **kw))
    init_weights(head, std)
    if method == "eagle3" and vocab is not None:
        head.set_draft_vocab(torch.tensor(vocab))
    return head.eval()



def engine(target, method, head, vocab=None, **kw):
    """An Engine drafting with ``head``. Its linears stay dense unless ``draft_weights`` says otherwise:
    these tests were built around what a random dense head accepts (tests/heads/test_heads.py covers
    the quantized default, q4_0 on CPU, on its own)."""
    kw.setdefault("draft_weights", "dense")
    tree = dict(kw.pop("tree", {}))
    if vocab is not None and method != "eagle3":
        tree["draft_vocab"] = vocab
    return Engine(target, drafter="medusa" if method == "medusa" else "eagle", head=head, tree=tree, **kw)



# ---- from test_ops.py

KERNELS = ops.kernels_available()



SHARED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "shared", "data")


def shared_data(name: str) -> str | None:
    """``../shared/data/<name>`` beside the checkout, or None where it is missing; CI sets
    TURBOSPEC_REQUIRE_SHARED=1 (it has the folder), and there a missing file fails the test instead
    of letting it skip or fall back."""
    path = os.path.join(SHARED_DATA, name)
    if os.path.isfile(path):
        return path
    if os.environ.get("TURBOSPEC_REQUIRE_SHARED") == "1":
        pytest.fail(f"{path} is missing, and TURBOSPEC_REQUIRE_SHARED=1 (CI) says it must be there")
    return None


def need_kernels(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not KERNELS.get(device, False):
        pytest.skip(f"turbospec._C has no {device} kernels (build with `python setup.py build_ext --inplace`)")
    return torch.device(device)



def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)



# ----------------------------------------------------------------------------------------------
# trees
# ----------------------------------------------------------------------------------------------
def random_parents(bsz: int, n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """int64 [bsz, n]: "random" (any valid tree), "chain", "star" or "wide" (few levels, many siblings)."""
    parents = torch.full((bsz, n), -1, dtype=torch.int64)
    for i in range(1, n):
        if kind == "chain":
            parents[:, i] = i - 1
        elif kind == "star":
            parents[:, i] = 0
        elif kind == "wide":
            parents[:, i] = torch.randint(0, min(i, 4), (bsz,), generator=g)
        else:
            parents[:, i] = torch.randint(0, i, (bsz,), generator=g)
    return parents



# ----------------------------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------------------------
SAMPLING = {  # name: (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "sample": (1.0, 0, 1.0),
    "temp": (0.6, 0, 1.0),
    "top_k": (0.8, 7, 1.0),
    "top_p": (1.2, 0, 0.8),
    "top_k_top_p": (0.9, 20, 0.9),
}



def make_verify_inputs(bsz: int, n: int, vocab: int, kind: str, with_q: bool, temperature: float, top_k: int,
                       top_p: float, seed: int, scale: float = 2.0, boost: float | None = None, hot: int = 0):
    """Random logits and a tree whose drafts are often accepted: each draft is the target's argmax at
    its parent, a sample from the target there, or a random token. With ``boost``, the target
    likes the drafts (a good drafter): the logit of each draft at its parent is set to the row's
    maximum + boost, so that paths go deep. With ``hot``, every row gets that many tokens 3-4
    above its maximum, holding most of the mass, as in a real LM: then a top-p cut falls between
    tokens of large probability, never within float rounding (a flat 100k-token tail would put the
    cut between masses ~1e-6 apart, where the float32 softmax's own rounding decides)."""
    g = gen(seed)
    parents = random_parents(bsz, n, kind, g)
    logits = torch.randn(bsz, n, vocab, generator=g) * scale
    if hot:
        idx = torch.randint(0, vocab, (bsz, n, hot), generator=g)
        logits.scatter_(2, idx, logits.amax(-1, keepdim=True) + 3.0 + torch.rand(bsz, n, hot, generator=g))
    tokens = torch.randint(0, vocab, (bsz, n), generator=g)
    argmax = logits.argmax(-1)
    probs = (reference.logits_to_probs(logits, temperature, top_k, top_p) if temperature > 0
             else torch.softmax(logits, -1))
    sampled = torch.multinomial(probs.reshape(-1, vocab), 1, generator=g).reshape(bsz, n)
    choice = torch.randint(0, 3, (bsz, n), generator=g)
    for b in range(bsz):
        for i in range(1, n):
            p = int(parents[b, i])
            if choice[b, i] == 0:
                tokens[b, i] = argmax[b, p]
            elif choice[b, i] == 1:
                tokens[b, i] = sampled[b, p]
    if boost is not None:
        row_max = logits.amax(-1)
        jitter = torch.rand(bsz, n, generator=g)
        for b in range(bsz):
            for i in range(1, n):
                p = int(parents[b, i])
                logits[b, p, tokens[b, i]] = row_max[b, p] + boost + jitter[b, i]
    draft_probs = torch.softmax(torch.randn(bsz, n, vocab, generator=g) * scale, -1) if with_q else None
    if with_q:  # make the drafter like its own drafts
        for b in range(bsz):
            for i in range(1, n):
                draft_probs[b, int(parents[b, i]), tokens[b, i]] += 0.5
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    uniform = torch.rand(bsz, n, generator=g)
    return logits, parents, tokens, draft_probs, uniform



# ----------------------------------------------------------------------------------------------
# compact_kv
# ----------------------------------------------------------------------------------------------
def random_paths(accept_len: list[int], n: int, g: torch.Generator) -> torch.Tensor:
    """int64 [B, n]: increasing node paths starting at the root, padded with -1."""
    index = torch.full((len(accept_len), n), -1, dtype=torch.int64)
    for b, a in enumerate(accept_len):
        if a < 0:
            continue
        nodes = torch.randperm(n - 1, generator=g)[:a].sort().values + 1
        index[b, 0] = 0
        index[b, 1:a + 1] = nodes
    return index



# ---- from test_tree_attention.py

# (out atol = rtol, lse atol): float32 within 1e-5; 16-bit outputs are rounded to the dtype (and the
# CUDA kernel rounds P to it before P V, as flash attention does).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-4), torch.float16: (4e-3, 1e-4)}



def make_inputs(bsz, n, hq, hkv, seq, d, cache_len, kind="random", dtype=torch.float32, seed=0):
    """q [B, n, Hq, D], caches [B, Hkv, S, D] (randn), cache_len int64 [B], tree_mask_packed [B, n]."""
    g = gen(seed)
    q = torch.randn(bsz, n, hq, d, generator=g).to(dtype)
    k = torch.randn(bsz, hkv, seq, d, generator=g).to(dtype)
    v = torch.randn(bsz, hkv, seq, d, generator=g).to(dtype)
    packed = reference.build_tree(random_parents(bsz, n, kind, g))[1]
    return q, k, v, torch.tensor(cache_len, dtype=torch.int64), packed



def assert_close(out, lse, ref_out, ref_lse, dtype, context=""):
    tol_o, tol_l = TOL[dtype]
    assert out.dtype == ref_out.dtype
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol_o, rtol=tol_o,
                               msg=lambda m: f"out {context}: {m}")
    torch.testing.assert_close(lse, ref_lse, atol=tol_l, rtol=1e-5, msg=lambda m: f"lse {context}: {m}")



# ---- from test_verify_rows.py

# Row specs: (real nodes incl. the root, tree kind, (temperature, top_k, top_p), boost). The values are
# exact in float32, so float32 tensors hold exactly the scalars each row is checked against alone.
ROWS = [
    (5, "chain", (0.0, 0, 1.0), 2.0),         # greedy, accepts deep
    (9, "random", (1.0, 0, 1.0), None),       # plain sampling
    (1, "wide", (0.75, 7, 1.0), None),        # no drafts: all padding
    (12, "star", (1.25, 0, 0.75), 2.0),       # the longest row: top-p
    (3, "random", (0.0, 0, 1.0), None),       # greedy tree
    (8, "chain", (0.875, 20, 0.875), 2.0),    # top-k and top-p
    (7, "wide", (0.625, 5, 1.0), 3.0),        # top-k tree
]



EXTRA_PAD = 2  # even the longest row has padding



def ragged_batch(specs: list, vocab: int, with_q: bool, seed: int, dtype: torch.dtype = torch.float32):
    """A padded batch of rows built independently (``make_verify_inputs``), and each row alone.

    Returns (batch inputs: logits, parents, tokens, draft_probs, uniform; per-row temperature
    float32 [B], top_k int64 [B], top_p float32 [B]; the rows alone: a list of (inputs [1, n_real],
    (temperature, top_k, top_p) scalars); the real node counts)."""
    g = gen(seed)
    n = max(s[0] for s in specs) + EXTRA_PAD
    bsz = len(specs)
    logits = torch.full((bsz, n, vocab), float("nan"))
    parents = torch.full((bsz, n), -1, dtype=torch.int64)
    tokens = torch.full((bsz, n), -1, dtype=torch.int64)
    draft_probs = torch.full((bsz, n, vocab), float("nan")) if with_q else None
    uniform = torch.zeros(bsz, n)
    alone, num_real = [], []
    for b, (n_real, kind, params, boost) in enumerate(specs):
        row = make_verify_inputs(1, n_real, vocab, kind, with_q, *params, seed=seed * 100 + b, boost=boost)
        row = (row[0].to(dtype),) + row[1:3] + (None if row[3] is None else row[3].to(dtype),) + row[4:]
        logits[b, :n_real], parents[b, :n_real], tokens[b, :n_real], uniform[b, :n_real] = (
            row[0][0], row[1][0], row[2][0], row[4][0])
        if with_q:
            draft_probs[b, :n_real] = row[3][0]
        for i in range(n_real, n):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
        alone.append((row, params))
        num_real.append(n_real)
    temperature = torch.tensor([s[2][0] for s in specs], dtype=torch.float32)
    top_k = torch.tensor([s[2][1] for s in specs], dtype=torch.int64)
    top_p = torch.tensor([s[2][2] for s in specs], dtype=torch.float32)
    inputs = (logits.to(dtype), parents, tokens, None if draft_probs is None else draft_probs.to(dtype), uniform)
    return inputs, (temperature, top_k, top_p), alone, num_real



def assert_row_equals_alone(batch_out, b: int, alone_out, n_real: int, context: str = "") -> None:
    """Row b of a batch's (accept_len, accept_index, output_token_ids) equals the row's own result
    ([1, n_real]), padded with -1."""
    n = batch_out[1].shape[1]
    assert batch_out[0][b].item() == alone_out[0][0].item(), f"accept_len of row {b} {context}"
    pad = [-1] * (n - n_real)
    for name, got, want in (("accept_index", batch_out[1][b], alone_out[1][0]),
                            ("output_token_ids", batch_out[2][b], alone_out[2][0])):
        assert got.tolist() == want.tolist() + pad, f"{name} of row {b} {context}"


def prompts_mixed(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths; some repeat themselves (n-gram lookup then drafts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, 256, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
        out.append(p * (1 + i % 3))
    return out


@contextlib.contextmanager
def counting_forwards(model):
    """Within the block, the token count of each ``model.forward`` call, in order (the list yielded)."""
    calls = []
    real = model.forward

    def spy(x, *args, **kw):
        calls.append(x.shape[1])
        return real(x, *args, **kw)

    model.forward = spy
    try:
        yield calls
    finally:
        del model.forward
