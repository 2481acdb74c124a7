"""Serving latency over the OpenAI-compatible HTTP endpoint, at several concurrencies, pipeline vs target alone.

    python -m experiments.bench_http --demo [--concurrency 1 4 16] [--requests 32] [--runs 3] [--max-tokens 64]
    python -m experiments.bench_http --config PIPELINE.yaml --alone-config TARGET.yaml --prompts FILE ...
    python -m experiments.bench_http --url http://127.0.0.1:8000 --prompts FILE ...   # a server already running

Each side is served the way users run it: `pipespec serve CONFIG --http-port P` (a local Ray, one
actor per device with the config's resources, the coordinator's HTTP server), started afresh per
run and stopped by its process id. The sides alternate, their order flipping every run, so whatever
else the machine does falls on both; both get the same cores (the demo: the pipeline's three
stages at 2/3 of a core each, the target alone on both cores). At each concurrency the same
`--requests` chat requests (greedy, the held-out questions of the demo world with their pictures as
`image_url` data URLs, or a prompt file's) go through `experiments.serving_load`, which times them
by vLLM's definitions (TTFT, TPOT, ITL, E2EL; mean, median, p99). The figures quoted are medians over
runs; written to --out as bench_http.json and bench_http.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from experiments.prompt_sets import WORLD_PROMPTS, Prompt, load_prompts
from experiments.serving_load import CLIENTS, run_load, summarize
from pipespec.commands.logs import add_log_level, setup_logging

log = logging.getLogger(__name__)
FIGURES = ("ttft", "tpot", "itl", "e2el")


def bodies(prompts: list[Prompt], max_tokens: int, n: int) -> list[dict]:
    """`n` greedy chat requests cycling through `prompts` (a picture as an image_url data URL)."""
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        content: list[dict] = [{"type": "text", "text": p.text}]
        if p.image is not None:
            url = "data:image/png;base64," + base64.b64encode(p.image.read_bytes()).decode()
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        out.append({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, deadline_s: float) -> None:
    """Until GET /health answers 200 (the server polls its own readiness; this only waits for it)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {deadline_s:g} s")


@contextmanager
def served(config: Path, log_dir: Path) -> Iterator[str]:
    """`pipespec serve config --http-port P` in its own process group; yields the HTTP base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    out = (log_dir / f"{config.stem}.log").open("a")
    command = [sys.executable, "-m", "pipespec.cli", "serve", str(config), "--port", "0", "--http-port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, process, 600)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # `pipespec serve` stops its actors and its Ray on SIGTERM
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        out.close()


def served_model(url: str) -> str:
    """The model the server serves (GET /v1/models): what every request names."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def measure(url: str, requests: list[dict], concurrencies: list[int], client: str = "aiohttp") -> dict[int, dict]:
    model = served_model(url)
    requests = [{**r, "model": model} for r in requests]
    asyncio.run(run_load(url, requests[:1], 1, client=client))  # warm-up
    figures = {}
    for c in concurrencies:
        samples, duration = asyncio.run(run_load(url, requests, c, client=client))
        figures[c] = summarize(samples, duration)
        figures[c]["texts"] = [s.text for s in samples]
        log.info(
            "c=%d: %.1f tok/s, median TTFT %.0f ms", c, figures[c]["output_tokens_per_s"], figures[c]["ttft"]["median_ms"] or 0
        )
    return figures


def medians(runs: list[dict[int, dict]], c: int) -> dict:
    """Each figure's median over runs at concurrency c."""
    at = [r[c] for r in runs]
    out = {key: statistics.median(f[key] for f in at) for key in ("output_tokens_per_s", "requests_per_s")}
    for figure in FIGURES:
        out[figure] = {
            stat: statistics.median(v for f in at if (v := f[figure][stat]) is not None)
            if any(f[figure][stat] is not None for f in at)
            else None
            for stat in ("mean_ms", "median_ms", "p99_ms")
        }
    out["completed"] = min(f["completed"] for f in at)
    out["requests"] = at[0]["requests"]
    out["runs_output_tokens_per_s"] = [f["output_tokens_per_s"] for f in at]
    return out


def _pair(figure: dict) -> str:
    return f"{figure['median_ms']:.0f} / {figure['p99_ms']:.0f}" if figure["median_ms"] is not None else "-"


