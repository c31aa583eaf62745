"""The settings of a ``turbospec train`` run (``TrainConfig``), their checks, and the command-line
options that set them."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from dataclasses import dataclass, field

import torch

from .data import FEATURE_DTYPES
from ..heads.config import METHODS
from ..ops.checks import is_int

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA = os.path.join(_REPO_ROOT, "..", "shared", "data", "train_prompts.jsonl")
# tuned for short runs (a few hundred steps of 8 sequences) on SmolLM2-135M
DEFAULT_LR = {"medusa": 3e-3, "eagle": 2e-3, "eagle3": 2e-3}
EVAL_DEPTH = 3
TOPK_TABLE = 8
SCHEDULES = ("cosine", "linear", "constant", "wsd")
# the feature stage's target forward (--feature-matmuls): turbospec's kernels, or a bfloat16 copy of
# the target on torch matmuls (Transformer.use_torch_matmuls)
FEATURE_MATMULS = ("kernels", "torch-bf16")
DEFAULT_DRAFT_VOCAB = 8192  # eagle3: draft vocabulary of a fresh head
WSD_DECAY = 0.2  # wsd: the share of the schedule (after warmup) spent decaying to 0


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
    distill_data: str | None = None    # a .npz of stored samples: used, continued and written back
    gen_batch_size: int = 16
    gen_temperature: float = 0.0       # 0: greedy answers; > 0: sampled at this temperature
    gen_dtype: str | None = None       # None: dtype; else a dense copy of the target in it answers
    gen_engine: str = "reference"      # "batched": turbospec.Engine's scheduler answers (the fast path)
    gen_activations: str = "exact"     # batched: the engine's activations ("int8": the fastest on CPU)
    gen_drafter: str = "ngram"         # batched: the engine's drafter (greedy answers do not depend on it)
    extend_data: str | None = None     # a stored shorter generation whose answers this one continues
    no_generate: bool = False          # train on the answers stored so far; generate none
    mix_data: list[str] | None = None  # other stored generations (.npz) whose samples join the train split
    seed: int = 0
    dtype: str = "float32"             # the target's
    # stage 2
    eval_samples: int | None = None    # None: 5% of the samples, 1..64
    shard_tokens: int = 65536
    feature_dtype: str = "bfloat16"
    feature_batch_size: int = 8
    feature_matmuls: str = "kernels"
    train_samples: tuple[int, int | None] | None = None  # a slice [start, end) of the train split
    extra_features: list[str] | None = None  # finished feature folders whose train samples join
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
    init_head: str | None = None       # start from this head's weights (fine-tuning) instead of a fresh one
    loss_on_prompt: bool | None = None  # None: on for eagle / eagle3 (measured better), off for medusa
    step_decay: float = 0.8
    medusa_heads: int = 4
    medusa_layers: int = 1
    ttt_steps: int | None = None       # None: eagle 1, eagle3 3
    draft_vocab: int | None = None     # eagle3; None: DEFAULT_DRAFT_VOCAB for a fresh head, --init-head's own
    align_topk: int = 0                # > 0: unrolled steps train only where the true token was in the top k
    distill_topk: int = 0              # > 0: soft labels, the target's top-k distribution (0: its argmax)
    soft_weight: float = 1.0           # with distill_topk: weight of the soft loss (the rest: the argmax's)
    feature_layers: list[int] | None = None
    feature_noise: float | None = None  # None: eagle 0.05, else 0
    head_intermediate_size: int | None = None  # eagle/eagle3: the head's MLP width (None: the target's)
    w_reg: float = 1.0
    w_cls: float = 0.1
    device: str = "cpu"
    amp: str = "auto"                  # "auto" | "bfloat16" | "none": autocast of the head's math
    threads: int | None = None
    stop_after: str | None = None      # "generate" | "features"
    time_budget: float | None = None   # seconds for the whole run; the schedule ends at the deadline
    command: str = ""                  # recorded in the checkpoint
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.loss_on_prompt is None:
            # EAGLE heads read the true tokens at prompt positions too, so the target's argmax there
            # is a valid label: at 2,000 samples the loss on them gave held-out acceptance 0.416
            # against 0.381 without (bench/results/2026-11-29-head-width-prompt-loss.md)
            self.loss_on_prompt = self.method in ("eagle", "eagle3")


GEN_ENGINES = ("reference", "batched")


def gen_answerer(cfg: TrainConfig) -> dict | None:
    """What of --gen-engine batched changes its answers, for the generation's settings (None: the
    reference loop, whose keys stay as before): its activations and, when sampling, its drafter
    (greedy answers are the same with any drafter: speculation is exact)."""
    if cfg.gen_engine != "batched":
        return None
    out = {"engine": "batched", "activations": cfg.gen_activations}
    if cfg.gen_temperature > 0:
        out["drafter"] = cfg.gen_drafter
    return out


def answers_by_copy(cfg: TrainConfig) -> bool:
    """Does a copy of the target in --gen-dtype (not the --dtype target itself) answer the prompts?"""
    return cfg.gen_dtype is not None and cfg.gen_dtype != cfg.dtype


def check_config(cfg: TrainConfig) -> None:
    """Option checks that need no model; errors name the option and the value."""
    if cfg.method not in METHODS:
        raise ValueError(f"--method {cfg.method!r} is not supported; choose one of {', '.join(METHODS)}")
    ints = dict(num_prompts=(cfg.num_prompts, 0), max_new_tokens=(cfg.max_new_tokens, 1),
                max_prompt_tokens=(cfg.max_prompt_tokens, 1), gen_batch_size=(cfg.gen_batch_size, 1),
                shard_tokens=(cfg.shard_tokens, 1), feature_batch_size=(cfg.feature_batch_size, 1), epochs=(cfg.epochs, 1), batch_size=(cfg.batch_size, 1),
                eval_every=(cfg.eval_every, 0), save_every=(cfg.save_every, 0),
                medusa_heads=(cfg.medusa_heads, 1), medusa_layers=(cfg.medusa_layers, 1),
                distill_topk=(cfg.distill_topk, 0),
                align_topk=(cfg.align_topk, 0))
    if cfg.ttt_steps is not None:
        ints["ttt_steps"] = (cfg.ttt_steps, 1)
    if cfg.draft_vocab is not None:
        if cfg.method != "eagle3":
            raise ValueError(f"--draft-vocab {cfg.draft_vocab!r}: EAGLE-3 heads only (an EAGLE-1/2 or Medusa head "
                             f"uses the target's whole vocabulary)")
        ints["draft_vocab"] = (cfg.draft_vocab, 1)
    if cfg.head_intermediate_size is not None:
        if cfg.method == "medusa":
            raise ValueError(f"--head-intermediate-size {cfg.head_intermediate_size!r}: EAGLE heads only (a Medusa "
                             f"head's blocks are hidden x hidden)")
        if cfg.init_head:
            raise ValueError(f"--head-intermediate-size {cfg.head_intermediate_size!r} sizes a fresh head; "
                             f"--init-head keeps its own")
        ints["head_intermediate_size"] = (cfg.head_intermediate_size, 1)
    if cfg.eval_samples is not None:
        ints["eval_samples"] = (cfg.eval_samples, 0)
    if cfg.warmup_steps is not None:
        ints["warmup_steps"] = (cfg.warmup_steps, 0)
    for name, (v, lo) in ints.items():
        if not is_int(v) or v < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
    for name, v in (("lr", cfg.lr), ("grad_clip", cfg.grad_clip)):
        if v is not None and not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v!r}")
    if isinstance(cfg.soft_weight, bool) or not isinstance(cfg.soft_weight, (int, float)) \
            or not 0 <= cfg.soft_weight <= 1:
        raise ValueError(f"--soft-weight must be a number in [0, 1], got {cfg.soft_weight!r}")
    if cfg.soft_weight != 1.0 and not cfg.distill_topk:
        raise ValueError(f"--soft-weight {cfg.soft_weight!r} needs --distill-topk K > 0 (the soft labels it weighs)")
    for name, v in (("weight_decay", cfg.weight_decay), ("w_reg", cfg.w_reg), ("w_cls", cfg.w_cls),
                    ("feature_noise", cfg.feature_noise or 0.0)):
        if not v >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {v!r}")
    t = cfg.gen_temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2:
        raise ValueError(f"--gen-temperature must be a number in [0, 2] (0: greedy answers), got {t!r}")
    if not 0 < cfg.step_decay <= 1:
        raise ValueError(f"--step-decay must be in (0, 1], got {cfg.step_decay!r}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule {cfg.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if cfg.feature_matmuls not in FEATURE_MATMULS:
        raise ValueError(f"--feature-matmuls {cfg.feature_matmuls!r}: choose one of {', '.join(FEATURE_MATMULS)}")
    if cfg.feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"--feature-dtype {cfg.feature_dtype!r}: choose one of {list(FEATURE_DTYPES)}")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {cfg.dtype!r}: choose float32, bfloat16 or float16")
    if cfg.gen_dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"--gen-dtype {cfg.gen_dtype!r}: choose float32, bfloat16 or float16")
    if cfg.gen_engine not in GEN_ENGINES:
        raise ValueError(f"--gen-engine {cfg.gen_engine!r}: choose {' or '.join(GEN_ENGINES)}")
    if cfg.gen_activations not in ("exact", "int8"):
        raise ValueError(f"--gen-activations {cfg.gen_activations!r}: choose exact or int8")
    if cfg.gen_engine != "batched" and (cfg.gen_activations != "exact" or cfg.gen_drafter != "ngram"):
        raise ValueError(f"--gen-activations / --gen-drafter (got {cfg.gen_activations!r} / {cfg.gen_drafter!r}) "
                         f"set the batched engine's answers: they need --gen-engine batched")
    if cfg.extend_data and cfg.extend_data == cfg.distill_data:
        raise ValueError(f"--extend-data {cfg.extend_data!r} is also --distill-data: the longer generation is "
                         f"stored in a file of its own")
    if cfg.align_topk:
        steps = unrolled_steps(cfg)
        if cfg.method == "medusa" or steps < 2:
            raise ValueError(f"--align-topk {cfg.align_topk!r} masks the unrolled steps of an EAGLE head: it needs "
                             f"--method eagle or eagle3 with --ttt-steps >= 2 (here: --method {cfg.method}, "
                             f"{steps} step{'s' if steps != 1 else ''})")
    if cfg.loss_on_prompt and cfg.method == "medusa":
        raise ValueError("--loss-on-prompt is for eagle / eagle3 only: a Medusa head reads one feature and "
                         "would learn the user's text, not the target's own continuation")
    if cfg.amp not in ("auto", "bfloat16", "none"):
        raise ValueError(f"--amp {cfg.amp!r}: choose auto, bfloat16 or none")
    if cfg.time_budget is not None and not (isinstance(cfg.time_budget, (int, float)) and cfg.time_budget > 0):
        raise ValueError(f"--time-budget must be a number of seconds > 0, got {cfg.time_budget!r}")
    if cfg.stop_after not in (None, "generate", "features"):
        raise ValueError(f"--stop-after {cfg.stop_after!r}: choose generate or features")
    if cfg.train_samples is not None:
        a, b = cfg.train_samples
        if not is_int(a) or a < 0 or (b is not None and (not is_int(b) or b <= a)):
            raise ValueError(f"--train-samples {cfg.train_samples!r}: expected START:END with 0 <= START < END "
                             f"(END may be left out)")
    extra = [os.path.realpath(d) for d in cfg.extra_features or []]
    if len(set(extra)) != len(extra):
        raise ValueError(f"--extra-features {cfg.extra_features!r}: a folder is given twice")
    for d in cfg.extra_features or []:
        if not os.path.isfile(os.path.join(d, "manifest.json")):
            raise ValueError(f"--extra-features {d!r} is not a feature folder (no manifest.json in it)")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device!r}: CUDA is not available on this machine")


def unrolled_steps(cfg: TrainConfig) -> int:
    """The EAGLE training-time-test steps: --ttt-steps, else eagle3 3, eagle 1."""
    return cfg.ttt_steps if cfg.ttt_steps is not None else (3 if cfg.method == "eagle3" else 1)


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
    g.add_argument("--gen-temperature", type=float, default=0.0,
                   help="0 (default): the target answers greedily; > 0: its answers are sampled at this "
                        "temperature (each prompt's own seeded generator: a resumed run draws the same "
                        "way), a generation of its own; the training labels stay the target's argmax")
    g.add_argument("--distill-data", default=None,
                   help="a .npz of stored self-distillation samples (token ids; settings and provenance "
                        "in the .json beside it): samples of the same settings are used, generation "
                        "continues after them, and the result is written back there")
    g.add_argument("--gen-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="answer the prompts with a dense copy of the target in this dtype (default: "
                        "--dtype, the target itself); bfloat16 is the fast path on CPUs with AVX512-BF16. "
                        "Features and labels still come from the --dtype target")
    g.add_argument("--gen-engine", default="reference", choices=list(GEN_ENGINES),
                   help="reference (default): the model's layer loop over left-padded batches; batched: "
                        "turbospec's own serving scheduler (continuous batching of --gen-batch-size requests, "
                        "speculation, --gen-activations), the fast path on CPU")
    g.add_argument("--gen-activations", default="exact", choices=["exact", "int8"],
                   help="with --gen-engine batched: the engine's activations (int8: integer dot products on "
                        "the GGUF blocks, the fastest on CPU; the labels still come from the --dtype target)")
    g.add_argument("--gen-drafter", default="ngram",
                   help="with --gen-engine batched: the engine's drafter (default ngram; greedy answers are the "
                        "same with any, sampled ones follow the same distribution)")
    g.add_argument("--extend-data", default=None, metavar="NPZ",
                   help="a stored generation (.npz) of the same prompts and settings with a smaller "
                        "--max-new-tokens: its answers ended by EOS are kept, those cut at its limit are "
                        "continued to --max-new-tokens (store the result with --distill-data, another file)")
    g.add_argument("--no-generate", action="store_true",
                   help="use only the answers already stored (a generation stopped by its time budget), "
                        "generate none: features and training on those")
    g.add_argument("--mix-data", action="append", default=None, metavar="NPZ",
                   help="(repeatable) another stored generation (a --distill-data .npz: sampled answers, "
                        "answers to other prompts) whose samples join the train split; the held-out "
                        "split stays this run's, and mixed samples whose prompt is held out are dropped")
    g.add_argument("--seed", type=int, default=0, help="prompt sampling, split, init and batch order")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype for generation and features")
    g = p.add_argument_group("stage 2: features")
    g.add_argument("--eval-samples", type=int, default=None,
                   help="held-out samples for eval (default: 5%% of the samples, 1..64)")
    g.add_argument("--shard-tokens", type=int, default=65536, help="tokens per feature shard (bounds memory)")
    g.add_argument("--feature-dtype", default="bfloat16", choices=list(FEATURE_DTYPES))
    g.add_argument("--feature-batch-size", type=int, default=8,
                   help="samples per target forward when extracting features (similar lengths together; "
                        "on CPU the features are the same bits as one sample at a time)")
    g.add_argument("--feature-matmuls", default="kernels", choices=list(FEATURE_MATMULS),
                   help="the feature stage's target forward: kernels (turbospec's, the engine's bits), or "
                        "torch-bf16: a bfloat16 copy of the target computing with torch matmuls and SDPA "
                        "over whole sequences (oneDNN's AMX tiles where the CPU has them: ~4x the features "
                        "per second on a Sapphire Rapids; not the float32 target's bits)")
    g.add_argument("--extra-features", action="append", default=None, metavar="DIR",
                   help="(repeatable) a finished feature folder (<work>/feat-<key>) of another run of the "
                        "same target and feature layers, e.g. other answers extracted before: its train "
                        "samples join this run's, without recomputing them; its first sample is recomputed "
                        "to check the target; the held-out split stays this run's")
    g.add_argument("--train-samples", default=None, metavar="START:END",
                   help="extract features for and train on only samples START..END-1 of the train split "
                        "(the held-out split is unchanged; END may be left out): continue a head "
                        "(--init-head) on samples it has not seen")
    g = p.add_argument_group("stage 3: training")
    g.add_argument("--epochs", type=int, default=1)
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: medusa 3e-3, eagle 2e-3, eagle3 2e-3)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step (padded)")
    g.add_argument("--schedule", default="cosine", choices=list(SCHEDULES),
                   help="decay after the linear warmup (wsd: constant, then a linear decay to 0 over the "
                        "last 20%% of the schedule)")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: 3%% of the steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=0.5, help="max gradient norm")
    g.add_argument("--eval-every", type=int, default=200,
                   help="steps between held-out evals (0: only at the start and the end)")
    g.add_argument("--save-every", type=int, default=500,
                   help="steps between checkpoints (also after each eval)")
    g.add_argument("--resume", action="store_true",
                   help="continue the saved training state of the same settings")
    g.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this head's weights (fine-tuning: new data for a trained head); its method "
                        "must be --method, its draft vocabulary and feature layers are kept")
    g.add_argument("--loss-on-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help="eagle/eagle3: also train on prompt positions (the head reads the true tokens there, "
                        "so the target's argmax is a valid target). Default: on for eagle / eagle3 (measured: "
                        "held-out acceptance 0.416 vs 0.381 at 2,000 samples), off for medusa; "
                        "--no-loss-on-prompt: only the response, where drafting happens")
    g.add_argument("--step-decay", type=float, default=0.8,
                   help="loss weight decay^j of Medusa head j / unrolled step j")
    g.add_argument("--medusa-heads", type=int, default=4)
    g.add_argument("--medusa-layers", type=int, default=1, help="residual blocks per Medusa head")
    g.add_argument("--ttt-steps", type=int, default=None,
                   help="EAGLE unrolled (training-time test) steps (default: eagle3 3, eagle 1)")
    g.add_argument("--align-topk", type=int, default=0, metavar="K",
                   help="eagle/eagle3 with unrolled steps: train step j only on chains whose true tokens "
                        "were among the head's top K drafts at every earlier step (GRIFFIN's "
                        "token-alignable training); 0 (default): every chain")
    g.add_argument("--draft-vocab", type=int, default=None,
                   help=f"eagle3: draft vocabulary size, the most frequent response tokens of the training "
                        f"samples (default: {DEFAULT_DRAFT_VOCAB} for a fresh head; with --init-head, that "
                        f"head's own; a larger size keeps the head's tokens and their rows and adds the most "
                        f"frequent others, a smaller one keeps the most frequent of its tokens)")
    g.add_argument("--distill-topk", type=int, default=0, metavar="K",
                   help="train against the target's own next-token distribution (its top K tokens, "
                        "stored with the features) instead of its argmax alone; 0 (default): the argmax")
    g.add_argument("--soft-weight", type=float, default=1.0, metavar="W",
                   help="with --distill-topk: loss = W x soft + (1 - W) x argmax cross-entropy (default 1)")
    g.add_argument("--feature-layers", default=None,
                   help="eagle3: comma list of 0-based target layers fc fuses (default: low, middle, high)")
    g.add_argument("--feature-noise", type=float, default=None,
                   help="EAGLE input-feature noise U(-a, a) * feature RMS (default: eagle 0.05, eagle3 0)")
    g.add_argument("--head-intermediate-size", type=int, default=None, metavar="N",
                   help="eagle/eagle3: the width of the head's MLP (default: the target's intermediate size)")
    g.add_argument("--w-reg", type=float, default=1.0, help="eagle: smooth-L1 feature loss weight")
    g.add_argument("--w-cls", type=float, default=0.1, help="eagle: token cross-entropy weight")
    g = p.add_argument_group("run")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--amp", default="auto", choices=["auto", "bfloat16", "none"],
                   help="bfloat16 autocast for the head's training math (auto: where bfloat16 matmuls "
                        "are fast: CUDA, CPUs with AVX512-BF16/AMX)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run: generation stops by 45%% of it and features by 70%% "
                        "(--resume continues them), training gets what is left, its learning-rate "
                        "schedule running on time as well as steps "
                        "(whichever is further along) and ends at the deadline with the final eval "
                        "and head; --resume continues the decay where it stopped")
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
    span = None
    if args.train_samples:
        a, sep, b = args.train_samples.partition(":")
        try:
            span = (int(a), int(b) if b.strip() else None)
        except ValueError:
            raise ValueError(f"--train-samples {args.train_samples!r}: expected START:END, two integers") from None
        if not sep:
            raise ValueError(f"--train-samples {args.train_samples!r}: expected START:END (a colon between)")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(feature_layers=layers, train_samples=span,
              command=shlex.join(["turbospec", *(sys.argv[1:] if argv is None else argv)]))
    return TrainConfig(**kw)
