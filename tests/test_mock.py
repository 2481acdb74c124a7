"""Mock stages (pipespec/stages/mock.py): they agree with their verifier, and rank its token second or third
where they do not, at the configured rates."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipespec import load_config
from pipespec.engine import noise
from pipespec.engine.stage import Feed, KVLengthError
from pipespec.errors import ConfigError
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.build import load_stages

N = 3000  # positions sampled per rate


def _pair(agreement: float, runner_up: float, third: float = 0.0):
    drafter = {"name": "d", "kind": "mock", "agreement": agreement, "runner_up": runner_up, "third": third, "vocab_size": 64}
    return load_stages(load_config({"stages": [drafter, {"name": "t", "kind": "mock", "vocab_size": 64}]}))


def _rows(stage) -> torch.Tensor:
    """[N, V] the stage's logits at N positions after varied token pairs."""
    return torch.stack([stage.row(i % 61, (7 * i) % 64, i) for i in range(N)])


def _plausible(count: int, n: int, p: float) -> bool:
    """count of n is a plausible Binomial(n, p) draw (5 standard deviations)."""
    return abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1


@pytest.mark.parametrize(
    "agreement, runner_up, third", [(0.8, 0.0, 0.0), (0.6, 0.5, 0.0), (0.7, 1.0, 0.0), (0.6, 0.5, 0.3), (0.7, 0.0, 1.0)]
)
def test_a_mock_agrees_and_ranks_its_verifiers_token_second_or_third_at_the_configured_rates(agreement, runner_up, third):
    drafter, target = _pair(agreement, runner_up, third)
    ours, theirs = _rows(drafter), _rows(target)
    truth = theirs.argmax(-1)
    agreed = (ours == theirs).all(-1)
    assert _plausible(int(agreed.sum()), N, agreement)
    assert (ours.argmax(-1) == truth)[agreed].all()
    ranked = ours.topk(3, -1).indices[~agreed]  # [disagreed, 3]
    disagreed, mine = len(ranked), 1 - runner_up - third
    # a random row ranks a given token first, second or third 1 time in 64 each; a token first by chance stays
    # first, and one second by chance stays second when it is to go third
    second = runner_up * 63 / 64 + (third + mine) / 64
    assert _plausible(int((ranked[:, 1] == truth[~agreed]).sum()), disagreed, second)
    assert _plausible(int((ranked[:, 2] == truth[~agreed]).sum()), disagreed, third * 62 / 64 + mine / 64)


@pytest.mark.parametrize("runner_up, third", [(1.0, 0.0), (0.0, 1.0)])
def test_the_ranking_rates_change_no_agreement_and_no_verifier_logit(runner_up, third):
    plain, plain_target = _pair(0.7, 0.0)
    betting, betting_target = _pair(0.7, runner_up, third)
    assert torch.equal(_rows(plain_target), _rows(betting_target))
    a, b = _rows(plain), _rows(betting)
    assert torch.equal((a == _rows(plain_target)).all(-1), (b == _rows(plain_target)).all(-1))
    assert torch.equal(a.argmax(-1), b.argmax(-1))  # only the second or third place moves


def test_ranking_shares_over_one_or_past_the_vocabulary_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"runner_up \+ third.*1\.2"):
        _pair(0.7, 0.6, 0.6)
    drafter = {"name": "d", "kind": "mock", "third": 0.2, "vocab_size": 2}
    with pytest.raises(ConfigError, match=r"stages\[0\]\.third: a vocabulary of 2 has no third place"):
        load_config({"stages": [drafter, {"name": "t", "kind": "mock", "vocab_size": 2}]})


def test_a_tree_forward_gives_each_side_the_row_of_its_own_line_and_keeps_only_the_main_line():
    """forward_tree (pipespec.engine.stage.TreeSession): a side's row equals the last row of a session fed its
    whole line; the cache afterwards is what forward(keep, tokens) leaves; a side past `keep` is refused."""
    drafter, _ = _pair(0.6, 0.5)
    prompt = (5, 9, 2, 7)

    def opened():
        return drafter.open(RequestSpec("r", prompt, SamplingParams(), max_new_tokens=8))

    session = opened()
    session.forward(3, [7, 11, 12, 13])  # context: 5 9 2 7 11 12 13
    sides = [(1, (40, 41)), (5, (42,)), (0, (43,)), (6, (44, 45, 46))]
    main, rows = session.forward_tree(6, [20, 21], sides)
    plain = opened()
    plain.forward(3, [7, 11, 12, 13])
    assert torch.equal(main, plain.forward(6, [20, 21]))
    assert session.context == plain.context
    for (base, side), row in zip(sides, rows):
        line = [5, 9, 2, 7, 11, 12, 13][:base] + list(side)
        assert torch.equal(row, opened().forward(0, line)[-1]), (base, side)
    with pytest.raises(KVLengthError):
        session.forward_tree(2, [9], [(3, (1,))])


