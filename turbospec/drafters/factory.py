"""Builds a drafter from the options users pass to ``Engine`` (``drafter=``, ``draft_model=``,
``head=``, ``tree=``, ...), and chooses one for ``drafter="auto"``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..heads.formats import load_head
from ..heads.shipped import best_shipped_head, shipped_heads
from ..model.loader import load_model, load_tokenizer
from ..model.prefix_cache import PrefixCache
from ..model.quant import WEIGHT_MODES
from ..model.transformer import Transformer
from .base import Drafter
from .draft_model import DraftModelDrafter, DraftPool, check_compatible
from .eagle import EagleDrafter
from .hybrid import Calibration, HeadSuffixDrafter, HybridDrafter
from .lookahead import LookaheadDrafter
from .medusa import MedusaDrafter
from .ngram import NgramDrafter
from .suffix import SuffixCache, SuffixDrafter

DRAFTERS = ("auto", "none", "ngram", "suffix", "lookahead", "draft_model", "eagle", "medusa", "hybrid")
SUFFIX_CACHE_OPTIONS = {"cache_tokens": "max_tokens", "max_ngram": "max_ngram", "min_ngram": "min_ngram"}
SUFFIX_OPTIONS = ("depth", "max_occurrences", "min_prob", "nodes_per_match")
LOOKAHEAD_OPTIONS = ("window", "ngram", "guesses", "pool_from_context")


@dataclass
class DraftSettings:
    """What a drafter is built against: the target and the engine's settings."""
    target: Transformer
    tokenizer: object
    max_seq_len: int
    dtype: torch.dtype              # a draft model's dtype
    draft_dtype: torch.dtype        # a head's dtype
    weights: str = "auto"           # how a draft model stores its weights (see ``load_model``)
    activations: str = "exact"
    adaptive: bool = True           # EAGLE trees: choose the depth from measured acceptance
    static: bool = False            # a draft model's fixed-shape path (CUDA graphs)
    graphs: bool | None = False
    default_target: bool = False    # the target is the default model (its shipped heads apply)
    slots: int = 1                  # drafters built to run at once (a draft model's pool rows)
    draft_activations: str | None = None  # a draft model's (None: int8 on CPU unless it shares weights)
    prefix_cache_bytes: int = 0     # a draft model's prefix cache (0: none; ``model.prefix_cache``)
    # how a head's linears are stored for drafting (None: ``tree.head_weights``' default) and a draft
    # model's weights (None: ``weights``)
    draft_weights: str | None = None

    def __post_init__(self):
        if self.draft_activations not in (None, "exact", "int8"):
            raise ValueError(f"draft_activations must be 'exact', 'int8' or None (int8 on CPU), got "
                             f"{self.draft_activations!r}")
        if self.draft_weights is not None and self.draft_weights not in WEIGHT_MODES:
            raise ValueError(f"draft_weights must be one of {', '.join(WEIGHT_MODES)} or None (heads: q4_0 on "
                             f"CPU; a draft model: the target's weights=), got {self.draft_weights!r}")


@dataclass(frozen=True)
class AutoChoice:
    """What ``drafter="auto"`` resolved to: the drafter's name and the options it drafts with (the
    caller's explicit arguments, else those the shipped head was tuned for; None: the default)."""
    drafter: str
    head: object = None
    tree: dict | None = None
    num_draft: int | None = None
    draft_dtype: object = None


def auto_drafter(default_target: bool, head=None, tree=None, num_draft=None, draft_dtype=None) -> AutoChoice:
    """drafter="auto": the default model gets its best shipped head with the options it was tuned
    for (explicit arguments win); anything else gets n-gram lookup."""
    best = best_shipped_head(default_only=True) if default_target else None
    if best is None:
        return AutoChoice("ngram", head, tree, num_draft, draft_dtype)
    method, path = best
    loaded = load_head(path)
    opts = dict(getattr(loaded, "extra", {}).get("engine", {}))
    return AutoChoice("medusa" if method == "medusa" else "eagle", head or loaded,
                      tree if tree is not None else opts.get("tree"),
                      num_draft if num_draft is not None else opts.get("num_draft"),
                      draft_dtype if draft_dtype is not None else opts.get("draft_dtype"))


