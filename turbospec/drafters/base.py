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

from ..ops.lockstep import run_one
from ..ops.sampling import SamplingParams


@dataclass
class Draft:
    token_ids: list[int]              # [k] draft tokens for nodes 1..k
    parents: list[int] | None = None  # [k] parent node of nodes 1..k (None: a chain, node i's parent is i-1)
    draft_probs: Tensor | None = None  # [k + 1, V] q at each node (node i's children were drawn from
    #                                    draft_probs[i]); None: point-mass drafts
    scores: list[float] | None = None  # [k] optional: the drafter's estimate of the chance that the
    #                                    target accepts the path to node i + 1, in [0, 1] (never above
    #                                    the parent's); hybrids allocate a shared node budget by it

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
    #: whether ``observe`` reads the target's greedy token (the argmax of its logits) at every node of
    #: the step's verify pass, accepted or not (``node_argmax=``: [k + 1] ints for the root, node 0,
    #: and the k nodes of the step's draft; k = 0 after a step without a draft). Lookahead decoding's Jacobi iteration reads the
    #: target's predictions at its lookahead nodes this way. The verify step then computes every
    #: node's logits (no lazy LM head) and reads the argmax back in its one host read.
    wants_node_argmax = False

    def __init_subclass__(cls, **kw):
        # A drafter that reads no features (or no node argmax) may override begin / observe without
        # the ``features`` (``node_argmax``) parameter; the engine passes them by keyword, so such an
        # override gets them dropped here.
        super().__init_subclass__(**kw)
        for name, keywords in (("begin", ("features",)), ("observe", ("features", "node_argmax"))):
            fn = cls.__dict__.get(name)
            if fn is None:
                continue
            params = inspect.signature(fn).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            drop = tuple(k for k in keywords if k not in params)
            if drop:
                setattr(cls, name, _drop_keywords(fn, drop))

    def begin(self, prompt_ids: list[int], features: Tensor | None = None) -> None:
        """Called once per generation before the first proposal."""

    def prepare(self, tokens: list[int]) -> None:
        """Optional: do now, in the prefill, what the first proposal after ``tokens`` would
        otherwise do first (a draft model reads the prompt). The engine calls it after ``begin``
        when its draft budget expects that to pay; a drafter must work without it."""

    def finish(self, tokens: list[int]) -> None:
        """Optional: the generation ended with ``tokens`` (prompt and answer); a drafter may keep
        what it computed of them for later prompts (a draft model's prefix cache)."""

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

    def observe(self, tokens: list[int], num_accepted: int, features: Tensor | None = None,
                node_argmax: list[int] | None = None) -> None:
        """After verification: ``tokens`` is the new committed sequence (its last element is the
        next root), ``num_accepted`` how many of the last proposal's tokens were kept;
        ``node_argmax``: see ``wants_node_argmax``."""


def _drop_keywords(fn, names: tuple[str, ...]):
    """``fn`` (a begin / observe override) called with the keywords in ``names`` dropped: an error
    when the drafter asks for what it drops (its ``features`` / ``wants_node_argmax``)."""
    @functools.wraps(fn)
    def call(self, *args, **kw):
        for name in names:
            value = kw.pop(name, None)
            if value is None:
                continue
            if name == "features" and self.features is not None:
                raise TypeError(f"{type(self).__name__}.{fn.__name__} reads target features "
                                f"(features={self.features!r}) but takes no features= argument")
            if name == "node_argmax" and self.wants_node_argmax:
                raise TypeError(f"{type(self).__name__}.{fn.__name__}: the drafter sets wants_node_argmax "
                                f"but takes no node_argmax= argument")
        return fn(self, *args, **kw)
    return call
