"""``verify`` with rows that differ: per-row temperature / top_k / top_p ([B] tensors) and ragged
drafts (rows padded with draft id -1), for the reference and the CPU kernel (test_cuda_emulated.py
runs the CUDA kernel's code on the same batches).

The padding rule: a node with draft id -1 is a padding node; a row's padding nodes come after all
its real nodes, and their parents follow the tree rule (any earlier node; the batch scheduler uses
0). A padding node is never accepted, emits nothing and leaves the residual distribution alone: a
padded row gives exactly what the row gives verified alone, padded with -1 to N. The batches here
give the padding nodes random earlier parents, NaN logits and draft probabilities (never read) and
a coin of 0 (which would accept anything).
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from turbospec import ops
    from turbospec.ops import reference

from helpers import ROWS, SAMPLING, assert_row_equals_alone, make_verify_inputs, need_kernels, ragged_batch


def cpu_verify(inputs, temperature, top_k, top_p):
    return [t.clone() for t in ops.verify(*inputs, temperature, top_k, top_p)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("vocab", [300, 1500])
def test_mixed_batch_rows_equal_rows_alone(vocab, with_q, dtype):
    """Greedy and sampled rows, chains and trees, ragged: each row of the batch equals the row
    verified alone with scalar parameters, exactly, for the reference and the CPU kernel."""
    need_kernels("cpu")
    for trial in range(3):
        seed = vocab + 10 * trial + (5 if with_q else 0)
        inputs, params, alone, num_real = ragged_batch(ROWS, vocab, with_q, seed, dtype)
        ref = reference.verify(*inputs, *params)
        out = cpu_verify(inputs, *params)
        for name, a, r in zip(("accept_len", "accept_index", "output_token_ids"), out, ref):
            assert torch.equal(a, r), f"{name}: kernel {a.tolist()} reference {r.tolist()} (trial {trial})"
        for b, ((row, (t, k, p)), n_real) in enumerate(zip(alone, num_real)):
            assert_row_equals_alone(ref, b, reference.verify(*row, t, k, p), n_real, f"(reference, trial {trial})")
            assert_row_equals_alone(out, b, cpu_verify(row, t, k, p), n_real, f"(kernel, trial {trial})")
        # the batch is not degenerate: drafts accepted and rejected, greedy and sampled
        assert (ref[0] >= 0).all()
    assert max(ref[0].tolist()) >= 2


@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_is_never_accepted(temperature, with_q):
    """Padding nodes (-1) under an accepted parent and under the root, with a coin of 0 that accepts any
    token of positive probability (the last token, which a -1 index would read, has mass everywhere)."""
    need_kernels("cpu")
    vocab, n = 16, 8
    # row 0: chain 0 -> 1 -> 2 of sure drafts, padding under node 2, node 1 and the root
    # row 1: the root's only real child has p = 0 (rejected): the recovered token comes from p without it
    # row 2: no drafts at all: the bonus token is drawn at the root
    parents = torch.tensor([[-1, 0, 1, 2, 1, 0, 3, 2],
                            [-1, 0, 0, 1, 2, 0, 0, 0],
                            [-1, 0, 0, 1, 1, 2, 0, 0]])
    tokens = torch.tensor([[4, 7, 9, -1, -1, -1, -1, -1],
                           [4, 3, -1, -1, -1, -1, -1, -1],
                           [4, -1, -1, -1, -1, -1, -1, -1]])
    logits = torch.zeros(3, n, vocab)
    logits[0, 0, 7] = logits[0, 1, 9] = 50.0   # the drafts hold all the mass (greedy: the argmax)
    logits[0, 2, 11] = 50.0                     # node 2: the bonus token is 11
    logits[1, 0, 3] = float("-inf")             # row 1: the draft has p = 0
    logits[1, 0, 5] = 4.0                       # ... and the argmax is 5
    logits[2, 0, 2] = 4.0
    uniform = torch.zeros(3, n)
    draft_probs = torch.full((3, n, vocab), 1.0 / vocab) if with_q else None
    params = (torch.full((3,), temperature), torch.zeros(3, dtype=torch.int64), torch.ones(3))
    for name, out in (("reference", reference.verify(logits, parents, tokens, draft_probs, uniform, *params)),
                      ("kernel", cpu_verify((logits, parents, tokens, draft_probs, uniform), *params))):
        accept_len, accept_index, output = (t.tolist() for t in out)
        assert accept_len == [2, 0, 0], name
        assert accept_index[0] == [0, 1, 2] + [-1] * 5, name
        assert output[0][:2] == [7, 9] and output[0][3:] == [-1] * 5, name
        assert output[1][0] != 3 and output[1][1:] == [-1] * 7, name
        assert output[2][1:] == [-1] * 7 and output[2][0] >= 0, name
        if temperature == 0.0:
            assert output[0][2] == 11 and output[1][0] == 5 and output[2][0] == 2, name
        # the same rows without their padding
        for b, n_real in enumerate((3, 2, 1)):
            row = (logits[b:b + 1, :n_real], parents[b:b + 1, :n_real], tokens[b:b + 1, :n_real],
                   None if draft_probs is None else draft_probs[b:b + 1, :n_real], uniform[b:b + 1, :n_real])
            alone = reference.verify(*row, temperature, 0, 1.0)
            assert_row_equals_alone(out, b, alone, n_real, name)


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("with_q", [False, True], ids=["point", "q"])
def test_scalars_and_row_tensors_agree(mode, with_q):
    """Python scalars (broadcast by the wrapper as float64) and [B] tensors of the same values give the
    same bits: float64 tensors of the scalars, and float32 tensors against the scalars they hold."""
    need_kernels("cpu")
    if mode == "greedy" and with_q:
        pytest.skip("greedy ignores draft_probs")
    temperature, top_k, top_p = SAMPLING[mode]
    inputs = make_verify_inputs(4, 10, 400, "random", with_q, temperature, top_k, top_p, seed=77, boost=2.0)
    bsz = 4
    by_scalars = cpu_verify(inputs, temperature, top_k, top_p)
    ref = reference.verify(*inputs, temperature, top_k, top_p)
    f64 = (torch.full((bsz,), temperature, dtype=torch.float64), torch.full((bsz,), top_k),
           torch.full((bsz,), top_p, dtype=torch.float64))
    for a, r, t64, rt in zip(by_scalars, ref, cpu_verify(inputs, *f64), reference.verify(*inputs, *f64)):
        assert torch.equal(a, r) and torch.equal(a, t64) and torch.equal(a, rt)
    f32 = (torch.full((bsz,), temperature), torch.full((bsz,), top_k), torch.full((bsz,), top_p))
    as_f32 = (float(f32[0][0]), top_k, float(f32[2][0]))
    for a, b, r in zip(cpu_verify(inputs, *f32), cpu_verify(inputs, *as_f32), reference.verify(*inputs, *f32)):
        assert torch.equal(a, b) and torch.equal(a, r)


def test_operator_takes_only_row_tensors():
    """The op itself takes [B] tensors; a Python number is the wrapper's to broadcast."""
    need_kernels("cpu")
    inputs = make_verify_inputs(2, 3, 20, "chain", False, 1.0, 0, 1.0, seed=1)
    outs = (torch.empty(2, dtype=torch.int64), torch.empty(2, 3, dtype=torch.int64),
            torch.empty(2, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="temperature"):
        torch.ops.turbospec.verify.default(*inputs, 1.0, torch.zeros(2, dtype=torch.int64), torch.ones(2), *outs)
    torch.ops.turbospec.verify.default(*inputs, torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2), *outs)
    assert torch.equal(outs[0], reference.verify(*inputs, 1.0, 0, 1.0)[0])


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------
RULES = {"temperature": "verify: temperature must be a finite number >= 0 (0 = greedy), got",
         "top_k": "verify: top_k must be >= 0 (0 disables top-k), got",
         "top_p": "verify: top_p must be in (0, 1] (1 disables top-p), got"}
