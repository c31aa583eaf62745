"""``turbospec train``: self-distillation training of draft heads (Medusa, EAGLE-1/2, EAGLE-3).

Stages (each re-uses or resumes what an earlier run stored under --work-dir):
1. generate  (``distill.generate``): the target answers training prompts greedily.
2. features  (``distill.collect_features``): one target pass per sample stores the features heads
   read and the target's greedy next token at every position.
3. train     (here): AdamW, warmup + cosine/linear schedule, gradient clipping, a held-out eval
   every --eval-every steps, periodic checkpoints; the final head goes to --out
   (``checkpoints.save_head``) with provenance and eval results in its ``turbospec_extra``.

Notation: a sample is x_0 .. x_{T-1} (prompt x_0 .. x_{P-1}, response x_P ..); f_i the target's
feature at i; a_i = argmax of the target's logits at i (its greedy prediction of x_{i+1}; in the
response a_i = x_{i+1}). A head "at chain i" drafts after the root x_{i+1}: its depth-d draft
(d = 1, 2, ...) is compared with a_{i+d}. Losses cover chains i >= P - 1 (drafting happens in the
response), or every position with --loss-on-prompt.

- medusa: head k (0-based) reads f_i and predicts a_{i+1+k} through the target's frozen LM head;
  loss = sum_k decay^k * CE_k.
- eagle (EAGLE-1/2): step 0 reads (f_i + noise, embed(x_{i+1})) at position i and predicts f_{i+1}:
  loss = w_reg * smooth-L1(pred, f_{i+1}) + w_cls * CE(LM_head(pred), a_{i+1}); with --ttt-steps > 1
  the unrolled steps below add decay^j-weighted terms against f_{i+1+j} and a_{i+1+j}.
- eagle3: fc fuses the captured layers; loss = sum_j decay^j * CE over the draft vocabulary of step
  j's prediction of a_{i+1+j} (targets outside the draft vocabulary are masked out).

Unrolled steps (training-time test, ``unroll``): step j > 0 at chain i feeds the head its own step
j-1 output at chain i (eagle3: fused=True, fc skipped) with embed(x_{i+1+j}) at position i + j.
Attention of (chain i, step j): the step-0 keys of positions 0..i (what the head's KV cache holds
for committed tokens at inference) plus the keys of the same chain at steps 1..j (its own drafts
so far); never step-0 keys of positions > i, nor another chain's drafts. This is exactly what
drafting j tokens deep after position i sees at inference. The held-out eval runs the same
unrolled forward (no noise) and reports the cumulative acceptance at depth d: the fraction of
chains whose first d drafted tokens (argmax) all equal the target's greedy tokens. Feeding the true
x_{i+1+j} instead of the head's own draft changes nothing for this metric: a chain only counts at
depth d when every earlier draft was right, and then the two are the same token.

Initialisation: Medusa ``init_identity`` (every head starts as the target's own next-token
prediction); EAGLE-1/2 ``init_weights`` with fc's feature half set to the identity (the head starts
as "the next feature is this one"); EAGLE-3 ``init_weights``. The input-feature noise (EAGLE's
augmentation) is uniform, U(-a, a) * the features' RMS, a = --feature-noise (default: eagle 0.05).
The head's math runs under bfloat16 autocast where bfloat16 matmuls are fast (--amp auto: CUDA, CPUs
with AVX512-BF16 / AMX; the LM-head products, which dominate, run about 4x faster there), with
float32 master weights, losses and optimizer state.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import data as distill
from .data import FeatureStore, _log, collate
from ..heads.layers import METHODS, HeadConfig, HeadKV, draft_vocab_from_counts, init_weights

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA = os.path.join(_REPO_ROOT, "..", "shared", "data", "train_prompts.jsonl")
# tuned for short runs (a few hundred steps of 8 sequences) on SmolLM2-135M
DEFAULT_LR = {"medusa": 3e-3, "eagle": 2e-3, "eagle3": 2e-3}
EVAL_DEPTH = 3
TOPK_TABLE = 8


@dataclass
class TrainConfig:
    method: str
    out: str
    target: str = "default"
    data: str | None = None            # None: ../shared/data/train_prompts.jsonl next to the repo
    work_dir: str | None = None        # None: <out>/work
    # stage 1
    num_prompts: int = 1000            # 0: all
    max_new_tokens: int = 128
    max_prompt_tokens: int = 512
    truncate_long_prompts: bool = False
    gen_batch_size: int = 16
    seed: int = 0
    dtype: str = "float32"             # the target's
    # stage 2
    eval_samples: int | None = None    # None: 5% of the samples, 1..64
    shard_tokens: int = 65536
    feature_dtype: str = "bfloat16"
    # stage 3
    epochs: int = 1
    lr: float | None = None            # None: DEFAULT_LR[method]
    batch_size: int = 8
    schedule: str = "cosine"
    warmup_steps: int | None = None    # None: 3% of the steps
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    eval_every: int = 200
    save_every: int = 500
    resume: bool = False
    loss_on_prompt: bool = False
    step_decay: float = 0.8
    medusa_heads: int = 4
    medusa_layers: int = 1
    ttt_steps: int | None = None       # None: eagle 1, eagle3 3
    draft_vocab: int = 8192
    feature_layers: list[int] | None = None
    feature_noise: float | None = None  # None: eagle 0.05, else 0
    w_reg: float = 1.0
    w_cls: float = 0.1
    device: str = "cpu"
    amp: str = "auto"                  # "auto" | "bfloat16" | "none": autocast of the head's math
    threads: int | None = None
    stop_after: str | None = None      # "generate" | "features"
    command: str = ""                  # recorded in the checkpoint
    extra: dict = field(default_factory=dict)


def _check(cfg: TrainConfig) -> None:
    """Option checks that need no model; errors name the option and the value."""
    if cfg.method not in METHODS:
        raise ValueError(f"--method {cfg.method!r} is not supported; choose one of {', '.join(METHODS)}")
    ints = dict(num_prompts=(cfg.num_prompts, 0), max_new_tokens=(cfg.max_new_tokens, 1),
                max_prompt_tokens=(cfg.max_prompt_tokens, 1), gen_batch_size=(cfg.gen_batch_size, 1),
                shard_tokens=(cfg.shard_tokens, 1), epochs=(cfg.epochs, 1), batch_size=(cfg.batch_size, 1),
                eval_every=(cfg.eval_every, 0), save_every=(cfg.save_every, 0),
                medusa_heads=(cfg.medusa_heads, 1), medusa_layers=(cfg.medusa_layers, 1),
                draft_vocab=(cfg.draft_vocab, 1))
    if cfg.ttt_steps is not None:
        ints["ttt_steps"] = (cfg.ttt_steps, 1)
    if cfg.eval_samples is not None:
        ints["eval_samples"] = (cfg.eval_samples, 0)
    if cfg.warmup_steps is not None:
        ints["warmup_steps"] = (cfg.warmup_steps, 0)
    for name, (v, lo) in ints.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
    for name, v in (("lr", cfg.lr), ("grad_clip", cfg.grad_clip)):
        if v is not None and not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v!r}")
    for name, v in (("weight_decay", cfg.weight_decay), ("w_reg", cfg.w_reg), ("w_cls", cfg.w_cls),
                    ("feature_noise", cfg.feature_noise or 0.0)):
        if not v >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {v!r}")
    if not 0 < cfg.step_decay <= 1:
        raise ValueError(f"--step-decay must be in (0, 1], got {cfg.step_decay!r}")
    if cfg.schedule not in ("cosine", "linear", "constant"):
        raise ValueError(f"--schedule {cfg.schedule!r}: choose cosine, linear or constant")
    if cfg.feature_dtype not in distill.FEATURE_DTYPES:
        raise ValueError(f"--feature-dtype {cfg.feature_dtype!r}: choose one of "
                         f"{list(distill.FEATURE_DTYPES)}")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {cfg.dtype!r}: choose float32, bfloat16 or float16")
    if cfg.loss_on_prompt and cfg.method == "medusa":
        raise ValueError("--loss-on-prompt is for eagle / eagle3 only: a Medusa head reads one feature and "
                         "would learn the user's text, not the target's own continuation")
    if cfg.amp not in ("auto", "bfloat16", "none"):
        raise ValueError(f"--amp {cfg.amp!r}: choose auto, bfloat16 or none")
    if cfg.stop_after not in (None, "generate", "features"):
        raise ValueError(f"--stop-after {cfg.stop_after!r}: choose generate or features")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device!r}: CUDA is not available on this machine")


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for training and eval: bfloat16 where the hardware has fast bfloat16
    matmuls ("auto": CUDA with bf16 support, or a CPU with AVX512-BF16 / AMX, where the LM-head
    products run about 4x faster than in float32), else None (float32)."""
    if amp == "none":
        return None
    if amp == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu" and os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "").split()
        if "avx512_bf16" in flags or "amx_bf16" in flags:
            return torch.bfloat16
    return None


