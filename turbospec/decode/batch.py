"""Batched speculative decoding with continuous batching.

``BatchStep`` is the target side: a static KV cache of ``max_batch`` slots (a request keeps its slot
from prefill to finish; nothing is copied between slots) and one verify step over every slot: each
active request's root + drafts (a chain or a tree, its own length; shorter rows are padded with nodes
that attend only themselves and carry draft id -1, which ``verify`` never accepts), one fixed-shape
target pass (``Transformer.forward_static``: per-row prefix lengths), one ``verify`` with per-row
sampling parameters, one ``compact_kv``, one host read for all rows. The pass covers the slots up to
the highest active one (requests take the lowest free slot); idle slots below it ride along as
one-node padding rows. (A CUDA-graph build would bucket that row count as it buckets node counts.)

``Scheduler`` is continuous batching: requests wait in order, take a free slot between steps (their
prompt is prefilled into it alone), and leave when they finish (or fail, or are cancelled), freeing the
slot for the next one. ``run_batch`` drives it to the end for ``Engine.generate([...])``; the server's
``AsyncEngine`` drives it from a thread as requests arrive.

A request that asks for log-probabilities gets them for its accepted path's rows in the same host
read (``decode.step``; one float64 copy then), computed from its own rows with its own sampling
parameters; the others' rows are untouched.

Every row's numbers are its own: the linears, norms and attention reduce in one order per row
whatever else is in the pass, and a request's coins come from its own generator, so a request's
output does not depend on its neighbours (greedy: identical to decoding it alone; seeded sampling:
the same tokens as alone with the same seed).
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from .. import ops
from ..drafters.base import Drafter
from ..drafters.budget import BatchBudget
from ..heads.lockstep import drive
from ..model.runner import chain_mask_packed, pad_mask_packed
from ..model.transformer import Transformer
from ..ops import nvtx
from ..ops.reference import MAX_TREE_NODES
from ..ops.sampling import path_logprobs, read_logprobs
from .loop import Sequence
from .step import NonFiniteLogitsError, draft_depth, prefill
from ..ops.checks import is_int


class _Staging:
    """A batch step's host inputs, allocated once: flat buffers for ``max_batch`` rows of up to
    ``MAX_TREE_NODES`` nodes, each step viewing a contiguous [bsz, n] prefix (draft probabilities:
    grown to the largest [bsz, n, vocab] seen, then reused). Off the CPU the host buffers are pinned
    and ``to_device`` copies into device twins of the same layout, so a step allocates nothing on
    either side once warm (the host buffers are refilled only after the step's one host read, by
    which time the copies have completed)."""
    NODES = ("ids", "draft_ids", "parents", "positions", "packed")
    ROWS = ("cache_len", "temperature", "top_k", "top_p")
    DTYPES = dict(ids=torch.int64, draft_ids=torch.int64, parents=torch.int64, positions=torch.int64,
                  packed=torch.int64, uniform=torch.float32, cache_len=torch.int64, temperature=torch.float64,
                  top_k=torch.int64, top_p=torch.float64)

    def __init__(self, max_batch: int, device: torch.device):
        self.device = torch.device(device)
        self.pin = self.device.type != "cpu"
        size = {name: max_batch * (1 if name in self.ROWS else MAX_TREE_NODES) for name in self.DTYPES}
        self.host = {name: torch.empty(size[name], dtype=dt, pin_memory=self.pin) for name, dt in self.DTYPES.items()}
        self.dev = ({name: torch.empty(size[name], dtype=dt, device=self.device) for name, dt in self.DTYPES.items()}
                    if self.pin else {})
        self._probs = self._probs_dev = None

    def view(self, name: str, *shape: int) -> Tensor:
        numel = 1
        for d in shape:
            numel *= d
        return self.host[name][:numel].view(*shape)

    def probs(self, bsz: int, n: int, vocab: int) -> Tensor:
        numel = bsz * n * vocab
        if self._probs is None or self._probs.numel() < numel:
            self._probs = torch.empty(numel, pin_memory=self.pin)
            self._probs_dev = torch.empty(numel, device=self.device) if self.pin else None
        return self._probs[:numel].view(bsz, n, vocab)

    def to_device(self, name: str, host: Tensor) -> Tensor:
        """The device copy of ``view(name, ...)`` / ``probs(...)`` (``name`` "probs"); the view itself on CPU."""
        if not self.pin:
            return host
        buf = self._probs_dev if name == "probs" else self.dev[name]
        out = buf[:host.numel()].view(host.shape)
        out.copy_(host, non_blocking=True)
        return out


class BatchStep:
    """The target side of a batch of up to ``max_batch`` requests (see the module docstring)."""

    def __init__(self, target: Transformer, max_batch: int, max_seq_len: int, features=None,
                 node_argmax: bool = False):
        if not is_int(max_batch) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.target, self.max_batch, self.features = target, max_batch, features
        # the drafters read the target's argmax at every node (``Drafter.wants_node_argmax``)
        self.node_argmax = bool(node_argmax)
        # a step writes its padded nodes' K/V after a row's prefix: one tree's worth of slack
        self.cache = target.new_cache(max_seq_len + MAX_TREE_NODES, batch_size=max_batch)
        target.ensure_rope(self.cache.max_seq_len)
        self._chain = chain_mask_packed(MAX_TREE_NODES)[0]  # packed mask rows, built once
        self._pad = pad_mask_packed(MAX_TREE_NODES)[0]
        self._stage = _Staging(max_batch, target.device)

    def prefill(self, slot: int, ids: list[int]) -> tuple[int, Tensor | None]:
        """A joining request's prompt (all but its last token) into its slot, alone."""
        return prefill(self.target, self.cache.rows(slot, slot + 1), ids, self.features)

    @torch.inference_mode()
    def prefill_part(self, slot: int, ids: list[int], start: int, end: int) -> Tensor | None:
        """Prompt tokens ``ids[start:end]`` into the slot after the ``start`` already there (chunked
        prefill: the same K/V and features as one ``prefill``, since every token's numbers are the
        same whatever shares its pass). Returns their features [end - start, F] when the drafter reads
        them."""
        dev = self.target.device
        x = torch.tensor([ids[start:end]], dtype=torch.int64).to(dev)
        pos = torch.arange(start, end, device=dev)[None]
        out = self.target.forward(x, pos, self.cache.rows(slot, slot + 1), start, logits="none",
                                  features=self.features)
        return None if self.features is None else out[1][0]

    @torch.inference_mode()
    def step(self, rows: dict[int, Sequence], parked: dict[int, int] | None = None
             ) -> dict[int, tuple[list[int], int, Tensor | None, list[int] | None, list | None]]:
        """One verify pass over the planned drafts of ``rows`` (slot -> request). Returns, per slot,
        (emitted tokens, accepted drafts, the drafter's features of the root and the accepted nodes,
        the target's argmax at the root and each draft node when ``node_argmax`` is set, else None,
        the emitted tokens' ``TokenLogprob``s when the request asked for them, else None);
        a row whose logits were not finite gets a ``NonFiniteLogitsError`` in place of its tokens.
        ``parked``: slots holding a prompt being prefilled in chunks (slot -> tokens in the cache);
        when they ride along as padding rows, they write after their prefix, never over it."""
        # the pass covers slots [0, highest active slot]: idle slots below it ride along as one-node
        # padding rows, those above it cost nothing (the scheduler fills the lowest free slot first)
        bsz = max(rows) + 1
        n = max(1 + (0 if s.draft is None else len(s.draft)) for s in rows.values())
        st = self._stage
        ids, draft_ids, parents, positions, packed = (st.view(name, bsz, n) for name in _Staging.NODES)
        cache_len, temperature, top_k, top_p = (st.view(name, bsz) for name in _Staging.ROWS)
        uniform = st.view("uniform", bsz, n)
        ids.zero_()
        draft_ids.fill_(-1)
        draft_ids[:, 0] = 0
        parents.zero_()
        parents[:, 0] = -1
        positions.zero_()
        packed.copy_(self._pad[:n].expand(bsz, n))
        cache_len.zero_()
        uniform.zero_()
        # float64: the Python numbers exactly, as a request decoded alone passes them
        temperature.zero_()
        top_k.zero_()
        top_p.fill_(1.0)
        with_probs = any(s.draft is not None and s.draft.draft_probs is not None for s in rows.values())
        probs = st.probs(bsz, n, self.target.cfg.vocab_size).zero_() if with_probs else None
        trees = False
        path_len: dict[int, int] = {}  # rows that want log-probabilities -> the most nodes on their path
        for b, length in (parked or {}).items():
            if b < bsz:
                cache_len[b] = length
                positions[b] = length
        for b, s in rows.items():
            d = s.draft
            k = 0 if d is None else len(d)
            root = s.tokens[-1]
            ids[b, 0] = draft_ids[b, 0] = root
            cache_len[b] = s.cache_len
            if k:
                ids[b, 1:k + 1] = draft_ids[b, 1:k + 1] = torch.tensor(d.token_ids)
            if d is None or d.parents is None:
                parents[b, 1:k + 1] = torch.arange(k)
                depth = torch.arange(k + 1)
                packed[b, :k + 1] = self._chain[:k + 1]
            else:
                trees = True
                _, pk, depth, _ = ops.build_tree(torch.tensor([[-1] + d.parents]))
                depth = depth[0]
                parents[b, 1:k + 1] = torch.tensor(d.parents)
                packed[b, :k + 1] = pk[0]
            positions[b, :k + 1] = s.cache_len + depth
            if s.logprobs is not None:
                path_len[b] = draft_depth(d) + 1
            positions[b, k + 1:] = s.cache_len  # padding: the root's position (attends only itself)
            uniform[b, :k + 1] = s.uniform()
            temperature[b], top_k[b], top_p[b] = s.params.temperature, s.params.top_k, s.params.top_p
            if with_probs:
                if d is not None and d.draft_probs is not None:
                    probs[b, :k + 1] = d.draft_probs
                elif not s.params.greedy and k:
                    raise ValueError("a batch mixes sampled rows with point-mass drafts and rows with draft "
                                     "probabilities; verify takes one kind per pass")
        ids, positions, packed, cache_len_d = (st.to_device(name, t) for name, t in (
            ("ids", ids), ("positions", positions), ("packed", packed), ("cache_len", cache_len)))
        with nvtx.range("verify"):
            out = self.target.forward_static(ids, positions, self.cache.rows(0, bsz), cache_len_d, packed,
                                             self.features)
        logits, feats = (out, None) if self.features is None else out
        with nvtx.range("accept"):
            accept_len, accept_index, emitted = ops.verify(
                logits, st.to_device("parents", parents), st.to_device("draft_ids", draft_ids),
                None if probs is None else st.to_device("probs", probs), st.to_device("uniform", uniform),
                st.to_device("temperature", temperature), st.to_device("top_k", top_k), st.to_device("top_p", top_p))
            parts = (accept_len, emitted.flatten()) + ((logits.argmax(-1).flatten(),) if self.node_argmax else ())
            if not path_len:
                host = torch.cat(parts).tolist()  # the one host read of the step
            else:  # with the log-probabilities of the rows that asked: one float64 read
                lps = [path_logprobs(logits[b, accept_index[b, :m].clamp(min=0)], emitted[b, :m], rows[b].params,
                                     rows[b].logprobs) for b, m in path_len.items()]
                host = torch.cat([p.double() for p in parts] + lps).tolist()
                n_int = sum(p.numel() for p in parts)
                lp_host, lp_at, at = host[n_int:], {}, 0
                for b, t in zip(path_len, lps):
                    lp_at[b], at = at, at + t.numel()
                host = [int(v) for v in host[:n_int]]
        if trees:
            with nvtx.range("compact"):
                ops.compact_kv(self.cache.rows(0, bsz).tensors(), cache_len_d, accept_index, accept_len)
        results = {}
        for b in rows:
            n_acc = host[b]
            if n_acc < 0:  # this row's failure only: the scheduler fails its request, the others go on
                results[b] = (NonFiniteLogitsError(
                    f"the target produced non-finite logits (NaN/inf) for the request in slot {b} at position "
                    f"{rows[b].cache_len}; no token was emitted"), n_acc, None, None, None)
                continue
            toks = host[bsz + b * n: bsz + b * n + n_acc + 1]
            f = None if feats is None else feats[b, accept_index[b, : n_acc + 1]]
            amax = None
            if self.node_argmax:
                k = 0 if rows[b].draft is None else len(rows[b].draft)
                amax = host[bsz + bsz * n + b * n: bsz + bsz * n + b * n + k + 1]
            lp = None
            if b in path_len:
                lp = read_logprobs(lp_host[lp_at[b]:], toks, rows[b].params, rows[b].logprobs, logits.shape[-1])
            results[b] = (toks, n_acc, f, amax, lp)
        return results


