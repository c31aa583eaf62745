"""A GGUF's tokenizer built from its own metadata with the ``tokenizers`` library (issue 37).

transformers' GGUF conversion reads the vocabulary through a second parser and builds a GPT2Tokenizer
that is then copied (~1-9 s for a 151,936-token vocabulary), and turbospec used to save the result
(11 MB for Qwen2.5) in its cache. Here the same tokenizer comes straight from the metadata each load:
a byte-level BPE model from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``, the file's
control tokens as special tokens and its user-defined ones as added tokens, the pre-tokenizer regex
``tokenizer.ggml.pre`` names, the bos / eos / unk / pad tokens, ``add_bos_token`` and
``tokenizer.chat_template``, wrapped as a transformers ``PreTrainedTokenizerFast`` (what the rest of
turbospec uses: ``apply_chat_template``, ``decode``, ``eos_token``).

Covered: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with the pre-tokenizers in
``BYTE_LEVEL_SPLITS``. Anything else (SentencePiece "llama" vocabularies, unigram "t5", other
pre-tokenizers) gives ``unsupported_reason`` a reason, and the loader falls back to transformers'
conversion. The result is meant to equal that conversion id for id (tests/model/test_gguf_tokenizer.py).
"""
from __future__ import annotations

from functools import lru_cache

from .gguf import read_gguf

TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")

# GGUF token types (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4

# The text split before byte-level BPE, by ``tokenizer.ggml.pre`` (llama.cpp's names). None: the GPT-2
# split built into ``pre_tokenizers.ByteLevel(use_regex=True)``, which transformers' conversion also
# gives a byte-level vocabulary whose pre-tokenizer it has no entry for ("smollm": llama.cpp isolates
# every digit as well, transformers does not; SmolLM2's merges join no digits, see the tests).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "gpt-2": None, "smollm": None,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
}


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """Byte b -> the character byte-level BPE spells it with: printable Latin-1 bytes as themselves,
    the other 68 (controls, space, NBSP, soft hyphen) as U+0100 onwards in byte order."""
    shown = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0x100
    for b in range(256):
        if b in shown:
            out.append(chr(b))
        else:
            out.append(chr(extra))
            extra += 1
    return tuple(out)


def unsupported_reason(meta: dict) -> str | None:
    """Why the tokenizer in this metadata (``read_gguf``'s) is not built here, or None when it is."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        return f"tokenizer.ggml.model {model!r} (only byte-level BPE, 'gpt2', is built from the metadata)"
    if pre not in BYTE_LEVEL_SPLITS:
        return f"tokenizer.ggml.pre {pre!r} (known: {', '.join(sorted(BYTE_LEVEL_SPLITS))})"
    if "tokenizer.ggml.merges#count" not in meta:
        return "no tokenizer.ggml.merges"
    return None


def backend_tokenizer(meta: dict):
    """The ``tokenizers.Tokenizer`` of a byte-level BPE GGUF from its metadata (``read_gguf(path,
    TOKENIZER_ARRAYS)``'s): vocabulary, merges, special and added tokens, pre-tokenizer, decoder."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    alphabet = byte_alphabet()
    letters = frozenset(alphabet)
    # a token spelled outside the byte alphabet (llama.cpp writes some added tokens as raw text) is
    # respelled from its UTF-8 bytes, as the BPE model sees text
    vocab = {(t if letters.issuperset(t) else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    split = BYTE_LEVEL_SPLITS[meta.get("tokenizer.ggml.pre", "default")]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    if types is not None:
        # control tokens (<|im_end|>) are special and matched whole; one spelled outside the byte
        # alphabet is a mislabel (it would be a new id past the model's vocabulary), left out.
        # User-defined ones (<tool_call>) are matched whole but are not special (decode keeps them).
        control = [AddedToken(tokens[i], special=True, normalized=False)
                   for i in (types == CONTROL).nonzero()[0] if letters.issuperset(tokens[i])]
        if control:
            tok.add_special_tokens(control)
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i in (types == USER_DEFINED).nonzero()[0] if tokens[i] in vocab]
        if user:
            tok.add_tokens(user)
    return tok


def gguf_tokenizer(path: str, meta: dict | None = None):
    """The transformers tokenizer (``PreTrainedTokenizerFast``) of the GGUF at ``path``, built from its
    metadata (``meta``: ``read_gguf(path, TOKENIZER_ARRAYS)``'s, read here when None). Raises
    ValueError naming the reason for a tokenizer this module does not build (``unsupported_reason``)."""
    if meta is None or "tokenizer.ggml.tokens" not in meta:
        meta, _ = read_gguf(path, TOKENIZER_ARRAYS)
    reason = unsupported_reason(meta)
    if reason is not None:
        raise ValueError(f"{path}: cannot build its tokenizer from the metadata: {reason}")
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    kwargs = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        kwargs[name] = tokens[i] if i is not None and 0 <= i < len(tokens) else None
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in meta:
            kwargs[key] = bool(meta[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in meta:
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    # PreTrainedTokenizerFast(tokenizer_object=...) deep-copies the backend (0.5 s for 151,936 tokens);
    # its constructor keeps a backend already set on the instance, as transformers' own subclasses
    # (GPT2Tokenizer) set it before calling it
    backend = backend_tokenizer(meta)
    tok = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tok._tokenizer = backend
    try:
        PreTrainedTokenizerFast.__init__(tok, **kwargs)
    except ValueError:  # a transformers whose constructor wants the backend passed (then copies it)
        tok = None
    if tok is None or tok.backend_tokenizer is not backend:
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    return tok
