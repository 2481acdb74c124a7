"""Outcome-cached pre-drafting: what a drafter drafts ahead, for the verdicts it expects.

Whatever a drafter drafts, its verifier answers with a verdict: the verifier's token t at some position
p. Either it rejected our draft at p (t is another token) or it accepted all we sent and t is its bonus
token right after. Either way our next work is a continuation after (p, t), one forward per token, while
the verifier waits for it. So a drafter drafts those continuations ahead ("branches"), for the outcomes
it finds likeliest:

- a rejection at a position we drafted, with one of the `ALTERNATIVES` tokens we ranked next there;
- full acceptance: after our last token, the token we would draft next ourselves;

each as likely as our own probabilities make it (the verifier's token t at p: every token before p
accepted, then t, as likely as we found t there), the likeliest first. Where a forward costs a forward
whatever it feeds (a GPU's, a few lines at once), every branch grows one token beside each forward of the
drafter (`riders`: a tree forward, pipespec.engine.stage.TreeSession); elsewhere only a waiting drafter
grows them, one forward a token.

(A verdict may carry more tokens after t, a branch the verifier itself took: `Verdict.after`. Then (p, t)
is where they first differ from ours, and a branch of ours there serves what it holds past them.)

A verdict that matches a branch is answered at once: the branch's tokens become ours and go downstream
in the same turn of the event loop, and the cache entries its forwards wrote become the request's (no
forward); a middle stage hands them to its own drafter in its Verdict. A verdict that matches none costs
what it cost before. Exactness is untouched: a branch holds the tokens our own steps would produce after
(p, t) (the same forwards, the same choice at the same positions: a tree forward's side lines are decided as
its own steps would), and the verifier verifies them like any draft.

One KV cache holds all lines of a request: the main line and the branches share the context before their
position. Each line knows how many of its context tokens the cache holds (`fed`); a forward that keeps
`keep` entries overwrites the rest, so every other line's count drops to at most `keep` (`overwritten`).
A branch grown beside a step keeps nothing in the cache: its line is fed from what it shares with the
step's (pipespec.engine.step.Rider), and the token after a hit feeds the branch's tokens first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ALTERNATIVES = 2  # other tokens a doubt holds: ranks 2 and 3 hold 71-72% of the demo drafters' rejections, rank 2 alone
# 49-51% (experiments/results/predraft/draft_ranks.md)


@dataclass(frozen=True)
class Doubt:
    """What we thought at a position we drafted: our choice's probability there, and the likeliest other
    tokens with theirs (the likeliest first): the verifier's tokens a rejection there may bring."""

    chosen_p: float
    others: tuple[tuple[int, float], ...]


SURE = Doubt(1.0, ())  # a position we hold no ranking for (a verifier's token, or one a branch hit brought)


@dataclass
class Branch:
    """Our continuation if the verifier puts `token` at `position` (the full-acceptance branch learns its
    token from its first forward: None until then)."""

    position: int
    token: int | None
    fed: int  # context tokens of this line the cache holds (prompt + tokens[:position] + [token] + tokens)
    tokens: list[int] = field(default_factory=list)  # at position + 1 ..
    probs: list[torch.Tensor | None] = field(default_factory=list)  # our p' per token (rejection sampling)
    done: bool = False  # grown as far as it may


@dataclass
class OutcomeCache:
    """One request's branches on one drafter, and its doubts: per position we drafted, what we thought there."""

    fanout: int  # most branches held at once
    depth: int  # most tokens per branch
    branches: list[Branch] = field(default_factory=list)
    doubts: dict[int, Doubt] = field(default_factory=dict)

    def decided(self, start: int, doubts: Sequence[Doubt]) -> None:
        """Our main line decided tokens from `start` on, with these doubts: a branch there would only repeat
        its forwards."""
        self.branches = [b for b in self.branches if b.position < start]
        self.doubts.update((start + i, doubt) for i, doubt in enumerate(doubts))

    def overwritten(self, keep: int) -> None:
        """A forward keeps the cache's first `keep` entries and writes past them."""
        for branch in self.branches:
            branch.fed = min(branch.fed, keep)

    def to_grow(self, length: int, verified: int, fed: int, prompt_len: int) -> Branch | None:
        """The branch to grow next for a request holding `length` tokens, `verified` of them confirmed, `fed`
        context tokens of its main line in the cache; None if there is nothing worth drafting."""
        growing = next((b for b in self.branches if not b.done), None)
        return growing or self._open(length, verified, fed, prompt_len, ahead=True)

    def riders(self, length: int, verified: int, fed: int, prompt_len: int, beside: Branch | None) -> list[Branch]:
        """The branches to grow one token each beside a forward of `beside` (None: of the main line), in a
        tree forward (pipespec.engine.stage.TreeSession): every one still growing, and new ones up to `fanout`.
        Beside the main line, no full-acceptance branch: the main line is drafting it."""
        riders = [b for b in self.branches if not b.done and b is not beside and (beside is not None or b.position < length)]
        while (
            len(self.branches) < self.fanout
            and (new := self._open(length, verified, fed, prompt_len, beside is not None)) is not None
        ):
            riders.append(new)
        return riders

    def _open(self, length: int, verified: int, fed: int, prompt_len: int, ahead: bool) -> Branch | None:
        """A new branch for the likeliest outcome no branch holds yet (`ahead`: full acceptance is one)."""
        if len(self.branches) >= self.fanout:
            return None
        held = {(b.position, b.token) for b in self.branches}
        likely, reach = {}, 1.0  # (position, verifier's token) -> how likely, by our own probabilities
        for p in range(verified, length):
            doubt = self.doubts.get(p, SURE)
            # all before p accepted, then t at p (a token we found impossible is no outcome)
            likely.update(((p, t), reach * q) for t, q in doubt.others if q > 0 and (p, t) not in held)
            reach *= doubt.chosen_p
        if ahead and not any(b.position == length for b in self.branches):
            likely[(length, None)] = reach  # all accepted
        if not likely:
            return None
        p, token = max(likely, key=likely.__getitem__)
        branch = Branch(p, token, min(fed, prompt_len + p - (token is None)))
        self.branches.append(branch)
        return branch

    def grown(self, branch: Branch, token: int, prob: torch.Tensor | None, fed: int, full: bool) -> None:
        """`branch`'s forward decided `token` (its key token, for a full-acceptance branch's first); the
        cache now holds `fed` of its context tokens; `full`: it may grow no further."""
        if branch.token is None:
            branch.token = token
        else:
            branch.tokens.append(token)
            branch.probs.append(prob)
        branch.fed = fed
        branch.done = full or len(branch.tokens) >= self.depth

    def verdict(self, position: int, token: int, changed: bool) -> Branch | None:
        """The verifier put `token` at `position` (`changed`: it is not what we held there). -> the branch
        that foresaw it, if any (its forward still in flight or not). Branches and doubts that can no longer
        match are dropped: those at or before `position` (confirmed now), and all when our tokens changed."""
        self.doubts = {p: d for p, d in self.doubts.items() if position < p and not changed}
        if not changed:
            self.branches = [b for b in self.branches if b.position > position]
            return None
        hit = next((b for b in self.branches if b.position == position and b.token == token), None)
        self.branches.clear()
        return hit

    def holds(self, branch: Branch) -> bool:
        return any(b is branch for b in self.branches)