@dataclass
class Request:
    """One request of a batch (``Engine.generate([...])``): the prompt (text, messages or token ids)
    and its own settings. None takes the value given to ``generate``."""
    prompt: object
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stop: object = None
    seed: int | None = None
    speculate: bool = True  # False: plain decoding for this request (no drafts)
    stop_token_ids: object = None  # token ids that end the request as EOS does (kept as its last token)
    logprobs: bool | None = None  # each token's log-probability on its Generation (``ops.sampling``)
    top_logprobs: int | None = None  # and this many alternatives (0-20; needs logprobs=True)


@dataclass
class Job:
    """A request in the scheduler: its index in the caller's list, its sequence, whether it drafts.
    The scheduler sets ``slot`` while it runs and ``error`` when it failed (its slot is freed, its
    neighbours go on); ``cancel()`` (any thread) makes it leave before the next step."""
    index: int
    seq: Sequence
    speculate: bool = True
    slot: int | None = None
    error: Exception | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def done(self) -> bool:
        """Finished or failed (a cancelled job leaves at the next step)."""
        return self.seq.finish is not None or self.error is not None


@dataclass
class StepOutput:
    """What one step did for one job: the tokens it kept (empty when it failed or was cancelled),
    the drafts it proposed, how many were accepted, and whether the job left the batch (finished,
    failed or cancelled: its last output)."""
    job: Job
    tokens: list[int]
    proposed: int = 0
    accepted: int = 0
    done: bool = True


