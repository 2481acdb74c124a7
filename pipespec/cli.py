"""The `pipespec` command line.

    pipespec demo [--prompt TEXT] [--max-new-tokens N] [--json FILE]
    pipespec serve CONFIG [--address RAY_ADDRESS] [--port P] [--strategy pack|spread]
    pipespec generate --address HOST:PORT --prompt TEXT [--image FILE] [--max-new-tokens N]
                      [--temperature T] [--top-p P] [--seed S]

`demo` runs the embedded default on this machine: a 3-stage pipeline (tiny -> mid -> target) streams
an answer, then the target runs alone on the same prompt, and a table shows each stage pair's
acceptance, tokens per second and the speedup, measured right then, and whether the two answers are
identical. Until the trained demo models ship, the models are small Llamas with random weights built
from configs (`experiments.toy_models`), saved once under --models and loaded from disk. All stages
run in this one process (LocalPipeline): they share two cores and Python's GIL, so the speedup shown
is that of the in-process runtime, not of stages on their own devices.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

DEFAULT_MODELS = Path(".cache/toy-models-v1")
DEFAULT_PROMPT = "the red circle is left of the blue square and"


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else "\u00b7" for c in text)


def demo(args: argparse.Namespace) -> int:
    from experiments.toy_models import DEMO_SIZES, build_family
    from pipespec import LocalPipeline, load_config

    models = Path(args.models)
    if not (models / "target" / "config.json").is_file():
        print(f"building the toy models (random weights) under {models} ...", flush=True)
        build_family(models, **DEMO_SIZES)
    names = ["tiny", "mid", "target"]
    stage = lambda n: {"name": n, "kind": "causal_lm", "model": str(models / n), "dtype": args.dtype, "max_lookahead": 8}
    pipeline = load_config({"name": "demo", "stages": [stage(n) for n in names]})
    alone = load_config({"name": "target-alone", "stages": [stage("target")]})
    print(f"pipeline: {' -> '.join(names)}  (toy Llamas with random weights: the text is noise, the mechanics are real)")
    print(f"prompt: {args.prompt!r}\n")

    with LocalPipeline(pipeline) as p:
        p.generate(args.prompt, max_new_tokens=4)  # warm up
        t0 = time.perf_counter()
        deltas = []
        for delta in p.stream(args.prompt, max_new_tokens=args.max_new_tokens):
            deltas.append(delta)
            print(_printable(delta.text), end="", flush=True)
        piped_s = time.perf_counter() - t0
        print("\n")
    from pipespec.outputs import Generation

    result = Generation.from_deltas(deltas)
    with LocalPipeline(alone, stages=[p.stages[-1]]) as t:
        t0 = time.perf_counter()
        reference = t.generate(args.prompt, max_new_tokens=args.max_new_tokens)
        alone_s = time.perf_counter() - t0

    tps, tps_alone = len(result.token_ids) / piped_s, len(reference.token_ids) / alone_s
    figures = {
        "exact": result.token_ids == reference.token_ids,
        "speedup_vs_target": tps / tps_alone,
        "tokens_per_second": tps,
        "target_alone_tokens_per_second": tps_alone,
        "prefill_s": result.stats.prefill_s,
        "pairs": [{k: v for k, v in pair.as_dict().items() if k != "per_position_acceptance"} for pair in result.stats.pairs],
    }
    print(f"{'drafter -> verifier':<22}{'drafts':>8}{'drafted':>9}{'accepted':>10}{'mean acc. len':>15}")
    for pair in result.stats.pairs:
        print(
            f"{pair.drafter + ' -> ' + pair.verifier:<22}{pair.num_drafts:>8}{pair.num_draft_tokens:>9}"
            f"{pair.num_accepted_tokens:>10}{pair.mean_acceptance_length:>15.2f}"
        )
    print(
        f"\npipeline {tps:.1f} tok/s, target alone {tps_alone:.1f} tok/s: speedup {figures['speedup_vs_target']:.2f}x; "
        f"identical to the target alone: {'yes' if figures['exact'] else 'NO'}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if figures["exact"] else 1


def serve(args: argparse.Namespace) -> int:
    from cluster.launch import serve as launch

    return launch(args.config, args.address, args.host, args.port, args.strategy)


def generate(args: argparse.Namespace) -> int:
    from pipespec.client import Client
    from pipespec.images import image_bytes

    last = None
    try:
        image = image_bytes(args.image)[0] if args.image else None  # read once, named if it is missing
    except ValueError as e:
        print(f"pipespec: {e}", file=sys.stderr)
        return 1
    for delta in Client(args.address).stream(
        args.prompt,
        image=image,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    ):
        print(_printable(delta.text), end="", flush=True)
        last = delta
    print()
    if last is None or last.finish_reason == "error":
        print(f"pipespec: {last.error if last else 'no answer'}", file=sys.stderr)
        return 1
    pairs = ", ".join(f"{p.drafter}->{p.verifier} {p.mean_acceptance_length:.2f}" for p in last.stats.pairs)
    print(f"[{last.finish_reason}; {last.stats.generated_tokens} tokens; mean acceptance length {pairs or '-'}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipespec", description="Asynchronous hierarchical speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the embedded default pipeline on this machine")
    d.add_argument("--prompt", default=DEFAULT_PROMPT)
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="float32 (default) compares exactly with the target alone; in bfloat16 a verifier's block "
        "logits can differ in the last bit from one-token decoding and flip a near-tie",
    )
    d.add_argument("--models", default=str(DEFAULT_MODELS), help="where the toy models are built and loaded from")
    d.add_argument("--json", help="also write the figures as JSON to this file")
    d.set_defaults(run=demo)
    s = sub.add_parser("serve", help="start a pipeline on Ray (a local one by default) and serve it")
    s.add_argument("config")
    s.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, help="coordinator port (default: the config's server.port)")
    s.add_argument("--strategy", default="pack")
    s.set_defaults(run=serve)
    g = sub.add_parser("generate", help="stream a generation from a running pipeline")
    g.add_argument("--address", required=True, help="HOST:PORT printed by serve")
    g.add_argument("--prompt", required=True)
    g.add_argument("--image")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int)
    g.set_defaults(run=generate)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