# ---------------------------------------------------------------------------------------------
# The frozen parts of the target the heads use
def lm_head_weight(target) -> Tensor:
    """The target's LM head weight [V, H], dense: ``Transformer.lm_head_weight`` (the embedding for
    tied models), else the LM head's weight dequantized (``Linear.dense``)."""
    w = getattr(target, "lm_head_weight", None)
    if w is not None:
        return w
    if target.cfg.tie_word_embeddings:
        return target.embed
    return target.lm_head.dense(target.dtype)


@dataclass
class Frozen:
    embed: Tensor         # [V, H] float32, the target's embedding
    lm_w: Tensor          # [V, H] float32, the target's LM head
    t2d: Tensor | None    # eagle3: [V] int64, draft-vocab row of each target id (-100: not in it)


def _shift(x: Tensor, k: int, fill: float) -> Tensor:
    """x[:, i + k] at i, ``fill`` past the end (x: [B, n, ...])."""
    tail = x.new_full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat((x[:, k:], tail), dim=1)


def _ce_chunk(h: Tensor, y: Tensor, fn) -> tuple[Tensor, Tensor]:
    logits = fn(h).float()
    loss = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    return loss, (logits.argmax(-1) == y).sum().float()


CE_KEEP_ELEMENTS = 1 << 27  # logits kept for backward up to this many (512 MB fp32); beyond, recomputed


