"""Pure-torch reference implementations of turbospec's ops: the specification.

The C++ (``csrc/cpu``) and CUDA (``csrc/cuda``) kernels must produce the same integer outputs as the
functions here (floating outputs within tolerance); tests compare them on random inputs, and
``turbospec.ops`` falls back to these functions when the extension is not built.

Vocabulary (shapes use B = batch, N = nodes per draft tree including the root, V = vocab):

* A draft *tree* is given by ``parents: int64 [B, N]``. Node 0 is the *root*: the last committed
  token, not yet in the target's KV cache. ``parents[b, 0] == -1`` and ``0 <= parents[b, i] < i``
  for ``i >= 1`` (nodes are in topological order). A chain of k drafts is ``[-1, 0, 1, ..., k-1]``.
* ``draft_token_ids: int64 [B, N]``: the token at each node (node 0 holds the root token).
* ``target_logits: [B, N, V]``: the target's logits *at* each node, i.e. its prediction for the
  children of that node. ``draft_probs: [B, N, V]`` is indexed the same way: ``draft_probs[b, i]``
  is the distribution q the drafter sampled node i's children from.
* *accepted* tokens are drafts the target keeps; the *recovered* token is sampled from the residual
  distribution after a rejection; the *bonus* token is sampled from the target at the last accepted
  node when it has no children left to try. Every verify step emits ``accept_len + 1`` tokens.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .limits import MAX_TREE_NODES


# ----------------------------------------------------------------------------------------------
# build_tree
# ----------------------------------------------------------------------------------------------
def check_parents(parents: Tensor) -> None:
    """Raise ValueError unless ``parents`` is a valid batch of trees (see module docstring)."""
    if parents.dim() != 2 or parents.dtype != torch.int64:
        raise ValueError(f"parents must be int64 [batch, num_nodes], got {parents.dtype} "
                         f"{list(parents.shape)}")
    n = parents.shape[1]
    if not 1 <= n <= MAX_TREE_NODES:
        raise ValueError(f"num_nodes must be in [1, {MAX_TREE_NODES}], got {n}")
    if parents.shape[0] == 0:
        return
    if bool((parents[:, 0] != -1).any()):
        raise ValueError(f"parents[:, 0] must be -1 (node 0 is the root), got {parents[:, 0].tolist()}")
    idx = torch.arange(n, device=parents.device)
    bad = (parents[:, 1:] < 0) | (parents[:, 1:] >= idx[1:])
    if bool(bad.any()):
        b, i = (bad.nonzero()[0] + torch.tensor([0, 1], device=parents.device)).tolist()
        raise ValueError(f"parents[{b}, {i}] = {int(parents[b, i])}: the parent of node i must be in "
                         f"[0, i) (nodes in topological order)")


def build_tree(parents: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tree attention metadata from parent indices.

    Args:
        parents: int64 [B, N], N <= 64.
    Returns:
        tree_mask: bool [B, N, N]; ``tree_mask[b, i, j]`` is True iff node j is node i or an
            ancestor of it (node i may attend to node j).
        tree_mask_packed: int64 [B, N]; bit j of ``tree_mask_packed[b, i]`` is ``tree_mask[b, i, j]``
            (bit 63 is the sign bit).
        depth: int64 [B, N]; the root has depth 0. A node's position id is prefix_len + depth.
        retrieve_index: int64 [B, N, N]; row i is the root-to-node-i path:
            ``retrieve_index[b, i, d]`` is node i's ancestor at depth d for d <= depth[b, i], else -1.
            The rows of leaves are the candidate paths acceptance chooses from.
    """
    check_parents(parents)
    bsz, n = parents.shape
    mask = torch.zeros(bsz, n, n, dtype=torch.bool, device=parents.device)
    depth = torch.zeros(bsz, n, dtype=torch.int64, device=parents.device)
    retrieve = torch.full((bsz, n, n), -1, dtype=torch.int64, device=parents.device)
    for i in range(n):
        mask[:, i, i] = True
        if i > 0:
            p = parents[:, i]
            rows = torch.arange(bsz, device=parents.device)
            mask[:, i] |= mask[rows, p]
            depth[:, i] = depth[rows, p] + 1
            retrieve[:, i] = retrieve[rows, p]
        retrieve[torch.arange(bsz), i, depth[:, i]] = i
    weights = torch.ones(n, dtype=torch.int64, device=parents.device)
    weights = torch.bitwise_left_shift(weights, torch.arange(n, device=parents.device))
    packed = (mask.to(torch.int64) * weights).sum(-1)  # bit 63 wraps to the sign bit, as in C++
    return mask, packed, depth, retrieve


# ----------------------------------------------------------------------------------------------
# logits -> probabilities (shared by verify and every drafter that samples)
# ----------------------------------------------------------------------------------------------
def logits_to_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> Tensor:
    """Sampling distribution of ``logits [..., V]`` in float32: divide by temperature; with
    ``min_p`` > 0 drop the tokens whose probability (float32 softmax of the scaled logits) is below
    ``float32(min_p) * the largest probability`` (a float32 product, as transformers'
    ``MinPLogitsWarper``; the most likely token always stays); keep the logits >= the k-th largest
    (top_k = 0: all), then keep the tokens whose strictly-larger probability mass is < top_p (ties
    are kept or dropped together), then softmax. min_p sits before top-k / top-p as in vLLM v1 (an
    argmax-invariant logits processor run after temperature, before its top-k / top-p sampler).
    temperature must be > 0 here (0 means greedy and never reaches this function)."""
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        threshold = probs.amax(-1, keepdim=True) * torch.tensor(min_p, dtype=torch.float32)
        x = x.masked_fill(probs < threshold, float("-inf"))
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_p = torch.sort(probs, dim=-1, descending=True).values
        mass_before = torch.cumsum(sorted_p.double(), dim=-1) - sorted_p.double()
        num_kept = (mass_before < top_p).sum(-1, keepdim=True).clamp(min=1)
        min_kept = torch.gather(sorted_p, -1, num_kept - 1)
        x = x.masked_fill(probs < min_kept, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample_from_probs(probs: Tensor, u: float | Tensor) -> int:
    """Inverse-CDF sample of one token from unnormalised ``probs [V]`` with a uniform u in [0, 1):
    the first token whose float64 cumulative mass exceeds u * total (the last token with positive
    mass if rounding leaves none)."""
    cdf = torch.cumsum(probs.double(), dim=0)
    threshold = float(u) * float(cdf[-1])
    t = int(torch.searchsorted(cdf, torch.tensor([threshold], dtype=torch.float64), right=True)[0])
    if t >= probs.shape[0] or probs[t] <= 0:
        t = int(torch.nonzero(probs > 0)[-1, 0])
    return t


def logits_are_valid(logits: Tensor) -> bool:
    """False when a row of logits cannot define a distribution: any NaN or +inf, or all -inf."""
    return not (bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any())
                or bool(torch.isneginf(logits).all()))


# ----------------------------------------------------------------------------------------------
# per-token logit processing: penalties, logit bias, allowed-token bitmask (verify's first stage)
# ----------------------------------------------------------------------------------------------
PENALTY_RANGE = 2.0        # presence / frequency penalties lie in [-2, 2] (OpenAI, vLLM)
LOGIT_BIAS_RANGE = 100.0   # SamplingParams.logit_bias values lie in [-100, 100] (OpenAI)


def bitmask_words(vocab: int) -> int:
    """int32 words per node of a ``token_bitmask``: ceil(V / 32)."""
    return (vocab + 31) // 32


