"""The `pipespec` command line.

    pipespec demo [--prompt TEXT] [--image FILE] [--max-new-tokens N] [--runs N] [--plan auto|none] [--devices N]
                  [--models DIR] [--json FILE]
    pipespec serve CONFIG [--address RAY_ADDRESS] [--host H] [--port P] [--strategy pack|spread|strict-pack|strict-spread]
                   [--http-port N [--http-host H] [--allowed-local-media-path DIR]] [--drain-seconds S]
                   [--plan auto|none [--devices N] [--image FILE]]
    pipespec generate --address HOST:PORT (--prompt TEXT | --prompt-token-ids IDS) [--system TEXT] [--image FILE]
                      [--max-new-tokens N]
                      [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop TEXT ...] [--logprobs K]
                      [--tokenizer DIR]
    pipespec plan CONFIG [--devices N] [--prompt TEXT ...] [--image FILE] [--max-new-tokens N] [--json FILE]
                  [--write-config FILE] [--threads N] [--trials N]
    pipespec config CONFIG | --reference
    pipespec --version

Every command takes `--log-level LEVEL` (DEBUG, INFO, WARNING, ERROR, CRITICAL; default WARNING;
INFO shows `plan`'s progress), or a logging config file named by $PIPESPEC_LOGGING_CONFIG (pipespec.commands.logs).

`demo` runs the embedded default on a local Ray (see pipespec.cli.demo): the shipped models (tiny -> dream
-> VLM target, trained on the generated visual world), in the chain and placement `pipespec plan`
recommends for this machine (`--plan none`: all three, a device each), answer a question about a picture, streamed
token by token; then pipeline and target-alone runs alternate, and a table shows each stage pair's
acceptance, the median tokens per second of each side and their median ratio, and whether the answers match.
Its models are `--models`, by default models/demo in the working directory (`make demo` runs it in the
repository).

`generate` sends the prompt as the user's message, after `--system`'s when given, and streams the answer
to stdout; its statistics follow on stderr, on a line of their own. A failure is one line on stderr
(the messages are `LocalPipeline`'s) and nothing more on stdout (but the end of the line of an answer
already streamed): exit 2 for bad input, whichever side sees it (a value out of range or over one of the
pipeline's limits, a missing or undecodable image, a tokenizer that does not load), exit 1 when the
request fails in the pipeline or the server cannot be reached. With `--logprobs K`, each generated
token's logprob and its K most likely alternatives follow the answer on stderr, one line per token
(the token, its logprob, then token:logprob for each alternative; tab-separated): each token as its
text (JSON-quoted) with `--tokenizer DIR` (the pipeline's tokenizer: a stage's model directory), else
as its id (the wire carries ids).

`plan` profiles each stage's forward latency and each pair's acceptance on a few prompts, in this
process, and recommends which stages to use, their placement on the devices and each drafter's
lookahead (see pipespec.planning.plan). Devices default to this machine's cores, one core each (`--devices N`
splits the cores into N devices). Then it tries `--trials` chains (pipespec.planning.plan.contenders), and the
target alone, in place on a local Ray, each round beside the target alone in this process, and
recommends the greatest speedup measured (`trials`; requests timed as `timed_requests` times them for
the demo too).
`config` prints the config (a file, or the name of an example shipped in pipespec/configs) as it is validated,
every default filled in, as YAML that loads back to the same config; an invalid one is one line on stderr naming
the key and its value (exit 2). `config --reference` prints every key's type, default and meaning, rendered from
the config's declarations (`config_reference`; docs/config-reference.md is its output).
`--plan auto` on `serve` (and `demo`, by default) profiles quickly, prints the recommendation and why,
and runs it; `demo` tries first, `serve` takes the model's pick (it may be launched onto a cluster).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipespec.cli.trials import TRIALS
from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.requests.generate_args import DEFAULT_MAX_NEW_TOKENS, GenerateArgs

if TYPE_CHECKING:
    from pipespec.config import PipelineConfig

DEMO_MODELS = Path("models", "demo")  # `pipespec demo`'s models: the working directory's (`make demo` runs in the repository)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else "\u00b7" for c in text)


def _fail(command: str, why: object, code: int = 2) -> int:
    """`why` on stderr, one line; -> `code` (2: bad input, 1: a failure of the server or of reaching it)."""
    print(f"pipespec {command}: {why}", file=sys.stderr)
    return code


def demo_command(args: argparse.Namespace) -> int:  # not `demo`: the submodule pipespec.cli.demo takes that name
    from pipespec.cli.demo import DEFAULT_PROMPT, DemoError, demo_request, demo_setup, planning_line, run_demo
    from pipespec.planning.placement import Devices
    from pipespec.requests.outputs import GenerationError

    if args.runs < 1:
        return _fail("demo", f"--runs must be at least 1, got {args.runs}")
    if args.devices is not None and args.plan != "auto":
        return _fail("demo", "--devices places the stages with --plan auto (the default), not --plan none")
    try:
        devices = Devices.of_this_machine(args.devices) if args.plan == "auto" else None
    except ValueError as e:
        return _fail("demo", e)
    try:
        request = demo_request(args.models, args.prompt or DEFAULT_PROMPT, args.image, args.max_new_tokens)
        if devices is not None:
            print(planning_line(devices), flush=True)
        setup = demo_setup(request, args.dtype, devices, on_trial=lambda trial: print(f"  tried {trial}", flush=True))
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
    from pipespec.cluster.launch import ServeOptions, check_early
    from pipespec.cluster.launch import serve as launch
    from pipespec.commands.examples import config_path
    from pipespec.config import load_config

    config: str | PipelineConfig = args.config
    if args.plan != "auto" and (args.devices is not None or args.image is not None):
        return _fail("serve", "--devices and --image are for --plan auto; give it too")
    if args.plan == "auto":
        try:  # before profiling imports torch and loads the models
            check_early(load_config(config_path(args.config)), ServeOptions.from_flags(args))
        except ValueError as e:  # ConfigError included
            return _fail("serve", e)
        from pipespec.planning.placement import Devices
        from pipespec.planning.plan import auto, explain

        try:
            config, chosen = auto(config_path(args.config), Devices.of_this_machine(args.devices), image=args.image)
        except ValueError as e:  # ConfigError included
            return _fail("serve", e)
        print(explain(chosen), flush=True)
    return launch(config, ServeOptions.from_flags(args))


# the request's keywords that `pipespec generate` takes as flags of the same names (`--max-new-tokens`: max_new_tokens)
FLAGGED = frozenset(f.name for f in fields(GenerateArgs)) - {"prompt", "messages"}


def generate(args: argparse.Namespace) -> int:
    from pipespec.client import Client
    from pipespec.requests.outputs import GenerationError, RequestRefused

    tokenizer = None
    if args.tokenizer is not None:  # to print --logprobs' tokens as text
        from pipespec.requests.tokenization import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer, "--tokenizer")
        except ValueError as e:  # ConfigError: the message names the directory (transformers' reason on one line)
            return _fail("generate", " ".join(str(e).split()))
    prompt, messages = args.prompt, None
    if args.system is not None and prompt is None:
        return _fail("generate", "--system needs --prompt: --prompt-token-ids bypass the chat template")
    if args.system is not None:  # a conversation: the system message, then the prompt (after the image, if any)
        user = [{"type": "image"}] if args.image is not None else []
        user.append({"type": "text", "text": args.prompt})
        prompt, messages = None, [{"role": "system", "content": args.system}, {"role": "user", "content": user}]
    logprobs: list[TokenLogprobs] = []
    with Client(args.address) as client:
        try:  # the request's GenerateArgs, built (checked) once by the Client, the image read: nothing sent yet
            flags = {f.name: getattr(args, f.name) for f in fields(GenerateArgs) if f.name in FLAGGED}
            deltas = client.stream(prompt, messages=messages, **flags)
        except ValueError as e:  # refused on this side: exit 2 like a usage error
            return _fail("generate", e)
        streamed = False
        try:
            for last in deltas:  # the last delta: the finish reason and the statistics
                if last.text:
                    print(_printable(last.text), end="", flush=True)
                    streamed = True
                logprobs.extend(last.logprobs)
        except GenerationError as e:  # refused by the server's front door (bad input), failed there, or not reached
            if streamed:
                print(flush=True)  # the error on a line of its own
            return _fail("generate", e, 2 if isinstance(e, RequestRefused) else 1)
    print(flush=True)  # the answer's line ended before anything goes to stderr
    for line in _logprob_lines(logprobs, tokenizer):
        print(line, file=sys.stderr)
    pairs = ", ".join(f"{p.drafter}->{p.verifier} {p.mean_acceptance_length:.2f}" for p in last.stats.pairs)
    print(f"[{last.finish_reason}; {last.stats.generated_tokens} tokens; mean acceptance length {pairs or '-'}]", file=sys.stderr)
    return 0


def _logprob_lines(logprobs: list[TokenLogprobs], tokenizer: Any = None) -> list[str]:
    """`--logprobs K`'s table, one line per generated token: the token, its logprob, then the K most likely
    tokens with theirs (token:logprob, most likely first), tab-separated, under a header; nothing if not
    asked. Each token as its text, JSON-quoted (spaces and newlines visible), when `tokenizer` is given,
    else as its id: the wire carries each token's id and logprobs, and a delta's text as a whole."""
    if not logprobs:
        return []

    def shown(token: int) -> str:
        return str(token) if tokenizer is None else json.dumps(tokenizer.decode([token]), ensure_ascii=False)

    rows = (f"{shown(t.token)}\t{t.logprob:.6f}\t" + " ".join(f"{shown(i)}:{p:.6f}" for i, p in t.top) for t in logprobs)
    return ["token\tlogprob\ttop", *rows]


def plan(args: argparse.Namespace) -> int:
    from pipespec.commands.examples import config_path
    from pipespec.config import load_config
    from pipespec.planning.placement import Devices
    from pipespec.planning.plan import format_plan, recommend, write_config
    from pipespec.planning.profiling import profile

    if args.trials < 0:
        return _fail("plan", f"--trials must be 0 or more, got {args.trials}")
    try:
        devices = Devices.of_this_machine(args.devices)
        threads = devices.threads if args.threads is None else args.threads
        config = load_config(config_path(args.config))
        measured = profile(config, args.prompt, args.image, args.max_new_tokens, torch_threads=threads)
    except ValueError as e:  # ConfigError included: the message names the key, file or value
        return _fail("plan", e)
    result = recommend(measured, config, devices)
    if args.trials:
        from pipespec.cli.trials import run_trials
        from pipespec.planning.plan import tried
        from pipespec.requests.outputs import GenerationError

        try:
            result = tried(result, run_trials(config, result, args.image, args.trials, threads=threads))
        except ValueError as e:  # a candidate the cluster refuses (ConfigError): the message names what
            return _fail("plan", e)
        except GenerationError as e:  # a request failed in a trial's pipeline
            return _fail("plan", f"a trial failed: {e}", 1)
    print(format_plan(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    if args.write_config:
        Path(args.write_config).parent.mkdir(parents=True, exist_ok=True)
        write_config(config, result, args.write_config)
        print(f"recommended config written to {args.write_config}")
    return 0


def config_command(args: argparse.Namespace) -> int:
    import yaml

    from pipespec.commands.examples import config_path
    from pipespec.config import config_dict, load_config

    if args.reference:
        from pipespec.cli.config_reference import reference

        print(reference(), end="")
        return 0
    if args.config is None:
        return _fail("config", "name a config file (or a shipped example), or ask for --reference")
    try:
        config = load_config(config_path(args.config))
    except ValueError as e:  # ConfigError: the message names the key
        return _fail("config", e)
    print(yaml.safe_dump(config_dict(config), sort_keys=False), end="")
    return 0


def _add_plan_flags(parser: argparse.ArgumentParser, plan_help: str, default: str = "none") -> None:
    """`--plan auto|none` and the `--devices` auto places the stages on (demo, serve); `plan_help` says what each runs."""
    parser.add_argument("--plan", choices=["auto", "none"], default=default, help=f"{plan_help} (default {default})")
    parser.add_argument(
        "--devices", type=int, help="with --plan auto: split this machine's cores into N devices (default: one per core)"
    )


def _token_ids(text: str) -> list[int]:
    """--prompt-token-ids: "1,2,3" -> [1, 2, 3]."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids (such as 1,2,3)") from None


