"""``AsyncEngine``: an ``Engine`` serving many requests at once, for asyncio code (the HTTP server).

One worker (a thread of its own, or the thread that calls ``work()``; see below) owns the engine's
batch (``decode.batch.Scheduler``): requests submitted from the event loop join between steps,
every step runs one batched verify pass, and each request's new tokens go back to its own
``async for`` as they are accepted. A consumer that stops iterating
(a client that disconnects) cancels its request; its slot is free at the next step. A request's
failure (a bad draft, non-finite logits) ends that request with the error; the others go on.

    async with AsyncEngine(Engine(max_batch=16)) as served:
        async for delta in served.stream("Tell me a story", max_new_tokens=64):
            print(delta.text, end="", flush=True)

Each request decodes exactly as it would alone (greedy: the same tokens; seeded sampling: the same
tokens as alone with that seed): see ``decode.batch``.

Which thread steps. By default (``start()``) a worker thread of its own. On CPU, the fastest is the
thread that ran the process's earlier torch work (usually the main thread): torch's OpenMP keeps one
thread pool per thread that has run a parallel region, and once two pools share the cores, libgomp
stops spinning between regions, so every kernel pays a wake-up. Measured on 2 cores: a step of
SmolLM2 took 25 ms on a worker thread vs 11 ms on the main thread. ``start(thread=False)`` and then
``work()`` on that thread (with the event loop on another one) avoids it; ``turbospec serve`` and
``bench/bench_serve.py`` do this.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from ..decode import text
from ..decode.batch import Job, Request, Scheduler, StepOutput
from ..decode.engine import Engine
from ..decode.loop import Generation, draft_depth
from ..ops.checks import is_int


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows; try again later."""


@dataclass
class StreamDelta:
    """What one verify step added to a request: its new token ids and the text they complete (empty
    while a multi-byte character or a possible stop string is undecided, and without a tokenizer).
    The last delta of a request has ``finish_reason`` ("eos", "stop", "length") and ``generation``
    (the whole result with its statistics). ``logprobs``: the ``TokenLogprob`` of each of
    ``token_ids`` when the request asked for them."""
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    generation: Generation | None = None
    logprobs: list | None = None


