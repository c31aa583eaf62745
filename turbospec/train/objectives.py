"""The losses and the held-out eval of draft-head training (stage 3 of ``turbospec train``).

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
- --distill-topk K (any method): each cross-entropy is taken against the target's own distribution
  at that position (its top-K next tokens, renormalized over the ids the head's logits cover)
  instead of the one-hot a_{i+1+j}, the distillation loss of EAGLE's and HASS's training; the
  rows and the reported accuracies are those of the argmax labels. --soft-weight w blends:
  w x soft + (1 - w) x argmax cross-entropy (w = 0: the argmax loss on the same features).

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

--align-topk K (GRIFFIN's token-alignable training): step j > 0 trains only on the chains where,
at every earlier step j' < j, the true token a_{i+1+j'} was among the head's top K drafts there
(for EAGLE-3: in the draft vocabulary too). Elsewhere the drafts at step j would never be reached
at inference (a tree of width K holds no branch that carries the true prefix), so training on them
spends the head's capacity on contexts drafting never meets. The held-out eval is unchanged.

The input-feature noise (EAGLE's augmentation) is uniform, U(-a, a) * the features' RMS,
a = --feature-noise (default: eagle 0.05).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .config import EVAL_DEPTH, TOPK_TABLE, TrainConfig, unrolled_steps
from ..heads.layers import head_cache


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


def frozen_parts(target, head: nn.Module, device) -> Frozen:
    """The target's embedding and LM head (float32) and, for an EAGLE-3 head, the draft-vocabulary
    row of each target id, on ``device``."""
    frozen = Frozen(embed=target.embed.detach().float().to(device),
                    lm_w=lm_head_weight(target).detach().float().to(device), t2d=None)
    if head.cfg.method == "eagle3":
        t2d = torch.full((target.cfg.vocab_size,), -100, dtype=torch.int64)
        ids = head.draft_vocab_ids()
        t2d[ids] = torch.arange(ids.numel())
        frozen.t2d = t2d.to(device)
    return frozen


def _shift(x: Tensor, k: int, fill: float) -> Tensor:
    """x[:, i + k] at i, ``fill`` past the end (x: [B, n, ...])."""
    tail = x.new_full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat((x[:, k:], tail), dim=1)


def _ce_chunk(h: Tensor, y: Tensor, fn, soft_ids: Tensor | None = None, soft_p: Tensor | None = None,
              soft_weight: float = 1.0, rank_k: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    logits = fn(h).float()
    with torch.no_grad():  # rows whose label is among the k largest logits (ties count as in)
        in_top = (logits > logits.gather(1, y[:, None])).sum(1) < rank_k if rank_k else y.new_zeros(0, dtype=torch.bool)
    if soft_ids is None:
        loss = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    else:  # cross-entropy against the target's (top-k) distribution, blended with the argmax's
        logq = torch.log_softmax(logits, -1)
        loss = -soft_weight * (soft_p * logq.gather(1, soft_ids)).sum()
        if soft_weight < 1:
            loss = loss - (1 - soft_weight) * logq.gather(1, y[:, None]).sum()
    return loss, (logits.argmax(-1) == y).sum().float(), in_top


CE_KEEP_ELEMENTS = 1 << 27  # logits kept for backward up to this many (512 MB fp32); beyond, recomputed


def chunked_ce(h: Tensor, y: Tensor, fn: "_Logits", chunk: int = 1024,
               soft: tuple[Tensor, Tensor] | None = None, soft_weight: float = 1.0,
               rank_k: int = 0) -> tuple[Tensor, Tensor, int] | tuple[Tensor, Tensor, int, Tensor]:
    """Cross-entropy of logits ``fn(h)`` [N, V] against ``y`` [N] (-100: ignored), in row chunks.
    ``soft`` (ids [N, K] in the logits' space, p [N, K] summing to 1 per row): the loss is
    ``soft_weight`` x the cross-entropy against that distribution + (1 - ``soft_weight``) x the one
    against ``y`` (``y`` also picks the rows and counts the hits).
    When all N x V logits would take more than CE_KEEP_ELEMENTS, each chunk's logits are recomputed
    in backward instead of kept (memory: chunk x V; a third more LM-head compute).
    Returns (summed loss, top-1 hits, counted rows), and with ``rank_k`` > 0 a fourth item: bool [N],
    whether each row's label is among its ``rank_k`` largest logits (False where y is -100)."""
    keep = y != -100
    h, y = h[keep], y[keep]
    sid, sp = (None, None) if soft is None else (soft[0][keep], soft[1][keep])
    total, hits, tops = h.new_zeros(()), 0.0, []
    recompute = torch.is_grad_enabled() and h.requires_grad and \
        h.shape[0] * fn.out_features > CE_KEEP_ELEMENTS
    for s in range(0, h.shape[0], chunk):
        part = (None, None, soft_weight) if sid is None else (sid[s:s + chunk], sp[s:s + chunk], soft_weight)
        if recompute:
            loss, hit, top = checkpoint(_ce_chunk, h[s:s + chunk], y[s:s + chunk], fn, *part, rank_k,
                                        use_reentrant=False)
        else:
            loss, hit, top = _ce_chunk(h[s:s + chunk], y[s:s + chunk], fn, *part, rank_k)
        total = total + loss
        hits += float(hit)
        tops.append(top)
    if not rank_k:
        return total, hits, int(y.numel())
    in_top = torch.zeros(keep.shape, dtype=torch.bool, device=keep.device)
    if tops:
        in_top[keep] = torch.cat(tops)
    return total, hits, int(y.numel()), in_top


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
        kv = head_cache(head.cfg, (j + 1) * n, bsz, dtype=features.dtype, device=features.device)
        if j:
            kv.k[0][:, :, :j * n] = prev.k[0]
            kv.v[0][:, :, :j * n] = prev.v[0]
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
    """Loss and eval of one head type over a batch (dict from ``data.collate``, on device)."""

    def __init__(self, head: nn.Module, frozen: Frozen, cfg: TrainConfig, feature_rms: float):
        self.head, self.fz, self.cfg = head, frozen, cfg
        self.method = head.cfg.method
        noise = cfg.feature_noise
        if noise is None:
            noise = 0.05 if self.method == "eagle" else 0.0
        self.noise = noise * feature_rms  # half-width of the uniform noise added to input features
        self.steps = unrolled_steps(cfg)

    def _logits_fn(self) -> "_Logits":
        if self.method == "eagle3":
            return _Logits(self.head.logits, self.head.lm_head.out_features)
        w = self.fz.lm_w
        return _Logits(lambda h: F.linear(h, w), w.shape[0])

    def _soft_labels(self, batch: dict, depth: int) -> tuple[Tensor, Tensor] | None:
        """--distill-topk: the target's top-k next tokens at chain i + depth as (ids in the head's
        logits space [B, n, K], probabilities [B, n, K] renormalized over the ids those logits
        cover: the draft vocabulary for EAGLE-3); None when training on the argmax alone."""
        if not self.cfg.distill_topk or "topk_ids" not in batch:
            return None
        ids = _shift(batch["topk_ids"], depth, 0)
        p = _shift(batch["topk_logp"], depth, float("-inf")).exp()
        if self.fz.t2d is not None:
            rows = self.fz.t2d[ids]
            p = torch.where(rows >= 0, p, torch.zeros_like(p))
            ids = rows.clamp_min(0)
        return ids, p / p.sum(-1, keepdim=True).clamp_min(1e-30)

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
                soft = self._soft_labels(batch, 1 + k)
                ce, hits, cnt = chunked_ce(outs[k], y, fn, soft=soft and (soft[0][sel], soft[1][sel]),
                                           soft_weight=self.cfg.soft_weight)
                total = total + self.cfg.step_decay ** k * ce / max(cnt, 1)
                stats[f"acc{k + 1}"] = hits / max(cnt, 1)
            return total, stats
        x = feats
        if self.noise:
            x = x + (torch.rand_like(x) * 2 - 1) * self.noise
        outs = unroll(self.head, x, batch["ids"], self.fz.embed, self.steps)
        align_k = self.cfg.align_topk
        aligned = ok                                              # --align-topk: chains still reachable
        for j, out in enumerate(outs):
            y = _labels(batch, 1 + j, aligned)
            keep = y != -100
            w = self.cfg.step_decay ** j
            soft = self._soft_labels(batch, 1 + j)
            soft = soft and (soft[0][keep], soft[1][keep])
            rank_k = align_k if j + 1 < len(outs) else 0
            if self.method == "eagle":
                tgt = _shift(feats, 1 + j, 0.0)                   # f_{i+1+j}
                reg = F.smooth_l1_loss(out[keep], tgt[keep], reduction="none").mean(-1).sum()
                ce, hits, cnt, *top = chunked_ce(out[keep], y[keep], fn, soft=soft,
                                                 soft_weight=self.cfg.soft_weight, rank_k=rank_k)
                total = total + w * (self.cfg.w_reg * reg + self.cfg.w_cls * ce) / max(cnt, 1)
                stats[f"reg{j + 1}"] = reg.item() / max(cnt, 1)
            else:
                ce, hits, cnt, *top = chunked_ce(out[keep], self._draft_labels(y[keep]), fn, soft=soft,
                                                 soft_weight=self.cfg.soft_weight, rank_k=rank_k)
                total = total + w * ce / max(cnt, 1)
            stats[f"acc{j + 1}"] = hits / max(cnt, 1)
            if top:  # step j + 1 trains only where the true token is among step j's top k drafts
                reach = torch.zeros_like(keep)
                reach[keep] = top[0]
                aligned = reach
                stats[f"aligned{j + 2}"] = float(reach.sum()) / max(int(ok.sum()), 1)
        return total, stats

    def _sampled_acceptance(self, out: Tensor, batch: dict, ok: Tensor, chain: Tensor, fn,
                            chunk: int = 1024) -> float:
        """Summed over the chains: the probability that the first draft, sampled from the head's
        distribution q (temperature 1), is accepted by rejection sampling against the target's p,
        sum_x min(p(x), q(x)) (= 1 - total variation), over the target's stored top-k tokens: a lower
        bound that misses only the mass beyond its top k. ``out``: the depth-1 outputs of the rows
        ``ok``; ``chain`` [rows]: the rows that count."""
        ids = _shift(batch["topk_ids"], 1, 0)[ok]
        p = _shift(batch["topk_logp"], 1, float("-inf")).exp()[ok]
        if self.fz.t2d is not None:
            ids = self.fz.t2d[ids]
            ids = torch.where(ids >= 0, ids, torch.full_like(ids, -1))
        total = 0.0
        for s in range(0, out.shape[0], chunk):
            rows = _sampled_acceptance_rows(fn(out[s:s + chunk]), ids[s:s + chunk], p[s:s + chunk])
            total += float(rows[chain[s:s + chunk]].sum())
        return total

    @torch.no_grad()
    def evaluate(self, batches: list[dict], device) -> dict:
        """Cumulative acceptance at depths 1..D on chains i >= P - 1 whose depth-D target exists
        (D = 3 for EAGLE, the number of heads for Medusa); per-depth top-1 over the same chains;
        mean CE per depth; Medusa: head_accuracy[k][r] = P(rank-r candidate of head k is a_{i+1+k})."""
        self.head.eval()
        depth = self.head.cfg.medusa_num_heads if self.method == "medusa" else EVAL_DEPTH
        fn = self._logits_fn()
        chains, soft_sum, soft_seen = 0, 0.0, False
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
            if self.method != "medusa" and "topk_ids" in batch:
                soft_sum += self._sampled_acceptance(outs[0], batch, ok, chain_sel, fn)
                soft_seen = True
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
        if soft_seen:
            res["sampled_acceptance1"] = soft_sum / max(chains, 1)
        # rank_accuracy[d][r]: P(the rank-r candidate at depth d is the target's token) (Medusa: head d)
        res["rank_accuracy"] = [[v / max(n, 1) for v in row] for row, n in zip(table, table_n)]
        return res


def _sampled_acceptance_rows(logits: Tensor, ids: Tensor, p: Tensor) -> Tensor:
    """sum_k min(p_k, q(ids_k)) per row: q = softmax(logits) [N, V], ids [N, K] rows of q (-1: not
    in q's vocabulary, q = 0), p [N, K] the target's probabilities of those tokens."""
    q = torch.softmax(logits.float(), -1).gather(1, ids.clamp_min(0))
    return torch.minimum(p, torch.where(ids >= 0, q, torch.zeros_like(q))).sum(-1)


def format_eval(ev: dict) -> str:
    acc = ", ".join(f"+{d + 1} {a:.3f}" for d, a in enumerate(ev["acceptance"]))
    ce = ", ".join(f"{c:.3f}" for c in ev["ce"])
    sampled = (f"; sampled acceptance +1 (T = 1) >= {ev['sampled_acceptance1']:.3f}"
               if "sampled_acceptance1" in ev else "")
    return (f"acceptance {acc} (mean accepted per chain {ev['mean_accepted']:.2f}, {ev['chains']} chains); "
            f"ce by depth {ce}{sampled}")