BAD_VALUES = [  # (argument, per-row values, the bad row, the value as the kernel prints it)
    ("temperature", [1.0, -0.5], 1, "-0.5"),
    ("temperature", [float("nan"), 1.0], 0, "nan"),
    ("temperature", [0.0, float("inf")], 1, "inf"),
    ("top_k", [0, -3], 1, "-3"),
    ("top_p", [0.5, 0.0], 1, "0"),
    ("top_p", [1.5, 1.0], 0, "1.5"),
]


def _outs() -> tuple:
    return (torch.empty(2, dtype=torch.int64), torch.empty(2, 4, dtype=torch.int64),
            torch.empty(2, 4, dtype=torch.int64))


def _two_rows():
    logits, parents, tokens, _, uniform = make_verify_inputs(2, 4, 8, "chain", False, 1.0, 0, 1.0, seed=3)
    params = {"temperature": torch.ones(2), "top_k": torch.zeros(2, dtype=torch.int64), "top_p": torch.ones(2)}
    return (logits, parents, tokens, None, uniform), params


@pytest.mark.parametrize("name,values,row,printed", BAD_VALUES, ids=[f"{b[0]}-{b[1]}" for b in BAD_VALUES])
def test_bad_row_parameter_raises_naming_the_row(name, values, row, printed):
    need_kernels("cpu")
    inputs, params = _two_rows()
    params[name] = torch.tensor(values, dtype=params[name].dtype)
    with pytest.raises(RuntimeError, match=re.escape(f"{RULES[name]} {printed} at {name}[{row}]")):
        ops.verify(*inputs, **params)
    # the reference: the same words (with Python's number formatting), a ValueError
    with pytest.raises(ValueError, match=re.escape(RULES[name]) + " .* " + re.escape(f"at {name}[{row}]")):
        reference.verify(*inputs, **params)
    # a bad Python number: the wrapper's check, today's message (no row)
    scalar = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, name: values[row]}
    with pytest.raises(RuntimeError, match=re.escape(RULES[name])):
        ops.verify(*inputs, **scalar)
    with pytest.raises(ValueError, match=re.escape(RULES[name])):
        reference.verify(*inputs, **scalar)


