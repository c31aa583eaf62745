"""Continuous batching over the target step (``decode.step.TargetStep``).

``Scheduler``: requests wait in order, take a free slot between steps (their prompt is prefilled
into it alone), and leave when they finish (or fail, or are cancelled), freeing the slot for the
next one; every step drafts for all decoding requests together and runs one verify pass over all of
them. ``run_batch`` drives it to the end for ``Engine.generate([...])``; the server's
``AsyncEngine`` drives it from a thread as requests arrive (``Engine.scheduler`` builds one).

A request's output does not depend on its neighbours (greedy: identical to decoding it alone;
seeded sampling: the same tokens as alone with the same seed): see ``decode.step``.
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..drafters.base import Drafter
from ..drafters.budget import BatchBudget
from ..ops.lockstep import drive
from ..ops import nvtx
from ..ops.checks import is_int
from .errors import NonFiniteLogitsError
from .loop import Sequence
from .step import TargetStep


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
    presence_penalty: float | None = None  # penalties, bias and min-p: see ``Engine.generate``
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict | None = None
    grammar: object = None  # structured output ({"json_schema": ...}, {"regex": ...}, ...; ``decode.grammar``)


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
    """Continuous batching over a ``TargetStep`` (its KV cache reserved for ``max_batch`` slots
    here): jobs wait in order, take a free slot between steps
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

    def __init__(self, step: TargetStep, drafter_for_slot: Callable[[int], Drafter | None],
                 budget: BatchBudget | None = None, prefill_chunk: int | None = None):
        if prefill_chunk is not None and (not is_int(prefill_chunk)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an integer >= 1 (prompt tokens per step), "
                             f"got {prefill_chunk!r}")
        step.reserve(step.max_batch)
        self.batch, self.drafter_for_slot, self.budget = step, drafter_for_slot, budget
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Job] = deque()
        self.free = list(range(step.max_batch))  # a heap: the lowest free slot is taken first
        self.active: dict[int, Job] = {}  # slot -> job, prefilling or decoding
        self.prefilling: dict[int, list] = {}  # slot -> [tokens in the cache, features so far, cached] (join order)

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
            self.prefilling[job.slot] = [0, [], None]  # tokens in the cache, their features, from the prefix cache
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
        if self.budget is not None:  # the pass's tokens: its drafts' (ragged), else rows x the longest
            sizes = [1 + (0 if j.seq.draft is None else len(j.seq.draft)) for j in decoding.values()]
            self.budget.record(sum(sizes) if self.batch.ragged else (max(decoding) + 1) * max(sizes), seconds)
        for slot, res in results.items():
            job = self.active[slot]
            if isinstance(res, Exception):
                self.leave(job, res)
                out.append(StepOutput(job, []))
                continue
            proposed = 0 if job.seq.draft is None else len(job.seq.draft)
            kept = job.seq.commit(res, verify_seconds=seconds)
            finished = job.seq.finish is not None
            out.append(StepOutput(job, kept, proposed, res.accepted, finished))
            if finished:
                self.batch.store_written(slot, job.seq)
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
                if state[2] is None and (budget is None or n <= budget):  # in one piece: as alone
                    if budget is not None:
                        budget -= n
                    job.seq.drafter = self.drafter_for_slot(slot) if job.speculate else None
                    job.seq.start(*self.batch.prefill(slot, ids), keep_features=self.batch.keeps_features)
                    del self.prefilling[slot]
                    continue
                if budget is not None and budget <= 0:
                    break
                if state[2] is None:  # its first chunk: the cached prefix first
                    state[0], f = self.batch.load_prefix(slot, ids)
                    state[2] = state[0]
                    if f is not None:
                        state[1].append(f)
                if state[0] < n:
                    end = n if budget is None else min(n, state[0] + budget)
                    f = self.batch.prefill_part(slot, ids, state[0], end)
                    if budget is not None:
                        budget -= end - state[0]
                    state[0] = end
                    if f is not None:
                        state[1].append(f)
                if state[0] == n:
                    del self.prefilling[slot]
                    features = torch.cat(state[1]) if state[1] else None
                    self.batch.store_prefix(slot, ids, features)
                    job.seq.drafter = self.drafter_for_slot(slot) if job.speculate else None
                    job.seq.start(n, features, state[2], keep_features=self.batch.keeps_features)
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
        return self.budget.choose(max(decoding) + 1, len(decoding) - len(drafting), drafting,
                                  ragged=self.batch.ragged)


def run_batch(sched: Scheduler, jobs: list[Job]) -> Iterator[tuple[int, list[int]]]:
    """Decode ``jobs`` to the end on ``sched``: yields (job index, kept tokens) after every step for
    every active job. A job's failure is raised here."""
    for job in jobs:
        sched.add(job)
    while sched.busy:
        for o in sched.step():
            if o.job.error is not None:
                raise o.job.error
            yield o.job.index, o.tokens
