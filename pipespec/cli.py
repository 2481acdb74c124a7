"""The `pipespec` command line.

    pipespec demo [--prompt TEXT] [--image FILE] [--max-new-tokens N] [--json FILE]
    pipespec serve CONFIG [--address RAY_ADDRESS] [--port P] [--strategy pack|spread]
    pipespec generate --address HOST:PORT --prompt TEXT [--image FILE] [--max-new-tokens N]
                      [--temperature T] [--top-p P] [--seed S]
    pipespec plan CONFIG [--prompt TEXT ...] [--image FILE] [--max-new-tokens N] [--json FILE]
                  [--write-config FILE] [--threads N]

`demo` runs the embedded default on a local Ray (see pipespec.cluster.demo): the shipped models (tiny -> dream
-> VLM target, trained on the generated visual world) answer a question about a picture, streamed
token by token; then the target alone answers the same request, and a table shows each stage pair's
acceptance, tokens per second and the speedup measured right then, and whether the answers match.

`plan` profiles each stage's forward latency and each pair's acceptance on a few prompts, in this
process, and recommends which stages to use and each drafter's lookahead (see pipespec.plan).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else "\u00b7" for c in text)


def demo(args: argparse.Namespace) -> int:
    from pipespec.cluster.demo import DEFAULT_PROMPT, run_demo

    models = {"models": Path(args.models)} if args.models else {}
    return run_demo(args.prompt or DEFAULT_PROMPT, args.image, args.max_new_tokens, args.dtype, args.json, **models)


def serve(args: argparse.Namespace) -> int:
    from pipespec.cluster.launch import serve as launch

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


def plan(args: argparse.Namespace) -> int:
    import json

    from pipespec.plan import format_plan, profile, read_config, recommend, write_config

    logging.getLogger("pipespec.plan").setLevel(logging.INFO)  # progress on stderr: profiling real models takes a while
    try:
        _, raw = read_config(args.config)
        measured = profile(raw, args.prompt, args.image, args.max_new_tokens, torch_threads=args.threads)
    except ValueError as e:  # ConfigError included: the message names the key, file or value
        print(f"pipespec plan: {e}", file=sys.stderr)
        return 2
    result = recommend(measured, raw)
    print(format_plan(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    if args.write_config:
        Path(args.write_config).parent.mkdir(parents=True, exist_ok=True)
        write_config(raw, result, args.write_config)
        print(f"recommended config written to {args.write_config}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipespec", description="Asynchronous hierarchical speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the embedded default pipeline on this machine")
    d.add_argument("--prompt", help="the question (default: Describe the image.)")
    d.add_argument("--image", help="a picture to ask about (default: the shipped example, models/demo/example.png)")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="float32 (default) compares exactly with the target alone; in bfloat16 a verifier's block "
        "logits can differ in the last bit from one-token decoding and flip a near-tie",
    )
    d.add_argument("--models", help="the trained demo models (default: models/demo; python -m demo.train)")
    d.add_argument("--json", help="also write the figures as JSON to this file")
    d.set_defaults(run=demo)
    s = sub.add_parser("serve", help="start a pipeline on Ray (a local one by default) and serve it")
    s.add_argument("config", help="a pipeline YAML file, or the name of an example shipped in pipespec/configs (e.g. mock3)")
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
    p = sub.add_parser("plan", help="profile a config's stages and recommend the chain and lookaheads to use")
    p.add_argument("config")
    p.add_argument("--prompt", action="append", help="a prompt to profile on (repeatable; default: a few built-in ones)")
    p.add_argument("--image", help="a picture for a VLM target (required there)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt to measure acceptance")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as each stage of a pipeline here)")
    p.add_argument("--json", help="also write the profile and the plan as JSON to this file")
    p.add_argument("--write-config", help="write the recommended config (YAML) to this file")
    p.set_defaults(run=plan)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
