"""Statistical losslessness tests for ``turbospec.ops.verify``.

Speculative sampling is *lossless*: whatever the drafts, the tokens a verify step emits must follow
the target's sampling distribution (``logits_to_probs(target_logits, T, top_k, top_p)``) exactly.

Model used to make the inputs (a tiny depth-indexed bigram "LM", vocabulary V = 12):

* target logits at a node of depth d holding token a: ``LT[d, a]`` (so, as for a real LM, the
  target at a node is a function of the tokens on its path, never of which node index it got:
  needed because sampled drafts land on different nodes in different rows);
* drafter logits at that node: ``LQ[d, a]`` (= LT plus noise, so drafts are often accepted); the
  drafter's q is ``logits_to_probs(LQ[d, a], DRAFT_TEMPERATURE_SCALE * T)`` (over-confident).

Two draft modes:

* ``"q"``: ``draft_probs`` given. For every parent node, its children's tokens are drawn from
  that q *without replacement*, in node order (sequential sampling: the next sibling from q with
  the earlier siblings removed and q renormalised), fresh per row, exactly as
  ``reference.verify``'s docstring specifies.
* ``"point"``: ``draft_probs=None``. Fixed drafts, identical in every row and chosen independently
  of the target's randomness: the children of a node are the top-k tokens of ``LQ[d, a]``.

What is checked, per row-batch of B independent rows (independent uniforms, fresh drafts):

1. Structure (exact, no statistics): accept_len >= 0; ``accept_len + 1`` emitted tokens then -1
   padding; the accepted path walks parent -> child and its tokens are the drafts; the final
   (recovered/bonus) token never equals a child of the last accepted node (a rejected draft has
   zero residual mass, and an un-rejected one would have been tried), so "t_{j} equals a child's
   token" <=> "t_{j} was accepted"; tokens that the target's filtered distribution gives
   probability 0 are never emitted.
2. Marginal of the first emitted token t0 = output_token_ids[:, 0]: Pearson chi-square against
   ``P0 = logits_to_probs(LT[0, root], T, top_k, top_p)``.
3. The two-token joint: P(t0, t1) = P0(t0) * P1(t1 | t0) where t1 exists exactly when t0 was
   accepted at a depth-1 node (1. makes this exact), and then t1 ~ target at that node, i.e.
   ``logits_to_probs(LT[1, t0])``. Given (2), the joint is checked by the conditional: among rows
   with accept_len >= 1, grouped by t0, t1 must follow ``logits_to_probs(LT[1, t0])``
   (a product-multinomial chi-square, statistics and degrees of freedom summed over the groups,
   Anderson-Goodman style). The same is done for every deeper position j (rows with
   accept_len >= j, grouped by t_{j-1}, against LT[j, t_{j-1}]) when enough rows reach it.

Thresholds: every chi-square p-value must be > ALPHA = 1e-5. Cells with expected count < 5 are
pooled (so the chi-square approximation holds); cells with expected probability exactly 0 are
checked exactly by (1). With ~100 p-values over the whole file, a correct implementation fails by
chance with probability < 1e-3 for a random seed; the seeds are fixed, so the test is deterministic.
(Calibration was checked when writing this file: over ~4000 p-values from 40 seeds per case, the
fractions below 0.05 / 0.01 / 0.001 were ~0.05 / ~0.01 / ~0.001.)

Power: ``test_negative_controls`` feeds the SAME inputs and the SAME checks to deliberately wrong
acceptance rules (an independent vectorised re-implementation of the algorithm with one bug
injected: accept every draft; after a rejection keep p instead of the residual; sample the final
token from q instead of the residual; treat sibling drafts as drawn with replacement; apply
top-k/top-p only to the final sample) and requires a chi-square p-value <= ALPHA (not merely a
structural violation); the same re-implementation without a bug must pass (positive control).

Sample sizes: the pure-torch reference verify is a Python loop (~0.1 ms per row), so on that path
B = B_REFERENCE rows per case; with a compiled kernel B = B_KERNEL. The negative controls use
B_REFERENCE, i.e. power is shown at the smaller of the two sample sizes.

Also: a greedy (temperature 0) test, deterministic, against the argmax walk.
"""
from __future__ import annotations

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "extension not built" warning: the reference path is tested too
    import turbospec  # noqa: F401
    from turbospec import ops
    from turbospec.ops.reference import logits_to_probs

