"""One prompt set through every way of running a pipeline config's models, side by side, in one run.

    python -m experiments.bench CONFIG --prompts FILE [--runs 3] [--out DIR] [--max-new-tokens 96]
                                [--limit N] [--gamma 4] [--backend ray|local]

The methods, all on the same loaded models and the same requests (greedy, batch 1, one request at
a time, as Spec-Bench measures):

    target                   the target alone, in this process on every core (the reference for exactness of
                             the methods whose target runs on as many torch threads)
    target, 1 thread         the same on one torch thread (what one stage actor of one core gets; the
                             reference for exactness of the methods on one thread: their answers are compared
                             with the target alone's on the same threads); the faster of the two is the
                             reference for speedup
    sync <d>->target         synchronous speculative decoding (pipespec.engine.synchronous), drafter d, window
                             --gamma, on every core and on one thread (the faster is the best sync)
    hf-generate target       Hugging Face `generate` on the target's model, on every core and on one thread
    hf-assisted <d>->target  Hugging Face assisted generation (`generate(assistant_model=...)`), for each
                             drafter that is a Hugging Face model
    async <chain>            the asynchronous pipeline for each depth the config allows: the target alone,
                             each drafter right before the target, and the whole chain; on a local Ray
                             (one actor per stage, with the config's resources, linked by gRPC) or in
                             this process (--backend local)

Each method runs every prompt --runs times (after one warm-up request). The in-process methods are pinned
to as many cores as their threads while they answer, as the device actors are pinned to theirs
(pipespec.engine.affinity.pinned: unpinned, the demo target on one thread ran at 0.7x). `--only` picks
methods by the start of a word of their names (the target alone always runs); a pipeline it does not pick
never starts, so a GPU run loads as many 7B targets as it measures; a pattern ending in `$` runs to the
end of a name. A pipeline that cannot start, or a method that fails, is listed under the table with its
error, and the others run. Written to --out after every method's pass through the prompts (a bench
stopped by a time limit keeps what it measured; the header says which run was under way)
(default experiments/results/bench/<config name>/): `<method>.jsonl` (its name a plain file name: `file_stem`) with one Spec-Bench-shaped line per
prompt and run (`choices[0]`: `turns`, `new_tokens`, `wall_time`, `accept_lengths`: the tokens each
target step committed), `bench.md` (the table), `bench.json`, and at the end `bench.png` (where
matplotlib is installed). The table gives the
median over runs of tokens per second over the whole set, the speedup over the target alone (the
faster of its two rows: on a loaded 2-core machine one thread can beat two) and over the best
synchronous run, the median prefill (submission to first token) apart from decode, the mean
acceptance length of every stage pair, and the fraction of answers identical to the target alone's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from experiments import cpu_account
from experiments.prompt_sets import Prompt, load_prompts
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig, sub_pipeline
from pipespec.engine import trace
from pipespec.engine.affinity import pinned
from pipespec.engine.synchronous import generate_sync
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.stats import PairStats, StageStats, merged_stages
from pipespec.stages.packing import plain_attention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    runs: int = 3  # each method answers every prompt this many times; figures are medians over runs
    max_new_tokens: int = 96
    gamma: int = 4  # synchronous speculation's window
    backend: str = "ray"  # where the asynchronous pipelines run: "ray" or "local"
    pin_cores: bool = True  # pin each Ray device actor to cores of its own (pipespec.cluster.cores)
    only: tuple[str, ...] = ()  # run only the methods one of these begins a word of (`selected`; the target alone always)

    def describe(self) -> str:
        return (
            f"greedy, up to {self.max_new_tokens} new tokens, median of {self.runs} runs; sync window {self.gamma}; "
            f"async on {self.backend}" + ("" if self.pin_cores or self.backend == "local" else " (cores not pinned)")
        )


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    spec: RequestSpec  # what in-process methods run
    kwargs: dict[str, Any]  # what a Client or LocalPipeline is given for the same request


@dataclass(frozen=True)
class Answer:
    question_id: int | str
    token_ids: tuple[int, ...]
    wall_s: float
    prefill_s: float  # submission -> first committed token
    accept_lengths: tuple[int, ...]  # tokens committed per target step
    pairs: tuple[tuple[str, int, int], ...]  # (drafter->verifier, verification steps with drafts, accepted drafts)
    stages: tuple[StageStats, ...] = ()  # the pipeline's, per stage (its pre-drafting among them)


class Method(Protocol):
    name: str

    def answer(self, request: Request) -> Answer: ...


def _pairs(stats: Sequence[PairStats]) -> tuple[tuple[str, int, int], ...]:
    return tuple((f"{p.drafter}->{p.verifier}", p.num_drafts, p.num_accepted_tokens) for p in stats)


@dataclass
class InProcess:
    """The target alone (drafter None) or synchronous speculative decoding, on the loaded stages."""

    name: str
    target: Any
    drafter: Any | None
    gamma: int
    threads: int  # torch threads (the process's are set at each answer: methods alternate)

    def answer(self, request: Request) -> Answer:
        torch.set_num_threads(self.threads)
        with pinned(self.threads):  # as the device actors are (pipespec.cluster.cores)
            t0 = time.perf_counter()
            r = generate_sync(self.target, request.spec, self.drafter, self.gamma)
            wall = time.perf_counter() - t0
        pairs = _pairs([r.pair]) if r.pair else ()
        return Answer(request.prompt.question_id, tuple(r.token_ids), wall, r.prefill_s, tuple(r.accept_lengths), pairs)


class _Clock:
    """A Hugging Face streamer that only notes when each chunk of tokens arrives."""

    def __init__(self):
        self.chunks: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass


@dataclass
class HFAssisted:
    """Hugging Face `generate` on the same target model (greedy): assisted by a drafter, or (None) plain."""

    name: str
    target: Any  # a stage with an HF `model` and a `fit` (pipespec.stages.vocabulary.LogitsFit)
    drafter: Any | None
    threads: int

    def answer(self, request: Request) -> Answer:
        torch.set_num_threads(self.threads)
        spec = request.spec
        inputs = {"input_ids": torch.tensor([spec.prompt_token_ids])}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if spec.image is not None:
            inputs.update({k: torch.as_tensor(v) for k, v in spec.image.arrays.items()})
        padding = list(range(self.target.fit.valid, self.target.model.get_output_embeddings().out_features)) or None
        clock = _Clock()
        t0 = time.perf_counter()
        models = [self.target.model] + ([self.drafter.model] if self.drafter else [])
        with torch.inference_mode(), pinned(self.threads), ExitStack() as plain:
            for model in models:
                plain.enter_context(plain_attention(model))
            out = self.target.model.generate(
                **inputs, assistant_model=self.drafter and self.drafter.model, max_new_tokens=spec.max_new_tokens, do_sample=False,
                suppress_tokens=padding, eos_token_id=sorted(spec.stop_token_ids) or None, streamer=clock,
            )  # fmt: skip
        wall = time.perf_counter() - t0
        tokens = out[0, len(spec.prompt_token_ids) :].tolist()
        steps = clock.chunks[1:]  # the first chunk is the prompt
        prefill = steps[0][0] - t0 if steps else wall
        return Answer(request.prompt.question_id, tuple(tokens), wall, prefill, tuple(n for _, n in steps), ())


@dataclass
class Pipelined:
    """The asynchronous pipeline, through the Python client of a Ray deployment or a LocalPipeline."""

    name: str
    client: Any  # pipespec.Client or LocalPipeline: both have `stream(prompt, **kwargs)`
    deployment: Any  # RunningPipeline or LocalPipeline: both have start_trace/stop_trace
    processes: dict[int, str]  # pid -> what it runs (pipespec.cluster.pipeline.RunningPipeline.processes)
    placement: str  # which stages share which device, and its cores
    threads: int | None = None  # in this process (a LocalPipeline): torch threads, set at each answer
    target_threads: int = 1  # the torch threads the target's forwards run on (its device actor's: its CPUs)

    def answer(self, request: Request) -> Answer:
        from pipespec.requests.outputs import Generation

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        with pinned(self.threads) if self.threads is not None else nullcontext():
            t0 = time.perf_counter()
            deltas = list(self.client.stream(**request.kwargs))
            wall = time.perf_counter() - t0
        g = Generation.from_deltas(deltas)
        steps = tuple(len(d.token_ids) for d in deltas if d.token_ids)
        pairs = _pairs(g.stats.pairs)
        return Answer(
            request.prompt.question_id, tuple(g.token_ids), wall, g.stats.prefill_s, steps, pairs, tuple(g.stats.stages)
        )


# ---- which methods a config allows ---------------------------------------------------------------


def chains(config: PipelineConfig) -> list[list[str]]:
    """The asynchronous pipelines to run: the target alone, each drafter right before the target, the whole chain."""
    target = config.target.name
    out = [[target]] + [[s.name, target] for s in config.stages[:-1]]
    if len(config.stages) > 2:
        out.append([s.name for s in config.stages])
    return out


def _chain(config: PipelineConfig) -> str:
    return "->".join(s.name for s in config.stages)


def _placement(devices: list[dict]) -> str:
    return " | ".join(
        "+".join(d["stages"]) + (f" (cores {','.join(map(str, d['cores']))})" if d["cores"] else "") for d in devices
    )


def file_stem(method: str) -> str:
    """A method's name as a plain file name: `sync tiny->target, 1 thread` -> `sync_tiny-target_1_thread`."""
    return re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9.-]+", "_", method.replace("->", "-"))).strip("_")


