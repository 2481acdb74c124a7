"""The analytical throughput models of ../shared/reference.md (PipeSpec, arXiv 2505.01572).

alpha: acceptance rate between neighbouring stages; gamma: window (lookahead);
c = T_draft / T_target.
"""

from __future__ import annotations


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