def table(result: dict) -> str:
    lines = [
        "| side | concurrency | done | output tok/s | TTFT median / p99 (ms) | TPOT median / p99 (ms) | ITL median / p99 (ms) | E2EL median (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, by_c in result["sides"].items():
        for c, f in by_c.items():
            ttft, tpot, itl = (_pair(f[name]) for name in ("ttft", "tpot", "itl"))
            lines.append(
                f"| {side} | {c} | {f['completed']}/{f['requests']} | {f['output_tokens_per_s']:.1f} | {ttft} | {tpot} | {itl} | "
                f"{f['e2el']['median_ms']:.0f} |"
            )
    for c, r in result.get("ratios", {}).items():
        lines.append(
            f"\npipeline / target alone at concurrency {c}: output tok/s x{r['throughput']:.2f}, median TPOT x{r['tpot']:.2f}"
        )
    return "\n".join(lines) + "\n"


def _relative(path: Path) -> str:
    """A path as the results record it: relative to the working directory when it lies under it."""
    resolved = path.resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else str(path)


def demo_configs(directory: Path) -> dict[str, Path]:
    """The demo's pipeline (tiny -> dream -> target, 2/3 core each) and its target alone (both cores), as YAML."""
    from pipespec.cli import DEMO_MODELS
    from pipespec.cli.demo import demo_config
    from pipespec.config import config_dict

    cores = os.cpu_count() or 1
    sides = {
        "pipeline": demo_config(DEMO_MODELS, ["tiny", "dream", "target"], "float32", cores / 3),
        "target alone": demo_config(DEMO_MODELS, ["target"], "float32", cores),
    }
    paths = {}
    for side, config in sides.items():
        paths[side] = directory / f"{config.name}.yaml"
        paths[side].write_text(yaml.safe_dump(config_dict(config), sort_keys=False))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--demo", action="store_true", help="the demo's models: pipeline vs target alone")
    which.add_argument("--config", type=Path, help="a pipeline config to serve (with --alone-config: its target alone)")
    which.add_argument("--url", help="measure a server already running at this base URL")
    parser.add_argument("--alone-config", type=Path, help="with --config: the target alone's config, served as the other side")
    parser.add_argument(
        "--prompts", type=Path, default=WORLD_PROMPTS, help="a prompt file (default: the demo world's held-out questions)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--client", choices=CLIENTS, default="aiohttp", help="how requests are sent: raw HTTP, or the official openai client"
    )
    parser.add_argument("--out", type=Path, default=Path("experiments/results/bench_http"))
    add_log_level(parser, default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level, fmt="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts)
    requests = bodies(prompts, args.max_tokens, args.requests)
    if args.url:
        result = {"sides": {args.url: {c: medians([measure(args.url, requests, [c], args.client)], c) for c in args.concurrency}}}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            if args.demo:
                configs = demo_configs(Path(tmp))
            else:
                configs = {"pipeline": args.config} | ({"target alone": args.alone_config} if args.alone_config else {})
            runs: dict[str, list] = {side: [] for side in configs}
            for i in range(args.runs):
                for side in configs if i % 2 == 0 else reversed(list(configs)):
                    log.info("run %d: %s", i + 1, side)
                    with served(configs[side], args.out) as url:
                        runs[side].append(measure(url, requests, args.concurrency, args.client))
        result = {"sides": {side: {c: medians(r, c) for c in args.concurrency} for side, r in runs.items()}}
        if len(runs) == 2:
            pipe, alone = result["sides"]["pipeline"], result["sides"]["target alone"]
            result["ratios"] = {
                c: {
                    "throughput": pipe[c]["output_tokens_per_s"] / alone[c]["output_tokens_per_s"],
                    "tpot": pipe[c]["tpot"]["median_ms"] / alone[c]["tpot"]["median_ms"],
                }
                for c in args.concurrency
            }
            result["same_answers"] = {
                c: sum(a == b for a, b in zip(runs["pipeline"][0][c]["texts"], runs["target alone"][0][c]["texts"]))
                for c in args.concurrency
            }
    result["settings"] = {k: _relative(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "cores": os.cpu_count()
    }
    (args.out / "bench_http.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "bench_http.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
