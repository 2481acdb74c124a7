"""The wheel as a user installs it: one top-level package, its data, no clash with other projects' packages.

The wheel is built from the project's own files, listed (only `pipespec/` and its dist-info), and
installed without `-e` into a fresh virtual environment beside an installed distribution named `protos`
(a name this project used to install at the top level). The new environment borrows this one's
dependencies through a directory of links (nothing is downloaded), `pip check` must be clean, and
`pipespec serve` serves the packaged example config `mock3` by name, outside any checkout, and answers
one `Client` request exactly as the target alone does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[1]
NOT_DEPENDENCIES = ("pipespec", "__editable__", "_pipespec")  # this environment's editable install of the checkout


def run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done


def build_wheel(source: Path, out: Path, name: str) -> Path:
    """The wheel of distribution `name` from `source`, built offline with this environment's setuptools."""
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out, source)
    [wheel] = out.glob(f"{name}-*.whl")
    return wheel


def project_copy(tmp: Path) -> Path:
    """The files the wheel is built from, copied so the build leaves the checkout untouched."""
    source = tmp / "pipespec-src"
    shutil.copytree(ROOT / "pipespec", source / "pipespec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    return source


def other_protos_project(tmp: Path) -> Path:
    """Another project's distribution named `protos`, with a top-level `protos` package of its own."""
    source = tmp / "protos"
    (source / "protos").mkdir(parents=True)
    (source / "protos" / "__init__.py").write_text("OWNER = 'another project'\n")
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "protos"\nversion = "1.0"\n[tool.setuptools]\npackages = ["protos"]\n'
    )
    return source


def fresh_venv(tmp: Path) -> Path:
    """A new virtual environment that sees this one's installed packages (pip included, pipespec not) via links."""
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    deps = tmp / "deps"
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not entry.name.startswith(NOT_DEPENDENCIES) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    [site] = (venv / "lib").glob("python*/site-packages")
    (site / "borrowed-dependencies.pth").write_text(f"{deps}\n")
    return venv


def test_the_wheel_installs_pipespec_alone_and_serves_a_packaged_config(tmp_path):
    dist = tmp_path / "dist"
    wheel = build_wheel(project_copy(tmp_path), dist, "pipespec")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"pipespec", wheel.name.split("-py")[0] + ".dist-info"}, tops
    rooms = ("engine", "protocol", "requests", "planning", "wiring", "serving", "commands", "cli")
    for shipped in ("pipespec/protos/pipespec.proto", "pipespec/configs/mock3.yaml", "pipespec/stages/dream/model.py"):
        assert shipped in names
    assert {f"pipespec/{room}/__init__.py" for room in rooms} <= set(names)
    assert [n for n in names if "training" in n or n.endswith("/train.py")] == []  # DREAM's training stays out
    protos_wheel = build_wheel(other_protos_project(tmp_path), dist, "protos")

    venv = fresh_venv(tmp_path)
    python, outside = venv / "bin" / "python", tmp_path / "elsewhere"  # no checkout on the path
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run(python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", protos_wheel, wheel, cwd=outside, env=env)
    assert "No broken requirements" in run(python, "-m", "pip", "check", cwd=outside, env=env).stdout
    where = run(
        python, "-c", "import pipespec, protos, pipespec.protos; print(pipespec.__file__, protos.OWNER)", cwd=outside, env=env
    )
    assert where.stdout.startswith(str(venv)) and where.stdout.strip().endswith("another project"), where.stdout

    from pipespec.cluster.pipeline import RAY_ENV

    env = {**env, **RAY_ENV, "RAY_ADDRESS": ""}
    server = subprocess.Popen(
        [venv / "bin" / "pipespec", "serve", "mock3", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=outside, env=env,
    )  # fmt: skip
    try:
        address, seen = None, []
        for line in server.stdout:  # blocks until serve prints its address (or exits)
            seen.append(line)
            if "serving" in line:
                address = line.rsplit(" at ", 1)[1].strip()
                break
        assert address, "pipespec serve exited without serving:\n" + "".join(seen)
        answer = run(
            python, "-c", "import sys; from pipespec import Client\n"
            "g = Client(sys.argv[1]).generate(prompt_token_ids=[5, 6, 7], max_new_tokens=16)\n"
            "print(g.finish_reason, *g.token_ids)",
            address, cwd=outside, env=env,
        ).stdout.split()  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=120)
    assert server.returncode == 0

    import yaml

    from pipespec import LocalPipeline, load_config

    target = yaml.safe_load((ROOT / "pipespec" / "configs" / "mock3.yaml").read_text())["stages"][-1]
    with LocalPipeline(load_config({"name": "alone", "stages": [target]})) as alone:
        expected = alone.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=16).token_ids
    assert answer == ["length", *map(str, expected)]
