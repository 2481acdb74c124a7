"""A request's logits do not depend on what shares its forward (pipespec.stages.packed_forwards, packing).

On the model tests/test_forwards.py uses to show a block's effect (2 layers at hidden 1024, loaded
through `from_pretrained`), requests at different lengths feed 1 to 11 tokens (past `max_width`: two
pieces), alone and in random batches of random order, after rollbacks; every row of every request is
bitwise what it is alone, in fp32 and bf16, eager and compiled. A mutation that drops the row buckets
(a lone one-token step then runs a one-row product, which in fp32 rounds otherwise) is caught.
"""

from __future__ import annotations

import random

import pytest
import torch

from pipespec.config import StageSpec
from pipespec.engine.stage import Feed
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.schema.kinds import ModelOptions
from pipespec.stages.causal_lm import CausalLMStage
from pipespec.stages.packed_forwards import PackedForwards
from tests.test_forwards import _llama

REQUESTS = 6


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    return _llama(tmp_path_factory.mktemp("wide"), 1024, 2)


def _stage(path: str, dtype: str, compiled: bool, max_batch: int) -> CausalLMStage:
    spec = StageSpec("t", "causal_lm", path, dtype=dtype, options=ModelOptions(compile=compiled), max_batch=max_batch)
    return CausalLMStage(spec)


def _from(stage: CausalLMStage, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """`buckets` from the least rows a forward of `stage` has on this CPU (pipespec.stages.invariance)."""
    least = stage.forwards.rows
    return tuple(b for b in buckets if b >= least) or (least,)


def _work(seed: int) -> list[tuple[tuple[int, ...], int, list[int]]]:
    """Per request: its prompt, how many generated tokens it holds before the step, and the step's feed."""
    rng = random.Random(seed)
    out = []
    for _ in range(REQUESTS):
        prompt = tuple(rng.randrange(3, 500) for _ in range(rng.randrange(2, 40)))
        out.append((prompt, rng.randrange(0, 20), [rng.randrange(3, 500) for _ in range(rng.choice([1, 2, 3, 4, 5, 8, 11]))]))
    return out


def _rows(stage: CausalLMStage, work, batch: list[int]) -> dict[int, torch.Tensor]:
    """Open the requests of `batch`, bring each to its length (a rejected draft rolled back on the way), then run
    their steps as one batch -> each request's logits of the step."""
    sessions = {}
    for i in batch:
        prompt, held, _ = work[i]
        session = sessions[i] = stage.open(RequestSpec(str(i), prompt, SamplingParams(), max_new_tokens=64))
        keep = len(prompt) - 1
        fed = [prompt[-1]] + [(7 * j) % 500 + 3 for j in range(held)]
        session.forward(keep, [9] * 3)  # a rejected draft: its keys stay in the cache, masked
        session.forward(keep, fed)
    feeds = [Feed(sessions[i], len(work[i][0]) + work[i][1], work[i][2]) for i in batch]
    try:
        return {i: logits for i, (logits, _) in zip(batch, stage.forward_batch(feeds))}
    finally:
        for session in sessions.values():
            session.close()


def _batches(seed: int, n: int, most: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(range(REQUESTS), rng.randrange(2, most + 1)) for _ in range(n)]


def _differing(stage: CausalLMStage, work, batches: list[list[int]]) -> list[tuple[int, list[int]]]:
    """(request, batch) wherever a request's logits in a batch differ from its logits alone."""
    alone = {i: _rows(stage, work, [i])[i] for i in range(REQUESTS)}
    return [(i, batch) for batch in batches for i, rows in _rows(stage, work, batch).items() if not torch.equal(rows, alone[i])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_requests_logits_are_the_same_in_any_batch(wide, dtype):
    stage = _stage(wide, dtype, compiled=False, max_batch=REQUESTS)
    work = _work(1)
    assert _differing(stage, work, _batches(2, 8, REQUESTS)) == []


def test_compiled_forwards_keep_it(wide):
    stage = _stage(wide, "float32", compiled=True, max_batch=2)
    # each compiled when the stage starts (24 and up: also 3 x 2^k), from the least rows this CPU needs (invariance)
    assert stage.forwards.buckets == _from(stage, (4, 8, 16))
    assert _differing(stage, _work(3), _batches(4, 4, 2)) == []


def test_dropping_the_row_buckets_is_caught(wide, monkeypatch):
    """The mutation: every forward exactly as many rows as it carries (a lone one-token step: one row)."""
    stage = _stage(wide, "float32", compiled=False, max_batch=REQUESTS)
    work = [(prompt, held, feed[:1]) for prompt, held, feed in _work(5)]  # one-token steps: 1 row alone, more in a batch
    monkeypatch.setattr(PackedForwards, "bucket", lambda self, rows: rows)
    assert _differing(stage, work, _batches(6, 4, REQUESTS))


def test_a_batch_past_max_batch_still_runs(wide):
    """More requests than `max_batch` (a caller's choice, never the runner's): a bucket compiled when first met."""
    stage = _stage(wide, "float32", compiled=False, max_batch=1)
    assert stage.forwards.buckets == _from(stage, (4, 8)) and stage.forwards.bucket(20) == 32
    eight = _stage(wide, "float32", compiled=False, max_batch=8)
    assert eight.forwards.buckets == _from(eight, (4, 8, 16, 24, 32, 48, 64))
    assert _differing(stage, _work(7), [[0, 1, 2, 3, 4, 5]]) == []


def test_one_requests_error_in_a_batch_is_its_own(wide):
    """compute_batch (pipespec.engine.step): a request whose feed the stage refuses (a keep past what its cache
    holds) fails alone; the others of its batch get the tokens they get alone."""
    from pipespec.engine.step import StepPlan, compute_batch

    stage = _stage(wide, "float32", compiled=False, max_batch=3)
    specs = [RequestSpec(str(i), tuple(range(3, 13 + i)), SamplingParams(), max_new_tokens=16) for i in range(3)]
    sessions = [stage.open(spec) for spec in specs]
    plans = [
        StepPlan(spec.request_id, 0, 0, len(spec.prompt_token_ids) - 1, (spec.prompt_token_ids[-1],), 0, (), None)
        for spec in specs
    ]
    plans[1] = StepPlan("1", 0, 0, stage.max_context - 1, (5, 6), 0, (), None)  # keeps more than its cache holds
    outcomes = compute_batch(stage, list(zip(plans, sessions, specs)), 0, False, 0.0)
    assert "asked to keep 127 context tokens of a cache holding 10" in str(outcomes[1].error)
    for i in (0, 2):
        session = stage.open(specs[i])
        alone = session.forward(len(specs[i].prompt_token_ids) - 1, [specs[i].prompt_token_ids[-1]])
        decision = outcomes[i].result[0]
        assert outcomes[i].error is None and decision.tokens == (int(alone[-1].argmax()),)
