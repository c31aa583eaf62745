"""Argument checks shared by the package (every layer may import this module)."""
from __future__ import annotations


def is_int(v) -> bool:
    """``v`` is an integer and not a bool (Python's True / False are ints, and never a valid count)."""
    return isinstance(v, int) and not isinstance(v, bool)
