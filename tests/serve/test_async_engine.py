"""AsyncEngine: requests submitted from asyncio while others decode, each equal to itself alone;
cancellation frees the slot; a full queue is refused; a failing step fails only its requests."""
from __future__ import annotations

import asyncio

import pytest

from turbospec import Engine, Request
from turbospec.serve import AsyncEngine, QueueFullError

from helpers import make_tiny_model, make_tiny_tokenizer


N_NEW = 24


@pytest.fixture(scope="module")
def engine():
    # adaptive=False: every step drafts (the tests check that drafts take part; the load-aware
    # budget, which may switch drafting off on timings, has its own tests)
    return Engine(make_tiny_model(), drafter="ngram", tokenizer=make_tiny_tokenizer(), max_batch=4,
                  max_seq_len=256, adaptive=False)


def prompt(i: int) -> str:
    # repeats inside each prompt, so that prompt lookup proposes (and some drafts are accepted)
    words = [f"w{(i * 11 + j * 5) % 256}" for j in range(3 + i % 4)]
    return " ".join(words * 3)


def run(coro):
    return asyncio.run(coro)


def test_concurrent_streams_equal_alone(engine):
    """12 requests through 4 slots, arriving at different times: each stream's text and ids equal the
    request decoded alone (greedy and seeded sampling); the streamed text equals the final text."""
    reqs = [Request(prompt(i), max_new_tokens=N_NEW - i, temperature=0.0 if i % 3 else 0.9, seed=100 + i)
            for i in range(12)]
    alone = [engine.generate(r.prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=r.seed)
             for r in reqs]

    async def main():
        async with AsyncEngine(engine) as served:
            async def one(i, r):
                await asyncio.sleep(0.003 * i)  # staggered arrivals: joins while others decode
                parts, ids, last = [], [], None
                async for d in served.stream(r):
                    parts.append(d.text)
                    ids.extend(d.token_ids)
                    last = d
                return "".join(parts), ids, last
            out = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
            return out, served.counters
    out, counters = run(main())
    for (txt, ids, last), a in zip(out, alone):
        assert ids == a.token_ids == last.generation.token_ids
        assert txt == a.text == last.generation.text
        assert last.finish_reason == a.finish_reason
    assert counters.tokens == sum(len(a.token_ids) for a in alone)
    assert counters.finished == {"length": 12}
    assert counters.draft_accepted > 0  # the drafts really took part


def test_stop_string_stream(engine):
    full = engine.generate(prompt(1), max_new_tokens=N_NEW)
    words = full.text.split()
    stop = " " + words[5]
    want = engine.generate(prompt(1), max_new_tokens=N_NEW, stop=stop)
    assert want.finish_reason == "stop"

    async def main():
        async with AsyncEngine(engine) as served:
            parts, last = [], None
            async for d in served.stream(prompt(1), max_new_tokens=N_NEW, stop=stop):
                parts.append(d.text)
                last = d
            return "".join(parts), last
    txt, last = run(main())
    assert txt == want.text and stop not in txt
    assert last.finish_reason == "stop"


def test_cancel_frees_the_slot(engine):
    """Leaving the ``async for`` cancels the request: counted as aborted, slot free, next one runs."""
    async def main():
        async with AsyncEngine(engine) as served:
            n = 0
            async for _ in served.stream(prompt(2), max_new_tokens=200):
                n += 1
                if n == 2:
                    break
            for _ in range(200):
                if served.running == 0:
                    break
                await asyncio.sleep(0.01)
            running = served.running
            g = await served.generate(prompt(3), max_new_tokens=8)
            return running, served.counters.finished, g
    running, finished, g = run(main())
    assert running == 0
    assert finished.get("abort") == 1
    assert g.token_ids == engine.generate(prompt(3), max_new_tokens=8).token_ids


def test_queue_full_and_bad_requests(engine):
    async def main():
        async with AsyncEngine(engine, max_waiting=0) as served:
            with pytest.raises(ValueError, match="temperature"):
                served.submit(Request(prompt(0), temperature=-1.0))
            with pytest.raises(ValueError, match="max_new_tokens"):
                served.submit(Request(prompt(0), max_new_tokens=0))
            with pytest.raises(ValueError, match="exceeds the KV cache"):
                served.submit(Request(prompt(0), max_new_tokens=10_000))
            jobs = [served.submit(Request(prompt(i), max_new_tokens=100)) for i in range(4)]  # fill the 4 slots
            with pytest.raises(QueueFullError, match="max_waiting"):
                served.submit(Request(prompt(5), max_new_tokens=4))
            for job, _ in jobs:
                served.cancel(job)
            return served.counters
    run(main())
    with pytest.raises(ValueError, match="max_waiting"):
        AsyncEngine(engine, max_waiting=-1)