scipy_stats = pytest.importorskip("scipy.stats")

ALPHA = 1e-5          # every chi-square p-value must exceed this
MIN_EXPECTED = 5.0    # Pearson cells with a smaller expected count are pooled
MIN_GROUP_ROWS = 30   # conditional groups with fewer rows are only checked structurally
B_REFERENCE = 8000    # rows per case on the pure-torch reference path (Python loop)
B_KERNEL = 100000     # rows per case when the compiled kernel runs verify
VOCAB = 12
ROOT_TOKEN = 3
# The drafter samples at this fraction of the target's temperature. A peaked q makes removing
# rejected siblings from q (without-replacement drafting) matter a lot, which gives the checks
# power against a kernel that forgets to renormalise q (the "with_replacement" negative control).
DRAFT_TEMPERATURE_SCALE = 0.6

TREES = {
    # chain of 4 drafts
    "chain": [-1, 0, 1, 2, 3],
    # root with 4 children; node 1 has children 5, 6; node 2 has child 7; node 5 has child 8
    "tree": [-1, 0, 0, 0, 0, 1, 1, 2, 5],
}
TEMPERATURES = [0.7, 1.0]
FILTERS = {"none": (0, 1.0), "top_k5": (5, 1.0), "top_p0.8": (0, 0.8)}
DRAFT_MODES = ["q", "point"]
DEVICES = ["cpu", "cuda"]


