"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3): the modules (``EagleHead``); drafting with them is
``drafters.eagle``.

EAGLE drafts at the feature level. For every committed position i the target leaves a feature f_i
(EAGLE-1/2: the final-normed hidden state the LM head reads; EAGLE-3: the outputs of a low, a middle
and a high layer, fused by ``fc``). The head reads the pair (f_i, embed(x_{i+1})) at position i and
predicts f_{i+1}; the target's LM head (EAGLE-1/2) or the head's own (EAGLE-3) turns that into the
distribution of x_{i+2}. Drafting further feeds the head its own prediction in place of f.

Layouts (parameter names are those of the public checkpoints):
- "eagle": ``fc`` (2H -> H, bias) over cat(embed, feature), then ``layers.0`` = a Llama decoder layer
  without its input norm. Logits: the target's LM head on the output.
- "eagle3": ``fc`` (kH -> H) fuses the k target features; ``midlayer`` = a decoder layer whose
  attention reads cat(input_layernorm(embed), hidden_norm(hidden)) (2H); ``norm`` + ``lm_head`` over a
  draft vocabulary (``d2t``: draft id -> target id offset, ``t2d``: target ids in the draft vocab).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from .config import HeadConfig
from ..model.kv_cache import KVCache
from ..model.transformer import Linear
from ..ops import eagle_input, eagle_output, has_op
from .layers import MLP, Attention, RMSNorm, Rotary
from ..ops.lockstep import Rows, compute


