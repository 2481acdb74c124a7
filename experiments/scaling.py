"""Scaling sweep: tokens per second and speedup against the number of devices, measured and predicted.

    python -m experiments.scaling [--devices 4] [--time-scale 0.1] [--tokens 64] [--runs 3] [--predraft 0]
                                  [--real | --no-real] [--out experiments/results/scaling]

One device per pipeline stage. Two sweeps, each next to the analytical chain model
(`pipespec.planning.analytical.chain_rates`, upstream stages feeding the target) on the same axes:

1. EMULATED (beyond the hardware at hand): mock stages (`pipespec/stages/mock.py`, not real models) that
   sleep a published-like per-forward latency and agree with the next model at a chosen rate, so
   many of them run on two cores. d devices run the last d models of the chain

       68M -> 1B -> 8B -> 70B          (d = 1: the 70B alone; d = 2: 8B -> 70B; ...)

   The 70B's 123.7 ms per forward is PipeSpec's published figure (Llama-3.1-70B in 4-bit on
   A100s, ../shared/reference.md; it needed two A100-40GB there, one "device" here). The 8B, 1B and
   68M-class latencies (25 / 8 / 3 ms) and every acceptance rate (0.7 / 0.8 / 0.8) are ASSUMED
   (see CHAIN). `--time-scale` shrinks every latency so the sweep runs fast; the reported tokens
   per second are rescaled to the emulated A100 clock (wall rate x time scale), ratios unchanged.
   Per device count: the asynchronous pipeline in process (`LocalPipeline`), the best synchronous
   speculation (any drafter of the chain straight into the 70B, window 2 / 4 / 8) for reference,
   each the median of --runs runs; the prediction uses the seconds per step (traced: a sleep lasts
   a little longer than asked, and the runtime adds its dispatch and handoff), the drafters' verify
   windows and the per-token acceptance alpha MEASURED in the run (and, beside it, the configured
   latencies and rates).
   The gap quoted is measured / predicted - 1. With --predraft N every drafter pre-drafts N
   branches (pipespec.engine.outcome_cache), each grown a token beside every step it takes (a mock
   runs a tree of lines as one forward, as a GPU does: pipespec.engine.stage.TreeSession; a mock
   forward lasts its latency, the arithmetic standing in for the model's included). Where an emulated
   drafter disagrees with the next model, it ranks that model's token second with probability
   `runner_up` (0.5, ASSUMED: the demo's drafters measure 0.49 and 0.51) and third with probability
   `third` (0.22: they measure 0.24 and 0.20), which is what a rejection branch bets on. The chain
   model takes each pair's measured hit rate: a rejection a branch foresaw costs its drafter no lag
   (`pipespec.planning.analytical.drafter_bound`).

2. REAL (this machine): the shipped demo models (`models/demo`) on a local Ray, one actor per
   device (a CPU core here, a GPU where the cluster has them): d = 1 the target alone, d = 2
   tiny -> target (the cheapest drafter), d = 3 tiny -> dream -> target, as far as the devices go.
   The prediction uses each stage's measured seconds per forward and each pair's measured alpha.
   A real stage that fails (a model that does not load) ends the real sweep with a message; the
   emulated figures are written all the same and the exit status is 1.

Writes scaling.md (the table), scaling.json and scaling.png (tokens per second and speedup against
devices; measured solid, predicted dashed) under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from experiments.bench_engine import PROMPTS, SYNC_WINDOWS, spec, time_pipeline, time_sync
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import ConfigError, PipelineConfig
from pipespec.engine.stage import Stage
from pipespec.engine.synchronous import generate_sync
from pipespec.engine.trace import decode_step_s
from pipespec.planning.analytical import chain_rates, sync_speedup
from pipespec.protocol.stats import StageStats, merged_pairs, merged_stages
from pipespec.requests.outputs import Generation

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("experiments/results/scaling")
Tick = Callable[[str], None]  # progress callback: called once per finished unit of work, with a label


@dataclass(frozen=True)
class EmulatedModel:
    """One model of the emulated chain: a mock stage with this latency and agreement."""

    name: str
    latency_ms: float  # per forward on the emulated hardware (A100), before --time-scale
    agreement: float  # per-token acceptance of its drafts by the next model (unused for the target)
    source: str  # where latency_ms comes from: "published" or "assumed"
    runner_up: float = 0.5  # where it disagrees, how often the next model's token is its second choice (the
    # demo's drafters: 0.49 and 0.51, experiments/results/predraft/draft_ranks.md); what pre-drafting bets on
    third: float = 0.22  # ... and its third (the demo's drafters: 0.24 and 0.20)


CHAIN: tuple[EmulatedModel, ...] = (
    EmulatedModel("68M", 3.0, 0.7, "assumed"),
    EmulatedModel("1B", 8.0, 0.8, "assumed"),
    EmulatedModel("8B", 25.0, 0.8, "assumed"),
    EmulatedModel("70B", 123.7, 1.0, "published"),  # PipeSpec: Llama-3.1-70B 4-bit, 4x A100-40GB
)
REAL_CHAINS: tuple[tuple[str, ...], ...] = (("target",), ("tiny", "target"), ("tiny", "dream", "target"))


@dataclass(frozen=True)
class ScalingRow:
    """One device count of one sweep: what was measured and what the chain model predicts."""

    sweep: str  # "emulated" or "real"
    devices: int
    chain: str  # "8B -> 70B"
    tokens_per_s: float  # measured, median over runs (emulated: on the emulated clock)
    predicted_tokens_per_s: float  # chain_rates with the measured alphas and seconds per step (real: per forward)
    speedup: float  # measured, over the measured d = 1 of the same sweep
    predicted_speedup: float  # over the predicted d = 1 of the same sweep
    alphas: tuple[float, ...]  # measured per-token acceptance per pair, upstream first
    exact: bool  # every output equals the target alone's
    configured_tokens_per_s: float | None = None  # emulated: chain_rates with the configured alphas
    sync_tokens_per_s: float | None = None  # emulated, d >= 2: best synchronous speculation
    sync_predicted_tokens_per_s: float | None = None
    sync_best: str | None = None  # "1B, window 4"
    step_ms: tuple[float, ...] = ()  # emulated: per stage, measured ms per step on the emulated clock (the model's)
    predraft_hit_rates: tuple[float, ...] | None = None  # emulated, pre-drafting on: per drafter, upstream first, the
    # changed verdicts a branch foresaw

    @property
    def gap(self) -> float:
        """measured / predicted - 1."""
        return self.tokens_per_s / self.predicted_tokens_per_s - 1

    @property
    def speedup_gap(self) -> float:
        """measured speedup / predicted speedup - 1: the gap left once d = 1's is factored out."""
        return self.speedup / self.predicted_speedup - 1

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gap": self.gap, "speedup_gap": self.speedup_gap}


