"""``turbospec train``: self-distillation training of draft heads (Medusa, EAGLE-1/2, EAGLE-3).

Stages (each re-uses or resumes what an earlier run stored under --work-dir):
1. generate  (``data.generate``): the target answers training prompts greedily.
2. features  (``data.collect_features``): one target pass per sample stores the features heads
   read and the target's greedy next token at every position.
3. train     (here, ``Trainer``): AdamW, warmup + cosine/linear schedule, gradient clipping, a held-out
   eval every --eval-every steps, periodic checkpoints; the final head goes to --out
   (``checkpoints.save_head``) with provenance and eval results in its ``turbospec_extra``.

The losses, the unrolled (training-time test) forward and the eval are in ``objectives``; the
settings and their command-line options in ``config``.

Initialisation: Medusa ``init_identity`` (every head starts as the target's own next-token
prediction); EAGLE-1/2 ``init_weights`` with fc's feature half set to the identity (the head starts
as "the next feature is this one"); EAGLE-3 ``init_weights``. The head's math runs under bfloat16
autocast where bfloat16 matmuls are fast (--amp auto: CUDA, CPUs with AVX512-BF16 / AMX; the LM-head
products, which dominate, run about 4x faster there), with float32 master weights, losses and
optimizer state.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import sys
import time

import torch
from torch import Tensor, nn

from . import data as distill
from .config import DEFAULT_DATA, DEFAULT_DRAFT_VOCAB, DEFAULT_LR, TrainConfig, WSD_DECAY, amp_dtype, answers_by_copy
from .config import check_config, gen_answerer
from .config import add_args, config_from_args  # add_args: re-exported, turbospec.cli imports it from here
from .data import FeatureStore, collate, log
from .objectives import Method, format_eval, frozen_parts
from ..heads.config import HeadConfig
from ..heads.layers import draft_vocab_from_counts, init_weights

# With --time-budget, generation stops by this share of the budget and features by the next
# (a later --resume run continues both); training has the rest, at least 30%.
GEN_SHARE, FEATURES_SHARE = 0.45, 0.70

__all__ = ["Trainer", "add_args", "build_head", "config_from_args", "run", "run_cli"]


# ---------------------------------------------------------------------------------------------
def build_head(cfg: TrainConfig, target, counts: Tensor | None, source: str = "") -> nn.Module:
    """A freshly initialised head for ``target`` (``source``: its path, recorded in the config)."""
    from ..heads.formats import build_head as _build
    kw = {"target": str(source or cfg.target)}
    if cfg.method == "medusa":
        kw.update(medusa_num_heads=cfg.medusa_heads, medusa_num_layers=cfg.medusa_layers)
    if cfg.method != "medusa" and cfg.head_intermediate_size:
        kw["intermediate_size"] = cfg.head_intermediate_size
    draft_vocab = cfg.draft_vocab or DEFAULT_DRAFT_VOCAB
    if cfg.method == "eagle3":
        kw["draft_vocab_size"] = draft_vocab
        if cfg.feature_layers:
            kw["feature_layers"] = list(cfg.feature_layers)
    hcfg = HeadConfig.for_target(cfg.method, target.cfg, **kw)
    head = _build(hcfg)
    if cfg.method == "medusa":
        head.init_identity()
        return head
    init_weights(head)
    h = hcfg.hidden_size
    with torch.no_grad():
        if cfg.method == "eagle":
            # fc starts by passing the feature through (its embedding half stays small): the head
            # starts by predicting "the next feature is this one", the prior Medusa's init uses too.
            head.fc.weight[:, h:] = torch.eye(h)
        else:
            # the draft LM head learns from scratch (initialising it from the target's rows gave
            # confident wrong logits at first and no better head after training, in a short test)
            head.set_draft_vocab(draft_vocab_from_counts(counts, draft_vocab))
    return head


def _schedule(cfg: TrainConfig, total: int, time_progress=lambda: 0.0):
    """The learning-rate factor of a step: a linear warmup over the first steps, then the decay
    (cosine, linear, wsd or none) over the progress made, which is the steps' share of ``total`` or,
    with a time budget, ``time_progress()`` (the share of the training time used) where that is
    further along: a run given a deadline anneals fully by it. The default warmup (3% of the
    schedule) ends after 3% of the steps or of the time, whichever comes first."""
    warm = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * total))

    def f(step: int) -> float:
        ramp = (step + 1) / warm if step < warm else 1.0
        if cfg.warmup_steps is None:  # the default warmup is 3% of the schedule, in time too
            ramp = max(ramp, min(1.0, time_progress() / 0.03))
        if cfg.schedule == "constant":
            return ramp
        p = min(1.0, max(max(0, step - warm) / max(1, total - warm), time_progress()))
        if cfg.schedule == "cosine":
            return min(ramp, 0.5 * (1 + math.cos(math.pi * p)))
        if cfg.schedule == "wsd":  # warmup, stable, then a linear decay over the last WSD_DECAY
            return min(ramp, min(1.0, (1.0 - p) / WSD_DECAY))
        return min(ramp, 1.0 - p)
    return f


def _machine(device: str) -> dict:
    proc = platform.processor()
    if not proc and os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            proc = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    m = {"processor": proc, "machine": platform.machine(), "cpu_count": os.cpu_count(),
         "torch_threads": torch.get_num_threads(), "device": device, "torch": torch.__version__,
         "platform": platform.platform()}
    if device.startswith("cuda"):
        m["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return m


def checkout_commit() -> str | None:
    """The checkout's commit (with "+" when it has uncommitted changes), or None outside a git tree."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (head.stdout.strip() + ("+" if dirty.stdout.strip() else "")) if head.returncode == 0 else None


