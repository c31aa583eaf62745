"""The OpenAI API's request and response bodies, checked by hand so that every bad request gets the
OpenAI error shape (``{"error": {"message", "type", "param", "code"}}``) with status 400 naming the
field, the value and what is allowed."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..decode.batch import Request
from ..ops.sampling import MAX_TOP_LOGPROBS
from ..ops.checks import is_int

FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}  # turbospec -> OpenAI


class APIError(Exception):
    """An error the client gets as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """A checked request: what the engine decodes and how to answer."""
    request: Request
    chat: bool                  # /v1/chat/completions (messages -> chat template)
    stream: bool
    include_usage: bool         # stream_options.include_usage
    model: str
    n: int = 1                  # choices: n requests decoded side by side (seed + i each, when seeded)


MAX_N = 16  # choices per request (each is a request of the batch)


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not ((lo < v) if lo_open else (lo <= v)) or v > hi:
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        raise APIError(f"{name} must be {kind} {lo_s} and <= {hi}, got {v!r}", param=name)
    return v


# The fields each endpoint implements (a null counts as absent, as OpenAI's API treats it).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "n", "speculate", "user", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "min_p", "logit_bias", "response_format", "guided_json", "guided_regex", "guided_choice"}
_FIELDS = {True: _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
           False: _COMMON | {"prompt", "best_of", "logprobs"}}
# Fields of the OpenAI API (and vLLM's extras) that are accepted only at the value that changes
# nothing: anything else would be silently ignored, so it is refused, naming the field.
_NEUTRAL = {"top_logprobs": (0,),  # (completions: logprobs=k)
            "echo": (False,), "suffix": ("",), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
            "parallel_tool_calls": (True, False), "store": (False,), "ignore_eos": (False,), "min_tokens": (0,)}
MAX_LOGIT_BIAS = 1024  # entries of logit_bias


def _check_fields(body: dict, chat: bool) -> None:
    """Every field is implemented, or set to its no-op value; else 400 naming it."""
    for name, v in body.items():
        if v is None or name in _FIELDS[chat]:
            continue
        if name in _NEUTRAL:
            if any(type(v) is type(ok) and v == ok for ok in _NEUTRAL[name]):
                continue
            raise APIError(f"{name} is not supported by this server (got {v!r}); it is refused rather than "
                           f"ignored", param=name)
        endpoint = "chat completions" if chat else "completions"
        raise APIError(f"unknown field {name!r} for {endpoint}; supported: {', '.join(sorted(_FIELDS[chat]))}",
                       param=name)


