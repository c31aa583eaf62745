"""``turbospec serve``: an OpenAI-compatible HTTP server over an ``AsyncEngine`` (FastAPI + uvicorn,
server-sent events for streaming, Prometheus metrics).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream or not; ``usage``;
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, ``n`` (1-16), ``logprobs``
(chat: with ``top_logprobs``; the log-probabilities of the distribution each token was drawn from,
the same with speculation as without; a stream's chunks carry those of their tokens),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``repetition_penalty``, ``min_p``, ``guided_json`` / ``guided_regex`` /
``guided_choice``, all exact under speculation; the extra field ``"speculate": false`` turns
speculation off for a request; any other field, or a field such as ``echo`` / ``tools`` at a value
that would change the output, gets a 400 naming it instead of being ignored), ``GET /v1/models``,
``GET /health``, ``GET /metrics``. A bad request gets the OpenAI error shape with status 400; a full
queue 429; a request that fails inside the engine 500 (or an error event in its stream). A client
that disconnects mid-stream cancels its request: its slot is free at the next step.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..decode import text
from ..decode.engine import Engine
from ..decode.errors import ContextLengthError
from . import protocol
from .async_engine import AsyncEngine, QueueFullError
from .metrics import ServerMetrics
from .protocol import APIError
from ..ops.checks import is_int


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


log = logging.getLogger("turbospec.serve")
MAX_BODY_BYTES = 4 << 20  # a request body past this gets 413 (the longest prompt a cache holds is far less)


def create_app(engine: Engine, model_name: str, max_waiting: int = 64, prefill_chunk: int | None = 256,
               api_key: str | None = None, protect_all: bool = False,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's FastAPI app; the engine's worker starts and stops with the app (``prefill_chunk``:
    see ``AsyncEngine``). ``api_key``: the /v1 endpoints answer 401 without ``Authorization: Bearer
    <api_key>`` (and /health and /metrics too with ``protect_all``). ``max_body_bytes``: larger
    request bodies get 413 before they are read whole."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string (or None for no key)")
    if not is_int(max_body_bytes) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    served = AsyncEngine(engine, max_waiting=max_waiting, prefill_chunk=prefill_chunk)
    metrics = ServerMetrics(served)
    # Prompts are tokenized off the event loop (a long one takes seconds: /health and the streams
    # must not wait for it), one at a time, with the server's own copy of the tokenizer (the engine's
    # worker detokenizes with the original; a fast tokenizer is not to be shared across threads).
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turbospec-tokenize")
    served.on_step = metrics.on_step

    @asynccontextmanager
    async def lifespan(app):
        served.start()  # a worker thread, unless run() already started it to step on its own thread
        yield
        served.close()
        tokenize.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="turbospec", lifespan=lifespan)
    app.state.served, app.state.metrics, app.state.model_name = served, metrics, model_name
    app.state.tokenizer = tokenizer
    pieces = text.TokenPieces(engine.tokenizer)  # token id -> its text and bytes, for logprobs

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return _error(APIError(str(e.detail), status=e.status_code, code=str(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return _error(APIError(str(e), status=400))

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        # the client gets an id to quote, never the exception's text (paths, internals): that is logged
        rid = uuid.uuid4().hex[:16]
        log.error("request %s %s failed (error id %s)", request.method, request.url.path, rid, exc_info=e)
        return _error(APIError(f"internal error (error id {rid})", status=500, type="server_error", code=rid))

    async def guard(scope, receive, send, inner):
        """API key and body-size checks as plain ASGI (a BaseHTTPMiddleware would hide a client's
        disconnect from the endpoints)."""
        if scope["type"] == "http":
            path = scope.get("path", "")
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            error = None
            if api_key is not None and (path.startswith("/v1/") or protect_all):
                auth = headers.get("authorization", "")
                given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
                if not hmac.compare_digest(given.encode(), api_key.encode()):
                    error = APIError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401,
                                     type="authentication_error", code="invalid_api_key")
            length = headers.get("content-length")
            if error is None and length is not None and (not length.isdigit() or int(length) > max_body_bytes):
                error = APIError(f"the request body ({length} bytes) is larger than this server's limit "
                                 f"({max_body_bytes} bytes)", status=413, code="request_too_large")
            if error is not None:
                return await _error(error)(scope, receive, send)
        return await inner(scope, receive, send)

    class _Guard:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            return await guard(scope, receive, send, self.inner)

    app.add_middleware(_Guard)

    @app.get("/health")
    async def health():
        if served._error is not None or not served.started:
            return _error(APIError("the engine is not running", status=503, type="server_error"))
        return {"status": "ok", "running": served.running, "waiting": served.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "turbospec", "max_model_len": engine.max_seq_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await _complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await _complete(request, chat=True)

    async def _complete(http: HTTPRequest, chat: bool):
        t0 = time.perf_counter()
        raw = bytearray()
        async for part in http.stream():  # a body sent without a length is cut off at the limit too
            raw += part
            if len(raw) > max_body_bytes:
                raise APIError(f"the request body is larger than this server's limit ({max_body_bytes} bytes)",
                               status=413, code="request_too_large")
        try:
            body = json.loads(raw)
        except RecursionError:
            raise APIError("the request body is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and integers past Python's digit limit
            raise APIError(f"the request body is not valid JSON: {e}") from None
        parsed = protocol.parse(body, chat, model_name, engine.max_seq_len)
        r = parsed.request
        try:
            try:
                ids = await asyncio.get_running_loop().run_in_executor(
                    tokenize, text.encode, tokenizer, engine.target.cfg.vocab_size, r.prompt, chat)
            except TemplateError as e:  # the chat template refused these messages (roles, order...)
                raise APIError(f"the model's chat template rejected the messages: {e}", param="messages") from None
            if r.max_new_tokens is None:  # as many as the cache holds after the prompt
                r.max_new_tokens = max(1, engine.max_seq_len - len(ids))
            r.prompt = ids
            # n choices: n requests of the batch, side by side (a seeded one: seed + i for choice i)
            reqs = [r] + [dataclasses.replace(r, seed=None if r.seed is None else r.seed + i)
                          for i in range(1, parsed.n)]
            jobs = []
            try:
                for q in reqs:
                    jobs.append(served.submit(q, chat=False))
            except BaseException:
                for job, _ in jobs:
                    served.cancel(job)
                raise
        except QueueFullError as e:
            raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
        except ContextLengthError as e:
            raise APIError(str(e), code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(str(e)) from None
        cid = protocol.completion_id(chat)
        first_token = [True]

        def logprobs_of():  # one per choice: completions' text_offset runs across a choice's chunks
            offset = 0

            def logprobs(entries):
                nonlocal offset
                if not r.logprobs:
                    return None
                if chat:
                    return protocol.chat_logprobs(entries, pieces)
                obj = protocol.completion_logprobs(entries, pieces, offset)
                offset += sum(len(t) for t in obj["tokens"])
                return obj
            return logprobs

        def saw_tokens(d) -> None:
            if d.token_ids and first_token[0]:
                metrics.ttft_seconds.observe(time.perf_counter() - t0)
                first_token[0] = False

        def cancel_all() -> None:
            for job, _ in jobs:
                if not job.done:
                    served.cancel(job)

        if not parsed.stream:
            async def collect(job, queue):
                gen = None
                async for d in served.follow(job, queue):
                    saw_tokens(d)
                    gen = d.generation or gen
                    if gen is None and await http.is_disconnected():
                        break  # nobody will read the answer: free the slot now, not at max_tokens
                return gen
            try:
                gens = await asyncio.gather(*(collect(job, queue) for job, queue in jobs))
            finally:
                cancel_all()
            if any(g is None for g in gens) and await http.is_disconnected():
                return Response(status_code=499)  # (the client is gone; nothing reads this)
            if any(g is None for g in gens):
                raise APIError("the request was cancelled", status=500, type="server_error")
            metrics.request_seconds.observe(time.perf_counter() - t0)
            return protocol.completion(cid, model_name, chat, [
                (g.text, protocol.FINISH_REASON[g.finish_reason], len(g.token_ids), logprobs_of()(g.logprobs))
                for g in gens], len(ids), gens[0].stats.get("cached_prompt_tokens", 0))

        async def events():
            n_out = 0
            merged: asyncio.Queue = asyncio.Queue()  # (choice, delta or None when it ended or failed)

            async def pump(i, job, queue):
                try:
                    async for d in served.follow(job, queue):
                        await merged.put((i, d))
                    await merged.put((i, None))
                except Exception as e:  # noqa: BLE001 - reported in the stream below
                    await merged.put((i, e))
            tasks = []
            try:
                if chat:
                    for i in range(len(jobs)):
                        yield _sse(protocol.chunk(cid, model_name, chat, "", None, role=True, index=i))
                tasks = [asyncio.ensure_future(pump(i, job, queue)) for i, (job, queue) in enumerate(jobs)]
                lps = [logprobs_of() for _ in jobs]
                pending = [[] for _ in jobs]  # log-probabilities of tokens whose text is not out yet
                live = len(jobs)
                while live:
                    i, d = await merged.get()
                    if d is None:
                        live -= 1
                        continue
                    if isinstance(d, Exception):
                        raise d
                    saw_tokens(d)
                    n_out += len(d.token_ids)
                    pending[i] += d.logprobs or []
                    if d.text:
                        yield _sse(protocol.chunk(cid, model_name, chat, d.text, None, logprobs=lps[i](pending[i]),
                                                  index=i))
                        pending[i] = []
                    if d.finish_reason is not None:
                        yield _sse(protocol.chunk(cid, model_name, chat, None if chat else "",
                                                  protocol.FINISH_REASON[d.finish_reason],
                                                  logprobs=lps[i](pending[i]) if pending[i] else None, index=i))
                        pending[i] = []
                if parsed.include_usage:
                    yield _sse({"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": int(time.time()), "model": model_name, "choices": [],
                                "usage": protocol.usage(len(ids), n_out, jobs[0][0].seq.cached_prompt_tokens)})
                metrics.request_seconds.observe(time.perf_counter() - t0)
                yield "data: [DONE]\n\n"
            except Exception as e:  # the request failed inside the engine: say so in the stream
                rid = uuid.uuid4().hex[:16]
                log.error("streamed request %s failed (error id %s)", cid, rid, exc_info=e)
                yield _sse(APIError(f"the request failed (error id {rid})", status=500, type="server_error",
                                    code=rid).body())
            finally:  # a client that went away: its requests leave the batch at the next step
                for t in tasks:
                    t.cancel()
                cancel_all()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, sockets=None, log_level: str = "info") -> int:
    """Serve ``app`` until interrupted (Ctrl-C, SIGTERM) or until the server stops (``sockets``:
    already bound sockets to use). The engine steps on the calling thread (the one that loaded the
    model: see ``AsyncEngine`` on OpenMP thread pools); uvicorn's event loop runs on another.
    Returns the exit status: 0, or 1 when the HTTP server could not start (e.g. the port is taken)."""
    import signal
    import threading

    import uvicorn
    served: AsyncEngine = app.state.served
    served.start(thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))

    def http() -> None:
        try:
            server.run(sockets=sockets)
        except SystemExit:  # uvicorn exits this way when it cannot bind; server.started stays False
            pass
        finally:  # the server ended (shut down, or failed to start): end the worker too
            served.close()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
    thread = threading.Thread(target=http, name="turbospec-http", daemon=True)
    thread.start()
    try:
        served.work()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        thread.join()
        served.close()
    return 0 if server.started else 1
