"""setup.py's choice of the C++ runtime: the extension must link the shared libstdc++ (a private
static copy made every failed argument check crash the process on the GPU machine)."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def runtime_flags_fn():
    """``_shared_cxx_runtime_flags`` from setup.py, without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_shared_cxx_runtime_flags")
    ns = {"os": os, "sys": sys, "subprocess": subprocess, "sysconfig": sysconfig}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), ns)
    return ns["_shared_cxx_runtime_flags"]


def test_compiler_without_a_shared_libstdcxx_gets_the_system_one(tmp_path, monkeypatch):
    stub = tmp_path / "g++"
    stub.write_text("#!/bin/sh\necho libstdc++.so\n")  # what a GCC with only libstdc++.a prints
    stub.chmod(0o755)
    monkeypatch.setenv("CXX", str(stub))
    monkeypatch.delenv("TURBOSPEC_SHARED_LIBSTDCXX", raising=False)
    assert runtime_flags_fn()() == ["-l:libstdc++.so.6"]
    monkeypatch.setenv("TURBOSPEC_SHARED_LIBSTDCXX", "0")
    assert runtime_flags_fn()() == []


def test_compiler_with_a_shared_libstdcxx_links_it_itself(monkeypatch):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(found):
        pytest.skip(f"{cxx} has no shared libstdc++ here")
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.delenv("TURBOSPEC_SHARED_LIBSTDCXX", raising=False)
    assert runtime_flags_fn()() == []
    monkeypatch.setenv("TURBOSPEC_SHARED_LIBSTDCXX", "1")
    assert runtime_flags_fn()() == ["-l:libstdc++.so.6"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF only")
def test_built_extension_does_not_carry_its_own_cxx_runtime():
    from turbospec.ops.wrappers import _EXTENSION
    if not _EXTENSION or shutil.which("nm") is None:
        pytest.skip("no built extension or no nm")
    import turbospec._C as ext
    out = subprocess.run(["nm", "-D", "--defined-only", ext.__file__], capture_output=True, text=True).stdout
    assert "__cxa_throw" not in out, f"{ext.__file__} defines __cxa_throw: a static libstdc++ was linked in"


def test_no_kernel_vector_code_is_left_in_an_out_of_line_lambda():
    """A lambda's body is a function of its own: it does not take the ``target("avx2,fma")`` /
    AVX-512 attribute of the ISA-specific kernel it is written in, so GCC compiles it for the
    baseline ISA and emulates the kernel's GCC vector types there (tree_attention's score lambda
    made the AVX2 path 3x slower than the scalar one and 9x slower than after the fix). Vector code
    belongs in always-inlined functions; a lambda symbol whose signature carries a vector type means
    one slipped back in."""
    from turbospec.ops.wrappers import _EXTENSION
    if not _EXTENSION or shutil.which("nm") is None:
        pytest.skip("no built extension or no nm")
    import turbospec._C as ext
    out = subprocess.run(["nm", "-C", "--defined-only", ext.__file__], capture_output=True, text=True).stdout
    bad = [line.split(" ", 2)[-1][:200] for line in out.splitlines()
           if "turbospec::" in line and "{lambda(" in line and "__vector(" in line]
    assert not bad, "vector code compiled out of line in lambdas (baseline ISA):\n" + "\n".join(bad)