def chunked_ce(h: Tensor, y: Tensor, fn: "_Logits", chunk: int = 1024) -> tuple[Tensor, Tensor, int]:
    """Cross-entropy of logits ``fn(h)`` [N, V] against ``y`` [N] (-100: ignored), in row chunks.
    When all N x V logits would take more than CE_KEEP_ELEMENTS, each chunk's logits are recomputed
    in backward instead of kept (memory: chunk x V; a third more LM-head compute).
    Returns (summed loss, top-1 hits, counted rows)."""
    keep = y != -100
    h, y = h[keep], y[keep]
    total, hits = h.new_zeros(()), 0.0
    recompute = torch.is_grad_enabled() and h.requires_grad and \
        h.shape[0] * fn.out_features > CE_KEEP_ELEMENTS
    for s in range(0, h.shape[0], chunk):
        if recompute:
            loss, hit = checkpoint(_ce_chunk, h[s:s + chunk], y[s:s + chunk], fn, use_reentrant=False)
        else:
            loss, hit = _ce_chunk(h[s:s + chunk], y[s:s + chunk], fn)
        total = total + loss
        hits += float(hit)
    return total, hits, int(y.numel())


class _Logits:
    """hidden [N, H] -> logits [N, out_features]."""

    def __init__(self, fn, out_features: int):
        self.fn, self.out_features = fn, out_features

    def __call__(self, h: Tensor) -> Tensor:
        return self.fn(h)


def _eval_chunked(h: Tensor, y: Tensor, fn, k: int, chunk: int = 1024) -> tuple[float, int, Tensor]:
    """No-grad: (summed CE over rows with y != -100, their count, top-k ids [N, k] of every row),
    one logits chunk at a time."""
    ce, cnt, tops = 0.0, 0, []
    for s in range(0, h.shape[0], chunk):
        logits = fn(h[s:s + chunk]).float()
        yy = y[s:s + chunk]
        ce += float(F.cross_entropy(logits, yy, ignore_index=-100, reduction="sum"))
        cnt += int((yy != -100).sum())
        tops.append(logits.topk(k, dim=-1).indices)
    top = torch.cat(tops) if tops else torch.zeros(0, k, dtype=torch.int64, device=h.device)
    return ce, cnt, top


# ---------------------------------------------------------------------------------------------
# EAGLE: the unrolled forward
def ttt_mask(n: int, j: int, device) -> Tensor:
    """Attention of step j's n chains over the keys of steps 0..j: bool [1, n, (j + 1) n]. Chain i
    sees step-0 keys 0..i (causal) and its own keys at steps 1..j (the diagonal of each block)."""
    blocks = [torch.ones(n, n, dtype=torch.bool, device=device).tril_()]
    blocks += [torch.eye(n, dtype=torch.bool, device=device)] * j
    return torch.cat(blocks, dim=1)[None].contiguous()


def unroll(head, features: Tensor, ids: Tensor, embed: Tensor, steps: int) -> list[Tensor]:
    """The head's outputs [B, n, H] for steps 0..steps-1 (see the module docstring).
    features [B, n, F] (already noised if wanted), ids [B, n]."""
    bsz, n, _ = features.shape
    pos = torch.arange(n, device=features.device).expand(bsz, n)
    hidden, prev, outs = features, None, []
    for j in range(steps):
        emb = embed[_shift(ids, 1 + j, 0)]
        kv = HeadKV(head.cfg, (j + 1) * n, bsz, dtype=features.dtype, device=features.device)
        if j:
            kv.k[:, :, :j * n] = prev.k
            kv.v[:, :, :j * n] = prev.v
        mask = ttt_mask(n, j, features.device) if j else None  # step 0: causal
        out = head(hidden, emb, pos + j, kv=kv, cache_len=j * n, mask=mask, fused=j > 0)
        outs.append(out)
        prev, hidden = kv, out
    return outs


