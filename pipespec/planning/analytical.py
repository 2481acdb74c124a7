"""The analytical throughput models of ../shared/reference.md (PipeSpec, arXiv 2505.01572).

alpha: acceptance rate between neighbouring stages; gamma: window (lookahead);
c = T_draft / T_target. The chain model (`chain_rates`, `chain_rates_with_verify_cost`) gives every stage
a device of its own; `PlacedChain` places stages on devices, those sharing one serializing their forwards.
Every asynchronous link is also held to what its drafter can supply through its rejections
(`drafter_bound`), which PipeSpec's formula leaves out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace


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


VERDICT_LAG = 1.25  # verifier steps from a draft to its verdict reaching the drafter (`drafter_bound`)


def drafter_bound(drafter_s: float, alpha: float, verifier_s: float, foreseen: float = 0.0) -> float:
    """Most tokens a second an asynchronous verifier's sequence grows through its drafter's drafts.

    `drafter_s`: the drafter's seconds per token it yields; `verifier_s`: the verifier's seconds per step.
    The drafter drafts every position the verifier commits (the bonus ones too: measured at alpha 1), one
    forward each, and each rejection costs it the time until the verdict comes back: what it drafted
    meanwhile is thrown away, or it idled at its lookahead bound. Per committed token that is
    drafter_s + (1 - alpha) * lag. The lag is a verifier step plus the wait for the step in progress when
    the draft arrived: none when the verifier waits for drafts (pipespec.engine.patience), half a step when
    it steps back to back; `VERDICT_LAG` steps, between the two. On sleeping mock pairs (no CPU
    contention; experiments.pair_model) this model holds where PipeSpec's formula overpredicts: a drafter
    a quarter of its verifier's cost or more is the bottleneck of an asynchronous pair, and its rejections
    are what that costs. A rejection a pre-drafted branch foresaw (a share `foreseen` of them:
    pipespec.engine.outcome_cache) costs no lag: the branch's tokens go out as the verdict comes.
    """
    return 1.0 / (drafter_s + (1.0 - alpha) * (1.0 - foreseen) * VERDICT_LAG * verifier_s)


def linked_rate(step_rate: float, drafter_rate: float, alpha: float, one_s: float, step_s: float, foreseen: float = 0.0) -> float:
    """An asynchronous verifier's rate: what its steps yield (`step_rate`), held to what its drafter can
    supply (`drafter_bound`, `foreseen` its share of rejections a branch answers); that bound is never
    taken below generating alone (1 / `one_s`: a verifier never idles for want of drafts)."""
    return min(step_rate, max(1.0 / one_s, drafter_bound(1.0 / drafter_rate, alpha, step_s, foreseen)))


def chain_rates(
    latencies_s: Sequence[float], alphas: Sequence[float], lookaheads: Sequence[int], foreseen: Sequence[float] = ()
) -> list[float]:
    """Predicted tokens per second that each stage of an asynchronous chain yields, upstream first.

    latencies_s[i]: stage i's seconds per forward (the last is the target); alphas[i]: per-token
    acceptance of stage i's drafts by stage i + 1; lookaheads[i]: how far stage i may run ahead.

    The first drafter yields one token per forward. Stage i + 1, during one of its forwards, receives
    n = min(lookahead_i, rate_i * T_{i+1}) drafts from upstream (the supply limit that PipeSpec's
    formula leaves out), and steps on whether or not they have arrived: with PipeSpec's steady-state
    probability rho(alpha, n) a step verifies and yields expected_accepted(alpha, n) tokens, otherwise
    one. So rate_{i+1} = ((1 - rho) + rho * expected_accepted(alpha, n)) / T_{i+1}; with ample supply
    this is PipeSpec's E[N] / T_target. Each rate is then held within `linked_rate`: no more than the
    drafter supplies through its rejections (less those its pre-drafted branches foresaw: `foreseen[i]`,
    stage i's share, 0 where not given), no less than the stage generating alone.
    """
    assert len(latencies_s) == len(alphas) + 1 == len(lookaheads) + 1, "one alpha and one lookahead per drafter"
    rates = [1.0 / latencies_s[0]]
    for i, (alpha, gamma, t) in enumerate(zip(alphas, lookaheads, latencies_s[1:])):
        n = min(float(gamma), rates[-1] * t)
        rho = alpha / (1 - alpha ** (n + 1) + alpha) if alpha > 0 else 0.0
        h = foreseen[i] if i < len(foreseen) else 0.0
        rates.append(linked_rate(((1 - rho) + rho * expected_accepted(alpha, n)) / t, rates[-1], alpha, t, t, h))
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


@dataclass(frozen=True)
class Step:
    """A stage's mean forward in a chain's steady state."""

    drafts: float  # n: drafts one of its verifications takes (0 for the first stage)
    verifying: float  # rho: the share of its forwards that verify drafts
    seconds: float  # mean seconds of a forward
    tokens: float  # mean tokens of its own sequence that a forward yields


def async_step(
    alpha: float, window: int, supply: float, one_s: float, block_s: float, block_tokens: int, iterations: int = 100
) -> Step:
    """A verifier stepping on its own device while its drafter supplies `supply` drafts a second.

    During a step of T seconds, n = min(window, supply * T) drafts arrive; with PipeSpec's rho(alpha, n)
    the step verifies them and costs T(n + 1) (`forward_latency`), otherwise it costs T(1). n depends on
    T, so T is the least fixed point of T = (1 - rho) * T(1) + rho * T(n + 1), iterated from T(1).
    PipeSpec's step, no more: `linked_step` holds it to what the drafter supplies through its rejections."""
    seconds = one_s
    for _ in range(iterations):
        n = min(float(window), supply * seconds)
        rho = verification_probability(alpha, n) if alpha > 0 else 0.0
        step_s = (1 - rho) * one_s + rho * forward_latency(one_s, block_s, block_tokens, n + 1)
        converged = abs(step_s - seconds) <= 1e-12 * step_s
        seconds = step_s
        if converged:
            break
    n = min(float(window), supply * seconds)
    rho = verification_probability(alpha, n) if alpha > 0 else 0.0
    return Step(n, rho, seconds, (1 - rho) + rho * expected_accepted(alpha, n))


def linked_step(step: Step, supply: float, alpha: float, one_s: float) -> Step:
    """`async_step`'s step with its tokens held within `linked_rate` over the same seconds: a drafter that
    cannot keep up through its rejections leaves the verifier stepping with fewer."""
    return replace(step, tokens=linked_rate(step.tokens / step.seconds, supply, alpha, one_s, step.seconds) * step.seconds)


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
    `verify_tokens`-token forward (see `forward_latency`). Each verifier's mean step is `async_step`'s,
    upstream first: its rate is that step's tokens over its seconds (`drafter_bound` included). With flat
    verify costs (verify_latencies_s == latencies_s) this is exactly `chain_rates`.
    """
    assert len(latencies_s) == len(verify_latencies_s) == len(alphas) + 1 == len(lookaheads) + 1
    rates = [1.0 / latencies_s[0]]
    for j in range(1, len(latencies_s)):
        alpha, one_s = alphas[j - 1], latencies_s[j]
        step = async_step(alpha, lookaheads[j - 1], rates[-1], one_s, verify_latencies_s[j], verify_tokens, iterations)
        step = linked_step(step, rates[-1], alpha, one_s)
        rates.append(step.tokens / step.seconds)
    return rates


@dataclass(frozen=True)
class PlacedChain:
    """A chain as the model sees it, upstream first: each stage's 1-token and `verify_tokens`-token forward
    seconds (`latencies_s`, `verify_latencies_s`), each link's acceptance and window (`alphas`, `windows`, as in
    `chain_rates_with_verify_cost`), and the device each stage runs on (`devices`: stages on one device share it)."""

    latencies_s: Sequence[float]
    verify_latencies_s: Sequence[float]
    verify_tokens: int
    alphas: Sequence[float]
    windows: Sequence[int]
    devices: Sequence[Hashable]

    def __post_init__(self) -> None:
        stages = len(self.latencies_s)
        if not stages == len(self.verify_latencies_s) == len(self.alphas) + 1 == len(self.windows) + 1 == len(self.devices):
            raise ValueError(f"a placed chain of {stages} stages needs as many latencies and devices, one link fewer")

    def steps(self) -> tuple[list[Step], list[float]]:
        """Each stage's mean step and the rate of its own sequence (tokens a second).

        A link whose drafter runs on another device is asynchronous (`async_step`, then `linked_step`). A link
        whose drafter shares the verifier's device is synchronous: the device runs one forward at a time, so the
        verifier waits while its drafter supplies a full window of w drafts (w / rate_drafter seconds of that
        device), then verifies them all: rho = 1, a step costs T(w + 1), and the verifier's sequence grows at
        expected_accepted(alpha, w) / (w / rate_drafter + T(w + 1)) tokens a second.
        """
        one, block, devices = self.latencies_s, self.verify_latencies_s, self.devices
        steps, rates = [Step(0.0, 0.0, one[0], 1.0)], [1.0 / one[0]]
        for j in range(1, len(one)):
            alpha, w = self.alphas[j - 1], self.windows[j - 1]
            if devices[j] == devices[j - 1]:
                seconds = forward_latency(one[j], block[j], self.verify_tokens, w + 1)
                step = Step(float(w), 1.0, seconds, expected_accepted(alpha, w))
                rates.append(step.tokens / (w / rates[-1] + step.seconds))
            else:
                supplied = async_step(alpha, w, rates[-1], one[j], block[j], self.verify_tokens)
                step = linked_step(supplied, rates[-1], alpha, one[j])
                rates.append(step.tokens / step.seconds)
            steps.append(step)
        return steps, rates

    def rate(self) -> float:
        """Predicted committed tokens per second.

        Two bounds, the smaller wins. Dependencies: the target's rate in `steps` (asynchronous links across
        devices, synchronous ones within a device). Devices: a device runs one forward at a time, so the rate
        is at most 1 / the most loaded device's seconds per committed token (`device_loads`).

        What it assumes: every stage's latencies are those of its device alone (profiled at that device's
        threads); a verifier that shares its drafter's device takes full windows (the device's scheduler lets
        the drafter fill the window before the verifier steps); a stage that shares a device with one that is
        not its neighbour is supplied, in the dependency bound, as if it ran alone, so that bound is optimistic
        there and the device bound is the one that holds. Consequences: where every device holds consecutive
        stages the device bound never binds below the dependency one (a block of stages works per committed
        token at most as long as the stage it feeds), so with a device per stage this is
        `chain_rates_with_verify_cost`; a drafter and its target on one device give exactly `sync_rate`; every
        stage on one device gives the sum of all forwards per committed token, hierarchical synchronous
        speculation.
        """
        steps, rates = self.steps()
        return min(rates[-1], 1.0 / max(device_loads(steps, self.devices).values()))


def device_loads(steps: Sequence[Step], devices: Sequence[Hashable]) -> dict[Hashable, float]:
    """Seconds of work each device does per committed token, for a chain's `PlacedChain.steps`.

    Downstream first: the target steps 1 / tokens_t times per committed token; stage i + 1, stepping F
    times, verifies on F * verifying of them, each taking `drafts` of stage i's tokens, and stage i
    yields `tokens` of them a forward, so stage i steps F * verifying * drafts / tokens_i times. A
    device's load is the sum over its stages of steps times seconds a step."""
    loads: dict[Hashable, float] = {}
    forwards = 1.0 / steps[-1].tokens
    for j in range(len(steps) - 1, -1, -1):
        loads[devices[j]] = loads.get(devices[j], 0.0) + forwards * steps[j].seconds
        if j:
            forwards *= steps[j].verifying * steps[j].drafts / steps[j - 1].tokens
    return loads


def client_rate(rate: float, tokens: Sequence[int], first_s: Sequence[float]) -> float:
    """Tokens a second as a client sees whole requests: request k yields `tokens[k]` tokens, its first after
    `first_s[k]` seconds (the target's prefill: the first token is the target's own), the rest at `rate`."""
    return sum(tokens) / sum(f + max(0, n - 1) / rate for n, f in zip(tokens, first_s))


def sync_rate(alpha: float, gamma: int, draft_s: float, verify_s: float) -> float:
    """Tokens per second of synchronous speculative decoding: gamma drafter forwards of `draft_s`, then
    one target forward of `verify_s` over the gamma + 1 tokens, yielding expected_accepted(alpha, gamma).
    With verify_s the target's 1-token latency T_t this is sync_speedup(alpha, gamma, draft_s / T_t) / T_t."""
    return expected_accepted(alpha, gamma) / (gamma * draft_s + verify_s)
