"""Logging, set up the same way by every command: `--log-level`, or a config file named by an environment variable.

    parser = argparse.ArgumentParser()
    add_log_level(parser)
    args = parser.parse_args()
    setup_logging(args.log_level)

`--log-level` takes DEBUG, INFO, WARNING, ERROR or CRITICAL, in any case: the level of the root
logger, whose records go to stderr; WARNING by default for every command. Above INFO the libraries are
quiet too: no Hugging Face progress bars, no gRPC core chatter (`quiet_libraries`). When
`PIPESPEC_LOGGING_CONFIG` names a file (JSON, or YAML, in the form `logging.config.dictConfig` takes)
that file configures logging instead, and a file that does not load is a `LoggingConfigError` naming it.

Ray actors run in processes of their own, possibly on other nodes where the file is not:
`actor_env()` is what to put in their `runtime_env` env_vars (the level as `PIPESPEC_LOG_LEVEL`, or
the config file's content, parsed, as JSON in `PIPESPEC_LOGGING_CONFIG_JSON`), and each actor calls
`setup_logging()`, which reads them. The config travels, not the files it names: a handler's
`filename` is opened on the actor's own node.
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LEVEL = "WARNING"  # Python's own
CONFIG_ENV = "PIPESPEC_LOGGING_CONFIG"
CONFIG_JSON_ENV = "PIPESPEC_LOGGING_CONFIG_JSON"  # the file's content, as the launcher hands it to its actors
LEVEL_ENV = "PIPESPEC_LOG_LEVEL"
QUIET_ENV = {"GRPC_VERBOSITY": "ERROR", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # what `quiet_libraries` sets
FORMAT = "%(levelname)s %(name)s: %(message)s"


class LoggingConfigError(ValueError):
    """The logging config file cannot be read or applied (the message names it)."""


def add_log_level(parser: argparse.ArgumentParser, default: str = DEFAULT_LEVEL) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=default,
        metavar="LEVEL",
        help=f"what to log on stderr: {', '.join(LEVELS)} (default {default}); ${CONFIG_ENV}, a logging config file, overrides it",
    )


def parse_logged(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """What a script's `main` does first: `--log-level` added to `parser`, `argv` parsed, logging set up at that
    level (`setup_logging`) -> the arguments."""
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    return args


def setup_logging(level: str | None = None, fmt: str = FORMAT) -> None:
    """Configure this process's logging: from the config in `$PIPESPEC_LOGGING_CONFIG_JSON` (a Ray
    actor's, from `actor_env()`), else from the file `$PIPESPEC_LOGGING_CONFIG` names, else records at
    `level` and above (None: `$PIPESPEC_LOG_LEVEL`, else WARNING) to stderr, in `fmt`. Raises
    LoggingConfigError for a config that does not load."""
    if carried := os.environ.get(CONFIG_JSON_ENV):
        where = f"the logging config in ${CONFIG_JSON_ENV}"
        try:
            config = json.loads(carried)
        except ValueError as e:
            raise LoggingConfigError(f"{where} is not JSON: {e}") from None
        _apply(config, where)
    elif path := os.environ.get(CONFIG_ENV):
        _apply(read_config_file(path), _named(path))
    else:
        logging.basicConfig(format=fmt)  # a handler on stderr, unless logging has one already
        logging.getLogger().setLevel(level or os.environ.get(LEVEL_ENV, DEFAULT_LEVEL))
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        quiet_libraries()


def quiet_libraries() -> None:
    """No progress bars from Hugging Face (loading weights, reading the hub) and only errors from gRPC's C
    core, for the rest of the process and its children, as the libraries read them; an environment
    variable the user set wins. Called for any level above INFO: at INFO and below they speak as they would."""
    os.environ.update({name: value for name, value in QUIET_ENV.items() if name not in os.environ})
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != QUIET_ENV["HF_HUB_DISABLE_PROGRESS_BARS"]:
        return  # the user's choice
    if "huggingface_hub" in sys.modules:  # imported already: it read the variable then
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()


def read_config_file(path: str) -> dict:
    """The `logging.config.dictConfig` mapping a JSON or YAML file holds."""
    where = _named(path)
    try:
        config = yaml.safe_load(Path(path).read_text())  # YAML reads JSON too
    except OSError as e:
        raise LoggingConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise LoggingConfigError(f"{where} is neither JSON nor YAML: {_where_wrong(e)}") from None
    return config


def _named(path: str) -> str:
    return f"the logging config {path!r} (${CONFIG_ENV})"


def _apply(config: object, where: str) -> None:
    """Configure logging from `config`, a mapping in `logging.config.dictConfig` form."""
    if not isinstance(config, dict):
        raise LoggingConfigError(f"{where} must hold a mapping (logging.config.dictConfig's form), got {type(config).__name__}")
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as e:
        raise LoggingConfigError(f"{where} does not configure logging: {e}") from None


def _where_wrong(e: yaml.YAMLError) -> str:
    """A YAML error on one line."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        return f"{e.problem} at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}"
    return " ".join(str(e).split())


def actor_env() -> dict[str, str]:
    """The environment a Ray actor needs to log as this process does (for its runtime_env's env_vars):
    the config file's content as JSON (the actor may run on a node without the file), or the root
    logger's level when it is not the default. Raises LoggingConfigError for a file that does not
    load, or that holds what JSON cannot carry."""
    if path := os.environ.get(CONFIG_ENV):
        config = read_config_file(path)
        try:
            return {CONFIG_JSON_ENV: json.dumps(config)}
        except (TypeError, ValueError) as e:
            raise LoggingConfigError(f"{_named(path)} cannot be passed to the Ray actors as JSON: {e}") from None
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return {LEVEL_ENV: level} if level != DEFAULT_LEVEL else {}