def selected(name: str, only: Sequence[str]) -> bool:
    """Whether `--only` picks the method `name`: with no patterns every method, always the target alone, and
    a method a pattern begins a word of ("async tiny" picks "async tiny->target", "dream->target" picks
    "sync dream->target", "sync tiny" picks "sync tiny->target" but not "async tiny->target"); a pattern
    ending in `$` runs to the name's end ("sync tiny->target$" leaves out "sync tiny->target, 1 thread")."""

    def picks(pattern: str) -> bool:
        whole = pattern.endswith("$")
        return re.search(r"(?:^|\s)" + re.escape(pattern.removesuffix("$")) + ("$" if whole else ""), name) is not None

    return not only or name == "target" or any(map(picks, only))


def async_name(config: PipelineConfig, backend: str) -> str:
    return f"async {_chain(config)}" + (" (local)" if backend == "local" else "")


@contextmanager
def async_methods(
    config: PipelineConfig, backend: str, pin_cores: bool = True, only: Sequence[str] = (), failures: dict | None = None
) -> Iterator[list[Pipelined]]:
    """The asynchronous pipelines of `chains` that `only` picks, all started at once (idle ones cost next to
    nothing), so that their runs alternate with the in-process methods'; stopped on exit. Only those:
    each one loads its models again (a 7B target each). One that cannot start (an actor out of memory, a
    forward that fails to compile) is left out, its error in `failures`: the other methods still run."""
    configs = [sub_pipeline(config, names) for names in chains(config)]
    configs = [c for c in configs if selected(async_name(c, backend), only)]
    failures = {} if failures is None else failures
    methods: list[Pipelined] = []
    with ExitStack() as stack:
        if backend != "local":
            from pipespec import Client
            from pipespec.cluster.pipeline import local_ray, start_pipeline

            # Ray is told the machine has room for every pipeline at once (in whole cores); only one runs at a time
            cores = math.ceil(sum(c.cpus() for c in configs))
            stack.enter_context(local_ray(max(os.cpu_count() or 1, cores)))
        for c in configs:
            name = async_name(c, backend)
            try:
                if backend == "local":
                    pipe = stack.enter_context(LocalPipeline(c))
                    methods.append(Pipelined(name, pipe, pipe, {}, "one process", threads=1))
                    continue
                running = start_pipeline(c, port=0, pin_cores=pin_cores)
                stack.callback(running.stop)
                placement = _placement(running.placement())
                threads = max(1, int(c.stages[c.devices()[-1][0]].resources.get("num_cpus", 1)))  # as the actor sets them
                methods.append(Pipelined(name, Client(running.address), running, running.processes(), placement, None, threads))
            except Exception as e:  # noqa: BLE001 - whatever stops one pipeline starting is its row's failure
                log.warning("%s did not start: %s", name, e)
                failures[name] = f"it did not start ({type(e).__name__}: {e})"[:2000]
        yield methods


