"""The shape of the draft trees a drafter grows for its verifier (pipespec.engine.tree_drafting): a drafter's `tree`
section. Torch-free: the config reads it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TreeShape:
    """A drafter's `tree` section: how big a tree it grows for its verifier."""

    budget: int = field(
        default=7, metadata={"doc": "most nodes: with the root, the rows of the verifier's tree forward", "least": 1}
    )
    depth: int = field(default=7, metadata={"doc": "most levels (the synchronous engine's trees)", "least": 1})
    branching: int = field(default=4, metadata={"doc": "most children of a node (1 offers no siblings: a chain)", "least": 2})
    temperature: float = field(
        default=1.0,
        metadata={"doc": "divides the drafter's log-probabilities in a node's value: its calibration (`pipespec plan` fits it)"},
    )

    def __post_init__(self) -> None:
        for name in ("budget", "depth", "branching"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tree.{name} must be an integer >= 1, got {value!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"tree.temperature must be a number > 0, got {t!r}")