def _lo(batch: dict, loss_on_prompt: bool) -> Tensor:
    """[B, n] bool: chains that count (i >= P - 1 unless --loss-on-prompt; i < T)."""
    n = batch["ids"].shape[1]
    i = torch.arange(n, device=batch["ids"].device)[None]
    lo = torch.zeros_like(batch["prompt_len"]) if loss_on_prompt else batch["prompt_len"] - 1
    return (i >= lo[:, None]) & (i < batch["length"][:, None])


def _labels(batch: dict, depth: int, ok: Tensor) -> Tensor:
    """a_{i+depth} at chain i, -100 where it does not exist or the chain does not count."""
    return torch.where(ok, _shift(batch["argmax"], depth, -100), torch.full_like(batch["argmax"], -100))


class Method:
    """Loss and eval of one head type over a batch (dict from ``distill.collate``, on device)."""

    def __init__(self, head: nn.Module, frozen: Frozen, cfg: TrainConfig, feature_rms: float):
        self.head, self.fz, self.cfg = head, frozen, cfg
        self.method = head.cfg.method
        noise = cfg.feature_noise
        if noise is None:
            noise = 0.05 if self.method == "eagle" else 0.0
        self.noise = noise * feature_rms  # half-width of the uniform noise added to input features
        self.steps = cfg.ttt_steps or (3 if self.method == "eagle3" else 1)

    def _logits_fn(self) -> "_Logits":
        if self.method == "eagle3":
            return _Logits(self.head.logits, self.head.lm_head.out_features)
        w = self.fz.lm_w
        return _Logits(lambda h: F.linear(h, w), w.shape[0])

    def _draft_labels(self, y: Tensor) -> Tensor:
        if self.fz.t2d is None:
            return y
        return torch.where(y >= 0, self.fz.t2d[y.clamp_min(0)], y)

    def loss(self, batch: dict) -> tuple[Tensor, dict]:
        ok = _lo(batch, self.cfg.loss_on_prompt)
        feats = batch["features"].float()
        total, stats = feats.new_zeros(()), {}
        fn = self._logits_fn()
        if self.method == "medusa":
            sel = ok & (batch["argmax"] != -100)
            outs = self.head(feats[sel])                           # [K, N, H]
            for k in range(outs.shape[0]):
                y = _labels(batch, 1 + k, ok)[sel]
                ce, hits, cnt = chunked_ce(outs[k], y, fn)
                total = total + self.cfg.step_decay ** k * ce / max(cnt, 1)
                stats[f"acc{k + 1}"] = hits / max(cnt, 1)
            return total, stats
        x = feats
        if self.noise:
            x = x + (torch.rand_like(x) * 2 - 1) * self.noise
        outs = unroll(self.head, x, batch["ids"], self.fz.embed, self.steps)
        for j, out in enumerate(outs):
            y = _labels(batch, 1 + j, ok)
            keep = y != -100
            w = self.cfg.step_decay ** j
            if self.method == "eagle":
                tgt = _shift(feats, 1 + j, 0.0)                   # f_{i+1+j}
                reg = F.smooth_l1_loss(out[keep], tgt[keep], reduction="none").mean(-1).sum()
                ce, hits, cnt = chunked_ce(out[keep], y[keep], fn)
                total = total + w * (self.cfg.w_reg * reg + self.cfg.w_cls * ce) / max(cnt, 1)
                stats[f"reg{j + 1}"] = reg.item() / max(cnt, 1)
            else:
                ce, hits, cnt = chunked_ce(out[keep], self._draft_labels(y[keep]), fn)
                total = total + w * ce / max(cnt, 1)
            stats[f"acc{j + 1}"] = hits / max(cnt, 1)
        return total, stats

    @torch.no_grad()
    def evaluate(self, batches: list[dict], device) -> dict:
        """Cumulative acceptance at depths 1..D on chains i >= P - 1 whose depth-D target exists
        (D = 3 for EAGLE, the number of heads for Medusa); per-depth top-1 over the same chains;
        mean CE per depth; Medusa: head_accuracy[k][r] = P(rank-r candidate of head k is a_{i+1+k})."""
        self.head.eval()
        depth = self.head.cfg.medusa_num_heads if self.method == "medusa" else EVAL_DEPTH
        fn = self._logits_fn()
        chains = 0
        cum = [0.0] * depth
        top1 = [0.0] * depth
        ce_sum, ce_cnt = [0.0] * depth, [0] * depth
        table = [[0.0] * TOPK_TABLE for _ in range(depth)]
        table_n = [0] * depth
        for b in batches:
            batch = {k: v.to(device) for k, v in b.items()}
            ok = _lo(batch, False)
            chain = ok & (_labels(batch, depth, ok) != -100)       # [B, n]
            feats = batch["features"].float()
            if self.method == "medusa":
                sel = ok & (batch["argmax"] != -100)
                outs = list(self.head(feats[sel]))
                chain_sel = chain[sel]
                ys = [_labels(batch, 1 + k, ok)[sel] for k in range(depth)]
            else:
                outs = unroll(self.head, feats, batch["ids"], self.fz.embed, depth)
                outs = [o[ok] for o in outs]
                chain_sel = chain[ok]
                ys = [_labels(batch, 1 + j, ok)[ok] for j in range(depth)]
            alive = chain_sel.clone()
            chains += int(chain_sel.sum())
            for d in range(depth):
                y = ys[d]
                ce, cnt, top = _eval_chunked(outs[d], self._draft_labels(y), fn,
                                             min(TOPK_TABLE, fn.out_features))
                ce_sum[d] += ce
                ce_cnt[d] += cnt
                if self.fz.t2d is not None:
                    top = self.head.draft_vocab_ids().to(top.device)[top]
                hit = top[:, 0] == y
                top1[d] += float((hit & chain_sel).sum())
                alive &= hit
                cum[d] += float(alive.sum())
                valid = y != -100
                table_n[d] += int(valid.sum())
                for r in range(top.shape[1]):
                    table[d][r] += float(((top[:, r] == y) & valid).sum())
        self.head.train()
        res = {"chains": chains,
               "acceptance": [c / max(chains, 1) for c in cum],
               "top1": [t / max(chains, 1) for t in top1],
               "ce": [s / max(c, 1) for s, c in zip(ce_sum, ce_cnt)]}
        res["mean_accepted"] = sum(res["acceptance"])
        # rank_accuracy[d][r]: P(the rank-r candidate at depth d is the target's token) (Medusa: head d)
        res["rank_accuracy"] = [[v / max(n, 1) for v in row] for row, n in zip(table, table_n)]
        return res