class Scheduler:
    """Continuous batching over a ``BatchStep``: jobs wait in order, take a free slot between steps
    (their prompt is prefilled into it alone) and leave when finished, failed or cancelled, freeing
    the slot for the next one. ``drafter_for_slot(slot)`` gives the drafter of a drafting job in that
    slot (set on its sequence when it starts; a job with ``speculate=False`` gets none).

    ``prefill_chunk`` (tokens; None: a whole prompt at once) bounds the prompt tokens prefilled per
    step: a long prompt joining a running batch is written in chunks, one per step, so that the
    requests already decoding keep getting tokens (chunked prefill) instead of stalling for the
    whole prompt; while nobody decodes, prompts go in whole. The chunks give the same cache as one
    pass (batch-invariant kernels), so outputs do not change.

    One thread drives ``step``; ``add`` and ``Job.cancel`` may come from others between steps (a
    deque append and a flag). A failure that belongs to one job (its prompt, its drafter, its
    non-finite logits) fails that job only; anything else propagates."""

    def __init__(self, step: BatchStep, drafter_for_slot: Callable[[int], Drafter | None],
                 budget: BatchBudget | None = None, prefill_chunk: int | None = None):
        if prefill_chunk is not None and (not is_int(prefill_chunk)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an integer >= 1 (prompt tokens per step), "
                             f"got {prefill_chunk!r}")
        self.batch, self.drafter_for_slot, self.budget = step, drafter_for_slot, budget
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Job] = deque()
        self.free = list(range(step.max_batch))  # a heap: the lowest free slot is taken first
        self.active: dict[int, Job] = {}  # slot -> job, prefilling or decoding
        self.prefilling: dict[int, list] = {}  # slot -> [tokens in the cache, features so far] (in join order)

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def leave(self, job: Job, error: Exception | None = None) -> None:
        """``job`` leaves its slot (with ``error``: as failed)."""
        if error is not None:
            job.error = error
        if job.slot is not None:
            del self.active[job.slot]
            self.prefilling.pop(job.slot, None)
            heapq.heappush(self.free, job.slot)
            job.slot = None

    def step(self) -> list[StepOutput]:
        """Admit waiting jobs into free slots, prefill (a chunk of) joining prompts, run one verify
        step over the decoding jobs, commit."""
        out: list[StepOutput] = []
        for job in [j for j in self.active.values() if j.cancelled]:
            self.leave(job)
            out.append(StepOutput(job, []))
        while self.waiting and self.free:
            job = self.waiting.popleft()
            if job.cancelled:
                out.append(StepOutput(job, []))
                continue
            job.slot = heapq.heappop(self.free)
            self.active[job.slot] = job
            self.prefilling[job.slot] = [0, []]
        self._prefill(out)
        decoding = {slot: job for slot, job in self.active.items() if slot not in self.prefilling}
        k = self._draft_length(decoding)
        # Every request drafts at once: the head drafters' weight products go in one call per round
        # for the whole batch (lockstep); each request gets the drafts it would get alone.
        jobs = list(decoding.values())
        t = time.perf_counter()
        with nvtx.range("draft"):
            planned = drive([job.seq.plan_steps(k if self._budgeted(job) else None) for job in jobs])
        drafting = sum(1 for job in jobs if job.seq.drafter is not None)
        share = (time.perf_counter() - t) / max(1, drafting)
        for job, res in zip(jobs, planned):
            if isinstance(res, ValueError):  # a drafter's bad proposal (check_draft) fails its own request
                self.leave(job, res)
                out.append(StepOutput(job, []))
            elif isinstance(res, Exception):
                raise res
            else:
                job.seq.planned(share if job.seq.drafter is not None else 0.0)
        decoding = {slot: job for slot, job in decoding.items() if job.slot == slot}  # not failed
        if not decoding:
            return out
        t = time.perf_counter()
        parked = {slot: p[0] for slot, p in self.prefilling.items()}
        results = self.batch.step({slot: job.seq for slot, job in decoding.items()}, parked)
        seconds = time.perf_counter() - t
        if self.budget is not None:
            n = max(1 + (0 if j.seq.draft is None else len(j.seq.draft)) for j in decoding.values())
            self.budget.record((max(decoding) + 1) * n, seconds)
        for slot, (toks, n_acc, feats, node_argmax, lps) in results.items():
            job = self.active[slot]
            if isinstance(toks, Exception):
                self.leave(job, toks)
                out.append(StepOutput(job, []))
                continue
            proposed = 0 if job.seq.draft is None else len(job.seq.draft)
            kept = job.seq.commit(toks, n_acc, feats, verify_seconds=seconds, node_argmax=node_argmax,
                                  logprobs=lps)
            finished = job.seq.finish is not None
            out.append(StepOutput(job, kept, proposed, n_acc, finished))
            if finished:
                self.leave(job)
        return out


    def _prefill(self, out: list[StepOutput]) -> None:
        """Write joining prompts into their slots, in join order: whole while nobody decodes, else
        up to ``prefill_chunk`` tokens this step. A prompt fully in starts decoding (its drafter
        reads it) at this step's verify pass."""
        decoding = len(self.active) > len(self.prefilling)
        budget = self.prefill_chunk if (self.prefill_chunk is not None and decoding) else None
        for slot in list(self.prefilling):
            job = self.active[slot]
            state = self.prefilling[slot]
            ids = job.seq.ids
            n = len(ids) - 1  # every prompt token but the last (the first root)
            try:
                if state[0] == 0 and (budget is None or n <= budget):  # in one piece: as alone
                    if budget is not None:
                        budget -= n
                    job.seq.drafter = self.drafter_for_slot(slot) if job.speculate else None
                    job.seq.start(*self.batch.prefill(slot, ids))
                    del self.prefilling[slot]
                    continue
                if budget is not None and budget <= 0:
                    break
                end = n if budget is None else min(n, state[0] + budget)
                f = self.batch.prefill_part(slot, ids, state[0], end)
                if budget is not None:
                    budget -= end - state[0]
                state[0] = end
                if f is not None:
                    state[1].append(f)
                if end == n:
                    del self.prefilling[slot]
                    job.seq.drafter = self.drafter_for_slot(slot) if job.speculate else None
                    job.seq.start(n, torch.cat(state[1]) if state[1] else None)
            except (ValueError, NonFiniteLogitsError) as e:
                self.leave(job, e)
                out.append(StepOutput(job, []))

    def _budgeted(self, job: Job) -> bool:
        """Does the batch budget set this job's draft length? (Drafting rows whose lengths may follow
        timings; a seeded sampled request keeps its own untimed budget: output as alone.)"""
        return self.budget is not None and job.seq.drafter is not None and job.seq.budget.timed

    def _draft_length(self, decoding: dict[int, Job]) -> int | None:
        if self.budget is None or not decoding:
            return None
        drafting = [(j.seq.budget.expected_upto, j.seq.budget.draft_cost())
                    for j in decoding.values() if self._budgeted(j)]
        return self.budget.choose(max(decoding) + 1, len(decoding) - len(drafting), drafting)


def run_batch(step: BatchStep, jobs: list[Job], drafter_for_slot: Callable[[int], Drafter | None],
              budget: BatchBudget | None = None) -> Iterator[tuple[int, list[int]]]:
    """Decode ``jobs`` to the end with continuous batching (``Scheduler``): yields (job index, kept
    tokens) after every step for every active job. A job's failure is raised here."""
    sched = Scheduler(step, drafter_for_slot, budget)
    for job in jobs:
        sched.add(job)
    while sched.busy:
        for o in sched.step():
            if o.job.error is not None:
                raise o.job.error
            yield o.job.index, o.tokens