def predicted_tokens_per_s(
    latencies_s: Sequence[float], alphas: Sequence[float], windows: Sequence[int], foreseen: Sequence[float] = ()
) -> float:
    """The target's rate in the chain model; `windows[i]`: most drafts of stage i one step of stage
    i + 1 verifies (the model's gamma); `foreseen[i]`: stage i's share of rejections a branch answered."""
    return chain_rates(latencies_s, alphas, windows, foreseen)[-1]


def verify_windows(config: PipelineConfig) -> list[int]:
    """Per drafter: how many of its drafts its verifier checks per step at most."""
    return [config.window(i + 1) for i in range(len(config.stages) - 1)]


# ---- the emulated sweep -------------------------------------------------------------------------


def emulated_config(
    models: Sequence[EmulatedModel], time_scale: float, lookahead: int, predraft: int = 0, vocab: int = 256, max_batch: int = 1
) -> PipelineConfig:
    """`predraft`: branches each drafter pre-drafts (pipespec.engine.outcome_cache); `max_batch`: requests one
    forward of each stage carries (the mock's batched cost model: a forward costs its latency however many)."""
    stages = [
        {
            "name": m.name, "kind": "mock", "agreement": m.agreement if drafts else 1.0,
            "runner_up": m.runner_up if drafts else 0.0, "third": m.third if drafts else 0.0,
            "latency_ms": m.latency_ms * time_scale, "max_lookahead": lookahead if drafts else 0,
            "vocab_size": vocab, "predraft": predraft if drafts else 0, "max_batch": max_batch,
        }
        for m, drafts in zip(models, [True] * (len(models) - 1) + [False])  # every model but the target drafts
    ]  # fmt: skip
    return load_config({"name": "emulated-" + "-".join(m.name for m in models), "stages": stages})


def pipeline_outputs(pipe: LocalPipeline, tokens: int) -> list[list[int]]:
    """The token ids the pipeline commits for each of PROMPTS."""
    return [pipe.generate(prompt_token_ids=p, max_new_tokens=tokens).token_ids for p in PROMPTS]