class Trainer:
    """One ``turbospec train`` run. ``run`` goes through the stages: ``load_target``, ``generate``,
    ``collect_features``, ``build`` (head and frozen target parts), ``setup_optimizer``, ``resume``
    and ``train`` (epochs of ``train_step``s, ``evaluate``, ``save``)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.data = cfg.data or DEFAULT_DATA
        self.work = cfg.work_dir or os.path.join(cfg.out, "work")
        self.summary: dict = {}
        self.step, self.history, self.t_train = 0, [], 0.0
        self.last_ev: dict | None = None
        # --time-budget: the deadline, and the share of the schedule's time-based progress already
        # made (by a resumed run) and what this run can spend training (set when training starts)
        self.deadline: float | None = None
        self.time_p0, self.train_avail = 0.0, None
        self.init = None  # --init-head: the head training starts from
        self.extra_features: list[tuple[str, dict]] = []  # --extra-features: [(folder, manifest)]

    def run(self) -> dict:
        """The whole pipeline; returns a summary (stage infos, final eval, checkpoint path)."""
        cfg = self.cfg
        check_config(cfg)
        self.prompts = distill.read_prompts(self.data)  # fails fast on a missing / empty / unusable file
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.t_start = time.perf_counter()
        if cfg.time_budget:
            self.deadline = self.t_start + cfg.time_budget
        os.makedirs(self.work, exist_ok=True)
        target, tok = self.load_target()
        self.init = self.load_init_head(target)
        self.generate(*self.generation_target(target), tok)
        if cfg.stop_after == "generate":
            return self.summary
        self.collect_features(target)
        if cfg.stop_after == "features":
            return self.summary
        self.build(target)
        del target, tok  # only the embedding and the LM head are needed from here on
        self.setup_optimizer()
        self.resume()
        self.train()
        return self.summary

    def load_init_head(self, target):
        """--init-head: the head training starts from (float32), checked against --method and the
        target; None without it."""
        cfg = self.cfg
        if not cfg.init_head:
            return None
        from ..heads.formats import load_head
        head = load_head(cfg.init_head, target_cfg=target.cfg)
        method = head.cfg.method
        if method != cfg.method:
            raise ValueError(f"--init-head {cfg.init_head!r} is a {method!r} head; --method is {cfg.method!r}")
        if cfg.feature_layers and list(cfg.feature_layers) != list(head.cfg.feature_layers or []):
            raise ValueError(f"--feature-layers {list(cfg.feature_layers)} differ from --init-head's "
                             f"{list(head.cfg.feature_layers or [])}: a head keeps its feature layers")
        log(f"train: starting from the head in {cfg.init_head}")
        return head.float()

    # -----------------------------------------------------------------------------------------
    # Stages 1 and 2: the target and its self-distillation data
    def load_target(self):
        """The target model and its tokenizer; checks the options that need the target's config."""
        from ..model.loader import default_model_path, load_model, load_tokenizer, parse_dtype
        cfg = self.cfg
        self.source = default_model_path() if cfg.target == "default" else cfg.target
        target = load_model(self.source, parse_dtype(cfg.dtype), device=cfg.device)
        tok = load_tokenizer(self.source)
        vocab = target.cfg.vocab_size
        if cfg.method == "eagle3" and (cfg.draft_vocab or 0) > vocab:
            raise ValueError(f"--draft-vocab {cfg.draft_vocab} is larger than the target's vocabulary ({vocab})")
        if cfg.distill_topk > vocab:
            raise ValueError(f"--distill-topk {cfg.distill_topk} is larger than the target's vocabulary ({vocab})")
        if cfg.feature_layers:
            bad = [i for i in cfg.feature_layers if not 0 <= i < target.cfg.num_layers]
            if bad:
                raise ValueError(f"--feature-layers {cfg.feature_layers}: layer {bad[0]} is outside "
                                 f"[0, {target.cfg.num_layers})")
        return target, tok

    def generation_target(self, target):
        """The model that answers the prompts: the target itself, or with --gen-dtype another than
        --dtype a dense copy in that dtype (bf16 here: 366 vs 249 sampled answer tokens/s of the Q4_1
        target in float32, 2 threads). The answers need not be the float32 target's bits: the
        features stage recomputes every label with the target of --dtype.
        Returns (that model, None), or with --gen-engine batched (its target, the ``Engine`` that
        answers: turbospec's scheduler, drafter and --gen-activations; int8 answers are not the float32
        target's bits either, and need not be)."""
        cfg = self.cfg
        if cfg.gen_engine == "batched":
            from ..decode.engine import Engine

            def engine():  # built only when something is left to answer (a stored generation may be complete)
                return Engine(self.source, drafter=cfg.gen_drafter, dtype=cfg.gen_dtype or cfg.dtype, device=cfg.device,
                              activations=cfg.gen_activations, max_batch=cfg.gen_batch_size,
                              max_seq_len=cfg.max_prompt_tokens + cfg.max_new_tokens + 1)
            if not answers_by_copy(cfg):
                return target, engine  # the same weights: the generation is keyed by the target's fingerprint
            e = engine()
            return e.target, e
        if not answers_by_copy(cfg):
            return target, None
        from ..model.loader import load_model, parse_dtype
        return load_model(self.source, parse_dtype(cfg.gen_dtype), device=cfg.device, weights="dense"), None

    def generate(self, target, engine, tok) -> None:
        """Stage 1: the target's answers to the training prompts (chat template applied), greedy or
        sampled at --gen-temperature."""
        from ..decode.text import encode, eos_token_ids
        cfg = self.cfg
        vocab = target.cfg.vocab_size
        self.data_sha1 = distill.file_sha1(self.data)
        self.gen_dir, self.samples, self.gen_info = distill.generate(
            target, lambda prompt: encode(tok, vocab, prompt), eos_token_ids(target.cfg.eos_token_ids, tok),
            self.prompts, self.work, data_sha1=self.data_sha1, num_prompts=cfg.num_prompts,
            max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed,
            truncate=cfg.truncate_long_prompts, batch_size=cfg.gen_batch_size,
            dtype=cfg.gen_dtype or cfg.dtype, temperature=cfg.gen_temperature,
            stop_at=float("-inf") if cfg.no_generate else self._stage_deadline(GEN_SHARE),
            distill_data=cfg.distill_data, engine=engine, answerer=gen_answerer(cfg), extend_data=cfg.extend_data,
            provenance={"prompts_file": os.path.basename(self.data), "model": os.path.basename(str(self.source)),
                        "command": cfg.command or None, "commit": checkout_commit(), "machine": _machine(cfg.device),
                        "date": datetime.datetime.now().astimezone().isoformat()})
        if cfg.no_generate and not self.samples:
            raise ValueError(f"--no-generate: no answers of these settings are stored (in --work-dir "
                             f"{self.work!r} or --distill-data {cfg.distill_data!r}); generate them first")
        self.summary = {"generation": self.gen_info, "generation_dir": self.gen_dir}

    def collect_features(self, target) -> None:
        """Stage 2: the features the head reads and the target's greedy tokens, train and held-out."""
        cfg = self.cfg
        n = len(self.samples)
        self.n_eval = cfg.eval_samples if cfg.eval_samples is not None else min(64, max(1, round(0.05 * n)))
        layers_kw = {"feature_layers": list(cfg.feature_layers)} if cfg.feature_layers else {}
        probe = HeadConfig.for_target(cfg.method, target.cfg, **layers_kw) if self.init is None else self.init.cfg
        spec = tuple(probe.feature_layers) if cfg.method == "eagle3" else "final"
        samples, complete = self.samples, self.gen_info.get("complete", True)
        train, held = distill.split(self.samples, self.n_eval)
        if cfg.train_samples is not None:  # a slice of the train split, the same held-out split
            a, b = cfg.train_samples
            if a > len(train) or (a == len(train) and not cfg.mix_data):
                raise ValueError(f"--train-samples {a}:{'' if b is None else b}: the train split has only "
                                 f"{len(train)} samples" + ("" if cfg.mix_data else
                                                            " (START = its size: only with --mix-data)"))
            n_train, train, complete = len(train), train[a:b], False  # keyed by the subset's indices
            log(f"features: train samples {a}..{a + len(train) - 1} of {n_train} (--train-samples)"
                if train else "features: none of the generation's train samples (--train-samples): "
                              "the --mix-data samples only")
        self.mix_records = None
        if cfg.mix_data:  # other stored generations join the train split; the held-out split stays
            mix, self.mix_records = distill.load_mix(cfg.mix_data, self.gen_dir, held)
            train, complete = train + mix, False
            self.summary["mix_data"] = self.mix_records
        samples = samples if complete else train + held
        self.feature_samples = samples
        feature_target = target
        if cfg.feature_matmuls == "torch-bf16":  # (the feature folder's key records it)
            from ..model.loader import load_model
            feature_target = load_model(self.source, torch.bfloat16, device=cfg.device).use_torch_matmuls()
            log("features: a bfloat16 copy of the target on torch matmuls (--feature-matmuls torch-bf16)")
        self.feat_dir, self.manifest = distill.collect_features(
            feature_target, self.gen_dir, samples, self.work, spec, eval_samples=self.n_eval,
            shard_tokens=cfg.shard_tokens, feature_dtype=cfg.feature_dtype,
            complete_gen=complete, stop_at=self._stage_deadline(FEATURES_SHARE),
            batch_size=cfg.feature_batch_size,
            other_answerer=answers_by_copy(cfg) or cfg.gen_engine == "batched" or bool(cfg.mix_data), mix=self.mix_records,
            topk=cfg.distill_topk)
        self.summary.update(features_dir=self.feat_dir, features_seconds=self.manifest.get("seconds"))
        self.extra_features = []
        for d in cfg.extra_features or []:
            m = distill.read_manifest(d)
            distill.check_extra_features(d, m, spec, cfg.feature_dtype, cfg.distill_topk, self.feat_dir)
            rel = distill.check_same_target(target, d, m, spec, distill.FEATURE_DTYPES[cfg.feature_dtype])
            n, tokens = sum(len(sh["lengths"]) for sh in m["shards"]), sum(sum(sh["lengths"]) for sh in m["shards"])
            log(f"features: --extra-features {d}: {n} train samples ({tokens} tokens) join; its first sample "
                f"recomputed by this target: {rel:.2e} relative RMS")
            self.extra_features.append((d, m))

    def _stage_deadline(self, share: float) -> float | None:
        """With --time-budget: when a data stage stops (the budget's first ``share``); else None."""
        return None if self.deadline is None else self.t_start + share * self.cfg.time_budget

    # -----------------------------------------------------------------------------------------
    # Stage 3: the head, its optimizer and the saved state
    def build(self, target) -> None:
        """The fresh head, the frozen target parts its losses use and the ``Method``, on --device."""
        cfg = self.cfg
        self.dev = dev = torch.device(cfg.device)
        vocab = target.cfg.vocab_size
        train_samples, _ = distill.split(self.feature_samples, self.n_eval)
        counts = torch.zeros(vocab, dtype=torch.int64)
        for s in train_samples:
            counts += torch.bincount(torch.tensor(s["response_ids"], dtype=torch.int64), minlength=vocab)
        for d, m in self.extra_features:
            counts += distill.response_counts(d, m, vocab)
        head = build_head(cfg, target, counts, self.source) if self.init is None else self.init
        coverage = lambda h: float(counts[h.draft_vocab_ids().cpu()].sum()) / max(int(counts.sum()), 1)  # noqa: E731
        if self.init is not None and cfg.method == "eagle3" and cfg.draft_vocab is not None \
                and cfg.draft_vocab != head.lm_head.out_features:
            # --init-head with another --draft-vocab: the head's tokens kept (growing; shrinking, the
            # most frequent of them), the most frequent other response tokens of these samples added
            old_n, old_cov = head.lm_head.out_features, coverage(head)
            head = head.with_draft_vocab(draft_vocab_from_counts(counts, cfg.draft_vocab, keep=head.draft_vocab_ids()))
            kept = int(torch.isin(head.draft_vocab_ids(), self.init.draft_vocab_ids()).sum())
            log(f"train: draft vocabulary {old_n} -> {cfg.draft_vocab} tokens ({kept} rows carried over); "
                f"coverage of the train responses {old_cov:.4f} -> {coverage(head):.4f}")
        frozen = frozen_parts(target, head, dev)
        if cfg.method == "eagle3":
            self.summary["draft_vocab_coverage"] = coverage(head)
        self.head = head.to(dev).train()
        self.method = Method(self.head, frozen, cfg, self.manifest.get("feature_rms", 1.0))
        self.amp = amp_dtype(cfg.amp, dev)

    def autocast(self):
        return torch.autocast(device_type=self.dev.type, dtype=self.amp or torch.bfloat16,
                              enabled=self.amp is not None)

    def setup_optimizer(self) -> None:
        """The feature store and batch plan, AdamW, the schedule, and where the training state is
        saved (keyed by every setting that changes the result)."""
        cfg = self.cfg
        self.store = FeatureStore(self.feat_dir, self.manifest, self.extra_features)
        self.eval_batches = self.store.eval_batches(cfg.batch_size)
        self.per_epoch = len(self.store.plan(cfg.batch_size, cfg.seed, 0))
        self.total = self.per_epoch * cfg.epochs
        self.lr = cfg.lr or DEFAULT_LR[cfg.method]
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=self.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule(cfg, self.total, self.time_progress))
        hyper = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("command", "extra")}
        hyper.update(lr=self.lr, ttt_steps=self.method.steps, feature_noise_abs=self.method.noise,
                     amp_dtype=str(self.amp), eval_samples=self.manifest["eval_samples"])
        self.hyper = hyper
        not_keyed = ("resume", "threads", "out", "work_dir", "eval_every", "save_every", "feature_batch_size",
                     "feature_matmuls", "distill_data", "mix_data", "extra_features")  # the feature folders' keys hold what the data files hold
        if not cfg.align_topk:  # off: the key of the runs from before the option existed (they resume)
            not_keyed += ("align_topk",)
        extra_key = {"extra_feat": [os.path.basename(os.path.normpath(d)) for d, _ in self.extra_features]} \
            if self.extra_features else {}  # absent without: earlier runs' keys stay valid
        train_key = distill.sha1({"feat": os.path.basename(self.feat_dir), **extra_key,
                                  **{k: v for k, v in hyper.items() if k not in not_keyed}})
        self.state_path = os.path.join(self.work, f"train-{cfg.method}-{train_key}.pt")
        self.tokens = sum(sum(s["lengths"]) for s in self.store.shards)

    def resume(self) -> None:
        """--resume: continue the saved state of the same settings (head, optimizer, schedule, step,
        eval history, RNG)."""
        if not self.cfg.resume:
            return
        if not os.path.isfile(self.state_path):
            log(f"train: --resume: no saved state for these settings ({self.state_path}); starting fresh")
            return
        # weights_only: tensors, numbers, strings and containers; a state file that holds anything
        # else (arbitrary pickled objects) is refused instead of executed
        st = torch.load(self.state_path, map_location=self.dev, weights_only=True)
        self.head.load_state_dict(st["head"])
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step, self.history, self.t_train = st["step"], st["history"], st["train_seconds"]
        self.time_p0 = st.get("time_progress", 0.0)
        torch.set_rng_state(st["rng"])
        log(f"train: resuming at step {self.step}/{self.total} from {self.state_path}")

    def provenance(self, ev: dict | None, partial: bool) -> dict:
        """The head's ``turbospec_extra``: data, settings, run times, machine and eval results."""
        cfg, manifest, gen_info = self.cfg, self.manifest, self.gen_info
        extra = {
            "command": cfg.command or None, "dataset": os.path.abspath(self.data), "dataset_sha1": self.data_sha1,
            "num_samples": self.store.num_train_samples(), "num_eval_samples": manifest["eval_samples"],
            "train_tokens": self.tokens, "generation": {k: gen_info.get(k) for k in
                                                        ("prompts", "prompt_tokens", "response_tokens",
                                                         "finished_by_eos", "seconds")},
            "generation_settings": {"max_new_tokens": cfg.max_new_tokens, "max_prompt_tokens":
                                    cfg.max_prompt_tokens, "num_prompts": cfg.num_prompts,
                                    "seed": cfg.seed, "target_dtype": cfg.dtype,
                                    "generation_dtype": cfg.gen_dtype or cfg.dtype,
                                    "greedy": not cfg.gen_temperature, "temperature": cfg.gen_temperature},
            "argmax_agreement": manifest.get("argmax_agreement"),
            "hyperparameters": self.hyper, "steps": self.step, "total_steps": self.total, "partial": partial,
            "stopped_by_time_budget": self.time_progress() >= 1.0,
            "run_time_s": {"generation": gen_info.get("seconds"),
                           "features": manifest.get("seconds"), "training": round(self.t_train, 1),
                           "total_this_run": round(time.perf_counter() - self.t_start, 1)},
            "machine": _machine(cfg.device), "date": datetime.datetime.now().astimezone().isoformat(),
            "eval": ev, "eval_history": self.history, **cfg.extra}
        if ev and cfg.method == "medusa":
            extra["head_accuracy"] = ev["rank_accuracy"]  # what medusa.default_choices takes
        if self.mix_records:
            extra["mix_data"] = self.mix_records
        if self.extra_features:
            extra["extra_features"] = [
                {"folder": os.path.basename(os.path.normpath(d)), "generation": m["settings"].get("gen"),
                 "mix": m["settings"].get("mix"), "train_samples": sum(len(sh["lengths"]) for sh in m["shards"]),
                 "tokens": sum(sum(sh["lengths"]) for sh in m["shards"])} for d, m in self.extra_features]
        if "draft_vocab_coverage" in self.summary:
            extra["draft_vocab_coverage"] = self.summary["draft_vocab_coverage"]
        return extra

    def save(self, ev: dict | None, partial: bool) -> None:
        """The head to --out (with provenance) and the training state for --resume."""
        from ..heads.formats import save_head
        save_head(self.head, self.cfg.out, extra=self.provenance(ev, partial))
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                    "step": self.step, "history": self.history, "train_seconds": self.t_train,
                    "rng": torch.get_rng_state(), "time_progress": self.time_progress()},
                   self.state_path + ".tmp")
        os.replace(self.state_path + ".tmp", self.state_path)

    # -----------------------------------------------------------------------------------------
    # Stage 3: the training loop
    def evaluate(self, tag: str) -> dict | None:
        """The held-out eval (None without eval samples), recorded in the eval history."""
        from tqdm import tqdm
        if not self.eval_batches:
            return None
        with self.autocast():
            ev = self.method.evaluate(self.eval_batches, self.dev)
        ev["step"] = self.step
        self.history.append({k: ev[k] for k in ("step", "acceptance", "top1", "ce", "mean_accepted")})
        tqdm.write(f"[turbospec train] eval {tag}(step {self.step}): {format_eval(ev)}", file=sys.stderr)
        return ev

    def train(self) -> None:
        """The eval at init, the epochs left (a resumed run starts mid-epoch), the final eval and head.
        Ctrl-C saves a partial head and the state --resume continues."""
        from tqdm import tqdm
        cfg = self.cfg
        log(f"train: {cfg.method}, {self.store.num_train_samples()} train samples ({self.tokens} tokens), "
            f"{len(self.eval_batches) and self.manifest['eval_samples']} eval samples; {self.per_epoch} "
            f"steps/epoch x {cfg.epochs} epochs = {self.total} steps of {cfg.batch_size} sequences; "
            f"lr {self.lr}, {cfg.schedule}"
            + (f", {self.method.steps} unrolled steps" if cfg.method != "medusa" else ""))
        t_eval = time.perf_counter()
        self.last_ev = self.evaluate("at init ") if self.step == 0 else None
        t_eval = time.perf_counter() - t_eval
        self.summary["init_eval"] = self.last_ev
        bar = tqdm(total=self.total, initial=self.step, unit="step", desc=f"train {cfg.method}", **distill.BAR)
        self._t0, self._t_prev, self._ema = time.perf_counter(), self.t_train, None
        if self.deadline is not None:
            # what is left once the final eval and the save are paid for (each eval's time, again)
            self.train_avail = self.deadline - self._t0 - (2 * t_eval + 2.0)
            log(f"train: --time-budget {cfg.time_budget:g} s: {max(self.train_avail, 0):.0f} s left to train; "
                f"the schedule ends by then" + (f" (resumed at {100 * self.time_p0:.0f}% of it)"
                                                 if self.time_p0 else ""))
        try:
            while self.step < self.total and self.time_progress() < 1.0:
                epoch, k = divmod(self.step, self.per_epoch)
                self.run_epoch(epoch, k, bar)
        except KeyboardInterrupt:
            bar.close()
            self.save(self.last_ev, partial=True)
            log(f"train: interrupted at step {self.step}/{self.total}; partial head in {cfg.out}, "
                f"continue with --resume")
            raise
        bar.close()
        if self.step < self.total:
            log(f"train: the time budget ran out at step {self.step}/{self.total} (the schedule has "
                f"annealed); final eval")
        final = self.evaluate("final ")
        self.save(final, partial=False)
        log(f"train: {self.step} steps in {self.t_train:.0f} s; head saved to {cfg.out}")
        self.summary.update(final_eval=final, out=cfg.out, steps=self.step, train_seconds=self.t_train)

    def run_epoch(self, epoch: int, start: int, bar) -> None:
        """Epoch ``epoch``'s batches from the ``start``-th on, with the periodic evals and checkpoints."""
        cfg = self.cfg
        plan = self.store.plan(cfg.batch_size, cfg.seed, epoch)
        for sh, idx in plan[start:]:
            if self.time_progress() >= 1.0:
                return
            batch = {key: v.to(self.dev) for key, v in collate(self.store.load(sh), idx).items()}
            lv, stats = self.train_step(batch)
            self._ema = lv if self._ema is None else 0.95 * self._ema + 0.05 * lv
            bar.update(1)
            bar.set_postfix(loss=f"{self._ema:.3f}", acc1=f"{stats.get('acc1', 0):.2f}",
                            lr=f"{self.sched.get_last_lr()[0]:.1e}")
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total:
                self.last_ev = self.evaluate("")
                self.save(self.last_ev, partial=True)
            elif cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.total:
                self.save(self.last_ev, partial=True)

    def time_progress(self) -> float:
        """With --time-budget, the share of the schedule's time this run and the runs it resumed
        have used (1.0 at the deadline); 0.0 without a budget or before training starts."""
        if self.train_avail is None:
            return self.time_p0
        if self.train_avail <= 0:
            return 1.0
        used = (time.perf_counter() - self._t0) / self.train_avail
        return min(1.0, self.time_p0 + (1.0 - self.time_p0) * used)

    def train_step(self, batch: dict) -> tuple[float, dict]:
        """One optimizer step on a batch (on device); returns (the loss, the method's stats)."""
        with self.autocast():
            loss, stats = self.method.loss(batch)
        if loss.requires_grad:  # False only when no position of the batch counts
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            self.opt.step()
        self.sched.step()
        self.step += 1
        self.t_train = self._t_prev + time.perf_counter() - self._t0
        return loss.item(), stats


def run(cfg: TrainConfig) -> dict:
    """The whole pipeline; returns a summary (stage infos, final eval, checkpoint path)."""
    return Trainer(cfg).run()


# ---------------------------------------------------------------------------------------------
# Command line (the options are ``config.add_args``)
def run_cli(args, argv: list[str] | None = None) -> int:
    summary = run(config_from_args(args, argv))
    ev = summary.get("final_eval")
    if ev:
        print(f"[turbospec train] final: {format_eval(ev)}; head in {summary['out']}")
    return 0
