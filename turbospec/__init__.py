"""turbospec: exact speculative decoding for Hugging Face causal language models."""
from .ops import kernels_available

__all__ = ["kernels_available"]