# ---- running and reporting ---------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    method: str
    tokens_per_s: float  # median over runs of the whole set's new tokens / wall seconds
    prefill_s: float  # median over prompts and runs
    decode_tokens_per_s: float  # median over runs: tokens after the first / seconds after the first token
    mean_acceptance_length: dict[str, float]  # per stage pair, over all prompts and runs
    exact: float  # fraction of answers identical to the target alone's on as many torch threads (`tabulate`)
    runs: int
    predraft: str | None = None  # per pre-drafting stage: its hit rate over the verdicts that changed its tokens, tokens served
    speedup: float = 1.0  # over the target alone
    speedup_vs_sync: float | None = None  # over the best synchronous method


def summarise(name: str, runs: list[list[Answer]], reference: dict[int | str, tuple[int, ...]]) -> Row:
    tps, decode = [], []
    for answers in runs:
        tps.append(sum(len(a.token_ids) for a in answers) / sum(a.wall_s for a in answers))
        decode.append(
            sum(max(len(a.token_ids) - 1, 0) for a in answers) / max(sum(a.wall_s - a.prefill_s for a in answers), 1e-9)
        )
    drafts: dict[str, list[int]] = {}
    for a in (a for answers in runs for a in answers):
        for pair, n, accepted in a.pairs:
            totals = drafts.setdefault(pair, [0, 0])
            totals[0], totals[1] = totals[0] + n, totals[1] + accepted
    tau = {pair: 1 + acc / n if n else 1.0 for pair, (n, acc) in drafts.items()}
    every = [a for answers in runs for a in answers]
    exact = sum(a.token_ids == reference[a.question_id] for a in every) / len(every)
    return Row(
        name,
        statistics.median(tps),
        statistics.median(a.prefill_s for a in every),
        statistics.median(decode),
        tau,
        exact,
        len(runs),
        _predraft(merged_stages(a.stages for a in every)),
    )