def format_eval(ev: dict) -> str:
    acc = ", ".join(f"+{d + 1} {a:.3f}" for d, a in enumerate(ev["acceptance"]))
    ce = ", ".join(f"{c:.3f}" for c in ev["ce"])
    return (f"acceptance {acc} (mean accepted per chain {ev['mean_accepted']:.2f}, {ev['chains']} chains); "
            f"ce by depth {ce}")


# ---------------------------------------------------------------------------------------------
def build_head(cfg: TrainConfig, target, counts: Tensor | None, source: str = "") -> nn.Module:
    """A freshly initialised head for ``target`` (``source``: its path, recorded in the config)."""
    from ..heads.formats import build_head as _build
    kw = {"target": str(source or cfg.target)}
    if cfg.method == "medusa":
        kw.update(medusa_num_heads=cfg.medusa_heads, medusa_num_layers=cfg.medusa_layers)
    if cfg.method == "eagle3":
        kw["draft_vocab_size"] = cfg.draft_vocab
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
            head.set_draft_vocab(draft_vocab_from_counts(counts, cfg.draft_vocab))
    return head


def _schedule(cfg: TrainConfig, total: int):
    warm = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * total))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.schedule == "constant":
            return 1.0
        p = min(1.0, (step - warm) / max(1, total - warm))
        return 0.5 * (1 + math.cos(math.pi * p)) if cfg.schedule == "cosine" else 1.0 - p
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


