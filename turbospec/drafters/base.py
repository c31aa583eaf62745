"""The drafter interface. A drafter proposes a chain or tree of tokens after the root; the engine
verifies them in one target pass and tells the drafter what was kept.

Node numbering inside a step: node 0 is the root (the last committed token, not yet in the target's
cache); draft nodes are 1..k in topological order.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from ..heads.lockstep import run_one
from ..ops.sampling import SamplingParams


@dataclass
class Draft:
    token_ids: list[int]              # [k] draft tokens for nodes 1..k
    parents: list[int] | None = None  # [k] parent node of nodes 1..k (None: a chain, node i's parent is i-1)
    draft_probs: Tensor | None = None  # [k + 1, V] q at each node (node i's children were drawn from
    #                                    draft_probs[i]); None: point-mass drafts

    def __len__(self) -> int:
        return len(self.token_ids)


class Drafter:
    """Base class. ``tokens`` is always the whole committed sequence (prompt + generated), whose
    last element is the root."""

    name = "drafter"
    #: target features the drafter reads (``Transformer.forward(features=...)``): None (none),
    #: "final" (the final-normed hidden state: Medusa, EAGLE-1/2) or a tuple of layer indices
    #: (EAGLE-3). ``begin`` and ``observe`` receive them as ``features=`` (None when not set): in
    #: ``begin`` the features of the prefilled prompt positions [len(prompt) - 1, F]; in ``observe``
    #: those of the root and the accepted nodes of the step, in path order [num_accepted + 1, F].
    features = None

    def __init_subclass__(cls, **kw):
        # A drafter that reads no features may override begin / observe without the ``features``
        # parameter; the engine always passes it, so such an override gets it dropped here.
        super().__init_subclass__(**kw)
        for name in ("begin", "observe"):
            fn = cls.__dict__.get(name)
            if fn is not None and "features" not in inspect.signature(fn).parameters and not any(
                    p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
                setattr(cls, name, _drop_features(fn))

    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        """Called once per generation before the first proposal."""

    def prepare(self, tokens: list[int]) -> None:
        """Optional: do now, in the prefill, what the first proposal after ``tokens`` would
        otherwise do first (a draft model reads the prompt). The engine calls it after ``begin``
        when its draft budget expects that to pay; a drafter must work without it."""

    @property
    def windowed(self) -> bool:
        """Whether this generation's proposals see only a recent window of the context (a draft
        model that restarted from the last tokens instead of reading all): its acceptance then says
        little about the drafter's, and the draft budget does not pass it on to the next generation."""
        return False

    def propose(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        """At most ``max_tokens`` draft tokens after ``tokens[-1]``, or None for none. A drafter
        that writes ``propose_steps`` instead gets this from it (run alone)."""
        if type(self).propose_steps is Drafter.propose_steps:
            raise NotImplementedError(f"{type(self).__name__} implements neither propose nor propose_steps")
        return run_one(self.propose_steps(tokens, max_tokens, params, generator))

    def propose_steps(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None):
        """``propose`` as a generator that yields its shared-weight products as ``lockstep.Rows``
        requests, so that a batch's proposals share each weight read (``lockstep.drive``); returns
        the draft. This default computes everything itself (nothing to share)."""
        return self.propose(tokens, max_tokens, params, generator)
        yield  # noqa: unreachable - makes this a generator

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None) -> None:
        """After verification: ``tokens`` is the new committed sequence (its last element is the
        next root), ``num_accepted`` how many of the last proposal's tokens were kept."""


def _drop_features(fn):
    @functools.wraps(fn)
    def call(self, *args, features=None, **kw):
        if features is not None and self.features is not None:
            raise TypeError(f"{type(self).__name__}.{fn.__name__} reads target features "
                            f"(features={self.features!r}) but takes no features= argument")
        return fn(self, *args, **kw)
    return call
