"""The structure of the source tree (design section 5), read from the code with `ast`:

- rooms by role: the top level of pipespec/ is the public face (the package's `__init__`, the CLI,
  config, errors, client, local); every other module sits in a room (a subpackage) whose `__init__`
  docstring names each module and subpackage it holds;
- layers: each room (or public module) has a place in `LAYERS`, lowest first, and imports only from
  its own place and those below it, never upward;
- no import circle, counting every import (in functions and under `if TYPE_CHECKING` too), in the
  runtime and in the packages beside it (training/, demo/, experiments/, dev/);
- ray is imported only in pipespec/cluster/; grpc only in the transport (pipespec/transport/ and the
  generated pipespec/protos/);
- torch never by the coordinator, at import time, through any chain of pipespec imports;
- nothing in the runtime (pipespec/) imports experiments/, dev/, demo/, training/ or tests/.

Each rule is also run on a small tree that breaks it, so a checker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_THE_RUNTIME = ("experiments", "dev", "demo", "training", "tests")
PUBLIC_FACE = ("__init__", "cli", "config", "errors", "client", "local")  # the modules at pipespec's top level

# Lowest first. A module belongs to the longest entry that prefixes its name and imports only from its
# own entry and the entries before it.
LAYERS = (
    "pipespec.errors",  # the runtime's errors
    "pipespec.commands",  # what every command line shares: logging, the shipped example configs
    "pipespec.protocol",  # the messages between stages, their codec and links; torch-free
    "pipespec.schema",  # what a config is made of: the table of stage kinds, where a stage's model is
    "pipespec.config",  # a pipeline config, validated
    "pipespec.engine",  # what runs inside a stage's process: runner, scheduler, choice, ...
    "pipespec.requests",  # a request's way in and out: arguments, chat, images, front door, outputs
    "pipespec.stages",  # the stage kinds themselves, and building them
    "pipespec.serving",  # the coordinator, served to clients (one Serving, the HTTP server)
    "pipespec.protos",  # the generated gRPC code
    "pipespec.transport",  # gRPC: stage streams, the coordinator service, health
    "pipespec.wiring",  # a config's parts built and connected
    "pipespec.local",  # the whole pipeline in one process
    "pipespec.planning",  # profiling and the plan
    "pipespec.cluster",  # Ray
    "pipespec.client",  # the remote Python client
    "pipespec.cli",  # the pipespec command
    "pipespec",  # the package's own __init__: the public names
)


def modules(root: Path, package: str = "pipespec") -> dict[str, Path]:
    """Dotted name -> file, for every module of `package` under `root`."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, module: str, top_level_only: bool = False) -> Iterator[str]:
    """Absolute names `path` imports (relative imports resolved against `module`); with `top_level_only`,
    only those executed when the module is imported (not inside functions or `if TYPE_CHECKING`)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = _top_level(tree.body) if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when a module is imported: everything but function bodies and
    `if TYPE_CHECKING:` blocks."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _top_level(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from _top_level(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from _top_level(handler.body)


def _root(name: str) -> str:
    return name.split(".")[0]


def violations(root: Path) -> list[str]:
    """Every import of `root`'s pipespec package that breaks a rule, as 'file: imports name (rule)'."""
    found = []
    for module, path in modules(root).items():
        where = path.relative_to(root).as_posix()
        for name in set(imports(path, module)):
            top = _root(name)
            if top == "ray" and not where.startswith("pipespec/cluster/"):
                found.append(f"{where}: imports {name} (ray only in pipespec/cluster/)")
            if top == "grpc" and not where.startswith(("pipespec/transport/", "pipespec/protos/")):
                found.append(f"{where}: imports {name} (grpc only in the transport)")
            if top in OUTSIDE_THE_RUNTIME:
                found.append(f"{where}: imports {name} (the runtime never imports {top}/)")
    return sorted(found)


def torch_chain(root: Path, start: str = "pipespec.serving.coordinator") -> list[str] | None:
    """The chain of import-time imports from `start` (or a package above it) to torch, or None."""
    known = modules(root)
    parents: dict[str, str | None] = {m: None for m in (*_packages(start), start)}  # importing it runs its packages too
    todo = list(parents)
    while todo:
        module = todo.pop()
        for name in imports(known[module], module, top_level_only=True):
            if _root(name) == "torch":
                chain = [name, module]
                while parents[chain[-1]] is not None:
                    chain.append(parents[chain[-1]])
                return chain[::-1]
            for target in (name, *_packages(name)):  # importing a.b.c runs a/__init__ and a/b/__init__ too
                if target in known and target not in parents:
                    parents[target] = module
                    todo.append(target)
    return None


