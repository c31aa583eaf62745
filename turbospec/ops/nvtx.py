"""NVTX ranges around the phases of a speculative step (draft / verify / accept / compact), so that
``nsys`` timelines (bench/profile_nsys.sh) show where a step's time goes. Without CUDA they cost one
attribute read and do nothing."""
from __future__ import annotations

import contextlib

import torch

_ENABLED = torch.cuda.is_available()


@contextlib.contextmanager
def range(name: str):  # noqa: A001 - mirrors torch.cuda.nvtx.range
    if not _ENABLED:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
