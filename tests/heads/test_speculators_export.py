"""The exported EAGLE-3 head read by vLLM's speculators library (tests/heads/speculators_check.py).

speculators pins transformers <= 5.19 and pulls datasets / pyarrow; it is installed apart from the
test environment (``.ci/run``: ``pip install --no-deps --target``), named by
``$TURBOSPEC_SPECULATORS_PATH``, and the check runs in a subprocess with it on the path. Outside
CI the test skips when speculators is not installed; in CI (``CI=true``) it must run."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_exported_eagle3_head_loads_in_speculators(smollm2):
    path = os.environ.get("TURBOSPEC_SPECULATORS_PATH", "")
    if not (path and os.path.isdir(os.path.join(path, "speculators"))) and importlib.util.find_spec("speculators") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run this check: install speculators as .ci/run does and set TURBOSPEC_SPECULATORS_PATH")
        pytest.skip("speculators is not installed (see .ci/run)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, os.path.join(HERE, "speculators_check.py")], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    checks = [line for line in r.stdout.splitlines() if line.startswith("CHECK ")]
    assert len(checks) == 4, r.stdout
    assert "argmax equal" in checks[-1]
