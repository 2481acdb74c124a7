"""`TokenLogprobs`: the target's log-probability of one generated token and its most likely alternatives.

Computed by the target (pipespec.engine.sampling.token_logprobs) from its own distribution at the token's
position, the same rows the target alone would compute, so they do not depend on what the drafters
proposed. Sent with each `Commit` when a request asks for them (`logprobs=k`), streamed in each
`Delta` beside its token ids. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float  # natural log; -inf where the processed distribution gives the token no mass
    top_ids: tuple[int, ...] = ()  # the k most likely tokens, most likely first
    top_logprobs: tuple[float, ...] = ()  # their logprobs

    @property
    def top(self) -> list[tuple[int, float]]:
        """The k most likely (token id, logprob), most likely first."""
        return list(zip(self.top_ids, self.top_logprobs))