def unpack_token_bitmask(bitmask: Tensor, vocab: int) -> Tensor:
    """bool [..., V] from ``bitmask`` int32 [..., ceil(V / 32)]: token v is allowed iff bit v % 32 of
    word v // 32 is set (bit 31 is the sign bit; bits at v >= V are ignored)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32)[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].bool()


def pack_token_bitmask(allowed: Tensor) -> Tensor:
    """The inverse of ``unpack_token_bitmask``: int32 [..., ceil(V / 32)] from bool [..., V]."""
    vocab = allowed.shape[-1]
    pad = bitmask_words(vocab) * 32 - vocab
    bits = torch.nn.functional.pad(allowed.to(torch.int64), (0, pad)).unflatten(-1, (-1, 32))
    words = (bits << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def tree_token_counts(parents: Tensor, draft_token_ids: Tensor, vocab: int,
                      output_counts: Tensor | None = None) -> Tensor:
    """int64 [B, N, V]: how often each token has been generated in the context node i's logits
    predict after: ``output_counts[b]`` (the request's committed output, the root's token included:
    the caller counted it when it was emitted) plus the draft tokens of the nodes on the path from
    the root to node i, node i itself included and the root excluded. Padding nodes (-1) count
    nothing (they are never on a real node's path)."""
    bsz, n = parents.shape
    mask = build_tree(parents)[0].clone()   # [B, N, N]: j is i or an ancestor of i
    mask[:, :, 0] = False                   # the root is already in output_counts
    tokens = draft_token_ids.to(parents.device)
    mask &= (tokens >= 0)[:, None, :]
    counts = torch.zeros(bsz, n, vocab, dtype=torch.int64, device=parents.device)
    counts.scatter_add_(2, tokens.clamp(min=0)[:, None, :].expand(bsz, n, n).contiguous(), mask.to(torch.int64))
    if output_counts is not None:
        counts += output_counts.to(torch.int64)[:, None, :]
    return counts


def process_logits(logits: Tensor, counts: Tensor | None = None, prompt_mask: Tensor | None = None,
                   presence_penalty: Tensor | None = None, frequency_penalty: Tensor | None = None,
                   repetition_penalty: Tensor | None = None, logit_bias: Tensor | None = None,
                   allowed: Tensor | None = None) -> Tensor:
    """The processed logits (float32 [..., V]) that verify samples from, elementwise in float32, in
    this order (vLLM v1's: the logit bias is a logits processor applied before its penalties):

    1. ``x = float32(logit) + logit_bias[v]`` (logit_bias float32 [..., V]);
    2. repetition penalty r (HF / vLLM; r = 1: off) on every token of the prompt or the output
       (``prompt_mask[v]`` or ``counts[v] > 0``): ``x / r`` if x > 0, else ``x * r`` (r rounded to
       float32; a division, as transformers' RepetitionPenaltyLogitsProcessor, where vLLM
       multiplies by 1 / r);
    3. frequency penalty f then presence penalty p (OpenAI; vLLM's order), output tokens only
       (``counts[v] > 0``): ``x = x - float32(f) * float32(counts[v])``, then ``x = x - float32(p)``;
    4. ``allowed`` (bool [..., V]): a disallowed token gets -inf.

    ``counts`` (int [..., V]) are output counts (the prompt is not counted: prompt_mask is). The
    per-row penalties are tensors of the leading shape ``[...]`` (any float dtype; None: off).
    Neutral values (bias 0, r = 1, f = p = 0) leave every logit exactly as it was."""
    x = logits.float()
    if logit_bias is not None:
        x = x + logit_bias.float()
    if counts is None:
        counts = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    seen = counts > 0
    if repetition_penalty is not None:
        r = repetition_penalty.float()[..., None]
        hit = seen if prompt_mask is None else (seen | prompt_mask.bool())
        x = torch.where(hit, torch.where(x > 0, x / r, x * r), x)
    if frequency_penalty is not None:
        f = frequency_penalty.float()[..., None]
        x = torch.where(seen, x - f * counts.float(), x)
    if presence_penalty is not None:
        p = presence_penalty.float()[..., None]
        x = torch.where(seen, x - p, x)
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    return x


def _row_values(name: str, value, bsz: int, check) -> Tensor | None:
    """A per-row parameter of verify's logit processing as float64 [B] (None stays None), each
    value checked by ``check`` (a message, or None when fine)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.shape[0] != bsz or not value.is_floating_point():
            raise ValueError(f"verify: {name} must be a number or a float tensor [B] = [{bsz}], got "
                             f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}")
        column = [float(v) for v in value.tolist()]
        for b, v in enumerate(column):
            msg = check(v)
            if msg:
                raise ValueError(f"verify: {name} must be {msg}, got {v} at {name}[{b}]")
        return torch.tensor(column, dtype=torch.float64)
    v = float(value)
    msg = check(v)
    if msg:
        raise ValueError(f"verify: {name} must be {msg}, got {v}")
    return torch.full((bsz,), v, dtype=torch.float64)


def check_penalty(v: float) -> str | None:
    return None if -PENALTY_RANGE <= v <= PENALTY_RANGE else f"in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off)"


def check_repetition(v: float) -> str | None:
    return None if math.isfinite(v) and v > 0 else "a finite number > 0 (1 = off)"


def check_min_p(v: float) -> str | None:
    return None if 0.0 <= v <= 1.0 else "in [0, 1] (0 = off)"


def verify_processing(bsz: int, n: int, vocab: int, output_counts: Tensor | None = None,
                      prompt_mask: Tensor | None = None, presence_penalty=None, frequency_penalty=None,
                      repetition_penalty=None, logit_bias: Tensor | None = None, min_p=None,
                      token_bitmask: Tensor | None = None) -> dict:
    """Checks verify's logit-processing arguments (shapes, dtypes, values: the kernels' rules and
    words) and returns them normalised: the per-row values as float64 [B] tensors (None: not given).
    Raises ValueError naming the argument."""
    def tensor(name, t, dtypes, shape):
        if t is None:
            return None
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        if not isinstance(t, Tensor) or t.dtype not in dtypes or list(t.shape) != [s for _, s in shape]:
            got = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}" if isinstance(t, Tensor) else repr(t)
            raise ValueError(f"verify: {name} must be {names} [{', '.join(d for d, _ in shape)}] = "
                             f"{[s for _, s in shape]}, got {got}")
        return t
    out = dict(
        output_counts=tensor("output_counts", output_counts, (torch.int32,), (("B", bsz), ("V", vocab))),
        prompt_mask=tensor("prompt_mask", prompt_mask, (torch.bool,), (("B", bsz), ("V", vocab))),
        logit_bias=tensor("logit_bias", logit_bias, (torch.float32,), (("B", bsz), ("V", vocab))),
        token_bitmask=tensor("token_bitmask", token_bitmask, (torch.int32,),
                             (("B", bsz), ("N", n), ("ceil(V / 32)", bitmask_words(vocab)))),
        presence_penalty=_row_values("presence_penalty", presence_penalty, bsz, check_penalty),
        frequency_penalty=_row_values("frequency_penalty", frequency_penalty, bsz, check_penalty),
        repetition_penalty=_row_values("repetition_penalty", repetition_penalty, bsz, check_repetition),
        min_p=_row_values("min_p", min_p, bsz, check_min_p))
    if out["output_counts"] is not None and bool((out["output_counts"] < 0).any()):
        b, v = (out["output_counts"] < 0).nonzero()[0].tolist()
        raise ValueError(f"verify: output_counts must be >= 0 (how often each token was generated), got "
                         f"{int(out['output_counts'][b, v])} at output_counts[{b}, {v}]")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if out[name] is not None and out["output_counts"] is None:
            raise ValueError(f"verify: {name} needs output_counts (int32 [B, V], the request's generated "
                             f"token counts; zeros for a fresh request)")
    return out


def processing_active(proc: dict) -> bool:
    """Whether any of verify's logit processing (``verify_processing``'s result) is given."""
    return any(proc[k] is not None for k in ("logit_bias", "token_bitmask", "presence_penalty",
                                             "frequency_penalty", "repetition_penalty"))


def verify_processed_logits(target_logits: Tensor, parents: Tensor, draft_token_ids: Tensor, **processing
                            ) -> Tensor:
    """float32 [B, N, V]: the logits of every node after verify's logit processing (``process_logits``
    with each node's own counts, ``tree_token_counts``, and its own bitmask row); the raw logits as
    float32 when no processing is given. ``processing``: verify's keyword arguments
    ``output_counts`` ... ``token_bitmask`` (min_p is not part of this stage)."""
    bsz, n, vocab = target_logits.shape
    proc = verify_processing(bsz, n, vocab, **processing)
    if not processing_active(proc):
        return target_logits.float()
    counts = None
    if proc["output_counts"] is not None:
        counts = tree_token_counts(parents, draft_token_ids, vocab, proc["output_counts"])
    allowed = None if proc["token_bitmask"] is None else unpack_token_bitmask(proc["token_bitmask"], vocab)
    pm = None if proc["prompt_mask"] is None else proc["prompt_mask"][:, None, :]
    lb = None if proc["logit_bias"] is None else proc["logit_bias"][:, None, :]
    per_node = {k: None if proc[k] is None else proc[k][:, None].expand(bsz, n)
                for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
    return process_logits(target_logits, counts, pm, per_node["presence_penalty"], per_node["frequency_penalty"],
                          per_node["repetition_penalty"], lb, allowed)


# ----------------------------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------------------------
def _check_sampling_value(name: str, value: float, where: str = "") -> None:
    """Raise ValueError unless ``value`` is a valid ``temperature`` / ``top_k`` / ``top_p`` (the
    CPU kernel's rules and words, csrc/cpu/verify.cpp); ``where`` names the row (e.g. " at top_p[2]")."""
    if name == "temperature" and not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"verify: temperature must be a finite number >= 0 (0 = greedy), got {value}{where}")
    if name == "top_k" and not value >= 0:
        raise ValueError(f"verify: top_k must be >= 0 (0 disables top-k), got {value}{where}")
    if name == "top_p" and not 0.0 < value <= 1.0:
        raise ValueError(f"verify: top_p must be in (0, 1] (1 disables top-p), got {value}{where}")


def verify_row_params(bsz: int, temperature: float | Tensor, top_k: int | Tensor, top_p: float | Tensor
                      ) -> list[tuple[float, int, float]]:
    """The (temperature, top_k, top_p) of each of the ``bsz`` rows of ``verify``: a Python scalar is
    every row's value, a tensor [B] holds one value per row (read exactly: a float32 value is that
    float's value). Raises ValueError on a bad value, naming the row of a tensor."""
    columns = []
    for name, value, cast in (("temperature", temperature, float), ("top_k", top_k, int), ("top_p", top_p, float)):
        if isinstance(value, Tensor):
            if value.dim() != 1 or value.shape[0] != bsz or value.is_complex() or value.dtype == torch.bool:
                raise ValueError(f"verify: {name} must be a number or a real tensor [B] = [{bsz}], got "
                                 f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}")
            column = [cast(v) for v in value.tolist()]
            for b, v in enumerate(column):
                _check_sampling_value(name, v, f" at {name}[{b}]")
        else:
            _check_sampling_value(name, cast(value))
            column = [cast(value)] * bsz
        columns.append(column)
    return list(zip(*columns))