def parse(body, chat: bool, served_model: str, max_seq_len: int) -> Parsed:
    """Check an OpenAI completions (``chat=False``) or chat completions body; raises ``APIError``."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_fields(body, chat)
    model = body.get("model")
    if model is None:
        raise APIError("model is required", param="model")
    if model != served_model:
        raise APIError(f"model {model!r} is not served here; available: [{served_model!r}]", param="model",
                       code="model_not_found")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError("messages must be a non-empty list of {role, content} objects", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(f"messages[{i}] must be an object with a string role", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
                m = {**m, "content": "".join(p["text"] for p in content)}
                messages[i] = m
            elif not isinstance(content, str):
                raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                               param="messages")
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list (n=1 batch)
        ok = (isinstance(prompt, str) and prompt) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if not ok:
            raise APIError("prompt must be a non-empty string or a non-empty list of token ids (one prompt)",
                           param="prompt")
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    if body.get("best_of") not in (None, 1):
        raise APIError(f"best_of must be 1, got {body.get('best_of')!r}", param="best_of")
    limit = max_seq_len - 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None:
        max_tokens = _number(body, name, None, 1, limit, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k == -1:  # "off" in vLLM's convention
        top_k = 0
    top_k = _number({"top_k": top_k}, "top_k", 0, 0, 1 << 30, integer=True)
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    if seed is not None and seed < 0:
        seed = seed + (1 << 64)  # a generator seed is unsigned
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise APIError(f"stop must be a non-empty string or a list of up to 4 of them, got {stop!r}", param="stop")
        stop = stops or None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("stream_options must be an object", param="stream_options")
    speculate = body.get("speculate", True)
    if not isinstance(speculate, bool):
        raise APIError(f"speculate must be true or false, got {speculate!r}", param="speculate")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and len(stop_ids) <= 64 and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)):
        raise APIError(f"stop_token_ids must be a list of up to 64 token ids, got {stop_ids!r}", param="stop_token_ids")
    logprobs, top_logprobs = _logprobs(body, chat)
    processing = dict(presence_penalty=float(_number(body, "presence_penalty", 0.0, -2.0, 2.0)),
                      frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
                      repetition_penalty=float(_number(body, "repetition_penalty", 1.0, 0.0, 100.0, lo_open=True)),
                      min_p=float(_number(body, "min_p", 0.0, 0.0, 1.0)), logit_bias=_logit_bias(body))
    request = Request(prompt, max_tokens, float(temperature), int(top_k), float(top_p), stop, seed, speculate,
                      stop_token_ids=stop_ids or None, logprobs=logprobs, top_logprobs=top_logprobs,
                      grammar=_grammar(body), **processing)
    return Parsed(request, chat, stream, bool(options.get("include_usage")), model, n)


def _logit_bias(body: dict) -> dict | None:
    """``logit_bias``: {token id (a string, as JSON keys are): bias in [-100, 100]}."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise APIError(f"logit_bias must be an object of up to {MAX_LOGIT_BIAS} token id: bias entries",
                       param="logit_bias")
    out = {}
    for key, bias in v.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            tok = -1
        if tok < 0 or str(tok) != str(key).strip():
            raise APIError(f"logit_bias: {key!r} is not a token id", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise APIError(f"logit_bias[{key!r}] must be a number in [-100, 100], got {bias!r}", param="logit_bias")
        out[tok] = float(bias)
    return out or None


def _grammar(body: dict) -> dict | None:
    """Structured output: ``response_format`` ({"type": "text" | "json_object" | "json_schema"}) or
    vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``; at most one of them."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(f"response_format must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\"}}, "
                           f"got {fmt!r}", param="response_format")
        if fmt["type"] == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                               "{...}}}", param="response_format")
            found.append(("response_format", {"json_schema": schema}))
    for name, kind, ok in (("guided_json", "json_schema", lambda v: isinstance(v, (dict, str))),
                           ("guided_regex", "regex", lambda v: isinstance(v, str) and v),
                           ("guided_choice", "choice", lambda v: isinstance(v, list) and v
                            and all(isinstance(c, str) and c for c in v))):
        v = body.get(name)
        if v is None:
            continue
        if not ok(v):
            raise APIError(f"{name} has the wrong type: {v!r}", param=name)
        found.append((name, {kind: v}))
    if len(found) > 1:
        raise APIError(f"at most one of response_format (json) and guided_json / guided_regex / guided_choice, "
                       f"got {', '.join(n for n, _ in found)}", param=found[1][0])
    return found[0][1] if found else None


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """Chat: ``logprobs`` (true / false) and ``top_logprobs`` (0-20, needs logprobs: true);
    completions: ``logprobs`` (null or 0-20 alternatives; false: off). -> (on, alternatives)."""
    v = body.get("logprobs")
    if chat:
        if v is not None and not isinstance(v, bool):
            raise APIError(f"logprobs must be true or false, got {v!r}", param="logprobs")
        top = body.get("top_logprobs")
        if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise APIError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                           param="top_logprobs")
        if top and not v:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return bool(v), top or 0
    if v is None or v is False:
        return False, 0
    if not is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise APIError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token) or "
                       f"null, got {v!r}", param="logprobs")
    return True, v


LOGPROB_FLOOR = -9999.0  # what a -inf log-probability (a token filtered out) is reported as (JSON has no -inf)


def _lp(v: float) -> float:
    return max(v, LOGPROB_FLOOR)


def chat_logprobs(entries, pieces) -> dict:
    """OpenAI chat's ``logprobs`` object for ``entries`` (``TokenLogprob``s; ``pieces``: a
    ``decode.text.TokenPieces``): {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(t: int, lp: float) -> dict:
        text, raw = pieces(t)
        return {"token": text, "logprob": _lp(lp), "bytes": list(raw)}
    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries, pieces, offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object: {tokens, token_logprobs, top_logprobs (per
    token a {text: logprob} map of the alternatives and the sampled token), text_offset (each
    token's offset in the concatenated token texts, from ``offset``)}."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = pieces.text(e.token_id)
        top: dict[str, float] = {}
        for t, lp in e.top:
            top.setdefault(pieces.text(t), _lp(lp))
        top.setdefault(text, _lp(e.logprob))
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(e.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def chunk(cid: str, model: str, chat: bool, text: str | None, finish: str | None, role: bool = False,
          logprobs: dict | None = None, index: int = 0) -> dict:
    """One streamed chunk (``text`` None: no content in this chunk; ``logprobs``: those of the
    chunk's tokens, ``chat_logprobs`` / ``completion_logprobs``)."""
    if chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [choice]}
    choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(cid: str, model: str, chat: bool, choices: list[tuple[str, str, int, dict | None]],
               prompt_tokens: int, cached_tokens: int = 0) -> dict:
    """A whole (non-streamed) response; ``choices``: (text, finish reason, completion tokens,
    logprobs or None) per choice, in index order."""
    out = []
    for i, (text, finish, _, logprobs) in enumerate(choices):
        if chat:
            out.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                        "finish_reason": finish})
        else:
            out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(prompt_tokens, sum(c[2] for c in choices), cached_tokens)}
