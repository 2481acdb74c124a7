"""The STAND drafter: its memory of the target's distributions, its rows, what it learns from commits, and that
a pipeline and the synchronous engine with it stay exact and learn (pipespec.stages.stand, .ngram_memory)."""

from __future__ import annotations

import math

import pytest
import torch

from pipespec import LocalPipeline, load_config
from pipespec.config import StageSpec, StandOptions
from pipespec.engine.synchronous import generate_sync
from pipespec.errors import ConfigError
from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.messages import Commit, RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.tree_shape import TreeShape
from pipespec.stages.build_context import BuildContext
from pipespec.stages.ngram_memory import NgramMemory
from pipespec.stages.stand import StandStage


def test_memory_recalls_the_longest_taught_suffix_averaged():
    memory = NgramMemory(min_n=1, max_n=3, top_k=2, max_contexts=100)
    memory.teach([1, 2, 3], [(7, 0.6), (8, 0.3), (9, 0.1)])
    memory.teach([5, 2, 3], [(8, 0.9)])  # the 2-gram (2, 3) and 1-gram (3,) again, the 3-gram new
    tokens, probs = zip(*memory.recall([1, 2, 3]))  # the 3-gram: the top 2 of its one lesson
    assert tokens == (7, 8) and probs == pytest.approx((2 / 3, 1 / 3))
    recalled = dict(memory.recall([4, 2, 3]))  # the 2-gram: 7 (0.6 + 0) and 8 (0.3 + 0.9) averaged, top 2
    assert recalled.keys() == {7, 8} and math.isclose(recalled[8], 1.2 / 1.8) and math.isclose(sum(recalled.values()), 1.0)
    assert memory.recall([4, 4]) is None  # (4,) never taught
    memory.teach([6], [(1, 0.0), (2, 0.5)])  # a token the target gave no mass (its top-k or top-p cut it): not kept
    memory.teach([7], [(1, 0.0)])
    assert memory.recall([6]) == [(2, 1.0)] and memory.recall([7]) is None


def test_memory_forgets_the_least_recently_taught_past_its_bound():
    memory = NgramMemory(min_n=1, max_n=1, top_k=4, max_contexts=2)
    for token in (1, 2, 1, 3):  # (2,) is the least recently taught when (3,) comes
        memory.teach([token], [(0, 1.0)])
    assert len(memory) == 2 and memory.recall([2]) is None and memory.recall([1]) == [(0, 1.0)]


def _stage(**options) -> StandStage:
    return StandStage(StageSpec("stand", "stand", options=StandOptions(**options)), BuildContext(width=10))


def _commit(start: int, tokens: list[int], tops: list[list[tuple[int, float]]]) -> Commit:
    logprobs = tuple(
        TokenLogprobs(t, 0.0, tuple(i for i, _ in top), tuple(math.log(p) for _, p in top)) for t, top in zip(tokens, tops)
    )
    return Commit("r", start, tuple(tokens), logprobs)


def test_rows_are_the_targets_distribution_then_lookup_then_uniform():
    stage = _stage(max_n=2)
    spec = RequestSpec("r", (4, 5, 6), SamplingParams(), 8)
    stage.learn(spec, _commit(0, [7, 4], [[(7, 0.75), (2, 0.25)], [(4, 1.0)]]))  # after 5 6: 7 (or 2); after 6 7: 4
    rows = stage.open(spec).forward(2, [6, 7, 4])  # contexts ..5 6 | ..6 7 | ..7 4
    assert torch.allclose(rows[0].softmax(-1)[[7, 2]], torch.tensor([0.75, 0.25])) and torch.isinf(rows[0]).sum() == 8
    assert int(rows[1].argmax()) == 4 and torch.isinf(rows[1]).sum() == 9
    assert int(rows[2].argmax()) == 5 and torch.isinf(rows[2]).sum() == 9  # untaught (7, 4) and (4,): lookup's 4 -> 5
    assert torch.equal(stage.open(spec).forward(2, [9])[0], torch.zeros(10))  # nothing known, nothing to look up