def check_draft_token_ids(draft_token_ids: Tensor, vocab: int) -> list[int]:
    """Raise ValueError unless every draft id (nodes 1..N-1) is a token id in [0, vocab) or -1
    (padding), and a row's padding nodes come after its real nodes. Returns the number of real nodes
    of each row (the root included): the index of its first padding node, N if none."""
    tokens = draft_token_ids[:, 1:]
    pad = tokens == -1
    bad = ((tokens < 0) & ~pad) | (tokens >= vocab)
    after_pad = ~pad & (pad.cumsum(1) > 0)
    wrong = bad | after_pad
    if bool(wrong.any()):
        b, i = wrong.nonzero()[0].tolist()
        t = int(tokens[b, i])
        if bool(bad[b, i]):
            raise ValueError(f"draft_token_ids[{b}, {i + 1}] = {t} is not a token id in [0, {vocab}) "
                             f"(or -1: padding)")
        j = int(pad[b].nonzero()[0, 0])
        raise ValueError(f"draft_token_ids[{b}, {j + 1}] = -1 (padding) comes before the real token "
                         f"draft_token_ids[{b}, {i + 1}] = {t}: a row's padding nodes must come after its real nodes")
    n = draft_token_ids.shape[1]
    return [1 + int(pad[b].nonzero()[0, 0]) if bool(pad[b].any()) else n for b in range(draft_token_ids.shape[0])]


def verify(target_logits: Tensor, parents: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
           uniform: Tensor, temperature: float | Tensor, top_k: int | Tensor, top_p: float | Tensor,
           output_counts: Tensor | None = None, prompt_mask: Tensor | None = None,
           presence_penalty: float | Tensor | None = None, frequency_penalty: float | Tensor | None = None,
           repetition_penalty: float | Tensor | None = None, logit_bias: Tensor | None = None,
           min_p: float | Tensor | None = None, token_bitmask: Tensor | None = None
           ) -> tuple[Tensor, Tensor, Tensor]:
    """Speculative acceptance over a chain or tree, lossless for the target's distribution.

    Args:
        target_logits: float [B, N, V], the target's logits at each node.
        parents: int64 [B, N], the tree (see module docstring).
        draft_token_ids: int64 [B, N], token at each node (node 0: the root, not tested). The others
            must be in [0, V) or -1 (padding), else ValueError.
            *Padding* (ragged batches: rows with fewer drafts than N): a node with id -1 stands for no
            node. A row's padding nodes come after all its real nodes (a real id after a -1 is a
            ValueError); their parents follow the usual rule (any earlier node; by convention 0, the
            root). A padding node is never a child to test (it is never accepted, emits nothing, and
            does not change the residual distribution), its logits, draft_probs and coin are never
            read, and its accept_index / output entries are -1: a padded row gives exactly what the
            row without its padding nodes gives alone (then padded with -1 to N).
        draft_probs: float [B, N, V] or None. ``draft_probs[b, i]`` is the distribution q the
            children of node i were drafted from; siblings are taken as drawn without replacement
            (after a sibling is rejected it is removed from q and q renormalised). None means the
            drafts are point masses (n-gram lookup, top-k trees, greedy drafters): q(x) = 1.
        uniform: float [B, N] in [0, 1). ``uniform[b, i]`` (i >= 1) is the coin of node i's
            acceptance test; ``uniform[b, 0]`` draws the final recovered/bonus token.
        temperature, top_k, top_p: each a Python number (every row) or a tensor [B] (one value per
            row: a batch may mix greedy and sampled rows; the op takes temperature and top_p as
            float32 or float64, top_k as int64). A row's values act exactly as the same numbers
            given as scalars (a float32 value as the number it holds). temperature: 0 means greedy
            (argmax; the first maximal index on ties), > 0 samples; finite and >= 0. top_k >= 0
            (0 disables); top_p in (0, 1] (1.0 disables). Applied to the target logits as in
            ``logits_to_probs``; draft_probs are taken as given. A bad value is a ValueError
            (naming the row of a tensor).
        Logit processing (all optional; none given: exactly the behaviour above). Node i of row b is
        processed with ITS OWN PATH: the counts are ``output_counts[b]`` plus the draft tokens of
        the nodes from the root to node i, node i included (its logits predict the token after it)
        and the root excluded (the last committed token: the caller counted it when it was
        emitted); see ``tree_token_counts`` and ``process_logits`` for the arithmetic.
        output_counts: int32 [B, V] >= 0, how often the request has generated each token
            (committed tokens only). Needed by the three penalties.
        prompt_mask: bool [B, V], the tokens of the prompt (repetition penalty only); None: none.
        presence_penalty, frequency_penalty: per row in [-2, 2] (0: off), output tokens only.
        repetition_penalty: per row, finite and > 0 (1: off), prompt and output tokens.
        logit_bias: float32 [B, V], added to the raw logits (0: off). A NaN / +inf bias makes the
            node's row invalid as a NaN logit would; -inf bans the token.
        min_p: per row in [0, 1] (0: off): after temperature, tokens with probability < min_p x the
            largest are dropped, before top-k / top-p (vLLM v1's order; ``logits_to_probs``).
        token_bitmask: int32 [B, N, ceil(V / 32)], per NODE: bit v % 32 of word v // 32 set = token
            v allowed after that node (structured output); the others get -inf.
        The per-row values are Python numbers (every row) or float tensors [B].
        Order: logit bias, repetition, frequency, presence penalties on the raw logits, then the
        bitmask, then temperature, min_p, top-k, top-p. Greedy (temperature 0) takes the argmax of
        the processed logits (min_p, top-k, top-p cannot change it).
        Validity: a visited node is invalid (accept_len = -1) when its raw logits are (NaN, +inf,
        all -inf) or its processed logits are: a +inf (a repetition penalty < 1 overflowing a huge
        logit), or no token left (all -inf: e.g. a bitmask that allows no token, or only tokens
        whose logit is -inf). A bitmask allowing nothing is therefore not an exception but an
        invalid row, as on CUDA (no host sync); the caller must allow at least one token (EOS).
    Returns:
        accept_len: int64 [B], number of accepted draft tokens; -1 if a row's logits or draft
            probs at a visited node are not finite (see ``logits_are_valid``): no tokens emitted.
        accept_index: int64 [B, N], accepted path as node indices, starting with the root (0);
            ``accept_len + 1`` entries, padded with -1.
        output_token_ids: int64 [B, N], emitted tokens: the accepted drafts then the recovered or
            bonus token; ``accept_len + 1`` entries, padded with -1.

    Walk from the root. Greedy: move to the first child (in node order) whose token equals the
    argmax of the target at the current node; stop when none does and emit the argmax. Sampling:
    p = target distribution at the current node; for each child c in node order with token x, accept
    if ``uniform[c] * q(x) < p(x)`` (q(x) = 1 for point masses); on rejection set
    p <- normalise(max(0, p - q)) (point mass: p(x) <- 0, renormalise; if the residual has no mass,
    p is kept) and remove x from q. On acceptance move to c. When no child is accepted, emit a
    sample from p with ``uniform[b, 0]``. Each step of the recursion preserves the distribution
    (recursive rejection sampling), so emitted tokens follow the target exactly.
    """
    bsz, n, vocab = target_logits.shape
    check_parents(parents)
    num_real = check_draft_token_ids(draft_token_ids, vocab)
    row_params = verify_row_params(bsz, temperature, top_k, top_p)
    processing = dict(output_counts=output_counts, prompt_mask=prompt_mask, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                      logit_bias=logit_bias, token_bitmask=token_bitmask)
    proc = verify_processing(bsz, n, vocab, **processing, min_p=min_p)
    processed = verify_processed_logits(target_logits, parents, draft_token_ids, **processing) \
        if processing_active(proc) else None
    min_ps = [0.0] * bsz if proc["min_p"] is None else proc["min_p"].tolist()
    accept_len = torch.zeros(bsz, dtype=torch.int64)
    accept_index = torch.full((bsz, n), -1, dtype=torch.int64)
    output = torch.full((bsz, n), -1, dtype=torch.int64)
    for b in range(bsz):
        temp_b, top_k_b, top_p_b = row_params[b]
        greedy = temp_b == 0.0
        children = [[] for _ in range(n)]
        for i in range(1, num_real[b]):  # padding nodes are no one's children
            children[int(parents[b, i])].append(i)
        node, n_acc, path, emitted, valid = 0, 0, [0], [], True
        while True:
            logits = target_logits[b, node]
            if not logits_are_valid(logits):
                valid = False
                break
            if processed is not None:
                logits = processed[b, node]
                if not logits_are_valid(logits):
                    valid = False
                    break
            if greedy:
                t = int(torch.argmax(logits.float()))
                nxt = next((c for c in children[node] if int(draft_token_ids[b, c]) == t), None)
                if nxt is None:
                    emitted.append(t)
                    break
                emitted.append(t)
                path.append(nxt)
                node, n_acc = nxt, n_acc + 1
                continue
            p = logits_to_probs(logits, temp_b, top_k_b, top_p_b, min_ps[b]).double()
            q = None
            if draft_probs is not None and children[node]:
                q = draft_probs[b, node].double().clone()
                if not (bool(torch.isfinite(q).all()) and bool((q >= 0).all())):
                    valid = False
                    break
            nxt = None
            for c in children[node]:
                x = int(draft_token_ids[b, c])
                qx = 1.0 if q is None else float(q[x])
                if float(uniform[b, c]) * qx < float(p[x]):
                    nxt = c
                    break
                if q is None:
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = torch.clamp(p - q, min=0.0)
                    q[x] = 0.0
                    qs = float(q.sum())
                    if qs > 0:
                        q = q / qs
                rs = float(residual.sum())
                if rs > 0:
                    p = residual / rs
            if nxt is None:
                emitted.append(sample_from_probs(p, uniform[b, 0]))
                break
            emitted.append(int(draft_token_ids[b, nxt]))
            path.append(nxt)
            node, n_acc = nxt, n_acc + 1
        if not valid:
            accept_len[b] = -1
            continue
        accept_len[b] = n_acc
        accept_index[b, : len(path)] = torch.tensor(path)
        output[b, : len(emitted)] = torch.tensor(emitted)
    return accept_len, accept_index, output


