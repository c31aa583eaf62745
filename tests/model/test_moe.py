"""Mixtures of experts (Mixtral, Qwen3-MoE, OLMoE): the experts' two dispatches and the C++ layer loop.

* ``Transformer.moe_dispatch`` "masked" (fixed shapes, no host read: what a CUDA graph captures)
  gives the bits of "index" (the rows routed to each expert, read on the host) on CPU, through
  ``forward`` and ``forward_static``: single tokens, chains, trees, batches with padding rows, in
  float32 / bfloat16 / float16, logits and every cache slot; and stays within the HF tolerance.
* the masked dispatch reads nothing on the host: it runs on the 'meta' device (no data at all), and
  a whole ``forward_static`` runs under a dispatch mode that refuses every op that reads a value on
  the host (nonzero, item, boolean indexing, ...); the index dispatch fails both (the checks bite).
* a token's logits are the same bits alone or inside a batch, with either dispatch.
* the C++ layer loop (``turbospec::llama_layers``, CPU) runs expert layers, bit for bit the Python
  loop (its specification), with 3 experts per token, quantized experts and int8 activations too
  (the kinds' basic C++ == Python tests are tests/model/test_model.py's, which cover MoE as well).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import turbospec
from turbospec import ops
from turbospec.model.transformer import MOE_DISPATCHES

from helpers import make_tiny_model

MOE = ["mixtral", "qwen3_moe", "olmoe"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _model(kind: str, dtype=torch.float32, seed: int = 1, per_token: int = 2, **load):
    """A 3-layer tiny model of ``kind`` (4 experts); ``per_token`` experts per token (with 3 or more
    the order of a token's sum matters: a + b + c is not c + b + a in 16 bits)."""
    extra = dict(moe_intermediate_size=64) if kind == "qwen3_moe" else {}  # (quantizable: K % 32 == 0)
    hf = make_tiny_model(kind, seed=seed, num_hidden_layers=3, num_experts_per_tok=per_token, **extra)
    return turbospec.load_model(hf, dtype=dtype, **load)


def _dynamic_runs(model) -> list[torch.Tensor]:
    """forward: a prefill, a tree-masked verify, a single token with features, a batch of two."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                          [1, 0, 1, 0, 1]]], dtype=torch.bool)
    cache = model.new_cache(64)
    a = model.forward(ids[:, :30], torch.arange(30)[None], cache, 0)
    b = model.forward(ids[:, 30:35], torch.tensor([[30, 31, 31, 32, 32]]), cache, 30, mask)
    c, feats = model.forward(ids[:, 35:36], torch.tensor([[33]]), cache, 35, features=[0, 2])
    cache2 = model.new_cache(64, batch_size=2)
    d = model.forward(torch.cat([ids[:, :12], ids[:, 12:24]]), torch.arange(12).expand(2, 12), cache2, 0)
    return [a, b, c, feats, d] + cache.tensors() + cache2.tensors()


def _static_runs(model) -> list[torch.Tensor]:
    """forward_static: three rows at different prefix lengths (a tree, a chain, a padding row whose
    nodes attend only themselves), then one token per row."""
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([7, 0, 23])
    prompts = [torch.randint(0, 256, (1, int(s)), generator=g) for s in lens]
    ids = torch.randint(0, 256, (3, 4), generator=g)
    packed = torch.tensor([[1, 3, 5, 11], [1, 3, 7, 15], [1, 2, 4, 8]])
    positions = lens[:, None] + torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3], [0, 0, 0, 0]])
    cache = model.new_cache(40, batch_size=3)
    model.ensure_rope(40)
    for b, p in enumerate(prompts):
        if p.shape[1]:
            model.forward(p, torch.arange(p.shape[1])[None], cache.rows(b, b + 1), 0, logits="none")
    logits, feats = model.forward_static(ids, positions, cache, lens, packed, features=[0, 1])
    one = model.forward_static(ids[:, :1], positions[:, :1] + 4, cache, lens + 4, torch.ones(3, 1, dtype=torch.long),
                               last=torch.zeros(3, dtype=torch.long))
    return [logits, feats, one] + cache.tensors()


def _python_loop(model):
    model.use_cpp_layers = False
    return model


@pytest.mark.parametrize("per_token", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", MOE)
def test_masked_dispatch_equals_index_dispatch(kind, dtype, per_token):
    model = _python_loop(_model(kind, dtype, per_token=per_token))
    runs = {}
    for mode in ("index", "masked"):
        model.moe_dispatch = mode
        runs[mode] = _dynamic_runs(model) + _static_runs(model)
    assert len(runs["index"]) == len(runs["masked"])
    for x, y in zip(runs["index"], runs["masked"]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kind", MOE)
def test_masked_dispatch_matches_transformers(kind):
    hf = make_tiny_model(kind, seed=1)
    model = _python_loop(turbospec.load_model(hf))
    model.moe_dispatch = "masked"
    ids = torch.randint(0, model.cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = model.forward(ids, torch.arange(48)[None], model.new_cache(64), 0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["index", "masked"])
@pytest.mark.parametrize("kind", MOE)
def test_token_alone_equals_token_in_a_batch(kind, mode):
    """forward_static of rows 0 and 2 alone equals those rows inside a batch of four (another
    request and a padding row beside them), bit for bit, in bfloat16."""
    model = _python_loop(_model(kind, torch.bfloat16, seed=2))
    model.moe_dispatch = mode
    model.ensure_rope(32)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (4, 3), generator=g)
    lens = torch.tensor([5, 9, 0, 2])
    packed = torch.tensor([[1, 3, 7], [1, 3, 5], [1, 2, 4], [1, 3, 7]])
    pos = lens[:, None] + torch.tensor([[0, 1, 2], [0, 1, 1], [0, 0, 0], [0, 1, 2]])
    prompts = torch.randint(0, 256, (4, 9), generator=g)

    def run(rows):
        cache = model.new_cache(32, batch_size=len(rows))
        for i, b in enumerate(rows):
            if lens[b]:
                model.forward(prompts[b:b + 1, :int(lens[b])], torch.arange(int(lens[b]))[None],
                              cache.rows(i, i + 1), 0, logits="none")
        return model.forward_static(ids[rows], pos[rows], cache, lens[rows], packed[rows])

    together = run([0, 1, 2, 3])
    for b in (0, 2):
        assert torch.equal(run([b])[0], together[b])


# ------------------------------------------------------------------------------------------------
# No host reads
# ------------------------------------------------------------------------------------------------
class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's values on the host: nonzero / single-argument where
    (index lists; under inference mode torch.where(cond) reaches the mode as aten.where.default), item / int() / bool() (_local_scalar_dense, is_nonzero), boolean-mask indexing,
    masked_select, unique, equal. (On CUDA each is a device sync and cannot be captured in a graph.)"""
    READS = {"aten.nonzero.default", "aten.where.default", "aten.nonzero_numpy.default", "aten.argwhere.default",
             "aten._local_scalar_dense.default", "aten.is_nonzero.default",
             "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
             "aten.unique_consecutive.default", "aten.equal.default", "aten.allclose.default",
             "aten.repeat_interleave.Tensor", "aten.bincount.default"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in self.READS:
            self.reads.append(name)
        elif name.startswith("aten.index.") or name.startswith("aten.index_put"):
            idx = args[1] if len(args) > 1 else []
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or []):
                self.reads.append(name + " (boolean mask)")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", MOE)
def test_masked_dispatch_runs_on_meta_tensors(kind):
    """A meta tensor has no data: any host read raises. Every expert layer's MLP runs on 'meta' with
    the masked dispatch (and with "auto", which picks it off the CPU); the index dispatch cannot."""
    model = turbospec.load_model(make_tiny_model(kind, seed=1, num_hidden_layers=3), device="meta")
    act = torch.nn.functional.silu
    h = torch.empty(2, 5, model.cfg.hidden_size, device="meta")
    moe_layers = [layer for layer in model.layers if layer.experts is not None]
    assert len(moe_layers) == len(model.cfg.moe_layers) > 0
    for mode in ("masked", "auto"):
        model.moe_dispatch = mode
        for layer in moe_layers:
            y = model._moe(layer, h, act)
            assert y.shape == h.shape and y.device.type == "meta"
    model.moe_dispatch = "index"
    with pytest.raises((NotImplementedError, RuntimeError)):
        model._moe(moe_layers[0], h, act)


@pytest.mark.parametrize("kind", MOE)
def test_forward_static_reads_nothing_on_the_host(kind):
    """The whole fixed-shape step (Python layer loop, masked experts) on CPU under ``HostReads``: no
    op reads a value on the host. The same step with the index dispatch is caught."""
    model = _python_loop(_model(kind))
    model.ensure_rope(32)
    cache = model.new_cache(32, batch_size=2)
    ids = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([3, 0])
    packed = torch.tensor([[1, 3, 5, 9], [1, 2, 4, 8]])
    pos = lens[:, None] + torch.tensor([[0, 1, 1, 2], [0, 0, 0, 0]])
    found = {}
    for mode in ("masked", "index"):
        model.moe_dispatch = mode
        with HostReads() as spy:
            model.forward_static(ids, pos, cache, lens, packed, features=[0])
        found[mode] = spy.reads
    assert found["masked"] == []
    assert "aten.where.default" in found["index"]


def test_host_reads_detector_sees_each_kind_of_read():
    x = torch.arange(6)
    for read in (lambda: torch.where(x > 2), lambda: torch.inference_mode()(torch.where)(x > 2), lambda: x[x > 2], lambda: int(x[1]), lambda: bool(x[1] > 0),
                 lambda: x.sum().item(), lambda: x.nonzero(), lambda: torch.masked_select(x, x > 1)):
        with HostReads() as spy:
            read()
        assert spy.reads, read
    with HostReads() as spy:
        torch.where(x > 2, x, -x).sum()
    assert spy.reads == []


def test_moe_dispatch_refuses_unknown_modes():
    model = _model("olmoe")
    assert model.moe_dispatch == "auto" and MOE_DISPATCHES == ("auto", "index", "masked")
    with pytest.raises(ValueError, match="moe_dispatch must be one of auto, index, masked, got 'sorted'"):
        model.moe_dispatch = "sorted"


# ------------------------------------------------------------------------------------------------
# The C++ layer loop
# ------------------------------------------------------------------------------------------------
needs_cpp = pytest.mark.skipif(not ops.has_op("llama_layers"), reason="turbospec._C is not built")


# (dtype, weights, activations, cache): every dtype with dense, Q8_0 and Q4_0 experts and float32 caches
# (the raw-buffer loop); int8 activations in float32; 16-bit caches (the ATen loop) for the 16-bit models
CPP_CASES = [(d, w, "exact", "float32") for d in DTYPES for w in ("auto", "q8_0", "q4_0")] + \
    [(torch.float32, "q4_0", "int8", "float32")] + [(d, "auto", "exact", "model") for d in DTYPES[1:]]


@needs_cpp
@pytest.mark.parametrize("dtype,weights,activations,cache", CPP_CASES,
                         ids=["-".join(map(str, c)).replace("torch.", "") for c in CPP_CASES])
@pytest.mark.parametrize("kind", MOE)
def test_cpp_loop_equals_python_loop(kind, dtype, weights, activations, cache):
    """3 experts per token (of 4): forward (prefill, tree, single token with features, batch) and
    forward_static (a tree, a chain and a padding row at different prefix lengths): the C++ loop's
    logits, features and caches are the Python loop's, bit for bit, with either Python dispatch.
    float32 caches (what a CPU model makes) run the C++ raw-buffer loop, caches in a 16-bit model's
    own dtype its ATen loop."""
    model = _model(kind, dtype, per_token=3, weights=weights, activations=activations)
    if cache == "model":
        new_cache = model.new_cache

        def model_dtype_cache(length: int, batch_size: int = 1):
            c = new_cache(length, batch_size)
            c.k, c.v = [t.to(dtype) for t in c.k], [t.to(dtype) for t in c.v]
            return c
        model.new_cache = model_dtype_cache
    assert model._flat is not None and model._cpp_experts == [0 if i not in model.cfg.moe_layers else 4
                                                              for i in range(3)]
    if weights != "auto":
        assert all(lin.quantized for layer in model.layers if layer.experts for pair in layer.experts for lin in pair)
    runs = {}
    for loop, mode in (("python", "index"), ("python", "masked"), ("cpp", "auto")):
        model.use_cpp_layers, model.moe_dispatch = loop == "cpp", mode
        assert model._cpp_loop() == (loop == "cpp")
        runs[loop, mode] = _dynamic_runs(model) + _static_runs(model)
    ref = runs["python", "index"]
    for key in (("python", "masked"), ("cpp", "auto")):
        assert len(runs[key]) == len(ref)
        for x, y in zip(ref, runs[key]):
            assert torch.equal(x, y), key


@needs_cpp
def test_cpp_loop_checks_the_expert_layout():
    """The op's expert arguments are checked: a clear error names what is wrong."""
    model = _model("olmoe")
    norms, weights, formats, counts, biases, qk_norms = model._flat
    cfg = model.cfg
    cos, sin = model.rope(torch.arange(2)[None])
    cache = model.new_cache(8)

    def call(experts, per_token=2, weights=weights):
        return torch.ops.turbospec.llama_layers(
            model.embed_tokens(torch.zeros(1, 2, dtype=torch.long)), cos, sin, torch.tensor([[1, 3]]), norms, weights,
            formats, counts, biases, cache.k, cache.v, 0, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps,
            model.scale, [], qk_norms, 0, None, 0, [], 0, 0.0, experts, per_token, cfg.moe_norm_topk)
    call([4, 4, 4])
    with pytest.raises(RuntimeError, match="experts must be empty or one entry per layer"):
        call([4, 4])
    with pytest.raises(RuntimeError, match=r"layer 0 has 4 experts: experts_per_token must be in \[1, 4\], got 5"):
        call([4, 4, 4], per_token=5)
    with pytest.raises(RuntimeError, match="counts has 33 entries, expected 29"):
        call([4, 4, 2])
    with pytest.raises(RuntimeError, match="counts has 33 entries, expected 12"):
        call([])
    router = counts[0] + counts[1]  # layer 0's router: the segment after qkv's and o's
    assert weights[router].shape[0] == 4
    with pytest.raises(RuntimeError, match=r"layer 0 router has 3 outputs, expected one per expert \(4\)"):
        call([4, 4, 4], weights=weights[:router] + [weights[router][:3]] + weights[router + 1:])
    down = router + 1 + counts[3] + counts[4] + counts[5]  # expert 1's down
    with pytest.raises(RuntimeError, match="layer 0 expert 1 has gate_up / down of 256 / 32 outputs, expected "
                                           "256 / 64"):
        call([4, 4, 4], weights=weights[:down] + [weights[down][:32]] + weights[down + 1:])
