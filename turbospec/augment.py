"""Training prompts written with the target itself, for heads that draft where users go.

A draft head learns the target's answers to its training prompts (self-distillation), so it drafts
well only where those prompts went. The prompts that ship beside the project (T0 templates,
self-instruct seeds, GSM8K questions) are short tasks and grade-school maths; on the Spec-Bench
sample the shipped EAGLE-3 head reaches τ 3.00 on maths and 1.21–1.66 on translation,
summarization and chat (bench/results/2026-11-28-suffix-workloads.md). ``augment`` widens the
prompts without any new data, from the training prompts and the target:

* ``self_instruct``: the chat template up to the start of a user turn, continued by the target
  (sampled): the requests an instruction-tuned model has learnt users make (the idea of Magpie).
* ``summarize``: a passage from the training prompts with a request to summarise it.
* ``passage_qa``: a passage, and a question about it that the target wrote, to answer from it.
* ``translate``: an English sentence from the training prompts with a request to translate it into
  French, German or Spanish; and the target's translation given back to be translated into English.
* ``follow_up``: a training prompt, the target's own greedy answer, and a follow-up request (a
  conversation the target continues in its third turn, as chats resend their history).

Every generation is seeded (one seed per prompt), so the same settings give the same file. The
records are ``{"source": "augment/<kind>", "prompt": ...}`` (a string, or a message list for
follow-ups): ``turbospec train --data`` reads them like any prompt file.
"""
from __future__ import annotations

import hashlib
import json
import random
import re

from .decode.batch import Request

KINDS = ("self_instruct", "summarize", "passage_qa", "translate", "follow_up")
LANGUAGES = ("French", "German", "Spanish")
SUMMARIZE = ("Summarize the following text in a few sentences.\n\n{p}",
             "Write a short summary of this article:\n\n{p}",
             "{p}\n\nTL;DR: summarize the text above in two or three sentences.",
             "Give me the main points of the following passage as a short paragraph.\n\n{p}")
ASK = "Write one question that can be answered from this text. Reply with the question only.\n\n{p}"
PASSAGE_QA = ("Answer the question using the passage below.\n\nPassage: {p}\n\nQuestion: {q}",
              "{p}\n\nBased on the text above, {q}",
              "Read the passage and answer the question.\n\n{p}\n\nQ: {q}")
TO_LANGUAGE = ("Translate the following sentence into {lang}:\n{s}",
               "How do you say this in {lang}? \"{s}\"",
               "Translate into {lang}: {s}")
TO_ENGLISH = ("Translate the following {lang} text into English:\n{s}",
              "Translate to English: {s}",
              "What does this {lang} text mean in English? {s}")
FOLLOW_UPS = ("Can you explain that more simply?", "Give me an example.", "Why is that?",
              "Can you make it shorter?", "What else should I know about this?",
              "Summarize your answer in one sentence.", "Are you sure? Please check your answer.",
              "Now write it as a list of steps.")


def user_turn_prefix(tokenizer) -> list[int]:
    """The token ids of the chat template up to where a user turn's text begins (the system prompt
    the template adds included)."""
    mark = "\ufffcUSER\ufffc"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=False)
    if mark not in text:
        raise ValueError("the tokenizer's chat template does not show the user's text: self_instruct "
                         "needs a chat template")
    return tokenizer(text[:text.index(mark)], add_special_tokens=False)["input_ids"]


def passages(prompts: list, min_chars: int = 300, max_chars: int = 1500) -> list[str]:
    """Paragraphs of the string prompts at least ``min_chars`` long (cut at ``max_chars`` on a
    sentence end), without duplicates, in order."""
    seen, out = set(), []
    for p in prompts:
        if not isinstance(p, str):
            continue
        for para in re.split(r"\n\s*\n", p):
            para = " ".join(para.split())
            if len(para) < min_chars:
                continue
            if len(para) > max_chars:
                cut = para.rfind(". ", 0, max_chars)
                para = para[: cut + 1] if cut >= min_chars else para[:max_chars]
            if para not in seen:
                seen.add(para)
                out.append(para)
    return out


def sentences(texts: list[str], min_chars: int = 40, max_chars: int = 240) -> list[str]:
    """Whole English-looking sentences of ``texts`` (a capital first, a full stop last, ASCII)."""
    seen, out = set(), []
    for t in texts:
        for s in re.split(r"(?<=[.!?])\s+", t):
            s = s.strip()
            if (min_chars <= len(s) <= max_chars and s[0].isupper() and s[-1] in ".!?" and s.isascii()
                    and s not in seen):
                seen.add(s)
                out.append(s)
    return out


def _clean(text: str, max_chars: int = 1200) -> str | None:
    """A generated text kept as a prompt part: stripped, non-empty, not cut mid-way (None)."""
    text = text.strip()
    if len(text) < 8 or len(text) > max_chars:
        return None
    return text


