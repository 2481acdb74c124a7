"""Choice functions and verifiers: how a stage turns logits into tokens and judges drafts.

One function, `decide`, is the whole speculative step of a stage: given its logits at positions
start..start+n (rows [n + 1, V]) and the n tokens its drafter proposed at start..start+n-1, it returns
how many drafts it accepts and its own token right after them (a correction or a bonus). With no
drafts it simply generates one token. Every stage, the target included, goes through here, so the
pipeline's output equals the target alone by construction:

- greedy: argmax of the logits.
- coupled (temperature > 0): argmax(log p'(x) + g(seed, position, x)) with counter-based Gumbel
  noise g shared by every stage (stream 0). Exact match verification, like greedy.
- rejection: Leviathan et al.; each stage draws from its own noise streams, accepts a draft x with
  probability min(1, p(x) / q(x)), samples the normalised residual max(0, p - q) on rejection, and
  returns its own p for the tokens it emits so the next stage can use them as q.

Logits may be on any device; the noise is drawn there (pipespec.engine.noise gives every device the same
numbers), and a drafter's q rows are moved there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipespec.engine import noise
from pipespec.engine.outcome_cache import Doubt
from pipespec.engine.sampling import log_processed
from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.messages import Siblings
from pipespec.protocol.params import SamplingParams


@dataclass(frozen=True)
class Decision:
    accepted: int  # number of leading draft tokens accepted
    tokens: tuple[int, ...]  # drafts[:accepted] + (own token,)
    probs: torch.Tensor | None  # [accepted + 1, V] float64: this stage's p' at those positions (rejection only)
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token: the target's, when the request asks (pipespec.engine.step)
    doubts: tuple[Doubt, ...] | None = None  # per token: what we thought there, to pre-draft (pipespec.engine.outcome_cache)
    agreed: int | None = None  # a tree's: how many drafts of the drafter's line it took (None: `accepted`)
    siblings: tuple[Siblings, ...] | None = None  # per token: its siblings, offered with it (a drafter's `tree`)

    @property
    def line(self) -> int:
        """How many of the drafter's line of drafts it took: all it accepted, but where a tree's path left the line."""
        return self.accepted if self.agreed is None else self.agreed


def rejection_streams(depth: int) -> tuple[int, int, int]:
    """(sample, accept, residual) noise streams of the stage `depth` hops above the target."""
    return 3 * depth + 1, 3 * depth + 2, 3 * depth + 3


def scores(logits: torch.Tensor, params: SamplingParams, start: int) -> torch.Tensor:
    """logits [n, V] at positions start.. -> choice scores [n, V]; a stage's token is the argmax."""
    if params.greedy:
        return logits.to(torch.float32)
    logp = log_processed(logits, params)
    v = logits.shape[-1]
    g = noise.gumbel_rows(params.seed, start, len(logp), v, 0, logits.device)  # [n, V]
    return logp + g


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to sample after rejecting a draft: norm(max(0, p - q)). p, q: [V]."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def sample(probs: torch.Tensor, seed: int, position: int, stream: int) -> int:
    """Exact sample of probs [V] by Gumbel-max with counter noise."""
    g = noise.gumbel(seed, position, probs.shape[-1], stream, probs.device)
    return int(torch.argmax(torch.log(probs) + g))


def decide(
    logits: torch.Tensor,  # [n + 1, V] this stage's logits at positions start..start+n
    drafts: Sequence[int],  # n drafted tokens at positions start..start+n-1
    draft_probs: torch.Tensor | None,  # [n, V] the drafter's p' (rejection only), on any device
    params: SamplingParams,
    start: int,
    depth: int,  # hops from this stage to the target (target = 0)
) -> Decision:
    n = len(drafts)
    assert logits.shape[0] == n + 1, (logits.shape, n)
    if not params.rejection:
        choices = torch.argmax(scores(logits, params, start), dim=-1).tolist()
        accepted = 0
        while accepted < n and choices[accepted] == drafts[accepted]:
            accepted += 1
        return Decision(accepted, tuple(drafts[:accepted]) + (choices[accepted],), None)

    assert draft_probs is not None or n == 0, "rejection sampling needs the drafter's q"
    p = torch.exp(log_processed(logits, params))  # [n + 1, V]
    if n:
        draft_probs = draft_probs.to(p.device)  # the drafter's device, or the CPU they crossed the wire on
    s_sample, s_accept, s_residual = rejection_streams(depth)
    for i, x in enumerate(drafts):
        q = draft_probs[i]
        if noise.scalar_uniform(params.seed, start + i, s_accept) * float(q[x]) < float(p[i, x]):
            continue  # accepted with probability min(1, p(x) / q(x))
        token = sample(residual(p[i], q), params.seed, start + i, s_residual)
        return Decision(i, tuple(drafts[:i]) + (token,), p[: i + 1])
    token = sample(p[n], params.seed, start + n, s_sample)
    return Decision(n, tuple(drafts) + (token,), p)


def generate_each(rows: torch.Tensor, starts: Sequence[int], params: SamplingParams, depth: int) -> list[Decision]:
    """rows [R, V] of R lines, each at its own position starts[i] -> `decide` with no drafts on each: the token
    each line generates next (greedy: one argmax for all)."""
    if params.greedy:
        return [Decision(0, (token,), None) for token in torch.argmax(scores(rows, params, 0), dim=-1).tolist()]
    return [decide(rows[i : i + 1], (), None, params, start, depth) for i, start in enumerate(starts)]
