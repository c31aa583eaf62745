"""A batch's drafting in lockstep (turbospec.ops.lockstep): the requests' shared-weight products
go in one call per round, and every request gets exactly the drafts it gets alone."""
from __future__ import annotations

import pytest
import torch

from turbospec.decode.loop import Sequence
from turbospec.ops.lockstep import Rows, drive, run_one
from turbospec.drafters.tree import DraftLMHead
from turbospec.heads.eagle import EagleHead

from helpers import N_NEW, PROMPT, engine, make_head


class Counting:
    """A row-wise op (x @ w) that records the row count of every call."""

    def __init__(self, w: torch.Tensor):
        self.w, self.calls = w, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return x @ self.w


def proposal(ops, xs, fail_at=None):
    """Asks ``ops[i](xs[i])`` in turn; returns the sums of the answers (raises at round ``fail_at``)."""
    total = []
    for r, (op, x) in enumerate(zip(ops, xs)):
        if r == fail_at:
            raise ValueError(f"bad proposal at round {r}")
        total.append(float((yield Rows(op, x)).sum()))
    return total


def test_drive_groups_requests_by_op_and_returns_what_each_alone_returns():
    g = torch.Generator().manual_seed(0)
    a, b = Counting(torch.randn(4, 3, generator=g)), Counting(torch.randn(4, 5, generator=g))
    plans = [([a, b, a], [torch.randn(n, 4, generator=g) for n in (2, 1, 3)]),
             ([a, a], [torch.randn(n, 4, generator=g) for n in (1, 4)]),
             ([b], [torch.randn(3, 4, generator=g)]),
             ([], [])]
    alone = [run_one(proposal(*p)) for p in plans]
    a.calls.clear(), b.calls.clear()
    together = drive([proposal(*p) for p in plans])
    for x, y in zip(together, alone):
        assert x == pytest.approx(y, rel=1e-6)
    # round 1: a (2 + 1 rows) and b (3 rows); round 2: b (1) and a (4); round 3: a (3)
    assert a.calls == [3, 4, 3] and b.calls == [3, 1]
    assert together[3] == []


def test_drive_hands_back_one_proposals_failure_and_finishes_the_others():
    w = Counting(torch.eye(2))
    x = torch.ones(1, 2)
    out = drive([proposal([w, w], [x, x]), proposal([w, w], [x, x], fail_at=1), proposal([w], [x])])
    assert out[0] == [2.0, 2.0] and out[2] == [2.0]
    assert isinstance(out[1], ValueError) and "round 1" in str(out[1])


PROMPTS = [PROMPT, PROMPT[:7], PROMPT[5:], PROMPT[:12], PROMPT[2:9]]


def record_drafts(monkeypatch) -> dict[tuple, list]:
    """Every draft a sequence takes, per prompt, in step order (filled as generations run)."""
    drafts: dict[tuple, list] = {}
    take = Sequence._take

    def record(self, draft, k):
        drafts.setdefault(tuple(self.ids), []).append(
            None if draft is None else (draft.token_ids, draft.parents))
        return take(self, draft, k)
    monkeypatch.setattr(Sequence, "_take", record)
    return drafts


def count_rows(monkeypatch, cls, name: str, rows: list[int]) -> None:
    """Appends the row count of every call of the row-wise method ``cls.name`` to ``rows``."""
    fn = getattr(cls, name)

    def call(self, x):
        rows.append(x.shape[0])
        return fn(self, x)
    monkeypatch.setattr(cls, name, call)


def assert_batch_drafts_as_alone(eng, drafts: dict, counters: list[list[int]]) -> None:
    """``PROMPTS`` generated as one batch and each alone: the same tokens, the same drafts step by
    step (and more than 20 of them), and for every counter the same rows in fewer calls."""
    out = eng.generate(PROMPTS, max_new_tokens=N_NEW)
    batched, batched_calls = dict(drafts), [list(c) for c in counters]
    drafts.clear()
    for c in counters:
        c.clear()
    for p, g in zip(PROMPTS, out):
        assert g.token_ids == eng.generate(p, max_new_tokens=N_NEW).token_ids
    assert batched.keys() == drafts.keys()
    for p in PROMPTS:
        assert batched[tuple(p)] == drafts[tuple(p)], f"prompt {p}: drafts differ in the batch"
    assert sum(d is not None for p in PROMPTS for d in drafts[tuple(p)]) > 20
    for together, alone in zip(batched_calls, counters):
        assert sum(together) == sum(alone)          # the same rows ...
        assert len(together) < 0.6 * len(alone)    # ... in fewer calls: several requests per call


