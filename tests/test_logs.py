"""Tests for pipespec/commands/logs.py: `--log-level` on every command, and a logging config file named by
`PIPESPEC_LOGGING_CONFIG`, whose content reaches the Ray actors (as JSON in their environment).

The real command line runs in a subprocess (`pipespec generate` against an address where nothing
listens: it logs, at DEBUG, the channel it opens): `--log-level DEBUG` shows what the default hides,
and a config file from the environment is applied whatever the level says. A bad level is refused by
argparse, a config file that does not load is one line naming it (exit 2). Every entry point with
argparse (pipespec's commands, experiments/, demo/) takes `--log-level`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipespec.cli import build_parser
from pipespec.cli import main as cli
from pipespec.cluster.launch import main as launch_main
from pipespec.commands.logs import (
    CONFIG_ENV,
    CONFIG_JSON_ENV,
    LEVEL_ENV,
    LoggingConfigError,
    actor_env,
    parse_logged,
    setup_logging,
)
from tests.fixtures.ports import nowhere

ROOT = Path(__file__).resolve().parents[1]
OPENED = "DEBUG pipespec.transport.generate_client: opened a channel to the coordinator at"


def generate(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`pipespec generate` against an address where nothing listens: exit 1, after logging the channel it opens at DEBUG."""
    command = [sys.executable, "-m", "pipespec.cli", "generate", "--address", nowhere(), "--prompt", "hi", *flags]
    environment = {k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, LEVEL_ENV)} | (env or {})
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment, cwd=ROOT)


@pytest.fixture
def root_logger():
    """The root logger's level and handlers, put back after the test."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    root.setLevel(level)
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)


def test_log_level_debug_shows_what_the_default_hides():
    default, debug = generate(), generate("--log-level", "debug")
    assert default.returncode == debug.returncode == 1
    assert OPENED not in default.stderr
    assert OPENED in debug.stderr
    assert "UNAVAILABLE" in debug.stderr.splitlines()[-1]  # the error, as at any level


@pytest.mark.parametrize("argv", [["demo"], ["serve", "mock3"], ["generate", "--address", "a:1", "--prompt", "p"], ["plan", "c"]])
def test_a_bad_level_is_refused_by_argparse(argv, capsys):
    with pytest.raises(SystemExit) as refused:
        cli([*argv, "--log-level", "LOUD"])
    assert refused.value.code == 2
    assert re.search(r"argument --log-level: invalid choice: 'LOUD' \(choose from .*DEBUG", capsys.readouterr().err)


def test_launch_refuses_a_bad_level(capsys):
    from pipespec.cluster.launch import main as launch

    with pytest.raises(SystemExit) as refused:
        launch(["mock3", "--log-level", "verbose"])
    assert refused.value.code == 2 and "invalid choice: 'VERBOSE'" in capsys.readouterr().err


def test_the_level_is_the_root_loggers_in_any_case(root_logger):
    for given, level in (("debug", logging.DEBUG), ("Error", logging.ERROR), ("WARNING", logging.WARNING)):
        assert cli(["generate", "--address", nowhere(), "--prompt", "hi", "--log-level", given]) == 1
        assert root_logger.level == level


@pytest.mark.parametrize("form", ["json", "yaml"])
def test_a_config_file_from_the_environment_is_applied(tmp_path, form):
    log_file = tmp_path / "pipespec.log"
    config = {
        "version": 1,
        "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "plain"}},
        "loggers": {"pipespec": {"level": "DEBUG", "handlers": ["file"]}},
    }
    path = tmp_path / f"logging.{form}"
    path.write_text(json.dumps(config) if form == "json" else yaml.safe_dump(config))
    out = generate("--log-level", "ERROR", env={CONFIG_ENV: str(path)})  # the file decides, not the level
    assert out.returncode == 1, out.stderr
    assert OPENED in log_file.read_text()


BROKEN = {
    "missing": (None, "cannot be read: No such file or directory"),
    "not YAML": ("version: [1\n", "is neither JSON nor YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1"),
    "not a mapping": ("- version\n", "must hold a mapping (logging.config.dictConfig's form), got list"),
}


@pytest.mark.parametrize("case", BROKEN, ids=BROKEN)
def test_a_broken_config_file_is_one_line_naming_it(case, tmp_path, monkeypatch, capsys):
    text, why = BROKEN[case]
    path = tmp_path / "logging.yaml"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert cli(["generate", "--address", nowhere(), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == f"pipespec generate: the logging config {str(path)!r} (${CONFIG_ENV}) {why}\n"
    with pytest.raises(LoggingConfigError, match=re.escape(why)):
        setup_logging("INFO")


def test_a_config_logging_cannot_apply_is_one_line_naming_it(tmp_path):
    """(In a subprocess: logging.config.dictConfig closes this process's handlers before it fails.)"""
    path = tmp_path / "logging.json"
    path.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}))
    out = generate(env={CONFIG_ENV: str(path)})
    assert out.returncode == 2 and out.stdout == ""
    assert re.fullmatch(
        rf"pipespec generate: the logging config {re.escape(repr(str(path)))} \(\${CONFIG_ENV}\) does not configure logging: .*handler 'h'.*\n",
        out.stderr,
    )


