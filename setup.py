"""Build turbospec and its compiled ops, ``turbospec._C``.

    pip install --no-build-isolation -e .        # or: python setup.py build_ext --inplace

Install torch first and build with ``--no-build-isolation`` (otherwise pip may fetch another torch
into an isolated build environment). The CUDA kernels (csrc/cuda/*.cu) are built when torch has
CUDA and nvcc is found; ``TURBOSPEC_CUDA=0`` / ``=1`` forces them off / on. ``MAX_JOBS`` limits the
parallel compile jobs, ``TORCH_CUDA_ARCH_LIST`` the GPU architectures (e.g. "8.0;9.0"),
``TURBOSPEC_DEBUG_INFO=1`` keeps debug info in the C++ objects (off by default: faster to build).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover
    sys.exit("turbospec: install torch first, then build with `pip install --no-build-isolation -e .`")

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(paths: list[str]) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _use_cuda() -> bool:
    forced = os.environ.get("TURBOSPEC_CUDA", "").strip()
    if forced == "1" and torch.version.cuda is None:
        sys.exit(f"turbospec: TURBOSPEC_CUDA=1, but torch {torch.__version__} has no CUDA (install a CUDA build of torch)")
    if forced in ("0", "1"):
        return forced == "1"
    has_nvcc = cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    return torch.version.cuda is not None and has_nvcc


def _shared_cxx_runtime_flags() -> list[str]:
    """Link flags that make _C use the process's shared C++ runtime (libstdc++.so.6).

    A compiler whose own library folder holds only the static libstdc++.a (seen on the lent GPU
    machine: a GCC 13 under /opt/gcc) links a private copy of the C++ runtime into _C. An exception
    thrown there (every argument check: TORCH_CHECK) then ran that copy's __cxa_throw and crashed
    the process (SIGSEGV) instead of reaching Python as a RuntimeError. When the compiler cannot
    name a shared libstdc++.so, name the runtime that torch itself loads: ``-l:libstdc++.so.6``.
    ``TURBOSPEC_SHARED_LIBSTDCXX=1`` / ``=0`` forces this on / off."""
    forced = os.environ.get("TURBOSPEC_SHARED_LIBSTDCXX", "").strip()
    if forced in ("0", "1"):
        return ["-l:libstdc++.so.6"] if forced == "1" else []
    if not sys.platform.startswith("linux"):
        return []
    cxx = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []  # the compiler links its shared runtime itself
    print(f"turbospec: {cxx} has no shared libstdc++.so; linking the system's libstdc++.so.6 explicitly")
    return ["-l:libstdc++.so.6"]


def _extension():
    cpu_sources = _rel([os.path.join(ROOT, "csrc", "ops.cpp")] + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    # at::parallel_for runs on OpenMP, as in torch's own build. No floating-point contraction: a
    # kernel's scalar (baseline ISA) and vector paths then do the same roundings (fused multiply-adds
    # are written out where wanted), so every ISA gives the same bits.
    # TURBOSPEC_BUILD_OPT=-O0 is for build checks that run nothing (CI's CUDA link check): the CPU
    # kernels then compile in a fraction of the time.
    opt = os.environ.get("TURBOSPEC_BUILD_OPT", "-O3").strip()
    if opt not in ("-O0", "-O1", "-O2", "-O3"):
        sys.exit(f"turbospec: TURBOSPEC_BUILD_OPT={opt!r}; allowed: -O0, -O1, -O2, -O3")
    # No debug info unless TURBOSPEC_DEBUG_INFO=1 (Python's own CFLAGS carry -g): the same machine code,
    # built faster and a much smaller _C (measured: bench/results/2026-11-28-build-time.md).
    debug = ["-g"] if os.environ.get("TURBOSPEC_DEBUG_INFO", "").strip() == "1" else ["-g0"]
    cxx_flags = [opt, *debug, "-fopenmp", "-ffp-contract=off"]
    link_flags = ["-fopenmp"] + _shared_cxx_runtime_flags()
    if _use_cuda():
        cuda_sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
        print(f"turbospec: building CPU + CUDA kernels ({len(cuda_sources)} .cu files)")
        return cpp_extension.CUDAExtension(
            "turbospec._C", cpu_sources + cuda_sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=link_flags)
    print("turbospec: building CPU kernels only (no CUDA torch / nvcc, or TURBOSPEC_CUDA=0)")
    return cpp_extension.CppExtension("turbospec._C", cpu_sources, extra_compile_args={"cxx": cxx_flags},
                                      extra_link_args=link_flags)


setup(
    name="turbospec",
    version="0.1.0",
    description="Exact speculative decoding for Hugging Face causal language models",
    packages=find_packages(include=["turbospec", "turbospec.*"]),
    package_data={"turbospec": ["*.json", "heads_data/*/*.json", "heads_data/*/*.safetensors"]},
    python_requires=">=3.10",
    install_requires=["torch", "transformers", "gguf", "accelerate", "safetensors", "tqdm"],
    entry_points={"console_scripts": ["turbospec=turbospec.cli:main"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    zip_safe=False,
)
