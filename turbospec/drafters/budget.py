"""How many tokens to draft this step, from measured acceptance and measured costs.

With a(d) the chance that draft token d is accepted once tokens 1..d-1 were, drafting k tokens emits
E(k) = 1 + a(1) + a(1) a(2) + ... + a(1)...a(k) tokens per verify step (counting the recovered/bonus
token) and costs verify(k + 1) + draft(k) seconds. The controller picks the k in [0, max_draft] with
the best E(k) / cost(k); k = 0 is a plain decode step. Acceptance is estimated per depth because it
is correlated along a chain: a draft model whose first token is accepted 55% of the time may have
its second accepted 90% of the time once the first was (the Qwen 1.5B/0.5B pair: drafts of 2 tokens
mostly end with 0 or 2 accepted), which one geometric rate cannot describe: it overrates 1-token
drafts and underrates longer ones.

Both costs are measured. Verify: per width, the lower median of its last 5 passes; a width not yet
measured is interpolated linearly between measured neighbours, beyond them it grows by a mild slope;
every 8th drafting step tries a neighbouring length (one token fewer may be a plain step: the cost
drafting is weighed against), so that the widths around the choice stay fresh. Draft: k times the
median per-token cost of the last 9 drafting steps (k draft forwards, k lookups). Medians, so one
outlier (a drafter catching up on a long stretch, a page fault) cannot switch speculation off; a
probe (below) starts the draft cost's history afresh (its own time, inflated by a draft model's
catch-up on the tokens committed while off, is not kept). a(d) is a decayed count (decayed at each
step that reached depth d) of the steps whose token d was accepted among the steps that drafted it
after accepting tokens 1..d-1, over a prior of 2 pseudo-steps at a(d - 1) (``prior_accept`` for d =
1); a depth not reached lately keeps its last estimate, and every 8th drafting step tries a
neighbouring length, so the depth just past the choice stays measured. While drafting, speculation
goes off only when a plain step beats every length by SWITCH_OFF_MARGIN on acceptance counts decayed
slowly (SLOW_DECAY, ~30 steps): coming back costs a probe, and over ~10 steps the estimate swings by
more than a marginal gain (simulated with this CPU's Qwen-pair costs and +-20 % timing noise: 0.94
of plain before, 0.95-0.97 after). A probe (below) keeps a quarter of the counts: acceptance comes
in phases (a draft model on the Qwen pair: stretches of 0s, then of 2s), and the counts that
switched speculation off must not outvote what the probe sees now. While speculation is off, two
steps draft anyway after 4, 8, 16, ... 64 plain steps (1 or 2 tokens, whichever the estimates
prefer; the second step's draft time is measured), so that acceptance and draft cost are measured
again: a drafter is never kept off on stale data. A probe costs what its two steps took beyond the
plain steps they replace (a draft model catching up on the tokens committed while off: on the Qwen
1.5B/0.5B pair, int8, 6 plain steps' worth); the next probe waits until the plain steps since the
last one took PROBE_SHARE^-1 times that, so a useless drafter costs at most PROBE_SHARE (2%) of the
decode time. Plain steps since the last probe are counted across the generations of one engine
(``carry_over``).

What the model predicts is checked against what drafting delivers: the steps that proposed in
drafting mode (their tokens and their verify + draft seconds, decayed by REAL_DECAY per step, ~33
steps; a lookup that found nothing is no evidence) are set against plain steps' (or, before any,
the measured plain verify). Once drafting has REAL_MIN steps' weight of evidence and they emitted
fewer tokens per second than plain steps, speculation goes off whatever the estimates say, and the
probe back-off is not reset. Medians and the prior
misjudge a drafter whose cost is a heavy-tailed fixed cost per proposal rather than a per-token one
(an EAGLE head's tree: its catch-up after plain steps, its root forward and draft LM head): on an
AVX2 Zen 3 the shipped EAGLE-3 head's proposals had a median of 2.5 ms and a mean of 6.0 ms, its
first token was estimated at 0.47 accepted against 0.33 seen, and the model drafted ~45 % of the
steps at 0.92-0.94x plain speed (bench/results/2026-11-29-avx2-split-passes.md). A probe clears
the drafting evidence: the model decides again from the probe's acceptance, and REAL_MIN steps of
drafting give the next verdict.

A draft model reads the prompt in the prefill (``Drafter.prepare``) only when that is expected to
pay over the generation: ``reading_pays`` weighs the seconds drafting is expected to save over
``max_new_tokens`` against the prompt's length times the last measured read time per token. A
700-token prompt read by the 0.5B draft costs ~7 s on a 2-core CPU; over 64 new tokens drafting
saves ~1 s. Unread, the draft catches up on a window of the context at its first proposal.
"""
from __future__ import annotations

