"""``turbospec serve``: the real server on 127.0.0.1 (a free port), talked to with the official
``openai`` client and raw HTTP: streaming and not, 16 concurrent streams each equal to the request
decoded alone (fp32 greedy), seeded sampling, stop strings, speculation off per request, a client
that disconnects mid-stream, every kind of bad request, a full queue, a failing step, ``/metrics``."""
from __future__ import annotations

import functools
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai", reason="the serving extras are not installed (.ci/run installs them)")
uvicorn = pytest.importorskip("uvicorn", reason="the serving extras are not installed (.ci/run installs them)")
pytest.importorskip("fastapi", reason="the serving extras are not installed (.ci/run installs them)")
from turbospec import Engine
from turbospec.decode.text import TokenPieces
from turbospec.drafters.ngram import NgramDrafter
from turbospec.serve.server import create_app

from helpers import make_tiny_model, make_tiny_tokenizer


MODEL = "tiny"
MAX_BATCH = 4
# a chat template for the word-level test tokenizer: "w1" opens a turn, "w2" closes it, "w3" is the
# assistant's role; the words of the content follow
CHAT_TEMPLATE = ("{% for m in messages %}w1 {{ 'w3' if m['role'] == 'assistant' else 'w4' }} {{ m['content'] }} w2 "
                 "{% endfor %}{% if add_generation_prompt %}w1 w3 {% endif %}")


def prompt(i: int) -> str:
    words = [f"w{(i * 13 + j * 7) % 250 + 5}" for j in range(3 + i % 5)]
    return " ".join(words * 3)  # repeats: prompt lookup proposes, some drafts are accepted


@pytest.fixture(scope="module")
def engine():
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    # adaptive=False: every step drafts (the tests check that drafts take part); 1-token matches:
    # the tiny random model's text repeats too little for longer ones
    return Engine(make_tiny_model(), drafter=functools.partial(NgramDrafter, min_ngram=1), tokenizer=tok,
                  max_batch=MAX_BATCH, max_seq_len=256,
                  adaptive=False)


@pytest.fixture(scope="module")
def server(engine):
    yield from _serving(create_app(engine, MODEL, max_waiting=64))


