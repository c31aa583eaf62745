"""End-to-end benchmark (same as `turbospec bench`); see turbospec/benchmark.py for the options.

Example (CPU, default model, both dtypes):
    python bench/bench_e2e.py --dtype float32 --layer-skip 8
    python bench/bench_e2e.py --dtype bfloat16 --layer-skip 8
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from turbospec.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
