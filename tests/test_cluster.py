"""The distributed runtime on a local Ray: stage actors, gRPC streams, the coordinator, a client.

One Ray session for the module. Mock stages (toy models, emulated latency), each in its own actor,
and the small random Llamas, two drafters sharing one actor, each stage with its own gRPC server
(real models on three devices: `pipespec demo` in tests/test_cli.py), a client streaming through the
coordinator: outputs equal the target alone; many streams at once stay exact and isolated; a
client that goes away is dropped on every stage within a second.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from pipespec import Client, ConfigError, GenerationError, LocalPipeline, load_config

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_session():
    from pipespec.cluster.pipeline import ray_env

    ray_env()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def mock_pipeline(ray_session):
    from pipespec.cluster.pipeline import start_pipeline

    running = start_pipeline(load_config("pipespec/configs/mock3.yaml"), port=0)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def mock_target_alone():
    config = load_config("pipespec/configs/mock3.yaml")
    with LocalPipeline(load_config({"stages": [{"name": "t", "kind": "mock", "vocab_size": 128, "latency_ms": 0}]})) as p:
        assert config.stages[-1].options.vocab_size == 128
        yield p


def request(i):
    return dict(prompt_token_ids=[i % 9 + 1, 2, i % 4 + 3], max_new_tokens=24 + i, temperature=0.0 if i % 2 else 0.8, seed=i)


def test_three_actors_stream_exactly_the_target_alone(mock_pipeline, mock_target_alone):
    client = Client(mock_pipeline.address)
    for i in range(4):
        deltas = list(client.stream(**request(i)))
        ids = [t for d in deltas for t in d.token_ids]
        assert ids == mock_target_alone.generate(**request(i)).token_ids
        last = deltas[-1]
        assert last.finish_reason == "length" and [p.verifier for p in last.stats.pairs] == ["mid", "target"]
        assert all(d.finish_reason is None for d in deltas[:-1]) and len(deltas) > 2  # true deltas, streamed


def test_eight_concurrent_streams_are_exact(mock_pipeline, mock_target_alone):
    client = Client(mock_pipeline.address)
    results: dict[int, list[int]] = {}

    def run(i):
        results[i] = client.generate(**request(i)).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(10))
    for i, ids in results.items():
        assert ids == mock_target_alone.generate(**request(i)).token_ids


def test_a_disconnected_client_is_dropped_everywhere_within_a_second(ray_session, mock_pipeline, mock_target_alone):
    ray = ray_session
    client = Client(mock_pipeline.address)
    long = dict(prompt_token_ids=[2, 3, 4], max_new_tokens=300, temperature=0.8, seed=9)
    running = client.stream(**long)  # keeps going while the other client disconnects
    first = next(running)
    stream = client.stream(prompt_token_ids=[5, 6, 7], max_new_tokens=400)
    next(stream)
    assert ray.get(mock_pipeline.coordinator.live_requests.remote()) == 2
    stream.close()  # the client goes away mid-answer
    gone = time.monotonic()
    dropped_after = None
    while time.monotonic() - gone < 1.0:  # a deadline, not a sleep: poll the actors' own counts
        counts = ray.get([a.open_requests.remote() for a in mock_pipeline.devices])
        if ray.get(mock_pipeline.coordinator.live_requests.remote()) == 1 and counts == [1, 1, 1]:
            dropped_after = time.monotonic() - gone
            break
    assert dropped_after is not None, "the abandoned request was still open somewhere after a second"
    ids = list(first.token_ids) + [t for d in running for t in d.token_ids]
    assert ids == mock_target_alone.generate(**long).token_ids  # the other request was undisturbed
    assert ray.get([a.open_requests.remote() for a in mock_pipeline.devices]) == [0, 0, 0]


def test_bad_request_is_an_error_naming_the_value(mock_pipeline):
    with pytest.raises(GenerationError, match=re.escape("temperature must be >= 0, got -1.0")):
        list(Client(mock_pipeline.address).stream(prompt_token_ids=[1, 2], max_new_tokens=8, temperature=-1.0))


def test_real_models_in_actors_equal_target_alone_two_stages_sharing_a_device(ray_session, family):
    """tiny and mid on one device (one actor, one compute thread, linked in process), the target on another;
    token ids and text both equal the target alone. (Three devices: the mock pipeline of this module.)"""
    from pipespec.cluster.pipeline import start_pipeline

    def stage(name, group):
        spec = {"name": name, "kind": "causal_lm", "model": family[name], "dtype": "float32", "resources": {"num_cpus": 0.1}}
        return spec | {"device_group": group}

    # the mock pipeline holds 1.5 of the 2 CPUs: these bundles fit beside it
    config = load_config({"name": "toy", "stages": [stage("tiny", "drafters"), stage("mid", "drafters"), stage("target", "t")]})
    running = start_pipeline(config, port=0)
    try:
        assert [d["stages"] for d in running.placement()] == [["tiny", "mid"], ["target"]]
        assert all(d["cores"] is None for d in running.placement())  # a fractional CPU share is not pinned
        running.start_trace()
        with LocalPipeline(load_config({"stages": [stage("target", "t")]})) as ref:
            for prompt in ([1, 40, 50, 60], [1, 99, 7, 13, 200]):
                for temperature in (0.0, 0.9):
                    kw = dict(prompt_token_ids=prompt, max_new_tokens=24, temperature=temperature, seed=4)
                    assert Client(running.address).generate(**kw).token_ids == ref.generate(**kw).token_ids
            text = Client(running.address).generate("the red circle", max_new_tokens=8)
            assert text.text == ref.generate("the red circle", max_new_tokens=8).text
        traces = running.stop_trace()
        assert [t["stage"] for t in traces] == ["tiny", "mid", "target"]
        assert all(t["steps"] > 0 for t in traces)
    finally:
        running.stop()


def test_astream_is_the_async_twin(mock_pipeline, mock_target_alone):
    import asyncio

    async def collect():
        return [d async for d in Client(mock_pipeline.address).astream(**request(5))]

    deltas = asyncio.run(collect())
    assert [t for d in deltas for t in d.token_ids] == mock_target_alone.generate(**request(5)).token_ids
    assert deltas[-1].finish_reason == "length" and deltas[-1].stats.generated_tokens == len(
        mock_target_alone.generate(**request(5)).token_ids
    )


def test_on_one_loopback_node_everything_serves_on_loopback(mock_pipeline):
    addresses = [a for device in mock_pipeline.placement() for a in device["addresses"]]
    assert len(addresses) == 3 and all(a.startswith("127.0.0.1:") for a in [mock_pipeline.address, *addresses])


def test_a_port_in_use_is_a_config_error_at_once(ray_session):
    import socket

    from pipespec.cluster.pipeline import start_pipeline

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve on 127.0.0.1:{port}: Address already in use"):
            start_pipeline(load_config("pipespec/configs/mock3.yaml"), port=port)


def test_an_http_port_in_use_or_the_coordinators_is_a_config_error_at_once():
    import socket

    from pipespec.cluster.actors import HttpSpec
    from pipespec.cluster.pipeline import start_pipeline

    config = load_config("pipespec/configs/mock3.yaml")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"the HTTP server cannot serve on 127.0.0.1:{port}: Address already in use"):
            start_pipeline(config, port=0, http=HttpSpec(port))
    with pytest.raises(ConfigError, match=f"the HTTP server and the coordinator's gRPC cannot share 127.0.0.1:{port}"):
        start_pipeline(config, port=port, http=HttpSpec(port, "127.0.0.1"))


def test_a_target_that_fails_to_load_fails_the_start_naming_its_error_and_leaves_nothing(ray_session, family, tmp_path):
    """Every actor starts at once, the drafters waiting for the target's vocabulary: a target whose weights
    cannot be read (its config and tokenizer can: nothing refuses it before the actors start) fails the start
    with its own error, and the drafters' actors and the placement group go with it."""
    import shutil

    from ray.util import placement_group_table

    from pipespec.cluster.pipeline import start_pipeline

    broken = shutil.copytree(family["target"], tmp_path / "target")
    (broken / "model.safetensors").write_bytes(b"not weights")
    stage = lambda n, path: {"name": n, "kind": "causal_lm", "model": str(path), "resources": {"num_cpus": 0.1}}  # noqa: E731
    config = load_config({"name": "broken", "stages": [stage("tiny", family["tiny"]), stage("target", broken)]})
    with pytest.raises(ray_session.exceptions.RayError, match="safetensors|header"):
        start_pipeline(config, port=0)
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values() if g["name"] == "pipespec-broken")


def test_resources_no_node_has_are_refused_at_once(ray_session):
    from pipespec.cluster.pipeline import start_pipeline

    config = load_config({"name": "huge", "stages": [{"name": "t", "kind": "mock", "resources": {"num_cpus": 64}}]})
    with pytest.raises(ConfigError, match=r"can never be placed \(spread\): no node has the resources \{'CPU': 64.0\}"):
        start_pipeline(config, port=0, strategy="spread", placement_timeout_s=600)  # not waited for