def _serving(app):
    """Runs ``app`` on a free local port; yields (base URL, app) and stops it afterwards."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if srv.started:
            break
        time.sleep(0.01)
    assert srv.started, "the server did not start"
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def metrics(base: str) -> dict:
    """/metrics as {name: value} ({name: {label: value}} for labelled ones)."""
    text = httpx.get(base + "/metrics").text
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels and not s.name.endswith(("_bucket",)):
                out.setdefault(s.name, {})[next(iter(s.labels.values()))] = s.value
            elif not s.labels:
                out[s.name] = s.value
    return out


def alone(engine, p, chat=False, **kw):
    return engine.generate(p, chat=chat, **kw)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(server[0] + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_equals_alone(server, client, engine):
    want = alone(engine, prompt(0), max_new_tokens=20)
    r = client.completions.create(model=MODEL, prompt=prompt(0), max_tokens=20, temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids) == 20
    # token ids as the prompt
    r = client.completions.create(model=MODEL, prompt=want.prompt_token_ids, max_tokens=20, temperature=0)
    assert r.choices[0].text == want.text


def test_chat_stream_equals_alone(server, client, engine):
    messages = [{"role": "user", "content": prompt(1)}]
    want = alone(engine, messages, max_new_tokens=24)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    # not streamed
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"


def test_16_concurrent_streams_equal_alone(server, client, engine):
    """16 streams at once through 4 slots (requests wait, join and leave): every stream's text equals
    the request decoded alone, greedy fp32; the metrics count every token."""
    before = metrics(server[0])
    n_new = [12 + (i * 5) % 17 for i in range(16)]
    wants = [alone(engine, prompt(i), max_new_tokens=n_new[i]).text for i in range(16)]

    def one(i):
        s = client.completions.create(model=MODEL, prompt=prompt(i), max_tokens=n_new[i], temperature=0,
                                      stream=True)
        return "".join(c.choices[0].text for c in s if c.choices)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == wants
    after = metrics(server[0])
    assert after["turbospec_generation_tokens_total"] - before["turbospec_generation_tokens_total"] == sum(n_new)
    proposed = after["turbospec_draft_tokens_proposed_total"] - before["turbospec_draft_tokens_proposed_total"]
    accepted = after["turbospec_draft_tokens_accepted_total"] - before["turbospec_draft_tokens_accepted_total"]
    assert 0 < accepted <= proposed
    assert after["turbospec_tau"] > 1.0  # accepted drafts: more than one token per request-step
    assert after["turbospec_requests_running"] == 0 and after["turbospec_requests_waiting"] == 0
    assert after["turbospec_requests_finished_total"]["length"] - \
        before.get("turbospec_requests_finished_total", {}).get("length", 0) == 16
    assert after["turbospec_step_seconds_count"] > before.get("turbospec_step_seconds_count", 0)
    assert set(after["turbospec_acceptance_rate"]) >= {"1"}


def test_seeded_sampling_stop_and_speculate_off(server, client, engine):
    want = alone(engine, prompt(2), max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    r = client.completions.create(model=MODEL, prompt=prompt(2), max_tokens=20, temperature=0.8, top_p=0.9,
                                  seed=7, extra_body={"top_k": 50})
    assert r.choices[0].text == want.text
    full = alone(engine, prompt(3), max_new_tokens=20)
    stop = " " + full.text.split()[4]
    want = alone(engine, prompt(3), max_new_tokens=20, stop=stop)
    r = client.completions.create(model=MODEL, prompt=prompt(3), max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    before = metrics(server[0])["turbospec_draft_tokens_proposed_total"]
    r = client.completions.create(model=MODEL, prompt=prompt(3), max_tokens=20, temperature=0,
                                  extra_body={"speculate": False})
    assert r.choices[0].text == full.text
    assert metrics(server[0])["turbospec_draft_tokens_proposed_total"] == before  # no drafts


def test_n_choices_streamed_and_not(server, client, engine):
    """n > 1: n requests of the batch side by side. Greedy: n copies of the one answer; seeded
    sampling: choice i is the request with seed + i alone; streamed: each choice's chunks (by index)
    make up the same text; usage counts every choice's tokens, the prompt once."""
    greedy = alone(engine, prompt(4), max_new_tokens=12)
    r = client.completions.create(model=MODEL, prompt=prompt(4), max_tokens=12, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.text == greedy.text for c in r.choices)
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == len(greedy.prompt_token_ids)
    messages = [{"role": "user", "content": prompt(5)}]
    want = [alone(engine, messages, chat=True, max_new_tokens=16, temperature=0.9, seed=11 + i).text for i in range(3)]
    assert len(set(want)) > 1  # the seeds give different samples, so the check below can tell them apart
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9, seed=11, n=3)
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == want
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                            seed=11, n=3, stream=True, stream_options={"include_usage": True})
    texts, roles, finishes = ["", "", ""], [0, 0, 0], [None, None, None]
    chunks = list(stream)
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index] += ch.delta.role == "assistant"
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == want and roles == [1, 1, 1] and all(f in ("length", "stop") for f in finishes)
    assert chunks[-1].usage.completion_tokens == sum(
        len(alone(engine, messages, chat=True, max_new_tokens=16, temperature=0.9, seed=11 + i).token_ids)
        for i in range(3))


def slow_steps(app, seconds: float):
    """Slow every batch step down (so a long request is still running when the test acts)."""
    served = app.state.served
    hook = served.on_step

    def slow(outputs, s):
        hook(outputs, s)
        time.sleep(seconds)
    served.on_step = slow
    return hook