def _packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def misplaced(root: Path) -> list[str]:
    """Modules at pipespec's top level outside the public face, and rooms whose `__init__` says nothing."""
    found = []
    for path in sorted((root / "pipespec").iterdir()):
        if path.suffix == ".py" and path.stem not in PUBLIC_FACE:
            found.append(f"pipespec/{path.name}: a top-level module outside the public face {PUBLIC_FACE}")
    for init in sorted((root / "pipespec").rglob("__init__.py")):
        said = ast.get_docstring(ast.parse(init.read_text())) or ""
        where = init.relative_to(root).as_posix()
        if not said:
            found.append(f"{where}: a room without a docstring saying what it holds")
            continue
        held = [p.stem for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__")]
        held += [p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
        for name in sorted(held):
            if not re.search(rf"\b{name}\b", said):
                found.append(f"{where}: its docstring does not say what `{name}` holds")
    return found


def layer(module: str) -> int | None:
    """The index in LAYERS of `module`'s entry: the longest entry that is it or a package above it (the
    root entry, `pipespec`, is its `__init__` alone)."""
    entries = [i for i, e in enumerate(LAYERS) if module == e or ("." in e and module.startswith(e + "."))]
    return max(entries, key=lambda i: len(LAYERS[i]), default=None)


def edges(root: Path, packages: tuple[str, ...] = ("pipespec",)) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (every import: in functions and TYPE_CHECKING too)."""
    known = {m: p for package in packages for m, p in modules(root, package).items()}
    return {m: {n for n in imports(path, m) if n in known and n != m} for m, path in known.items()}


def upward(root: Path) -> list[str]:
    """Every pipespec module in no layer, and every import of a module from a higher layer."""
    found = []
    for module, targets in sorted(edges(root).items()):
        if layer(module) is None:
            found.append(f"{module}: in no layer of LAYERS")
            continue
        for target in sorted(targets):
            if layer(target) is not None and layer(target) > layer(module):
                found.append(f"{module} imports {target} ({LAYERS[layer(target)]} is above {LAYERS[layer(module)]})")
    return found


def circles(root: Path, packages: tuple[str, ...] = ("pipespec",)) -> list[list[str]]:
    """The import circles among `packages`' modules: each strongly connected set of two or more modules
    (Tarjan's algorithm), sorted."""
    graph = edges(root, packages)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


PACKAGES = ("pipespec", "training", "demo", "experiments", "dev")


def test_the_top_level_is_the_public_face_and_every_room_says_what_it_holds():
    assert misplaced(ROOT) == []


def test_no_module_imports_upward():
    assert upward(ROOT) == []


def test_no_import_circle():
    assert circles(ROOT, PACKAGES) == []


def test_the_source_tree_keeps_its_layers():
    assert violations(ROOT) == []


def test_the_coordinator_never_imports_torch():
    assert torch_chain(ROOT) is None


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A pipespec tree that breaks every rule once."""
    files = {
        "pipespec/__init__.py": "",
        "pipespec/serving/__init__.py": "",
        "pipespec/serving/coordinator.py": "from pipespec.serving import ledger\n",
        "pipespec/serving/ledger.py": "from ..util import helper\n",
        "pipespec/util.py": "import torch.nn\n\ndef helper():\n    import ray\n",
        "pipespec/client.py": "def connect():\n    import grpc\n",
        "pipespec/planning/plan.py": "from demo.world import render\nfrom tests.fixtures import toy_models\n",
        "pipespec/cluster/__init__.py": '"""Ray."""\nimport ray\n',
        "pipespec/transport/__init__.py": "import grpc\n",
        "pipespec/planning/__init__.py": '"""Planning."""\n',
        "pipespec/engine/__init__.py": '"""The engine: `runner`, `step`."""\n',
        "pipespec/engine/runner.py": "from pipespec.engine.step import plan\n",
        "pipespec/engine/step.py": "def plan():\n    from pipespec.engine.runner import run\n",
        "pipespec/protocol/__init__.py": '"""The protocol: `codec`."""\n',
        "pipespec/protocol/codec.py": "from pipespec.config import LimitsSpec\n",
        "pipespec/config.py": "from pipespec.errors import ConfigError\n",
        "pipespec/errors.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_rules_catch_a_broken_tree(broken: Path):
    assert violations(broken) == [
        "pipespec/client.py: imports grpc (grpc only in the transport)",
        "pipespec/planning/plan.py: imports demo.world (the runtime never imports demo/)",
        "pipespec/planning/plan.py: imports demo.world.render (the runtime never imports demo/)",
        "pipespec/planning/plan.py: imports tests.fixtures (the runtime never imports tests/)",
        "pipespec/planning/plan.py: imports tests.fixtures.toy_models (the runtime never imports tests/)",
        "pipespec/util.py: imports ray (ray only in pipespec/cluster/)",
    ]
    assert torch_chain(broken) == ["pipespec.serving.coordinator", "pipespec.serving.ledger", "pipespec.util", "torch.nn"]


def test_the_structure_checks_catch_a_broken_tree(broken: Path):
    assert misplaced(broken) == [
        "pipespec/util.py: a top-level module outside the public face ('__init__', 'cli', 'config', 'errors', 'client', 'local')",
        "pipespec/__init__.py: a room without a docstring saying what it holds",
        "pipespec/planning/__init__.py: its docstring does not say what `plan` holds",
        "pipespec/serving/__init__.py: a room without a docstring saying what it holds",
        "pipespec/transport/__init__.py: a room without a docstring saying what it holds",
    ]
    assert upward(broken) == [
        "pipespec.protocol.codec imports pipespec.config (pipespec.config is above pipespec.protocol)",
        "pipespec.util: in no layer of LAYERS",
    ]
    assert circles(broken) == [["pipespec.engine.runner", "pipespec.engine.step"]]


def test_a_torch_import_inside_a_function_is_not_an_import_time_one(broken: Path):
    (broken / "pipespec/util.py").write_text("def helper():\n    import torch\n")
    assert torch_chain(broken) is None
