"""The `pipespec` command line.

    pipespec demo [--prompt TEXT] [--image FILE] [--max-new-tokens N] [--runs N] [--plan auto [--devices N]]
                  [--models DIR] [--json FILE]
    pipespec serve CONFIG [--address RAY_ADDRESS] [--host H] [--port P] [--strategy pack|spread|strict-pack|strict-spread]
                   [--http-port N [--http-host H] [--allowed-local-media-path DIR]] [--plan auto [--devices N] [--image FILE]]
    pipespec generate --address HOST:PORT --prompt TEXT [--system TEXT] [--image FILE] [--max-new-tokens N]
                      [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop TEXT ...] [--logprobs K]
    pipespec plan CONFIG [--devices N] [--prompt TEXT ...] [--image FILE] [--max-new-tokens N] [--json FILE]
                  [--write-config FILE] [--threads N]

Every command takes `--log-level LEVEL` (DEBUG, INFO, WARNING, ERROR, CRITICAL; default WARNING, INFO
for `plan`), or a logging config file named by $PIPESPEC_LOGGING_CONFIG (pipespec.commands.logs).

`demo` runs the embedded default on a local Ray (see pipespec.cli.demo): the shipped models (tiny -> dream
-> VLM target, trained on the generated visual world) answer a question about a picture, streamed
token by token; then pipeline and target-alone runs alternate, and a table shows each stage pair's
acceptance, the median tokens per second of each side and their median ratio, and whether the answers match.
Its models are `--models`, by default models/demo in the working directory (`make demo` runs it in the
repository).

`generate` sends the prompt as the user's message, after `--system`'s when given. It refuses a bad
value with one line on stderr: exit 2 when this side sees it (a value out of range, a missing image
file: nothing is sent), exit 1 when the server refuses it (one of its pipeline's limits), the request
fails there or the server cannot be reached. The messages are `LocalPipeline`'s. With `--logprobs K`,
each generated token's logprob and its K most likely alternatives follow the answer on stderr, one
line per token (token id, logprob, then id:logprob for each alternative; tab-separated).

`plan` profiles each stage's forward latency and each pair's acceptance on a few prompts, in this
process, and recommends which stages to use, their placement on the devices and each drafter's
lookahead (see pipespec.planning.plan). Devices default to this machine's cores, one core each (`--devices N`
splits the cores into N devices). `--plan auto` on `serve` and `demo` profiles quickly, prints the
recommendation and why, and runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.requests.generate_args import DEFAULT_MAX_NEW_TOKENS

DEMO_MODELS = Path("models", "demo")  # `pipespec demo`'s models: the working directory's (`make demo` runs in the repository)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else "\u00b7" for c in text)


def _fail(command: str, why: object) -> int:
    print(f"pipespec {command}: {why}", file=sys.stderr)
    return 2


def demo_command(args: argparse.Namespace) -> int:  # not `demo`: the submodule pipespec.cli.demo takes that name
    from pipespec.cli.demo import DEFAULT_PROMPT, DemoError, demo_request, demo_setup, planning_line, run_demo
    from pipespec.planning.placement import Devices
    from pipespec.requests.outputs import GenerationError

    if args.runs < 1:
        return _fail("demo", f"--runs must be at least 1, got {args.runs}")
    if args.devices is not None and args.plan != "auto":
        return _fail("demo", "--devices places the stages with --plan auto; give both")
    try:
        devices = Devices.of_this_machine(args.devices) if args.plan == "auto" else None
    except ValueError as e:
        return _fail("demo", e)
    try:
        request = demo_request(args.models, args.prompt or DEFAULT_PROMPT, args.image, args.max_new_tokens)
        if devices is not None:
            print(planning_line(devices), flush=True)
        setup = demo_setup(request, args.dtype, devices)
        print("\n".join(setup.lines()), flush=True)
        report = run_demo(setup, args.runs, on_text=lambda text: print(text, end="", flush=True))
    except DemoError as e:  # what it was given cannot run (nothing is left running)
        return _fail("demo", e)
    except GenerationError as e:  # a request failed in the pipeline
        print()
        print(f"pipespec demo: {e}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0 if report.exact else 1


def serve(args: argparse.Namespace) -> int:
    from pipespec.cluster.launch import ServeOptions
    from pipespec.cluster.launch import serve as launch
    from pipespec.commands.examples import config_path

    config: str | dict = args.config
    if args.plan != "auto" and (args.devices is not None or args.image is not None):
        return _fail("serve", "--devices and --image are for --plan auto; give it too")
    if args.plan == "auto":
        from pipespec.planning.placement import Devices
        from pipespec.planning.plan import auto, explain

        try:
            config, chosen = auto(config_path(args.config), Devices.of_this_machine(args.devices), image=args.image)
        except ValueError as e:  # ConfigError included
            return _fail("serve", e)
        print(explain(chosen), flush=True)
    return launch(config, ServeOptions.from_flags(args))


def generate(args: argparse.Namespace) -> int:
    from pipespec.client import Client
    from pipespec.requests.outputs import GenerationError

    prompt, messages = args.prompt, None
    if args.system is not None:  # a conversation: the system message, then the prompt (after the image, if any)
        user = [{"type": "image"}] if args.image is not None else []
        user.append({"type": "text", "text": args.prompt})
        prompt, messages = None, [{"role": "system", "content": args.system}, {"role": "user", "content": user}]
    logprobs: list[TokenLogprobs] = []
    with Client(args.address) as client:
        try:  # the request's GenerateArgs, built (checked) once by the Client, the image read: nothing sent yet
            deltas = client.stream(
                prompt,
                messages=messages,
                image=args.image,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                logprobs=args.logprobs,
            )
        except ValueError as e:  # refused on this side: exit 2 like a usage error
            return _fail("generate", e)
        try:
            for last in deltas:  # the last delta: the finish reason and the statistics
                print(_printable(last.text), end="", flush=True)
                logprobs.extend(last.logprobs)
        except GenerationError as e:  # refused by the server's front door, failed there, or not reached
            print()
            print(f"pipespec generate: {e}", file=sys.stderr)
            return 1
    print()
    for line in _logprob_lines(logprobs):
        print(line, file=sys.stderr)
    pairs = ", ".join(f"{p.drafter}->{p.verifier} {p.mean_acceptance_length:.2f}" for p in last.stats.pairs)
    print(f"[{last.finish_reason}; {last.stats.generated_tokens} tokens; mean acceptance length {pairs or '-'}]", file=sys.stderr)
    return 0


def _logprob_lines(logprobs: list[TokenLogprobs]) -> list[str]:
    """`--logprobs K`'s table, one line per generated token: its id, its logprob, then the K most likely
    ids with theirs (id:logprob, most likely first), tab-separated, under a header; nothing if not asked.
    Ids, not text: the wire carries each token's id and logprobs, and a delta's text as a whole."""
    if not logprobs:
        return []
    rows = (f"{t.token}\t{t.logprob:.6f}\t" + " ".join(f"{i}:{p:.6f}" for i, p in t.top) for t in logprobs)
    return ["token\tlogprob\ttop", *rows]


def plan(args: argparse.Namespace) -> int:
    from pipespec.planning.placement import Devices
    from pipespec.planning.plan import format_plan, recommend, write_config
    from pipespec.planning.profiling import profile, read_config

    try:
        devices = Devices.of_this_machine(args.devices)
        threads = devices.threads if args.threads is None else args.threads
        _, raw = read_config(args.config)
        measured = profile(raw, args.prompt, args.image, args.max_new_tokens, torch_threads=threads)
    except ValueError as e:  # ConfigError included: the message names the key, file or value
        return _fail("plan", e)
    result = recommend(measured, raw, devices)
    print(format_plan(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    if args.write_config:
        Path(args.write_config).parent.mkdir(parents=True, exist_ok=True)
        write_config(raw, result, args.write_config)
        print(f"recommended config written to {args.write_config}")
    return 0


def _add_plan_flags(parser: argparse.ArgumentParser, plan_help: str) -> None:
    """`--plan auto` and the `--devices` it places the stages on (demo, serve); `plan_help` says what auto runs."""
    parser.add_argument("--plan", choices=["auto"], help=plan_help)
    parser.add_argument(
        "--devices", type=int, help="with --plan auto: split this machine's cores into N devices (default: one per core)"
    )


def main(argv: list[str] | None = None) -> int:
    from pipespec.cluster.launch import add_serve_arguments
    from pipespec.commands.logs import LoggingConfigError, add_log_level, setup_logging

    parser = argparse.ArgumentParser(prog="pipespec", description="Asynchronous hierarchical speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the embedded default pipeline on this machine")
    d.add_argument("--prompt", help="the question (default: Describe the image.)")
    d.add_argument("--image", help="a picture to ask about (default: the shipped example, example.png under --models)")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="float32 (default) compares exactly with the target alone; in bfloat16 a verifier's block "
        "logits can differ in the last bit from one-token decoding and flip a near-tie",
    )
    d.add_argument(
        "--models",
        type=Path,
        default=DEMO_MODELS,
        help="the trained demo models (default: models/demo in the working directory; python -m demo.train)",
    )
    d.add_argument("--runs", type=int, default=3, help="pipeline and target-alone runs, alternating (default 3 each)")
    _add_plan_flags(d, "auto: profile the models, run the chain and placement `pipespec plan` recommends")
    d.add_argument("--json", help="also write the figures as JSON to this file")
    add_log_level(d)
    d.set_defaults(run=demo_command)
    s = sub.add_parser("serve", help="start a pipeline on Ray (a local one by default) and serve it")
    s.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    add_serve_arguments(s)  # CONFIG, --host, --port, --strategy, --http-port, --http-host, --allowed-local-media-path
    _add_plan_flags(s, "auto: profile the config here, serve the chain and placement `pipespec plan` recommends")
    s.add_argument("--image", help="with --plan auto: a picture to profile a VLM target on")
    add_log_level(s)
    s.set_defaults(run=serve)
    g = sub.add_parser("generate", help="stream a generation from a running pipeline")
    g.add_argument("--address", required=True, help="HOST:PORT printed by serve")
    g.add_argument("--prompt", required=True, help="the user's message")
    g.add_argument("--system", help="a system message, sent before the prompt")
    g.add_argument("--image")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--logprobs", type=int, metavar="K", help="ask for each token's logprob and its K top alternatives")
    add_log_level(g)
    g.set_defaults(run=generate)
    p = sub.add_parser("plan", help="profile a config's stages and recommend the chain and lookaheads to use")
    p.add_argument("config")
    p.add_argument(
        "--devices", type=int, help="devices to place the stages on: this machine's cores split in N (default: one per core)"
    )
    p.add_argument("--prompt", action="append", help="a prompt to profile on (repeatable; default: a few built-in ones)")
    p.add_argument("--image", help="a picture for a VLM target (required there)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt to measure acceptance")
    p.add_argument("--threads", type=int, help="torch threads to profile at (default: the cores of one device)")
    p.add_argument("--json", help="also write the profile and the plan as JSON to this file")
    p.add_argument("--write-config", help="write the recommended config (YAML) to this file")
    add_log_level(p, default="INFO")  # profiling's progress: real models take a while
    p.set_defaults(run=plan)
    args = parser.parse_args(argv)
    try:
        setup_logging(args.log_level)
    except LoggingConfigError as e:
        return _fail(args.command, e)
    return args.run(args)