def test_disconnect_of_a_non_streamed_request_frees_the_slot(server, client, engine):
    """A non-streamed request whose client gives up leaves the batch within steps, not after its
    max_tokens."""
    base, app = server
    hook = slow_steps(app, 0.02)
    try:
        before = metrics(base)
        aborted = before.get("turbospec_requests_finished_total", {}).get("abort", 0)
        body = {"model": MODEL, "prompt": prompt(6), "max_tokens": 200, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=0.3)
        for _ in range(300):
            m = metrics(base)
            if m.get("turbospec_requests_finished_total", {}).get("abort", 0) > aborted:
                break
            time.sleep(0.01)
        assert m["turbospec_requests_finished_total"]["abort"] == aborted + 1
        assert m["turbospec_requests_running"] == 0
        # 200 tokens at 20 ms a step would take seconds: it left long before
        assert m["turbospec_generation_tokens_total"] - before["turbospec_generation_tokens_total"] < 100
    finally:
        app.state.served.on_step = hook
    r = client.completions.create(model=MODEL, prompt=prompt(6), max_tokens=8, temperature=0)
    assert r.choices[0].text == alone(engine, prompt(6), max_new_tokens=8).text


def test_disconnect_mid_stream_frees_the_slot(server, client, engine):
    base, app = server
    hook = slow_steps(app, 0.02)
    try:
        before = metrics(base)
        aborted = before.get("turbospec_requests_finished_total", {}).get("abort", 0)
        body = {"model": MODEL, "prompt": prompt(4), "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
        # the client has gone; the request leaves the batch at the next step (200 tokens at 20 ms
        # per step would take seconds)
        for _ in range(300):
            m = metrics(base)
            if m.get("turbospec_requests_finished_total", {}).get("abort", 0) > aborted:
                break
            time.sleep(0.01)
        assert m["turbospec_requests_running"] == 0
        assert m["turbospec_requests_finished_total"]["abort"] == aborted + 1
        # it left long before its 200 tokens
        assert m["turbospec_generation_tokens_total"] - before["turbospec_generation_tokens_total"] < 100
    finally:
        app.state.served.on_step = hook
    r = client.completions.create(model=MODEL, prompt=prompt(5), max_tokens=8, temperature=0)
    assert r.choices[0].text == alone(engine, prompt(5), max_new_tokens=8).text


@pytest.mark.parametrize("body, param", [
    ({"model": "gpt-4", "prompt": "w5"}, "model"),
    ({"prompt": "w5"}, "model"),
    ({"model": MODEL, "prompt": "w5", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "w5", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "w5", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "w5", "top_k": 1.5}, "top_k"),
    ({"model": MODEL, "prompt": "w5", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "w5", "max_tokens": 10_000}, "max_tokens"),
    ({"model": MODEL, "prompt": "w5", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "w5", "n": 17}, "n"),
    ({"model": MODEL, "prompt": "w5", "n": "2"}, "n"),
    ({"model": MODEL, "prompt": "w5", "n": True}, "n"),
    ({"model": MODEL, "prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": MODEL, "prompt": "w5", "stop": 3}, "stop"),
    ({"model": MODEL, "prompt": "w5", "logprobs": -1}, "logprobs"),
    ({"model": MODEL, "prompt": "w5", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "w5", "logprobs": "2"}, "logprobs"),
    ({"model": MODEL, "prompt": "w5", "logprobs": True}, "logprobs"),
    ({"model": MODEL, "prompt": "w5", "logprobs": 1.5}, "logprobs"),
    ({"model": MODEL, "prompt": "w5", "top_logprobs": 2}, "top_logprobs"),  # chat's (completions: logprobs=k)
    ({"model": MODEL, "prompt": "w5", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "w5", "presence_penalty": -3}, "presence_penalty"),
    ({"model": MODEL, "prompt": "w5", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": MODEL, "prompt": "w5", "min_p": 1.5}, "min_p"),
    ({"model": MODEL, "prompt": "w5", "logit_bias": {"x5": 10}}, "logit_bias"),
    ({"model": MODEL, "prompt": "w5", "logit_bias": {"5": 200}}, "logit_bias"),
    ({"model": MODEL, "prompt": "w5", "logit_bias": [5]}, "logit_bias"),
    ({"model": MODEL, "prompt": "w5", "logit_bias": {"999": 1}}, None),  # outside the vocabulary
    ({"model": MODEL, "prompt": "w5", "response_format": {"type": "xml"}}, "response_format"),
    ({"model": MODEL, "prompt": "w5", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"model": MODEL, "prompt": "w5", "guided_regex": 5}, "guided_regex"),
    ({"model": MODEL, "prompt": "w5", "guided_choice": []}, "guided_choice"),
    ({"model": MODEL, "prompt": "w5", "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"model": MODEL, "prompt": "w5", "stop_token_ids": "3"}, "stop_token_ids"),
    ({"model": MODEL, "prompt": "w5", "stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"model": MODEL, "prompt": "w5", "stop_token_ids": [999]}, None),  # outside the vocabulary
    ({"model": MODEL, "prompt": "w5", "ignore_eos": True}, "ignore_eos"),
    ({"model": MODEL, "prompt": "w5", "frequency_penalty": "0"}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "w5", "max_completion_tokens": 5}, "max_completion_tokens"),  # chat's
    ({"model": MODEL, "prompt": "w5", "temprature": 0}, "temprature"),  # a typo is not ignored either
    ({"model": MODEL, "prompt": "w5", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": "w5", "speculate": "no"}, "speculate"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 999]}, None),                           # id outside the vocabulary
    ({"model": MODEL, "prompt": " ".join(["w5"] * 250), "max_tokens": 20}, None),  # too long for the cache
])
def test_bad_completion_requests(server, body, param):
    r = httpx.post(server[0] + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if param is not None:
        assert param in err["message"]


def test_stop_token_ids(server, client, engine):
    """vLLM's stop_token_ids: the request ends at the first of them (kept, as EOS is), the same as
    the engine alone without drafts."""
    full = alone(engine, prompt(3), max_new_tokens=24)
    j = next(i for i in range(3, len(full.token_ids)) if full.token_ids[i] not in full.token_ids[:i])
    stop_id = full.token_ids[j]
    plain = Engine(engine.target, drafter="none", tokenizer=engine.tokenizer, max_seq_len=256)
    want = plain.generate(prompt(3), max_new_tokens=24, chat=False, stop_token_ids=[stop_id])
    assert want.token_ids == full.token_ids[: j + 1] and want.finish_reason == "eos"
    r = client.completions.create(model=MODEL, prompt=prompt(3), max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == j + 1
    chunks = list(client.completions.create(model=MODEL, prompt=prompt(3), max_tokens=24, temperature=0,
                                            stream=True, extra_body={"stop_token_ids": [stop_id]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_fields_at_their_no_op_values_are_accepted(server, client, engine):
    """What clients send by default (penalties 0, response_format text, null fields) is not refused."""
    want = alone(engine, "w5 w6", max_new_tokens=6).text
    r = httpx.post(server[0] + "/v1/completions", json={
        "model": MODEL, "prompt": "w5 w6", "max_tokens": 6, "temperature": 0, "frequency_penalty": 0,
        "presence_penalty": 0.0, "logit_bias": {}, "logprobs": None, "echo": False, "user": "u1", "suffix": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=4,
                                       temperature=0, frequency_penalty=0, response_format={"type": "text"})
    assert c.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="tools"):  # what is not implemented is still refused
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "f"}}])


def test_penalties_and_logit_bias_as_the_engine(server, client, engine):
    """presence / frequency / repetition penalties, logit_bias (string keys, as JSON has them) and
    min_p reach the engine: the same text as the engine alone without drafts, streamed too."""
    plain = Engine(engine.target, drafter="none", tokenizer=engine.tokenizer, max_seq_len=256)
    settings = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={9: 5.0})
    want = plain.generate(prompt(4), max_new_tokens=16, chat=False, **settings)
    assert want.token_ids != plain.generate(prompt(4), max_new_tokens=16, chat=False).token_ids
    body = dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"9": 5.0})
    r = client.completions.create(model=MODEL, prompt=prompt(4), max_tokens=16, temperature=0,
                                  extra_body={"repetition_penalty": 1.3}, **body)
    assert r.choices[0].text == want.text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt(4), max_tokens=16, temperature=0, stream=True,
                                            extra_body={"repetition_penalty": 1.3}, **body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    r = client.completions.create(model=MODEL, prompt=prompt(4), max_tokens=8, temperature=0.7, seed=3,
                                  extra_body={"min_p": 0.2})
    assert r.choices[0].text == alone(engine, prompt(4), max_new_tokens=8, temperature=0.7, seed=3, min_p=0.2).text


@pytest.fixture(scope="module")
def json_server():
    """A server over the cycling tiny model with a byte-level tokenizer (any text encodes), for
    structured output."""
    from helpers import make_byte_tokenizer
    hf = make_tiny_model("llama", seed=1, num_hidden_layers=4)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    eng = Engine(hf, drafter="ngram", tokenizer=make_byte_tokenizer(), max_batch=2, max_seq_len=512, adaptive=False)
    yield from _serving(create_app(eng, MODEL, max_waiting=8))


def test_structured_output_with_the_openai_client(json_server):
    """response_format json_schema / json_object and vLLM's guided_regex / guided_choice: the answer
    matches (validated with jsonschema), and equals the engine's without speculation."""
    import json
    import re

    import jsonschema
    base, app = json_server
    eng = app.state.served.engine
    plain = Engine(eng.target, drafter="none", tokenizer=eng.tokenizer, max_seq_len=512)
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    text = '{"ok": true, "n": 5} ' * 4
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=60, temperature=0,
                             extra_body={"response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == plain.generate(text, 60, chat=False, grammar={"json_schema": schema}).text
    chunks = list(c.completions.create(model=MODEL, prompt=text, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"guided_json": schema}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=30, temperature=0,
                             extra_body={"guided_regex": "(ab|cd){1,3}x"})
    assert re.fullmatch("(ab|cd){1,3}x", r.choices[0].text)
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0.8, seed=1,
                             extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].text in ("red", "green", "blue")
    bad = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "guided_regex": "(ab"})
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"]


def test_oversized_deep_and_huge_bodies_are_client_errors(server):
    base = server[0]
    big = {"model": MODEL, "prompt": "w5 " * 1_500_000}  # ~4.5 MB
    r = httpx.post(base + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():  # no Content-Length: the body is cut off once past the limit
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"w5 " * 20_000
        yield b'"}'
    r = httpx.post(base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, r.text
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    r = httpx.post(base + "/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    huge = b'{"model": "tiny", "prompt": "w5", "max_tokens": ' + b"9" * 5000 + b"}"
    r = httpx.post(base + "/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    assert httpx.get(base + "/health").status_code == 200  # still serving


def test_chat_template_refusal_is_a_client_error(server):
    """A template that raises on these messages (as many do for a wrong role order) is a 400."""
    base, app = server
    tok = app.state.tokenizer  # the server's copy, which tokenizes requests
    real = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                   "{{ raise_exception('System role not supported') }}{% endif %}"
                                   "{{ m['content'] }} {% endfor %}")
    try:
        r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": "w5"}, {"role": "user", "content": "w6"}]})
    finally:
        tok.chat_template = real
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "System role not supported" in r.json()["error"]["message"]


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """While a ~3.6 MB prompt is tokenized (seconds), /health answers at once."""
    base = server[0]
    body = {"model": MODEL, "prompt": "w5 w6 " * 600_000, "max_tokens": 1}
    done = {}

    def post():
        t = time.perf_counter()
        done["r"] = httpx.post(base + "/v1/completions", json=body, timeout=120)
        done["s"] = time.perf_counter() - t
    th = threading.Thread(target=post)
    th.start()
    time.sleep(0.3)  # the body is in, tokenizing
    worst = 0.0
    while th.is_alive():
        t = time.perf_counter()
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.05)
    th.join()
    assert done["r"].status_code == 400 and done["r"].json()["error"]["code"] == "context_length_exceeded"
    assert done["s"] > 1.0, "tokenizing took too little time for this test to tell anything"
    assert worst < 0.5, worst


@pytest.fixture(scope="module")
def keyed():
    tok = make_tiny_tokenizer()
    eng = Engine(make_tiny_model(seed=2), drafter="ngram", tokenizer=tok, max_batch=2, max_seq_len=128)
    yield from _serving(create_app(eng, MODEL, api_key="s3cret", protect_all=False))


def test_api_key(keyed):
    base = keyed[0]
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(base + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(base + "/v1/models").status_code == 401
    ok = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(base + "/health").status_code == 200  # not protected unless protect_all
    assert httpx.get(base + "/metrics").status_code == 200
    c = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0, timeout=60)
    assert c.completions.create(model=MODEL, prompt="w5", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()


def test_api_key_protects_everything_when_asked():
    tok = make_tiny_tokenizer()
    eng = Engine(make_tiny_model(seed=3), drafter="none", tokenizer=tok, max_batch=1, max_seq_len=64)
    gen = _serving(create_app(eng, MODEL, api_key="k", protect_all=True))
    base, _ = next(gen)
    try:
        assert httpx.get(base + "/health").status_code == 401
        assert httpx.get(base + "/metrics").status_code == 401
        assert httpx.get(base + "/health", headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        gen.close()
    with pytest.raises(ValueError, match="api_key"):
        create_app(eng, MODEL, api_key="")


def test_bad_chat_and_malformed_requests(server, client):
    base = server[0]
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": "hi"},
                 {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
                 {"model": MODEL, "messages": [{"content": "w5"}]}):
        r = httpx.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": " ".join(["w5"] * 250), "max_tokens": 20})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # the official client sees the OpenAI shape
        client.completions.create(model="nope", prompt="w5")
    assert e.value.status_code == 400 and "nope" in str(e.value)
    assert httpx.get(base + "/v1/nothing").status_code == 404
    # the server is still fine
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_full_queue_is_refused_not_hung(server, client):
    base, app = server
    served = app.state.served
    hook, max_waiting = slow_steps(app, 0.02), served.max_waiting
    served.max_waiting = 1
    streams = []
    try:
        body = {"model": MODEL, "prompt": prompt(6), "max_tokens": 200, "temperature": 0, "stream": True}
        for _ in range(MAX_BATCH + 1):  # every slot busy and one waiting
            s = httpx.stream("POST", base + "/v1/completions", json=body, timeout=30)
            streams.append(s)
            assert s.__enter__().status_code == 200
        t = time.perf_counter()
        r = httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert time.perf_counter() - t < 5
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        served.on_step, served.max_waiting = hook, max_waiting
    for _ in range(300):
        if metrics(base)["turbospec_requests_running"] == 0:
            break
        time.sleep(0.01)
    r = client.completions.create(model=MODEL, prompt=prompt(7), max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_failing_step_answers_500_and_the_server_goes_on(server, client, engine, caplog):
    """The client gets a 500 with an error id, never the exception's text; the log has the text
    under that id."""
    base, app = server
    batch = app.state.served._sched.batch
    real = batch.step

    def broken(rows, parked=None):
        raise RuntimeError("simulated kernel failure")
    batch.step = broken
    try:
        with caplog.at_level("ERROR", logger="turbospec.serve"):
            r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt(8), "max_tokens": 8})
            err = r.json()["error"]
            assert r.status_code == 500 and "simulated kernel failure" not in r.text and "Error" not in r.text
            assert err["type"] == "server_error" and err["code"] and err["code"] in err["message"]
            body = {"model": MODEL, "prompt": prompt(8), "max_tokens": 8, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as s:
                events = [line for line in s.iter_lines() if line.startswith("data: ")]
            serr = json.loads(events[-1][6:])["error"]
            assert "simulated kernel failure" not in events[-1] and serr["code"] in serr["message"]
        logged = [rec for rec in caplog.records if rec.name == "turbospec.serve"]
        for rid in (err["code"], serr["code"]):
            rec = next(rec for rec in logged if rid in rec.getMessage())
            assert "simulated kernel failure" in str(rec.exc_info[1]), rid
    finally:
        batch.step = real
    r = client.completions.create(model=MODEL, prompt=prompt(8), max_tokens=8, temperature=0)
    assert r.choices[0].text == alone(engine, prompt(8), max_new_tokens=8).text
    assert metrics(base)["turbospec_requests_finished_total"]["error"] >= 2


# ------------------------------------------------------------------------------------------------
# logprobs (issue 38 §1)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cyc_engine():
    """A tiny target whose attention outputs are zeroed (its continuations cycle: n-gram drafts are
    accepted often), drafting with n-grams."""
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    hf = make_tiny_model(seed=1, num_hidden_layers=3)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return Engine(hf, drafter="ngram", tokenizer=tok, max_batch=MAX_BATCH, max_seq_len=256, adaptive=False)


@pytest.fixture(scope="module")
def cyc_server(cyc_engine):
    yield from _serving(create_app(cyc_engine, MODEL, max_waiting=64))


@pytest.fixture(scope="module")
def cyc_client(cyc_server):
    return openai.OpenAI(base_url=cyc_server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat_content(engine, g) -> list[dict]:
    """OpenAI chat's logprobs.content for a Generation, built from its TokenLogprobs."""
    pieces = TokenPieces(engine.tokenizer)

    def one(t, lp):
        return {"token": pieces.text(t), "logprob": lp, "bytes": list(pieces.bytes(t))}
    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in g.logprobs]


def _dump(content) -> list[dict]:
    return [c.model_dump() if hasattr(c, "model_dump") else c for c in content]


def test_chat_logprobs_streamed_and_not_equal_plain(cyc_server, cyc_client, cyc_engine):
    """Chat logprobs + top_logprobs through the openai client: the engine's numbers alone without
    drafts, the same streamed (each chunk carries its tokens'), speculation on and off."""
    messages = [{"role": "user", "content": prompt(9)}]
    plain = Engine(cyc_engine.target, drafter="none", tokenizer=cyc_engine.tokenizer, max_seq_len=256)
    want = plain.generate(messages, max_new_tokens=40, logprobs=True, top_logprobs=3)
    content = _chat_content(cyc_engine, want)
    assert len(content) == 40 and all(len(c["top_logprobs"]) == 3 for c in content)
    before = metrics(cyc_server[0])["turbospec_draft_tokens_accepted_total"]
    r = cyc_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                       logprobs=True, top_logprobs=3)
    assert r.choices[0].message.content == want.text
    assert _dump(r.choices[0].logprobs.content) == content
    assert metrics(cyc_server[0])["turbospec_draft_tokens_accepted_total"] > before  # drafts were accepted
    off = cyc_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"speculate": False})
    assert _dump(off.choices[0].logprobs.content) == content
    chunks = list(cyc_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            assert c.choices[0].delta.content or c.choices[0].finish_reason  # logprobs ride chunks with text
            streamed += _dump(c.choices[0].logprobs.content)
    assert streamed == content
    assert sum(1 for c in chunks if c.choices and c.choices[0].logprobs) > 1  # spread over the chunks
    # logprobs without alternatives; and off
    r = cyc_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    assert [c.logprob for c in r.choices[0].logprobs.content] == [e.logprob for e in want.logprobs[:6]]
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    r = cyc_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(cyc_server, cyc_client, cyc_engine):
    """Legacy completions ``logprobs: k``: tokens, token_logprobs, top_logprobs (the k alternatives
    and the sampled token), text_offset; the same streamed and with speculation off."""
    plain = Engine(cyc_engine.target, drafter="none", tokenizer=cyc_engine.tokenizer, max_seq_len=256)
    want = plain.generate(prompt(10), max_new_tokens=20, chat=False, logprobs=True, top_logprobs=2)
    pieces = TokenPieces(cyc_engine.tokenizer)
    before = metrics(cyc_server[0])["turbospec_draft_tokens_accepted_total"]
    r = cyc_client.completions.create(model=MODEL, prompt=prompt(10), max_tokens=20, temperature=0, logprobs=2)
    assert metrics(cyc_server[0])["turbospec_draft_tokens_accepted_total"] > before  # drafts were accepted
    assert r.choices[0].text == want.text
    lp = r.choices[0].logprobs
    assert lp.tokens == [pieces.text(e.token_id) for e in want.logprobs]
    assert lp.token_logprobs == [e.logprob for e in want.logprobs]
    assert lp.top_logprobs == [{**{pieces.text(t): v for t, v in e.top}, pieces.text(e.token_id): e.logprob}
                               for e in want.logprobs]
    assert all(2 <= len(d) <= 3 for d in lp.top_logprobs)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    off = cyc_client.completions.create(model=MODEL, prompt=prompt(10), max_tokens=20, temperature=0, logprobs=2,
                                    extra_body={"speculate": False})
    assert off.choices[0].logprobs.model_dump() == lp.model_dump()
    chunks = list(cyc_client.completions.create(model=MODEL, prompt=prompt(10), max_tokens=20, temperature=0,
                                            logprobs=2, stream=True))
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            for k in merged:
                merged[k] += getattr(c.choices[0].logprobs, k)
    assert merged == lp.model_dump(include=set(merged))
    # logprobs: 0: the sampled token's logprob (and itself as its only "top" entry)
    r = cyc_client.completions.create(model=MODEL, prompt=prompt(10), max_tokens=5, temperature=0, logprobs=0)
    assert r.choices[0].logprobs.token_logprobs == lp.token_logprobs[:5]
    assert [list(d) for d in r.choices[0].logprobs.top_logprobs] == [[t] for t in lp.tokens[:5]]


def test_sampled_logprobs_through_the_server(cyc_server, cyc_client, cyc_engine):
    """Seeded sampling with top-k 3 (alternatives filtered out are not listed): the numbers of the
    engine alone with the same seed."""
    want = alone(cyc_engine, prompt(11), max_new_tokens=16, temperature=0.9, top_k=3, seed=5, logprobs=True,
                 top_logprobs=5)
    assert any(len(e.top) == 3 for e in want.logprobs)
    r = cyc_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt(11)}],
                                       max_tokens=16, temperature=0.9, seed=5, logprobs=True, top_logprobs=5,
                                       extra_body={"top_k": 3})
    g = alone(cyc_engine, [{"role": "user", "content": prompt(11)}], chat=True, max_new_tokens=16, temperature=0.9,
              top_k=3, seed=5, logprobs=True, top_logprobs=5)
    assert r.choices[0].message.content == g.text
    assert _dump(r.choices[0].logprobs.content) == _chat_content(cyc_engine, g)
    assert all(len(c.top_logprobs) <= 3 for c in r.choices[0].logprobs.content)


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": "yes"}, "logprobs"), ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"), ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_chat_logprobs(cyc_server, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, **extra}
    r = httpx.post(cyc_server[0] + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_prefix_cache_reported_in_usage(client):
    """A prompt sent again (a chat's next turn resends it): the same answer, and usage says how many
    prompt tokens came from the prefix cache (OpenAI's prompt_tokens_details.cached_tokens)."""
    text = " ".join(f"w{(i * 7) % 250}" for i in range(70))  # 70 words: 4 blocks of 16 tokens and more
    first = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    again = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    # all but the last prompt token (the first root, computed by the first step)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1 > 0
    streamed = client.completions.create(model=MODEL, prompt=text, max_tokens=6, stream=True, temperature=0,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens
