"""A minimal GGUF reader: the architecture name and every tensor as a view of the memory-mapped file.

``gguf.GGUFReader`` parses every metadata field into Python objects (a tokenizer's vocabulary and
merges: ~100k strings, seconds per load); this reader walks past the metadata and maps the tensors,
so that loading a quantized model costs about as much as reading its bytes. Arrays are read only when
asked for by key (``arrays``: the tokenizer's vocabulary, merges and token types). Format: GGUF v2/v3
(little endian), as written by llama.cpp and the ``gguf`` package.
"""
from __future__ import annotations

import mmap
import os
import struct
import weakref
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from ..ops.reference import WEIGHT_FORMATS

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9
_DENSE = {0: np.float32, 1: np.float16, 30: np.uint16}  # F32, F16, BF16 (raw words)
_ARRAY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # array item type -> numpy (little endian)


# (start address, end address, the mmap) of each GGUF mapped by read_gguf while it is alive
_MAPPINGS: list[tuple[int, int, weakref.ref]] = []


def is_mapped(t) -> bool:
    """Is tensor ``t`` a view of a GGUF mapped by ``read_gguf`` (still alive)?"""
    if not _MAPPINGS or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    return any(ref() is not None and lo <= start < hi for lo, hi, ref in _MAPPINGS)


def release_pages(t) -> None:
    """Unmap the file pages under tensor ``t`` from this process (madvise DONTNEED) when ``t`` is a view
    of a GGUF mapped by ``read_gguf``, else nothing: for a tensor just copied into another layout, so
    that a load holds the copy, not the copy and the pages it was read from (they stay in the page
    cache; reading ``t`` again maps them again, with the file's bytes: a value this process wrote
    into the copy-on-write mapping would be lost, and nothing writes a GGUF's weights). Only the pages
    wholly inside ``t`` (a neighbour's bytes may share its first and last page)."""
    if not _MAPPINGS or not hasattr(mmap, "MADV_DONTNEED") or not t.is_contiguous() or t.device.type != "cpu":
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    for lo, hi, ref in _MAPPINGS:
        mapping = ref()
        if mapping is not None and lo <= start and end <= hi:
            a = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
            b = end // mmap.PAGESIZE * mmap.PAGESIZE
            if b > a:
                mapping.madvise(mmap.MADV_DONTNEED, a - lo, b - a)
            return


@dataclass
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length (K)
    data: np.ndarray        # dense: [rows, K] (or [K]) of the stored dtype; blocks: uint8 [rows, row bytes]


def read_gguf(path: str, arrays: Collection[str] = ()) -> tuple[dict, dict[str, GGUFTensor]]:
    """(scalar metadata {key: value} (strings and numbers; an array only as its length, under
    ``key + "#count"``, unless its key is in ``arrays``: then also in full under its key, a list of
    str for strings, a numpy array for numbers), {name: GGUFTensor})."""
    if os.path.getsize(path) < 24:
        raise ValueError(f"{path}: not a GGUF file ({os.path.getsize(path)} bytes: shorter than a GGUF header)")
    with open(path, "rb") as f:
        # copy-on-write: the tensors are writable views of the file's pages (torch wants writable
        # arrays); a write would change this process's copy only, never the file
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mm = np.frombuffer(mapping, dtype=np.uint8)
    _MAPPINGS[:] = [m for m in _MAPPINGS if m[2]() is not None]
    _MAPPINGS.append((mm.ctypes.data, mm.ctypes.data + len(mm), weakref.ref(mapping)))
    try:
        return _parse(path, mm, frozenset(arrays))
    except (struct.error, IndexError, OverflowError, MemoryError) as e:  # the header runs past the file
        raise ValueError(f"{path}: corrupt or truncated GGUF header ({len(mm)} bytes; {e})") from None


def _parse(path: str, mm, arrays: frozenset) -> tuple[dict, dict[str, GGUFTensor]]:
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

    u64 = struct.Struct("<Q").unpack_from

    def read_array(key: str, p: int):
        """The array at ``p`` (after its value type) in full: strings (UTF-8, strict: a token's text)
        as a list of str, numbers as a numpy array."""
        it, count = struct.unpack_from("<IQ", buf, p)
        p += 12
        if it in _ARRAY_DTYPES:
            return np.frombuffer(mm, dtype=_ARRAY_DTYPES[it], count=count, offset=p).copy()
        if it != _STRING:
            raise ValueError(f"{path}: metadata {key!r} is an array of GGUF type {it}; only strings and numbers "
                             f"are read")
        out = []
        for _ in range(count):
            (n,) = u64(buf, p)
            out.append(str(buf[p + 8:p + 8 + n], "utf-8"))
            p += 8 + n
        return out

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
            if t == _ARRAY:  # kept as its length only (a vocabulary's token count), unless asked for
                meta[key + "#count"] = struct.unpack_from("<IQ", buf, pos)[1]
                if key in arrays:
                    meta[key] = read_array(key, pos)
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