@pytest.mark.parametrize("name,value,message", [
    ("temperature", torch.ones(2, dtype=torch.int64), "verify: temperature must be float32 or float64 [B] = [2], "
                                                      "got int64 [2]"),
    ("top_k", torch.zeros(2), "verify: top_k must be int64 [B] = [2], got float32 [2]"),
    ("top_p", torch.ones(3), "verify: top_p must be float32 or float64 [B] = [2], got float32 [3]"),
    ("top_p", torch.ones(2, 1), "verify: top_p must be float32 or float64 [B] = [2], got float32 [2, 1]"),
    ("top_k", torch.zeros(2, dtype=torch.int64, device="meta"),
     "verify: top_k must be on cpu (the device of target_logits), got meta"),
])
def test_bad_row_tensor_raises_in_kernel_and_fake(name, value, message):
    """A wrong dtype / shape / device: the CPU kernel and the fake kernel (torch.compile) raise alike."""
    need_kernels("cpu")
    inputs, params = _two_rows()
    params[name] = value
    outs = _outs()
    args = (*inputs, params["temperature"], params["top_k"], params["top_p"], *outs)
    op = torch.ops.turbospec.verify.default
    if value.device.type != "meta":  # a meta tensor sends the real call to the fake kernel
        with pytest.raises(RuntimeError, match=re.escape(message)):
            op(*args)
    mode = FakeTensorMode()
    fake_args = pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        with mode:
            op(*fake_args)


def test_row_tensors_trace_under_fake_mode():
    need_kernels("cpu")
    inputs, params = _two_rows()
    outs = _outs()
    for temperature, top_p in ((params["temperature"], params["top_p"]),
                               (params["temperature"].double(), params["top_p"].double())):
        mode = FakeTensorMode()
        args = pytree.tree_map_only(torch.Tensor, mode.from_tensor,
                                    (*inputs, temperature, params["top_k"], top_p, *outs))
        with mode:
            assert torch.ops.turbospec.verify.default(*args) is None


@pytest.mark.parametrize("tokens,message", [
    ([[0, 1, 2, 3], [0, 5, -2, -1]], "draft_token_ids[1, 2] = -2 is not a token id in [0, "),
    ([[0, 8, 2, 3], [0, 5, -1, -1]], "draft_token_ids[0, 1] = 8 is not a token id in [0, "),
    ([[0, 1, 2, 3], [0, -1, 4, -1]], "draft_token_ids[1, 1] = -1 (padding) comes before the real token "
                                     "draft_token_ids[1, 2] = 4"),
])
def test_bad_draft_ids_raise(tokens, message):
    need_kernels("cpu")
    inputs, params = _two_rows()
    inputs = (inputs[0], inputs[1], torch.tensor(tokens), None, inputs[4])
    with pytest.raises(RuntimeError, match=re.escape("verify: " + message)):
        ops.verify(*inputs, **params)
    with pytest.raises(ValueError, match=re.escape(message)):
        reference.verify(*inputs, **params)
