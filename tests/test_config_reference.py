"""The configuration reference is the config's own declarations rendered: docs/config-reference.md is what
`pipespec config --reference` prints, every key the parser accepts is in it, and a key without a doc stops it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest

from pipespec.cli import main
from pipespec.cli.config_reference import _table, reference
from pipespec.config import STAGE_KEYS
from pipespec.schema.kinds import KINDS

DOC = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"


def test_the_docs_page_is_the_generated_reference(capsys):
    assert main(["config", "--reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == reference()
    assert DOC.read_text() == printed, "docs/config-reference.md is stale: pipespec config --reference > docs/config-reference.md"


def test_every_key_the_parser_accepts_is_in_it():
    text = reference()
    options = {f.name for kind in KINDS.values() if kind.options for f in fields(kind.options)}
    missing = [key for key in (*STAGE_KEYS, *options) if f"| `{key}` |" not in text]
    assert missing == []


def test_a_key_without_a_doc_is_refused():
    @dataclass(frozen=True)
    class Section:
        said: int = field(default=1, metadata={"doc": "a key that says what it means"})
        silent: int = 2

    with pytest.raises(ValueError, match="config key 'silent' declares no doc"):
        _table("a section", fields(Section))


def test_config_asks_for_a_file_or_the_reference(capsys):
    assert main(["config"]) == 2
    assert "name a config file (or a shipped example), or ask for --reference" in capsys.readouterr().err
