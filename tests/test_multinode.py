"""A pipeline spread over two Ray nodes: each stage serves on its own node's address, and stays exact.

Two nodes on this machine with distinct loopback addresses (127.0.0.2, the head, and 127.0.0.3), each
with a custom resource that pins stages to it (node_a, node_b); the mock stages alternate between
them (tiny and the target on the head, mid on the other), placed with the spread strategy. Every
stage server binds and advertises its own node's address (the pipeline spans nodes), the coordinator
serves clients on the launcher's node at the config's host (127.0.0.1), and a request streamed
through the `Client` equals the target alone. The cluster is shut down at the end (its processes,
by their ids: never `ray stop`).
"""

from __future__ import annotations

import pytest

from pipespec import Client, LocalPipeline, load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HEAD, OTHER = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def two_nodes():
    from pipespec.cluster.pipeline import ray_env

    ray_env()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"node_ip_address": HEAD, "num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(node_ip_address=OTHER, num_cpus=1, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def stage(name, node, **options):
    """A mock stage pinned to `node` (a custom resource only that node has)."""
    spec = {"name": name, "kind": "mock", "vocab_size": 128, "max_lookahead": 8, "resources": {"num_cpus": 0.3, node: 0.3}}
    return spec | options


def test_stages_spread_over_two_nodes_serve_on_their_own_nodes_and_stay_exact(two_nodes):
    from pipespec.cluster.pipeline import start_pipeline

    config = load_config(
        {
            "name": "spread",
            "stages": [
                stage("tiny", "node_a", agreement=0.8),
                stage("mid", "node_b", agreement=0.9, latency_ms=1),
                stage("target", "node_a", latency_ms=3),
            ],
        }
    )
    running = start_pipeline(config, port=0, strategy="spread")
    try:
        where = {tuple(d["stages"]): (d["node"], d["addresses"]) for d in running.placement()}
        assert {stages: node for stages, (node, _) in where.items()} == {("tiny",): HEAD, ("mid",): OTHER, ("target",): HEAD}
        assert all(a.rpartition(":")[0] == node for node, addresses in where.values() for a in addresses)
        assert running.address.startswith("127.0.0.1:")  # the coordinator, on the launcher's node, at server.host
        request = dict(prompt_token_ids=[4, 5, 6], max_new_tokens=40, temperature=0.8, seed=2)
        deltas = list(Client(running.address).stream(**request))
        with LocalPipeline(load_config({"stages": [{"name": "t", "kind": "mock", "vocab_size": 128}]})) as alone:
            assert [t for d in deltas for t in d.token_ids] == alone.generate(**request).token_ids
        assert deltas[-1].finish_reason == "length" and [p.verifier for p in deltas[-1].stats.pairs] == ["mid", "target"]
    finally:
        running.stop()