def build_parser() -> argparse.ArgumentParser:
    """The `pipespec` command's parser: a subcommand each, every flag with its help."""
    from pipespec.cluster.launch import add_serve_arguments
    from pipespec.commands.logs import add_log_level

    parser = argparse.ArgumentParser(prog="pipespec", description="Asynchronous hierarchical speculative decoding.")
    parser.add_argument("--version", action="version", version=f"pipespec {version('pipespec')}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the embedded default pipeline on this machine")
    d.add_argument("--prompt", help="the question (default: Describe the image.)")
    d.add_argument("--image", help="a picture to ask about (default: the shipped example, example.png under --models)")
    d.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens to generate per run (default {DEFAULT_MAX_NEW_TOKENS})",
    )
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
    _add_plan_flags(
        d,
        "auto: profile the models, run the chain and placement `pipespec plan` recommends; "
        "none: tiny -> dream -> target, a device each",
        default="auto",
    )
    d.add_argument("--json", help="also write the figures as JSON to this file")
    add_log_level(d)
    d.set_defaults(run=demo_command)
    s = sub.add_parser("serve", help="start a pipeline on Ray (a local one by default) and serve it")
    s.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    add_serve_arguments(s)  # CONFIG, --host, --port, --strategy, --http-port, --http-host, --allowed-local-media-path
    _add_plan_flags(
        s, "auto: profile the config here, serve the chain and placement `pipespec plan` recommends; none: the config as written"
    )
    s.add_argument("--image", help="with --plan auto: a picture to profile a VLM target on")
    add_log_level(s)
    s.set_defaults(run=serve)
    g = sub.add_parser("generate", help="stream a generation from a running pipeline")
    g.add_argument("--address", required=True, help="HOST:PORT printed by serve")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the user's message")
    what.add_argument(
        "--prompt-token-ids",
        type=_token_ids,
        metavar="IDS",
        help="the prompt as token ids, comma-separated (1,2,3): no tokenizer, no chat template (mock stages)",
    )
    g.add_argument("--system", help="a system message, sent before the prompt")
    g.add_argument("--image", metavar="FILE", help="a picture to send with the prompt (PNG, JPEG, WEBP, GIF or BMP)")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    g.add_argument("--temperature", type=float, help="sampling temperature, 0 = greedy (default: the pipeline config's)")
    g.add_argument(
        "--top-p", type=float, help="nucleus sampling: keep the most likely tokens up to this mass (default: the config's)"
    )
    g.add_argument("--top-k", type=int, help="sample among the K most likely tokens only, 0 = all (default: the config's)")
    g.add_argument("--seed", type=int, help="the sampling seed: the same seed, the same answer (default: the config's)")
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--logprobs", type=int, metavar="K", help="ask for each token's logprob and its K top alternatives")
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the pipeline's tokenizer (a stage's model directory) to print --logprobs' tokens as text (default: ids)",
    )
    add_log_level(g)
    g.set_defaults(run=generate)
    p = sub.add_parser("plan", help="profile a config's stages and recommend the chain and lookaheads to use")
    p.add_argument("config", help="a pipeline YAML file, or the name of an example shipped in pipespec/configs")
    p.add_argument(
        "--devices", type=int, help="devices to place the stages on: this machine's cores split in N (default: one per core)"
    )
    p.add_argument("--prompt", action="append", help="a prompt to profile on (repeatable; default: a few built-in ones)")
    p.add_argument("--image", help="a picture for a VLM target (required there)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens generated per prompt to measure acceptance (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument("--threads", type=int, help="torch threads to profile at (default: the cores of one device)")
    p.add_argument(
        "--trials",
        type=int,
        default=TRIALS,
        help=f"run N chains (the best-ranked on each number of devices, each drafter's pair), the target alone and the "
        f"fastest chain measured again with draft trees, in place on a local Ray and recommend the greatest speedup measured "
        f"(0: the model's pick, nothing "
        f"started; default {TRIALS})",
    )
    p.add_argument("--json", help="also write the profile and the plan as JSON to this file")
    p.add_argument("--write-config", help="write the recommended config (YAML) to this file")
    add_log_level(p)  # INFO: profiling's and the trials' progress (real models take a while)
    p.set_defaults(run=plan)
    c = sub.add_parser("config", help="print a config as validated, every default filled in (or its error)")
    c.add_argument("config", nargs="?", help="a pipeline YAML file, or the name of an example shipped in pipespec/configs")
    c.add_argument("--reference", action="store_true", help="print every config key's type, default and meaning instead")
    add_log_level(c)
    c.set_defaults(run=config_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pipespec.commands.logs import LoggingConfigError, setup_logging

    args = build_parser().parse_args(argv)
    try:
        setup_logging(args.log_level)
    except LoggingConfigError as e:
        return _fail(args.command, e)
    return args.run(args)
