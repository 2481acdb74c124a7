"""The chain model against the runtime on one drafter -> verifier pair, where nothing contends for a core.

    python -m experiments.pair_model [--runs 2] [--tokens 96] [--out experiments/results/pair_model]

Mock stages (`pipespec/stages/mock.py`, not real models) that sleep their latency, in one process
(`LocalPipeline`): so the measured rates are the runtime's protocol and scheduling at those costs, with no
neighbour's tax on a shared machine. A grid of verifiers (8, 16 and 40 ms a forward, a little more per
token it verifies), drafters from a tenth of the verifier's cost to two thirds of it, one or two acceptance
rates each, and a lookahead (`GRID`). For every point, side by side:

- the asynchronous pair measured (tokens per second, the median of --runs over three prompts);
- the best synchronous speculation measured on the same two stages (windows 1, 2, 4);
- PipeSpec's formula with the supply limit, as the chain model had it: n = min(window, T_verifier /
  T_drafter) drafts a step, (1 - rho) + rho * E(n) tokens a step (`async_step`, verify cost included);
- the chain model now (`chain_rates_with_verify_cost`): the same, held to what the drafter supplies
  through its rejections and never below the verifier alone (`pipespec.planning.analytical.drafter_bound`).

Both models take the seconds per step each stage took in the run (its trace: forward, dispatch and
handoff), the measured alpha and the verify window. The verifier's mean step, its verifications
included, stands for its one-token step, and the models add the verify cost on top: a few percent
pessimistic (rho * n * per_token_ms). Writes pair_model.md and pair_model.json under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.bench_engine import time_pipeline, time_sync
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig
from pipespec.engine.trace import decode_step_s
from pipespec.planning.analytical import VERDICT_LAG, async_step, chain_rates_with_verify_cost
from pipespec.stages.build import load_stages

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("experiments/results/pair_model")
SYNC_WINDOWS = (1, 2, 4)
BLOCK = 8  # the verifier's block, for its cost per verified token


@dataclass(frozen=True)
class Verifier:
    """One row of the grid: a verifier and the drafters and acceptance rates put in front of it."""

    forward_ms: float  # a one-token forward
    per_token_ms: float  # each further token it verifies
    lookahead: int  # the drafter's max_lookahead (its verify window is half)
    drafters_ms: tuple[float, ...]
    alphas: tuple[float, ...]


GRID = (
    Verifier(16.0, 0.3, 6, (1.5, 3.5, 7.0, 11.0), (0.6, 0.83)),  # the demo target's cost on this machine
    Verifier(40.0, 0.5, 6, (4.0, 12.0, 20.0, 28.0), (0.75,)),
    Verifier(8.0, 0.2, 12, (1.0, 3.0, 5.0), (0.7, 0.9)),
)


@dataclass(frozen=True)
class Point:
    verifier_ms: float  # asked
    drafter_ms: float  # asked
    lookahead: int
    agreement: float  # configured
    alpha: float  # measured per-token acceptance
    verifier_step_ms: float  # measured: forward, dispatch and handoff per decode step
    drafter_step_ms: float
    tokens_per_s: float  # the asynchronous pair, measured
    sync_tokens_per_s: float  # the best synchronous speculation, measured
    sync_window: int
    formula_tokens_per_s: float  # PipeSpec's formula with the supply limit (the chain model before the drafter bound)
    model_tokens_per_s: float  # the chain model now

    @property
    def formula_gap(self) -> float:
        return self.tokens_per_s / self.formula_tokens_per_s - 1

    @property
    def model_gap(self) -> float:
        return self.tokens_per_s / self.model_tokens_per_s - 1

    def as_dict(self) -> dict:
        return {**asdict(self), "formula_gap": self.formula_gap, "model_gap": self.model_gap}


def pair_config(verifier: Verifier, drafter_ms: float, agreement: float) -> PipelineConfig:
    stages = [
        {"name": "drafter", "kind": "mock", "agreement": agreement, "runner_up": 0.5, "latency_ms": drafter_ms,
         "max_lookahead": verifier.lookahead, "vocab_size": 256},
        {"name": "verifier", "kind": "mock", "agreement": 1.0, "latency_ms": verifier.forward_ms - verifier.per_token_ms,
         "per_token_ms": verifier.per_token_ms, "vocab_size": 256},
    ]  # fmt: skip
    return load_config({"name": "pair", "stages": stages})


def measure(verifier: Verifier, drafter_ms: float, agreement: float, runs: int, tokens: int) -> Point:
    config = pair_config(verifier, drafter_ms, agreement)
    stages = load_stages(config)
    with LocalPipeline(config, stages=stages) as pipe:
        time_pipeline(pipe, tokens)  # warm-up
        pipe.start_trace()
        timed = [time_pipeline(pipe, tokens) for _ in range(runs)]
        traces = pipe.stop_trace()
    drafter_s, verifier_s = (decode_step_s(t) for t in traces)
    alpha = statistics.median(t.alphas[0] for t in timed)
    sync = {g: statistics.median(time_sync(stages[1], stages[0], tokens, g)[0] for _ in range(runs)) for g in SYNC_WINDOWS}
    window = config.window(1)
    block_s = verifier_s + (BLOCK - 1) * verifier.per_token_ms / 1000.0  # a verifier step of BLOCK tokens
    step = async_step(alpha, window, 1.0 / drafter_s, verifier_s, block_s, BLOCK)
    model = chain_rates_with_verify_cost([drafter_s, verifier_s], [drafter_s, block_s], BLOCK, [alpha], [window])[-1]
    best = max(sync, key=sync.get)
    return Point(
        verifier.forward_ms, drafter_ms, verifier.lookahead, agreement, alpha, 1e3 * verifier_s, 1e3 * drafter_s,
        statistics.median(t.tokens_per_s for t in timed), sync[best], best, step.tokens / step.seconds, model,
    )  # fmt: skip


def render(points: list[Point]) -> str:
    lines = [
        "# The chain model against the runtime on one pair, nothing contending for a core",
        "",
        "Sleeping mock stages (not real models) in one process: `python -m experiments.pair_model`. Seconds per",
        "step as traced in the run (forward, dispatch, handoff); alpha measured. *formula*: PipeSpec's with the",
        "supply limit (the chain model before `drafter_bound`); *model*: the chain model now, held to what the",
        f"drafter supplies through its rejections (a verdict {VERDICT_LAG} verifier steps behind its draft).",
        "",
        "| verifier ms | drafter ms | c | lookahead | alpha | async tok/s | sync best tok/s (window) | async / sync "
        "| formula tok/s (gap) | model tok/s (gap) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        c = p.drafter_step_ms / p.verifier_step_ms
        lines.append(
            f"| {p.verifier_ms:g} ({p.verifier_step_ms:.1f}) | {p.drafter_ms:g} ({p.drafter_step_ms:.1f}) "
            f"| {c:.2f} | {p.lookahead} "
            f"| {p.alpha:.2f} | {p.tokens_per_s:.1f} | {p.sync_tokens_per_s:.1f} ({p.sync_window}) "
            f"| {p.tokens_per_s / p.sync_tokens_per_s:.2f}x | {p.formula_tokens_per_s:.1f} ({p.formula_gap:+.0%}) "
            f"| {p.model_tokens_per_s:.1f} ({p.model_gap:+.0%}) |"
        )
    formula, model = [p.formula_gap for p in points], [p.model_gap for p in points]
    ratio = [p.tokens_per_s / p.sync_tokens_per_s for p in points]
    lines += [
        "",
        f"Measured over predicted - 1, over {len(points)} points: formula {min(formula):+.0%} to {max(formula):+.0%}, "
        f"model {min(model):+.0%} to {max(model):+.0%}. "
        f"Async over the best sync measured: {min(ratio):.2f}x to {max(ratio):.2f}x.",
        "(c: the drafter's step over the verifier's, as run; asked latencies first, measured steps in brackets.)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="timed runs per point (and per sync window); the median is kept")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parse_logged(parser, argv)
    if args.runs < 1 or args.tokens < 1:
        parser.error(f"--runs and --tokens must be at least 1, got {args.runs} and {args.tokens}")
    points = []
    for verifier in GRID:
        for drafter_ms in verifier.drafters_ms:
            for agreement in verifier.alphas:
                points.append(measure(verifier, drafter_ms, agreement, args.runs, args.tokens))
                log.info("%s", points[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pair_model.json").write_text(json.dumps([p.as_dict() for p in points], indent=1) + "\n")
    text = render(points)
    (args.out / "pair_model.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
