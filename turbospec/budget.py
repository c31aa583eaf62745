"""How many tokens to draft this step, from measured acceptance and a measured cost model.

With per-token acceptance rate a, drafting k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens per
verify step (counting the recovered/bonus token) and costs verify(k + 1) + k * draft_token seconds.
The controller picks the k in [0, max_draft] with the best E(k) / cost(k); k = 0 is a plain decode
step. Verify times are measured per width (exponential moving average), widths not yet measured are
interpolated linearly; acceptance is a decayed count of accepted vs rejected tokens. While
speculation is switched off the counts decay back towards the prior, so it is probed again later.
"""
from __future__ import annotations


class DraftBudget:
    def __init__(self, max_draft: int, adaptive: bool = True, prior_accept: float = 0.6,
                 decay: float = 0.9, timed: bool = True):
        # timed=False: ignore measured times (keep the prior cost model), so that the chosen draft
        # lengths depend only on acceptance, which is reproducible, and not on wall-clock noise.
        self.max_draft, self.adaptive, self.decay, self.timed = max_draft, adaptive, decay, timed
        self.prior = (2.0 * prior_accept, 2.0 * (1.0 - prior_accept))  # pseudo-counts
        self.accepted, self.rejected = 0.0, 0.0
        self.verify_time: dict[int, float] = {}  # width (nodes) -> seconds
        self.draft_token_time = 0.0

    @property
    def accept_rate(self) -> float:
        s, f = self.accepted + self.prior[0], self.rejected + self.prior[1]
        return s / (s + f)

    def _verify_cost(self, width: int) -> float:
        if width in self.verify_time:
            return self.verify_time[width]
        known = sorted(self.verify_time.items())
        if not known:
            return 1.0 + 0.03 * (width - 1)  # relative prior until something is measured
        lo = [(w, t) for w, t in known if w < width]
        hi = [(w, t) for w, t in known if w > width]
        if lo and hi:
            (w0, t0), (w1, t1) = lo[-1], hi[0]
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
        w0, t0 = (lo or hi)[-1 if lo else 0]
        return t0 * (1.0 + 0.03 * (width - w0))  # extrapolate with a mild slope

    def expected_tokens(self, k: int) -> float:
        a = min(self.accept_rate, 0.999)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def choose(self) -> int:
        if not self.adaptive or self.max_draft == 0:
            return self.max_draft
        best_k, best_rate = 0, 1.0 / self._verify_cost(1)
        for k in range(1, self.max_draft + 1):
            rate = self.expected_tokens(k) / (self._verify_cost(k + 1) + k * self.draft_token_time)
            if rate > best_rate * 1.0001:
                best_k, best_rate = k, rate
        if best_k == 0:  # speculation is off: let the evidence fade so it gets probed again
            self.accepted *= self.decay
            self.rejected *= self.decay
        return best_k

    def record(self, proposed: int, accepted: int, width: int, verify_seconds: float,
               draft_seconds: float) -> None:
        if self.timed:
            t = self.verify_time.get(width)
            self.verify_time[width] = verify_seconds if t is None else 0.8 * t + 0.2 * verify_seconds
        if proposed > 0:
            self.accepted = self.decay * self.accepted + accepted
            self.rejected = self.decay * self.rejected + (1.0 if accepted < proposed else 0.0)
            if not self.timed:
                return
            per_token = draft_seconds / proposed
            self.draft_token_time = per_token if self.draft_token_time == 0.0 else \
                0.8 * self.draft_token_time + 0.2 * per_token


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
