"""The errors a request can end with, as types (the server maps each to its HTTP answer)."""
from __future__ import annotations


class ContextLengthError(ValueError):
    """The prompt plus ``max_new_tokens`` does not fit the KV cache (``max_seq_len``)."""


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN/inf logits; no token was emitted from them."""