def drafter_builder(drafter, s: DraftSettings, *, draft_model=None, draft_tokenizer=None, head=None,
                    tree: dict | None = None) -> Callable[[], Drafter | None]:
    """Checks the options and loads what they name (a draft model, a head) once; returns a function
    that builds a fresh drafter over those (one per concurrent request: a drafter holds one
    request's state). A ``Drafter`` instance cannot be copied: its builder returns it each time."""
    if isinstance(drafter, Drafter):
        return lambda: drafter
    if callable(drafter) and not isinstance(drafter, str):  # a factory: a fresh drafter per request
        def build() -> Drafter:
            d = drafter()
            if not isinstance(d, Drafter):
                raise TypeError(f"drafter: the callable {drafter!r} returned {type(d).__name__}, expected a "
                                f"turbospec Drafter")
            return d
        return build
    if s.draft_weights is not None and drafter in (None, "none", "ngram", "suffix", "lookahead"):
        raise ValueError(f"draft_weights={s.draft_weights!r}: drafter={drafter!r} has no weights (draft_weights "
                         f"applies to the head drafters and draft_model)")
    if drafter is None or drafter == "none":
        return lambda: None
    if drafter in ("eagle", "medusa"):
        return head_drafter_builder(drafter, s, head, tree or {})
    if drafter == "ngram":
        return NgramDrafter
    if drafter == "suffix":
        return suffix_drafter_builder(tree or {})
    if drafter == "lookahead":
        return lookahead_drafter_builder(tree or {})
    if drafter == "hybrid":
        return hybrid_drafter_builder(s, head, tree or {})
    if drafter == "draft_model":
        if draft_model is None:
            raise ValueError("drafter='draft_model' needs draft_model= (a path, transformers model or "
                             "turbospec Transformer)")
        if isinstance(draft_model, Transformer) and s.draft_weights is not None:
            raise ValueError(f"draft_weights={s.draft_weights!r}: the draft model was passed loaded (a Transformer "
                             f"keeps its weights); pass its path to have it loaded with these weights")
        dm = draft_model if isinstance(draft_model, Transformer) else \
            load_model(draft_model, s.dtype, device=s.target.device, weights=s.draft_weights or s.weights)
        dm.set_activations(draft_activations(s, dm))
        if draft_tokenizer is None and not isinstance(draft_model, (Transformer, torch.nn.Module)):
            draft_tokenizer = load_tokenizer(draft_model)
        check_compatible(s.target, dm, s.tokenizer, draft_tokenizer)
        # the drafters built share one pool of up to s.slots cache rows, so that a batch's proposals
        # run one draft forward per round; past s.slots each gets its own (static ones draft alone)
        pool = None if s.static else DraftPool(dm, s.max_seq_len, s.slots)
        # and one prefix cache of the draft's prompt K/V (a chat's next turn reads only what is new)
        pc = PrefixCache(s.prefix_cache_bytes) if s.prefix_cache_bytes else None
        return lambda: DraftModelDrafter(dm, s.max_seq_len, static=s.static, graphs=s.graphs, pool=pool,
                                         prefix_cache=pc)
    raise ValueError(f"drafter {drafter!r} is not supported; choose one of {DRAFTERS} or pass a "
                     f"turbospec.Drafter")