def run(cfg: TrainConfig) -> dict:
    """The whole pipeline; returns a summary (stage infos, final eval, checkpoint path)."""
    import datetime
    _check(cfg)
    data = cfg.data or DEFAULT_DATA
    prompts = distill.read_prompts(data)  # fails fast on a missing / empty / unusable file
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    work = cfg.work_dir or os.path.join(cfg.out, "work")
    os.makedirs(work, exist_ok=True)

    from ..decode.engine import Engine, _dtype
    from ..model.loader import default_model_path, load_model, load_tokenizer
    source = default_model_path() if cfg.target == "default" else cfg.target
    target = load_model(source, _dtype(cfg.dtype), device=cfg.device)
    tok = load_tokenizer(source)
    vocab = target.cfg.vocab_size
    if cfg.method == "eagle3" and cfg.draft_vocab > vocab:
        raise ValueError(f"--draft-vocab {cfg.draft_vocab} is larger than the target's vocabulary ({vocab})")
    if cfg.feature_layers:
        bad = [i for i in cfg.feature_layers if not 0 <= i < target.cfg.num_layers]
        if bad:
            raise ValueError(f"--feature-layers {cfg.feature_layers}: layer {bad[0]} is outside "
                             f"[0, {target.cfg.num_layers})")
    engine = Engine(target, drafter="none", tokenizer=tok, max_seq_len=2)  # for encode / EOS ids
    data_sha1 = distill.file_sha1(data)

    gen_dir, samples, gen_info = distill.generate(
        target, engine, prompts, work, data_sha1=data_sha1, num_prompts=cfg.num_prompts,
        max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed,
        truncate=cfg.truncate_long_prompts, batch_size=cfg.gen_batch_size, dtype=cfg.dtype)
    summary = {"generation": gen_info, "generation_dir": gen_dir}
    if cfg.stop_after == "generate":
        return summary

    n_eval = cfg.eval_samples if cfg.eval_samples is not None else min(64, max(1, round(0.05 * len(samples))))
    layers_kw = {"feature_layers": list(cfg.feature_layers)} if cfg.feature_layers else {}
    probe = HeadConfig.for_target(cfg.method, target.cfg, **layers_kw)
    spec = tuple(probe.feature_layers) if cfg.method == "eagle3" else "final"
    feat_dir, manifest = distill.collect_features(
        target, gen_dir, samples, work, spec, eval_samples=n_eval, shard_tokens=cfg.shard_tokens,
        feature_dtype=cfg.feature_dtype)
    summary.update(features_dir=feat_dir, features_seconds=manifest.get("seconds"))
    if cfg.stop_after == "features":
        return summary

    dev = torch.device(cfg.device)
    train_samples, _ = distill._split(samples, n_eval)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in train_samples:
        counts += torch.bincount(torch.tensor(s["response_ids"], dtype=torch.int64), minlength=vocab)
    frozen = Frozen(embed=target.embed.detach().float(), lm_w=lm_head_weight(target).detach().float(),
                    t2d=None)
    head = build_head(cfg, target, counts, source)
    if cfg.method == "eagle3":
        t2d = torch.full((vocab,), -100, dtype=torch.int64)
        ids = head.draft_vocab_ids()
        t2d[ids] = torch.arange(ids.numel())
        frozen.t2d = t2d.to(dev)
        summary["draft_vocab_coverage"] = float(counts[ids].sum()) / max(int(counts.sum()), 1)
    del target, engine  # only the embedding and the LM head are needed from here on
    head = head.to(dev).train()
    frozen.embed, frozen.lm_w = frozen.embed.to(dev), frozen.lm_w.to(dev)
    method = Method(head, frozen, cfg, manifest.get("feature_rms", 1.0))
    amp = amp_dtype(cfg.amp, dev)

    def autocast():
        return torch.autocast(device_type=dev.type, dtype=amp or torch.bfloat16, enabled=amp is not None)

    store = FeatureStore(feat_dir, manifest)
    eval_batches = store.eval_batches(cfg.batch_size)
    per_epoch = len(store.plan(cfg.batch_size, cfg.seed, 0))
    total = per_epoch * cfg.epochs
    lr = cfg.lr or DEFAULT_LR[cfg.method]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg, total))
    hyper = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("command", "extra")}
    hyper.update(lr=lr, ttt_steps=method.steps, feature_noise_abs=method.noise, amp_dtype=str(amp),
                 eval_samples=manifest["eval_samples"])
    not_keyed = ("resume", "threads", "out", "work_dir", "eval_every", "save_every")
    train_key = distill._sha1({"feat": os.path.basename(feat_dir),
                               **{k: v for k, v in hyper.items() if k not in not_keyed}})
    state_path = os.path.join(work, f"train-{cfg.method}-{train_key}.pt")
    step, history = 0, []
    t_train = 0.0
    if cfg.resume and os.path.isfile(state_path):
        st = torch.load(state_path, map_location=dev, weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, history, t_train = st["step"], st["history"], st["train_seconds"]
        torch.set_rng_state(st["rng"])
        _log(f"train: resuming at step {step}/{total} from {state_path}")
    elif cfg.resume:
        _log(f"train: --resume: no saved state for these settings ({state_path}); starting fresh")

    tokens = sum(sum(s["lengths"]) for s in store.shards)
    _log(f"train: {cfg.method}, {store.num_train_samples()} train samples ({tokens} tokens), "
         f"{len(eval_batches) and manifest['eval_samples']} eval samples; {per_epoch} steps/epoch x "
         f"{cfg.epochs} epochs = {total} steps of {cfg.batch_size} sequences; lr {lr}, {cfg.schedule}"
         + (f", {method.steps} unrolled steps" if cfg.method != "medusa" else ""))

    def provenance(ev: dict | None, partial: bool) -> dict:
        extra = {
            "command": cfg.command or None, "dataset": os.path.abspath(data), "dataset_sha1": data_sha1,
            "num_samples": store.num_train_samples(), "num_eval_samples": manifest["eval_samples"],
            "train_tokens": tokens, "generation": {k: gen_info.get(k) for k in
                                                   ("prompts", "prompt_tokens", "response_tokens",
                                                    "finished_by_eos", "seconds")},
            "generation_settings": {"max_new_tokens": cfg.max_new_tokens, "max_prompt_tokens":
                                    cfg.max_prompt_tokens, "num_prompts": cfg.num_prompts,
                                    "seed": cfg.seed, "target_dtype": cfg.dtype, "greedy": True},
            "argmax_agreement": manifest.get("argmax_agreement"),
            "hyperparameters": hyper, "steps": step, "total_steps": total, "partial": partial,
            "run_time_s": {"generation": gen_info.get("seconds"),
                           "features": manifest.get("seconds"), "training": round(t_train, 1),
                           "total_this_run": round(time.perf_counter() - t_start, 1)},
            "machine": _machine(cfg.device), "date": datetime.datetime.now().astimezone().isoformat(),
            "eval": ev, "eval_history": history, **cfg.extra}
        if ev and cfg.method == "medusa":
            extra["head_accuracy"] = ev["rank_accuracy"]  # what medusa.default_choices takes
        if "draft_vocab_coverage" in summary:
            extra["draft_vocab_coverage"] = summary["draft_vocab_coverage"]
        return extra

    def do_eval(tag: str) -> dict | None:
        if not eval_batches:
            return None
        with autocast():
            ev = method.evaluate(eval_batches, dev)
        ev["step"] = step
        history.append({k: ev[k] for k in ("step", "acceptance", "top1", "ce", "mean_accepted")})
        tqdm_write(f"[turbospec train] eval {tag}(step {step}): {format_eval(ev)}", file=sys.stderr)
        return ev

    def save(ev, partial: bool) -> None:
        from ..heads.formats import save_head
        save_head(head, cfg.out, extra=provenance(ev, partial))
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "step": step, "history": history, "train_seconds": t_train,
                    "rng": torch.get_rng_state()}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)

    from tqdm import tqdm
    tqdm_write = tqdm.write
    init_ev = do_eval("at init ") if step == 0 else None
    summary["init_eval"] = init_ev
    last_ev = init_ev
    bar = tqdm(total=total, initial=step, unit="step", desc=f"train {cfg.method}", **distill.BAR)
    t0 = time.perf_counter()
    t_prev = t_train
    ema = None
    try:
        while step < total:
            epoch, k = divmod(step, per_epoch)
            plan = store.plan(cfg.batch_size, cfg.seed, epoch)
            for sh, idx in plan[k:]:
                batch = {key: v.to(dev) for key, v in collate(store.load(sh), idx).items()}
                with autocast():
                    loss, stats = method.loss(batch)
                if loss.requires_grad:  # False only when no position of the batch counts
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    opt.step()
                sched.step()
                step += 1
                t_train = t_prev + time.perf_counter() - t0
                lv = loss.item()
                ema = lv if ema is None else 0.95 * ema + 0.05 * lv
                bar.update(1)
                bar.set_postfix(loss=f"{ema:.3f}", acc1=f"{stats.get('acc1', 0):.2f}",
                                lr=f"{sched.get_last_lr()[0]:.1e}")
                if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                    last_ev = do_eval("")
                    save(last_ev, partial=True)
                elif cfg.save_every and step % cfg.save_every == 0 and step < total:
                    save(last_ev, partial=True)
    except KeyboardInterrupt:
        bar.close()
        save(last_ev, partial=True)
        _log(f"train: interrupted at step {step}/{total}; partial head in {cfg.out}, continue with --resume")
        raise
    bar.close()
    final = do_eval("final ")
    save(final, partial=False)
    _log(f"train: {step} steps in {t_train:.0f} s; head saved to {cfg.out}")
    summary.update(final_eval=final, out=cfg.out, steps=step, train_seconds=t_train)
    return summary


