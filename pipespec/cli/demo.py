"""`pipespec demo`: the embedded default, on a local Ray, on this machine.

The shipped models (`models/demo`: a LLaVA-class target trained on the generated visual world, a tiny
text drafter and a DREAM drafter, all trained by `python -m demo.train`) run as a pipeline of Ray
actors linked by gRPC streams. By default all three, tiny -> dream -> target, each stage on a device of
its own with a third of this machine's cores; with `--plan auto`, the chain, placement and lookaheads
that `pipespec plan` recommends for this machine's cores, profiled here first on the demo's own request
(a few seconds). A picture from the world's held-out split (or `--image`) and a question (or `--prompt`)
go through the `Client`; the first answer streams token by token.

Measured honestly: pipeline runs and target-alone runs alternate (`--runs`, 3 each by default) with
both loaded and warm, the target alone in this process with as many torch threads as the pipeline's
devices have cores in total; the speedup is the median of the rounds' ratios. The table shows each
stage pair's acceptance over all runs, and whether every answer equals the target alone's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipespec.cluster.pipeline import local_ray, start_pipeline
from pipespec.config import ConfigError, PipelineConfig, load_config
from pipespec.requests.outputs import Delta, Generation, GenerationError
from pipespec.planning.placement import Devices
from pipespec.protocol.stats import PairStats

if TYPE_CHECKING:
    from pipespec.planning.plan import Plan

log = logging.getLogger(__name__)

DEMO_MODELS = Path(__file__).resolve().parents[2] / "models" / "demo"
DEFAULT_PROMPT = "Describe the image."
Run = tuple[Generation, float]  # an answer and the seconds it took


def demo_raw(models: Path, names: list[str], dtype: str, cpus: float) -> dict[str, Any]:
    """The demo pipeline of the stages `names` (of tiny, dream, target), each on a device of `cpus` cores, as a mapping."""
    kinds = {"tiny": "causal_lm", "dream": "dream", "target": "vlm"}
    lookahead = {"tiny": 6, "dream": 6, "target": 0}
    stages = [
        {
            "name": n, "kind": kinds[n], "model": str(models / n), "dtype": dtype, "max_lookahead": lookahead[n],
            "resources": {"num_cpus": cpus},
        }
        for n in names
    ]  # fmt: skip
    return {"name": "demo" if len(names) > 1 else "target-alone", "stages": stages, "server": {"port": 0}}


def demo_config(models: Path, names: list[str], dtype: str, cpus: float) -> PipelineConfig:
    return load_config(demo_raw(models, names, dtype, cpus))


def default_image(models: Path = DEMO_MODELS) -> Any:
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


@contextmanager
def serving(config: PipelineConfig, warm_up: dict) -> Iterator[Any]:
    """Serve `config` on the running Ray; yield a `Client` to it once `warm_up` (a request's keywords) has
    gone through every stage; stop the pipeline on exit."""
    from pipespec import Client

    running = start_pipeline(config)
    try:
        client = Client(running.address)
        client.generate(**{**warm_up, "max_new_tokens": 4})
        yield client
    finally:
        running.stop()


def timed(stream: Callable[..., Iterator[Delta]], request: dict, echo: bool = False) -> Run:
    """Stream one request (`Client.stream` or `LocalPipeline.stream`) -> (its Generation, seconds); `echo` prints it."""
    start = time.perf_counter()
    deltas = []
    for delta in stream(**request):
        deltas.append(delta)
        if echo:
            print(delta.text, end="", flush=True)
    seconds = time.perf_counter() - start
    if echo:
        print("\n")
    return Generation.from_deltas(deltas), seconds


def time_requests(config: PipelineConfig, requests: list[dict], echo: bool = False) -> list[Run]:
    """Serve `config` on the running Ray, warm it up, then stream `requests` one after another
    (keyword dicts for `Client.stream`); -> [(Generation, seconds)]. `echo` prints the first answer."""
    with serving(config, requests[0]) as client:
        return [timed(client.stream, request, echo and i == 0) for i, request in enumerate(requests)]


def placement_lines(config: PipelineConfig) -> list[str]:
    """One line per device of `config`: its stages and resources."""
    lines = []
    for k, indices in enumerate(config.devices(), 1):
        stages = [config.stages[i] for i in indices]
        resources = ", ".join(f"{key} {value:g}" for key, value in stages[0].resources.items())
        lines.append(f"  device {k}: {' + '.join(s.name for s in stages):<24}({resources})")
    return lines


def run_demo(
    prompt: str = DEFAULT_PROMPT,
    image: Any = None,
    max_new_tokens: int = 96,
    dtype: str = "float32",
    json_path: str | None = None,
    models: Path = DEMO_MODELS,
    runs: int = 3,
    plan: Devices | None = None,
) -> int:
    """`plan`: the devices to place the stages on with `pipespec plan`'s recommendation (None: all three
    stages, a device each)."""
    from pipespec.local import LocalPipeline

    if not (models / "target" / "config.json").is_file():
        print(f"pipespec: no demo models under {models}; train them with `python -m demo.train all`")
        return 2
    if image is None and not (models / "example.png").is_file():
        print(
            f"pipespec: no example picture under {models}; give one with --image FILE or write it with `python -m demo.train picture`"
        )
        return 2
    truth = picture_truth(models, image)
    if image is None:
        image = default_image(models)
    else:
        from pipespec.requests.images import image_bytes, load_image

        try:
            load_image(image_bytes(image)[0])
        except ValueError as e:
            print(f"pipespec: {e}")
            return 2
    request = dict(prompt=prompt, image=image, max_new_tokens=max_new_tokens)
    config, chosen = pipeline_config(models, dtype, plan, prompt, image)
    threads = max(1, round(config.cpus()))
    print(f"\npipeline: {' -> '.join(s.name for s in config.stages)}  (models/demo, trained on the generated world; {dtype})")
    print("placement:", *placement_lines(config), sep="\n")
    print(f"target alone: in this process, {_count(threads, 'torch thread')} (the pipeline's cores)")
    print(f"prompt: {prompt!r}\n")
    rounds: list[tuple[Run, Run]] = []
    try:
        with local_ray():
            alone_config = demo_config(models, ["target"], dtype, threads)
            with serving(config, request) as client, LocalPipeline(alone_config, torch_threads=threads) as alone:
                alone.generate(**{**request, "max_new_tokens": 4})
                for i in range(runs):  # alternate, so that whatever else the machine does falls on both sides
                    rounds.append((timed(client.stream, request, echo=i == 0), timed(alone.stream, request)))
                    if i == 0 and truth is not None:
                        print(f"the picture shows: {truth}\n")
    except ConfigError as e:  # the placement does not fit this machine
        print(f"pipespec: {e}")
        return 2
    except GenerationError as e:
        print(f"pipespec: {e}")
        return 1
    return report(rounds, config, threads, chosen, json_path)


def pipeline_config(
    models: Path, dtype: str, plan: Devices | None, prompt: str, image: Any
) -> tuple[PipelineConfig, Plan | None]:
    """The demo's pipeline: tiny -> dream -> target, a device each; or, with `plan`, what `pipespec plan`
    recommends for those devices, profiled here on the demo's request (printed with its reasons)."""
    names = ["tiny", "dream", "target"]
    if plan is None:
        return demo_config(models, names, dtype, Devices.of_this_machine(len(names)).cpus), None
    from pipespec.planning.plan import auto, explain

    print(f"planning for {_count(plan.count, 'device')} of {_count(plan.cpus, 'core')} (profiling here) ...")
    raw, chosen = auto(demo_raw(models, names, dtype, plan.cpus), plan, prompts=[prompt], image=image)
    print(explain(chosen))
    return load_config(raw), chosen