def suffix_drafter_builder(tree: dict) -> Callable[[], Drafter]:
    """Suffix drafters sharing one ``SuffixCache``: each request drafts from its own context and
    from the earlier requests the cache still holds. ``tree``: cache_tokens, max_ngram, min_ngram
    (the cache's) and depth, max_occurrences, min_prob, nodes_per_match (the drafter's)."""
    bad = set(tree) - set(SUFFIX_CACHE_OPTIONS) - set(SUFFIX_OPTIONS)
    if bad:
        raise ValueError(f"tree options {sorted(bad)} are not suffix options "
                         f"({', '.join(list(SUFFIX_CACHE_OPTIONS) + list(SUFFIX_OPTIONS))})")
    cache = SuffixCache(**{SUFFIX_CACHE_OPTIONS[k]: v for k, v in tree.items() if k in SUFFIX_CACHE_OPTIONS})
    opts = {k: v for k, v in tree.items() if k in SUFFIX_OPTIONS}
    SuffixDrafter(cache, **opts)  # bad drafter options fail here, when the engine is built
    return lambda: SuffixDrafter(cache, **opts)


HYBRID_HEAD_OPTIONS = ("depth", "top_k", "draft_vocab")


def hybrid_drafter_builder(s: DraftSettings, head, tree: dict) -> Callable[[], Drafter]:
    """drafter="hybrid": an EAGLE / EAGLE-3 head (``head``; the default model: its shipped one) and
    suffix decoding in one tree (``HeadSuffixDrafter``). ``tree``: the head's depth, top_k,
    draft_vocab, "suffix": a dict of suffix options (as for drafter="suffix"), and "skip_head_at"
    (``HeadSuffixDrafter``; None, the default: the head always drafts). The drafters built share the head's
    prepared copy, one ``SuffixCache`` and one ``Calibration``."""
    bad = set(tree) - set(HYBRID_HEAD_OPTIONS) - {"suffix", "skip_head_at"}
    if bad:
        raise ValueError(f"tree options {sorted(bad)} are not hybrid options ({', '.join(HYBRID_HEAD_OPTIONS)}, "
                         f"suffix, skip_head_at)")
    skip = tree.get("skip_head_at", HeadSuffixDrafter.SKIP_HEAD_AT)
    suffix_opts = tree.get("suffix", {})
    if not isinstance(suffix_opts, dict):
        raise ValueError(f"tree['suffix'] must be a dict of suffix options, got {suffix_opts!r}")
    head_tree = {k: v for k, v in tree.items() if k not in ("suffix", "skip_head_at")}
    if head is None and s.default_target:
        heads = shipped_heads()
        path = next((heads[m] for m in ("eagle3", "eagle") if m in heads), None)
        if path is not None:
            head = load_head(path, target_cfg=s.target.cfg)
            shipped = dict(head.extra.get("engine", {}).get("tree", {}))
            head_tree = {**{k: v for k, v in shipped.items() if k in HYBRID_HEAD_OPTIONS}, **head_tree}
    if head is None:
        raise ValueError("drafter='hybrid' needs head= (an EAGLE or EAGLE-3 head checkpoint directory or a loaded "
                         "head)")
    if isinstance(head, (str, bytes)) or hasattr(head, "__fspath__"):
        head = load_head(head, target_cfg=s.target.cfg)
    method = getattr(getattr(head, "cfg", None), "method", None)
    if method not in ("eagle", "eagle3"):
        raise ValueError(f"drafter='hybrid' needs an eagle or eagle3 head, got a {method!r} head")
    new_head = head_drafter_builder("eagle", s, head, head_tree)
    new_suffix = suffix_drafter_builder(suffix_opts)
    calibration = Calibration(HeadSuffixDrafter.PRIOR)
    HeadSuffixDrafter.check_skip_head_at(skip)  # a bad value fails when the engine is built
    return lambda: HeadSuffixDrafter(new_head(), new_suffix(), calibration, skip_head_at=skip)


def lookahead_drafter_builder(tree: dict) -> Callable[[], Drafter]:
    """Lookahead drafters (one per request: each holds its own Jacobi window and n-gram pool).
    ``tree``: window, ngram, guesses, pool_from_context (see ``LookaheadDrafter``)."""
    bad = set(tree) - set(LOOKAHEAD_OPTIONS)
    if bad:
        raise ValueError(f"tree options {sorted(bad)} are not lookahead options ({', '.join(LOOKAHEAD_OPTIONS)})")
    opts = dict(tree)
    LookaheadDrafter(**opts)  # bad options fail here, when the engine is built
    return lambda: LookaheadDrafter(**opts)