def test_failed_step_fails_its_requests_only(engine):
    """A step that raises (a bug, simulated) fails the requests in it; the engine keeps serving."""
    async def main():
        async with AsyncEngine(engine) as served:
            batch = served._sched.batch
            real = batch.step
            calls = {"n": 0}

            def flaky(rows, parked=None):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("simulated kernel failure")
                return real(rows, parked)
            batch.step = flaky
            try:
                with pytest.raises(RuntimeError, match="simulated kernel failure"):
                    await served.generate(prompt(4), max_new_tokens=8)
                g = await served.generate(prompt(4), max_new_tokens=8)
            finally:
                del batch.step
            return g, served.counters.finished
    g, finished = run(main())
    assert g.token_ids == engine.generate(prompt(4), max_new_tokens=8).token_ids
    assert finished == {"error": 1, "length": 1}


def test_closed_engine_refuses(engine):
    served = AsyncEngine(engine)

    async def main():
        with pytest.raises(RuntimeError, match="not running"):
            served.submit(Request(prompt(0)))
    run(main())


def test_steps_on_the_callers_thread(engine):
    """start(thread=False) + work(): the engine steps on the calling thread (the main thread in
    ``turbospec serve``) while the event loop runs on another; close() from the loop's thread ends
    work(), and a request submitted afterwards is refused with a clear error."""
    import threading
    served = AsyncEngine(engine).start(thread=False)
    assert served.started
    reqs = [Request(prompt(i), max_new_tokens=N_NEW, temperature=0.0) for i in range(6)]
    alone = [engine.generate(r.prompt, max_new_tokens=N_NEW).token_ids for r in reqs]
    result, stepped_on = {}, set()
    served.on_step = lambda outputs, seconds: stepped_on.add(threading.current_thread().name)

    async def clients():
        gens = await asyncio.gather(*(served.generate(r) for r in reqs))
        result["ids"] = [g.token_ids for g in gens]

    def loop_thread():
        try:
            asyncio.run(clients())
        finally:
            served.close()

    t = threading.Thread(target=loop_thread, name="loop")
    t.start()
    served.work()  # returns once close() ran on the loop thread
    t.join()
    assert result["ids"] == alone
    assert stepped_on == {threading.current_thread().name}
    assert not served.started

    async def late():
        return await served.generate(prompt(0), max_new_tokens=4)
    with pytest.raises(RuntimeError, match="not running"):
        run(late())
    with pytest.raises(RuntimeError, match=r"start\(thread=False\)"):
        served.work()


def test_long_prompt_joins_in_chunks_while_others_stream(engine):
    """A long prompt arriving while two requests stream is prefilled 8 tokens per step: the two
    keep getting tokens during its prefill (no stall of the whole prompt), and all three equal
    their solo outputs."""
    long_prompt = " ".join(f"w{(j * 7) % 256}" for j in range(150))
    reqs = [Request(prompt(1), max_new_tokens=N_NEW), Request(prompt(2), max_new_tokens=N_NEW),
            Request(long_prompt, max_new_tokens=8)]
    alone = [engine.generate(r.prompt, max_new_tokens=r.max_new_tokens).token_ids for r in reqs]
    engine.target_step.prefix_cache.clear()  # the long prompt is prefilled again, in chunks
    log = []  # per step: (requests decoding that got tokens, prompt tokens of the long one in the cache)

    def on_step(outputs, seconds):
        sched = served._sched
        log.append((sum(1 for o in outputs if o.tokens and o.job.index != 2),
                    [p[0] for p in sched.prefilling.values()]))

    served = AsyncEngine(engine, on_step=on_step, prefill_chunk=8)

    async def main():
        async with served:
            first = [asyncio.create_task(served.generate(r)) for r in reqs[:2]]
            while served.counters.tokens < 4:
                await asyncio.sleep(0.001)
            late = await served.generate(reqs[2])
            return [await t for t in first] + [late]
    gens = run(main())
    assert [g.token_ids for g in gens] == alone
    during = [got for got, parts in log if parts]  # steps while the long prompt was partly in
    assert len(during) >= 5 and all(got >= 1 for got in during)
    with pytest.raises(ValueError, match="prefill_chunk"):
        AsyncEngine(engine, prefill_chunk=0)