def target_alone_outputs(target: Stage, tokens: int) -> list[list[int]]:
    """The token ids of the target decoding alone, one token per forward, outside any pipeline."""
    return [generate_sync(target, spec(p, tokens, i)).token_ids for i, p in enumerate(PROMPTS)]


@dataclass(frozen=True)
class SyncBest:
    label: str  # "drafter, window g"
    tokens_per_s: float  # wall clock, median over runs
    predicted_tokens_per_s: float  # Leviathan's formula with the measured alpha, at the given latencies


def best_sync(target: Stage, drafters: Sequence[Stage], latencies_ms: dict[str, float], tokens: int, runs: int) -> SyncBest:
    """Synchronous speculation, every drafter and window once, then the fastest --runs times in all.
    `latencies_ms`: per stage name, for the prediction (their ratio c and the target's rate)."""
    trials = {(d.name, g): time_sync(target, d, tokens, g) for d in drafters for g in SYNC_WINDOWS}
    name, gamma = max(trials, key=lambda k: trials[k][0])
    drafter = next(d for d in drafters if d.name == name)
    timed = [trials[name, gamma]] + [time_sync(target, drafter, tokens, gamma) for _ in range(runs - 1)]
    tps, alpha = statistics.median(t for t, _ in timed), statistics.median(a for _, a in timed)
    c = latencies_ms[name] / latencies_ms[target.name]
    predicted = 1000.0 / latencies_ms[target.name] * sync_speedup(alpha, gamma, c)
    return SyncBest(f"{name}, window {gamma}", tps, predicted)


@dataclass(frozen=True)
class ChainRun:
    """One emulated chain, measured: wall-clock figures (before rescaling to the emulated clock)."""

    config: PipelineConfig
    tokens_per_s: float  # median over runs
    alphas: tuple[float, ...]  # median per pair over runs, upstream first
    sync: SyncBest | None  # None for the target alone
    outputs: list[list[int]]  # committed token ids per prompt
    step_s: tuple[float, ...]  # per stage, wall seconds per decode step as traced in the timed runs (pipespec.engine.trace)
    drafters: tuple[StageStats, ...]  # the drafters' statistics over the timed runs (their pre-drafting), upstream first


def run_chain(
    models: Sequence[EmulatedModel], time_scale: float, lookahead: int, tokens: int, runs: int, predraft: int = 0
) -> ChainRun:
    """The pipeline's outputs (also its warm-up), its median rate and alphas, then the best sync."""
    config = emulated_config(models, time_scale, lookahead, predraft)
    with LocalPipeline(config) as pipe:
        outputs = pipeline_outputs(pipe, tokens)
        pipe.start_trace()
        timed = [time_pipeline(pipe, tokens) for _ in range(runs)]
        step_s = tuple(decode_step_s(t) for t in pipe.stop_trace())
        *drafters, target = pipe.stages
        latencies = {m.name: m.latency_ms for m in models}  # the prediction is on the emulated clock
        sync = best_sync(target, drafters, latencies, tokens, runs) if drafters else None
    alphas = tuple(statistics.median(t.alphas[i] for t in timed) for i in range(len(models) - 1))
    *stats, _ = merged_stages(t.stages for t in timed)  # the drafters'; the target's last
    return ChainRun(config, statistics.median(t.tokens_per_s for t in timed), alphas, sync, outputs, step_s, tuple(stats))