def test_ray_actors_are_told_the_level_or_the_file(root_logger, monkeypatch, tmp_path):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    root_logger.setLevel(logging.WARNING)
    assert actor_env() == {}  # the default: nothing to tell
    root_logger.setLevel(logging.DEBUG)
    assert actor_env() == {LEVEL_ENV: "DEBUG"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logging.yaml").write_text(yaml.safe_dump(QUIET))
    monkeypatch.setenv(CONFIG_ENV, "logging.yaml")
    told = actor_env()  # the content: an actor's node may not have the file
    assert list(told) == [CONFIG_JSON_ENV] and json.loads(told[CONFIG_JSON_ENV]) == QUIET


QUIET = {"version": 1, "incremental": True, "loggers": {"tests.test_logs": {"level": "ERROR"}}}  # safe in this process


def test_an_actor_applies_the_config_file_where_the_file_is_not(monkeypatch, tmp_path):
    """The file's content reaches the actor: `setup_logging()` there applies it though the path names nothing."""
    path = tmp_path / "logging.yaml"
    path.write_text(yaml.safe_dump(QUIET))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    env = actor_env()
    path.unlink()  # another node: the environment it inherits may still name the file
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    logger = logging.getLogger("tests.test_logs")
    try:
        setup_logging()
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(logging.NOTSET)


def test_a_config_carried_to_an_actor_that_is_not_json_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv(CONFIG_JSON_ENV, "[1")
    with pytest.raises(LoggingConfigError, match=re.escape(f"the logging config in ${CONFIG_JSON_ENV} is not JSON: ")):
        setup_logging()


def test_an_actor_takes_its_level_from_the_environment(root_logger, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setenv(LEVEL_ENV, "INFO")
    setup_logging()
    assert root_logger.level == logging.INFO


def test_a_script_parses_its_arguments_and_logs_at_the_level_asked(root_logger):
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parse_logged(parser, ["--runs", "2", "--log-level", "info"])
    assert args.runs == 2 and args.log_level == "INFO" and root_logger.level == logging.INFO


COMMANDS = ("pipespec/cli/__init__.py", "pipespec/cluster/launch.py", "training/train.py")
ENTRY_POINTS = sorted(
    path
    for path in [*ROOT.glob("experiments/*.py"), *ROOT.glob("dev/*.py"), *ROOT.glob("demo/*.py"), *(ROOT / p for p in COMMANDS)]
    if "ArgumentParser(" in path.read_text()
)


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=[str(p.relative_to(ROOT)) for p in ENTRY_POINTS])
def test_every_command_takes_log_level(path):
    text = path.read_text()
    assert "parse_logged(" in text or "add_log_level(" in text and "setup_logging(" in text


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub for a in actions for name, sub in a.choices.items()}


def test_every_pipespec_command_logs_at_warning_by_default(capsys):
    commands = _subcommands(build_parser())
    assert {"demo", "serve", "generate", "plan"} <= set(commands)
    for name, parser in commands.items():
        assert parser.get_default("log_level") == "WARNING", name
    with pytest.raises(SystemExit):
        launch_main(["--help"])
    assert "(default WARNING)" in " ".join(capsys.readouterr().out.split())


_LOAD = """
import sys
from pipespec.commands.logs import setup_logging
setup_logging(sys.argv[1])
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[2])
"""


@pytest.mark.parametrize("level, bars", [("WARNING", False), ("INFO", True)])
def test_loading_a_model_shows_progress_bars_only_at_info(family, level, bars):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "GRPC_VERBOSITY")}
    done = subprocess.run([sys.executable, "-c", _LOAD, level, family["tiny"]], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert ("Loading weights" in done.stderr) == bars, done.stderr
    assert bars or "\x1b[" not in done.stderr  # no colour codes when quiet
