"""A drafter's tree of proposals: nodes after one root, each a token whose parent is the root or an earlier node.

The root is the last token of the line the tree extends: its logits propose the tree's first level. Node i
sits at the position after its parent's, `depths[i]` positions after the root (the root's children: depth 1),
so the nodes of one depth are alternatives for one position. A chain is the tree whose node i's parent is
node i - 1 (`DraftTree.chain`).

A verifier's tree forward gives one row of logits for the root and one for each node (row i + 1: node i's, the
distribution of the token after it), each bitwise the row a one-token decode of its path would give
(pipespec.stages.packing); pipespec.engine.tree_verification decides which path it takes. Under rejection
sampling each node carries the distribution it was drawn from (`probs`: its parent's q; siblings share it,
drawn from it without replacement, first child first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

ROOT = -1  # the parent of the first level's nodes


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # node i's token
    parents: tuple[int, ...]  # node i's parent: ROOT or an earlier node
    probs: torch.Tensor | None = None  # [n, V] float64: the q node i was drawn from (rejection sampling only)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree of {len(self.tokens)} tokens has {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"draft tree node {i}: its parent {parent} is not the root or an earlier node")
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise ValueError(f"a draft tree of {len(self.tokens)} nodes has {len(self.probs)} q rows")

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> DraftTree:
        """The tree of one line of drafts: node i's parent is node i - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's distance from the root (the root's children: 1)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent == ROOT else out[parent] + 1)
        return tuple(out)

    @cached_property
    def _children(self) -> dict[int, tuple[int, ...]]:
        kids: dict[int, list[int]] = {ROOT: []}
        for i, parent in enumerate(self.parents):
            kids.setdefault(parent, []).append(i)
        return {node: tuple(nodes) for node, nodes in kids.items()}

    def children(self, node: int) -> tuple[int, ...]:
        """`node`'s children (ROOT: the first level), in the order they were drafted."""
        return self._children.get(node, ())

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to `node` (ROOT: none)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return tuple(reversed(out))

    def depth(self, node: int) -> int:
        return 0 if node == ROOT else self.depths[node]

    @property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self)) if not self.children(i))
