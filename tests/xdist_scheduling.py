"""How `make test` shares its two worker processes (`pytest -n 2 --dist loadfile`; pytest-xdist).

Each module runs whole on one worker, so its module fixtures (loaded models, a pipeline, a Ray session) are built
once; and, beyond loadfile, every module with a `ray` test runs on the same worker, one after another: two Ray
sessions starting at once on two cores slow both, and the Ray head that commands join (tests/conftest.py's
`ray_head`, one per worker) is then started once. (xdist's own `--dist loadgroup` does not group under
pytest 9: it renames `item._nodeid`, which pytest no longer reads.) tests/test_xdist_scheduling.py checks it in a real run.

Loaded by tests/conftest.py where xdist is installed; other `--dist` modes keep xdist's own scheduling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

# the test modules with a `ray` test (the marker's contract: the test starts a Ray session), by file name; the
# scheduler sees node ids only (workers collect, the controller does not), so it reads the files
RAY_MODULES = frozenset(p.name for p in Path(__file__).parent.glob("test_*.py") if "pytest.mark.ray" in p.read_text())


class RayModulesTogether(LoadFileScheduling):
    """loadfile, with every module of `RAY_MODULES` in one scope, "ray"."""

    def _split_scope(self, nodeid: str) -> str:
        module = super()._split_scope(nodeid)
        return "ray" if module.rpartition("/")[2] in RAY_MODULES else module


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where its plugin is off (`-p no:xdist`)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadFileScheduling | None:
    return RayModulesTogether(config, log) if config.getvalue("dist") == "loadfile" else None