def emulated_sweep(
    devices: int,
    time_scale: float = 0.1,
    lookahead: int = 8,
    tokens: int = 64,
    runs: int = 3,
    tick: Tick | None = None,
    predraft: int = 0,
) -> list[ScalingRow]:
    """d = 1 .. devices: the last d models of CHAIN as an asynchronous pipeline, measured and predicted;
    `predraft`: branches each drafter pre-drafts."""
    if not 1 <= devices <= len(CHAIN):
        raise ValueError(f"--devices: the emulated chain has {len(CHAIN)} models, got {devices}")
    if time_scale <= 0:
        raise ValueError(f"--time-scale: must be > 0 (rates are rescaled by it), got {time_scale}")
    rows: list[ScalingRow] = []
    reference: list[list[int]] | None = None
    for d in range(1, devices + 1):
        models = CHAIN[-d:]
        run = run_chain(models, time_scale, lookahead, tokens, runs, predraft)
        reference = reference or run.outputs
        latencies_s = [m.latency_ms / 1000.0 for m in models]  # the emulated clock: measured rates rescaled below
        windows = verify_windows(run.config)
        # a sleep lasts a little longer than asked (timer slack, wake-up), and the runtime adds its host work to
        # each step: the model takes the steps as they ran
        step_s = [f / time_scale for f in run.step_s]
        hit_rates = tuple(s.predraft_hit_rate for s in run.drafters) if predraft and d > 1 else None
        predicted = predicted_tokens_per_s(step_s, run.alphas, windows, hit_rates or ())
        configured = predicted_tokens_per_s(latencies_s, [m.agreement for m in models[:-1]], windows)
        tps = run.tokens_per_s * time_scale
        base = rows[0] if rows else None
        rows.append(
            ScalingRow(
                sweep="emulated",
                devices=d,
                chain=" -> ".join(m.name for m in models),
                tokens_per_s=tps,
                predicted_tokens_per_s=predicted,
                speedup=tps / base.tokens_per_s if base else 1.0,
                predicted_speedup=predicted / base.predicted_tokens_per_s if base else 1.0,
                alphas=run.alphas,
                exact=run.outputs == reference,
                configured_tokens_per_s=configured,
                sync_tokens_per_s=run.sync.tokens_per_s * time_scale if run.sync else None,
                sync_predicted_tokens_per_s=run.sync.predicted_tokens_per_s if run.sync else None,
                sync_best=run.sync.label if run.sync else None,
                step_ms=tuple(1e3 * f for f in step_s),
                predraft_hit_rates=hit_rates,
            )
        )
        log.info("emulated %s: %.2f tok/s measured, %.2f predicted", rows[-1].chain, tps, predicted)
        if tick:
            tick(f"emulated d={d}")
    return rows


# ---- the real sweep ------------------------------------------------------------------------------


def have_real_models(models: Path) -> bool:
    """Whether every model of the longest real chain has weights under `models`."""
    return all(any((models / name).glob("*.safetensors")) for name in REAL_CHAINS[-1])


def cluster_devices(resources: dict[str, float]) -> tuple[str, int]:
    """The devices a stage can have to itself: GPUs where the cluster has them, else CPU cores."""
    if resources.get("GPU", 0) >= 1:
        return "num_gpus", int(resources["GPU"])
    return "num_cpus", int(resources.get("CPU", 1))


def on_devices(config: PipelineConfig, resource: str) -> PipelineConfig:
    """One device per stage: a CPU core each, or a GPU each (then on cuda)."""
    device = "cuda" if resource == "num_gpus" else "cpu"
    stages = tuple(replace(s, resources={resource: 1}, device=device) for s in config.stages)
    return replace(config, stages=stages)


def real_requests(prompts: int, tokens: int, seed: int = 3) -> list[dict]:
    """Questions about held-out pictures of the demo models' world."""
    from demo.world import IMAGE_SIZE, examples, render

    held_out = examples("held_out", prompts, seed=seed)
    return [dict(prompt=ex.prompt, image=render(ex.scene, IMAGE_SIZE), max_new_tokens=tokens) for ex in held_out]


def seconds_per_forward(generations: Sequence[Generation]) -> list[float]:
    """Per stage, upstream first: compute seconds per model call over all requests (prefill included).
    A stage that made no forward has no latency to give: that is an error naming it."""
    names = [s.stage for s in generations[0].stats.stages]
    compute = [sum(g.stats.stages[i].compute_s for g in generations) for i in range(len(names))]
    forwards = [sum(g.stats.stages[i].forwards for g in generations) for i in range(len(names))]
    idle = [name for name, f in zip(names, forwards) if f == 0]
    if idle:
        raise ValueError(f"stages {idle} made no forward in {len(generations)} requests: time longer ones")
    return [c / f for c, f in zip(compute, forwards)]


