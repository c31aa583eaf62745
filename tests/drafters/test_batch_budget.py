"""BatchBudget: the draft length of a batched step follows the measured cost of the pass and each
row's acceptance — long drafts when the pass costs little more with more tokens, none when every
token costs (a full compute-bound batch), probes while off; fixed when not adaptive."""
from __future__ import annotations

from turbospec.drafters.budget import BatchBudget


def geometric(accept: float):
    """k -> [E(0), ..., E(k)] of a drafter whose tokens are each accepted with probability ``accept``."""
    return lambda k: [(1.0 - accept ** (j + 1)) / (1.0 - accept) for j in range(k + 1)]


def drive(budget: BatchBudget, rows: int, accept: float, cost, steps: int = 200) -> list[int]:
    """Run ``steps`` choices with a synthetic pass cost ``cost(tokens)``; the chosen lengths."""
    ks = []
    for _ in range(steps):
        k = budget.choose(rows, 0, [(geometric(accept), 1e-5)] * rows)
        budget.record(rows * (k + 1), cost(rows * (k + 1)))
        ks.append(k)
    return ks


def test_cheap_tokens_long_drafts():
    # memory-bound pass: a token more costs 1% of the pass; acceptance 0.8 -> drafting pays
    ks = drive(BatchBudget(8), rows=1, accept=0.8, cost=lambda t: 0.01 * (1 + 0.01 * t))
    assert sum(ks[-50:]) / 50 >= 6


def test_compute_bound_full_batch_turns_drafting_off():
    # every token costs the same (a compute-bound target, 32 rows): drafts only add work
    ks = drive(BatchBudget(8), rows=32, accept=0.6, cost=lambda t: 0.001 * t)
    tail = ks[-100:]
    assert tail.count(0) >= 90  # off, apart from the probes
    assert 1 in tail  # ... which do happen


def test_load_shrinks_the_draft():
    # the pass costs a fixed part plus a part per token: the more rows, the shorter the best draft
    def cost(t):
        return 0.02 + 0.0015 * t
    best = {r: sorted(drive(BatchBudget(8), rows=r, accept=0.7, cost=cost)[-60:])[30] for r in (1, 4, 16, 32)}
    assert best[1] >= best[4] >= best[16] >= best[32]
    assert best[1] >= 3 and best[32] == 0


def test_low_acceptance_no_drafts():
    ks = drive(BatchBudget(8), rows=2, accept=0.02, cost=lambda t: 0.01 * (1 + 0.05 * t))
    assert ks[-100:].count(0) >= 90


def test_fixed_and_no_drafting_rows():
    b = BatchBudget(5, adaptive=False)
    assert b.choose(8, 0, [(geometric(0.1), 1.0)] * 8) == 5  # fixed: always max_draft
    assert BatchBudget(5).choose(4, 4, []) == 0  # nothing drafts
    assert BatchBudget(0).choose(1, 0, [(geometric(0.9), 0.0)]) == 0


def test_ragged_pass_costs_its_drafts_not_the_rectangle():
    """12 plain rows and 4 drafting ones (acceptance 0.9) on a pass that costs a fixed part plus a part
    per token: padded to the longest draft (16 x (k + 1) tokens) drafting does not pay; a ragged pass
    (CPU's eager pass: 12 + 4 x (k + 1) tokens) it does."""
    def cost(t):
        return 0.02 + 0.001 * t

    def run(ragged: bool) -> list[int]:
        b, ks = BatchBudget(6), []
        for _ in range(200):
            k = b.choose(16, 12, [(geometric(0.9), 1e-5)] * 4, ragged=ragged)
            tokens = 12 + 4 * (k + 1) if ragged else 16 * (k + 1)
            b.record(tokens, cost(tokens))
            ks.append(k)
        return ks[-100:]
    assert run(False).count(0) >= 90
    ragged = run(True)
    assert ragged.count(0) <= 10 and sorted(ragged)[50] >= 3
