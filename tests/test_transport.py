"""The pipeline over real gRPC streams (one server per stage on 127.0.0.1) stays exact.

Same stages and runners as in process; only the links differ: every draft, verdict, open, commit
and close crosses a gRPC stream as a msgpack frame.
"""

from __future__ import annotations

import asyncio

import pytest

from pipespec import LocalPipeline, load_config
from pipespec.transport.streams import StageClient, serve_stage


def mocks(agreements, target_ms=0.0, **sampling):
    stages = [
        {"name": f"m{i}", "kind": "mock", "agreement": a, "vocab_size": 64, "max_lookahead": 6} for i, a in enumerate(agreements)
    ]
    stages[-1]["latency_ms"] = target_ms  # a slower target gives drafts time to cross the wire
    return load_config({"stages": stages, "sampling": sampling})


@pytest.fixture(scope="module")
def target_alone():
    with LocalPipeline(mocks([1.0])) as p:
        yield p


@pytest.mark.parametrize("k", [2, 3])
def test_grpc_pipeline_equals_target_alone(k, target_alone):
    requests = [
        dict(prompt_token_ids=[i + 1, 2, 3], max_new_tokens=40, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(10)
    ]
    with LocalPipeline(mocks([0.7] * (k - 1) + [1.0]), over_grpc=True) as p:
        futures = [p.submit(**r) for r in requests]  # all at once: concurrent streams
        got = [f.result(timeout=60) for f in futures]
    for g, r in zip(got, requests):
        assert g.token_ids == target_alone.generate(**r).token_ids
    assert sum(pair.num_accepted_tokens for g in got for pair in g.stats.pairs) > 0


def test_rejection_mode_ships_q_over_grpc():
    with LocalPipeline(mocks([0.3, 1.0], target_ms=3.0, temperature=1.0, verify="rejection"), over_grpc=True) as p:
        outs = [p.generate(prompt_token_ids=[1, 2], max_new_tokens=30, seed=s) for s in range(5)]
    assert all(len(o.token_ids) == 30 and all(0 <= t < 64 for t in o.token_ids) for o in outs)
    assert sum(o.stats.pairs[0].num_draft_tokens for o in outs) > 0


def test_real_models_over_grpc_equal_target_alone(family):
    def config(names):
        return load_config({"stages": [{"name": n, "kind": "causal_lm", "model": family[n], "dtype": "float32"} for n in names]})

    with LocalPipeline(config(["target"])) as ref, LocalPipeline(config(["tiny", "mid", "target"]), over_grpc=True) as p:
        for prompt in ([1, 40, 50, 60], [1, 99, 7]):
            assert (
                p.generate(prompt_token_ids=prompt, max_new_tokens=24).token_ids
                == ref.generate(prompt_token_ids=prompt, max_new_tokens=24).token_ids
            )


def test_health_reports_open_requests():
    from pipespec.runner import StageRunner
    from pipespec.stages import load_stages

    async def check():
        runner = StageRunner(load_stages(mocks([1.0]))[0], name="m0", depth=0, max_lookahead=0)
        server, port, _ = await serve_stage(runner)
        client = StageClient(f"127.0.0.1:{port}")
        try:
            await client.wait_ready()
            reply = await client.health()
        finally:
            await client.close()
            await server.stop(grace=None)
        return reply

    reply = asyncio.run(check())
    assert (reply.name, reply.status, reply.requests) == ("m0", "serving", 0)
