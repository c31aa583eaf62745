"""What a draft head is (``HeadConfig``: stored as config.json next to its weights) and whether it
fits a target (``check_head_compatible``)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from torch import nn

from ..model.transformer import ModelConfig

METHODS = ("medusa", "eagle", "eagle3")


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head; stored as config.json next to the weights."""
    method: str                    # "medusa", "eagle" (EAGLE-1/2 feature head) or "eagle3"
    hidden_size: int
    vocab_size: int                # the target's vocabulary
    intermediate_size: int = 0     # eagle/eagle3 decoder layer
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    fc_bias: bool = True           # eagle: EAGLE-1/2 checkpoints have a bias on fc
    feature_layers: list[int] = field(default_factory=list)  # eagle3: target layers fused by fc
    draft_vocab_size: int = 0      # eagle3: its own LM head's size (0: the full vocabulary)
    medusa_num_heads: int = 0      # medusa: heads predicting tokens +1 .. +K after the root
    medusa_num_layers: int = 1     # medusa: residual blocks per head
    target: str = ""               # informational: what it was trained for

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} is not supported; choose one of {METHODS}")

    @classmethod
    def for_target(cls, method: str, cfg: ModelConfig, **kw) -> "HeadConfig":
        """A head shaped like one decoder layer of the target ``cfg``."""
        base = dict(method=method, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                    intermediate_size=cfg.intermediate_size, num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                    rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)
        if method == "eagle3" and "feature_layers" not in kw:
            n = cfg.num_layers  # EAGLE-3's choice: a low, a middle and a high layer
            kw["feature_layers"] = sorted({min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0)})
        if method == "medusa" and "medusa_num_heads" not in kw:
            kw["medusa_num_heads"] = 4
        base.update(kw)
        return cls(**base)

    def to_json(self) -> str:
        return json.dumps({"turbospec_head": asdict(self)}, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        d = d.get("turbospec_head", d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"head config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def model_config(self) -> ModelConfig:
        """The ModelConfig of the head's decoder layer (for RoPE)."""
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling)


def check_head_compatible(head: nn.Module, target_cfg: ModelConfig) -> None:
    """Raise ValueError listing every way ``head`` cannot draft for a target with ``target_cfg``:
    hidden size, vocabulary, EAGLE-3 feature layers beyond the target's layers, LM head shapes."""
    cfg: HeadConfig = head.cfg
    problems = []
    if cfg.hidden_size != target_cfg.hidden_size:
        problems.append(f"head hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"head vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if cfg.method == "eagle3":
        n = target_cfg.num_layers
        bad = [i for i in cfg.feature_layers if not 0 <= i < n]
        if bad:
            problems.append(f"EAGLE-3 feature layer(s) {bad} (of {list(cfg.feature_layers)}) outside the target's "
                            f"{n} layers [0, {n})")
        ids = head.draft_vocab_ids()
        if ids is not None and ids.numel() and int(ids.max()) >= target_cfg.vocab_size:
            problems.append(f"EAGLE-3 draft vocabulary maps to target id {int(ids.max())} >= target vocab_size "
                            f"{target_cfg.vocab_size}")
    if cfg.method == "medusa" and getattr(head, "lm_heads", None) is not None:
        for i, lin in enumerate(head.lm_heads):
            if tuple(lin.weight.shape) != (target_cfg.vocab_size, target_cfg.hidden_size):
                problems.append(f"Medusa head {i}'s LM head has shape {list(lin.weight.shape)}, expected "
                                f"[{target_cfg.vocab_size}, {target_cfg.hidden_size}] (target vocab_size, hidden_size)")
                break
    if problems:
        raise ValueError("; ".join(problems))