import math
from typing import Callable


def _fill(measured: dict[int, float], xs: range, beyond) -> list[float | None]:
    """For each x in xs: measured[x], else linear between the nearest measured neighbours, else
    beyond(x, x0, t0) from the nearest measured point x0; None when nothing is measured."""
    keys = sorted(measured)
    out: list[float | None] = []
    j = 0  # keys[j] is the first measured key >= x
    for x in xs:
        while j < len(keys) and keys[j] < x:
            j += 1
        if j < len(keys) and keys[j] == x:
            out.append(measured[x])
        elif not keys:
            out.append(None)
        elif 0 < j < len(keys):
            x0, x1 = keys[j - 1], keys[j]
            out.append(measured[x0] + (measured[x1] - measured[x0]) * (x - x0) / (x1 - x0))
        else:
            x0 = keys[j - 1] if j else keys[0]
            out.append(beyond(x, x0, measured[x0]))
    return out


class DraftBudget:
    VERIFY_SLOPE = 0.03  # prior: relative verify cost per extra token in the pass
    SAMPLES = 5  # a verify cost is the (lower) median of its width's last SAMPLES measurements
    DRAFT_SAMPLES = 9  # the per-token draft cost: the median of the last DRAFT_SAMPLES steps
    EXPLORE_EVERY = 8  # drafting steps between two tries of a neighbouring length
    MAX_PROBE_INTERVAL = 64  # the doubling's cap ...
    PROBE_SHARE = 0.02  # ... unless the last probe's extra seconds exceed this share of the plain steps
    MAX_COSTLY_INTERVAL = 4096
    PROBE_DISCOUNT = 0.25  # at a probe, the weight left to the acceptance measured before it
    PRIOR_WEIGHT = 2.0  # pseudo-steps of the prior acceptance at every depth
    SWITCH_OFF_MARGIN = 0.05  # while drafting, a plain step must look this much better to switch off
    SLOW_DECAY = 0.97  # ... on acceptance counts decayed this slowly (~30 steps)
    REAL_DECAY = 0.97  # what drafting and plain steps delivered: (tokens, seconds) decayed per step
    REAL_MIN = 4.0  # the weight of drafting steps before they may overrule the estimates
    REAL_Z = 1.0  # ... by more than this many standard errors of their mean tokens per step

    def __init__(self, max_draft: int, adaptive: bool = True, prior_accept: float = 0.6,
                 decay: float = 0.9, timed: bool = True):
        # timed=False: ignore measured times (keep the prior cost model), so that the chosen draft
        # lengths depend only on acceptance, which is reproducible, and not on wall-clock noise.
        self.max_draft, self.adaptive, self.decay, self.timed = max_draft, adaptive, decay, timed
        self.prior_accept = prior_accept
        # depth d (index d - 1): steps that drafted token d after tokens 1..d-1 were accepted, and
        # among them those whose token d was accepted too (decayed counts)
        self.arrived = [0.0] * max_draft
        self.went_on = [0.0] * max_draft
        # the same counts decayed more slowly (SLOW_DECAY): what switching speculation off is judged on
        self.arrived_slow = [0.0] * max_draft
        self.went_on_slow = [0.0] * max_draft
        self.verify_time: dict[int, list[float]] = {}  # width (nodes) -> last seconds measured
        self.draft_time: list[float] = []  # last seconds per drafted token
        self._cost: list[float] | None = None  # cost(k), k = 0..max_draft; None: to recompute
        self._off_steps = 0  # consecutive plain steps chosen
        self._probe_interval = 4
        self._drafting_steps = 0
        self._probing = False
        self._confirm = 0  # after a probe: the length to draft once more, to measure a steady step
        self._probe_steps = 0  # steps of the probe under way still to record (the probe, its confirm)
        self._probe_extra = 0.0  # seconds the last probe took beyond the plain steps it replaced
        self.read_time: float | None = None  # seconds per token of the drafter's last prompt read
        # True once this generation's drafter proposed from a window of the context: its
        # acceptance is not passed on (``carry_over`` passes on what this generation started from)
        self.windowed = False
        self._carried: tuple[list[float], list[float]] | None = None  # (arrived, went_on) passed on to us
        # what steps that proposed in drafting mode, and plain steps, delivered: decayed (weight,
        # tokens, tokens squared, seconds)
        self.real_draft = [0.0, 0.0, 0.0, 0.0]
        self.real_plain = [0.0, 0.0, 0.0, 0.0]
        self._mode: int | None = None  # the length ``choose`` returned for the step being recorded
        self._trial = False  # since the last probe, until drafting's realized verdict
        self._carried_real: tuple[list[float], list[float]] | None = None  # (real_draft, real_plain) passed on to us

    def _chain(self, k: int, slow: bool = False) -> list[float]:
        """[a(1), ..., a(k)]. a(d)'s prior is a(d - 1) (a(1)'s: ``prior_accept``): a depth seldom
        reached is taken to be about as good as the one before it. ``slow``: from the slowly
        decayed counts."""
        out, a = [], self.prior_accept
        counts = (self.went_on_slow, self.arrived_slow) if slow else (self.went_on, self.arrived)
        for went_on, arrived in zip(counts[0][:k], counts[1][:k]):
            a = (went_on + self.PRIOR_WEIGHT * a) / (arrived + self.PRIOR_WEIGHT)
            out.append(a)
        return out

    def accept_at(self, depth: int) -> float:
        """a(depth): the estimated chance that draft token ``depth`` (1-based) is accepted once the
        tokens before it were."""
        return self._chain(depth)[depth - 1]

    @property
    def accept_rate(self) -> float:
        """The first draft token's acceptance rate, a(1)."""
        return self.accept_at(1) if self.max_draft else self.prior_accept

    def carry_over(self, last: "DraftBudget | None") -> None:
        """Start from what an earlier generation measured on the same engine: its cost samples (the
        machine's and the models', not the prompt's) and half the weight of its acceptance counts
        (a prior the new prompt soon outweighs). A short generation then does not spend its first
        steps re-learning the costs from the prior. The acceptance of a generation whose drafter
        saw only a window of the context (``Drafter.windowed``: a draft model that did not read the
        prompt) is not passed on: the one it started from is, so that a prompt too long to read
        does not switch speculation off for the next, short prompt."""
        if last is None or not (self.timed and last.timed) or last.max_draft != self.max_draft:
            return
        self.verify_time = {w: list(v) for w, v in last.verify_time.items()}
        self.draft_time = list(last.draft_time)
        counts = last._carried if last.windowed and last._carried else (last.arrived, last.went_on)
        self._carried = counts
        self.arrived = [0.5 * n for n in counts[0]]
        self.went_on = [0.5 * n for n in counts[1]]
        self.arrived_slow, self.went_on_slow = list(self.arrived), list(self.went_on)
        # The probe back-off (4 while drafting; longer when the last generation ended with
        # speculation off): a useless drafter is not probed after 4 plain steps of every generation.
        self._probe_interval = last._probe_interval
        self._off_steps, self._probe_extra = last._off_steps, last._probe_extra
        self.read_time = last.read_time
        # what drafting delivered passes on whole (a drafter found slower than plain stays off until
        # its next probe; halved, each generation would start with a trial of REAL_MIN steps), but
        # as the acceptance: not that of a windowed generation
        real = last._carried_real if last.windowed and last._carried_real else (last.real_draft, last.real_plain)
        self._carried_real = real
        self.real_draft, self.real_plain = list(real[0]), list(real[1])
        self._cost = None

    @staticmethod
    def _median(samples: list[float]) -> float:
        return sorted(samples)[(len(samples) - 1) // 2]

    def costs(self) -> list[float]:
        """Seconds (or prior cost units, before anything is measured) of a step drafting k tokens,
        k = 0..max_draft: verify(k + 1) + k * draft_per_token."""
        if self._cost is None:
            ks = range(self.max_draft + 1)
            slope = self.VERIFY_SLOPE
            verify = _fill({w - 1: self._median(v) for w, v in self.verify_time.items()}, ks,
                           lambda k, k0, t0: t0 * (1.0 + slope * (k - k0)))
            per_token = self._median(self.draft_time) if self.draft_time else 0.0
            self._cost = [(1.0 + slope * k if v is None else v) + k * per_token for k, v in zip(ks, verify)]
        return self._cost

    def draft_cost(self) -> float:
        """Measured draft seconds per drafted token (0 before anything is measured)."""
        return self._median(self.draft_time) if self.draft_time else 0.0

    def expected_upto(self, k: int, slow: bool = False) -> list[float]:
        """[E(0), ..., E(k)], in one pass over the chain (past max_draft, E stays E(max_draft))."""
        out, reach = [1.0], 1.0
        for a in self._chain(k, slow):
            reach *= min(a, 0.999)
            out.append(out[-1] + reach)
        return out + [out[-1]] * (k + 1 - len(out))

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a step drafting k emits, on average (the bonus/recovered token included)."""
        return self.expected_upto(k)[k]

    def _rates(self, slow: bool = False) -> list[float]:
        """Tokens per second (or per prior cost unit) of drafting k = 0..max_draft tokens."""
        return [e / c for e, c in zip(self.expected_upto(self.max_draft, slow), self.costs())]

    def _scale_counts(self, factor: float) -> None:
        """Both sets of acceptance counts times ``factor``."""
        for name in ("arrived", "went_on", "arrived_slow", "went_on_slow"):
            setattr(self, name, [factor * n for n in getattr(self, name)])

    def _rates_and_best(self) -> tuple[list[float], int]:
        rates = self._rates()
        best_k = 0
        for k in range(1, self.max_draft + 1):
            if rates[k] > rates[best_k] * 1.0001:
                best_k = k
        return rates, best_k

    def drafting(self) -> bool:
        """Whether the estimates favour drafting now (probes aside); changes nothing."""
        if not self.adaptive or self.max_draft == 0:
            return self.max_draft > 0
        return self._confirm > 0 or self._rates_and_best()[1] > 0

    def reading_pays(self, prompt_tokens: int, new_tokens: int) -> bool:
        """Whether the drafter should read the prompt in the prefill (``Drafter.prepare``): drafting
        is expected to pay now, and the time it is expected to save over ``new_tokens`` tokens is
        more than reading ``prompt_tokens`` costs at the last measured read speed (a draft model
        reading a 700-token prompt can cost more than it saves over 64 new tokens). Unread, the
        drafter catches up on a window of the context at its first proposal. Before both speeds
        are measured (and in a fixed or untimed budget), it reads whenever it drafts."""
        if not self.drafting():
            return False
        if not (self.adaptive and self.timed) or self.read_time is None or 1 not in self.verify_time \
                or not self.draft_time:
            return True
        rates, best_k = self._rates_and_best()
        saved = new_tokens * (1.0 / rates[0] - 1.0 / rates[best_k])
        return saved > prompt_tokens * self.read_time

    def record_read(self, tokens: int, seconds: float) -> None:
        """The drafter read ``tokens`` prompt tokens in ``seconds``."""
        if self.timed and tokens > 0:
            self.read_time = seconds / tokens

    def choose(self) -> int:
        k = self._choose()
        self._mode = k
        return k

    def realized_verdict(self) -> bool | None:
        """Did the last steps in drafting mode deliver at least the tokens per second of plain
        steps? None until they weigh REAL_MIN steps (and for untimed budgets)."""
        w, tokens, squares, seconds = self.real_draft
        if not self.timed or w < self.REAL_MIN or seconds <= 0.0:
            return None
        pw, ptokens, _, pseconds = self.real_plain
        if pw >= 2.0 and pseconds > 0.0:
            plain_rate = ptokens / pseconds
        else:
            plain = self.verify_time.get(1)
            if not plain:
                return None
            plain_rate = 1.0 / self._median(plain)
        # tokens per step vary (0..k accepted): slower only by more than REAL_Z standard errors of
        # the mean tokens per step, so that a drafter a few per cent ahead is not switched off by chance
        mean = tokens / w
        stderr = math.sqrt(max(squares / w - mean * mean, 0.0) / w)
        return (mean + self.REAL_Z * stderr) / (seconds / w) >= plain_rate

    def _choose(self) -> int:
        if not self.adaptive or self.max_draft == 0:
            return self.max_draft
        if self._confirm:
            k, self._confirm = self._confirm, 0
            return k
        rates, best_k = self._rates_and_best()
        if best_k == 0 and self._off_steps == 0 and self._drafting_steps > 0:
            # Drafting until now: switch off only if the slowly decayed acceptance agrees, by
            # SWITCH_OFF_MARGIN. Coming back costs a probe (for a draft model a catch-up), and over
            # ~10 steps the acceptance estimate swings by more than a marginal gain.
            slow = self._rates(slow=True)
            k = max(range(1, self.max_draft + 1), key=lambda k: slow[k])
            if slow[k] * (1.0 + self.SWITCH_OFF_MARGIN) >= rates[0]:
                best_k = k
        verdict = None
        if best_k > 0:
            verdict = self.realized_verdict()
            if verdict is False:  # drafting delivered less than plain steps: off, whatever the estimates say
                best_k = 0
        if best_k > 0:
            self._off_steps = 0
            if verdict:  # a back-off is reset only by drafting that delivered
                self._probe_interval = 4
            self._drafting_steps += 1
            if self.timed and self._drafting_steps % self.EXPLORE_EVERY == 0:
                # keep the neighbours' verify times fresh (one stale sample must not pin the choice),
                # a plain step's too: it is what drafting is weighed against
                up = self._drafting_steps % (2 * self.EXPLORE_EVERY) == 0
                return min(best_k + 1, self.max_draft) if up else best_k - 1
            return best_k
        # speculation is off: probe now and then, with fresh measurements
        self._off_steps += 1
        if self._off_steps > self.probe_wait():  # that many plain steps in a row: probe
            self._off_steps = 0
            self._probe_interval = min(2 * self._probe_interval, self.MAX_PROBE_INTERVAL)
            self._probing = True
            k = max(range(1, min(2, self.max_draft) + 1), key=lambda k: rates[k])  # cheap: 1 or 2
            # the acceptance that switched speculation off is stale now: the probe's steps decide
            self._scale_counts(self.PROBE_DISCOUNT)
            self.real_draft = [0.0, 0.0, 0.0, 0.0]  # the probe's acceptance decides; then REAL_MIN steps' verdict
            self._trial = True
            self._probe_steps, self._probe_extra = 1, 0.0
            if self.timed:
                self._confirm = k
                self._probe_steps = 2
            return k
        return 0

    def probe_wait(self) -> int:
        """Plain steps between two probes: the doubling back-off, or more when the last probe cost
        more than PROBE_SHARE of that many plain steps."""
        wait = self._probe_interval
        plain = self.verify_time.get(1)
        if self.timed and self._probe_extra > 0.0 and plain:
            costly = math.ceil(self._probe_extra / (self.PROBE_SHARE * self._median(plain)))
            wait = max(wait, min(costly, self.MAX_COSTLY_INTERVAL))
        return wait

    def record(self, proposed: int, accepted: int, width: int, verify_seconds: float,
               draft_seconds: float) -> None:
        if self.timed:
            samples = self.verify_time.setdefault(width, [])
            samples.append(verify_seconds)
            del samples[:-self.SAMPLES]
            if proposed > 0:
                if self._probing:
                    # What was measured before speculation went off is stale, and the probe's own
                    # time is not a steady step's (a draft model first catches up on every token
                    # committed while it was off): drop both; the step after a probe drafts the same
                    # length again and is measured.
                    self.draft_time.clear()
                else:
                    self.draft_time.append(draft_seconds / proposed)
                del self.draft_time[:-self.DRAFT_SAMPLES]
            self._cost = None
        mode = self._mode if self._mode is not None else proposed
        if self.timed:
            # the step's mode: the length ``choose`` picked (a batch's rows: what they drafted). Kept
            # as drafting: steps that proposed, but the first step of a probe (its catch-up is the
            # probe's cost, charged by probe_wait); a step whose drafter found nothing to propose (an
            # n-gram lookup without a match) is no evidence either way
            if mode == 0:
                self._realize(self.real_plain, 1, verify_seconds + draft_seconds)
            elif proposed > 0 and not self._probing:
                self._realize(self.real_draft, 1 + accepted, verify_seconds + draft_seconds)
        self._mode = None
        self._probing = False
        # What the probe's steps, and the drafting after it until the realized verdict, took beyond
        # plain steps emitting as much: the next probe waits for PROBE_SHARE of it (probe_wait).
        trial = self._trial and mode > 0
        if self._probe_steps or trial:
            self._probe_steps = max(self._probe_steps - 1, 0)
            plain = self.verify_time.get(1)
            if self.timed and plain:
                self._probe_extra += verify_seconds + draft_seconds - (1 + accepted) * self._median(plain)
        if self._trial and self.realized_verdict() is not None:
            self._trial = False
        for i in range(min(proposed, accepted + 1)):  # the depths this step reached
            self.arrived[i] = self.decay * self.arrived[i] + 1.0
            self.went_on[i] = self.decay * self.went_on[i] + (1.0 if accepted > i else 0.0)
            self.arrived_slow[i] = self.SLOW_DECAY * self.arrived_slow[i] + 1.0
            self.went_on_slow[i] = self.SLOW_DECAY * self.went_on_slow[i] + (1.0 if accepted > i else 0.0)

    def _realize(self, real: list[float], tokens: int, seconds: float) -> None:
        d = self.REAL_DECAY
        for i, v in enumerate((1.0, tokens, tokens * tokens, seconds)):
            real[i] = d * real[i] + v


class DepthBudget:
    """How many expansion rounds (tree depth) a dynamic-tree drafter runs this step.

    Measured per step: how deep the accepted path reached, against how deep the tree went; the time
    of one expansion round; and the rest of a step (verify and bookkeeping). a(d), the chance that
    the path goes on to depth d once it reached d - 1 (in trees that went that deep), gives
    P(d) = a(1) ... a(d), the tokens reaching depth d is worth, so D rounds give 1 + sum P(d) tokens
    per step for t_rest + D * t_round seconds; the depth with the best ratio wins. Depths not run
    lately decay back towards an optimistic prior, so they are probed again. Only used for greedy
    steps: the shape then never changes the output, and timings cannot make a seeded sampling run
    irreproducible.
    """

    def __init__(self, max_depth: int, prior: float = 0.7, weight: float = 2.0, decay: float = 0.95):
        self.max_depth, self.prior, self.weight, self.decay = max_depth, prior, weight, decay
        self.went_on = [0.0] * max_depth  # steps whose path reached d (tree depth >= d) ...
        self.arrived = [0.0] * max_depth  # ... among steps whose path reached d - 1 (tree depth >= d)
        self.t_round = 0.0
        self.t_rest = 0.0

    def p_reach(self, d: int) -> float:
        p = 1.0
        for j in range(d):
            p *= (self.went_on[j] + self.weight * self.prior) / (self.arrived[j] + self.weight)
        return p

    def choose(self, limit: int) -> int:
        limit = max(1, min(limit, self.max_depth))
        if self.t_round <= 0.0 or self.t_rest <= 0.0:
            return limit  # nothing measured yet
        best, best_rate, tokens = 1, 0.0, 1.0
        for depth in range(1, limit + 1):
            tokens += self.p_reach(depth)
            rate = tokens / (self.t_rest + depth * self.t_round)
            if rate > best_rate * 1.0001:
                best, best_rate = depth, rate
        for d in range(best + 1, self.max_depth + 1):  # unexplored depths fade back to the prior
            self.went_on[d - 1] *= self.decay
            self.arrived[d - 1] *= self.decay
        return best

    def record(self, depth_used: int, depth_accepted: int, round_seconds: float | None,
               rest_seconds: float | None) -> None:
        for d in range(1, min(depth_used, depth_accepted + 1) + 1):  # the path had reached d - 1
            self.arrived[d - 1] = self.decay * self.arrived[d - 1] + 1.0
            self.went_on[d - 1] = self.decay * self.went_on[d - 1] + (1.0 if depth_accepted >= d else 0.0)
        for name, v in (("t_round", round_seconds), ("t_rest", rest_seconds)):
            if v is not None and v > 0:
                old = getattr(self, name)
                setattr(self, name, v if old == 0.0 else 0.8 * old + 0.2 * v)


class BatchBudget:
    """The draft length of a batched step, from measured acceptance per request and the measured
    cost of the batched verify pass.

    Every row of a pass is padded to the longest one, so the pass costs V(R * (k + 1)) for R rows
    and drafts of k tokens; a ragged pass (``ragged``: CPU's eager pass, which skips the padding)
    costs V(plain rows + D * (k + 1)) for D drafting rows. V is measured as a function of the tokens
    in the pass (the lower median
    of its last 5 passes; unmeasured sizes linear between measured neighbours, beyond them a mild
    slope). One length k serves the drafting rows; it is the k in [0, max_draft] with the best
    expected tokens per second of the whole step:

        (plain rows + sum over drafting rows of E_r(k)) / (V(R * (k + 1)) + k * sum_r draft_r)

    with E_r(k) row r's expected tokens from its own acceptance (``DraftBudget.expected_upto``)
    and draft_r its measured draft time per token. A full batch of a compute-bound target makes V
    grow with every token, so k falls, down to 0 (plain batched decode) when drafting no longer
    pays. While off, 1 token is drafted after 4, 8, ... 64 plain steps so acceptance and cost are
    measured again; every 8th drafting step tries a neighbouring length to keep those costs fresh.

    Only rows whose lengths may follow timings use it (greedy rows and unseeded sampling): a seeded
    sampled row keeps its own untimed budget, so its output stays that of the request alone."""
    SAMPLES = 5
    VERIFY_SLOPE = 0.03
    EXPLORE_EVERY = 8
    MAX_PROBE_INTERVAL = 64

    def __init__(self, max_draft: int, adaptive: bool = True):
        self.max_draft, self.adaptive = max_draft, adaptive
        self.verify_time: dict[int, list[float]] = {}  # tokens in the pass -> last seconds
        self._off_steps, self._probe_interval, self._drafting_steps = 0, 4, 0

    def verify_costs(self, sizes: list[int]) -> list[float | None]:
        """Seconds of a pass of each size in ``sizes`` (None before anything is measured)."""
        measured = {t: DraftBudget._median(v) for t, v in self.verify_time.items()}
        lo, hi = min(sizes), max(sizes)
        filled = _fill(measured, range(lo, hi + 1), lambda x, x0, t0: t0 * (1.0 + self.VERIFY_SLOPE * (x - x0)))
        return [filled[t - lo] for t in sizes]

    def choose(self, rows_in_pass: int, plain_rows: int,
               drafting: list[tuple[Callable[[int], list[float]], float]], ragged: bool = False) -> int:
        """k for this step. ``drafting``: (k -> [E(0), ..., E(k)], the tokens a step drafting 0..k
        emits; draft seconds per token) of each row that drafts by this budget; ``plain_rows``: the
        other active rows (one token each); ``ragged``: the pass computes its rows' own tokens only
        (``record`` then gets those)."""
        if not self.adaptive or self.max_draft == 0 or not drafting:
            return self.max_draft if drafting else 0
        ks = range(self.max_draft + 1)
        sizes = [plain_rows + len(drafting) * (k + 1) if ragged else rows_in_pass * (k + 1) for k in ks]
        verify = self.verify_costs(sizes)
        if verify[0] is None:
            return min(2, self.max_draft)  # nothing measured yet: start short, then follow the numbers
        per_token = sum(d for _, d in drafting)

        tables = [expected_upto(self.max_draft) for expected_upto, _ in drafting]

        def tokens(k: int) -> float:
            return plain_rows + sum(table[k] for table in tables)
        rates = [tokens(k) / (verify[k] + k * per_token) for k in ks]
        best = 0
        for k in ks[1:]:
            if rates[k] > rates[best] * 1.0001:
                best = k
        if best > 0:
            self._off_steps, self._probe_interval = 0, 4
            self._drafting_steps += 1
            if self._drafting_steps % self.EXPLORE_EVERY == 0:
                up = self._drafting_steps % (2 * self.EXPLORE_EVERY) == 0
                return min(best + 1, self.max_draft) if up else max(best - 1, 1)
            return best
        self._off_steps += 1
        if self._off_steps > self._probe_interval:
            self._off_steps = 0
            self._probe_interval = min(2 * self._probe_interval, self.MAX_PROBE_INTERVAL)
            return 1
        return 0

    def record(self, tokens_in_pass: int, seconds: float) -> None:
        samples = self.verify_time.setdefault(tokens_in_pass, [])
        samples.append(seconds)
        del samples[:-self.SAMPLES]
