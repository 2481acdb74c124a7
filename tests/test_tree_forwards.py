"""A draft tree's forward (pipespec.engine.stage.DraftTreeSession, pipespec.stages.packing.TreeRows): each node's logits
are bitwise those of a one-token decode of its path, whether the tree goes in whole (a verifier) or a level a
forward (a drafter), alone or beside other requests in a batch, eager or compiled, fp32 or bf16; a kept path's
cache is the chain's, so the decode goes on bitwise as if the path had been fed as a line."""

from __future__ import annotations

import pytest
import torch

from pipespec.config import StageSpec
from pipespec.engine.draft_tree import DraftTree
from pipespec.engine.stage import Feed, TreeNodes
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.schema.kinds import ModelOptions
from pipespec.stages.causal_lm import CausalLMStage
from tests.test_forwards import _llama

PROMPT = (5, 17, 33, 101, 7, 250, 9)
# node: 0 1 2 3 4 5 6; parents: two first-level nodes, a deep line under node 0, a fork under node 1
TREE = DraftTree((40, 41, 42, 43, 44, 45, 46), (-1, -1, 0, 1, 2, 1, 4))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return _llama(tmp_path_factory.mktemp("tree"), 256, 2)


def _stage(path: str, dtype: str = "float32", compiled: bool = False) -> CausalLMStage:
    spec = StageSpec("t", "causal_lm", path, dtype=dtype, options=ModelOptions(compile=compiled), max_batch=2)
    return CausalLMStage(spec)


def _open(stage: CausalLMStage, prompt=PROMPT):
    return stage.open(RequestSpec("r", prompt, SamplingParams(), max_new_tokens=32))


def _decoded(stage: CausalLMStage, tokens: list[int], prompt=PROMPT) -> list[torch.Tensor]:
    """The rows a one-token decode gives after the prompt's last token and each of `tokens`."""
    session = _open(stage, prompt)
    try:
        keep, rows = len(prompt) - 1, []
        for token in [prompt[-1], *tokens]:
            rows.append(session.forward(keep, [token])[0])
            keep += 1
        return rows
    finally:
        session.close()


def _path_rows(stage: CausalLMStage) -> dict[int, torch.Tensor]:
    """-1: the root's row; node: the row a one-token decode of its path gives after it."""
    out = {-1: _decoded(stage, [])[0]}
    for node in range(len(TREE)):
        out[node] = _decoded(stage, [TREE.tokens[n] for n in TREE.path(node)])[-1]
    return out


@pytest.mark.parametrize("dtype,compiled", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_a_whole_trees_rows_are_its_paths_decodes(model, dtype, compiled):
    stage = _stage(model, dtype, compiled)
    want = _path_rows(stage)
    session = _open(stage)
    try:
        rows = session.forward_nodes(len(PROMPT) - 1, [PROMPT[-1]], TreeNodes(TREE, tuple(range(len(TREE)))))
        assert session.cache.length == len(PROMPT)
    finally:
        session.close()
    assert torch.equal(rows[0], want[-1])
    assert [n for n in range(len(TREE)) if not torch.equal(rows[n + 1], want[n])] == []


def test_a_tree_fed_a_level_a_forward_gives_the_same_rows(model):
    """A drafter's growth: the line first, then each level's nodes over the ones fed before."""
    stage = _stage(model)
    want = _path_rows(stage)
    session = _open(stage)
    try:
        keep = len(PROMPT) - 1
        session.forward(keep, [PROMPT[-1]])
        got = {}
        for level in ((0, 1), (2, 3, 5), (4,), (6,)):
            got.update(zip(level, session.forward_nodes(keep + 1, [], TreeNodes(TREE, level))))
    finally:
        session.close()
    assert [n for n in range(len(TREE)) if not torch.equal(got[n], want[n])] == []


def test_a_tree_beside_another_request_in_a_batch_keeps_its_rows(model):
    stage = _stage(model)
    want = _path_rows(stage)
    other_prompt = (8, 9, 10, 11, 12)
    alone_other = _decoded(stage, [60, 61], other_prompt)
    session, other = _open(stage), _open(stage, other_prompt)
    try:
        other.forward(len(other_prompt) - 1, [other_prompt[-1], 60])
        feeds = [
            Feed(session, len(PROMPT) - 1, [PROMPT[-1]], nodes=TreeNodes(TREE, tuple(range(len(TREE))))),
            Feed(other, len(other_prompt) + 1, [61]),
        ]
        (rows, _), (other_rows, _) = stage.forward_batch(feeds)
    finally:
        session.close()
        other.close()
    assert [n for n in range(len(TREE)) if not torch.equal(rows[n + 1], want[n])] == []
    assert torch.equal(other_rows[0], alone_other[-1])


def test_a_kept_path_decodes_on_as_the_line_would(model):
    stage = _stage(model)
    path = TREE.path(6)  # 0 -> 2 -> 4 -> 6
    line = [TREE.tokens[n] for n in path]
    want = _decoded(stage, [*line, 70, 71])
    session = _open(stage)
    try:
        keep = len(PROMPT) - 1
        session.forward_nodes(keep, [PROMPT[-1]], TreeNodes(TREE, tuple(range(len(TREE)))))
        session.keep_path(keep + 1, path)
        assert session.cache.length == keep + 1 + len(path)
        rows = session.forward(keep + 1 + len(path), [70, 71])
    finally:
        session.close()
    assert torch.equal(rows[0], want[-2]) and torch.equal(rows[1], want[-1])


def test_a_tree_wider_than_the_widest_forward_is_refused(model):
    stage = _stage(model)
    wide = DraftTree.chain(range(40, 40 + stage.shapes.widths[-1]))
    session = _open(stage)
    try:
        with pytest.raises(ValueError, match="tree forward of .* rows exceeds its max_width"):
            session.forward_nodes(len(PROMPT) - 1, [PROMPT[-1]], TreeNodes(wide, tuple(range(len(wide)))))
    finally:
        session.close()
