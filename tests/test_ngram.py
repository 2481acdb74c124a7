"""The n-gram (prompt lookup) drafter: what it proposes, and that it keeps the pipeline exact."""

from __future__ import annotations

import torch

from pipespec import LocalPipeline, load_config
from pipespec.config import NgramOptions, StageSpec
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.build_context import BuildContext
from pipespec.stages.ngram import NgramStage


def test_proposes_what_followed_the_longest_earlier_match():
    stage = NgramStage(StageSpec("ng", "ngram", options=NgramOptions(min_n=1, max_n=3)), BuildContext(width=20))
    assert stage.propose([5, 6, 7, 9, 5, 6, 7]) == 9  # the 3-gram (5, 6, 7) was followed by 9
    assert stage.propose([1, 2, 3, 4]) is None  # nothing repeats
    assert stage.propose([3, 8, 1, 3]) == 8  # falls back to the 1-gram (3,)


def test_rows_are_one_hot_or_uniform_and_follow_truncation():
    stage = NgramStage(StageSpec("ng", "ngram", options=NgramOptions()), BuildContext(width=10))
    session = stage.open(RequestSpec("r", (4, 5, 6, 4), SamplingParams(), 8))
    rows = session.forward(3, [4, 5])  # context 4 5 6 4 5: after "4 5" came 6
    assert rows.shape == (2, 10)
    assert int(torch.argmax(rows[1])) == 6 and torch.isinf(rows[1]).sum() == 9
    rows = session.forward(2, [9])  # roll back to "4 5", then 9: no earlier 9
    assert torch.equal(rows[0], torch.zeros(10))


def test_ngram_in_front_of_a_causal_lm_is_exact(family):
    def config(stages):
        return load_config({"stages": stages})

    target = {"name": "target", "kind": "causal_lm", "model": family["target"], "dtype": "float32"}
    prompt = [1, 40, 50, 60, 70, 40, 50, 60, 70, 40, 50]  # repetitive: lookup has something to propose
    with (
        LocalPipeline(config([target])) as ref,
        LocalPipeline(config([{"name": "ng", "kind": "ngram", "max_lookahead": 6}, target])) as p,
    ):
        for temperature in (0.0, 0.8):
            want = ref.generate(prompt_token_ids=prompt, max_new_tokens=30, temperature=temperature, seed=3)
            got = p.generate(prompt_token_ids=prompt, max_new_tokens=30, temperature=temperature, seed=3)
            assert got.token_ids == want.token_ids
            assert got.stats.pairs[0].drafter == "ng"
