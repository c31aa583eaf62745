"""Text in and out of a generation: prompts to token ids (chat template), stop strings, and the
incremental detokenizing that streams text without splitting a character or showing the start of a
stop string before it is decided."""
from __future__ import annotations

from torch import Tensor


def encode(tokenizer, vocab_size: int, prompt, chat: bool | None = None) -> list[int]:
    """Prompt -> token ids. A string gets the tokenizer's chat template (as one user turn) unless
    ``chat=False``; a list of {"role", "content"} dicts is a conversation; ids pass through."""
    if isinstance(prompt, Tensor):
        prompt = prompt.flatten().tolist()
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int)):
        ids = [int(t) for t in prompt]
    else:
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer (pass tokenizer= or token ids)")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt is empty: give at least one token")
        messages = prompt if isinstance(prompt, (list, tuple)) else None
        use_chat = (chat is not False) and getattr(tokenizer, "chat_template", None)
        if messages is None and use_chat:
            messages = [{"role": "user", "content": prompt}]
        if messages is not None:
            text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def stop_strings(stop, tokenizer) -> list[str]:
    """``stop`` (None, a string or a list of strings) -> a list, checked."""
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop or [])
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    return stop


class StopMatcher:
    """Finds the first stop string in the generated text as tokens arrive; only the text that a new
    match could touch is searched each time."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self._longest = max(map(len, stop), default=0)
        self._text_len = 0

    def find(self, generated: list[int]) -> int | None:
        """The end (in characters) of the text before the first stop string in ``generated``'s
        text, or None when there is none yet."""
        if not self.stop:
            return None
        text = self.tokenizer.decode(generated)
        start = max(0, self._text_len - self._longest)
        hits = [h for h in (text.find(s, start) for s in self.stop) if h >= 0]
        self._text_len = len(text)
        return min(hits) if hits else None


def final_text(tokenizer, generated: list[int], stop_end: int | None) -> str:
    """The completion's text: cut before the stop string when one matched (the cut is measured on
    the text with special tokens, as ``StopMatcher`` saw it)."""
    if stop_end is not None:
        return tokenizer.decode(generated)[:stop_end]
    return tokenizer.decode(generated, skip_special_tokens=True)


class TextStream:
    """Turns the growing list of generated ids into text deltas: waits for the rest of an incomplete
    multi-byte character, and holds back text that may be the start of a stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.shown = ""

    def _held_back(self, text: str) -> int:
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)

    def push(self, generated: list[int], stop_end: int | None) -> str:
        """The new text to show after ``generated`` (possibly empty)."""
        text = final_text(self.tokenizer, generated, stop_end)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the rest
        if stop_end is None:
            text = text[: len(text) - self._held_back(text)]
        return self._advance(text)

    def finish(self, generated: list[int], stop_end: int | None) -> str:
        """The text still to show when the generation has ended."""
        return self._advance(final_text(self.tokenizer, generated, stop_end))

    def _advance(self, text: str) -> str:
        if len(text) > len(self.shown) and text.startswith(self.shown):
            delta, self.shown = text[len(self.shown):], text
            return delta
        return ""


def eos_token_ids(model_eos: list[int], tokenizer) -> set[int]:
    """The tokens that end a generation: the model config's EOS ids and the tokenizer's."""
    eos = set(model_eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``), inverted: character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


class TokenPieces:
    """A token id's own text and bytes, for reporting log-probabilities (OpenAI's ``token`` and
    ``bytes``): byte-level BPE pieces (GPT-2, Llama 3, SmolLM2) map back to their exact bytes, a
    SentencePiece byte-fallback piece ``<0xNN>`` to its byte and ``▁`` to a space; other tokenizers
    give ``decode([id])``. A piece that is part of a multi-byte character has its bytes, and its
    text shows U+FFFD for what is not a whole character. Cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, bytes]] = {}

    def bytes(self, token_id: int) -> bytes:
        return self(token_id)[1]

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._piece(token_id)
        return got

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if not isinstance(piece, str):
            raw = self.tokenizer.decode([token_id]).encode()
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and \
                all(c in "0123456789abcdefABCDEF" for c in piece[3:5]):
            raw = bytes([int(piece[3:5], 16)])
        elif self.byte_level and piece and all(c in _BYTE_LEVEL for c in piece):
            raw = bytes(_BYTE_LEVEL[c] for c in piece)
        elif "\u2581" in piece:
            raw = piece.replace("\u2581", " ").encode()
        else:
            raw = self.tokenizer.decode([token_id]).encode()
        return raw.decode("utf-8", errors="replace"), raw