def _device_or_skip(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return torch.device(device)


def _rows_for(device: torch.device) -> int:
    return B_KERNEL if ops.kernels_available().get(device.type, False) else B_REFERENCE


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
class Case:
    """One verify problem replicated over B rows, plus what is needed to compute expectations."""

    def __init__(self, tree: str, draft_mode: str, temperature: float, top_k: int, top_p: float,
                 bsz: int, seed: int):
        self.tree, self.draft_mode = tree, draft_mode
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        par = TREES[tree]
        n, v = len(par), VOCAB
        self.parents_list = par
        self.children = [[c for c in range(1, n) if par[c] == i] for i in range(n)]
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[par[i]] + 1
        self.depth = depth
        self.max_depth = max(depth)
        g = torch.Generator().manual_seed(seed)
        self.LT = torch.randn(self.max_depth + 1, v, v, generator=g) * 1.2
        self.LQ = self.LT + torch.randn(self.max_depth + 1, v, v, generator=g) * 0.7
        # the drafter's distribution q (unfiltered), over-confident: sampled at a lower temperature
        q_table = logits_to_probs(self.LQ, DRAFT_TEMPERATURE_SCALE * temperature)

        tokens = torch.full((bsz, n), -1, dtype=torch.int64)
        tokens[:, 0] = ROOT_TOKEN
        draft_probs = torch.zeros(bsz, n, v)
        for i in range(n):
            draft_probs[:, i] = q_table[depth[i], tokens[:, i]]  # parents come before children
            kids = self.children[i]
            if not kids:
                continue
            if draft_mode == "point":
                top = torch.topk(self.LQ[depth[i], tokens[:, i]], len(kids), dim=-1).indices
                tokens[:, kids] = top
            else:  # sequential sampling without replacement from q, in node order
                q = draft_probs[:, i].double().clone()
                for c in kids:
                    cdf = torch.cumsum(q / q.sum(-1, keepdim=True), -1)
                    u = torch.rand(bsz, 1, generator=g, dtype=torch.float64)
                    x = (cdf <= u).sum(-1).clamp(max=v - 1)
                    x = torch.where(q.gather(1, x[:, None])[:, 0] > 0, x, q.argmax(-1))
                    tokens[:, c] = x
                    q.scatter_(1, x[:, None], 0.0)
        if draft_mode == "point":
            assert bool((tokens == tokens[:1]).all())  # fixed drafts, the same in every row
        self.draft_token_ids = tokens
        self.draft_probs = draft_probs if draft_mode == "q" else None
        self.target_logits = self.LT[torch.tensor(depth)[None, :], tokens]  # [B, N, V]
        self.parents = torch.tensor(par, dtype=torch.int64).expand(bsz, n).contiguous()
        self.uniform = torch.rand(bsz, n, generator=g)  # float32 in [0, 1), independent per row

    def target_probs(self, depth: int, prev_token) -> torch.Tensor:
        """Expected distribution of the token emitted at a node of this depth holding prev_token."""
        return logits_to_probs(self.LT[depth, prev_token], self.temperature, self.top_k,
                               self.top_p).double()

    def run(self, verify_fn, device: torch.device):
        dp = None if self.draft_probs is None else self.draft_probs.to(device)
        outs = verify_fn(self.target_logits.to(device), self.parents.to(device),
                         self.draft_token_ids.to(device), dp, self.uniform.to(device),
                         self.temperature, self.top_k, self.top_p)
        return tuple(o.cpu() for o in outs)


def _case_seed(tree, draft_mode, temperature, filt) -> int:
    return (1000 * list(TREES).index(tree) + 100 * DRAFT_MODES.index(draft_mode)
            + 10 * TEMPERATURES.index(temperature) + list(FILTERS).index(filt) + 12345)


def _make_case(tree, draft_mode, temperature, filt, bsz) -> Case:
    top_k, top_p = FILTERS[filt]
    return Case(tree, draft_mode, temperature, top_k, top_p, bsz,
                _case_seed(tree, draft_mode, temperature, filt))


# ----------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------
def _pearson(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of one multinomial sample against ``probs``
    (support only: zero-probability cells are checked exactly elsewhere). Cells with an expected
    count < MIN_EXPECTED are pooled together (with the next smallest cells if the pool is still
    too small)."""
    n = float(counts.sum())
    support = probs > 0
    obs = counts[support].double()
    exp = probs[support].double() / probs[support].double().sum() * n
    order = torch.argsort(exp)
    obs, exp = obs[order].tolist(), exp[order].tolist()
    cells_o, cells_e = [], []
    pool_o = pool_e = 0.0
    for o, e in zip(obs, exp):
        if e < MIN_EXPECTED or pool_e and pool_e < MIN_EXPECTED:
            pool_o += o
            pool_e += e
        else:
            cells_o.append(o)
            cells_e.append(e)
    if pool_e > 0:
        if pool_e < MIN_EXPECTED and cells_e:  # merge the small pool into the smallest cell
            cells_o[0] += pool_o
            cells_e[0] += pool_e
        else:
            cells_o.append(pool_o)
            cells_e.append(pool_e)
    if len(cells_e) < 2:
        return 0.0, 0
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    return stat, len(cells_e) - 1


def _pvalue(stat: float, df: int) -> float:
    return 1.0 if df == 0 else float(scipy_stats.chi2.sf(stat, df))


def _analyse(case: Case, accept_len, accept_index, out) -> tuple[dict, list[str]]:
    """Return ({check name: (p-value, stat, df, n, max |empirical - expected|)}, [violations])."""
    bsz, n = out.shape
    v = VOCAB
    violations: list[str] = []
    pvals: dict[str, tuple] = {}
    drafts = case.draft_token_ids
    par = torch.tensor(case.parents_list)
    rows = torch.arange(bsz)
    pos = torch.arange(n)[None, :]

    # ---- structure (exact) -------------------------------------------------------------------
    if bool((accept_len < 0).any()):
        violations.append(f"{int((accept_len < 0).sum())} rows with accept_len < 0")
        return pvals, violations
    emitted = pos <= accept_len[:, None]
    if bool((out[emitted] < 0).any()) or bool((out[emitted] >= v).any()):
        violations.append("emitted token outside [0, V)")
    if bool((out[~emitted] != -1).any()) or bool((accept_index[~emitted] != -1).any()):
        violations.append("padding after accept_len + 1 entries is not -1")
    if bool((accept_index[:, 0] != 0).any()):
        violations.append("accept_index[:, 0] != 0")
    for j in range(1, n):
        live = accept_len >= j
        if not bool(live.any()):
            break
        node, prev = accept_index[live, j], accept_index[live, j - 1]
        if bool((node <= 0).any()) or bool((par[node.clamp(min=0)] != prev).any()):
            violations.append(f"accept_index[:, {j}] is not a child of accept_index[:, {j - 1}]")
            break
        if bool((out[live, j - 1] != drafts[rows[live], node]).any()):
            violations.append(f"output[:, {j - 1}] differs from the accepted draft token")
    last = accept_index[rows, accept_len]
    final = out[rows, accept_len]
    for i in range(n):
        kids = case.children[i]
        sel = last == i
        if kids and bool(sel.any()):
            clash = (drafts[sel][:, kids] == final[sel][:, None]).any(-1)
            if bool(clash.any()):
                violations.append(f"{int(clash.sum())} rows emit a recovered/bonus token equal to a "
                                  f"child draft of node {i} (a rejected draft must have no mass)")

    # ---- position 0: marginal ----------------------------------------------------------------
    p0 = case.target_probs(0, ROOT_TOKEN)
    t0 = out[:, 0].clamp(0, v - 1)
    counts = torch.bincount(t0, minlength=v).double()
    if bool((counts[p0 == 0] > 0).any()):
        violations.append(f"position 0 emits tokens the target gives probability 0: "
                          f"{(counts * (p0 == 0)).nonzero().flatten().tolist()}")
    stat, df = _pearson(counts, p0)
    dev = float((counts / bsz - p0).abs().max())
    pvals["t0"] = (_pvalue(stat, df), stat, df, bsz, dev)

    # ---- position j >= 1: conditional on t_{j-1} accepted at depth j -------------------------
    for j in range(1, case.max_depth + 1):
        live = accept_len >= j
        stat_sum, df_sum, n_used, dev = 0.0, 0, 0, 0.0
        prev, cur = out[live, j - 1], out[live, j].clamp(0, v - 1)
        for a in range(v):
            sel = prev == a
            m = int(sel.sum())
            if m == 0:
                continue
            pj = case.target_probs(j, a)
            counts = torch.bincount(cur[sel], minlength=v).double()
            if bool((counts[pj == 0] > 0).any()):
                violations.append(f"position {j} (after accepted token {a}) emits tokens the target "
                                  f"gives probability 0")
            if m < MIN_GROUP_ROWS:
                continue
            s, d = _pearson(counts, pj)
            stat_sum, df_sum, n_used = stat_sum + s, df_sum + d, n_used + m
            dev = max(dev, float((counts / m - pj).abs().max()))
        if n_used:
            pvals[f"t{j}|t{j - 1}"] = (_pvalue(stat_sum, df_sum), stat_sum, df_sum, n_used, dev)
    return pvals, violations


def _describe(pvals: dict) -> str:
    return "; ".join(f"{k}: p={p:.3g} (chi2={s:.1f}, df={d}, n={m}, max|dev|={dv:.4f})"
                     for k, (p, s, d, m, dv) in pvals.items())


# ----------------------------------------------------------------------------------------------
# losslessness of turbospec.ops.verify
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("filt", list(FILTERS))
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_verify_is_lossless(temperature, filt, tree, draft_mode, device):
    dev = _device_or_skip(device)
    case = _make_case(tree, draft_mode, temperature, filt, _rows_for(dev))
    accept_len, accept_index, out = case.run(ops.verify, dev)
    pvals, violations = _analyse(case, accept_len, accept_index, out)
    assert not violations, violations
    assert "t0" in pvals and "t1|t0" in pvals, pvals  # both the marginal and the joint are tested
    bad = {k: v for k, v in pvals.items() if not v[0] > ALPHA}
    assert not bad, f"not lossless (p <= {ALPHA}): {_describe(pvals)}"
    # the case is not degenerate: >= 2 tokens possible at the root, drafts both accepted and
    # rejected (so the conditional checks have data and the residual path is exercised)
    assert int((case.target_probs(0, ROOT_TOKEN) > 0).sum()) >= 2
    assert float((accept_len >= 1).double().mean()) > 0.02
    assert float((accept_len < case.max_depth).double().mean()) > 0.02


# ----------------------------------------------------------------------------------------------
# negative controls: the same checks must reject wrong acceptance rules
# ----------------------------------------------------------------------------------------------
def _simulate_verify(target_logits, parents, draft_token_ids, draft_probs, uniform, temperature,
                     top_k, top_p, bug: str | None = None):
    """Independent vectorised re-implementation of sampling verify (all rows share one tree),
    with an optional deliberate bug:

    * ``accept_all``: every first child is accepted (no acceptance test).
    * ``no_residual``: after a rejection p is kept instead of normalise(max(0, p - q)).
    * ``q_not_residual``: the final token after a rejection is sampled from the (original) q of the
      node instead of the residual (point mass: the last rejected draft is emitted).
    * ``with_replacement``: rejected siblings are not removed from q (q never renormalised).
    * ``filter_final_only``: the acceptance test and residual use the unfiltered target; top-k /
      top-p are applied only when sampling the final token.
    """
    bsz, n, v = target_logits.shape
    par = parents[0].tolist()
    children = [[c for c in range(1, n) if par[c] == i] for i in range(n)]
    filtered = logits_to_probs(target_logits, temperature, top_k, top_p).double()
    probs = logits_to_probs(target_logits, temperature).double() if bug == "filter_final_only" else filtered
    u = uniform.double()
    accept_len = torch.zeros(bsz, dtype=torch.int64)
    accept_index = torch.full((bsz, n), -1, dtype=torch.int64)
    accept_index[:, 0] = 0
    out = torch.full((bsz, n), -1, dtype=torch.int64)
    node = torch.zeros(bsz, dtype=torch.int64)
    active = torch.ones(bsz, dtype=torch.bool)
    for i in range(n):  # a row only moves to a child (larger index): one pass in node order
        idx = (active & (node == i)).nonzero().flatten()
        if idx.numel() == 0:
            continue
        m = idx.numel()
        p = probs[idx, i].clone()
        q0 = None if draft_probs is None else draft_probs[idx, i].double()
        q = None if q0 is None else q0.clone()
        decided = torch.zeros(m, dtype=torch.bool)
        nxt = torch.full((m,), -1, dtype=torch.int64)
        last_rej = torch.full((m,), -1, dtype=torch.int64)
        for c in children[i]:
            x = draft_token_ids[idx, c]
            und = ~decided
            qx = torch.ones(m, dtype=torch.float64) if q is None else q.gather(1, x[:, None])[:, 0]
            px = p.gather(1, x[:, None])[:, 0]
            acc = und.clone() if bug == "accept_all" else und & (u[idx, c] * qx < px)
            nxt[acc] = c
            decided |= acc
            rej = und & ~acc
            last_rej[rej] = x[rej]
            if bug != "no_residual":
                if q is None:
                    res = p.clone()
                    res.scatter_(1, x[:, None], 0.0)
                else:
                    res = torch.clamp(p - q, min=0.0)
                rs = res.sum(-1, keepdim=True)
                upd = rej & (rs[:, 0] > 0)
                p[upd] = (res / rs.clamp(min=1e-300))[upd]
            if q is not None and bug != "with_replacement":
                q2 = q.clone()
                q2.scatter_(1, x[:, None], 0.0)
                qs = q2.sum(-1, keepdim=True)
                q2 = torch.where(qs > 0, q2 / qs.clamp(min=1e-300), q2)
                q[rej] = q2[rej]
        # accepted rows move on
        a_rows = idx[decided]
        if a_rows.numel():
            out[a_rows, accept_len[a_rows]] = draft_token_ids[a_rows, nxt[decided]]
            accept_len[a_rows] += 1
            accept_index[a_rows, accept_len[a_rows]] = nxt[decided]
            node[a_rows] = nxt[decided]
        # the others stop: one sample from p (inverse CDF with uniform[:, 0])
        stop = ~decided
        s_rows = idx[stop]
        if s_rows.numel() == 0:
            continue
        dist = p[stop]
        if bug == "filter_final_only":
            dist = dist * (filtered[s_rows, i] > 0)
            dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, filtered[s_rows, i])
        if bug == "q_not_residual":
            rejected = last_rej[stop] >= 0
            if q0 is not None:
                dist = torch.where(rejected[:, None], q0[stop], dist)
            else:
                point = torch.zeros_like(dist)
                point.scatter_(1, last_rej[stop].clamp(min=0)[:, None], 1.0)
                dist = torch.where(rejected[:, None], point, dist)
        cdf = torch.cumsum(dist, -1)
        thr = u[s_rows, 0] * cdf[:, -1]
        t = (cdf <= thr[:, None]).sum(-1).clamp(max=v - 1)
        last_pos = v - 1 - torch.argmax((dist.flip(-1) > 0).to(torch.int64), -1)
        t = torch.where(dist.gather(1, t[:, None])[:, 0] > 0, t, last_pos)
        out[s_rows, accept_len[s_rows]] = t
        active[s_rows] = False
    return accept_len, accept_index, out


NEGATIVE_CONTROLS = [
    # (bug, tree, draft_mode, temperature, filter)
    ("accept_all", "chain", "point", 1.0, "none"),
    ("accept_all", "tree", "q", 0.7, "top_k5"),
    ("no_residual", "chain", "point", 1.0, "none"),
    ("no_residual", "chain", "q", 1.0, "none"),
    ("no_residual", "tree", "q", 0.7, "top_p0.8"),
    ("q_not_residual", "chain", "q", 1.0, "none"),
    ("q_not_residual", "tree", "point", 1.0, "top_k5"),
    ("q_not_residual", "tree", "q", 1.0, "none"),
    ("no_residual", "tree", "point", 1.0, "none"),
    ("with_replacement", "tree", "q", 1.0, "none"),
    ("with_replacement", "tree", "q", 0.7, "none"),
    ("with_replacement", "tree", "q", 1.0, "top_k5"),
    ("filter_final_only", "chain", "point", 1.0, "top_k5"),
    ("filter_final_only", "tree", "q", 0.7, "top_p0.8"),
]


@pytest.mark.parametrize("bug,tree,draft_mode,temperature,filt", NEGATIVE_CONTROLS)
def test_negative_controls(bug, tree, draft_mode, temperature, filt):
    """The checks of test_verify_is_lossless, on the same inputs with B = B_REFERENCE rows, must
    reject a wrong acceptance rule through a chi-square p-value <= ALPHA (not just a structural
    violation), and must accept the same re-implementation without the bug."""
    case = _make_case(tree, draft_mode, temperature, filt, B_REFERENCE)

    good = case.run(lambda *a: _simulate_verify(*a, bug=None), torch.device("cpu"))
    pvals, violations = _analyse(case, *good)
    assert not violations, violations
    assert all(v[0] > ALPHA for v in pvals.values()), _describe(pvals)

    wrong = case.run(lambda *a: _simulate_verify(*a, bug=bug), torch.device("cpu"))
    pvals, _ = _analyse(case, *wrong)
    assert min(v[0] for v in pvals.values()) <= ALPHA, (
        f"the test has no power against bug {bug!r}: {_describe(pvals)}")


# ----------------------------------------------------------------------------------------------
# greedy: deterministic argmax walk
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_is_argmax_walk(device, with_draft_probs):
    dev = _device_or_skip(device)
    g = torch.Generator().manual_seed(7)
    n, v = 5, VOCAB
    parents = torch.tensor([[-1, 0, 1, 2, 3]] * 4, dtype=torch.int64)
    logits = torch.randn(4, n, v, generator=g) * 3
    # row 3: ties at the maximum; greedy takes the first maximal index
    logits[3, :, :] = 0.0
    logits[3, :, 5] = logits[3, :, 9] = 2.0
    am = logits.argmax(-1)  # torch.argmax returns the first maximal index on CPU
    drafts = torch.zeros(4, n, dtype=torch.int64)
    drafts[:, 1:] = am[:, :-1]            # drafts match the argmax walk everywhere ...
    drafts[0, 3] = (am[0, 2] + 1) % v     # row 0: match, match, then differ -> accept_len 2
    drafts[1, 1] = (am[1, 0] + 3) % v     # row 1: first draft differs -> accept_len 0
    #                                       row 2: all match -> accept_len 4, bonus token
    drafts[3, 3] = 9                      # row 3: ties; 5 == argmax, 9 is the second maximum
    drafts[:, 0] = ROOT_TOKEN
    expect_len = torch.tensor([2, 0, 4, 2])
    draft_probs = torch.softmax(torch.randn(4, n, v, generator=g), -1) if with_draft_probs else None
    uniform = torch.rand(4, n, generator=g)
    accept_len, accept_index, out = ops.verify(
        logits.to(dev), parents.to(dev), drafts.to(dev),
        None if draft_probs is None else draft_probs.to(dev), uniform.to(dev), 0.0, 5, 0.8)
    accept_len, accept_index, out = accept_len.cpu(), accept_index.cpu(), out.cpu()
    assert accept_len.tolist() == expect_len.tolist()
    for b in range(4):
        k = int(expect_len[b])
        assert accept_index[b].tolist() == list(range(k + 1)) + [-1] * (n - k - 1)
        assert out[b].tolist() == am[b, : k + 1].tolist() + [-1] * (n - k - 1)
    assert out[3, :3].tolist() == [5, 5, 5]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tree_takes_matching_sibling(device):
    """Greedy over a tree: the walk moves to the first child (in node order) matching the argmax."""
    dev = _device_or_skip(device)
    g = torch.Generator().manual_seed(11)
    par = [-1, 0, 0, 0, 2, 2, 5]
    n, v = len(par), VOCAB
    logits = torch.randn(1, n, v, generator=g) * 3
    am = logits.argmax(-1)[0].tolist()
    drafts = torch.tensor([[ROOT_TOKEN, (am[0] + 1) % v, am[0], am[0],  # node 2 is the first match
                            (am[2] + 2) % v, am[2],                      # node 5 matches
                            (am[5] + 1) % v]])                           # node 6 does not
    accept_len, accept_index, out = ops.verify(
        logits.to(dev), torch.tensor([par]).to(dev), drafts.to(dev), None,
        torch.rand(1, n, generator=g).to(dev), 0.0, 0, 1.0)
    assert accept_len.cpu().tolist() == [2]
    assert accept_index.cpu()[0].tolist() == [0, 2, 5, -1, -1, -1, -1]
    assert out.cpu()[0].tolist() == [am[0], am[2], am[5], -1, -1, -1, -1]


# ----------------------------------------------------------------------------------------------
# logit processing: penalties counted per path token (and bias, min_p, a per-node bitmask)
# ----------------------------------------------------------------------------------------------
class ProcessedCase:
    """A ``Case`` whose target is processed (``reference.verify``): the request has generated
    ``base`` tokens (the root token among them) and has a prompt; presence / frequency / repetition
    penalties (``"penalties"``), plus a logit bias, min_p and an allowed-token bitmask that depends on
    a node's depth and token, as a grammar's state would (``"all"``). The expected distribution of
    the token after the prefix t_0 .. t_{j-1} is the processed target at depth j holding t_{j-1},
    with counts ``base`` + the prefix's tokens: it depends on the whole prefix."""

    def __init__(self, tree: str, draft_mode: str, features: str, bsz: int, seed: int):
        from turbospec.ops import reference
        self.reference = reference
        self.case = Case(tree, draft_mode, 1.0, 0, 1.0, bsz, seed)
        g = torch.Generator().manual_seed(seed + 1)
        v, c = VOCAB, self.case
        self.base = (torch.randint(0, 3, (v,), generator=g) * (torch.rand(v, generator=g) < 0.4)).to(torch.int32)
        self.base[ROOT_TOKEN] += 1
        self.prompt = torch.rand(v, generator=g) < 0.3
        self.presence, self.frequency, self.repetition = 1.0, 0.7, 1.4
        self.bias = torch.zeros(v)
        self.min_p = 0.0
        self.allowed = torch.ones(c.max_depth + 1, v, v, dtype=torch.bool)
        if features == "all":
            self.bias = torch.randn(v, generator=g)
            self.min_p = 0.03
            self.allowed = torch.rand(c.max_depth + 1, v, v, generator=g) < 0.7
            self.allowed.scatter_(2, c.LT.argmax(-1, keepdim=True), True)  # never nothing
        depth = torch.tensor(c.depth)
        self.kw = dict(output_counts=self.base.expand(bsz, v).contiguous(),
                       prompt_mask=self.prompt.expand(bsz, v).contiguous(),
                       presence_penalty=self.presence, frequency_penalty=self.frequency,
                       repetition_penalty=self.repetition, logit_bias=self.bias.expand(bsz, v).contiguous(),
                       min_p=self.min_p,
                       token_bitmask=reference.pack_token_bitmask(self.allowed[depth[None, :], c.draft_token_ids]))

    def processed(self, logits, counts, allowed):
        r = self.reference
        rows = logits.shape[0]
        return r.process_logits(logits, counts, self.prompt.expand(rows, VOCAB), torch.full((rows,), self.presence),
                                torch.full((rows,), self.frequency), torch.full((rows,), self.repetition),
                                self.bias.expand(rows, VOCAB), allowed)

    def target_probs(self, prefix: list[int]) -> torch.Tensor:
        j = len(prefix)
        last = prefix[-1] if prefix else ROOT_TOKEN
        counts = self.base.long() + torch.bincount(torch.tensor(prefix, dtype=torch.int64), minlength=VOCAB)
        x = self.processed(self.case.LT[j, last][None], counts[None], self.allowed[j, last][None])
        return logits_to_probs(x, 1.0, 0, 1.0, self.min_p)[0].double()

    def once_per_step_logits(self) -> torch.Tensor:
        """The bug other engines have: every node penalised with the step's committed counts only
        (the drafts on its path not counted); bias and bitmask per node as they should be."""
        c = self.case
        bsz, n, v = c.target_logits.shape
        allowed = self.reference.unpack_token_bitmask(self.kw["token_bitmask"], v)
        return self.processed(c.target_logits.reshape(-1, v), self.base.long().expand(bsz * n, v),
                              allowed.reshape(-1, v)).view(bsz, n, v)

    def analyse(self, accept_len, out) -> tuple[dict, list[str]]:
        """Chi-square of t0, then of t_j given the whole prefix t_0 .. t_{j-1} (j = 1, 2; groups of
        >= MIN_GROUP_ROWS rows, statistics summed); tokens of probability 0 never emitted."""
        pvals, violations = {}, []
        if bool((accept_len < 0).any()):
            return pvals, [f"{int((accept_len < 0).sum())} invalid rows"]
        for j in range(0, min(3, self.case.max_depth + 1)):
            live = accept_len >= j
            prefixes = out[live, :j]
            cur = out[live, j]
            stat_sum, df_sum, used = 0.0, 0, 0
            groups = torch.unique(prefixes, dim=0) if j else torch.zeros(1, 0, dtype=torch.int64)
            for pre in groups:
                sel = (prefixes == pre).all(-1) if j else torch.ones(cur.shape[0], dtype=torch.bool)
                m = int(sel.sum())
                probs = self.target_probs(pre.tolist())
                counts = torch.bincount(cur[sel], minlength=VOCAB).double()
                if bool((counts[probs == 0] > 0).any()):
                    violations.append(f"position {j} after {pre.tolist()} emits a token of probability 0")
                if m < MIN_GROUP_ROWS:
                    continue
                s, d = _pearson(counts, probs)
                stat_sum, df_sum, used = stat_sum + s, df_sum + d, used + m
            if used:
                pvals[f"t{j}|prefix"] = (_pvalue(stat_sum, df_sum), stat_sum, df_sum, used, 0.0)
        return pvals, violations


PROCESSED_CASES = [("chain", "point", "penalties"), ("tree", "q", "penalties"), ("chain", "q", "all"),
                   ("tree", "point", "all")]


@pytest.mark.parametrize("tree,draft_mode,features", PROCESSED_CASES)
def test_verify_with_processing_is_lossless(tree, draft_mode, features):
    """verify with penalties (and bias, min_p, a per-node bitmask) emits tokens from the processed
    target with the prefix's own counts, at every position; the same checks reject the
    penalties-once-per-step bug and accept a correct independent pre-processing (controls)."""
    if not ops.kernels_available()["cpu"]:
        pytest.skip("needs the CPU kernel (B_KERNEL rows)")
    seed = 777 + 10 * PROCESSED_CASES.index((tree, draft_mode, features))
    pc = ProcessedCase(tree, draft_mode, features, B_KERNEL, seed)
    c = pc.case
    args = (c.target_logits, c.parents, c.draft_token_ids, c.draft_probs, c.uniform, 1.0, 0, 1.0)
    accept_len, _, out = ops.verify(*args, **pc.kw)
    pvals, violations = pc.analyse(accept_len, out)
    assert not violations, violations
    assert {"t0|prefix", "t1|prefix", "t2|prefix"} <= set(pvals), pvals
    assert all(v[0] > ALPHA for v in pvals.values()), f"not lossless: {_describe(pvals)}"
    assert float((accept_len >= 2).double().mean()) > 0.001  # >= 100 rows reach depth 2
    # positive control: the reference's per-node processing done outside, the rest as plain verify
    pre = pc.reference.verify_processed_logits(c.target_logits, c.parents, c.draft_token_ids,
                                               **{k: v for k, v in pc.kw.items() if k != "min_p"})
    accept_len, _, out = ops.verify(pre, *args[1:], min_p=pc.min_p)
    pvals, violations = pc.analyse(accept_len, out)
    assert not violations and all(v[0] > ALPHA for v in pvals.values()), _describe(pvals)
    # negative control: penalties counted once per step (the path's drafts not counted)
    accept_len, _, out = ops.verify(pc.once_per_step_logits(), *args[1:], min_p=pc.min_p)
    pvals, _ = pc.analyse(accept_len, out)
    assert min(v[0] for v in pvals.values()) <= ALPHA, f"no power against once-per-step penalties: {_describe(pvals)}"
