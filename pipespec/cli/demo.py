"""`pipespec demo`: the embedded default, on a local Ray, on this machine.

The shipped models (`models/demo`: a LLaVA-class target trained on the generated visual world, a tiny
text drafter and a DREAM drafter, all trained by `python -m demo.train`) run as a pipeline of Ray
actors linked by gRPC streams: by default (`--plan auto`) the chain, placement and lookaheads that
`pipespec plan` recommends for this machine's cores, profiled here first on the demo's own question,
then its contenders tried in place on the demo's request (pipespec.cli.trials: five pipelines started
one after the other); with `--plan none`, all three, tiny -> dream -> target,
each stage on a device of its own with a third of this machine's cores. A picture from the world's
held-out split (or `--image`) and a question (or `--prompt`) go through the `Client`; the first answer
streams token by token.

Measured honestly: pipeline runs and target-alone runs alternate (`--runs`, 3 each by default) with
both loaded and warm, the target alone in this process with up to as many torch threads as the demo
was given cores (the plan's devices in all, whether or not the chosen pipeline uses each; with `--plan
none`, the three devices'): one, or all of them, whichever runs it faster here (measured first: on a
loaded machine more threads can be slower). A plan that leaves a core idle is not measured against a target denied it.
While it runs, the target alone is pinned to as many cores as its threads, as the pipeline's actors are
pinned to theirs (pipespec.engine.affinity.pinned). The speedup is the median of
the rounds' ratios. The table shows each stage pair's acceptance over all
runs, and whether every answer equals the target alone's. Last, the held-out questions shipped with the
models (held_out.jsonl) go through the same pipeline one at a time, then all at once, its stages' forwards
carrying every request that is ready (`max_batch`, pipespec.engine.stage.BatchingStage): the throughput
both ways, and whether every answer is the same either way.

Three steps, each returning data that the command prints (pipespec.cli): `demo_request` checks what
was asked (the models directory is an argument: the command's `--models`), `demo_setup` chooses the
pipeline, `run_demo` runs it and returns a `DemoReport`; the first answer's text goes to an `on_text`
callback as it streams. What the demo cannot run raises `DemoError`; a failed generation,
`GenerationError`. `demo_config` serves the experiments too; the requests are timed as
pipespec.cli.timed_requests times them, as the planner's trials are.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipespec.cli.timed_requests import OnText, Run, serving, timed, tokens_per_s
from pipespec.cluster.pipeline import local_ray
from pipespec.config import PipelineConfig, load_config
from pipespec.engine.affinity import pinned
from pipespec.errors import ConfigError
from pipespec.planning.placement import Devices
from pipespec.protocol.stats import PairStats, merged_pairs
from pipespec.requests.generate_args import DEFAULT_MAX_NEW_TOKENS

if TYPE_CHECKING:
    from pipespec.local import LocalPipeline
    from pipespec.planning.plan import Plan, Trial

DEFAULT_PROMPT = "Describe the image."
CHAIN = ("tiny", "dream", "target")  # the shipped models, upstream to downstream
MAX_BATCH = 16  # most requests one forward of a stage carries (the held-out questions all at once)


class DemoError(Exception):
    """What the demo was given cannot run: no models, a picture that is missing or not one, a pipeline
    this machine cannot hold. The message says which."""


def demo_config(models: Path, names: Sequence[str], dtype: str, cpus: float) -> PipelineConfig:
    """The demo pipeline of the stages `names` (of tiny, dream, target), each on a device of `cpus` cores; the
    models' paths absolute (an actor may run in another directory)."""
    kinds = {"tiny": "causal_lm", "dream": "dream", "target": "vlm"}
    lookahead = {"tiny": 6, "dream": 6, "target": 0}
    stages = [
        {
            "name": n, "kind": kinds[n], "model": str((models / n).resolve()), "dtype": dtype,
            "max_lookahead": lookahead[n], "resources": {"num_cpus": cpus}, "max_batch": MAX_BATCH,
        }
        for n in names
    ]  # fmt: skip
    return load_config({"name": "demo" if len(names) > 1 else "target-alone", "stages": stages, "server": {"port": 0}})


def default_image(models: Path) -> Any:
    """The demo's default picture: a held-out picture of the world the models were trained on."""
    from PIL import Image

    with Image.open(models / "example.png") as picture:
        return picture.convert("RGB")


def picture_truth(models: Path, image: Any) -> str | None:
    """What the shipped example picture shows (example.json, written with it by `python -m demo.train
    picture`), when `image` is that picture: None (the default) or a file with the same bytes."""
    recorded = models / "example.json"
    picture = models / "example.png" if image is None else image
    if not recorded.is_file() or not isinstance(picture, (str, Path)) or not Path(picture).is_file():
        return None
    truth = json.loads(recorded.read_text())
    return truth["truth"] if hashlib.sha256(Path(picture).read_bytes()).hexdigest() == truth["png_sha256"] else None


