"""Every fenced code block of README.md and docs/*.md runs as written on a fresh clone, from the repository root;
every relative link of theirs leads to a file (and a heading) that exists; the README stays a front page.

The pages are parsed into blocks (file, language, first line, text). `TABLE` classifies each block by its
language and first non-empty line, and says how it is checked; a block no entry classifies fails the
test (say how the new block is checked by adding an entry), and so does an entry that classifies no
block (stale) or a different number of blocks than it says.

- RUN_LOCAL: a python block run as a script (`python -c TEXT`, the block as written) in the repository
  root; it must exit 0 and print what its entry expects.
- SERVED: blocks that need a server. One `pipespec serve demo` for the module, from the repository
  root on a local Ray: the README's own line (`pipespec serve demo --http-port 8000`) with the ports it
  binds made free ones (`--http-port 0 --port 0`: the server picks them and prints them) and
  `--drain-seconds 0` added, so that it stops at once (the served bash block's test checks that the
  fixture's command is that line but for these). It starts with the module's first test, so that Ray
  and the models load while the tests that need no server run. In the blocks' text the ports are the
  only rewrite: 127.0.0.1:50051 becomes the gRPC port the server printed, 127.0.0.1:8000 and
  `--http-port 8000` its HTTP port. Python blocks run as RUN_LOCAL's do; in bash blocks each
  `pipespec generate` and `curl` line runs through bash as written and must exit 0 with an answer
  (generate's statistics naming the pairs, a curl stream ending in `data: [DONE]`, metrics holding
  spec_decode lines). `ray job submit` needs a Ray cluster head, which tests/test_job_submit.py starts
  and submits `python -m pipespec.cluster.launch` to: here its flags are checked against `ray job
  submit --help`, and the launch's argv is parsed by `pipespec.cluster.launch.main` with `serve` replaced.
- LOADED: a yaml config must pass `pipespec.load_config`. One that names hub ids not in the local cache
  (the Qwen example) is loaded against an empty cache and must fail only with the "not in the local
  cache" error for its first model, and each of its stages alone with that error for its own model
  (unknown keys and kinds are refused before a stage's model is looked up).
- FRAGMENT: python that needs context the README gives in prose (a pipeline `p`): compiled only.
- DIAGRAM: a Mermaid flowchart (the forge draws it): each line a node or an edge between two nodes.
- HELP: long-running commands (training, benchmarks, make targets, `bash SCRIPT` of the repository, whose
  `bash SCRIPT --help` must list its flags): each command line (backslash
  continuations joined, comment lines skipped) must name a command whose `--help` exits 0 and lists
  every `--flag` the line uses, in [brackets] and in a trailing comment too; `python -m MODULE WORD`'s
  WORD must be among the choices `python -m MODULE --help` lists. A trailing comment that is itself a
  command (`# python -m ...`) is checked as one. `make TARGET` must pass `make -n TARGET` and print the
  command its comment names.

Commands run with the virtualenv's bin directory first on PATH (`python` and `pipespec` are the
venv's, as with it activated), with Ray kept on loopback (`ray_env`).
"""

from __future__ import annotations

import enum
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # what a reader reads, the README first
README_BYTES = 12_000  # a front page: what pipespec is, the two commands, quick starts, results, the docs' index
BIN = Path(sys.executable).parent  # the virtualenv's: python, pipespec, ray
README_GRPC = "127.0.0.1:50051"
README_HTTP = "127.0.0.1:8000"
README_HTTP_FLAG = "--http-port 8000"


# ---- the README's blocks and their table ---------------------------------------------------------