class Augmenter:
    """Writes augmented prompts with ``engine`` (a ``turbospec.Engine`` on the target, any drafter:
    it only changes the speed) from ``prompts`` (the training prompts). ``seed`` picks passages,
    templates and the sampling seeds."""

    def __init__(self, engine, prompts: list, seed: int = 0, temperature: float = 0.8,
                 max_new_tokens: int = 128):
        if engine.tokenizer is None:
            raise ValueError("augment needs an Engine with a tokenizer (it writes text prompts)")
        self.engine, self.prompts, self.seed = engine, prompts, seed
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.rng = random.Random(seed)
        self._passages = passages(prompts)
        self._sentences = sentences(self._passages + [p for p in prompts if isinstance(p, str)])

    def _texts(self, requests: list[Request]) -> list[tuple[str, str]]:
        """Runs the requests as one batch; (text, finish reason) each."""
        if not requests:
            return []
        gens = self.engine.generate(requests)
        tok = self.engine.tokenizer
        return [(tok.decode(g.token_ids, skip_special_tokens=True), g.finish_reason) for g in gens]

    def _seed(self, kind: str, i: int) -> int:
        h = hashlib.sha1(f"{self.seed}/{kind}/{i}".encode()).digest()
        return int.from_bytes(h[:6], "little")

    def _pick(self, pool: list, n: int, what: str) -> list:
        if not pool:
            raise ValueError(f"augment: the training prompts have no {what} to build prompts from")
        return [pool[self.rng.randrange(len(pool))] for _ in range(n)]

    def self_instruct(self, n: int) -> list[dict]:
        prefix = user_turn_prefix(self.engine.tokenizer)
        reqs = [Request(prefix, max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=0.95,
                        seed=self._seed("self_instruct", i)) for i in range(n)]
        out = []
        for text, finish in self._texts(reqs):
            text = _clean(text)
            if text is not None and finish != "length":  # a request the target finished
                out.append({"source": "augment/self_instruct", "prompt": text})
        return out

    def summarize(self, n: int) -> list[dict]:
        return [{"source": "augment/summarize", "prompt": self.rng.choice(SUMMARIZE).format(p=p)}
                for p in self._pick(self._passages, n, "passages")]

    def passage_qa(self, n: int) -> list[dict]:
        ps = self._pick(self._passages, n, "passages")
        reqs = [Request(ASK.format(p=p), max_new_tokens=48, temperature=self.temperature, top_p=0.95,
                        seed=self._seed("passage_qa", i)) for i, p in enumerate(ps)]
        out = []
        for p, (q, finish) in zip(ps, self._texts(reqs)):
            q = _clean(q, 300)
            if q is not None and finish != "length":
                out.append({"source": "augment/passage_qa", "prompt": self.rng.choice(PASSAGE_QA).format(p=p, q=q)})
        return out

    def translate(self, n: int) -> list[dict]:
        """n // 2 prompts into a language, and n - n // 2 back into English from the target's own
        translations (greedy)."""
        ss = self._pick(self._sentences, n - n // 2, "English sentences")
        langs = [LANGUAGES[i % len(LANGUAGES)] for i in range(len(ss))]
        there = [self.rng.choice(TO_LANGUAGE).format(lang=lang, s=s) for s, lang in zip(ss, langs)]
        reqs = [Request(p, max_new_tokens=self.max_new_tokens) for p in there]
        out = [{"source": "augment/translate", "prompt": p} for p in there[: n // 2]]
        for lang, (text, finish) in zip(langs, self._texts(reqs)):
            text = _clean(text, 600)
            if text is not None and finish != "length":
                out.append({"source": "augment/translate",
                            "prompt": self.rng.choice(TO_ENGLISH).format(lang=lang, s=text)})
        return out

    def follow_up(self, n: int) -> list[dict]:
        firsts = self._pick([p for p in self.prompts if isinstance(p, str)], n, "string prompts")
        reqs = [Request(p, max_new_tokens=self.max_new_tokens) for p in firsts]
        out = []
        for p, (answer, finish) in zip(firsts, self._texts(reqs)):
            answer = answer.strip()
            if answer:
                out.append({"source": "augment/follow_up",
                            "prompt": [{"role": "user", "content": p}, {"role": "assistant", "content": answer},
                                       {"role": "user", "content": self.rng.choice(FOLLOW_UPS)}]})
        return out

    def run(self, counts: dict[str, int]) -> list[dict]:
        """``counts``: kind -> prompts wanted (a kind may give fewer: generated texts that did not
        finish within the length limit are dropped)."""
        bad = set(counts) - set(KINDS)
        if bad:
            raise ValueError(f"augment kinds {sorted(bad)} are not known; choose from {', '.join(KINDS)}")
        out = []
        for kind in KINDS:
            n = counts.get(kind, 0)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"augment count for {kind} must be an integer >= 0, got {n!r}")
            if n:
                out += getattr(self, kind)(n)
        return out


def parse_counts(spec: str) -> dict[str, int]:
    """'self_instruct=1000,summarize=500' -> {kind: count}."""
    counts = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        kind, eq, n = part.partition("=")
        if not eq or not n.strip().isdigit():
            raise ValueError(f"--kinds: expected KIND=COUNT[,KIND=COUNT...], got {part!r}")
        counts[kind.strip()] = int(n)
    bad = set(counts) - set(KINDS)
    if bad:
        raise ValueError(f"--kinds: {sorted(bad)} are not known; choose from {', '.join(KINDS)}")
    return counts


def write(records: list[dict], path: str, provenance: dict) -> None:
    """The records as JSONL at ``path`` and their provenance as ``path`` + '.json'."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    by_kind: dict[str, int] = {}
    for r in records:
        by_kind[r["source"]] = by_kind.get(r["source"], 0) + 1
    with open(path + ".json", "w") as f:
        json.dump({**provenance, "records": len(records), "by_source": by_kind}, f, indent=1)