def draft_activations(s: DraftSettings, dm: Transformer) -> str:
    """The activations a draft model computes with: ``s.draft_activations``, by default int8 on CPU
    (only speed and acceptance depend on the draft's arithmetic), the target's for a draft that
    shares the target's weights (a layer-skip draft: its linears are the target's)."""
    mode = s.draft_activations
    shares = dm is s.target or dm.lm_head is s.target.lm_head
    if shares:
        if mode is not None and mode != s.activations:
            raise ValueError(f"draft_activations={mode!r}: this draft shares the target's weights (a layer-skip "
                             f"draft) and computes with the target's activations ({s.activations!r})")
        return s.activations
    if mode is None:
        return "int8" if dm.device.type == "cpu" else s.activations
    return mode


def head_drafter_builder(kind: str, s: DraftSettings, head, tree: dict) -> Callable[[], Drafter]:
    """EAGLE or Medusa drafters from ``head`` (a checkpoint directory or a loaded head; for the
    default target, None picks its shipped head) and the tree options. The drafters built share one
    prepared copy of the head (``share=``), so a batch drafts with one weight read per round."""
    if head is None and s.default_target:
        heads = shipped_heads()
        head = next((heads[m] for m in (("medusa",) if kind == "medusa" else ("eagle3", "eagle")) if m in heads),
                    None)
        if head is not None:
            head = load_head(head, target_cfg=s.target.cfg)
            tree = tree or dict(head.extra.get("engine", {}).get("tree", {}))
    if head is None:
        raise ValueError(f"drafter={kind!r} needs head= (a head checkpoint directory or a loaded head)")
    if isinstance(head, (str, bytes)) or hasattr(head, "__fspath__"):
        head = load_head(head, target_cfg=s.target.cfg)
    method = getattr(getattr(head, "cfg", None), "method", None)
    want = ("medusa",) if kind == "medusa" else ("eagle", "eagle3")
    if method not in want:
        raise ValueError(f"drafter={kind!r} needs a {' or '.join(want)} head, got a {method!r} head")
    opts = dict(tree)
    vocab = opts.pop("draft_vocab", None)
    ngram = opts.pop("ngram", 0)
    if vocab is None and getattr(head, "extra", {}).get("draft_vocab") is not None:
        vocab = head.extra["draft_vocab"]
    vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.int64)
    if kind == "medusa":
        bad = set(opts) - {"choices", "num_nodes"}
        if bad:
            raise ValueError(f"tree options {sorted(bad)} are not medusa options (choices, num_nodes, "
                             f"draft_vocab, ngram)")

        def build():
            return MedusaDrafter(s.target, head, draft_vocab=vocab, draft_dtype=s.draft_dtype,
                                 draft_weights=s.draft_weights, draft_activations=s.draft_activations,
                                 share=first[0] if first else None, **opts)
    else:
        bad = set(opts) - {"depth", "top_k"}
        if bad:
            raise ValueError(f"tree options {sorted(bad)} are not eagle options (depth, top_k, draft_vocab, "
                             f"ngram)")

        def build():
            return EagleDrafter(s.target, head, s.max_seq_len, draft_vocab=vocab, draft_dtype=s.draft_dtype,
                                draft_weights=s.draft_weights, draft_activations=s.draft_activations,
                                adaptive_depth=s.adaptive, share=first[0] if first else None, **opts)

    # The drafters this builder makes (one per batch slot) share the first one's prepared head.
    first: list[Drafter] = []

    def build_shared():
        d = build()
        first[:] = first or [d]
        return HybridDrafter(d, ngram_tokens=ngram) if ngram else d
    return build_shared