@dataclass(frozen=True)
class Block:
    language: str
    line: int  # the line of its page its first line of code is on
    text: str
    page: str = "README.md"  # its path from the repository root

    @property
    def key(self) -> tuple[str, str]:
        first = next((line.strip() for line in self.text.splitlines() if line.strip()), "")
        return self.language, first

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.language})"


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def parse_blocks(markdown: str, page: str = "README.md") -> list[Block]:
    """The fenced code blocks of `markdown` (the page at `page`), in order."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, language = opening["fence"], (opening["info"].split() or [""])[0]
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and set(lines[i].strip()) == {fence[0]}):
            body.append(lines[i])
            i += 1
        blocks.append(Block(language, i - len(body) + 1, "\n".join(body) + "\n", page))
        i += 1  # past the closing fence
    return blocks


class Kind(enum.Enum):
    RUN_LOCAL = "run in process"
    SERVED = "run against the module's server"
    LOADED = "loaded as a config"
    FRAGMENT = "compiled only"
    DIAGRAM = "a Mermaid flowchart's lines checked"
    HELP = "commands and flags checked against --help"


@dataclass(frozen=True)
class Entry:
    kind: Kind
    why: str
    blocks: int = 1  # how many blocks share this key
    expect: tuple[str, ...] = ()  # what a run's output must hold
    hub_ids: bool = False  # LOADED: its models are hub ids, looked up in an empty cache


TABLE: dict[tuple[str, str], Entry] = {
    ("mermaid", "flowchart LR"): Entry(Kind.DIAGRAM, "the pipeline, drawn by the forge"),
    (
        "bash",
        "make demo   # the embedded default, placed by the planner on this machine's cores: an answer streams, then "
        "acceptance and speedup",
    ): Entry(Kind.HELP, "minutes: sets up a venv, then the demo (tests/test_cli.py runs `pipespec demo`)"),
    ("bash", "python -m demo.train tokenizer   # BPE on the world's text + chat tokens"): Entry(
        Kind.HELP, "an hour of training (tests/test_demo_train.py trains small)"
    ),
    ("python", "from pipespec import LocalPipeline, load_config"): Entry(
        Kind.RUN_LOCAL, "the demo's models in this process", expect=("'drafter': 'tiny'", "'verifier': 'target'")
    ),
    ("yaml", "name: demo-pair"): Entry(Kind.LOADED, "a whole config over models/demo"),
    ("yaml", "stages:"): Entry(Kind.LOADED, "demo_two_cores' stages and the DREAM chain, over models/demo", blocks=2),
    ("yaml", "stages:  # hub ids, read from the local Hugging Face cache (hf download them first)"): Entry(
        Kind.LOADED, "hub ids: gigabytes to download", hub_ids=True
    ),
    ("python", 'r = p.generate("What is in the picture?", image="cat.png")  # a path, bytes, a PIL image or a data URL'): Entry(
        Kind.FRAGMENT, "`p` is a pipeline over the Qwen models above; cat.png is the reader's"
    ),
    (
        "bash",
        "python -m training.train --target models/demo/target --samples demo.world:samples --out models/demo/dream \\",
    ): Entry(Kind.HELP, "hours of training (tests/test_dream_ablation.py and tests/test_dream.py train small)"),
    (
        "bash",
        "pipespec serve demo --http-port 8000   # a shipped config by name (or any YAML path); a local Ray; serves until Ctrl-C",
    ): Entry(Kind.SERVED, "serve is the module's server; generate runs against it; ray job submit: see the docstring"),
    ("python", "from pipespec import Client"): Entry(Kind.SERVED, "a gRPC client", expect=("'drafter': 'dream'",)),
    ("python", "import base64"): Entry(Kind.SERVED, "the official openai client over HTTP", expect=("completion_tokens",)),
    ("bash", "curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"): Entry(
        Kind.SERVED, "HTTP by hand"
    ),
    (
        "bash",
        "python -m experiments.bench pipespec/configs/demo_two_cores.yaml --prompts experiments/prompts/world_held_out.jsonl",
    ): Entry(Kind.HELP, "a benchmark of many minutes (tests/test_bench.py runs it small)"),
    (
        "bash",
        "python -m experiments.bench_http --demo [--concurrency 1 4 16] [--requests 24] [--runs 3]   # or --config A.yaml "
        "--alone-config B.yaml, or --url URL",
    ): Entry(Kind.HELP, "a benchmark of many minutes"),
    (
        "bash",
        "pipespec plan pipespec/configs/demo_two_cores.yaml --image models/demo/example.png [--devices N] [--prompt TEXT ...] "
        "[--trials N] [--json FILE] [--write-config FILE]",
    ): Entry(Kind.HELP, "a profile and trials of minutes (tests/test_plan.py, tests/test_trial.py)"),
    ("bash", "python -m experiments.scaling [--devices 4] [--time-scale 0.1] [--real | --no-real]"): Entry(
        Kind.HELP, "a sweep of many minutes (tests/test_scaling.py)"
    ),
    ("bash", "python -m experiments.pair_model [--runs 2]"): Entry(
        Kind.HELP, "a sweep of about 17 minutes (tests/test_pair_model.py runs one point)"
    ),
    (
        "bash",
        "python -m experiments.agreeing_family OUT [--shapes cpu | gpu | 68m 0.5b 7b] [--agreement 0.75 0.9] [--device cuda]",
    ): Entry(Kind.HELP, "a family of models and a device script of minutes (tests/test_agreeing_family.py builds a family)"),
    ("bash", "make bench    # python -m experiments.bench_engine --json experiments/results/bench_engine.json"): Entry(
        Kind.HELP, "a benchmark of minutes"
    ),
}


def classify(blocks: list[Block], table: dict[tuple[str, str], Entry]) -> tuple[list[tuple[Block, Entry]], list[str]]:
    """Each block with its entry, and the problems: blocks no entry classifies, entries that classify
    no block or another number of blocks than they say."""
    classified, problems = [], []
    for block in blocks:
        entry = table.get(block.key)
        if entry is None:
            problems.append(
                f"{block.where}: no entry of TABLE in tests/test_readme.py classifies this block, keyed {block.key!r}: "
                "add one saying how it is checked (RUN_LOCAL, SERVED, LOADED, FRAGMENT, DIAGRAM or HELP)"
            )
        else:
            classified.append((block, entry))
    for key, entry in table.items():
        found = sum(block.key == key for block in blocks)
        if found != entry.blocks:
            problems.append(f"TABLE entry {key!r} classifies {found} block(s), not {entry.blocks}: update or remove it")
    return classified, problems


BLOCKS = [block for page in PAGES for block in parse_blocks(page.read_text(), str(page.relative_to(ROOT)))]
CLASSIFIED, PROBLEMS = classify(BLOCKS, TABLE)


def of_kind(kind: Kind) -> list:
    return [pytest.param(block, entry, id=f"{block.page}:{block.line}") for block, entry in CLASSIFIED if entry.kind is kind]


# ---- running things ------------------------------------------------------------------------------


def env() -> dict[str, str]:
    """This environment with the venv's bin first on PATH, Ray kept on loopback and no cluster to join."""
    from pipespec.cluster.pipeline import RAY_ENV

    return {**os.environ, **RAY_ENV, "RAY_ADDRESS": "", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def run_python(block: Block, entry: Entry, text: str | None = None) -> None:
    """The block's code (or `text`, its rewrite) as a script from the repository root: exit 0, output expected."""
    out = run([sys.executable, "-c", block.text if text is None else text])
    assert out.returncode == 0, f"{block.where} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert out.stdout.strip(), f"{block.where} printed nothing"
    for expected in entry.expect:
        assert expected in out.stdout, f"{block.where}: {expected!r} not in its output:\n{out.stdout[-3000:]}"


def split_comment(line: str) -> tuple[str, str]:
    """`code  # comment` -> ("code", "comment"); a `#` inside quotes, or not after a space, is code."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1 :].strip()
    return line.strip(), ""


def command_lines(text: str) -> list[tuple[str, str]]:
    """The block's commands as (code, trailing comment): backslash continuations joined, comment lines
    (indented ones too) and blank lines skipped."""
    logical, pending = [], ""
    for line in text.splitlines():
        piece = line.strip() if pending else line
        if line.rstrip().endswith("\\"):
            pending += piece.rstrip()[:-1].rstrip() + " "
            continue
        logical.append(pending + piece)
        pending = ""
    return [split_comment(line) for line in logical if line.strip() and not line.strip().startswith("#")]


FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


@dataclass(frozen=True)
class HelpCheck:
    what: str  # the command line, as the README writes it
    argv: tuple[str, ...]  # its command up to its subcommand, then --help
    choices: tuple[str, ...]  # bare words it gives a positional, which the help must list among that one's choices
    flags: tuple[str, ...]  # the --flags it uses, which the help must list


def help_check(what: str, tokens: list[str], flags: list[str]) -> HelpCheck:
    """`pipespec plan CONFIG --json F` -> `pipespec plan --help`, listing --json; `python -m demo.train target
    --steps 3` -> `python -m demo.train --help`, listing --steps and `target` among its choices ({tokenizer,target,...})."""
    module = tokens[:2] == ["python", "-m"]
    if tokens[0] == "bash":  # a script of the repository: `bash SCRIPT --help`
        return HelpCheck(what, (*tokens[:2], "--help"), (), tuple(flags))
    head, rest = (tokens[:3], tokens[3:]) if module else (tokens[:1], tokens[1:])
    words = []
    for token in rest:
        if not re.fullmatch(r"[a-z][a-z_]*", token):
            break
        words.append(token)
    if not module:  # pipespec's subcommands have helps of their own
        head, words = [*head, *words], []
    return HelpCheck(what, (*head, "--help"), tuple(words), tuple(flags))


@cache
def help_of(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    return run(list(argv), timeout=180)


def help_problems(text: str) -> list[str]:
    """What is wrong with a HELP block's commands: a command that is not one, or a --flag (or a choice) its help lacks."""
    checks: list[HelpCheck] = []
    problems: list[str] = []
    for code, comment in command_lines(text):
        tokens = shlex.split(code)
        named = comment if comment.startswith("python -m ") else ""  # a command of its own: what the line runs
        if named:
            checks.append(help_check(named, shlex.split(named), FLAG.findall(named)))
        if tokens[0] == "make":
            dry = run(["make", "-n", *tokens[1:]], timeout=60)
            if dry.returncode != 0:
                problems.append(f"`{code}`: `make -n` failed: {dry.stderr.strip()}")
            elif named not in dry.stdout.replace(".venv/bin/", ""):
                problems.append(f"`{code}`: `make -n` does not run `{named}`, as its comment says")
            continue
        if tokens[0] not in ("python", "pipespec", "bash"):
            problems.append(f"`{code}`: a command tests/test_readme.py does not know how to check; teach it")
            continue
        checks.append(help_check(code, tokens, FLAG.findall(code) + ([] if named else FLAG.findall(comment))))
    with ThreadPoolExecutor(2) as pool:  # a help imports torch, seconds each: two at a time
        list(pool.map(help_of, {check.argv for check in checks}))
    for check in checks:
        shown, help_command = help_of(check.argv), shlex.join(check.argv)
        if shown.returncode != 0:
            problems.append(f"`{check.what}`: `{help_command}` exited {shown.returncode}: {shown.stderr.strip()[-500:]}")
            continue
        listed = set(FLAG.findall(shown.stdout))
        problems += [f"`{check.what}`: {flag} is not in `{help_command}`'s output" for flag in check.flags if flag not in listed]
        choices = {choice for group in re.findall(r"\{([^{}\s]+)\}", shown.stdout) for choice in group.split(",")}
        problems += [
            f"`{check.what}`: {word!r} is not among the choices `{help_command}` lists"
            for word in check.choices
            if word not in choices
        ]
    return problems


# ---- the blocks that need no server --------------------------------------------------------------


def test_every_block_is_classified_and_every_entry_classifies_one():
    assert BLOCKS, "README.md has no code blocks?"
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.mark.parametrize(("block", "entry"), of_kind(Kind.HELP))
def test_commands_exist_with_the_flags_they_use(block: Block, entry: Entry):
    problems = help_problems(block.text)
    assert not problems, f"{block.where}:\n" + "\n".join(problems)


@pytest.mark.parametrize(("block", "entry"), of_kind(Kind.FRAGMENT))
def test_fragments_compile(block: Block, entry: Entry):
    compile(block.text, block.where, "exec")


NODE = r"\w+(?:\[[^\]]*\]|\(\[[^\]]*\]\)|\([^)]*\))?"  # an id, with a [label], ([label]) or (label)
NODES = rf"{NODE}(?:\s*&\s*{NODE})*"  # one node, or several joined by &
# an arrow: `-->` or `-.->`, each with a |label| or none, or with its label inside: `-- label -->`, `-. label .->`
ARROW = r"(?:-->|-\.->)(?:\|[^|]*\|)?|--\s[^|]*?\s-->|-\.\s[^|]*?\s\.->"
MERMAID_LINE = re.compile(rf"^{NODES}(?:\s*(?:{ARROW})\s*{NODES})?$")


def diagram_problems(text: str) -> list[str]:
    """A Mermaid flowchart's lines that are neither a node nor an edge (`a -- label --> b`, `a -. label .-> b & c`)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("flowchart "):
        return ["not a flowchart"]
    return [f"{line!r} is neither a node nor an edge" for line in lines[1:] if not MERMAID_LINE.match(line)]


@pytest.mark.parametrize(("block", "entry"), of_kind(Kind.DIAGRAM))
def test_diagrams_are_flowcharts_of_nodes_and_edges(block: Block, entry: Entry):
    assert diagram_problems(block.text) == [], block.where


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as the forge makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(markdown: str) -> str:
    """`markdown` without its code: fenced blocks (``` or ~~~, indented up to 3 spaces) and inline spans."""
    without_blocks = re.sub(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", without_blocks)


def anchors(page: Path) -> set[str]:
    """The anchors of `page`'s headings (lines in code blocks are not headings)."""
    prose = _prose(page.read_text())
    return {slug(line.lstrip("#")) for line in prose.splitlines() if line.startswith("#")}


def link_problems(page: Path) -> list[str]:
    """`page`'s relative links whose file, or heading, does not exist (in code, blocks or spans, they are not links)."""
    prose = _prose(page.read_text())
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    return problems


def test_every_relative_link_leads_somewhere_and_the_readme_is_a_front_page():
    assert [problem for page in PAGES for problem in link_problems(page)] == []
    assert len(README.read_bytes()) <= README_BYTES, f"README.md is over {README_BYTES} bytes: move detail to docs/"
    indexed = set(LINK.findall(_prose(README.read_text())))
    assert [p for p in PAGES[1:] if str(p.relative_to(ROOT)) not in indexed] == [], "a docs page the README does not link"


def test_every_experiment_is_documented():
    """experiments/ holds what a user runs: each module and script is named in the README or a docs page."""
    said = "\n".join(page.read_text() for page in PAGES)
    named = [f"experiments.{p.stem}" for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__"]
    named += [f"experiments/{p.name}" for p in (ROOT / "experiments").glob("*.sh")]
    assert [n for n in sorted(named) if not re.search(rf"{re.escape(n)}\b", said)] == []


def test_the_link_and_diagram_checks_fail_what_they_should(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Its heading\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#its-heading) [b](gone.md) [c](other.md#nothing) [d](https://x.org) `[e](f)`?\n")
    assert link_problems(page) == ["page.md: gone.md: no such file", "page.md: other.md#nothing: no such heading"]
    good = "flowchart LR\n    a[A] -- x --> b & c\n    a --> b\n    b -.-> c\n    c -->|y| a\n    c -. z .-> d([D])\n"
    assert diagram_problems(good) == []
    assert diagram_problems("flowchart LR\n    a -> b\n    a -- x .-> b\n") == [
        "'a -> b' is neither a node nor an edge",
        "'a -- x .-> b' is neither a node nor an edge",
    ]


@pytest.mark.parametrize(("block", "entry"), of_kind(Kind.LOADED))
def test_configs_load(block: Block, entry: Entry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import huggingface_hub.constants

    from pipespec import load_config
    from pipespec.errors import ConfigError

    monkeypatch.chdir(ROOT)  # models/demo/... are relative to the root
    config = yaml.safe_load(block.text)
    assert "stages" in config, f"{block.where}: not a whole config"
    if not entry.hub_ids:
        load_config(config)
        return
    empty = tmp_path / "hub-cache"  # a developer's real cache cannot change the outcome
    empty.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(empty))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(empty))  # read once, when imported

    def refused(config: dict, model: str) -> None:
        with pytest.raises(ConfigError) as error:
            load_config(config)
        assert (
            f"stages[0].model: {model!r} is not a model directory, and as a Hugging Face hub id it is not in the local cache"
            in str(error.value)
        ), f"{block.where}: {error.value}"

    refused(config, config["stages"][0]["model"])
    for stage in config["stages"]:  # each stage's keys and kind are checked before its model is looked up
        refused({**config, "stages": [stage]}, stage["model"])


@pytest.mark.parametrize(("block", "entry"), of_kind(Kind.RUN_LOCAL))
def test_python_runs_in_process(block: Block, entry: Entry):
    run_python(block, entry)


# ---- the blocks that need a server ---------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen
    argv: list[str]
    lines: queue.Queue = field(default_factory=queue.Queue)  # its output, line by line; None once it ended
    seen: list[str] = field(default_factory=list)
    grpc_port: int = 0
    http_port: int = 0

    def wait_for(self, text: str, timeout: float = 300) -> str:
        """The first line of output holding `text`, skipping the lines before it."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"pipespec serve printed no {text!r} in {timeout} s:\n{''.join(self.seen)[-3000:]}")
            assert line is not None, f"pipespec serve ended without printing {text!r}:\n{''.join(self.seen)[-3000:]}"
            self.seen.append(line)
            if text in line:
                return line

    def rewrite(self, text: str) -> str:
        """`text` with the README's ports made this server's: the only rewrite."""
        http = f"127.0.0.1:{self.http_port}"
        return (
            text.replace(README_GRPC, f"127.0.0.1:{self.grpc_port}")
            .replace(README_HTTP, http)
            .replace(README_HTTP_FLAG, f"--http-port {self.http_port}")
        )


SERVE_LINE = "pipespec serve demo --http-port 8000"
ADDED = ["--port", "0", "--drain-seconds", "0"]  # any free gRPC port; stop at once


@pytest.fixture(scope="module", autouse=True)
def booting(request: pytest.FixtureRequest) -> Iterator[Server | None]:
    """`pipespec serve demo` as the README runs it, on free ports, joining the session's Ray head, started with the
    module's first test when a selected test needs it (the models load while the tests before it run); stopped at
    the end."""
    if not any("server" in item.fixturenames for item in request.session.items if item.module is request.module):
        yield None
        return
    argv = [*shlex.split(SERVE_LINE.replace(README_HTTP_FLAG, "--http-port 0")), *ADDED]
    joined = {**env(), "RAY_ADDRESS": request.getfixturevalue("ray_head").address}
    process = subprocess.Popen(argv, cwd=ROOT, env=joined, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    served = Server(process, argv)

    def read() -> None:
        for line in process.stdout:
            served.lines.put(line)
        served.lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        yield served
    finally:
        process.send_signal(signal.SIGTERM)  # it drains for --drain-seconds, 0 here
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(booting: Server | None) -> Server:
    """The module's server, once it serves: its ports read from what it prints."""
    assert booting is not None
    if not booting.grpc_port:
        booting.http_port = int(booting.wait_for("OpenAI-compatible HTTP at").rsplit(":", 1)[1])
        booting.grpc_port = int(booting.wait_for("pipespec: serving").rsplit(":", 1)[1])
    return booting


def check_ray_job_submit(code: str) -> None:
    """`ray job submit ... -- python -m pipespec.cluster.launch ARGS`: needs a cluster's head, which
    tests/test_job_submit.py starts; here ray's flags and the launch's argv."""
    job_test = (ROOT / "tests" / "test_job_submit.py").read_text()
    assert '"job", "submit"' in job_test and '"-m", "pipespec.cluster.launch"' in job_test
    ray_part, launched = code.split(" -- ", 1)
    ray_help = help_of(("ray", "job", "submit", "--help"))
    assert ray_help.returncode == 0, ray_help.stderr
    unknown = set(FLAG.findall(ray_part)) - set(FLAG.findall(ray_help.stdout))
    assert not unknown, f"`{ray_part}`: {sorted(unknown)} not in `ray job submit --help`'s output"
    tokens = shlex.split(launched)
    assert tokens[:3] == ["python", "-m", "pipespec.cluster.launch"], code
    import pipespec.cluster.launch as launch

    served: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "serve", lambda config, options: served.append((config, options)) or 0)
        patch.setattr(launch, "setup_logging", lambda level: None)
        assert launch.main(tokens[3:]) == 0
    [(config, options)] = served
    assert config == "demo" and options.http_port == 8000


def check_curl(code: str, out: subprocess.CompletedProcess) -> None:
    if "/v1/chat/completions" in code:
        events = [line for line in out.stdout.splitlines() if line.strip()]
        assert events[-1] == "data: [DONE]", out.stdout[-2000:]
        first = json.loads(events[0].removeprefix("data: "))
        assert first["id"].startswith("chatcmpl-") and first["object"] == "chat.completion.chunk", events[0]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        if "How many corners does a square have?" in code:  # the demo models answer a question with no picture
            assert re.search(r"\bfour\b", text), text
    elif "/metrics" in code:
        assert re.search(r"^pipespec:spec_decode_num_accepted_tokens_total\{.*\} [1-9]", out.stdout, re.M), out.stdout
    else:
        pytest.fail(f"a curl line tests/test_readme.py does not know how to check: `{code}`; teach it")


def run_served_commands(block: Block, server: Server) -> None:
    """Each line of a served bash block: serve is the fixture, the others run through bash as written
    (but the ports), ray job submit is checked as `check_ray_job_submit` says."""
    for code, _ in command_lines(block.text):
        if code.startswith("pipespec serve "):
            assert code == SERVE_LINE, f"{block.where}: the fixture runs `{SERVE_LINE}`, the README now `{code}`"
            assert server.argv == [*shlex.split(code.replace(README_HTTP_FLAG, "--http-port 0")), *ADDED]
        elif code.startswith("ray job submit "):
            check_ray_job_submit(code)
        elif code.startswith(("pipespec generate ", "curl ")):
            if code.startswith("curl ") and shutil.which("curl") is None:
                pytest.skip("curl is not on PATH")
            out = run(["bash", "-c", server.rewrite(code)], timeout=180)
            assert out.returncode == 0, f"{block.where}: `{code}` exited {out.returncode}:\n{out.stdout}\n{out.stderr[-3000:]}"
            assert out.stdout.strip(), f"{block.where}: `{code}` printed nothing"
            if code.startswith("curl "):
                check_curl(code, out)
            else:
                assert "mean acceptance length tiny->dream" in out.stderr, out.stderr
        else:
            pytest.fail(f"{block.where}: a line tests/test_readme.py does not know how to check: `{code}`; teach it")


@pytest.mark.parametrize(("block", "entry"), of_kind(Kind.SERVED))
def test_served_blocks_run_against_one_server(block: Block, entry: Entry, server: Server):
    if block.language == "python":
        run_python(block, entry, server.rewrite(block.text))
    elif block.language == "bash":
        run_served_commands(block, server)
    else:
        pytest.fail(f"{block.where}: a served {block.language} block; teach tests/test_readme.py to run it")


# ---- the checker itself, on a README of its own --------------------------------------------------

FAKE_README = """# A project

```bash
python -m experiments.bench_http --demo [--no-such-flag 3]   # or --url URL
```

```python
print("new")
```
"""


def test_the_checker_fails_an_unclassified_block_a_stale_entry_and_a_bad_flag():
    blocks = parse_blocks(FAKE_README)
    assert [(b.language, b.line) for b in blocks] == [("bash", 4), ("python", 8)]
    table = {
        blocks[0].key: Entry(Kind.HELP, "a benchmark"),
        ("bash", "make gone"): Entry(Kind.HELP, "a block the README lost"),
    }
    classified, problems = classify(blocks, table)
    assert [b.line for b, _ in classified] == [4]
    assert len(problems) == 2
    assert "README.md:8 (python): no entry of TABLE" in problems[0] and "('python', 'print(\"new\")')" in problems[0]
    assert "TABLE entry ('bash', 'make gone') classifies 0 block(s), not 1" in problems[1]
    assert help_problems(blocks[0].text) == [
        "`python -m experiments.bench_http --demo [--no-such-flag 3]`: --no-such-flag is not in "
        "`python -m experiments.bench_http --help`'s output"
    ]
    assert help_problems("python -m demo.train targt --steps 3\n") == [
        "`python -m demo.train targt --steps 3`: 'targt' is not among the choices `python -m demo.train --help` lists"
    ]
    assert help_problems("python -m experiments.bench_htp --demo\n")[0].startswith(
        "`python -m experiments.bench_htp --demo`: `python -m experiments.bench_htp --help` exited 1"
    )


def test_command_lines_join_continuations_and_skip_comments():
    text = "a --x \\\n    --y  # --z\n    # an indented comment --w\n# c\nb '#not' # d\n"
    assert command_lines(text) == [("a --x --y", "--z"), ("b '#not'", "d")]
