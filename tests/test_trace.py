"""Tests for pipespec/engine/trace.py: a stage's wall time split into compute, dispatch, handoff and idle.

The summary of hand-made steps adds up as the module docstring says; a traced pipeline of mock
stages with an emulated latency records every forward, its buckets add up to its wall time, and the
target of a pipeline whose drafter is much faster spends most of its time computing.
"""

from __future__ import annotations

import time

import pytest

from pipespec import LocalPipeline, load_config
from pipespec.engine.trace import Step, combine, decode_step_s, summarise, table


def test_summary_of_hand_made_steps():
    steps = [
        Step("prefill", 0, 0, planned=0.0, started=0.1, ended=1.1, handled=1.2, cpu_s=0.9),
        Step("verify", 4, 3, planned=2.0, started=2.1, ended=3.1, handled=3.3, cpu_s=1.0),
        Step("generate", 0, 0, planned=3.3, started=3.3, ended=4.3, handled=4.3, cpu_s=0.5),
    ]
    idle = {"waiting": 0.8, "starved": 0.0, "bounded": 0.0, "device": 0.0}
    s = summarise("t", steps, idle, pending_idle_s=0.3, loop_s=0.05, messages=7)
    assert combine([s, s])["busy"] == pytest.approx(s["busy"]) and combine([s, s])["steps"] == 6
    assert "| t | 3 | 1 | 4.0/3.0 | 70% (1000.0 ms)" in table([s])  # per decode step: the prefill apart
    assert s["steps"] == 3 and s["verify_steps"] == 1 and s["generate_steps"] == 1
    assert s["compute_s"] == pytest.approx(3.0)
    assert s["compute_on_cpu_s"] == pytest.approx(2.4)
    assert s["dispatch_s"] == pytest.approx(0.2)
    assert s["handoff_s"] == pytest.approx(0.3)
    assert s["wall_s"] == pytest.approx(4.3)  # 0 .. 4.3: every instant in exactly one bucket
    assert s["busy"] == pytest.approx(3.0 / 4.3)
    assert s["busy_with_drafts"] == pytest.approx(1.0 / (1.3 + 0.3))
    assert s["mean_drafts"] == 4 and s["mean_accepted"] == 3
    assert decode_step_s(s) == pytest.approx((2.0 + 0.2 + 0.3) / 2)  # two decode forwards, the host work of all three


def config(latencies):
    return load_config(
        {
            "stages": [
                {
                    "name": "drafter",
                    "kind": "mock",
                    "agreement": 0.9,
                    "latency_ms": latencies[0],
                    "vocab_size": 50,
                    "max_lookahead": 6,
                },
                {"name": "target", "kind": "mock", "latency_ms": latencies[1], "vocab_size": 50},
            ]
        }
    )


def test_a_traced_pipeline_accounts_for_its_time():
    with LocalPipeline(config([0.5, 8.0])) as p:
        p.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=8)  # warm
        t0 = time.perf_counter()
        p.start_trace()
        got = p.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=60)
        drafter, target = p.stop_trace()
        window = time.perf_counter() - t0
        assert not p.runners[0].trace.enabled
    assert target["steps"] == got.stats.stages[-1].forwards
    for s in (drafter, target):
        buckets = s["dispatch_s"] + s["compute_s"] + s["handoff_s"] + sum(v for k, v in s.items() if k.startswith("idle_"))
        assert s["wall_s"] <= window  # measured within the window this test measured around it
        assert buckets + s["other_s"] == pytest.approx(s["wall_s"])
        assert s["other_s"] < 0.2 * s["wall_s"]  # the buckets account for nearly all of it
        assert s["messages"] > 0 and s["loop_s"] > 0
    assert target["verify_steps"] > 0 and target["mean_accepted"] > 1
    assert target["busy"] > 0.5  # an 8 ms target behind a 0.5 ms drafter that agrees 90%: mostly computing
    assert drafter["idle_bounded_s"] > 0  # the drafter waits at its lookahead bound


def test_tracing_is_off_by_default_and_records_nothing():
    with LocalPipeline(config([0.0, 0.0])) as p:
        p.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=10)
        assert all(not r.trace.enabled and not r.trace.steps for r in p.runners)