def real_sweep(
    models: Path, prompts: int = 4, tokens: int = 48, dtype: str = "float32", tick: Tick | None = None
) -> list[ScalingRow]:
    """On a local Ray (started and stopped here): one stage per device, as far as the devices go."""
    from pipespec.cli.demo import demo_config
    from pipespec.cli.timed_requests import time_requests, tokens_per_s
    from pipespec.cluster.pipeline import local_ray

    requests = real_requests(prompts, tokens)
    rows: list[ScalingRow] = []
    reference: list[list[int]] | None = None
    with local_ray() as available:
        resource, count = cluster_devices(available)
        for names in REAL_CHAINS[: min(count, len(REAL_CHAINS))]:
            config = on_devices(demo_config(models, list(names), dtype, 1), resource)
            timed = time_requests(config, requests)
            generations = [g for g, _ in timed]
            reference = reference or [g.token_ids for g in generations]
            alphas = tuple(p.token_acceptance for p in merged_pairs(g.stats.pairs for g in generations))
            predicted = predicted_tokens_per_s(seconds_per_forward(generations), alphas, verify_windows(config))
            tps = tokens_per_s(timed)
            base = rows[0] if rows else None
            rows.append(
                ScalingRow(
                    sweep="real",
                    devices=len(names),
                    chain=" -> ".join(names),
                    tokens_per_s=tps,
                    predicted_tokens_per_s=predicted,
                    speedup=tps / base.tokens_per_s if base else 1.0,
                    predicted_speedup=predicted / base.predicted_tokens_per_s if base else 1.0,
                    alphas=alphas,
                    exact=[g.token_ids for g in generations] == reference,
                )
            )
            log.info("real %s: %.2f tok/s measured, %.2f predicted", rows[-1].chain, tps, predicted)
            if tick:
                tick(f"real d={len(names)}")
    return rows


# ---- outputs -------------------------------------------------------------------------------------


