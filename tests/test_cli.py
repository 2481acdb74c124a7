"""The command line end to end: `pipespec serve` a config on a Ray (the session's head, which it joins; `pipespec
demo` starts a Ray of its own, as on a fresh machine), `pipespec generate` from it.

Without Ray (a pipeline in this process behind the coordinator's gRPC service): every flag of every
subcommand has help; `generate` streams the answer to stdout and its statistics to stderr on a line of
their own, prints `--logprobs` with each token's text given `--tokenizer`, and fails with one line on
stderr and nothing on stdout: exit 2 for bad input, whichever side sees it, exit 1 when the server
cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.fixtures import DEMO_MODELS
from tests.fixtures.ports import nowhere
from tests.fixtures.ray_head import RayHead

needs_ray = [pytest.mark.ray, pytest.mark.slow]  # the tests that start a Ray session (marks, applied one by one)


def ray_test(test):
    for mark in needs_ray:
        test = mark(test)
    return test


PIPESPEC = str(Path(sys.executable).with_name("pipespec"))


def ray_env() -> dict[str, str]:
    """This environment, with Ray kept on loopback and no cluster to join: each command starts its own."""
    from pipespec.cluster.pipeline import RAY_ENV

    return {**os.environ, **RAY_ENV, "RAY_ADDRESS": ""}


@contextmanager
def serving(config: Path, head: RayHead) -> Iterator[str]:
    """`pipespec serve CONFIG` in a process of its own, joining `head`; yields the address it prints once serving,
    then stops it with SIGTERM, on which it must exit 0."""
    server = subprocess.Popen(
        [PIPESPEC, "serve", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=head.join()
    )
    try:
        address = None
        for line in server.stdout:  # blocks until serve prints its address (or exits)
            if "serving" in line:
                address = line.rsplit(" at ", 1)[1].strip()
                break
        assert address, "pipespec serve exited without serving"
        yield address
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=120)
    assert server.returncode == 0


@ray_test
def test_serve_a_vlm_then_generate_with_and_without_an_image(tmp_path, ray_head):
    """A VLM target in Ray actors behind `pipespec serve`: `pipespec generate` streams the answer with its
    statistics on stderr, `--image` sends the file; both equal the target alone. (Bad input on every flag:
    test_a_failure_is_one_line_on_stderr_nothing_on_stdout_and_one_exit_code_convention, on one served in process.)"""
    import numpy as np
    from PIL import Image

    from pipespec import LocalPipeline, load_config
    from pipespec.cli import _printable
    from tests.fixtures.vlm_zoo import build_zoo_family

    paths = build_zoo_family("llava", tmp_path / "zoo")
    picture = tmp_path / "picture.png"
    Image.fromarray((np.random.default_rng(3).random((48, 40, 3)) * 255).astype(np.uint8)).save(picture)
    stage = lambda n, kind: {"name": n, "kind": kind, "model": str(paths[n]), "dtype": "float32", "resources": {"num_cpus": 0.5}}  # noqa: E731
    config = {"name": "vlm", "stages": [stage("tiny", "causal_lm"), stage("target", "vlm")], "server": {"port": 0}}
    with LocalPipeline(load_config({"stages": [stage("target", "vlm")]})) as alone:
        expected = [alone.generate("the red circle", image=image, max_new_tokens=12).text for image in (None, str(picture))]
    assert expected[0] != expected[1], "the picture changes nothing: the test could not tell it was sent"
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    with serving(path, ray_head) as address:
        run = lambda *extra: subprocess.run(  # noqa: E731
            [PIPESPEC, "generate", "--address", address, "--prompt", "the red circle", "--max-new-tokens", "12", *extra],
            capture_output=True, text=True, timeout=120, env=ray_env(),
        )  # fmt: skip
        for out, want in zip((run(), run("--image", str(picture))), expected):
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == _printable(want).strip()
            assert "[length; 12 tokens; mean acceptance length tiny->target" in out.stderr


@ray_test
def test_demo_runs_the_shipped_models_exactly(tmp_path):
    """`pipespec demo --plan none`: local Ray, tiny -> dream -> VLM target from models/demo, figures as JSON."""
    import json

    out = tmp_path / "demo.json"
    run = subprocess.run(
        [PIPESPEC, "demo", "--plan", "none", "--max-new-tokens", "24", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ray_env(),
        cwd=DEMO_MODELS.parents[1],  # the checkout's root, where `make demo` runs: --models defaults to models/demo there
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["exact"] is True
    assert [(p["drafter"], p["verifier"]) for p in figures["pairs"]] == [("tiny", "dream"), ("dream", "target")]
    assert figures["tokens_per_second"] > 0 and figures["speedup_vs_target"] > 0
    assert "identical to the target alone: yes" in run.stdout
    assert len(figures["rounds"]) == 3 and "medians of 3 alternating runs" in run.stdout  # --runs defaults to 3
    assert [d["stages"] for d in figures["placement"]] == [["tiny"], ["dream"], ["target"]]
    cores = sum(d["resources"]["num_cpus"] for d in figures["placement"])
    assert figures["target_alone_threads"] in (1, max(1, round(cores)))  # whichever ran it faster
    assert "placement:\n  device 1: tiny" in run.stdout and "target alone: in this process" in run.stdout
    truth = json.loads((DEMO_MODELS / "example.json").read_text())["truth"]
    assert f"the picture shows: {truth}" in run.stdout  # under the answer, so a reader can judge it


def test_an_unknown_strategy_is_refused_before_anything_starts(capsys):
    from pipespec.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["serve", "mock3", "--strategy", "bogus"])
    assert refused.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


@ray_test
def test_serve_names_resources_it_can_never_place_and_exits_2(tmp_path, ray_head):
    stage = {"name": "t", "kind": "mock", "vocab_size": 16, "resources": {"num_cpus": 1000}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "huge", "stages": [stage], "server": {"port": 0}}))
    out = subprocess.run([PIPESPEC, "serve", str(path)], capture_output=True, text=True, timeout=300, env=ray_head.join())
    assert out.returncode == 2, out.stderr
    assert "{'CPU': 1000.0}] can never be placed (pack): no node has the resources" in out.stderr
    assert "Traceback" not in out.stderr


# --- without Ray: the parser, and `generate` against a pipeline in this process ---------------------


def actions_without_help(parser: argparse.ArgumentParser, command: str = "pipespec") -> list[str]:
    """Every argument (and subcommand) of `parser` and of its subcommands, at any depth, that has no help."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest for choice in action._choices_actions if choice.help}
            for name, sub in action.choices.items():
                if name not in listed:
                    missing.append(f"{command} {name}")
                missing += actions_without_help(sub, f"{command} {name}")
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{command} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_flag_of_every_subcommand_has_help():
    from pipespec.cli import build_parser

    assert actions_without_help(build_parser()) == []