class EagleLayer(nn.Module):
    """The head's decoder layer. ``EagleHead.forward_steps`` runs it in three parts: the row-wise
    input side (norms, q/k/v projections), the attention over the head's cache, and the row-wise
    output side (o_proj, residual, MLP)."""

    def __init__(self, cfg: HeadConfig, eagle3: bool):
        super().__init__()
        h = cfg.hidden_size
        self.eagle3 = eagle3
        self.self_attn = Attention(cfg, 2 * h if eagle3 else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)

    def qkv(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.eagle3:
            x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        else:
            x = hidden  # EAGLE-1/2: fc already mixed the embedding in; no input norm
        return self.self_attn.project(x)

    def out(self, attended: Tensor, hidden: Tensor) -> Tensor:
        h = hidden + self.self_attn.o_proj(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """One EAGLE head; ``cfg.method`` is "eagle" (EAGLE-1/2) or "eagle3"."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.method not in ("eagle", "eagle3"):
            raise ValueError(f"EagleHead: method must be 'eagle' or 'eagle3', got {cfg.method!r}")
        self.cfg = cfg
        h = cfg.hidden_size
        self.eagle3 = cfg.method == "eagle3"
        if self.eagle3:
            if not cfg.feature_layers:
                raise ValueError("eagle3 head config needs feature_layers (the target layers fc fuses)")
            self.fc = nn.Linear(len(cfg.feature_layers) * h, h, bias=False)
            self.midlayer = EagleLayer(cfg, eagle3=True)
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            dv = cfg.draft_vocab_size or cfg.vocab_size
            self.lm_head = nn.Linear(h, dv, bias=False)
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
            self.t2d[:dv] = True  # identity map until a draft vocabulary is set
        else:
            self.fc = nn.Linear(2 * h, h, bias=cfg.fc_bias)
            self.layers = nn.ModuleList([EagleLayer(cfg, eagle3=False)])
        self.rotary = Rotary(cfg)

    @property
    def layer(self) -> EagleLayer:
        return self.midlayer if self.eagle3 else self.layers[0]

    @property
    def feature_spec(self):
        """What the target must return (``Transformer.forward(features=...)``)."""
        return tuple(self.cfg.feature_layers) if self.eagle3 else "final"

    def set_draft_vocab(self, ids: Tensor) -> None:
        """EAGLE-3: the target ids [draft_vocab_size] (ascending) its LM head rows stand for."""
        ids = ids.to(torch.int64)
        if ids.numel() != self.d2t.numel():
            raise ValueError(f"draft vocab has {ids.numel()} ids, the head's lm_head has {self.d2t.numel()} rows")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def with_draft_vocab(self, ids: Tensor) -> "EagleHead":
        """EAGLE-3: a copy of this head over the draft vocabulary ``ids`` (target ids, ascending; any
        size): every weight but the LM head's is copied; an LM-head row of a token in both vocabularies
        is copied bit for bit (so those tokens' logits are unchanged up to the GEMM's rounding); a new token's row starts as the mean of the
        old rows (a typical, low logit: drafting ranks the new tokens below the likely old ones until
        training has learnt them). ``extra`` is carried over."""
        if not self.eagle3:
            raise ValueError("with_draft_vocab: an EAGLE-3 head's draft vocabulary (EAGLE-1/2 heads use the "
                             "target's LM head)")
        ids = torch.as_tensor(ids, dtype=torch.int64).cpu()
        v = self.cfg.vocab_size
        if ids.dim() != 1 or ids.numel() < 1 or not bool((ids[1:] > ids[:-1]).all()) or \
                int(ids[0]) < 0 or int(ids[-1]) >= v:
            raise ValueError(f"with_draft_vocab: ids must be distinct ascending target ids in [0, {v}), got "
                             f"{ids.numel()} ids")
        new = EagleHead(dataclasses.replace(self.cfg, draft_vocab_size=ids.numel())).to(self.fc.weight.dtype)
        state = {k: t for k, t in self.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
        missing, unexpected = new.load_state_dict(state, strict=False)
        assert sorted(missing) == ["d2t", "lm_head.weight", "t2d"] and not unexpected, (missing, unexpected)
        new.set_draft_vocab(ids)
        old_w = self.lm_head.weight.detach().cpu()
        old_row = torch.full((v,), -1, dtype=torch.int64)
        old_row[self.draft_vocab_ids().cpu()] = torch.arange(old_w.shape[0])
        rows = old_row[ids]
        with torch.no_grad():
            w = old_w.mean(0, keepdim=True).repeat(ids.numel(), 1)
            kept = rows >= 0
            w[kept] = old_w[rows[kept]]
            new.lm_head.weight.copy_(w)
        new.extra = dict(getattr(self, "extra", {}))
        return new.to(self.fc.weight.device)

    def draft_vocab_ids(self) -> Tensor | None:
        """EAGLE-3: target id of each draft-vocab row; None for EAGLE-1/2 (the drafter decides)."""
        if not self.eagle3:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def forward(self, hidden: Tensor, embeds: Tensor, position_ids: Tensor, kv: KVCache | None = None,
                cache_len: int = 0, mask: Tensor | None = None, fused: bool = False) -> Tensor:
        """One pass over n pairs -> the head's output [B, n, H] (the predicted next feature).

        hidden: the target features [B, n, F] (eagle: F = H; eagle3: F = k*H, fused by fc), or with
            ``fused=True`` the head's own earlier outputs [B, n, H] (drafting deeper; eagle3 skips fc).
        embeds: the target's embedding of the token after each position [B, n, H].
        kv / cache_len / mask: see ``heads.Attention`` (None: causal over these n only, training).
        """
        return compute(self.forward_steps(hidden, embeds, position_ids, kv, cache_len, mask, fused))

    def forward_steps(self, hidden: Tensor, embeds: Tensor, position_ids: Tensor, kv: KVCache | None = None,
                      cache_len: int = 0, mask: Tensor | None = None, fused: bool = False):
        """``forward`` as a generator of its two row-wise parts (``lockstep.Rows``: every projection
        and the MLP), so that a batch of drafters computes them in one call each
        (``lockstep.drive``); only the attention over each request's own cache runs per request."""
        b, n, h = embeds.shape
        a = self.layer.self_attn
        cos, sin = self.rotary(position_ids, embeds.dtype)
        rows = torch.cat((hidden, embeds), dim=-1).reshape(b * n, -1)
        pre = (yield Rows(self._input_fused if fused else self._input, rows)).view(b, n, -1)
        g, q, k, v = pre.split([h, a.nh * a.d, a.nkv * a.d, a.nkv * a.d], dim=-1)
        attended = a.attend(q, k, v, cos, sin, kv, cache_len, mask)
        out = yield Rows(self._output, torch.cat((attended, g), dim=-1).reshape(b * n, -1))
        return out.view(b, n, h)

    def bind_row_kernels(self) -> bool:
        """For a drafting copy (``drafters.tree.inference_copy``) in float32 on CPU whose linears all run
        on turbospec's kernels: ``_input`` / ``_output`` become one turbospec op each
        (``ops.eagle_input`` / ``ops.eagle_output``, the same operations in the same order: the same
        bits) instead of ~8 ATen calls each. Returns whether they did."""
        layer = self.layer
        a, mlp = layer.self_attn, layer.mlp

        def fast(mod):  # the turbospec Linear a drafting copy's nn.Linear runs (or a fused one)
            lin = mod if isinstance(mod, Linear) else getattr(getattr(mod, "forward", None), "__self__", None)
            return lin if isinstance(lin, Linear) and lin.kernel else None

        lins = [fast(m) for m in (self.fc, a.qkv_fused, a.o_proj, mlp.gate_up_fused, mlp.down_proj)]
        norms = [layer.post_attention_layernorm] + ([layer.input_layernorm, layer.hidden_norm] if self.eagle3 else [])
        if any(lin is None for lin in lins) or self.fc.weight.dtype != torch.float32 \
                or any(n.weight.dtype != torch.float32 or n.eps != self.cfg.rms_norm_eps for n in norms) \
                or not (has_op("eagle_input") and has_op("eagle_output")):
            self._row_kernels = None
            return False
        spec = [(lin.weights, lin.formats, lin.activations) for lin in lins]
        self._row_kernels = dict(
            input=spec[:2], input_fused=[([], [], 0), spec[1]], output=spec[2:], fc_bias=lins[0].bias,
            norms=[n.weight.detach() for n in norms[1:]], norm=layer.post_attention_layernorm.weight.detach())
        return True

    _row_kernels: dict | None = None

    def _input(self, rows: Tensor, fused: bool = False) -> Tensor:
        """rows [N, F + H] (features, embedding) -> [N, H + q + k + v]: the layer's hidden input
        g (eagle3: fc(features), or the features themselves when ``fused``) and its projections."""
        h = self.cfg.hidden_size
        if self._row_kernels is not None:
            k = self._row_kernels
            mode = (2 if fused else 1) if self.eagle3 else 0
            return eagle_input(rows, k["input_fused"] if mode == 2 else k["input"], k["fc_bias"], k["norms"], h,
                               self.cfg.rms_norm_eps, mode)
        hidden, embeds = rows.split([rows.shape[-1] - h, h], dim=-1)
        if self.eagle3:
            g = hidden if fused else self.fc(hidden)
        else:
            g = self.fc(torch.cat((embeds, hidden), dim=-1))
        return torch.cat((g, *self.layer.qkv(embeds, g)), dim=-1)

    def _input_fused(self, rows: Tensor) -> Tensor:
        return self._input(rows, fused=True)

    def _output(self, rows: Tensor) -> Tensor:
        """rows [N, nh * d + H] (attention output, g) -> the head's output [N, H]."""
        h = self.cfg.hidden_size
        if self._row_kernels is not None:
            k = self._row_kernels
            return eagle_output(rows, k["output"], k["norm"], self.cfg.rms_norm_eps)
        attended, g = rows.split([rows.shape[-1] - h, h], dim=-1)
        return self.layer.out(attended, g)

    def logits(self, out: Tensor) -> Tensor:
        """EAGLE-3 only: draft-vocab logits of the head's output (EAGLE-1/2 use the target's LM head)."""
        return self.lm_head(self.norm(out))