def _opt(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(rows: Sequence[ScalingRow], settings: dict[str, Any]) -> str:
    lines = [
        "# Scaling with devices: one device per pipeline stage",
        "",
        f"Settings: {json.dumps(settings)}",
        "",
        "EMULATED rows: mock stages (not real models) sleeping per-forward latencies: 70B 123.7 ms (PipeSpec, published); "
        + ", ".join(f"{m.name} {m.latency_ms:g} ms" for m in CHAIN[:-1])
        + " (assumed); configured acceptance "
        + ", ".join(f"{m.name}->next {m.agreement:g}" for m in CHAIN[:-1])
        + " (assumed). Tokens/s on the emulated A100 clock. REAL rows: the demo models on this machine, one Ray actor per device.",
        "Predicted: `chain_rates` with each stage's measured seconds per step (emulated: each step as traced, its forward, "
        "dispatch and handoff, on the emulated clock, "
        "a sleep lasting a little longer than asked; real: the measured compute time per forward), the measured alphas and the verify windows; gap = measured / predicted - 1.",
        "",
        "| sweep | devices | chain | tok/s measured | tok/s predicted | gap | predicted (configured alpha) "
        "| speedup measured | speedup predicted | alpha per pair (measured) | sync best tok/s (predicted; drafter, window) "
        "| async / sync | pre-drafted hits per pair | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sync = (
            "-"
            if r.sync_tokens_per_s is None
            else f"{r.sync_tokens_per_s:.2f} ({r.sync_predicted_tokens_per_s:.2f}; {r.sync_best})"
        )
        lines.append(
            f"| {r.sweep} | {r.devices} | {r.chain} | {r.tokens_per_s:.2f} | {r.predicted_tokens_per_s:.2f} | {r.gap:+.1%} "
            f"| {_opt(r.configured_tokens_per_s)} | {r.speedup:.2f}x | {r.predicted_speedup:.2f}x "
            f"| {' / '.join(f'{a:.2f}' for a in r.alphas) or '-'} | {sync} "
            f"| {'-' if r.sync_tokens_per_s is None else format(r.tokens_per_s / r.sync_tokens_per_s, '.2f') + 'x'} "
            f"| {' / '.join(f'{h:.0%}' for h in r.predraft_hit_rates or ()) or '-'} | {'yes' if r.exact else 'NO'} |"
        )
    for sweep in ("emulated", "real"):
        mine = [r for r in rows if r.sweep == sweep]
        if mine:
            lines += [
                "",
                f"{sweep}: {gap_summary([r.gap for r in mine], 'tokens/s')}; {gap_summary([r.speedup_gap for r in mine], 'speedup')}.",
            ]
    return "\n".join(lines) + "\n"


def gap_summary(gaps: Sequence[float], what: str) -> str:
    return f"{what} measured vs predicted {min(gaps):+.1%} to {max(gaps):+.1%} (mean {statistics.mean(gaps):+.1%})"


def plot(rows: Sequence[ScalingRow], path: Path) -> None:
    """Two panels against devices: tokens per second and speedup; measured solid, predicted dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tps_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        "emulated": ("tab:blue", "emulated (mock stages, A100 profile)"),
        "real": ("tab:orange", "real (demo models, a core or GPU each)"),
    }
    for sweep, (colour, label) in styles.items():
        mine = [r for r in rows if r.sweep == sweep]
        if not mine:
            continue
        d = [r.devices for r in mine]
        tps_ax.plot(d, [r.tokens_per_s for r in mine], "o-", color=colour, label=f"{label}: measured")
        tps_ax.plot(d, [r.predicted_tokens_per_s for r in mine], "s--", color=colour, alpha=0.7, label=f"{label}: predicted")
        speed_ax.plot(d, [r.speedup for r in mine], "o-", color=colour, label=f"{label}: measured")
        speed_ax.plot(d, [r.predicted_speedup for r in mine], "s--", color=colour, alpha=0.7, label=f"{label}: predicted")
    sync = [r for r in rows if r.sync_tokens_per_s is not None]
    if sync:
        tps_ax.plot(
            [r.devices for r in sync], [r.sync_tokens_per_s for r in sync], "x:", color="grey", label="emulated: best sync SD"
        )
    tps_ax.set(xlabel="devices (one per stage)", ylabel="tokens / s", title="Throughput")
    if {r.sweep for r in rows} == {"emulated", "real"}:
        tps_ax.set_yscale("log")  # the emulated A100 clock and this CPU are far apart
    speed_ax.set(xlabel="devices (one per stage)", ylabel="speedup over the target alone", title="Speedup")
    for ax in (tps_ax, speed_ax):
        ax.set_xticks(sorted({r.devices for r in rows}))
        ax.grid(alpha=0.3)
    handles, labels = tps_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("PipeSpec-style asynchronous pipeline: measured vs analytical chain model (emulated stages are mocks)")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: Sequence[ScalingRow], out: Path, settings: dict[str, Any]) -> str:
    """scaling.md, scaling.json and scaling.png under `out`; -> the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, settings)
    (out / "scaling.md").write_text(text)
    figures = {"settings": settings, "chain": [asdict(m) for m in CHAIN], "rows": [r.as_dict() for r in rows]}
    (out / "scaling.json").write_text(json.dumps(figures, indent=2) + "\n")
    plot(rows, out / "scaling.png")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from pipespec.cli import DEMO_MODELS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=len(CHAIN), help=f"emulated sweep: 1 .. this many (at most {len(CHAIN)})")
    parser.add_argument("--time-scale", type=float, default=0.1, help="factor on every emulated latency")
    parser.add_argument("--lookahead", type=int, default=8, help="emulated drafters' max_lookahead (verify window: half)")
    parser.add_argument("--tokens", type=int, default=64, help="emulated: new tokens per prompt")
    parser.add_argument("--runs", type=int, default=3, help="emulated: median of this many runs")
    parser.add_argument("--predraft", type=int, default=0, help="emulated: branches each drafter pre-drafts (0: none)")
    parser.add_argument("--real", action=argparse.BooleanOptionalAction, default=True, help="also sweep the demo models on Ray")
    parser.add_argument("--models", type=Path, default=DEMO_MODELS)
    parser.add_argument("--real-prompts", type=int, default=4)
    parser.add_argument("--real-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32", help="real models' dtype")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parse_logged(parser, argv)
    if not 1 <= args.devices <= len(CHAIN):
        parser.error(f"--devices must be in 1..{len(CHAIN)}")
    if args.time_scale <= 0:
        parser.error("--time-scale must be > 0")
    real = args.real and have_real_models(args.models)
    if args.real and not real:
        print(f"real sweep skipped: no demo models under {args.models} (python -m demo.train all)")
    real_points = min(os.cpu_count() or 1, len(REAL_CHAINS)) if real else 0
    settings = {k: os.path.relpath(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"prompts": len(PROMPTS)}
    with tqdm(total=args.devices + real_points, desc="scaling", unit="point") as bar:

        def tick(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update()

        rows = emulated_sweep(args.devices, args.time_scale, args.lookahead, args.tokens, args.runs, tick, args.predraft)
        failed = real and not run_real(rows, args, tick)
    print(write_outputs(rows, args.out, settings))
    print(f"wrote {args.out / 'scaling.md'}, scaling.json, scaling.png")
    return 0 if all(r.exact for r in rows) and not failed else 1


def run_real(rows: list[ScalingRow], args: argparse.Namespace, tick: Tick) -> bool:
    """Append the real sweep's rows; False (and a message) if a stage failed on Ray."""
    from pipespec.cluster.pipeline import ClusterError

    try:
        rows += real_sweep(args.models, args.real_prompts, args.real_tokens, args.dtype, tick)
    except (ClusterError, ConfigError) as e:
        print(f"real sweep failed: {str(e).strip().splitlines()[-1]}")
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