# ----------------------------------------------------------------------------------------------
# compact_kv
# ----------------------------------------------------------------------------------------------
def compact_kv(caches: list[Tensor], prefix_len: Tensor, accept_index: Tensor, accept_len: Tensor) -> None:
    """Move the KV entries of accepted tree nodes to contiguous positions, in place.

    Args:
        caches: tensors [B, H, S, D] (every layer's K and V), all the same shape.
        prefix_len: int64 [B], cache length before the tree; node i's entry sits at prefix_len + i.
        accept_index: int64 [B, N], accepted path from ``verify`` (root first).
        accept_len: int64 [B]; rows with accept_len < 0 are left untouched.
    For each row and j in [0, accept_len]: ``cache[b, :, prefix_len + j] =
    cache[b, :, prefix_len + accept_index[b, j]]``. Path indices increase along the path, so doing
    j in increasing order never overwrites an entry before it is read.
    """
    for b in range(accept_len.shape[0]):
        base = int(prefix_len[b])
        for j in range(int(accept_len[b]) + 1):
            src = int(accept_index[b, j])
            if src != j:
                for c in caches:
                    c[b, :, base + j] = c[b, :, base + src]


# ----------------------------------------------------------------------------------------------
# linear: weights in their stored format (dense or GGUF blocks), one reduction order
# ----------------------------------------------------------------------------------------------
# GGML type id -> (name, weights per block, bytes per block)
WEIGHT_FORMATS = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18),
                  3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
                  13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
                  # turbospec's own ids (1000 + the GGUF id): the same blocks, grouped (``group_blocks``)
                  1002: ("Q4_0G", 32, 18), 1003: ("Q4_1G", 32, 20), 1006: ("Q5_0G", 32, 22), 1008: ("Q8_0G", 32, 34),
                  # (2000 + the GGUF id): 16 rows' blocks interleaved, read with int8 activations only
                  # (``interleave_blocks``)
                  2002: ("Q4_0X", 32, 18), 2003: ("Q4_1X", 32, 20), 2006: ("Q5_0X", 32, 22), 2008: ("Q8_0X", 32, 34),
                  2012: ("Q4_KX", 256, 144)}
GROUP_BLOCKS = 16  # blocks per group of a grouped layout
DENSE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


def is_block_format(fmt: int) -> bool:
    """Whether ``fmt`` (a GGML type id) stores GGUF blocks (as opposed to a dense dtype)."""
    return fmt in WEIGHT_FORMATS and WEIGHT_FORMATS[fmt][1] > 1


