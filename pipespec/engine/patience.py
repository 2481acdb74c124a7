"""When a verifier should wait for its drafter instead of generating a token itself.

PipeSpec's verifier never idles: with no draft to check it generates one token itself. That is
right when the drafter is slow, and wasteful when it is much faster than the verifier: after a
rejection the drafter needs a few milliseconds to refill the window, while a self-generated token
costs a whole verifier forward for one token. `Patience` chooses, from running estimates, how many
drafts g to verify next: it maximises the expected tokens per second

    E(g) / (T_verify + (g - pending) * T_draft),     E(g) = (1 - a^(g+1)) / (1 - a)

over the g drafts it can afford to wait for (pending <= g <= room, with 1.5x the expected drafting
time (g - pending) * T_draft within `max_wait` of one verifier forward), and waits that long only
when g > pending. With a slow drafter g = pending and the rule reduces to PipeSpec's. T_verify is
this stage's own measured seconds per forward; T_draft is the drafter's seconds per token, which it
reports with its drafts; a is this stage's measured acceptance rate (accepted / (accepted +
rejections)).

`max_wait` guards against a drafter slower than its reported pace, and against the rate's myopia: it
counts the wait as lost time, though in a pipeline the drafter keeps drafting while the verifier
verifies. Too short, it overrules the rate for any drafter that costs more than a small share of the
verifier; too long, it waits where the rate's myopia misleads it. One forward is the default
(experiments/results/patience/README.md).

The rule is one request's. Where a verifier's forwards carry several requests that step now, none waits
(pipespec.engine.request_protocol, `Surroundings.crowded`): their waits fall together, so the device idles for
all of them, while the drafts they wait for come from a drafter that makes them in one forward for all of them
too (experiments/results/verify_budget/README.md).
"""

from __future__ import annotations


class Patience:
    def __init__(self, max_wait: float = 1.0, smoothing: float = 0.2):
        self.max_wait = max_wait  # fraction of one own forward we may wait for drafts
        self.smoothing = smoothing
        self.verify_s: float | None = None  # EMA of our seconds per forward
        self.accepted = 1.0  # acceptance counts with a weak 50% prior
        self.rejected = 1.0

    def observe_forward(self, seconds: float) -> None:
        s = self.smoothing
        self.verify_s = seconds if self.verify_s is None else (1 - s) * self.verify_s + s * seconds

    def observe_verification(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.accepted += accepted
            self.rejected += accepted < drafted

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def wait_for(self, pending: int, room: int, draft_s: float | None) -> tuple[int, float]:
        """-> (drafts worth having, seconds worth waiting for them); (pending, 0.0): go now."""
        if self.verify_s is None or draft_s is None or room <= pending:
            return pending, 0.0
        a = min(self.acceptance, 0.999)
        budget = self.max_wait * self.verify_s
        affordable = room if draft_s <= 0 else min(room, pending + int(budget / (1.5 * draft_s)))

        def rate(g: int) -> float:
            return (1 - a ** (g + 1)) / (1 - a) / (self.verify_s + (g - pending) * draft_s)

        best = max(range(pending, affordable + 1), key=rate)
        if best == pending:
            return pending, 0.0
        return best, max(1.5 * (best - pending) * draft_s, 1e-4)
