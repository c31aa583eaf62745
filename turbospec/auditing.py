"""``turbospec audit``: check that speculative decoding is lossless for a model, drafter, dtype and
sampling settings, the way a user would want it checked.

Greedy: every prompt is decoded plainly and with speculation by the same engine parts; the tokens
must be identical. The first divergence is reported with its prompt, position, both tokens and the
target's logits of both at that position (recomputed on the plain prefix).

Sampling: speculation may change which tokens a given seed gives (the coins are used differently),
never their distribution. ``samples`` seeded runs of the first ``k`` tokens of one prompt with
speculation and as many without are compared per position by a chi-square test of homogeneity
(categories with fewer than 5 pooled counts merged), with the total-variation distance between the
two samples (a bootstrap 95% interval of that plug-in estimate, and for scale its 95th percentile
when both samples come from one distribution, by label permutations: finite samples of identical
distributions are some distance apart).
The sample size is chosen so that a total-variation difference of ``detect_tv`` is detected with
probability ``power`` at level ``alpha`` (Bonferroni over the positions), from the noncentral
chi-square bound lambda >= 2 n tv^2. A negative control runs in the same audit: the same drafter
with a deliberately biased acceptance rule (every draft token the target gives non-zero
probability is accepted: coins of the acceptance tests set to 0); the test must reject it, else the
audit has shown nothing (no drafts in the sampled steps, or too few samples) and fails.

    report = turbospec.audit("default", drafter="ngram")    # (this module: turbospec.auditing)
    print(report.table()); assert report.ok
"""
from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import ops
from .decode.engine import Engine

#: built-in greedy prompts (chat template applied): one per kind of request people send
GREEDY_PROMPTS = [
    "Summarize in two sentences: The city council voted on Tuesday to expand the bike lane network, "
    "citing a rise in cycling commuters and fewer traffic injuries on streets that already have lanes.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "What is 17 times 23? Explain step by step.",
    "Give me three tips for writing clear emails.",
    "Continue the story: The lighthouse keeper found a letter in a bottle that was addressed to him.",
]
#: the sampled prompt (no chat template): its last word occurs earlier, so prompt lookup drafts from
#: the first step on (a head drafts anyway), and what follows is uncertain (SmolLM2 at T = 1: no token
#: above 16%), so that rejections and the residual distribution are exercised, and a biased rule shows
SAMPLING_PROMPT = "The dog ran. The cat sat. The bird flew. The fish swam. The"


@dataclass
class Divergence:
    prompt_index: int
    prompt: str
    position: int          # index in the generated tokens
    plain_token: int
    spec_token: int
    plain_logit: float     # the target's logit of each token at that position (on the plain prefix)
    spec_logit: float


@dataclass
class GreedyResult:
    prompts: int
    tokens_compared: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences


@dataclass
class PositionTest:
    position: int
    categories: int        # after merging rare tokens
    chi2: float
    df: int
    p_value: float
    tv: float              # total variation between the two samples
    tv_ci: tuple[float, float]
    tv_null_p95: float     # 95th percentile of the sample TV under the null (label permutations)


@dataclass
class SamplingResult:
    prompt: str
    k: int
    samples: int           # per arm
    temperature: float
    top_k: int
    top_p: float
    alpha: float
    detect_tv: float
    power: float
    draft_tokens_proposed: int     # by the speculative arm over all its runs (drafts really took part)
    draft_tokens_accepted: int
    positions: list[PositionTest] = field(default_factory=list)
    control: list[PositionTest] = field(default_factory=list)

    @property
    def level(self) -> float:
        return self.alpha / self.k  # Bonferroni over the positions

    @property
    def rejected(self) -> bool:
        return any(t.p_value < self.level for t in self.positions)

    @property
    def control_rejected(self) -> bool:
        return any(t.p_value < self.level for t in self.control)

    @property
    def ok(self) -> bool:
        return not self.rejected and self.control_rejected


