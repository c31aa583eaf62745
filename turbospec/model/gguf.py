"""A minimal GGUF reader: the architecture name and every tensor as a view of the memory-mapped file.

``gguf.GGUFReader`` parses every metadata field into Python objects (a tokenizer's vocabulary and
merges: ~100k strings, seconds per load); this reader walks past the metadata and maps the tensors,
so that loading a quantized model costs about as much as reading its bytes. Format: GGUF v2/v3
(little endian), as written by llama.cpp and the ``gguf`` package.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from ..ops.reference import WEIGHT_FORMATS

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9
_DENSE = {0: np.float32, 1: np.float16, 30: np.uint16}  # F32, F16, BF16 (raw words)


@dataclass
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length (K)
    data: np.ndarray        # dense: [rows, K] (or [K]) of the stored dtype; blocks: uint8 [rows, row bytes]


def read_gguf(path: str) -> tuple[dict, dict[str, GGUFTensor]]:
    """(scalar metadata {key: value} (strings and numbers; an array only as its length, under
    ``key + "#count"``), {name: GGUFTensor})."""
    if os.path.getsize(path) < 24:
        raise ValueError(f"{path}: not a GGUF file ({os.path.getsize(path)} bytes: shorter than a GGUF header)")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return _parse(path, mm)
    except (struct.error, IndexError, OverflowError, MemoryError) as e:  # the header runs past the file
        raise ValueError(f"{path}: corrupt or truncated GGUF header ({len(mm)} bytes; {e})") from None


def _parse(path: str, mm) -> tuple[dict, dict[str, GGUFTensor]]:
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    pos = 24

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        return bytes(buf[p + 8:p + 8 + n]).decode("utf-8", "replace"), p + 8 + n

    def skip_value(t: int, p: int) -> int:
        if t in _SCALARS:
            return p + _SCALARS[t]
        if t == _STRING:
            (n,) = struct.unpack_from("<Q", buf, p)
            return p + 8 + n
        if t == _ARRAY:
            it, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if it in _SCALARS:
                return p + count * _SCALARS[it]
            for _ in range(count):
                p = skip_value(it, p)
            return p
        raise ValueError(f"{path}: unknown GGUF value type {t}")

    meta: dict = {}
    fmt = {4: "<I", 5: "<i", 6: "<f", 10: "<Q", 11: "<q", 12: "<d", 0: "<B", 1: "<b", 2: "<H", 3: "<h", 7: "<?"}
    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if t == _STRING:
            meta[key], pos = string(pos)
        elif t in fmt:
            (meta[key],) = struct.unpack_from(fmt[t], buf, pos)
            pos += _SCALARS[t]
        else:
            if t == _ARRAY:  # kept as its length only (a vocabulary's token count)
                meta[key + "#count"] = struct.unpack_from("<IQ", buf, pos)[1]
            pos = skip_value(t, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{nd}Q", buf, pos + 4)
        t, off = struct.unpack_from("<IQ", buf, pos + 4 + 8 * nd)
        pos += 4 + 8 * nd + 12
        infos.append((name, tuple(int(d) for d in dims), int(t), int(off)))
    align = int(meta.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    tensors = {}
    for name, dims, t, off in infos:
        k = dims[0]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if t in _DENSE or t in WEIGHT_FORMATS:
            dt = np.dtype(_DENSE[t]) if t in _DENSE else np.dtype(np.uint8)
            row_items = k if t in _DENSE else k // WEIGHT_FORMATS[t][1] * WEIGHT_FORMATS[t][2]
            if start + off + rows * row_items * dt.itemsize > len(mm):
                raise ValueError(f"{path}: truncated: tensor {name!r} ({rows * row_items * dt.itemsize} bytes at "
                                 f"offset {start + off}) runs past the end of the file ({len(mm)} bytes)")
            arr = np.frombuffer(mm, dtype=dt, count=rows * row_items, offset=start + off)
            arr = arr.reshape(rows, row_items) if len(dims) > 1 or t not in _DENSE else arr
        else:
            arr = None  # a format turbospec has no kernel for: the caller dequantizes it with gguf
        tensors[name] = GGUFTensor(name, t, dims, arr)
    return meta, tensors
