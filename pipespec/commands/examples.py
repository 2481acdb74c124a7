"""The example pipeline configs shipped inside the package (`pipespec/configs/*.yaml`), by name.

`pipespec serve mock3` serves the packaged mock3.yaml from an installed wheel, with no checkout at hand.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

CONFIGS = files("pipespec") / "configs"


def example_names() -> list[str]:
    return sorted(entry.name.removesuffix(".yaml") for entry in CONFIGS.iterdir() if entry.name.endswith(".yaml"))


def config_path(name_or_path: str) -> str:
    """A config file's path: the argument itself when it is a file or does not name a shipped example, else
    that example's path (so a file of the same name in the working directory wins)."""
    if Path(name_or_path).is_file() or name_or_path not in example_names():
        return name_or_path
    return str(CONFIGS / f"{name_or_path}.yaml")