@dataclass
class AuditReport:
    model: str
    drafter: str
    dtype: str
    greedy: GreedyResult | None
    sampling: SamplingResult | None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.greedy is None or self.greedy.ok) and (self.sampling is None or self.sampling.ok)

    def table(self) -> str:
        """The report as text (what ``turbospec audit`` prints)."""
        lines = [f"turbospec audit: model {self.model}, drafter {self.drafter}, dtype {self.dtype} "
                 f"({self.seconds:.0f} s)"]
        g = self.greedy
        if g is not None:
            lines.append(f"greedy: {g.prompts} prompts, {g.tokens_compared} tokens compared: "
                         + ("identical to plain decoding" if g.ok else f"{len(g.divergences)} prompt(s) DIVERGE"))
            for d in g.divergences:
                lines.append(f"  prompt {d.prompt_index} ({d.prompt[:40]!r}...): first divergence at token "
                             f"{d.position}: plain {d.plain_token} (logit {d.plain_logit:.4f}) vs speculative "
                             f"{d.spec_token} (logit {d.spec_logit:.4f})")
        s = self.sampling
        if s is not None:
            lines.append(f"sampling: first {s.k} tokens of {s.prompt[:40]!r}..., T={s.temperature} top_k={s.top_k} "
                         f"top_p={s.top_p}; {s.samples} seeded runs per arm (detects TV >= {s.detect_tv} with "
                         f"power >= {s.power} at alpha {s.alpha}, per position {s.level:.4g}, for up to 20 categories); "
                         f"drafts proposed "
                         f"{s.draft_tokens_proposed}, accepted {s.draft_tokens_accepted}")
            lines.append("  arm                 pos  cats  chi2      df  p-value    TV      TV 95% CI        "
                         "null TV p95  verdict")
            for name, tests in (("speculative vs plain", s.positions), ("biased control", s.control)):
                for t in tests:
                    verdict = "reject" if t.p_value < s.level else "pass"
                    lines.append(f"  {name:20s}{t.position:3d}  {t.categories:4d}  {t.chi2:8.2f}  {t.df:3d}  "
                                 f"{t.p_value:9.3g}  {t.tv:.4f}  [{t.tv_ci[0]:.4f}, {t.tv_ci[1]:.4f}]  "
                                 f"{t.tv_null_p95:.4f}       {verdict}")
            if not s.control_rejected:
                lines.append("  the biased control was NOT rejected: this run cannot tell a biased rule from a "
                             "correct one (no drafts in the sampled steps, or too few samples)")
        lines.append("RESULT: " + ("PASS (lossless)" if self.ok else "FAIL"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        from dataclasses import asdict
        return {**asdict(self), "ok": self.ok}


# ------------------------------------------------------------------------------------------------
def samples_for_power(detect_tv: float, power: float, alpha: float, categories: int) -> int:
    """Runs per arm so that a chi-square homogeneity test with ``categories`` categories at level
    ``alpha`` rejects two distributions ``detect_tv`` apart with probability >= ``power``: the
    test's noncentrality is n * sum (p - q)^2 / (p + q) >= 2 n tv^2 (Cauchy-Schwarz)."""
    from scipy.stats import chi2, ncx2
    df = max(1, categories - 1)
    crit = chi2.ppf(1 - alpha, df)
    n = 10
    while ncx2.sf(crit, df, 2 * n * detect_tv ** 2) < power:
        n = int(n * 1.1) + 1
    return n


def compare(a: list[int], b: list[int], position: int, rng: random.Random, resamples: int = 300) -> PositionTest:
    """Chi-square homogeneity test and total-variation distance of two samples of tokens."""
    from scipy.stats import chi2
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    tokens = sorted(set(ca) | set(cb), key=lambda t: -(ca[t] + cb[t]))
    rows, other = [], [0, 0]
    for t in tokens:  # expected counts >= 5 per cell (equal arms): pool rare tokens into one category
        if ca[t] + cb[t] >= 10:
            rows.append((ca[t], cb[t]))
        else:
            other[0] += ca[t]
            other[1] += cb[t]
    if sum(other):
        rows.append(tuple(other))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = max(len(rows) - 1, 0)
    p = float(chi2.sf(stat, df)) if df else 1.0

    def tv(x: list[int], y: list[int]) -> float:
        cx, cy = Counter(x), Counter(y)
        return 0.5 * sum(abs(cx[t] / len(x) - cy[t] / len(y)) for t in set(cx) | set(cy))

    boots = sorted(tv(rng.choices(a, k=na), rng.choices(b, k=nb)) for _ in range(resamples))
    pooled = a + b
    null = []
    for _ in range(resamples):
        rng.shuffle(pooled)
        null.append(tv(pooled[:na], pooled[na:]))
    null.sort()
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return PositionTest(position, len(rows), float(stat), df, p, tv(a, b), (q(boots, 0.025), q(boots, 0.975)),
                        q(null, 0.95))


@contextmanager
def biased_acceptance():
    """The negative control: while active, every ``verify`` call gets acceptance coins of 0, so a
    draft token is accepted whenever the target gives it non-zero probability (the bonus /
    recovered token's coin, ``uniform[:, 0]``, is left alone). Deliberately wrong; audit only."""
    real = ops.verify

    def biased(logits, parents, draft_token_ids, draft_probs, uniform, *args, **kw):
        uniform = uniform.clone()
        uniform[:, 1:] = 0.0
        return real(logits, parents, draft_token_ids, draft_probs, uniform, *args, **kw)

    ops.verify = biased
    try:
        yield
    finally:
        ops.verify = real


def load_prompts(path: str) -> list:
    """Prompts from a file: .jsonl (a "prompt" / "text" field, or Spec-Bench's "turns": the first
    turn) or plain text (one prompt per non-empty line)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts: no such file {path!r}")
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            if path.endswith(".jsonl"):
                row = json.loads(line)
                p = row.get("prompt") or row.get("text") or (row.get("turns") or [None])[0]
                if not isinstance(p, str) or not p:
                    raise ValueError(f"prompts: line {i + 1} of {path} has no 'prompt', 'text' or 'turns'")
                out.append(p)
            else:
                out.append(line)
    if not out:
        raise ValueError(f"prompts: {path} holds no prompt")
    return out


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def audit(model="default", drafter: str = "auto", dtype: str = "float32", *, prompts=None,
          max_new_tokens: int = 64, greedy: bool = True, sampling: bool = True, sampling_prompt: str | None = None,
          k: int = 2, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, samples: int | None = None,
          detect_tv: float = 0.15, power: float = 0.9, alpha: float = 0.01, seed: int = 0, num_draft: int | None = None,
          head=None, draft_model=None, max_seq_len: int = 4096, log=None, settings: dict | None = None,
          tokenizer=None, engine_options: dict | None = None) -> AuditReport:
    """Check that speculative decoding with ``drafter`` is lossless for ``model`` (see the module
    docstring). ``prompts``: greedy prompts (list, or a .jsonl / .txt path; default: a built-in
    sample); ``samples``: runs per arm (default: enough for ``detect_tv`` at ``power``).
    ``settings``: more of ``Engine.generate``'s settings for both arms, greedy and sampled (e.g.
    penalties, ``min_p``, ``logit_bias``, ``grammar``); ``tokenizer``: for a model given in memory;
    ``engine_options``: more ``Engine`` options for the speculative engine (``weights``,
    ``activations``, ``device``, ``cuda_graphs``, ``adaptive``, ``prefix_cache``, ``draft_activations``,
    ``draft_weights``, ...); the plain engine runs on the same loaded target."""
    _check("max_new_tokens", max_new_tokens, isinstance(max_new_tokens, int) and max_new_tokens >= 1, "an integer >= 1")
    _check("k", k, isinstance(k, int) and 2 <= k <= 16, "an integer in [2, 16] (tokens sampled per run)")
    _check("temperature", temperature, isinstance(temperature, (int, float)) and temperature > 0,
           "> 0 (sampling is audited; greedy has its own check)")
    _check("top_k", top_k, isinstance(top_k, int) and top_k >= 0, "an integer >= 0")
    _check("top_p", top_p, isinstance(top_p, (int, float)) and 0 < top_p <= 1, "in (0, 1]")
    _check("detect_tv", detect_tv, isinstance(detect_tv, (int, float)) and 0 < detect_tv < 1, "in (0, 1)")
    _check("power", power, isinstance(power, (int, float)) and 0 < power < 1, "in (0, 1)")
    _check("alpha", alpha, isinstance(alpha, (int, float)) and 0 < alpha < 0.5, "in (0, 0.5)")
    _check("samples", samples, samples is None or (isinstance(samples, int) and samples >= 20),
           "None (chosen for the power) or an integer >= 20")
    _check("drafter", drafter, drafter != "none", "a drafter to audit (not 'none': that is the plain arm)")
    if not (greedy or sampling):
        raise ValueError("nothing to audit: greedy and sampling are both off")
    if isinstance(prompts, str):
        prompts = load_prompts(prompts)
    prompts = list(GREEDY_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    settings = dict(settings or {})
    for name in settings:
        if name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "chat", "prompt"):
            raise ValueError(f"settings: {name!r} is the audit's own argument, not a setting")
    opts = dict(engine_options or {})
    for name in opts:
        if name in ("drafter", "dtype", "num_draft", "head", "draft_model", "max_seq_len", "tokenizer"):
            raise ValueError(f"engine_options: {name!r} is the audit's own argument, not an engine option")
    spec = Engine(model, drafter=drafter, dtype=dtype, num_draft=num_draft, head=head, draft_model=draft_model,
                  max_seq_len=max_seq_len, tokenizer=tokenizer, **opts)
    plain = Engine(spec.target, drafter="none", tokenizer=spec.tokenizer, max_seq_len=max_seq_len,
                   cuda_graphs=opts.get("cuda_graphs"))
    name = spec.drafter.name if spec.drafter is not None else "none"
    report = AuditReport(str(model), name, str(spec.target.dtype).replace("torch.", ""), None, None)

    if greedy:
        g = GreedyResult(len(prompts), 0)
        for i, p in enumerate(prompts):
            a = plain.generate(p, max_new_tokens=max_new_tokens, **settings)
            b = spec.generate(p, max_new_tokens=max_new_tokens, **settings)
            g.tokens_compared += min(len(a.token_ids), len(b.token_ids))
            if a.token_ids != b.token_ids:
                pos = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                           min(len(a.token_ids), len(b.token_ids)))
                x = a.token_ids[pos] if pos < len(a.token_ids) else -1
                y = b.token_ids[pos] if pos < len(b.token_ids) else -1
                lx, ly = _logits_at(spec.target, a.prompt_token_ids + a.token_ids[:pos], (x, y))
                g.divergences.append(Divergence(i, p if isinstance(p, str) else str(p), pos, x, y, lx, ly))
            say(f"greedy {i + 1}/{len(prompts)}: {'same' if a.token_ids == b.token_ids else 'DIVERGES'}")
        report.greedy = g

    if sampling:
        prompt = SAMPLING_PROMPT if sampling_prompt is None else sampling_prompt
        n = samples or samples_for_power(detect_tv, power, alpha / k, categories=20)
        s = SamplingResult(prompt, k, n, float(temperature), top_k, float(top_p), alpha, detect_tv, power, 0, 0)
        kw = dict(max_new_tokens=k, temperature=temperature, top_k=top_k, top_p=top_p, chat=False, **settings)

        def runs(engine, base: int, count_drafts: bool) -> list[tuple[int, ...]]:
            out = []
            for r in range(n):
                gen = engine.generate(prompt, seed=base + r, **kw)
                # a run that ended (EOS) before k tokens: "ended" (-1) is a category of the later positions
                out.append(tuple(gen.token_ids[:k]) + (-1,) * (k - len(gen.token_ids)))
                if count_drafts:
                    s.draft_tokens_proposed += gen.stats["draft_proposed"]
                    s.draft_tokens_accepted += gen.stats["draft_accepted"]
            return out

        say(f"sampling: {n} runs per arm, k = {k}")
        plain_runs = runs(plain, seed + 1_000_000, False)
        spec_runs = runs(spec, seed, True)
        with biased_acceptance():
            control_runs = runs(spec, seed + 2_000_000, False)
        rng = random.Random(seed)
        for j in range(k):
            pa = [r[j] for r in plain_runs]
            s.positions.append(compare([r[j] for r in spec_runs], pa, j, rng))
            s.control.append(compare([r[j] for r in control_runs], pa, j, rng))
        report.sampling = s
    report.seconds = time.perf_counter() - t0
    return report


@torch.inference_mode()
def _logits_at(target, ids: list[int], tokens: tuple[int, int]) -> tuple[float, float]:
    """The target's logits of ``tokens`` after ``ids`` (a fresh cache, one pass)."""
    x = torch.tensor([ids], device=target.device)
    logits = target.forward(x, torch.arange(len(ids), device=target.device)[None], target.new_cache(len(ids)), 0,
                            logits="last")[0, -1]
    return tuple(float(logits[t]) if 0 <= t < logits.numel() else float("nan") for t in tokens)
