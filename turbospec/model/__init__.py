"""The target model: the Llama-family ``Transformer`` (dense or GGUF-quantized weights, kept as
stored), its static KV cache, rotary tables, loading (HF directories, GGUF files, transformers
models), and the verify forward's runner (dynamic, fixed-shape, CUDA graphs)."""
from .kv_cache import KVCache
from .transformer import ModelConfig, Transformer

__all__ = ["KVCache", "ModelConfig", "Transformer"]
