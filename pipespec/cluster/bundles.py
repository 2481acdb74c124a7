"""A pipeline's placement group: one bundle of Ray resources per device, and the strategies that place them.

`bundle` turns a stage's `resources` (num_cpus, num_gpus, custom resources) into Ray's bundle keys.
`unplaceable` says at once why a set of bundles can never be placed on a cluster of given nodes (no
node has a bundle's resources, the cluster has too few in all, strict-pack needs one node to hold
them all, strict-spread one node per bundle), instead of waiting out the placement timeout; bundles
that fit the cluster but not what is free now still wait. It judges the nodes there are: a cluster
that grows (an autoscaler) is not foreseen. No Ray here, so the command line can name the strategies
without importing it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict-pack": "STRICT_PACK", "strict-spread": "STRICT_SPREAD"}
_RAY_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU"}
_SLACK = 1e-6  # Ray keeps resources to 1e-4; sums of fractions round


def bundle(resources: Mapping[str, float]) -> dict[str, float]:
    """A stage's resources as a bundle (Ray's names; zero amounts left out)."""
    return {_RAY_NAMES.get(k, k): float(v) for k, v in resources.items() if v}


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) + _SLACK >= v for k, v in need.items())


def _total(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def unplaceable(bundles: Sequence[Mapping[str, float]], nodes: Sequence[Mapping[str, float]], strategy: str) -> str | None:
    """Why `bundles` can never be placed with `strategy` on `nodes` (each node's total resources), or None."""
    for b in bundles:
        if not any(_fits(b, n) for n in nodes):
            return f"no node has the resources {dict(b)}"
    need = _total(bundles)
    if strategy == "strict-pack" and not any(_fits(need, n) for n in nodes):
        return f"strict-pack needs one node with {need} for them all"
    if strategy == "strict-spread" and len(nodes) < len(bundles):
        return f"strict-spread needs a node for each of the {len(bundles)} bundles, the cluster has {len(nodes)}"
    have = _total(nodes)
    if not _fits(need, have):
        short = {k: v for k, v in need.items() if have.get(k, 0.0) + _SLACK < v}
        return f"they need {short} in all, the cluster has { ({k: have.get(k, 0.0) for k in short}) }"
    return None
