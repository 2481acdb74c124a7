"""A pipeline's bundles: what the cluster could never hold is said at once, naming the shortfall."""

from __future__ import annotations

import pytest

from pipespec.cluster.bundles import bundle, unplaceable

TWO_NODES = [{"CPU": 2.0, "memory": 1e9, "node_a": 1.0}, {"CPU": 2.0, "memory": 1e9, "node_b": 1.0}]


def test_resources_become_ray_names_without_zeros():
    assert bundle({"num_cpus": 0.5, "num_gpus": 0, "node_a": 1}) == {"CPU": 0.5, "node_a": 1.0}


@pytest.mark.parametrize(
    "bundles, strategy",
    [
        ([{"CPU": 0.5}, {"CPU": 0.5}], "pack"),
        ([{"CPU": 1.5, "node_a": 0.5}, {"CPU": 2.0, "node_b": 1.0}], "spread"),
        ([{"CPU": 0.1}] * 20, "strict-pack"),  # fractions that add up to 2 on one node
        ([{"CPU": 1.0}, {"CPU": 1.0}], "strict-spread"),
    ],
)
def test_what_fits_the_nodes_is_left_to_ray(bundles, strategy):
    assert unplaceable(bundles, TWO_NODES, strategy) is None


@pytest.mark.parametrize(
    "bundles, strategy, why",
    [
        ([{"CPU": 3.0}], "pack", "no node has the resources {'CPU': 3.0}"),
        ([{"CPU": 0.5, "node_c": 1.0}], "spread", "no node has the resources {'CPU': 0.5, 'node_c': 1.0}"),
        (
            [{"CPU": 2.0, "node_a": 1.0}, {"CPU": 1.0, "node_a": 0.5}],
            "pack",
            "they need {'node_a': 1.5} in all, the cluster has {'node_a': 1.0}",
        ),
        ([{"CPU": 1.5}, {"CPU": 1.5}, {"CPU": 1.5}], "spread", "they need {'CPU': 4.5} in all, the cluster has {'CPU': 4.0}"),
        ([{"CPU": 1.5}, {"CPU": 1.5}], "strict-pack", "strict-pack needs one node with {'CPU': 3.0}"),
        ([{"CPU": 0.1}] * 3, "strict-spread", "a node for each of the 3 bundles, the cluster has 2"),
    ],
)
def test_what_no_cluster_of_these_nodes_could_hold_is_named(bundles, strategy, why):
    assert why in unplaceable(bundles, TWO_NODES, strategy)