def _count(n: float, thing: str) -> str:
    return f"{n:g} {thing}{'s' if n != 1 else ''}"


def report(
    rounds: list[tuple[Run, Run]], config: PipelineConfig, threads: int, chosen: Plan | None, json_path: str | None
) -> int:
    """Print the rounds (pipeline, target alone), the pairs' acceptance and the median ratio; write the JSON
    figures; -> 0 if every answer equals the target alone's."""
    piped, alone = [_rate(p) for p, _ in rounds], [_rate(a) for _, a in rounds]
    ratios = [p / a for p, a in zip(piped, alone)]
    exact = all(p[0].token_ids == a[0].token_ids for p, a in rounds)
    pairs = merged_pairs([p[0] for p, _ in rounds])
    print(f"{'round':<8}{'pipeline tok/s':>16}{'target alone tok/s':>20}{'ratio':>8}")
    for k, (p, a, r) in enumerate(zip(piped, alone, ratios), 1):
        print(f"{k:<8}{p:>16.1f}{a:>20.1f}{r:>7.2f}x")
    print(f"\n{'drafter -> verifier':<22}{'drafts':>8}{'drafted':>9}{'accepted':>10}{'acceptance':>12}{'mean acc. len':>15}")
    for pair in pairs:
        print(
            f"{pair.drafter + ' -> ' + pair.verifier:<22}{pair.num_drafts:>8}{pair.num_draft_tokens:>9}"
            f"{pair.num_accepted_tokens:>10}{pair.acceptance_rate:>12.2f}{pair.mean_acceptance_length:>15.2f}"
        )
    figures = {
        "exact": exact,
        "speedup_vs_target": statistics.median(ratios),
        "tokens_per_second": statistics.median(piped),
        "target_alone_tokens_per_second": statistics.median(alone),
        "target_alone_threads": threads,
        "rounds": [{"pipeline": p, "target_alone": a, "ratio": r} for p, a, r in zip(piped, alone, ratios)],
        "placement": [
            {"stages": [config.stages[i].name for i in indices], "resources": dict(config.stages[indices[0]].resources)}
            for indices in config.devices()
        ],
        "lookaheads": {s.name: s.max_lookahead for s in config.stages[:-1]},
        "predicted_tokens_per_second": chosen.recommended.tokens_per_s if chosen else None,
        "pairs": [
            {
                k: v
                for k, v in pair.as_dict().items()
                if k in ("drafter", "verifier", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length")
            }
            for pair in pairs
        ],
    }
    predicted = f" (predicted {chosen.recommended.tokens_per_s:.1f})" if chosen else ""
    print(
        f"\npipeline {figures['tokens_per_second']:.1f} tok/s{predicted}, target alone {figures['target_alone_tokens_per_second']:.1f} "
        f"tok/s (medians of {len(rounds)} alternating runs): speedup {figures['speedup_vs_target']:.2f}x (the median of "
        f"the rounds' ratios); "
        f"identical to the target alone: {'yes' if exact else 'NO'}"
    )
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if exact else 1


def _rate(run: Run) -> float:
    return len(run[0].token_ids) / run[1]


def merged_pairs(generations: list[Generation]) -> list[PairStats]:
    """Each stage pair's statistics summed over `generations`, in the order of the first."""
    merged = [PairStats(p.drafter, p.verifier) for p in generations[0].stats.pairs]
    for generation in generations:
        for total, pair in zip(merged, generation.stats.pairs):
            total.merge(pair)
    return merged