def test_learns_commits_in_order_and_from_a_rejoin():
    stage = _stage()
    spec = RequestSpec("r", (4, 5), SamplingParams(), 8)
    stage.learn(spec, _commit(0, [6], [[(6, 1.0)]]))
    with pytest.raises(ValueError, match=r"stage 'stand': a commit of request 'r' at 3, after 1 committed tokens"):
        stage.learn(spec, _commit(3, [6], [[(6, 1.0)]]))
    stage.forget("r")
    rejoined = RequestSpec("r", (4, 5), SamplingParams(), 8, committed=(6, 6))
    stage.learn(rejoined, _commit(2, [1], [[(3, 1.0)]]))  # after 4 5 6 6 the target's likeliest was 3
    assert stage.memory.recall([6, 6]) == [(3, 1.0)]


def test_options_are_checked_and_it_can_only_be_first():
    with pytest.raises(ConfigError, match=r"stages\[0\]\.top_k: must be from 1 to 64 tokens, got 0"):
        load_config({"stages": [{"name": "s", "kind": "stand", "top_k": 0}, {"name": "t", "kind": "mock"}]})
    with pytest.raises(ConfigError, match=r"stages\[1\] \(s\): kind 'stand' has no model to verify with"):
        load_config({"stages": [{"name": "n", "kind": "ngram"}, {"name": "s", "kind": "stand"}, {"name": "t", "kind": "mock"}]})


PROMPT = [1, 40, 50, 60, 70, 40, 50]


@pytest.fixture(scope="module")
def target(family) -> dict:
    return {"name": "target", "kind": "causal_lm", "model": family["target"], "dtype": "float32"}


@pytest.mark.parametrize("tree", [None, TreeShape(budget=6, depth=6, branching=2)])
def test_sync_is_exact_and_a_second_answer_accepts_more(target, tree):
    from pipespec.stages.build import load_stages

    config = load_config({"stages": [{"name": "stand", "kind": "stand"}, target]})
    stand, model = load_stages(config)
    spec = RequestSpec("r", tuple(PROMPT), SamplingParams(), 24)
    alone = generate_sync(model, spec).token_ids
    first, second = (generate_sync(model, spec, stand, gamma=6, tree=tree) for _ in range(2))
    assert first.token_ids == second.token_ids == alone
    assert second.pair.mean_acceptance_length > first.pair.mean_acceptance_length + 1  # it learnt the answer


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8}, {"temperature": 0.8, "top_k": 2}])
def test_pipeline_is_exact_learns_and_trims_the_clients_logprobs(target, sampling):
    stages = [{"name": "stand", "kind": "stand", "max_lookahead": 6}, target]
    request = dict(prompt_token_ids=PROMPT, max_new_tokens=24, seed=3, **sampling)
    with LocalPipeline(load_config({"stages": [target]})) as ref, LocalPipeline(load_config({"stages": stages})) as p:
        want = ref.generate(**request)
        runs = [p.generate(**request, logprobs=1) for _ in range(2)]
        taught = p.stages[0].memory.recall(PROMPT)  # the target's top after the prompt (the same both times)
    assert [r.token_ids for r in runs] == [want.token_ids] * 2
    assert all(len(lp.top_ids) == 1 for r in runs for lp in r.logprobs)  # the client asked for 1
    assert len(taught) == (2 if "top_k" in sampling else 8)  # the learner got its 8 (those with mass)
    first, second = (r.stats.pairs[0] for r in runs)
    assert second.token_acceptance > first.token_acceptance


def test_a_learning_fault_costs_the_drafts_not_the_request(target, monkeypatch):
    def broken(self, request, commit):
        raise RuntimeError("the memory is broken")

    monkeypatch.setattr(StandStage, "learn", broken)
    stages = [{"name": "stand", "kind": "stand", "max_lookahead": 6}, target]
    with LocalPipeline(load_config({"stages": [target]})) as ref, LocalPipeline(load_config({"stages": stages})) as p:
        want = ref.generate(prompt_token_ids=PROMPT, max_new_tokens=16)
        got = p.generate(prompt_token_ids=PROMPT, max_new_tokens=16)
    assert got.finish_reason == "length" and got.token_ids == want.token_ids