def placement_lines(config: PipelineConfig) -> list[str]:
    """One line per device of `config`: its stages and resources."""
    lines = []
    for k, indices in enumerate(config.devices(), 1):
        stages = [config.stages[i] for i in indices]
        resources = ", ".join(f"{key} {value:g}" for key, value in stages[0].resources.items())
        lines.append(f"  device {k}: {' + '.join(s.name for s in stages):<24}({resources})")
    return lines


def _count(n: float, thing: str) -> str:
    return f"{n:g} {thing}{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class DemoRequest:
    """What the demo asks, checked: a question about a picture, of the models under `models`."""

    models: Path
    prompt: str
    image: Any  # a picture file's path, or the default picture (a PIL image)
    max_new_tokens: int
    truth: str | None  # what the picture shows, when it is the shipped example

    def keywords(self) -> dict[str, Any]:
        """The request, as `Client.stream` and `LocalPipeline.stream` take it."""
        return dict(prompt=self.prompt, image=self.image, max_new_tokens=self.max_new_tokens)


def demo_request(
    models: Path, prompt: str = DEFAULT_PROMPT, image: Any = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> DemoRequest:
    """Check what the demo is asked, before anything starts: DemoError without models under `models`,
    without the example picture when `image` is None, or for an `image` that is not a picture."""
    if not (models / "target" / "config.json").is_file():
        raise DemoError(f"no demo models under {models}; train them with `python -m demo.train all`")
    if image is None and not (models / "example.png").is_file():
        raise DemoError(
            f"no example picture under {models}; give one with --image FILE or write it with `python -m demo.train picture`"
        )
    truth = picture_truth(models, image)
    if image is None:
        image = default_image(models)
    else:
        from pipespec.requests.images import image_bytes, load_image

        try:
            load_image(image_bytes(image)[0])
        except ValueError as e:
            raise DemoError(str(e)) from None
    return DemoRequest(models, prompt, image, max_new_tokens, truth)


def planning_line(plan: Devices) -> str:
    """What `demo_setup` is about to do with `plan`, said before it profiles and tries (minutes: pipespec.cli.trials)."""
    return (
        f"planning for {_count(plan.count, 'device')} of {_count(plan.cpus, 'core')} "
        "(profiling here, then trying the best chains in place) ..."
    )


@dataclass(frozen=True)
class DemoSetup:
    """The demo about to run: its request, the pipeline, the cores it was given (the pipeline's devices may
    use fewer), and the plan that chose it (None: the default)."""

    request: DemoRequest
    config: PipelineConfig
    dtype: str
    cores: float
    chosen: Plan | None = None

    @property
    def threads(self) -> int:
        """The target alone's thread budget: as many torch threads as the demo was given cores."""
        return max(1, round(self.cores))

    def lines(self) -> list[str]:
        """What runs: the plan's reasons (when planned), the chain, its placement, the target alone, the prompt."""
        from pipespec.planning.plan import explain

        chain = " -> ".join(s.name for s in self.config.stages)
        return [
            *([explain(self.chosen)] if self.chosen else []),
            "",
            f"pipeline: {chain}  ({self.request.models}, trained on the generated world; {self.dtype})",
            "placement:",
            *placement_lines(self.config),
            f"target alone: in this process, at the faster of 1 and {_count(self.threads, 'torch thread')} (the demo's cores)"
            if self.threads > 1
            else "target alone: in this process, 1 torch thread (the demo's cores)",
            f"prompt: {self.request.prompt!r}",
            "",
        ]


def demo_setup(
    request: DemoRequest, dtype: str = "float32", plan: Devices | None = None, on_trial: Callable[[Trial], None] | None = None
) -> DemoSetup:
    """The demo's pipeline: tiny -> dream -> target, a device each; or, with `plan`, what `pipespec plan`
    recommends for those devices, profiled here on the demo's question, its contenders tried in place on
    the demo's request (`on_trial` is given each trial as it ends). DemoError for a plan that fails."""
    if plan is None:
        config = demo_config(request.models, CHAIN, dtype, Devices.of_this_machine(len(CHAIN)).cpus)
        return DemoSetup(request, config, dtype, config.cpus())
    from pipespec.cli.trials import run_trials
    from pipespec.planning.plan import auto, recommended_config, tried

    config = demo_config(request.models, CHAIN, dtype, plan.cpus)
    try:
        _, modelled = auto(config, plan, prompts=[request.prompt], image=request.image)
        trials = run_trials(config, modelled, request.image, max_new_tokens=request.max_new_tokens, on_trial=on_trial)
        chosen = tried(modelled, trials)
        return DemoSetup(request, recommended_config(config, chosen), dtype, plan.count * plan.cpus, chosen)
    except ConfigError as e:
        raise DemoError(str(e)) from None


def run_demo(setup: DemoSetup, runs: int = 3, on_text: OnText | None = None) -> DemoReport:
    """Run `setup` on a local Ray: `runs` rounds of the pipeline then the target alone, both warm ->
    the figures. `on_text` is given the first answer as it streams, then the lines under it (what the
    picture shows, when known). DemoError when the pipeline does not fit this machine; GenerationError
    (pipespec.requests.outputs) when a request fails."""
    request = setup.request.keywords()
    rounds: list[tuple[Run, Run]] = []
    try:
        with local_ray():
            with serving(setup.config, request) as client, fastest_alone(setup, request) as (alone, threads):
                for i in range(runs):  # alternate, so that whatever else the machine does falls on both sides
                    pipeline = timed(client.stream, request, on_text if i == 0 else None)
                    with pinned(threads):  # as the pipeline's actors are (pipespec.cluster.cores)
                        rounds.append((pipeline, timed(alone.stream, request)))
                    if i == 0 and on_text is not None:
                        truth = setup.request.truth
                        on_text("\n\n" + (f"the picture shows: {truth}\n\n" if truth is not None else ""))
                together = Together.of(client, held_out_requests(setup.request))
    except ConfigError as e:  # the placement does not fit this machine
        raise DemoError(str(e)) from None
    return DemoReport.of(rounds, setup, threads, together)


def held_out_requests(request: DemoRequest) -> list[dict[str, Any]]:
    """The held-out questions shipped with the models (held_out.jsonl: `python -m demo.train picture`), as
    request keywords at the demo's length; none where the models directory has no such file."""
    from PIL import Image

    listing = request.models / "held_out.jsonl"
    if not listing.is_file():
        return []
    out = []
    for line in listing.read_text().splitlines():
        row = json.loads(line)
        with Image.open(request.models / row["image"]) as picture:
            out.append({"prompt": row["text"], "image": picture.convert("RGB"), "max_new_tokens": request.max_new_tokens})
    return out


@dataclass(frozen=True)
class Together:
    """The held-out questions through the served pipeline one at a time, then all at once (its stages' forwards
    carrying every ready request: `max_batch`): output tokens per second each way, and whether every answer is the
    same either way."""

    requests: int
    one_at_a_time: float  # tokens per second
    all_at_once: float
    same: bool

    @classmethod
    def of(cls, client: Any, requests: Sequence[dict[str, Any]]) -> Together | None:
        if not requests:
            return None
        alone = [timed(client.stream, r) for r in requests]
        began = time.perf_counter()
        with ThreadPoolExecutor(len(requests)) as pool:  # a gRPC channel serves calls from many threads
            together = list(pool.map(lambda r: timed(client.stream, r), requests))
        seconds = time.perf_counter() - began
        return cls(
            requests=len(requests),
            one_at_a_time=tokens_per_s(alone),
            all_at_once=sum(len(g.token_ids) for g, _ in together) / seconds,
            same=all(a.token_ids == t.token_ids for (a, _), (t, _) in zip(alone, together)),
        )

    def line(self) -> str:
        return (
            f"the {self.requests} held-out questions: {self.one_at_a_time:.1f} tok/s one at a time, {self.all_at_once:.1f} "
            f"tok/s all at once ({self.all_at_once / self.one_at_a_time:.2f}x); the same answers either way: "
            f"{'yes' if self.same else 'NO'}"
        )


@contextmanager
def fastest_alone(setup: DemoSetup, request: dict) -> Iterator[tuple[LocalPipeline, int]]:
    """The target alone in this process, warm, at whichever of 1 and `setup.threads` torch threads runs
    `request` faster -> (it, its threads). Each count is tried in a pipeline of its own, one after the
    other: torch's thread count is the whole process's, and a compiled forward is compiled for one."""
    from pipespec.local import LocalPipeline

    @contextmanager
    def warm(threads: int) -> Iterator[LocalPipeline]:
        config = demo_config(setup.request.models, ["target"], setup.dtype, threads)
        with LocalPipeline(config, torch_threads=threads) as alone:
            alone.generate(**{**request, "max_new_tokens": 4})
            yield alone

    def rate(threads: int) -> float:
        with warm(threads) as alone, pinned(threads):
            return tokens_per_s([timed(alone.stream, request)])

    counts = sorted({1, setup.threads})
    threads = counts[0] if len(counts) == 1 else max(counts, key=rate)
    with warm(threads) as alone:
        yield alone, threads


@dataclass(frozen=True)
class DemoReport:
    """What `run_demo` measured: each round's tokens per second, the pipeline's and the target alone's;
    each stage pair's statistics over all the pipeline's runs; whether every answer equals the target
    alone's."""

    pipeline: tuple[float, ...]  # tokens per second, per round
    alone: tuple[float, ...]  # the target alone's, per round
    exact: bool
    pairs: tuple[PairStats, ...]
    threads: int  # the target alone's torch threads
    config: PipelineConfig = field(repr=False)  # the pipeline's
    predicted: float | None = None  # the tokens per second the plan expects (`Plan.predicted`; None: not planned)
    predicted_speedup: float | None = None  # and the speedup (`Plan.predicted_speedup`)
    together: Together | None = None  # the held-out questions one at a time and all at once (None: none shipped)

    @classmethod
    def of(
        cls, rounds: Sequence[tuple[Run, Run]], setup: DemoSetup, threads: int, together: Together | None = None
    ) -> DemoReport:
        """The figures of `rounds` (pipeline, target alone at `threads` torch threads) of `setup`, and `together`."""
        return cls(
            pipeline=tuple(tokens_per_s([p]) for p, _ in rounds),
            alone=tuple(tokens_per_s([a]) for _, a in rounds),
            exact=all(p[0].token_ids == a[0].token_ids for p, a in rounds),
            pairs=tuple(merged_pairs(p[0].stats.pairs for p, _ in rounds)),
            threads=threads,
            config=setup.config,
            predicted=setup.chosen.predicted if setup.chosen else None,
            predicted_speedup=setup.chosen.predicted_speedup if setup.chosen else None,
            together=together,
        )

    @property
    def ratios(self) -> list[float]:
        return [p / a for p, a in zip(self.pipeline, self.alone)]

    def as_dict(self) -> dict[str, Any]:
        """The figures, as `--json` writes them."""
        config = self.config
        kept = ("drafter", "verifier", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length")
        return {
            "exact": self.exact,
            "speedup_vs_target": statistics.median(self.ratios),
            "tokens_per_second": statistics.median(self.pipeline),
            "target_alone_tokens_per_second": statistics.median(self.alone),
            "target_alone_threads": self.threads,
            "rounds": [{"pipeline": p, "target_alone": a, "ratio": r} for p, a, r in zip(self.pipeline, self.alone, self.ratios)],
            "placement": [
                {"stages": [config.stages[i].name for i in indices], "resources": dict(config.stages[indices[0]].resources)}
                for indices in config.devices()
            ],
            "lookaheads": {s.name: s.max_lookahead for s in config.stages[:-1]},
            "predicted_tokens_per_second": self.predicted,
            "predicted_speedup": self.predicted_speedup,
            "pairs": [{k: v for k, v in pair.as_dict().items() if k in kept} for pair in self.pairs],
            "held_out": None if self.together is None else asdict(self.together),
        }

    def lines(self) -> list[str]:
        """The rounds' table, the pairs' table and the summary line."""
        lines = [f"{'round':<8}{'pipeline tok/s':>16}{'target alone tok/s':>20}{'ratio':>8}"]
        for k, (p, a, r) in enumerate(zip(self.pipeline, self.alone, self.ratios), 1):
            lines.append(f"{k:<8}{p:>16.1f}{a:>20.1f}{r:>7.2f}x")
        lines += [
            "",
            f"{'drafter -> verifier':<22}{'drafts':>8}{'drafted':>9}{'accepted':>10}{'acceptance':>12}{'mean acc. len':>15}",
        ]
        for pair in self.pairs:
            lines.append(
                f"{pair.drafter + ' -> ' + pair.verifier:<22}{pair.num_drafts:>8}{pair.num_draft_tokens:>9}"
                f"{pair.num_accepted_tokens:>10}{pair.acceptance_rate:>12.2f}{pair.mean_acceptance_length:>15.2f}"
            )
        predicted = f" (predicted {self.predicted:.1f})" if self.predicted is not None else ""
        predicted_speedup = f" (predicted {self.predicted_speedup:.2f}x)" if self.predicted_speedup is not None else ""
        lines += [
            "",
            f"pipeline {statistics.median(self.pipeline):.1f} tok/s{predicted}, target alone "
            f"{statistics.median(self.alone):.1f} tok/s on {_count(self.threads, 'torch thread')} "
            f"(medians of {len(self.pipeline)} alternating runs): speedup "
            f"{statistics.median(self.ratios):.2f}x{predicted_speedup} (the median of the rounds' ratios); "
            f"identical to the target alone: {'yes' if self.exact else 'NO'}",
        ]
        if self.together is not None:
            lines.append(self.together.line())
        if len(self.config.stages) == 1:  # the plan found no pipeline faster than the target alone
            lines.append(
                "no pipeline with drafters measured faster than the target alone here: this ratio is the target in the "
                "runtime against the target in this process, not a speculative speedup"
            )
        return lines