def _predraft(stages: list[StageStats]) -> str | None:
    """'tiny 27% of 129 (35 tokens)': each pre-drafting stage's hit rate over the verdicts that changed its tokens."""
    cells = [
        f"{s.stage} {s.predraft_hit_rate:.0%} of {s.predraft_hits + s.predraft_misses} ({s.predraft_tokens} tokens)"
        for s in stages
        if s.predraft_hits + s.predraft_misses
    ]
    return "; ".join(cells) or None


def spec_bench_lines(method: str, runs: list[list[Answer]], prompt_of: dict[int | str, Prompt], decode) -> list[str]:
    """One Spec-Bench answer line per prompt and run (single turn)."""
    lines = []
    for run, answers in enumerate(runs):
        for a in answers:
            p = prompt_of[a.question_id]
            choice = {
                "index": 0, "turns": [decode(list(a.token_ids))], "new_tokens": [len(a.token_ids)], "wall_time": [a.wall_s],
                "accept_lengths": list(a.accept_lengths), "prefill_time": [a.prefill_s],
            }  # fmt: skip
            row = {"question_id": p.question_id, "category": p.category, "model_id": method, "run": run, "choices": [choice]}
            lines.append(json.dumps(row))
    return lines


def markdown(rows: list[Row], header: str) -> str:
    lines = [
        header,
        "",
        "| method | tok/s | speedup vs target | vs best sync | prefill s | decode tok/s | mean acceptance length "
        "| pre-drafted hits | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        taus = ", ".join(f"{pair} {tau:.2f}" for pair, tau in r.mean_acceptance_length.items()) or "-"
        vs_sync = f"{r.speedup_vs_sync:.2f}x" if r.speedup_vs_sync is not None else "-"
        lines.append(
            f"| {r.method} | {r.tokens_per_s:.1f} | {r.speedup:.2f}x | {vs_sync} | {r.prefill_s:.3f} | {r.decode_tokens_per_s:.1f} "
            f"| {taus} | {r.predraft or '-'} | {r.exact:.0%} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the `plot` extra; the GPU machine's image has no matplotlib
        log.warning("matplotlib is not installed: %s not drawn (the table has the same figures)", path.name)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    names = [r.method for r in rows][::-1]
    speedups = [r.speedup for r in rows][::-1]
    colours = ["#888888" if n == "target" else "#4c72b0" if n.startswith("async") else "#dd8452" for n in names]
    ax.barh(names, speedups, color=colours)
    ax.axvline(1.0, color="black", linewidth=0.8)
    for y, (s, r) in enumerate(zip(speedups, rows[::-1])):
        ax.text(s, y, f" {s:.2f}x, {r.tokens_per_s:.0f} tok/s" + ("" if r.exact == 1 else f", {r.exact:.0%} exact"), va="center")
    ax.set_xlabel("speedup over the target alone (median of runs)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(speedups) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
        )
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, torch {torch.__version__}"


def run_bench(config: PipelineConfig, prompts: list[Prompt], settings: Settings, out: Path) -> list[Row]:
    """Every method on every prompt; writes the results under `out`; -> the table's rows, target first."""
    torch.set_num_threads(os.cpu_count() or 1)
    pipe = LocalPipeline(config, torch_threads=None)  # never started: its stages, loaded once, and its front door
    stages = dict(zip((s.name for s in config.stages), pipe.stages))
    target, name = stages[config.target.name], config.target.name
    requests = []
    for p in prompts:
        kwargs = {"prompt": p.text, "max_new_tokens": settings.max_new_tokens, **({"image": str(p.image)} if p.image else {})}
        requests.append(Request(p, pipe.request(**kwargs)[0], kwargs))
    drafters = config.stages[:-1]
    cores = os.cpu_count() or 1
    methods: list[Method] = [InProcess("target", target, None, 0, cores), InProcess("target, 1 thread", target, None, 0, 1)]
    methods += [InProcess(f"sync {d.name}->{name}", target, stages[d.name], settings.gamma, cores) for d in drafters]
    methods += [InProcess(f"sync {d.name}->{name}, 1 thread", target, stages[d.name], settings.gamma, 1) for d in drafters]
    methods += [
        HFAssisted("hf-generate target", target, None, cores),
        HFAssisted("hf-generate target, 1 thread", target, None, 1),
    ]
    methods += [
        HFAssisted(f"hf-assisted {d.name}->{name}", target, stages[d.name], cores) for d in drafters if d.kind == "causal_lm"
    ]
    results: dict[str, list[list[Answer]]] = {}
    failures: dict[str, str] = {}
    traces: dict[str, list[list[dict]]] = {}  # per async method, per run: each stage's trace summary
    cpu: dict[str, list[dict[str, float]]] = {}  # per method, per run: CPU seconds per process group
    decode = pipe.front_door.tokenizer.decode if pipe.front_door.tokenizer is not None else str
    prompt_of = {p.question_id: p for p in prompts}
    rows: list[Row] = []

    def report(under_way: str | None) -> list[Row]:
        """The tables of the runs so far, written (drawn and printed once every method ran); `under_way`: the round
        being run, if one is."""
        rows = tabulate({name: runs for name, runs in results.items() if runs}, threads_of)
        header = (
            f"Config `{config.name}` ({' -> '.join(s.name for s in config.stages)}), {len(prompts)} prompts, "
            f"{settings.describe()}{f' ({under_way})' if under_way else ''}; {hardware()}."
        )
        tokens = {r.method: sum(len(a.token_ids) for a in results[r.method][0]) for r in rows}
        extra = where_the_time_goes(traces, cpu, placements, tokens)
        lines = lambda name, runs: spec_bench_lines(name, runs, prompt_of, decode)  # noqa: E731
        write(out, header, rows, results, failures, lines, extra, final=under_way is None)
        return rows

    with async_methods(config, settings.backend, settings.pin_cores, settings.only, failures) as pipelines:
        chosen = [m for m in [*methods, *pipelines] if selected(m.name, settings.only)]
        placements = {m.name: m.placement for m in pipelines}
        threads_of = {m.name: m.threads if m.threads is not None else m.target_threads for m in chosen}
        bar = tqdm(total=settings.runs * len(requests) * len(chosen), desc="bench")
        alive = []
        for method in chosen:  # warm each up once
            try:
                method.answer(requests[0])
                results[method.name], cpu[method.name] = [], []
                alive.append(method)
            except (RuntimeError, TypeError, ValueError, KeyError) as e:  # a baseline that cannot run these models
                log.warning("%s failed: %s", method.name, e)
                failures[method.name] = f"{type(e).__name__}: {e}"
                bar.update(settings.runs * len(requests))
        if "target" not in results:
            raise RuntimeError(f"the target alone failed: {failures.get('target')}")
        for done in range(1, settings.runs + 1):  # rounds: every method answers every prompt once per round, in turn
            for method in alive:
                traced = isinstance(method, Pipelined)
                if traced:
                    method.deployment.start_trace()
                before = cpu_account.snapshot()
                results[method.name].append([method.answer(r) for r in requests])
                cpu[method.name].append(cpu_account.used(before, cpu_account.snapshot(), method.processes if traced else {}))
                if traced:
                    traces.setdefault(method.name, []).append(method.deployment.stop_trace())
                bar.update(len(requests))
                # written after every method's pass: a run stopped by a time limit keeps what it measured
                last = done == settings.runs and method is alive[-1]
                rows = report(None if last else f"run {done} of {settings.runs} under way")
    bar.close()
    return rows


def tabulate(results: dict[str, list[list[Answer]]], threads: dict[str, int] | None = None) -> list[Row]:
    """The table's rows, each method's answers compared with the first run of the target alone on as many torch
    threads as the method's target ran on (`threads`: per method; where that row did not run, or none is given,
    the target alone on every core): its speedup over the target alone at its faster thread count and over the
    best synchronous method."""
    threads = threads or {}
    alone = {}  # torch threads -> the target alone's answers on them (on every core: `target` wins a tie)
    for name in ("target, 1 thread", "target"):
        if name in results and name in threads:
            alone[threads[name]] = results[name][0]
    default = results["target"][0]

    def reference(name: str) -> dict[int | str, tuple[int, ...]]:
        return {a.question_id: a.token_ids for a in alone.get(threads.get(name, -1), default)}

    rows = [summarise(name, r, reference(name)) for name, r in results.items()]
    base = max(r.tokens_per_s for r in rows if r.method in ("target", "target, 1 thread"))
    sync = max((r.tokens_per_s for r in rows if r.method.startswith("sync")), default=None)
    return [
        Row(**{**asdict(r), "speedup": r.tokens_per_s / base, "speedup_vs_sync": r.tokens_per_s / sync if sync else None})
        for r in rows
    ]


def where_the_time_goes(
    traces: dict[str, list[list[dict]]],
    cpu: dict[str, list[dict[str, float]]],
    placements: dict[str, str],
    tokens: dict[str, int],
) -> str:
    """Markdown: per async method, its placement and its stages' traces (pipespec.engine.trace), all runs
    together; then per method the CPU seconds per process group per run (median over runs)."""
    parts = ["## Where the time goes (traced, all runs)"]
    for name, runs in traces.items():
        stages = [trace.combine([run[i] for run in runs]) for i in range(len(runs[0]))]
        parts += ["", f"**{name}** on {placements.get(name, '?')}", "", trace.table(stages)]
    parts += [
        "",
        "## CPU seconds per run, by process (median over runs)",
        "",
        "| method | tokens | " + " | ".join(CPU_GROUPS) + " |",
    ]
    parts.append("|---|---|" + "---|" * len(CPU_GROUPS))
    for name, runs in cpu.items():
        cells = []
        for group in CPU_GROUPS:
            values = [sum(v for k, v in r.items() if _cpu_group(k) == group) for r in runs]
            cells.append(f"{statistics.median(values):.2f}" if values else "-")
        parts.append(f"| {name} | {tokens.get(name, 0)} | " + " | ".join(cells) + " |")
    return "\n".join(parts)


CPU_GROUPS = ("devices", "coordinator", "this process (driver, client)", "ray (raylet, gcs, workers)", "other")


def _cpu_group(key: str) -> str:
    return "devices" if key.startswith("device ") else key


def write(
    out: Path,
    header: str,
    rows: list[Row],
    results: dict[str, list[list[Answer]]],
    failures: dict[str, str],
    lines,
    extra: str = "",
    final: bool = True,
) -> None:
    """bench.md, bench.json and one Spec-Bench jsonl per method (`lines(method, runs)`); when `final`, bench.png
    too, and the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    for name, runs in results.items():
        (out / f"{file_stem(name)}.jsonl").write_text("\n".join(lines(name, runs)) + "\n")
    table = markdown(rows, header)
    if failures:
        table += "\n\n" + "\n".join(f"- {name} did not run: {why}" for name, why in failures.items())
    if extra:
        table += "\n\n" + extra
    (out / "bench.md").write_text(table + "\n")
    summary = {"header": header, "rows": [asdict(r) for r in rows], "failures": failures}
    (out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    if final:
        plot(rows, out / "bench.png", header[:160])
        print(table)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a pipeline config (YAML)")
    parser.add_argument("--prompts", required=True, help="a Spec-Bench or image-question jsonl file")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="default: experiments/results/bench/<config name>")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--gamma", type=int, default=4, help="synchronous speculation's window")
    parser.add_argument("--backend", choices=["ray", "local"], default="ray", help="where the asynchronous pipelines run")
    parser.add_argument("--no-pin", action="store_true", help="leave the device actors' threads unpinned")
    parser.add_argument(
        "--only",
        nargs="+",
        default=(),
        help="run only the methods one of these begins a word of (the target alone always; "
        "no other pipeline starts): 'async tiny', 'sync dream->target', 'dream->target'",
    )
    args = parse_logged(parser, argv)
    config = load_config(args.config)
    prompts = load_prompts(args.prompts, args.limit)
    out = args.out or Path("experiments/results/bench") / config.name
    settings = Settings(args.runs, args.max_new_tokens, args.gamma, args.backend, not args.no_pin, tuple(args.only))
    run_bench(config, prompts, settings, out)


if __name__ == "__main__":
    main()