def test_the_help_check_finds_what_has_none():
    parser = argparse.ArgumentParser(prog="p")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="runs")
    run.add_argument("--fast", help="fast")
    run.add_argument("--image")
    run.add_argument("config")
    sub.add_parser("quiet").add_argument("--x", help="x")
    assert actions_without_help(parser) == ["pipespec run --image", "pipespec run config", "pipespec quiet"]


@dataclass
class Served:
    address: str
    tokenizer: str  # the pipeline's tokenizer directory (its target's)
    pipe: object


@pytest.fixture(scope="module")
def served(family) -> Iterator[Served]:
    """The toy target alone in a `LocalPipeline`, its coordinator's gRPC service on 127.0.0.1 (any port)."""
    from pipespec import LocalPipeline, load_config
    from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator

    config = load_config({"stages": [{"name": "target", "kind": "causal_lm", "model": family["target"], "dtype": "float32"}]})
    with LocalPipeline(config) as pipe:
        service = CoordinatorService(pipe.serving, "cli-test")
        server, port = asyncio.run_coroutine_threadsafe(serve_coordinator(service, "127.0.0.1", 0), pipe.loop).result()
        try:
            yield Served(f"127.0.0.1:{port}", family["target"], pipe)
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(grace=None), pipe.loop).result()


