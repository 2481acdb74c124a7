"""`pipespec demo`: the embedded default, on a local Ray, on this machine.

The shipped models (`models/demo`: a LLaVA-class target trained on the generated visual world, a tiny
text drafter and a DREAM drafter, all trained by `python -m demo.train`) run as a 3-stage
pipeline, one Ray actor per stage, linked by gRPC streams: tiny -> dream -> target. A picture from the
world's held-out split (or `--image`) and a question (or `--prompt`) go through the `Client`; the
answer streams token by token. Then the target alone serves the same request on the same machine,
and a table shows each stage pair's acceptance, tokens per second and the speedup measured right
then, and whether the two answers are identical.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pipespec.cluster.pipeline import ray_env, start_pipeline
from pipespec.config import PipelineConfig, load_config

log = logging.getLogger(__name__)

DEMO_MODELS = Path(__file__).resolve().parents[2] / "models" / "demo"
DEFAULT_PROMPT = "Describe the image."


def demo_config(models: Path, names: list[str], dtype: str, cpus: float) -> PipelineConfig:
    kinds = {"tiny": "causal_lm", "dream": "dream", "target": "vlm"}
    lookahead = {"tiny": 6, "dream": 6, "target": 0}
    stages = [
        {
            "name": n, "kind": kinds[n], "model": str(models / n), "dtype": dtype, "max_lookahead": lookahead[n],
            "resources": {"num_cpus": cpus},
        }
        for n in names
    ]  # fmt: skip
    return load_config({"name": "demo" if len(names) > 1 else "target-alone", "stages": stages, "server": {"port": 0}})


def default_image(models: Path = DEMO_MODELS) -> Any:
    """The demo's default picture: a held-out picture of the world the models were trained on."""
    from PIL import Image

    with Image.open(models / "example.png") as picture:
        return picture.convert("RGB")


def time_requests(config: PipelineConfig, requests: list[dict], echo: bool = False) -> list[tuple[Any, float]]:
    """Serve `config` on the running Ray, warm it up, then stream `requests` one after another
    (keyword dicts for `Client.stream`); -> [(Generation, seconds)]. `echo` prints the first answer."""
    from pipespec import Client
    from pipespec.outputs import Generation

    running = start_pipeline(config)
    out = []
    try:
        client = Client(running.address)
        client.generate(**{**requests[0], "max_new_tokens": 4})  # warm up every stage
        for i, request in enumerate(requests):
            t0 = time.perf_counter()
            deltas = []
            for delta in client.stream(**request):
                deltas.append(delta)
                if echo and i == 0:
                    print(delta.text, end="", flush=True)
            out.append((Generation.from_deltas(deltas), time.perf_counter() - t0))
    finally:
        running.stop()
    if echo:
        print("\n")
    return out


def run_demo(
    prompt: str = DEFAULT_PROMPT,
    image: Any = None,
    max_new_tokens: int = 96,
    dtype: str = "float32",
    json_path: str | None = None,
    models: Path = DEMO_MODELS,
) -> int:
    ray_env()
    import ray

    if not (models / "target" / "config.json").is_file():
        print(f"pipespec: no demo models under {models}; train them with `python -m demo.train all`")
        return 2
    if image is None and not (models / "example.png").is_file():
        print(
            f"pipespec: no example picture under {models}; give one with --image FILE or write it with `python -m demo.train picture`"
        )
        return 2
    if image is None:
        image = default_image(models)
    else:
        from pipespec.images import image_bytes, load_image

        try:
            load_image(image_bytes(image)[0])
        except ValueError as e:
            print(f"pipespec: {e}")
            return 2
    names = ["tiny", "dream", "target"]
    print(f"pipeline: {' -> '.join(names)}  (models/demo, trained on the generated world; {dtype})")
    print(f"prompt: {prompt!r}\n")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        request = [dict(prompt=prompt, image=image, max_new_tokens=max_new_tokens)]
        [(result, piped_s)] = time_requests(demo_config(models, names, dtype, 2 / 3), request, echo=True)
        [(reference, alone_s)] = time_requests(demo_config(models, ["target"], dtype, 2), request)
    finally:
        ray.shutdown()
    if result.finish_reason == "error":
        print(f"pipespec: {result.error}")
        return 1
    tps, tps_alone = len(result.token_ids) / piped_s, len(reference.token_ids) / alone_s
    figures = {
        "exact": result.token_ids == reference.token_ids,
        "speedup_vs_target": tps / tps_alone,
        "tokens_per_second": tps,
        "target_alone_tokens_per_second": tps_alone,
        "pairs": [
            {
                k: v
                for k, v in pair.as_dict().items()
                if k in ("drafter", "verifier", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length")
            }
            for pair in result.stats.pairs
        ],
    }
    print(f"{'drafter -> verifier':<22}{'drafts':>8}{'drafted':>9}{'accepted':>10}{'acceptance':>12}{'mean acc. len':>15}")
    for pair in result.stats.pairs:
        rate = pair.num_accepted_tokens / max(pair.num_draft_tokens, 1)
        print(
            f"{pair.drafter + ' -> ' + pair.verifier:<22}{pair.num_drafts:>8}{pair.num_draft_tokens:>9}"
            f"{pair.num_accepted_tokens:>10}{rate:>12.2f}{pair.mean_acceptance_length:>15.2f}"
        )
    print(
        f"\npipeline {tps:.1f} tok/s, target alone {tps_alone:.1f} tok/s: speedup {figures['speedup_vs_target']:.2f}x; "
        f"identical to the target alone: {'yes' if figures['exact'] else 'NO'}"
    )
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["exact"] else 1
