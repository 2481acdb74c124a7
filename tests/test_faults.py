"""Faults in one process (design 5c): a lost stage never hangs a request; a restored one rejoins.

The runners and the coordinator react to a lost link the same way whatever the link; here a stage
is killed and restored by hand (tests.fixtures.faults), so every case is deterministic and fast.
Over gRPC and Ray, with real processes killed, see tests/test_cluster_faults.py.
"""

from __future__ import annotations

import pytest

from pipespec import LocalPipeline
from pipespec.config import sub_pipeline
from pipespec.requests.outputs import GenerationError
from tests.fixtures.exactness import image_requests, run_all, vlm_chain
from tests.fixtures.faults import kill_stage, mock3, restore_stage

PROMPTS = [(3 + i, 5, 7 + 2 * i) for i in range(8)]
TOKENS = 48


@pytest.fixture(scope="module")
def reference():
    config = mock3()
    with LocalPipeline(sub_pipeline(config, ["target"])) as alone:
        return [alone.generate(prompt_token_ids=p, max_new_tokens=TOKENS).token_ids for p in PROMPTS]


def first_tokens_then(pipe, fault):
    """Start every request, wait for the first one's first tokens, run `fault`; -> each request's
    deltas (the first's) or its future (the others')."""
    head = pipe.stream(prompt_token_ids=PROMPTS[0], max_new_tokens=TOKENS)
    rest = [pipe.submit(prompt_token_ids=p, max_new_tokens=TOKENS) for p in PROMPTS[1:]]
    deltas = [next(d for d in head if d.token_ids)]
    fault()
    deltas += list(head)
    return deltas, rest


def exact(deltas, rest) -> list[list[int]]:
    assert deltas[-1].finish_reason == "length", deltas[-1]
    return [[t for d in deltas for t in d.token_ids]] + [f.result(timeout=60).token_ids for f in rest]


@pytest.mark.parametrize("lost, relay_above", [("tiny", None), ("mid", None), ("tiny", 2), ("mid", 2)])
def test_a_lost_drafter_costs_speed_not_correctness(reference, lost, relay_above):
    """relay_above: mid passes tiny's drafts on while more than 2 go on (8 do), until tiny or mid is lost."""
    config = mock3(relay_above=relay_above)
    i = [s.name for s in config.stages].index(lost)
    with LocalPipeline(config) as pipe:
        assert exact(*first_tokens_then(pipe, lambda: kill_stage(pipe, i))) == reference
        assert pipe.coordinator.trouble().startswith(f"stage {lost!r} was lost")
        after = pipe.generate(prompt_token_ids=PROMPTS[1], max_new_tokens=TOKENS)  # new requests still served
        assert after.token_ids == reference[1]
        assert not pipe.coordinator.live


@pytest.mark.parametrize("stage, relay_above", [("tiny", None), ("mid", None), ("target", None), ("mid", 2)])
def test_a_restored_stage_rejoins_running_requests_exactly(reference, stage, relay_above):
    config = mock3(relay_above=relay_above)
    i = [s.name for s in config.stages].index(stage)
    with LocalPipeline(config) as pipe:

        def fault():
            kill_stage(pipe, i)
            restore_stage(pipe, i)

        deltas, rest = first_tokens_then(pipe, fault)
        assert exact(deltas, rest) == reference
        assert pipe.coordinator.trouble() is None
        assert [s.stage for s in deltas[-1].stats.stages] == ["tiny", "mid", "target"]  # all closed the new incarnation
        assert pipe.generate(prompt_token_ids=PROMPTS[2], max_new_tokens=TOKENS).token_ids == reference[2]
        assert not pipe.coordinator.live and not pipe.coordinator.wires
        assert all(not r.requests for r in pipe.runners)


def test_a_lost_target_fails_its_requests_naming_it_and_refuses_new_ones():
    with LocalPipeline(mock3(restore_s=0.2)) as pipe:
        head = pipe.stream(prompt_token_ids=PROMPTS[0], max_new_tokens=TOKENS)
        rest = [pipe.submit(prompt_token_ids=p, max_new_tokens=TOKENS) for p in PROMPTS[1:]]
        assert next(d for d in head if d.token_ids)
        kill_stage(pipe, 2)
        why = "stage 'target' was lost and not restored within 0.2 s"
        with pytest.raises(GenerationError, match=why):  # the stream raises it after its first tokens
            list(head)
        for future in rest:
            with pytest.raises(GenerationError, match=why):
                future.result(timeout=60)
        with pytest.raises(GenerationError, match="stage 'target' was lost .* ago; the pipeline is restoring it"):
            pipe.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=TOKENS)
        assert not pipe.coordinator.live
        assert all(not r.requests for r in pipe.runners[:2])  # the drafters closed them


def test_a_stage_without_its_coordinator_closes_its_requests():
    with LocalPipeline(mock3()) as pipe:
        head = pipe.stream(prompt_token_ids=PROMPTS[0], max_new_tokens=TOKENS)
        next(d for d in head if d.token_ids)
        runner = pipe.runners[1]
        pipe._on_loop(lambda: (runner.lost(runner.coordinator), pipe.coordinator.lost(pipe.coordinator.stages[1])))
        pipe._on_loop(lambda: None)  # one loop turn: the loss is handled after what came before it
        assert pipe._on_loop(lambda: (len(runner.requests), runner.trouble())) == (0, "stage 'mid' lost its coordinator")
        head.close()


@pytest.mark.parametrize("stage", ["dream", "target"])
def test_image_requests_rejoin_a_restored_dream_or_target_exactly(llava_dream_zoo, stage):
    """A rejoining DREAM drafter takes the target's features again; a rejoining VLM target re-reads the image."""
    requests = image_requests()[:4]
    with LocalPipeline(vlm_chain(llava_dream_zoo, ["target"])) as alone:
        reference = [g.token_ids for g in run_all(alone, requests, new_tokens=24)]
    config = vlm_chain(llava_dream_zoo, ["tiny", "dream", "target"])
    i = [s.name for s in config.stages].index(stage)
    with LocalPipeline(config) as pipe:
        first = dict(requests[0])
        head = pipe.stream(first.pop("prompt"), max_new_tokens=24, **first)
        rest = [pipe.submit(r.pop("prompt"), max_new_tokens=24, **r) for r in map(dict, requests[1:])]
        deltas = [next(d for d in head if d.token_ids)]
        kill_stage(pipe, i)
        restore_stage(pipe, i)
        deltas += list(head)
        got = [[t for d in deltas for t in d.token_ids]] + [f.result(timeout=120).token_ids for f in rest]
    assert got == reference


def test_the_coordinator_drops_a_message_no_stage_sends():
    from pipespec.protocol.messages import Close, Verdict

    with LocalPipeline(mock3()) as pipe:
        for bogus in [Close("req-x"), Verdict("req-x", 0, 0, 1)]:
            pipe._on_loop(lambda bogus=bogus: pipe.coordinator.deliver(bogus))
        assert pipe.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=8).finish_reason == "length"