def test_the_statistics_are_a_line_of_their_own_after_the_answer(served):
    """stdout and stderr on one pipe, as a terminal shows them: the answer, then the statistics' line
    (stdout block-buffered, as Python buffers a pipe unless PYTHONUNBUFFERED says otherwise)."""
    from pipespec.cli import _printable

    expected = served.pipe.generate("the red circle", max_new_tokens=12).text
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run(
        [PIPESPEC, "generate", "--address", served.address, "--prompt", "the red circle", "--max-new-tokens", "12"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=buffered,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout
    *answer, stats = out.stdout.rstrip("\n").split("\n")
    assert "\n".join(answer) == _printable(expected)
    assert stats.startswith("[length; 12 tokens; mean acceptance length")


def test_logprobs_show_each_token_as_text_given_the_tokenizer(served, capsys):
    from transformers import AutoTokenizer

    from pipespec.cli import main as cli

    tokenizer = AutoTokenizer.from_pretrained(served.tokenizer)
    alone = served.pipe.generate("the red circle", max_new_tokens=6, logprobs=2)
    ask = ["generate", "--address", served.address, "--prompt", "the red circle", "--max-new-tokens", "6", "--logprobs", "2"]
    assert cli([*ask, "--tokenizer", served.tokenizer]) == 0
    header, *rows, stats = capsys.readouterr().err.splitlines()
    assert header == "token\tlogprob\ttop" and len(rows) == len(alone.logprobs) == 6 and stats.startswith("[length; 6 tokens")
    shown = lambda token: json.dumps(tokenizer.decode([token]), ensure_ascii=False)  # noqa: E731
    for row, want in zip(rows, alone.logprobs):
        token, logprob, top = row.split("\t")
        assert token == shown(want.token) and float(logprob) == pytest.approx(want.logprob, abs=1e-5)
        assert re.findall(r'("(?:[^"\\]|\\.)*"):-?[0-9.inf]+', top) == [
            shown(i) for i in want.top_ids
        ]  # JSON strings, then :logprob
    assert cli(ask) == 0  # without a tokenizer: the ids
    rows = capsys.readouterr().err.splitlines()[1:-1]
    assert [int(row.split("\t")[0]) for row in rows] == [t.token for t in alone.logprobs]


def test_a_prompt_as_token_ids_bypasses_the_tokenizer(served, capsys):
    """What a mock pipeline (no tokenizer) takes: the same answer as the LocalPipeline given the same ids."""
    from pipespec.cli import main as cli

    expected = served.pipe.generate(prompt_token_ids=[5, 9, 3], max_new_tokens=6).token_ids
    ask = ["generate", "--address", served.address, "--prompt-token-ids", "5,9,3", "--max-new-tokens", "6", "--logprobs", "0"]
    assert cli(ask) == 0
    rows = capsys.readouterr().err.splitlines()[1:-1]
    assert [int(row.split("\t")[0]) for row in rows] == expected


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt-token-ids", "1,x"], "argument --prompt-token-ids: '1,x' is not comma-separated token ids (such as 1,2,3)"),
        (["--prompt", "hi", "--prompt-token-ids", "1"], "argument --prompt-token-ids: not allowed with argument --prompt"),
        ([], "one of the arguments --prompt --prompt-token-ids is required"),
    ],
)
def test_the_prompt_is_text_or_token_ids_exactly_one_of_them(flags, message, capsys):
    from pipespec.cli import main as cli

    with pytest.raises(SystemExit) as exit_:
        cli(["generate", "--address", nowhere(), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_system_message_needs_a_text_prompt(capsys):
    from pipespec.cli import main as cli

    assert cli(["generate", "--address", nowhere(), "--prompt-token-ids", "1,2", "--system", "Be brief."]) == 2
    assert capsys.readouterr().err == "pipespec generate: --system needs --prompt: --prompt-token-ids bypass the chat template\n"


@pytest.mark.parametrize(
    "flags, code, message",
    [
        (["--temperature", "-2"], 2, "temperature must be >= 0, got -2.0"),  # refused here, nothing sent
        (["--image", "{tmp}/nope.png"], 2, "image file '{tmp}/nope.png' does not exist"),
        (["--image", "{tmp}/text.png"], 2, "image"),  # not a picture: refused by the server's front door
        (["--max-new-tokens", "9000"], 2, "max_new_tokens 9000 is over limits.max_new_tokens (8192)"),  # the server's limit
        (["--tokenizer", "{tmp}"], 2, "--tokenizer: cannot load a tokenizer from '{tmp}'"),
        ([], 1, "the coordinator at {nowhere}: UNAVAILABLE"),  # nothing listens there
    ],
    ids=["bad temperature", "missing image", "not an image", "over a limit", "no tokenizer there", "refused connection"],
)
def test_a_failure_is_one_line_on_stderr_nothing_on_stdout_and_one_exit_code_convention(served, tmp_path, flags, code, message):
    """Exit 2 for bad input (whichever side sees it), 1 when the server fails or cannot be reached."""
    (tmp_path / "text.png").write_text("not a picture")
    address = served.address if flags else nowhere()
    fill = lambda text: text.replace("{tmp}", str(tmp_path)).replace("{nowhere}", address)  # noqa: E731
    out = subprocess.run(
        [PIPESPEC, "generate", "--address", address, "--prompt", "the red circle", "--max-new-tokens", "4", *map(fill, flags)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (out.returncode, out.stdout) == (code, ""), out.stderr
    assert out.stderr.startswith("pipespec generate: ") and out.stderr.count("\n") == 1, out.stderr
    assert fill(message) in out.stderr


# --- a port in use: refused before anything starts ----------------------------------------------------

# Runs a command's main in a fresh interpreter, then says, as JSON on stdout's last line, its exit code,
# its seconds and whether ray or torch was ever imported (no Ray session, no model, can start without).
PROBE = """
import json, sys, time
from importlib import import_module
started = time.perf_counter()
code = import_module(sys.argv[1]).main(sys.argv[2:])
print(json.dumps({"code": code, "seconds": time.perf_counter() - started, "ray": "ray" in sys.modules,
                  "torch": "torch" in sys.modules}))
"""


@pytest.fixture
def busy() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


@pytest.fixture
def models_config(family, tmp_path) -> Path:
    """A pipeline of the toy models (tiny -> target): what `--plan auto` would profile, loading them."""
    stage = lambda n: {"name": n, "kind": "causal_lm", "model": family[n], "dtype": "float32"}  # noqa: E731
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "toy", "stages": [stage("tiny"), stage("target")], "server": {"port": 0}}))
    return path


@pytest.mark.parametrize(
    "module, argv, what, key",
    [
        ("pipespec.cli", ["serve", "mock3", "--port", "{busy}"], "the coordinator", "--port"),
        ("pipespec.cli", ["serve", "mock3", "--port", "0", "--http-port", "{busy}"], "the HTTP server", "--http-port"),
        ("pipespec.cli", ["serve", "{models}", "--port", "{busy}", "--plan", "auto"], "the coordinator", "--port"),
        ("pipespec.cluster.launch", ["mock3", "--port", "{busy}"], "the coordinator", "--port"),
    ],
    ids=["serve", "serve --http-port", "serve --plan auto", "cluster.launch"],
)
def test_a_port_in_use_is_refused_before_ray_starts_or_a_model_loads(busy, models_config, module, argv, what, key):
    fill = lambda a: a.replace("{busy}", str(busy)).replace("{models}", str(models_config))  # noqa: E731
    out = subprocess.run([sys.executable, "-c", PROBE, module, *map(fill, argv)], capture_output=True, text=True, timeout=120)
    probe = json.loads(out.stdout)  # nothing else on stdout
    assert probe["code"] == 2 and not probe["ray"] and not probe["torch"], (probe, out.stderr)
    refusal = f"{what} cannot serve on 127.0.0.1:{busy}: Address already in use ({key}; 0 picks a free port)\n"
    assert out.stderr in (f"pipespec: {refusal}", f"pipespec serve: {refusal}"), out.stderr  # one line
    assert probe["seconds"] < 30  # a hang guard only: it takes milliseconds; Ray's start alone took seconds


def test_pipespec_serve_on_a_port_in_use_returns_at_once_naming_it(busy):
    """The installed command as a user runs it: the message, exit 2, nothing on stdout, within seconds
    (interpreter start included; a hang guard, not a benchmark)."""
    started = time.perf_counter()
    out = subprocess.run(
        [PIPESPEC, "serve", "mock3", "--port", str(busy)], capture_output=True, text=True, timeout=120, env=ray_env()
    )
    seconds = time.perf_counter() - started
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert f"pipespec: the coordinator cannot serve on 127.0.0.1:{busy}: Address already in use" in out.stderr
    assert seconds < 30, seconds  # a hang guard (a loaded CI machine); it took 0.7 s here


@pytest.mark.parametrize("name", ["mock3", "demo", "demo_two_cores"])
def test_config_prints_a_shipped_example_with_every_default_and_it_loads_back_the_same(name, capsys, monkeypatch):
    from pipespec.cli import main
    from pipespec.commands.examples import config_path
    from pipespec.config import StageSpec, load_config

    monkeypatch.chdir(Path(__file__).parents[1])  # the demo configs name models/demo relative to the checkout
    assert main(["config", name]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert load_config(printed) == load_config(config_path(name))
    keys = {f.name for f in dataclasses.fields(StageSpec)} - {"options", "model"}  # a mock loads no model
    assert all(keys <= set(stage) for stage in printed["stages"])  # every key, its default written out


def test_config_prints_a_tree_section_that_loads_back_the_same(tmp_path, capsys):
    from pipespec.cli import main
    from pipespec.config import load_config

    raw = {"stages": [{"name": "d", "kind": "mock", "tree": {"budget": 5, "temperature": 0.7}}, {"name": "t", "kind": "mock"}]}
    path = tmp_path / "tree.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["config", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["stages"][0]["tree"] == {"budget": 5, "depth": 7, "branching": 4, "temperature": 0.7}
    assert load_config(printed) == load_config(raw)


def test_config_names_the_bad_key_on_one_line_and_exits_2(tmp_path, capsys):
    from pipespec.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"stages": [{"name": "t", "kind": "mock", "max_lookahead": -1}]}))
    assert main(["config", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "pipespec config: stages[0].max_lookahead: must be >= 0, got -1\n"


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    from pipespec.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"pipespec {version('pipespec')}\n"