@dataclass
class Counters:
    """What the worker has done since start (read by metrics; written by the worker thread only)."""
    steps: int = 0
    step_seconds: float = 0.0
    tokens: int = 0
    row_steps: int = 0                      # (request, verify step) pairs: tau = tokens / row_steps
    draft_proposed: int = 0
    draft_accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)   # by depth on the accepted path
    accepted_at: list[int] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)  # finish reason (and "abort", "error") -> count

    def record(self, outputs: list[StepOutput], seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds
        for o in outputs:
            if o.job.cancelled or o.job.error is not None:
                continue
            self.tokens += len(o.tokens)
            self.row_steps += 1
            self.draft_proposed += o.proposed
            self.draft_accepted += o.accepted
            depth = draft_depth(o.job.seq.draft)
            while len(self.proposed_at) < depth:
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            for i in range(depth):
                self.proposed_at[i] += 1
                self.accepted_at[i] += i < o.accepted

    def finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


class AsyncEngine:
    """Serve ``engine`` to asyncio code: ``stream`` (``async for`` over a request's deltas) and
    ``generate`` (await the whole ``Generation``). Up to ``engine.max_batch`` requests decode at
    once; up to ``max_waiting`` more wait in order (beyond that ``QueueFullError``). A prompt
    joining a running batch is prefilled ``prefill_chunk`` tokens per step (None: whole), so the
    running requests keep streaming meanwhile (``decode.batch.Scheduler``). ``on_step``
    (optional) is called by the worker after every step with (outputs, seconds).

    While an AsyncEngine runs, it owns the engine: don't call the engine's own ``generate`` then."""

    def __init__(self, engine: Engine, max_waiting: int = 64,
                 on_step: Callable[[list[StepOutput], float], None] | None = None, prefill_chunk: int | None = 256):
        if not is_int(max_waiting) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        # (checks prefill_chunk, and that the engine's drafter can serve a batch)
        self._sched: Scheduler = engine.scheduler(prefill_chunk)
        self.engine, self.max_waiting, self.on_step = engine, max_waiting, on_step
        self.prefill_chunk = prefill_chunk
        self.counters = Counters()
        self._inbox: deque[tuple[Job, Callable]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._started = False
        self._thread: threading.Thread | None = None  # the worker thread start() made, if it made one
        self._stopped = threading.Event()  # set when the worker loop has ended
        self._worker: threading.Thread | None = None  # the thread running work(), while it runs
        self._error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, thread: bool = True) -> "AsyncEngine":
        """Accept requests from now on; ``thread``: step on a worker thread of its own, else the
        caller runs ``work()`` on the thread that should step (see the module docstring)."""
        if not self._started:
            self._stop, self._started = False, True
            self._stopped.clear()
            if thread:
                self._thread = threading.Thread(target=self.work, name="turbospec-engine", daemon=True)
                self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._started

    def close(self) -> None:
        """Stop the worker (requests still running end with an error) and wait for it to end."""
        if self._started:
            self._stop = True
            self._wake.set()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            elif self._worker is not None and threading.current_thread() is not self._worker:
                self._stopped.wait()
            self._started = False

    async def __aenter__(self) -> "AsyncEngine":
        return self.start()

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    @property
    def running(self) -> int:
        """Requests holding a batch slot."""
        return len(self._sched.active)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet in a slot."""
        return len(self._inbox) + len(self._sched.waiting)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request: Request, chat: bool | None = None) -> tuple[Job, asyncio.Queue]:
        """Check ``request`` (ValueError naming the bad field), queue it (QueueFullError when
        ``max_waiting`` requests already wait) and return its job and the queue its steps arrive
        on: (tokens kept, done) per step. Call from the event loop; ``stream`` does this for you."""
        if not self._started:
            raise RuntimeError("the AsyncEngine is not running: call start() or use 'async with'")
        if self._error is not None:
            raise RuntimeError(f"the engine's worker stopped: {self._error!r}")
        job = self.engine.job(request, chat=chat)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        with self._lock:
            if self.waiting >= self.max_waiting + max(0, self.engine.max_batch - self.running):
                raise QueueFullError(f"{self.waiting} requests are already waiting (max_waiting "
                                     f"{self.max_waiting}); try again later")
            self._inbox.append((job, push))
        self._wake.set()
        return job, queue

    def cancel(self, job: Job) -> None:
        """Make ``job`` leave before the next step (any thread)."""
        job.cancel()
        self._wake.set()

    async def stream(self, prompt, *, chat: bool | None = None, **settings) -> AsyncIterator[StreamDelta]:
        """Decode ``prompt`` (text, messages, token ids or a ``Request``; ``settings`` are
        ``Request``'s fields) in the batch, yielding a ``StreamDelta`` per step that kept tokens.
        Leaving the ``async for`` early cancels the request. Raises ValueError for a bad request,
        QueueFullError when the queue is full, and the request's own error if it failed."""
        request = prompt if isinstance(prompt, Request) else Request(prompt, **settings)
        job, queue = self.submit(request, chat)
        async for delta in self.follow(job, queue):
            yield delta

    async def follow(self, job: Job, queue: asyncio.Queue) -> AsyncIterator[StreamDelta]:
        """The deltas of a ``submit``-ted job (see ``stream``; the server submits first, so that a
        bad request is answered before the response starts)."""
        tok = self.engine.tokenizer
        shown = None if tok is None else text.TextStream(tok, job.seq.stop.stop if job.seq.stop else [])
        out: list[int] = []
        ended = False
        try:
            while True:
                tokens, done = await queue.get()
                if job.error is not None:
                    ended = True
                    raise job.error
                if done and job.seq.finish is None:  # cancelled
                    ended = True
                    return
                out.extend(tokens)
                # (the worker recorded these tokens' log-probabilities before it sent them)
                lps = None if job.seq.token_logprobs is None else job.seq.token_logprobs[len(out) - len(tokens): len(out)]
                if not done:
                    delta = "" if shown is None else shown.push(out, None)
                    if tokens or delta:
                        yield StreamDelta(tokens, delta, logprobs=lps)
                    continue
                ended = True
                stop_end = job.seq.stats.get("stop_text_end")
                delta = "" if shown is None else shown.finish(out, stop_end)
                yield StreamDelta(tokens, delta, job.seq.finish, self.engine.generation(job, out), logprobs=lps)
                return
        finally:
            if not ended:
                self.cancel(job)

    async def generate(self, prompt, *, chat: bool | None = None, **settings) -> Generation:
        """Decode ``prompt`` in the batch and return its ``Generation``."""
        async for delta in self.stream(prompt, chat=chat, **settings):
            if delta.generation is not None:
                return delta.generation
        raise RuntimeError("the request ended without a result")  # not reached: the last delta has one

    # -- the worker ---------------------------------------------------------------------------
    def work(self) -> None:
        """The worker loop: step while requests are in, until ``close()``. ``start()`` runs it on a
        thread of its own; after ``start(thread=False)`` call it on the thread that should step."""
        if not self._started:
            raise RuntimeError("call start(thread=False) before work()")
        self._worker = threading.current_thread()
        subscribers: dict[int, Callable] = {}
        sched = self._sched
        try:
            while not self._stop:
                with self._lock:
                    while self._inbox:
                        job, push = self._inbox.popleft()
                        subscribers[id(job)] = push
                        sched.add(job)
                if not sched.busy:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                t = time.perf_counter()
                try:
                    outputs = sched.step()
                except Exception as e:  # not one request's fault (that fails only its job): a bug
                    # the running requests' state is unknown now: fail them, free their slots, keep serving
                    outputs = []
                    for job in list(sched.active.values()):
                        sched.leave(job, RuntimeError(f"the batch step failed: {e!r}"))
                        outputs.append(StepOutput(job, []))
                seconds = time.perf_counter() - t
                self.counters.record(outputs, seconds)
                if self.on_step is not None:
                    self.on_step(outputs, seconds)
                for o in outputs:
                    if o.done:
                        job = o.job
                        self.counters.finish("error" if job.error is not None else
                                             "abort" if job.cancelled and job.seq.finish is None else job.seq.finish)
                        subscribers.pop(id(job))((o.tokens, True))
                    else:
                        subscribers[id(o.job)]((o.tokens, False))
            reason = RuntimeError("the AsyncEngine was closed before the request finished")
        except BaseException as e:  # a bug in the worker itself: nothing can run any more
            self._error = reason = RuntimeError(f"the engine's worker stopped: {e!r}")
            raise
        finally:  # the requests still here end with an error rather than wait forever
            with self._lock:
                left = [(j, subscribers.pop(id(j), None)) for j in list(sched.active.values()) + list(sched.waiting)]
                left += list(self._inbox)
                self._inbox.clear()
            for job, push in left:
                job.error = reason
                if job.slot is not None:
                    sched.leave(job)
                if push is not None:
                    push(([], True))
            sched.waiting.clear()
            self._worker = None
            self._stopped.set()
