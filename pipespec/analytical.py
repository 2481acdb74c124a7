"""The analytical throughput models of ../shared/reference.md (PipeSpec, arXiv 2505.01572).

alpha: acceptance rate between neighbouring stages; gamma: window (lookahead);
c = T_draft / T_target.
"""

from __future__ import annotations

from collections.abc import Sequence


def sync_speedup(alpha: float, gamma: int, c: float) -> float:
    """Synchronous speculative decoding (Leviathan et al.) over the target alone."""
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def verification_probability(alpha: float, gamma: int) -> float:
    """PipeSpec: steady-state probability that a step of a stage is a verification step."""
    return alpha / (1 - alpha ** (gamma + 1) + alpha)


def tokens_per_step(alpha: float, gamma: int) -> float:
    """PipeSpec: expected tokens committed per step of a verifying stage, E[N] > 1 for alpha > 0."""
    rho = verification_probability(alpha, gamma)
    accepted = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return (1 - rho) + rho * accepted


def pipeline_speedup(alpha: float, gamma: int) -> float:
    """PipeSpec over the target alone: the target keeps stepping, E[N] tokens a step."""
    return tokens_per_step(alpha, gamma)


def expected_accepted(alpha: float, n: float) -> float:
    """Expected tokens one verification yields from n drafts: the accepted prefix plus the verifier's own
    token, (1 - alpha^(n+1)) / (1 - alpha). n may be fractional (an average supply of drafts)."""
    if alpha >= 1.0:
        return n + 1
    return (1 - alpha ** (n + 1)) / (1 - alpha)


def chain_rates(latencies_s: Sequence[float], alphas: Sequence[float], lookaheads: Sequence[int]) -> list[float]:
    """Predicted tokens per second that each stage of an asynchronous chain yields, upstream first.

    latencies_s[i]: stage i's seconds per forward (the last is the target); alphas[i]: per-token
    acceptance of stage i's drafts by stage i + 1; lookaheads[i]: how far stage i may run ahead.

    The first drafter yields one token per forward. Stage i + 1, during one of its forwards, receives
    n = min(lookahead_i, rate_i * T_{i+1}) drafts from upstream (the supply limit that PipeSpec's
    formula leaves out), and steps on whether or not they have arrived: with PipeSpec's steady-state
    probability rho(alpha, n) a step verifies and yields expected_accepted(alpha, n) tokens, otherwise
    one. So rate_{i+1} = ((1 - rho) + rho * expected_accepted(alpha, n)) / T_{i+1}; with ample supply
    this is PipeSpec's E[N] / T_target.
    """
    assert len(latencies_s) == len(alphas) + 1 == len(lookaheads) + 1, "one alpha and one lookahead per drafter"
    rates = [1.0 / latencies_s[0]]
    for alpha, gamma, t in zip(alphas, lookaheads, latencies_s[1:]):
        n = min(float(gamma), rates[-1] * t)
        rho = alpha / (1 - alpha ** (n + 1) + alpha) if alpha > 0 else 0.0
        rates.append(((1 - rho) + rho * expected_accepted(alpha, n)) / t)
    return rates


def chain_speedup(latencies_s: Sequence[float], alphas: Sequence[float], lookaheads: Sequence[int]) -> float:
    """Predicted speedup of an asynchronous chain over its target alone (one token per target forward)."""
    return chain_rates(latencies_s, alphas, lookaheads)[-1] * latencies_s[-1]


def forward_latency(one_s: float, block_s: float, block_tokens: int, tokens: float) -> float:
    """Seconds of one forward that feeds `tokens` tokens, from two measurements: `one_s` for 1 token and
    `block_s` for `block_tokens` tokens. Linear in between and beyond (a verifier's block is nearly flat on
    a GPU or in bf16, not in fp32 on a CPU), never cheaper than one token."""
    if block_tokens <= 1 or tokens <= 1:
        return one_s
    per_token = max(0.0, (block_s - one_s) / (block_tokens - 1))
    return one_s + per_token * (tokens - 1)


def chain_rates_with_verify_cost(
    latencies_s: Sequence[float],
    verify_latencies_s: Sequence[float],
    verify_tokens: int,
    alphas: Sequence[float],
    lookaheads: Sequence[int],
    iterations: int = 100,
) -> list[float]:
    """`chain_rates` where a verifying forward costs more than a one-token one.

    latencies_s[i]: stage i's seconds for a 1-token forward; verify_latencies_s[i]: for a
    `verify_tokens`-token forward (see `forward_latency`). A verification step of stage i + 1 feeds its
    n drafts plus its own last token, so with PipeSpec's rho(alpha, n) its mean step costs
    (1 - rho) * T(1) + rho * T(n + 1). n itself depends on the step time (drafts that arrive during one
    step), so each stage's effective latency is the least fixed point of that equation, found by
    iterating from T(1) upstream first; `chain_rates` over the effective latencies gives the rates.
    With flat verify costs (verify_latencies_s == latencies_s) this is exactly `chain_rates`.
    """
    assert len(latencies_s) == len(verify_latencies_s) == len(alphas) + 1 == len(lookaheads) + 1
    effective = list(latencies_s)
    for j in range(1, len(effective)):
        supply = chain_rates(effective[:j], alphas[: j - 1], lookaheads[: j - 1])[-1]
        alpha, gamma = alphas[j - 1], lookaheads[j - 1]
        for _ in range(iterations):
            n = min(float(gamma), supply * effective[j])
            rho = verification_probability(alpha, n) if alpha > 0 else 0.0
            verify_s = forward_latency(latencies_s[j], verify_latencies_s[j], verify_tokens, n + 1)
            step_s = (1 - rho) * latencies_s[j] + rho * verify_s
            converged = abs(step_s - effective[j]) <= 1e-12 * step_s
            effective[j] = step_s
            if converged:
                break
    return chain_rates(effective, alphas, lookaheads)


def sync_rate(alpha: float, gamma: int, draft_s: float, verify_s: float) -> float:
    """Tokens per second of synchronous speculative decoding: gamma drafter forwards of `draft_s`, then
    one target forward of `verify_s` over the gamma + 1 tokens, yielding expected_accepted(alpha, gamma).
    With verify_s the target's 1-token latency T_t this is sync_speedup(alpha, gamma, draft_s / T_t) / T_t."""
    return expected_accepted(alpha, gamma) / (gamma * draft_s + verify_s)
