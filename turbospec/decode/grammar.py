"""Structured output: generation constrained to a grammar (JSON schema, any JSON object, a regular
expression, one of fixed choices, or a Lark grammar), exact under speculation.

The grammar engine is llguidance (the engine behind llama.cpp's and vLLM's ``guidance`` backend):
an ``LLMatcher`` per request follows the committed tokens and gives the set of tokens allowed next
as a bitmask. Before each verify pass the request's draft is checked against it: walking the draft
tree from the root, each node whose token the grammar allows at its parent is consumed (and rolled
back after its subtree), and every reachable node gets the bitmask of the tokens allowed after its
own path. ``verify`` masks the target's logits at every node with its bitmask
(``ops.verify(token_bitmask=...)``), so the target's distribution at each node is the constrained
one: a draft token the grammar forbids has probability 0 at its parent and is rejected there (the
nodes under it are never reached; their rows allow everything), and the recovered or bonus token is
drawn from the constrained distribution. Plain decoding is the same step with no drafts, so the
output with speculation equals the output without (greedy: the same tokens; sampling: the same
distribution), and every emitted token is one the grammar allows. When the grammar is complete only
an end-of-sequence token is allowed, so the request ends with EOS (``finish_reason`` "eos").
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence as Seq

import torch
from torch import Tensor

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")

# JSON is written in one layout, '{"key": value, "key": value}' (a schema's own "x-guidance" options
# may change it): no whitespace left to the model, which a weak model could otherwise spend its
# whole token budget on.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: ``kind`` one of ``KINDS`` and its ``value`` (a JSON
    schema as a dict or JSON text; True for any JSON object; a regular expression; a list of
    strings; a Lark grammar)."""
    kind: str
    value: object

    @classmethod
    def of(cls, spec) -> "Grammar | None":
        """A ``Grammar``, None, or a dict with exactly one of ``KINDS`` as its key (e.g.
        ``{"json_schema": {...}}``, ``{"regex": "[0-9]+"}``, ``{"choice": ["yes", "no"]}``)."""
        if spec is None or isinstance(spec, Grammar):
            return spec
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ValueError(f"grammar must be a dict with exactly one key of {list(KINDS)}, got {spec!r}")
        kind, value = next(iter(spec.items()))
        return cls(kind, value)

    def source(self) -> str:
        """The llguidance grammar text; ValueError naming what is wrong with the value."""
        from llguidance import LLMatcher
        kind, value = self.kind, self.value
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError(f"json_schema must be a JSON schema object, got {type(value).__name__}")
            try:
                return LLMatcher.grammar_from_json_schema(value, defaults=JSON_FORMAT)
            except ValueError as e:
                raise ValueError(f"json_schema: {e}") from None
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"json_object takes True, got {value!r}")
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_FORMAT)
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise ValueError(f"regex must be a non-empty string, got {value!r}")
            return LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {value!r}")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        if kind == "lark":
            if not isinstance(value, str) or not value:
                raise ValueError(f"lark must be a non-empty Lark grammar string, got {value!r}")
            return LLMatcher.grammar_from_lark(value)
        raise ValueError(f"grammar kind must be one of {list(KINDS)}, got {kind!r}")


def bitmask_words(vocab: int) -> int:
    return (vocab + 31) // 32


class GrammarCompiler:
    """Builds the per-request matchers of one tokenizer (its llguidance tokenizer is made once:
    about 0.3 s for a 49k vocabulary)."""

    def __init__(self, tokenizer, vocab: int, eos_token_ids):
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        try:
            import llguidance.hf
        except ImportError as e:  # pragma: no cover - a dependency in requirements.txt
            raise ValueError("structured output needs the llguidance package (pip install llguidance)") from e
        self.vocab = vocab
        self.eos = sorted(int(t) for t in eos_token_ids)
        if not self.eos:
            raise ValueError("structured output needs an end-of-sequence token (the tokenizer has none)")
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=self.eos)
        except ValueError as e:
            raise ValueError(f"structured output: this tokenizer is not supported by llguidance ({e})") from None

    def matcher(self, grammar: Grammar) -> "Constraint":
        return Constraint(self, grammar)


class Constraint:
    """One request's grammar state (see the module docstring): ``fill`` writes the bitmasks of a
    step's nodes, ``commit`` follows the tokens the step kept."""

    def __init__(self, compiler: GrammarCompiler, grammar: Grammar):
        from llguidance import LLMatcher
        self.grammar, self.vocab, self.eos = grammar, compiler.vocab, frozenset(compiler.eos)
        self.matcher = LLMatcher(compiler.tokenizer, grammar.source(), log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"{grammar.kind}: {self.matcher.get_error()}")

    def _fill_row(self, row: Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @staticmethod
    def allows(row: Tensor, token: int) -> bool:
        return bool((int(row[token >> 5]) >> (token & 31)) & 1)

    def fill(self, token_ids: Seq[int], parents: Seq[int] | None, out: Tensor) -> int:
        """The bitmasks of a step's nodes into ``out`` int32 [k + 1, W] (contiguous, on the host):
        row 0 (the root) the tokens allowed now, row i those allowed after the path to draft i.
        Rows of nodes the grammar rules out (their token is not allowed at their parent) and their
        subtrees allow every token (verify never reaches them), as do the rows after an
        end-of-sequence token (the request ends there; what follows is cut). ``parents`` None: a
        chain. Returns how many draft nodes the grammar allows on their paths."""
        k = len(token_ids)
        out[: k + 1].fill_(-1)
        children: list[list[int]] = [[] for _ in range(k + 1)]
        for i in range(1, k + 1):
            children[i - 1 if parents is None else parents[i - 1]].append(i)
        self._allowed = 0
        self._fill_row(out[0])
        self._visit(0, token_ids, children, out)
        return self._allowed

    def _visit(self, node: int, token_ids: Seq[int], children: list[list[int]], out: Tensor) -> None:
        for c in children[node]:
            tok = token_ids[c - 1]
            if not (0 <= tok < self.vocab and self.allows(out[node], tok)):
                continue
            self._allowed += 1
            if tok in self.eos:
                continue
            if not self.matcher.consume_token(tok):
                raise RuntimeError(f"{self.grammar.kind}: the grammar refused a token its own mask allows "
                                   f"({self.matcher.get_error()}); this is a bug")
            self._fill_row(out[c])
            self._visit(c, token_ids, children, out)
            self.matcher.rollback(1)

    def commit(self, tokens: Seq[int]) -> None:
        """The tokens a step kept (each allowed by construction; an EOS ends the grammar)."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"{self.grammar.kind}: the grammar refused an emitted token "
                               f"({self.matcher.get_error()}); this is a bug")

    def done(self) -> bool:
        """The grammar is complete (only end-of-sequence is allowed now)."""
        return self.matcher.is_stopped()
