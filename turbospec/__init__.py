"""turbospec: exact speculative decoding for Hugging Face causal language models."""
from .drafters.base import Draft, Drafter
from .decode.engine import ContextLengthError, Engine, Generation, NonFiniteLogitsError, Request, TokenLogprob
from .model.loader import default_model_path, load_model, load_tokenizer
from .ops import kernels_available
from .auditing import audit

__all__ = ["Engine", "Generation", "ContextLengthError", "NonFiniteLogitsError", "Request", "TokenLogprob", "Draft", "Drafter", "kernels_available",
           "load_model", "load_tokenizer", "default_model_path", "audit"]