@pytest.mark.parametrize("weights", ["dense", "q4_0"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_batched_head_drafts_equal_the_drafts_alone(cyc, method, weights, monkeypatch):  # noqa: F811
    """Every request of a batch gets, step by step, the very drafts it gets decoded alone, while
    the batch computes the same LM-head rows in fewer calls; the slots share one head copy. With
    the head's linears quantized too (q4_0: the default on CPU), whose kernels are batch-invariant."""
    _, target, _, vocab = cyc
    drafts = record_drafts(monkeypatch)
    rows: list[int] = []
    layer_rows: list[int] = []  # the head layer's row-wise output side (o_proj, MLP)
    count_rows(monkeypatch, DraftLMHead, "__call__", rows)
    count_rows(monkeypatch, EagleHead, "logits", rows)
    count_rows(monkeypatch, EagleHead, "_output", layer_rows)
    head = make_head(method, target, vocab=vocab)
    eng = engine(target, method, head, vocab=vocab, max_seq_len=256, max_batch=4, num_draft=12, adaptive=False,
                 draft_weights=weights)
    assert_batch_drafts_as_alone(eng, drafts, [rows] if method == "medusa" else [rows, layer_rows])
    slots = [eng._slot_drafter(i) for i in range(4)]
    shared = "heads" if method == "medusa" else "head"
    assert all(getattr(d, shared) is getattr(slots[0], shared) for d in slots)
    if method != "medusa":
        assert len({id(d.kv) for d in slots}) == 4  # each request keeps its own head KV cache


def test_batched_draft_model_drafts_equal_the_drafts_alone(cyc, monkeypatch):  # noqa: F811
    """A draft model drafts for the whole batch with one forward per round (``DraftPool.step``):
    every request gets, step by step, the drafts it gets decoded alone, with fewer draft forwards;
    the slots share one pool, each in its own cache row."""
    from turbospec import Engine
    from turbospec.drafters.draft_model import DraftPool, layer_skip_draft
    _, target, _, _ = cyc
    drafts = record_drafts(monkeypatch)
    rows: list[int] = []
    count_rows(monkeypatch, DraftPool, "step", rows)
    eng = Engine(target, drafter="draft_model", draft_model=layer_skip_draft(target, 2), max_seq_len=256,
                 max_batch=4, num_draft=6, adaptive=False)
    eng.generate(PROMPT, max_new_tokens=4)
    assert eng.drafter.pool.cache.k[0].shape[0] == 1  # no batch yet: one row of draft cache
    drafts.clear(), rows.clear()
    assert_batch_drafts_as_alone(eng, drafts, [rows])
    slots = [eng._slot_drafter(i) for i in range(4)]
    assert all(d.pool is slots[0].pool for d in slots) and len({d.slot for d in slots}) == 4


def test_draft_pool_rows_equal_each_row_alone(cyc):  # noqa: F811
    """One ``DraftPool.step`` over rows feeding different token counts at different prefix lengths,
    with an idle slot riding along, gives each row the logits (bit for bit) and the cache the row
    gets fed alone; the idle slot's cache keeps what it held; bad requests name the limits."""
    from turbospec.drafters.draft_model import CHUNK, DraftPool
    _, target, _, _ = cyc
    g = torch.Generator().manual_seed(3)
    pools = [DraftPool(target, 64, 4) for _ in range(2)]
    prompts = {0: PROMPT[:9], 1: PROMPT[:4], 2: PROMPT[3:17], 3: PROMPT[:11]}
    for pool in pools:
        for slot, p in prompts.items():
            assert pool.acquire() == slot  # the cache grows 1 -> 2 -> 4 rows, keeping what they hold
            target.forward(torch.tensor([p]), torch.arange(len(p))[None], pool.cache.rows(slot, slot + 1), 0)
            pool.reset(slot, len(p))
        assert pool.acquire() is None and pool.cache.k[0].shape[0] == 4
    alone = target.new_cache(pools[0].cache.max_seq_len)
    target.forward(torch.tensor([prompts[0]]), torch.arange(9)[None], alone, 0)
    for a, b in zip(pools[0].cache.tensors(), alone.tensors()):
        assert torch.equal(a[0, :, :9], b[0, :, :9])  # slot 0 survived both growths
    feeds = {0: [5, 6, 7], 2: [9], 3: torch.randint(0, 200, (CHUNK,), generator=g).tolist()}  # slot 1 idle
    together = pools[0].step(torch.cat([DraftPool.request(s, len(prompts[s]), ids) for s, ids in feeds.items()]))
    for r, (s, ids) in enumerate(feeds.items()):
        alone = pools[1].step(DraftPool.request(s, len(prompts[s]), ids))
        assert torch.equal(together[r], alone[0]), f"slot {s}"
    for a, b in zip(pools[0].cache.tensors(), pools[1].cache.tensors()):
        for s, ids in feeds.items():
            n = len(prompts[s]) + len(ids)
            assert torch.equal(a[s, :, :n], b[s, :, :n])
        assert torch.equal(a[1, :, :len(prompts[1])], b[1, :, :len(prompts[1])])  # the idle slot
    end = pools[0].cache.max_seq_len
    with pytest.raises(ValueError, match=f"slot 0 asks for 2 tokens after {end - 1}"):
        pools[0].step(DraftPool.request(0, end - 1, [1, 2]))
    with pytest.raises(ValueError, match="slot 7 asks for 1 tokens after 0 .slots taken: 4"):
        pools[0].step(DraftPool.request(7, 0, [1]))
    with pytest.raises(ValueError, match="slots must be an integer >= 1"):
        DraftPool(target, 64, 0)
