"""The layering rules of the source tree (design section 5), read from the code with `ast`:

- ray is imported only in pipespec/cluster/;
- grpc only in the transport (pipespec/transport/ and the generated pipespec/protos/);
- torch never by the coordinator, at import time, through any chain of pipespec imports;
- nothing in the runtime (pipespec/) imports experiments/, demo/ or tests/.

Each rule is also run on a small tree that breaks it, so a checker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_THE_RUNTIME = ("experiments", "demo", "tests")


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the `pipespec` package under `root`."""
    found = {}
    for path in sorted((root / "pipespec").rglob("*.py")):
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
        "pipespec/cluster/__init__.py": "import ray\n",
        "pipespec/transport/__init__.py": "import grpc\n",
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


def test_a_torch_import_inside_a_function_is_not_an_import_time_one(broken: Path):
    (broken / "pipespec/util.py").write_text("def helper():\n    import torch\n")
    assert torch_chain(broken) is None
