"""Drafting for many requests at once: one weight read per batch instead of one per request.

A tree drafter's costly part is a few row-wise matrix products per expansion round (EAGLE: the
head's projections before and after its attention, and the LM head, over the round's nodes; Medusa:
the heads and their LM head) whose weights are shared by every request. Written as a generator (``Drafter.propose_steps``), a proposal yields each such product as
a ``Rows`` request and receives its result; ``drive`` runs the proposals of a whole batch in
lockstep, concatenating the requests that name the same ``op`` into one call per round. turbospec's
kernels are batch-invariant (a row's result does not depend on the other rows), so every request
gets exactly the drafts it would get alone (tests/drafters/test_lockstep.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rows:
    """``op(x)`` wanted: ``x`` [n, ...]; ``op`` maps rows to rows (row i of the result depends on
    row i of the input only). Requests whose ``op`` compare equal (the same object, or bound methods
    of the same object) are computed together."""
    op: Callable[[Tensor], Tensor]
    x: Tensor


def compute(gen: Generator):
    """Runs one generator of ``Rows`` requests alone (autograd as the caller has it); returns its
    return value."""
    try:
        req = next(gen)
        while True:
            req = gen.send(req.op(req.x))
    except StopIteration as stop:
        return stop.value


# The drafting drivers run the generators under inference mode: a generator must not enter it
# itself (a ``with`` block held open across a yield would be exited in another generator's order).

@torch.inference_mode()
def run_one(gen: Generator):
    """Runs one proposal generator alone, under inference mode; returns its return value."""
    return compute(gen)


@torch.inference_mode()
def drive(gens: list[Generator]) -> list:
    """Runs proposal generators in lockstep: each round every pending ``Rows`` request is answered,
    requests with the same op by one call over their rows concatenated. Returns, per generator, its
    return value or the exception it raised (the caller decides whose failure it is); an exception
    raised by a shared op call propagates."""
    results: list = [None] * len(gens)
    pending: dict[int, Rows] = {}

    def advance(i: int, value) -> None:
        try:
            pending[i] = gens[i].send(value)
        except StopIteration as stop:
            results[i] = stop.value
        except Exception as e:  # noqa: BLE001 - handed back to the caller with its request
            results[i] = e

    for i in range(len(gens)):
        advance(i, None)
    while pending:
        groups: dict[Callable, list[int]] = {}
        for i, req in pending.items():
            groups.setdefault(req.op, []).append(i)
        answers = {}
        for op, members in groups.items():
            xs = [pending[i].x for i in members]
            out = op(xs[0] if len(xs) == 1 else torch.cat(xs))
            for i, part in zip(members, out.split([x.shape[0] for x in xs])):
                answers[i] = part
        pending = {}
        for i, value in answers.items():
            advance(i, value)
    return results