def row_bytes(fmt: int, k: int) -> int:
    """Bytes of one row of ``k`` weights stored in format ``fmt`` (a GGML type id)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt!r} is not supported; supported GGML type ids: "
                         + ", ".join(f"{f} {v[0]}" for f, v in WEIGHT_FORMATS.items()))
    name, block, nbytes = WEIGHT_FORMATS[fmt]
    if k % block:
        raise ValueError(f"a {name} row holds a multiple of {block} weights, got K = {k}")
    return k // block * nbytes


GROUPED = {2: 1002, 3: 1003, 6: 1006, 8: 1008}  # GGUF format id -> its grouped layout's id


def grouped_base(fmt: int) -> int | None:
    """The GGUF format id of a grouped format id (1002 Q4_0G -> 2 Q4_0), else None."""
    return fmt - 1000 if fmt in GROUPED.values() else None


@functools.lru_cache(maxsize=64)
def _group_order(fmt: int, k: int) -> Tensor:
    """Byte order of a grouped row: position p of the grouped row holds byte order[p] of the GGUF row.
    A row's blocks go in groups of ``GROUP_BLOCKS`` (the last may be shorter, n blocks); a group holds
    the fp16 field d of its n blocks, then (Q4_1) the field m of its n blocks, then each block's
    remaining bytes in block order."""
    _, block, nbytes = WEIGHT_FORMATS[fmt]
    nh = 2 if fmt in (3, 1003) else 1  # fp16 fields at a block's start
    nb = k // block
    order = []
    for g0 in range(0, nb, GROUP_BLOCKS):
        blocks = range(g0, min(nb, g0 + GROUP_BLOCKS))
        for h in range(nh):
            for j in blocks:
                order += [j * nbytes + 2 * h, j * nbytes + 2 * h + 1]
        for j in blocks:
            order += range(j * nbytes + 2 * nh, (j + 1) * nbytes)
    return torch.tensor(order, dtype=torch.long)


def group_blocks(raw: Tensor, fmt: int, k: int) -> Tensor:
    """GGUF blocks uint8 [N, row bytes] of Q4_0 / Q4_1 / Q5_0 / Q8_0 (``fmt`` 2 / 3 / 6 / 8) -> the
    same bytes in the grouped layout (format ``1000 + fmt``): only their places in each row move."""
    if fmt not in GROUPED:
        raise ValueError(f"group_blocks: format {fmt!r} has no grouped layout; Q4_0 (2), Q4_1 (3), Q5_0 (6), "
                         f"Q8_0 (8) have")
    return raw[:, _group_order(fmt, k)].contiguous()


def ungroup_blocks(raw: Tensor, fmt: int, k: int) -> Tensor:
    """The inverse of ``group_blocks``: grouped rows (``fmt`` 1002 / 1003 / 1006 / 1008) -> GGUF blocks."""
    base = grouped_base(fmt)
    if base is None:
        raise ValueError(f"ungroup_blocks: format {fmt!r} is not a grouped format (1002, 1003, 1006, 1008)")
    out = torch.empty_like(raw)
    out[:, _group_order(base, k)] = raw
    return out


INTERLEAVED = {2: 2002, 3: 2003, 6: 2006, 8: 2008, 12: 2012}  # GGUF format id -> its interleaved layout's id
INTERLEAVE_ROWS = 16  # weight rows per group of an interleaved layout


def interleaved_base(fmt: int) -> int | None:
    """The GGUF format id of an interleaved format id (2003 Q4_1X -> 3 Q4_1), else None."""
    return fmt - 2000 if fmt in INTERLEAVED.values() else None


def _interleave_check(raw: Tensor, fmt: int, k: int, what: str) -> None:
    if fmt not in INTERLEAVED:
        raise ValueError(f"{what}: format {fmt!r} has no interleaved layout; Q4_0 (2), Q4_1 (3), Q5_0 (6), Q8_0 (8), "
                         f"Q4_K (12) have")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(fmt, k) \
            or raw.shape[0] % INTERLEAVE_ROWS:
        raise ValueError(f"{what}: raw must be uint8 [N, {row_bytes(fmt, k)}] with N a multiple of "
                         f"{INTERLEAVE_ROWS}, got {raw.dtype} {list(raw.shape)}")


def interleave_blocks(raw: Tensor, fmt: int, k: int) -> Tensor:
    """GGUF blocks uint8 [N, row bytes] of Q4_0 / Q4_1 / Q5_0 / Q8_0 (``fmt`` 2 / 3 / 6 / 8; N a
    multiple of 16) -> the interleaved layout (format ``2000 + fmt``), the layout of the
    int8-activation kernels' 16-row tiles (an integer lane per weight row). Rows 16 g .. 16 g + 15
    fill the bytes of those rows, block after block; block j of the group holds the 16 rows' fp16 d
    (32 bytes), then (Q4_1) their fp16 m (32 bytes), then the values in chunks of 64 bytes, 4 per row
    (byte 4 i + e of a chunk: row i): Q4_0 / Q4_1 / Q5_0 chunk c (0..3) holds GGUF's quant bytes
    4 c .. 4 c + 3 of each row's block (low nibbles: values 4 c + e, high nibbles: 16 + 4 c + e); Q8_0
    chunk c (0..7) holds values 4 c + e, each stored + 128 as an unsigned byte. Q5_0 then holds the
    fifth bits, 16 bytes per chunk c (byte i: row i): bits 4 c .. 4 c + 3 of the row's qh in the low
    nibble, bits 16 + 4 c .. 16 + 4 c + 3 in the high one."""
    _interleave_check(raw, fmt, k, "interleave_blocks")
    if fmt == 12:
        return _interleave_q4k(raw, k, True)
    n, nb, nbytes = raw.shape[0], k // 32, WEIGHT_FORMATS[fmt][2]
    b = raw.reshape(n // INTERLEAVE_ROWS, INTERLEAVE_ROWS, nb, nbytes).transpose(1, 2)  # [g, nb, 16, bytes]
    nh = 2 if fmt == 3 else 1
    heads = [b[..., 2 * h:2 * h + 2].reshape(*b.shape[:2], 32) for h in range(nh)]
    qs = b[..., 2 * nh + (4 if fmt == 6 else 0):]
    if fmt == 8:
        qs = qs ^ 0x80
    chunks = qs.reshape(*b.shape[:3], -1, 4).transpose(2, 3).reshape(*b.shape[:2], -1)  # [g, nb, chunk, 16, 4]
    parts = heads + [chunks]
    if fmt == 6:
        qh = b[..., 2:6].clone(memory_format=torch.contiguous_format).view(torch.int32).long()  # [g, nb, 16, 1], little endian
        c = torch.arange(4)
        hb = ((qh >> (4 * c)) & 15) | (((qh >> (16 + 4 * c)) & 15) << 4)  # [g, nb, 16 rows, 4 chunks]
        parts.append(hb.transpose(2, 3).reshape(*b.shape[:2], 64).to(torch.uint8))
    return torch.cat(parts, -1).reshape(n, -1).contiguous()


def _interleave_q4k(raw: Tensor, k: int, forward: bool) -> Tensor:
    """Q4_K super-blocks <-> Q4_KX: per super-block of a 16-row group (16 x 144 bytes) the rows' fp16
    d (32 bytes), fp16 dmin (32), their 12 packed scale bytes as three parts of 64 (part t: bytes
    4 t .. 4 t + 3 of each row, row i at 4 i), then 32 chunks of 64 bytes (chunk 8 j + c: the quant
    bytes 32 j + 4 c .. 32 j + 4 c + 3 of each row: low nibbles sub-block 2 j, high 2 j + 1)."""
    n, ns = raw.shape[0], k // 256
    g = n // INTERLEAVE_ROWS
    if forward:
        b = raw.reshape(g, INTERLEAVE_ROWS, ns, 144).transpose(1, 2)  # [g, ns, 16, 144]
        parts = [b[..., 0:2].reshape(g, ns, 32), b[..., 2:4].reshape(g, ns, 32),
                 b[..., 4:16].reshape(g, ns, INTERLEAVE_ROWS, 3, 4).transpose(2, 3).reshape(g, ns, 192),
                 b[..., 16:144].reshape(g, ns, INTERLEAVE_ROWS, 32, 4).transpose(2, 3).reshape(g, ns, 2048)]
        return torch.cat(parts, -1).reshape(n, -1).contiguous()
    b = raw.reshape(g, ns, INTERLEAVE_ROWS * 144)
    d = b[..., 0:32].reshape(g, ns, INTERLEAVE_ROWS, 2)
    dmin = b[..., 32:64].reshape(g, ns, INTERLEAVE_ROWS, 2)
    sc = b[..., 64:256].reshape(g, ns, 3, INTERLEAVE_ROWS, 4).transpose(2, 3).reshape(g, ns, INTERLEAVE_ROWS, 12)
    qs = b[..., 256:].reshape(g, ns, 32, INTERLEAVE_ROWS, 4).transpose(2, 3).reshape(g, ns, INTERLEAVE_ROWS, 128)
    return torch.cat([d, dmin, sc, qs], -1).transpose(1, 2).reshape(n, -1).contiguous()


def deinterleave_blocks(raw: Tensor, fmt: int, k: int) -> Tensor:
    """The inverse of ``interleave_blocks``: interleaved rows (``fmt`` 2002 / 2003 / 2008) -> GGUF blocks."""
    base = interleaved_base(fmt)
    if base is None:
        raise ValueError(f"deinterleave_blocks: format {fmt!r} is not an interleaved format (2002, 2003, 2006, "
                         f"2008)")
    _interleave_check(raw, base, k, "deinterleave_blocks")
    if base == 12:
        return _interleave_q4k(raw, k, False)
    n, nb, nbytes = raw.shape[0], k // 32, WEIGHT_FORMATS[base][2]
    nh = 2 if base == 3 else 1
    b = raw.reshape(n // INTERLEAVE_ROWS, nb, INTERLEAVE_ROWS * nbytes)
    g = b.shape[0]
    heads = [b[..., 32 * h:32 * h + 32].reshape(g, nb, INTERLEAVE_ROWS, 2) for h in range(nh)]
    end = b.shape[-1] - (64 if base == 6 else 0)
    qs = b[..., 32 * nh:end].reshape(g, nb, -1, INTERLEAVE_ROWS, 4).transpose(2, 3).reshape(g, nb, INTERLEAVE_ROWS, -1)
    if base == 8:
        qs = qs ^ 0x80
    parts = heads
    if base == 6:
        hb = b[..., end:].reshape(g, nb, 4, INTERLEAVE_ROWS).transpose(2, 3).long()  # [g, nb, 16 rows, 4 chunks]
        c = torch.arange(4)
        qh = (((hb & 15) << (4 * c)) | ((hb >> 4) << (16 + 4 * c))).sum(-1, keepdim=True)  # disjoint bits
        parts = parts + [qh.to(torch.int32).view(torch.uint8)]
    blocks = torch.cat(parts + [qs], -1)  # [g, nb, 16, bytes]
    return blocks.transpose(1, 2).reshape(n, -1).contiguous()


def _f16(raw: Tensor) -> Tensor:  # uint8 [..., 2] -> float32 [...]
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: Tensor) -> Tensor:  # uint8 [..., 16 * m] -> [..., 2, 16 * m]: low nibbles, then high
    return torch.stack((qs & 15, qs >> 4), dim=-2)


def _k4_scale_min(s: Tensor) -> tuple[Tensor, Tensor]:  # 12 packed bytes -> 6-bit scales, mins [.., 8]
    s = s.long()
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 6) << 4)), -1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 6) << 4)), -1)
    return sc.float(), mn.float()


def dequantize(raw: Tensor, fmt: int, k: int) -> Tensor:
    """Specification of ``turbospec::dequantize``: uint8 [N, row_bytes] GGUF blocks -> float32 [N, K],
    the values gguf's own dequantization gives (every product of a block scale and a quantized value
    is exact in float32, so each weight is rounded once)."""
    n = raw.shape[0]
    name, block, nbytes = WEIGHT_FORMATS[fmt] if fmt in WEIGHT_FORMATS else (None, 0, 0)
    if block <= 1:
        raise ValueError(f"dequantize: format {fmt!r} is not a GGUF block format")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(fmt, k):
        raise ValueError(f"dequantize: raw must be uint8 [N, {row_bytes(fmt, k)}] for {name} with K = {k}, "
                         f"got {raw.dtype} {list(raw.shape)}")
    if grouped_base(fmt) is not None:
        return dequantize(ungroup_blocks(raw, fmt, k), grouped_base(fmt), k)
    if interleaved_base(fmt) is not None:
        return dequantize(deinterleave_blocks(raw, fmt, k), interleaved_base(fmt), k)
    b = raw.reshape(n, k // block, nbytes)
    if name in ("Q4_0", "Q4_1", "Q5_0"):
        d = _f16(b[..., 0:2])[..., None]
        qs = b[..., {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[name]:]
        q = _nibbles(qs).reshape(n, -1, 32).float()
        if name == "Q4_0":
            w = d * (q - 8)
        elif name == "Q4_1":
            w = d * q + _f16(b[..., 2:4])[..., None]
        else:
            qh = b[..., 2:6].clone(memory_format=torch.contiguous_format).view(torch.int32).long()  # [n, nb, 1], little endian
            hb = (qh >> torch.arange(32)) & 1
            w = d * ((q.long() | (hb << 4)) - 16).float()
    elif name == "Q8_0":
        w = b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., 0:2])[..., None]
    elif name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k4_scale_min(b[..., 4:16])
        qs = b[..., 16:144] if name == "Q4_K" else b[..., 48:176]
        q = _nibbles(qs.reshape(n, -1, 4, 32)).reshape(n, -1, 8, 32).long()
        if name == "Q5_K":
            qh = b[..., 16:48].long()  # [n, nb, 32]
            q = q | (((qh[..., None, :] >> torch.arange(8)[:, None]) & 1) << 4)
        w = (d[..., None] * sc)[..., None] * q.float() - (dmin[..., None] * mn)[..., None]
    else:  # Q6_K
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32).long()
        lo = _nibbles(ql).long().reshape(n, -1, 2, 128)  # per half: 64 low nibbles, 64 high
        hi = ((qh[..., None, :] >> (2 * torch.arange(4))[:, None]) & 3).reshape(n, -1, 2, 128)
        q = ((lo | (hi << 4)) - 32).reshape(n, -1, 16, 16).float()
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        w = (_f16(b[..., 208:210])[..., None] * sc)[..., None] * q
    return w.reshape(n, k)


def _k_unsigned(b: Tensor, name: str) -> Tensor:
    """K-quant super-blocks uint8 [n, ns, bytes] -> the stored unsigned values [n, ns, 8, 32] (per
    sub-block of 32): Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (its q is this minus 32)."""
    n, ns = b.shape[:2]
    if name in ("Q4_K", "Q5_K"):
        qs = b[..., 16:144] if name == "Q4_K" else b[..., 48:176]
        u = _nibbles(qs.reshape(n, ns, 4, 32)).reshape(n, ns, 8, 32).long()
        if name == "Q5_K":
            u = u | (((b[..., 16:48].long()[..., None, :] >> torch.arange(8)[:, None]) & 1) << 4)
        return u
    ql, qh = b[..., 0:128].reshape(n, ns, 2, 64), b[..., 128:192].reshape(n, ns, 2, 32).long()
    lo = _nibbles(ql).long().reshape(n, ns, 2, 128)  # per half: 64 low nibbles, 64 high
    hi = ((qh[..., None, :] >> (2 * torch.arange(4))[:, None]) & 3).reshape(n, ns, 2, 128)
    return (lo | (hi << 4)).reshape(n, ns, 8, 32)


def block_parts(raw: Tensor, fmt: int, k: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """GGUF blocks split into what an integer dot product needs: ``q`` int64 [N, K], the signed
    integer weights (offsets such as Q4_0's -8 applied); ``scale`` float32 [N, K / 16], the factor of
    each 16 weights; ``minw`` float32 [N, K / 32] the additive term of each 32 weights (Q4_1, Q4_K,
    Q5_K; None for the others). ``dequantize`` = scale * q (+ minw), weight by weight."""
    n = raw.shape[0]
    name, block, nbytes = WEIGHT_FORMATS[fmt]
    dequantize(raw[:INTERLEAVE_ROWS] if interleaved_base(fmt) is not None else raw[:1], fmt, k)  # the same checks
    if grouped_base(fmt) is not None:
        return block_parts(ungroup_blocks(raw, fmt, k), grouped_base(fmt), k)
    if interleaved_base(fmt) is not None:
        return block_parts(deinterleave_blocks(raw, fmt, k), interleaved_base(fmt), k)
    b = raw.reshape(n, k // block, nbytes)
    minw = None
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        d = _f16(b[..., 0:2])[..., None]  # [n, nb, 1]
        if name == "Q8_0":
            q = b[..., 2:].contiguous().view(torch.int8).long()
        else:
            q = _nibbles(b[..., {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[name]:]).reshape(n, -1, 32).long()
        if name == "Q4_0":
            q = q - 8
        elif name == "Q5_0":
            qh = b[..., 2:6].clone(memory_format=torch.contiguous_format).view(torch.int32).long()
            q = (q | (((qh >> torch.arange(32)) & 1) << 4)) - 16
        elif name == "Q4_1":
            minw = _f16(b[..., 2:4]).reshape(n, -1)
        scale = d.expand(n, k // 32, 2)
    elif name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k4_scale_min(b[..., 4:16])
        q = _k_unsigned(b, name)
        scale = (d[..., None] * sc)[..., None].expand(n, k // 256, 8, 2)
        minw = -(dmin[..., None] * mn)
    else:  # Q6_K
        q = _k_unsigned(b, name) - 32
        scale = _f16(b[..., 208:210])[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()
    return q.reshape(n, k), scale.reshape(n, k // 16).contiguous(), None if minw is None else minw.reshape(n, k // 32)


def quantize_activations(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Specification of the int8 activations of ``linear(..., activations=8)``: each row of ``x``
    [R, K] in blocks of ``block`` (32; 256 for the K-quant formats): d = max|x| / 127 (float32),
    q = x * (1 / d) rounded to the nearest integer, ties to even (q = 0 where d = 0).
    Returns q int64 [R, K], d float32 [R, K / block]."""
    r, k = x.shape
    xb = x.float().reshape(r, k // block, block)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).long()
    return q.reshape(r, k), d


def _fma32(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """float32 fma(a, b, acc): the product and sum in float64, rounded once to float32 (see small_linear)."""
    return (acc.double() + a.double() * b.double()).float()


def _linear_int8_q4kx(qx: Tensor, dx: Tensor, raw: Tensor, k: int) -> Tensor:
    """One Q4_KX segment against activations quantized per 256 -> [R, n]: per super-block the exact
    integers L = sum over sub-blocks of sc * (sum of u_w * q_x) and M = sum of mn * (sum of q_x) per
    sub-block of 32, then y = fma(d_w * d_x, L, y), y = fma(-(dmin_w * d_x), M, y)."""
    b = deinterleave_blocks(raw, 2012, k)
    n, R, ns = b.shape[0], qx.shape[0], k // 256
    b = b.reshape(n, ns, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, ns]
    sc, mn = (t.long() for t in _k4_scale_min(b[..., 4:16]))  # [n, ns, 8]
    u = _k_unsigned(b, "Q4_K")  # [n, ns, 8, 32]
    xs = qx.view(R, ns, 8, 32)
    dots = torch.einsum("nsbk,rsbk->nrsb", u, xs)  # exact (int64) [n, R, ns, 8]
    L = (dots * sc[:, None]).sum(-1)  # [n, R, ns]
    M = (mn[:, None] * xs.sum(-1)[None]).sum(-1)
    y = torch.zeros(n, R, dtype=torch.float32)
    for s_ in range(ns):
        y = _fma32(y, d[:, None, s_] * dx[None, :, s_], L[:, :, s_].float())
        y = _fma32(y, -(dmin[:, None, s_] * dx[None, :, s_]), M[:, :, s_].float())
    return y.T


def _linear_int8_k(qx: Tensor, dx: Tensor, raw: Tensor, fmt: int, k: int) -> Tensor:
    """One K-quant segment (Q4_K, Q5_K, Q6_K) against activations quantized per 256 -> [n, R]."""
    n, R, ns = raw.shape[0], qx.shape[0], k // 256
    name, _, nbytes = WEIGHT_FORMATS[fmt]
    b = raw.reshape(n, ns, nbytes)
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = (t.long() for t in _k4_scale_min(b[..., 4:16]))  # [n, ns, 8]
        lane_scale = sc[..., None].expand(n, ns, 8, 8)  # [n, ns, sub-block, lane]
        bsum = qx.view(R, ns, 8, 32).sum(-1)  # [R, ns, 8]
        big_m = (mn.view(n, 1, ns, 8) * bsum.view(1, R, ns, 8)).sum(-1)  # [n, R, ns]
        neg = -(dmin.view(n, 1, ns) * dx.view(1, R, ns))
    else:  # Q6_K: unsigned 6-bit values u (q = u - 32), one int8 scale per 16
        sc = b[..., 192:208].contiguous().view(torch.int8).long()  # [n, ns, 16]
        d = _f16(b[..., 208:210])
        lane_scale = sc.view(n, ns, 8, 2).repeat_interleave(4, dim=-1)  # lanes 0..3: first 16, 4..7: second
        bsum16 = qx.view(R, ns, 16, 16).sum(-1)
        big_m = (sc.view(n, 1, ns, 16) * bsum16.view(1, R, ns, 16)).sum(-1)
        neg = None
    u = _k_unsigned(b, name)
    prod = (u.view(n, 1, ns, 8, 8, 4) * qx.view(1, R, ns, 8, 8, 4)).sum(-1)  # [n, R, ns, sub, lane]
    lanes = (prod * lane_scale.view(n, 1, ns, 8, 8)).sum(3)  # exact integers [n, R, ns, 8]
    ddx = d.view(n, 1, ns) * dx.view(1, R, ns)
    if neg is None:
        neg = -(32.0 * ddx)
    acc = torch.zeros(n, R, 8, dtype=torch.float32)
    m = torch.zeros(n, R, dtype=torch.float32)
    for s_ in range(ns):
        acc = _fma32(acc, ddx[:, :, s_, None], lanes[:, :, s_].float())
        m = _fma32(m, neg[:, :, s_], big_m[:, :, s_].float())
    t = acc[..., :4] + acc[..., 4:]
    t = t[..., :2] + t[..., 2:]
    return t[..., 0] + t[..., 1] + m


def has_int8_kernel(fmt: int) -> bool:
    """Whether ``linear(..., activations=8)`` takes weights of format ``fmt``: the GGUF block formats."""
    return is_block_format(int(fmt))


def linear_int8(x: Tensor, weights: list[Tensor], formats: list[int], bias: Tensor | None = None) -> Tensor:
    """Specification of ``turbospec::linear(..., activations=8)`` (GGUF block weights only): the
    activations quantized to int8 (``quantize_activations``), integer dot products, float32 scales.
    Q4_0 / Q4_1 / Q5_0 / Q8_0 (activations per 32): for output o, input row r and block b of 32
    weights, lanes j = 0..7 take the exact integer L_j = sum of q_w * q_x over weights 4j..4j+3 of
    the block and accumulate acc_j = fma(scale_w * d_x, L_j, acc_j) block by block (``block_parts``);
    Q4_1 adds m = fma(min_w, d_x * sum(q_x), m) block by block.
    Their interleaved layouts (Q4_0X / Q4_1X / Q5_0X / Q8_0X, ``interleave_blocks``): one
    accumulator, block by block y = fma(d_w * d_x, S, y) with S the exact integer sum of q_w * q_x
    over the block, then (Q4_1X) y = fma(min_w, d_x * sum(q_x), y); y (+ bias). Q4_KX (activations
    per 256): super-block by super-block y = fma(d_w * d_x, L, y), y = fma(-(dmin_w * d_x), M, y),
    L and M exact integers (``_linear_int8_q4kx``).
    Q4_K / Q5_K / Q6_K (activations per 256, one super-block): lane j takes the exact integer
    L_j = sum over the 8 sub-blocks of (integer scale) * sum of u_w * q_x over weights 4j..4j+3 of the
    sub-block (u_w: the stored unsigned values; Q6_K: its scale of each 16), and per super-block
    acc_j = fma(d_w * d_x, float(L_j), acc_j), m = fma(-(dmin_w * d_x), float(sum of mins * sums of
    q_x), m) (Q6_K: -(32 * d_w * d_x) times the sum of scales * sums of q_x per 16: its offset).
    y = ((acc_j + acc_j+4), + 2, + 1) + m (+ bias), cast to x's dtype. Each row is computed alone:
    batch-invariant like ``linear``."""
    k = x.shape[-1]
    xr = x.reshape(-1, k)
    q32 = q256 = None
    outs = []
    for w, f in zip(weights, formats):
        f = int(f)
        if f == 2012:  # Q4_KX: per super-block y = fma(d dx, L, y), y = fma(-(dmin dx), M, y)
            if q256 is None:
                q256 = quantize_activations(xr, 256)
            outs.append(_linear_int8_q4kx(*q256, w, k))
            continue
        if WEIGHT_FORMATS[f][1] == 256:
            if q256 is None:
                q256 = quantize_activations(xr, 256)
            outs.append(_linear_int8_k(*q256, w, f, k).T)
            continue
        if q32 is None:
            q32 = quantize_activations(xr)
        qx, dx = q32
        R, nb = qx.shape[0], k // 32
        q, scale, minw = block_parts(w, f, k)
        n = q.shape[0]
        sx = dx * qx.view(R, nb, 32).sum(-1).float()  # [R, nb]
        if interleaved_base(f) is not None:
            dots = (q.view(n, 1, nb, 32) * qx.view(1, R, nb, 32)).sum(-1).float()  # exact integers [n, R, nb]
            d = scale.view(n, nb, 2)[..., 0]
            y = torch.zeros(n, R, dtype=torch.float32)
            for blk in range(nb):
                y = _fma32(y, d[:, None, blk] * dx[None, :, blk], dots[:, :, blk])
                if minw is not None:
                    y = _fma32(y, minw[:, None, blk], sx[None, :, blk])
            outs.append(y.T)
            continue
        lanes = (q.view(n, 1, nb, 8, 4) * qx.view(1, R, nb, 8, 4)).sum(-1)  # exact integers [n, R, nb, 8]
        s = scale.view(n, 1, nb, 2, 1).expand(n, 1, nb, 2, 4).reshape(n, 1, nb, 8) * dx.view(1, R, nb, 1)
        acc = torch.zeros(n, R, 8, dtype=torch.float32)
        m = torch.zeros(n, R, dtype=torch.float32)
        for blk in range(nb):
            acc = _fma32(acc, s[:, :, blk], lanes[:, :, blk].float())
            if minw is not None:
                m = _fma32(m, minw[:, None, blk], sx[None, :, blk])
        t = acc[..., :4] + acc[..., 4:]
        t = t[..., :2] + t[..., 2:]
        y = t[..., 0] + t[..., 1]
        if minw is not None:
            y = y + m
        outs.append(y.T)
    y = torch.cat(outs, dim=1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[1])


def _dense(weight: Tensor, fmt: int, k: int) -> Tensor:
    return dequantize(weight, fmt, k) if is_block_format(fmt) else weight.float()


def small_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Specification of ``turbospec::small_linear`` (and ``linear``): y[r, o] = sum_k x[r, k] * W[o, k]
    (+ b[o]) in float32 with this order: lane j in 0..15 accumulates the terms k = j, j + 16, ... in
    increasing k with fused multiply-adds (x and W widened to float32 exactly), the lanes are summed
    as (j, j + 8), then + 4, + 2, + 1, then the bias is added; the result is cast to x's dtype."""
    k = x.shape[-1]
    xf = x.reshape(-1, k).double()
    wf = weight.double()
    pad = (-k) % 16
    xf = torch.nn.functional.pad(xf, (0, pad)).view(xf.shape[0], -1, 16)
    wf = torch.nn.functional.pad(wf, (0, pad)).view(wf.shape[0], -1, 16)
    # One FMA per step in float64 then rounded to float32 is exactly float32's fused multiply-add.
    acc = torch.zeros(xf.shape[0], wf.shape[0], 16, dtype=torch.float32)
    for c in range(xf.shape[1]):
        acc = (acc.double() + xf[:, None, c, :] * wf[None, :, c, :]).float()
    while acc.shape[-1] > 1:
        h = acc.shape[-1] // 2
        acc = acc[..., :h] + acc[..., h:]
    y = acc[..., 0]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weights: list[Tensor], formats: list[int], bias: Tensor | None = None) -> Tensor:
    """Specification of ``turbospec::linear``: ``small_linear`` over the weight segments dequantized
    to float32 (``dequantize``) and concatenated along the output dimension."""
    k = x.shape[-1]
    w = torch.cat([_dense(wi, int(f), k) for wi, f in zip(weights, formats)])
    return small_linear(x, w, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Specification of ``turbospec::rms_norm``: per row of K values, lane j in 0..7 sums
    x[8t + j]^2 over t = 0, 1, ... in increasing t (x zero-padded to a multiple of 8; each step
    rounds the square, then the sum), s = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)),
    inv = 1 / sqrt(s / K + eps), y = weight * (x * inv); every operation in float32. For bfloat16 /
    float16 x (and weight of that dtype) the sum and inv are the same float32 numbers and
    y = weight * T(x * inv) in T: the roundings of the composite norm HF models run."""
    k = x.shape[-1]
    xf = x.float()
    lanes = torch.nn.functional.pad(xf, (0, (-k) % 8)).unflatten(-1, (-1, 8))
    acc = torch.zeros(lanes.shape[:-2] + (8,), dtype=torch.float32)
    for t in range(lanes.shape[-2]):
        v = lanes[..., t, :]
        acc = acc + v * v
    t4 = acc[..., :4] + acc[..., 4:]
    t2 = t4[..., :2] + t4[..., 2:]
    s = t2[..., 0] + t2[..., 1]
    ms = s / torch.tensor(float(k), dtype=torch.float32)
    # sqrt and 1 / . computed in float64 and rounded: exactly float32's correctly rounded results
    # (torch's float32 sqrt is not correctly rounded on every CPU path)
    root = torch.sqrt((ms + torch.tensor(eps, dtype=torch.float32)).double()).float()
    inv = (1.0 / root.double()).float()
    if x.dtype in (torch.bfloat16, torch.float16):
        return weight * (xf * inv[..., None]).to(x.dtype)
    return weight.float() * (xf * inv[..., None])


# ----------------------------------------------------------------------------------------------
# tree_attention
# ----------------------------------------------------------------------------------------------
def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Specification of ``turbospec::add_rms_norm``: (s, y) with s = x + delta in x's dtype (s = x
    without delta) and y = weight * dtype(s * 1 / sqrt(mean(s^2) + eps)), the norm's math in float32.
    The same roundings as the model's composite ``x + delta`` then ``rms_norm``; the order of the sum
    of squares is the kernel's own (float32, fixed per kernel), so kernels match this to a few ulps
    of float32 in the mean, which can move a 16-bit result by one unit in its last place."""
    s = x if delta is None else x + delta
    h = s.float()
    inv = 1.0 / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return s, weight * (h * inv).to(x.dtype)


def _linear_as(x: Tensor, weights: list[Tensor], formats: list[int], act: int, bias: Tensor | None = None) -> Tensor:
    """turbospec::linear's specification with its activations (8: int8 where it takes them)."""
    if act == 8 and x.shape[-1] % 32 == 0 and all(map(has_int8_kernel, formats)):
        return linear_int8(x, weights, formats, bias)
    return linear(x, weights, formats, bias)


def eagle_input(rows: Tensor, linears: list[tuple[list[Tensor], list[int], int]], fc_bias: Tensor | None,
                norms: list[Tensor], hidden_size: int, eps: float, mode: int) -> Tensor:
    """Specification of ``turbospec::eagle_input`` (an EAGLE head's input side, ``EagleHead._input``):
    rows float32 [N, F + H] (features, embedding) -> [N, H + q + k + v] = (g, q/k/v). linears: [fc, qkv]
    as (weights, formats, activations). mode 0 (EAGLE-1/2): g = fc(cat(embedding, features)) + fc_bias,
    q/k/v of g; 1 (EAGLE-3): g = fc(features); 2: g = features; EAGLE-3's q/k/v of
    cat(rms_norm(embedding, norms[0]), rms_norm(g, norms[1]))."""
    h = hidden_size
    feats, emb = rows[:, :rows.shape[1] - h], rows[:, rows.shape[1] - h:]
    (fw, ff, fa), (qw, qf, qa) = linears
    if mode == 0:
        g = _linear_as(torch.cat((emb, feats), dim=-1), fw, ff, fa, fc_bias)
        x = g
    else:
        g = feats.contiguous() if mode == 2 else _linear_as(feats, fw, ff, fa)
        x = torch.cat((rms_norm(emb, norms[0], eps), rms_norm(g, norms[1], eps)), dim=-1)
    return torch.cat((g, _linear_as(x, qw, qf, qa)), dim=-1)


def eagle_output(rows: Tensor, linears: list[tuple[list[Tensor], list[int], int]], norm: Tensor, eps: float) -> Tensor:
    """Specification of ``turbospec::eagle_output`` (``EagleHead._output``): rows float32 [N, A + H]
    (attention output, g) -> h + down(silu(gate) * up) of gate_up(rms_norm(h, norm)), h = g + o(attention
    output). linears: [o, gate_up, down] as (weights, formats, activations)."""
    h_dim = norm.numel()
    att, g = rows[:, :rows.shape[1] - h_dim], rows[:, rows.shape[1] - h_dim:]
    (ow, of, oa), (uw, uf, ua), (dw, df, da) = linears
    h = g + _linear_as(att, ow, of, oa)
    gate, up = _linear_as(rms_norm(h, norm, eps), uw, uf, ua).chunk(2, dim=-1)
    return h + _linear_as(torch.nn.functional.silu(gate) * up, dw, df, da)


def silu_mul(gate_up: Tensor) -> Tensor:
    """Specification of ``turbospec::silu_mul``: gate_up [..., 2I] -> dtype(dtype(silu(gate)) * up)
    [..., I], gate and up the two halves of the last dim (torch's ``F.silu(gate) * up``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x * cos + roll(x, D/2) * sin_signed in x's dtype (sin_signed has its first half negated):
    the rotary embedding as ``turbospec.model.rope.rotate`` computes it."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def rope_cache(qkv: Tensor, cos: Tensor, sin_signed: Tensor, cache_len: Tensor, num_heads: int, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:
    """Specification of ``turbospec::rope_cache``: qkv [B, n, H + 2 Hkv, D] -> the rotated q heads
    [B, n, H, D]; the rotated k heads and the v heads are written into k_cache / v_cache
    [B, Hkv, S, D] at slot cache_len[b] + j for token j of row b. A row with cache_len < 0, or a slot
    >= S, writes nothing there (no error: the kernels read cache_len on the device)."""
    bsz, n, heads, _ = qkv.shape
    h_kv = k_cache.shape[1]
    if heads != num_heads + 2 * h_kv:
        raise ValueError(f"rope_cache: qkv has {heads} heads, expected num_heads + 2 Hkv = {num_heads + 2 * h_kv}")
    rot = rope_rotate(qkv[:, :, :num_heads + h_kv], cos, sin_signed)
    for b in range(bsz):
        length = int(cache_len[b])
        for j in range(n):
            slot = length + j
            if length < 0 or slot >= k_cache.shape[2]:
                continue
            k_cache[b, :, slot] = rot[b, j, num_heads:]
            v_cache[b, :, slot] = qkv[b, j, num_heads + h_kv:]
    return rot[:, :, :num_heads].contiguous()


def unpack_tree_mask(tree_mask_packed: Tensor, n: int) -> Tensor:
    """bool [B, n, n] from ``tree_mask_packed`` int64 [B, n]: entry [b, i, j] is bit j of row i
    (bit 63 is the sign bit; bits >= n are ignored)."""
    shifts = torch.arange(n, device=tree_mask_packed.device)
    return ((tree_mask_packed[:, :, None] >> shifts) & 1).bool()


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, tree_mask_packed: Tensor,
                   scale: float, include_prefix: bool = True, window: int = 0,
                   softcap: float = 0.0, bf16_products: bool = False) -> tuple[Tensor, Tensor]:
    """The attention of the target's verify pass: n new tokens (a chain or a draft tree) attend a
    static KV cache that already holds their own keys and values.

    Args:
        q: [B, n, Hq, D] float (n <= 64), the new tokens' queries.
        k_cache, v_cache: [B, Hkv, S, D], q's dtype (on CPU, float32 q also over float16 or bfloat16
            caches), one layer's cache; Hq % Hkv == 0 and query head h
            reads kv head ``h // (Hq // Hkv)`` (GQA). Positions ``[0, cache_len[b])`` are the
            committed prefix; the new token j sits at ``cache_len[b] + j``; ``cache_len[b] + n <= S``.
        cache_len: int64 [B].
        tree_mask_packed: int64 [B, n]; bit j of row i is set iff query i may attend new token j
            (``build_tree``'s output; a causal chain is bits 0..i). Bits >= n are ignored.
        scale: softmax scale (e.g. ``1 / sqrt(D)``).
        include_prefix: True: query i attends the prefix keys and its allowed new keys; False: only
            its allowed new keys (to be merged with a prefix part by ``merge_attention``).
        window: 0, or a sliding window of that many positions (Mistral, Gemma's local layers): query
            i, at position ``cache_len[b] + depth_i`` (depth_i = the number of bits set in its mask
            row, less one: its ancestors), attends only keys at positions > its own - window; the
            prefix key in slot s is at position s, new token j at ``cache_len[b] + depth_j``.
        softcap: 0, or attention logit soft-capping (Gemma 2): each score s = scale * q.k becomes
            softcap * tanh(s / softcap) before the mask and the softmax.
        bf16_products: (bfloat16 caches; float32 or bfloat16 q) the products are of bfloat16 values:
            ``scale * log2(e) * q`` is rounded to bfloat16 (the scores in base 2), and so is each
            probability ``2^(s - max)`` before it is summed and multiplies its value; any value below
            2^-50 in magnitude counts as 0 (the CPU kernel then computes the same bits on every path:
            the products are exact in float32, and vdpbf16ps meets no denormal).
    Returns:
        out: [B, n, Hq, D] in q's dtype, ``softmax(scale * q k^T) v`` over the attended keys
            (float32 math); a row that attends no key is 0.
        lse: float32 [B, Hq, n], the natural log of ``sum exp(scale * q k)`` over the attended keys
            (-inf when there are none).
    """
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"tree_attention: q must be [B, n, Hq, D] and k_cache, v_cache [B, Hkv, S, D], got "
                         f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}")
    bsz, n, hq, d = q.shape
    hkv, seq = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] != bsz or k_cache.shape[3] != d or hq % hkv != 0:
        raise ValueError(f"tree_attention: k_cache {list(k_cache.shape)} does not fit q {list(q.shape)} "
                         f"(same B and D, Hq a multiple of Hkv)")
    if not 1 <= n <= MAX_TREE_NODES:
        raise ValueError(f"tree_attention: n must be in [1, {MAX_TREE_NODES}], got {n}")
    group = hq // hkv
    dev = q.device
    out = torch.zeros(bsz, n, hq, d, dtype=torch.float32, device=dev)
    lse = torch.full((bsz, hq, n), float("-inf"), dtype=torch.float32, device=dev)
    if window < 0:
        raise ValueError(f"tree_attention: window must be >= 0 (0: none), got {window}")
    if softcap < 0:
        raise ValueError(f"tree_attention: softcap must be >= 0 (0: none), got {softcap}")
    tree = unpack_tree_mask(tree_mask_packed.to(dev), n)
    depth = tree.sum(-1) - 1  # [B, n]: a token's mask row is its ancestors and itself
    for b in range(bsz):
        length = int(cache_len[b])
        if length < 0 or length + n > seq:
            raise ValueError(f"tree_attention: cache_len[{b}] = {length} with n = {n} new tokens: needs "
                             f"0 <= cache_len and cache_len + n <= S = {seq}")
        lo = 0 if include_prefix else length
        keys = k_cache[b, :, lo:length + n].float().repeat_interleave(group, 0)      # [Hq, K, D]
        values = v_cache[b, :, lo:length + n].float().repeat_interleave(group, 0)
        allowed = torch.cat([torch.ones(n, length - lo, dtype=torch.bool, device=dev), tree[b]], 1)  # [n, K]
        if window > 0:
            key_pos = torch.cat([torch.arange(lo, length, device=dev), length + depth[b]])        # [K]
            allowed &= key_pos[None, :] > (length + depth[b])[:, None] - window
        if bf16_products:
            if k_cache.dtype != torch.bfloat16 or q.dtype == torch.float16:
                raise ValueError(f"tree_attention: bf16_products=True needs bfloat16 caches and float32 or bfloat16 "
                                 f"q, got q {q.dtype} over {k_cache.dtype} caches")
            log2e = 1.4426950408889634
            keys, values = _bf16_flush(keys), _bf16_flush(values)
            q2 = _bf16_flush((q[b].float() * (scale * log2e)).to(torch.bfloat16).float())
            s2 = torch.einsum("ihd,hkd->hik", q2, keys)                                 # base-2 scores
            if softcap > 0:
                s2 = softcap * log2e * torch.tanh(s2 / (softcap * log2e))
            s2 = s2.masked_fill(~allowed, float("-inf"))
            mx = s2.amax(-1, keepdim=True)
            p = _bf16_flush(torch.exp2(s2 - torch.where(torch.isinf(mx), 0.0, mx)).to(torch.bfloat16).float())
            total = p.sum(-1)                                                           # [Hq, n]
            out[b] = torch.einsum("hik,hkd->ihd", p / total.clamp(min=1e-30)[..., None], values)
            lse[b] = torch.where(total > 0, (mx[..., 0] + torch.log2(total)) * math.log(2), float("-inf"))
            continue
        scores = torch.einsum("ihd,hkd->hik", q[b].float(), keys) * scale              # [Hq, n, K]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(scores, -1)                                           # [Hq, n]
        p = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        out[b] = torch.einsum("hik,hkd->ihd", p, values)
        lse[b] = row_lse
    return out.to(q.dtype), lse


def _bf16_flush(x: Tensor) -> Tensor:
    """float32 ``x`` with every value below 2^-50 in magnitude made 0 (tree_attention's bf16_products)."""
    return torch.where(x.abs() < 2.0 ** -50, torch.zeros((), dtype=x.dtype, device=x.device), x)


def merge_attention(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets by log-sum-exp.

    o1, o2: [B, n, Hq, D]; lse1, lse2: float32 [B, Hq, n] (-inf: that part attended no key).
    Returns (o [B, n, Hq, D] in o1's dtype, lse float32 [B, Hq, n]): the attention over the union of
    the key sets, ``o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2)`` computed stably; a row with
    both parts -inf is 0 with lse -inf.
    """
    lse1, lse2 = lse1.float(), lse2.float()
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), 0.0, m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    lse = torch.where(total > 0, m + torch.log(total), float("-inf"))
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    w1 = (w1 * inv).transpose(1, 2)[..., None]   # [B, n, Hq, 1]
    w2 = (w2 * inv).transpose(1, 2)[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype), lse
