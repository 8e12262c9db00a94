"""When speculation pays under load: the `auto` policy of a serving replica.

The scheduler verifies every active request in one target forward. n requests drafting a
tree of N nodes put n * (N + 1) rows in that forward; plain steps put n. Per round:

    speculate:  n * tau tokens in  n * t_draft + t_target(n * (N + 1))
    plain:      n tokens       in  t_target(n)

so drafting pays while  tau * t_target(n) > n * t_draft + t_target(n * (N + 1)).
t_target(rows) is measured once at replica start (`profiling.profile_target`, linear
interpolation between the measured sizes); tau and t_draft are running means of what the
replica observes, starting from the drafter's own held-out estimate. One round in
`EXPLORE_EVERY` drafts anyway while plain steps win, so the tau estimate keeps up when the
traffic changes.
"""

from __future__ import annotations

import bisect

EXPLORE_EVERY = 32  # plain-step rounds between two exploratory drafting rounds
EMA = 0.05  # weight of one round in the running means (~20-round memory)


class SpeculationPolicy:
    def __init__(
        self,
        target_ms: dict[int, float],
        rows_per_request: int,
        prior_tau: float,
        prior_draft_ms: float,
    ):
        if not target_ms:
            raise ValueError("the policy needs at least one measured target forward size")
        self.sizes = sorted(target_ms)
        self.costs = [target_ms[n] for n in self.sizes]
        self.rows = rows_per_request  # N + 1: root and drafted nodes
        self.tau, self.draft_ms = prior_tau, prior_draft_ms
        self._plain_rounds = 0

    def target_ms(self, rows: int) -> float:
        """Interpolated (or linearly extrapolated) cost of a forward with `rows` rows."""
        s, c = self.sizes, self.costs
        if len(s) == 1:
            return c[0] * rows / s[0]
        i = min(max(bisect.bisect_left(s, rows), 1), len(s) - 1)
        lo, hi = s[i - 1], s[i]
        return c[i - 1] + (c[i] - c[i - 1]) * (rows - lo) / (hi - lo)

    def gain(self, n: int) -> float:
        """Predicted tokens/s of drafting over plain steps for n requests (> 1: draft)."""
        spec_ms = n * self.draft_ms + self.target_ms(n * self.rows)
        return self.tau * self.target_ms(n) / spec_ms

    def speculate(self, n: int) -> bool:
        if n <= 0:
            return False
        if self.gain(n) > 1.0:
            self._plain_rounds = 0
            return True
        self._plain_rounds += 1
        return self._plain_rounds % EXPLORE_EVERY == 0

    def observe(self, tokens: float, draft_ms: float) -> None:
        """One request's speculative round: tokens committed (accepted + bonus), drafting ms."""
        self.tau += EMA * (tokens - self.tau)
        self.draft_ms += EMA * (draft_ms - self.draft_ms)

    def as_dict(self) -> dict:
        return {
            "tau": self.tau,
            "draft_ms": self.draft_ms,
            "rows_per_request": self.rows,
            "target_ms": dict(zip(self.sizes, self.costs, strict=True)),
            "break_even_requests": self.break_even(),
        }

    def break_even(self, limit: int = 256) -> int | None:
        """The smallest load at which plain steps win (None: drafting wins up to `limit`)."""
        return next((n for n in range(1, limit + 1) if self.gain(n) <= 1.0), None)