# ---------------------------------------------------------------------------------------------
# Command line
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", required=True, choices=list(METHODS), help="head type to train")
    p.add_argument("--target", default="default",
                   help="target model: 'default' (SmolLM2-135M-Instruct), a model directory or a .gguf")
    p.add_argument("--data", default=None,
                   help="training prompts, JSONL with 'prompt' (or 'text', 'turns', 'messages') per line "
                        "(default: ../shared/data/train_prompts.jsonl next to the repo). "
                        "Never evaluation data.")
    p.add_argument("--out", required=True,
                   help="output folder for the head (config.json + model.safetensors)")
    p.add_argument("--work-dir", default=None,
                   help="where generations, features and training state are kept (default: OUT/work); "
                        "share it between methods to generate once")
    g = p.add_argument_group("stage 1: self-distillation data")
    g.add_argument("--num-prompts", type=int, default=1000, help="prompts to answer (0: all)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="response length limit")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    g.add_argument("--truncate-long-prompts", action="store_true",
                   help="keep the last --max-prompt-tokens tokens of long prompts instead of skipping them")
    g.add_argument("--gen-batch-size", type=int, default=16, help="prompts generated together")
    g.add_argument("--seed", type=int, default=0, help="prompt sampling, split, init and batch order")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype for generation and features")
    g = p.add_argument_group("stage 2: features")
    g.add_argument("--eval-samples", type=int, default=None,
                   help="held-out samples for eval (default: 5%% of the samples, 1..64)")
    g.add_argument("--shard-tokens", type=int, default=65536, help="tokens per feature shard (bounds memory)")
    g.add_argument("--feature-dtype", default="bfloat16", choices=list(distill.FEATURE_DTYPES))
    g = p.add_argument_group("stage 3: training")
    g.add_argument("--epochs", type=int, default=1)
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: medusa 3e-3, eagle 2e-3, eagle3 2e-3)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step (padded)")
    g.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"],
                   help="decay after the linear warmup")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: 3%% of the steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=0.5, help="max gradient norm")
    g.add_argument("--eval-every", type=int, default=200,
                   help="steps between held-out evals (0: only at the start and the end)")
    g.add_argument("--save-every", type=int, default=500,
                   help="steps between checkpoints (also after each eval)")
    g.add_argument("--resume", action="store_true",
                   help="continue the saved training state of the same settings")
    g.add_argument("--loss-on-prompt", action="store_true",
                   help="eagle/eagle3: also train on prompt positions (the head reads the true tokens there, "
                        "so the target's argmax is a valid target; default: only the response, where "
                        "drafting happens)")
    g.add_argument("--step-decay", type=float, default=0.8,
                   help="loss weight decay^j of Medusa head j / unrolled step j")
    g.add_argument("--medusa-heads", type=int, default=4)
    g.add_argument("--medusa-layers", type=int, default=1, help="residual blocks per Medusa head")
    g.add_argument("--ttt-steps", type=int, default=None,
                   help="EAGLE unrolled (training-time test) steps (default: eagle3 3, eagle 1)")
    g.add_argument("--draft-vocab", type=int, default=8192,
                   help="eagle3: draft vocabulary size (most frequent response tokens)")
    g.add_argument("--feature-layers", default=None,
                   help="eagle3: comma list of 0-based target layers fc fuses (default: low, middle, high)")
    g.add_argument("--feature-noise", type=float, default=None,
                   help="EAGLE input-feature noise U(-a, a) * feature RMS (default: eagle 0.05, eagle3 0)")
    g.add_argument("--w-reg", type=float, default=1.0, help="eagle: smooth-L1 feature loss weight")
    g.add_argument("--w-cls", type=float, default=0.1, help="eagle: token cross-entropy weight")
    g = p.add_argument_group("run")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--amp", default="auto", choices=["auto", "bfloat16", "none"],
                   help="bfloat16 autocast for the head's training math (auto: where bfloat16 matmuls "
                        "are fast: CUDA, CPUs with AVX512-BF16/AMX)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--stop-after", default=None, choices=["generate", "features"],
                   help="stop after a stage (e.g. to time it)")


def config_from_args(args, argv: list[str] | None = None) -> TrainConfig:
    layers = None
    if args.feature_layers:
        try:
            layers = [int(x) for x in args.feature_layers.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--feature-layers {args.feature_layers!r}: expected a comma list of "
                             f"integers") from None
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(feature_layers=layers,
              command=shlex.join(["turbospec", *(sys.argv[1:] if argv is None else argv)]))
    return TrainConfig(**kw)


def run_cli(args, argv: list[str] | None = None) -> int:
    summary = run(config_from_args(args, argv))
    ev = summary.get("final_eval")
    if ev:
        print(f"[turbospec train] final: {format_eval(ev)}; head in {summary['out']}")
    return 0