def _reference_row(stage, prev2: int, prev1: int, index: int) -> torch.Tensor:
    """A mock's row as it was computed one at a time, its hash through torch (noise's tensor path)."""

    def own(level: int, context: int) -> np.ndarray:
        k1, k2 = noise.counter_key(stage.world_seed + level * 7919, index, context)
        h = noise.mix32(noise.mix32(torch.arange(stage.vocab_size) ^ k1) ^ k2).numpy()
        u = (h.astype(np.float64) + 0.5) * (1.0 / (1 << 32))
        return (-stage.chain[0].scale * np.log(-np.log(u))).astype(np.float32)

    def row(hop: int, context: int) -> np.ndarray:
        options, level = stage.chain[hop], len(stage.chain) - 1 - hop
        if level == 0:
            return own(level, context)
        if noise.scalar_uniform(stage.world_seed, index, context ^ (level << 24) ^ 0xA5) < options.agreement:
            return row(hop + 1, context)
        mine = own(level, context)
        if (
            options.runner_up
            and noise.scalar_uniform(stage.world_seed, index, context ^ (level << 24) ^ 0x5A) < options.runner_up
        ):
            theirs, top = int(row(hop + 1, context).argmax()), int(mine.argmax())
            if theirs != top:
                runner = np.partition(mine, -2)[-2]
                mine[theirs] = runner + 0.5 * (mine[top] - runner)
        return mine

    return torch.from_numpy(row(0, noise.mix32((prev2 + 1) * 0x10001 ^ noise.mix32(prev1 + 1))))


def test_rows_drawn_together_are_the_rows_drawn_one_at_a_time():
    """MockStage.rows (one pass for a forward's rows) gives each row bit for bit as the per-row recipe does."""
    stages = load_stages(load_config({"stages": [
        {"name": "a", "kind": "mock", "agreement": 0.5, "runner_up": 0.6, "vocab_size": 64},
        {"name": "b", "kind": "mock", "agreement": 0.7, "runner_up": 0.5, "vocab_size": 64},
        {"name": "t", "kind": "mock", "vocab_size": 64},
    ]}))  # fmt: skip
    keys = [(i % 61 - 1, (7 * i) % 64, i) for i in range(150)]
    for stage in stages:
        want = torch.stack([_reference_row(stage, *key) for key in keys])
        assert torch.equal(stage.rows(keys), want), stage.name


def test_the_forwards_of_one_batch_sleep_once_for_the_latency_and_every_token_fed(monkeypatch):
    """`forward_batch` (pipespec.engine.stage.BatchingStage): the mock's batched cost model. Each session's logits
    are those it gets alone; the batch sleeps once, what its latency and all the tokens fed cost."""
    import pipespec.stages.mock as mock

    config = {"stages": [{"name": "t", "kind": "mock", "vocab_size": 64, "latency_ms": 50.0, "per_token_ms": 10.0}]}
    (stage,) = load_stages(load_config(config))
    prompts = [(5, 9, 2), (3, 4, 8, 1), (7, 7)]
    alone = []
    for prompt in prompts:
        session = stage.open(RequestSpec("r", prompt, SamplingParams(), max_new_tokens=8))
        alone.append(session.forward(len(prompt) - 1, [prompt[-1], 11]))
    sessions = [stage.open(RequestSpec("r", p, SamplingParams(), max_new_tokens=8)) for p in prompts]
    slept = []
    monkeypatch.setattr(mock.time, "sleep", slept.append)
    batched = [rows for rows, _ in stage.forward_batch([Feed(s, len(p) - 1, [p[-1], 11]) for s, p in zip(sessions, prompts)])]
    [seconds] = slept  # once, for the whole batch
    assert 0.050 + 0.010 * 5 < seconds <= 0.050 + 0.010 * 6  # once: the latency and 3 x 2 tokens, less the arithmetic
    with pytest.raises(RuntimeError, match="one_forward inside one_forward"), stage.one_forward(), stage.one_forward():
        pass
    assert all(torch.equal(a, b) for a, b in zip(alone, batched))
    assert len(batched) == len(prompts)
