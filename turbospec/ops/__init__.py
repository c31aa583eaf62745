"""The compiled ops (``torch.ops.turbospec.*``) and what specifies them: ``wrappers`` (the Python
entry points and fake kernels), ``reference`` (the pure-torch specification of every op),
``sampling`` (sampling parameters and draft sampling), ``nvtx`` (profiler ranges)."""
from .wrappers import (add_rms_norm, build_tree, compact_kv, cpu_amx, cpu_bf16_dot, cpu_isa, cpu_prefetch, dequantize, has_op, kernels_available, linear,
                       merge_attention, rms_norm, rope_cache, silu_mul, eagle_input, eagle_output, small_linear, tree_attention, verify)

__all__ = ["add_rms_norm", "build_tree", "compact_kv", "cpu_amx", "cpu_bf16_dot", "cpu_isa", "cpu_prefetch", "dequantize", "has_op", "kernels_available", "linear",
           "merge_attention", "rms_norm", "rope_cache", "silu_mul", "eagle_input", "eagle_output", "small_linear", "tree_attention", "verify"]
