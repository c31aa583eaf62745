"""Structured output (``decode.grammar``, llguidance): every token the grammar allows, the same
output with speculation as without (greedy: the same tokens; a batch: each request as alone), JSON
that validates against its schema, the log-probabilities of the constrained distribution, and bad
grammars named. Tiny models use a byte-level tokenizer (one token per byte); the real-weight case
uses SmolLM2-135M-Instruct."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

import turbospec
from turbospec import Engine, Request
from turbospec.decode.grammar import Constraint, Grammar, GrammarCompiler

from helpers import engine, make_byte_tokenizer, make_head, make_tiny_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99},
                                           "tag": {"enum": ["ab", "cd", "abcd"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
GRAMMARS = {
    "regex": ({"regex": "(ab|cd){1,4}x"}, lambda t: re.fullmatch("(ab|cd){1,4}x", t)),
    "choice": ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    "json_schema": ({"json_schema": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "lark": ({"lark": 'start: "[" num ("," num)? ("," num)? "]"\nnum: /[0-9]/'},
             lambda t: re.fullmatch(r"\[\d(,\d){0,2}\]", t)),
}
PROMPT_TEXT = '{"ok": true, "n": 5, "tag": "ab"} abcdx yes [1,2] ' * 2


@pytest.fixture
def byte_target(cyc):  # noqa: F811 - the cycling target: drafts are accepted
    return cyc[1], make_byte_tokenizer()


def _engines(target, tok, **kw):
    return {"plain": Engine(target, drafter="none", max_seq_len=512, tokenizer=tok, **kw),
            "ngram": Engine(target, drafter="ngram", max_seq_len=512, tokenizer=tok, num_draft=6, adaptive=False, **kw),
            "lookahead": Engine(target, drafter="lookahead", max_seq_len=512, tokenizer=tok, num_draft=6,
                                adaptive=False, **kw)}


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_output_matches_and_speculation_changes_nothing(byte_target, kind):
    target, tok = byte_target
    grammar, valid = GRAMMARS[kind]
    outs = {}
    for name, eng in _engines(target, tok).items():
        g = eng.generate(PROMPT_TEXT, 120, grammar=grammar, chat=False)
        outs[name] = g
    want = outs["plain"]
    assert want.finish_reason == "eos" and valid(want.text), want.text
    for name, g in outs.items():
        assert g.token_ids == want.token_ids, name
    if kind != "choice":  # (a one-word answer leaves the drafters nothing to accept)
        assert outs["ngram"].stats["draft_accepted"] + outs["lookahead"].stats["draft_accepted"] > 0
    free = Engine(target, drafter="none", max_seq_len=512, tokenizer=tok).generate(PROMPT_TEXT, 40, chat=False)
    try:
        free_ok = bool(valid(free.text))
    except (ValueError, jsonschema.ValidationError):
        free_ok = False
    assert not free_ok  # without the grammar the model writes something else


def test_head_trees_and_the_batch(cyc):  # noqa: F811
    """EAGLE-3 trees (their nodes checked against the grammar) and a batch mixing constrained and
    free requests: each equals the request alone without speculation."""
    hf, target, ref, vocab = cyc
    tok = make_byte_tokenizer()
    head = make_head("eagle3", target, vocab=vocab)
    eng = engine(target, "eagle3", head, vocab, num_draft=12, adaptive=False, max_seq_len=512, max_batch=3,
                 tokenizer=tok)
    plain = Engine(target, drafter="none", max_seq_len=512, tokenizer=tok)
    reqs = [Request(PROMPT_TEXT, 80, grammar={"json_schema": SCHEMA}), Request(PROMPT_TEXT, 30),
            Request(PROMPT_TEXT[5:], 60, grammar={"regex": "(ab|cd){1,4}x"}),
            Request(PROMPT_TEXT, 40, grammar={"choice": ["yes", "no"]}, temperature=0.9, seed=5)]
    out = eng.generate(reqs, chat=False)
    for r, g in zip(reqs, out):
        assert g.token_ids == eng.generate(r.prompt, r.max_new_tokens, grammar=r.grammar, chat=False,
                                           temperature=r.temperature or 0.0, seed=r.seed).token_ids
        if r.temperature is None:
            assert g.token_ids == plain.generate(r.prompt, r.max_new_tokens, grammar=r.grammar, chat=False).token_ids
    jsonschema.validate(json.loads(out[0].text), SCHEMA)
    assert out[3].text in ("yes", "no")
    assert sum(g.stats["draft_accepted"] for g in out) > 0


def test_logprobs_of_the_constrained_distribution(byte_target):
    """A token the grammar forbids has no probability: each token's logprob is the log_softmax over
    the allowed tokens only, and every alternative listed is allowed; the same with speculation."""
    target, tok = byte_target
    grammar = {"regex": "(ab|cd)+x"}
    engs = _engines(target, tok)
    a = engs["plain"].generate(PROMPT_TEXT, 30, grammar=grammar, chat=False, logprobs=True, top_logprobs=5)
    b = engs["ngram"].generate(PROMPT_TEXT, 30, grammar=grammar, chat=False, logprobs=True, top_logprobs=5)
    assert [(x.token_id, x.logprob, x.top) for x in a.logprobs] == [(x.token_id, x.logprob, x.top) for x in b.logprobs]
    allowed = set(b"abcdx") | {0}
    for lp in a.logprobs:
        assert all(t in allowed for t, _ in lp.top)
    # the first token: 'a' or 'c' only, renormalised
    with torch.no_grad():
        logits = target.forward(torch.tensor([tok.encode(PROMPT_TEXT)]),
                                torch.arange(len(tok.encode(PROMPT_TEXT)))[None],
                                target.new_cache(512), 0)[0, -1]
    two = torch.log_softmax(logits[[ord("a"), ord("c")]].double(), -1)
    first = a.token_ids[0]
    assert abs(a.logprobs[0].logprob - float(two[0 if first == ord("a") else 1])) < 1e-5


def test_bad_grammars_are_named(byte_target):
    target, tok = byte_target
    eng = Engine(target, drafter="none", max_seq_len=128, tokenizer=tok)
    for grammar, msg in (({"regex": "(ab"}, "regex"), ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
                         ({"choice": []}, "choice must be a non-empty list"), ({"lark": "start: foo"}, "lark"),
                         ({"xml": "x"}, "grammar must be a dict with exactly one key"),
                         ({"regex": "a", "choice": ["b"]}, "grammar must be a dict with exactly one key")):
        with pytest.raises(ValueError, match=msg):
            eng.generate("ab", 4, grammar=grammar, chat=False)
    with pytest.raises(ValueError, match="structured output needs the model's tokenizer"):
        Engine(target, drafter="none", max_seq_len=128).generate([1, 2, 3], 4, grammar={"regex": "a"})


def test_fill_marks_only_allowed_paths(byte_target):
    """The draft check itself: a tree's nodes get the masks of their own paths; a node the grammar
    forbids, and its subtree, allow everything (never reached); the matcher is left as it was."""
    target, tok = byte_target
    c = GrammarCompiler(tok, 256, [0]).matcher(Grammar.of({"regex": "(ab|cd)+x"}))
    out = torch.zeros(6, 8, dtype=torch.int32)
    # root -> a -> b -> x ; root -> z (forbidden) -> b
    n = c.fill([ord("a"), ord("b"), ord("x"), ord("z"), ord("b")], [0, 1, 2, 0, 4], out)
    assert n == 3

    def allowed(row):
        return {t for t in range(256) if Constraint.allows(out[row], t)}
    assert allowed(0) == {ord("a"), ord("c")}
    assert allowed(1) == {ord("b")}
    assert allowed(2) == {ord("a"), ord("c"), ord("x")}
    assert allowed(3) == {0}  # complete: end of sequence only
    assert len(allowed(4)) == 256 and len(allowed(5)) == 256
    c.commit([ord("c")])  # the state was rolled back to the root: 'c' is still allowed there
    assert not c.done()


def test_real_model_json_schema(smollm2):  # noqa: F811
    """SmolLM2-135M-Instruct answering with a JSON schema: valid, and the same with the shipped
    drafter as without."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = "Describe a fictional person as JSON with a name and an age."
    plain = Engine(drafter="none", max_seq_len=512).generate(prompt, 60, grammar={"json_schema": schema})
    spec = Engine(drafter="ngram", max_seq_len=512).generate(prompt, 60, grammar={"json_schema": schema})
    assert plain.finish_reason == "eos"
    jsonschema.validate(json.loads(plain.text), schema)
    assert spec.token_ids == plain.token_ids
    # any JSON object (response_format json_object); the random tiny models never close one
    obj = Engine(drafter="ngram", max_seq_len=512).generate(prompt, 80, grammar={"json_object": True})
    assert obj.finish_reason == "eos" and isinstance(json.loads(obj.text), dict)
