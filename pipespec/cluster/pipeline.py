"""Start a pipeline on a Ray cluster: a placement group, the stage actors, the coordinator, wired.

One bundle per stage from its `resources` (`num_cpus`, `num_gpus`, or custom resources), packed on
one node or spread across nodes. The coordinator is small and sits outside the group. Stages are
built target first (an ngram drafter needs the target's vocabulary), then each serves gRPC, each
drafter connects to its verifier, the coordinator connects to every stage, and only when every
stream is attached is the pipeline's address returned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray.exceptions import RayError as ClusterError  # noqa: F401  (what a failed actor raises, for callers outside cluster/)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipespec.assembly import Entrance
from pipespec.cluster.actors import CoordinatorActor, StageActor
from pipespec.config import ConfigError, PipelineConfig
from pipespec.stages import check_vocabularies

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict-pack": "STRICT_PACK", "strict-spread": "STRICT_SPREAD"}


def ray_env() -> None:
    """Keep Ray on loopback, without auth tokens or usage stats (set before ray.init / ray start)."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


@contextmanager
def local_ray(num_cpus: float | None = None) -> Iterator[dict]:
    """A Ray session on this machine only, for benchmarks, shut down on exit; yields its resources.
    `num_cpus`: what Ray is told this machine has (default: its cores)."""
    ray_env()
    cpus = os.cpu_count() or 1
    ray.init(
        address="local", num_cpus=cpus if num_cpus is None else num_cpus, include_dashboard=False, logging_level=logging.WARNING
    )
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()


def _bundle(resources: dict) -> dict:
    renamed = {"num_cpus": "CPU", "num_gpus": "GPU"}
    return {renamed.get(k, k): float(v) for k, v in resources.items() if v}


@dataclass
class RunningPipeline:
    address: str  # what clients connect to
    stages: list  # StageActor handles, upstream to downstream
    coordinator: object
    group: object

    def stop(self) -> None:
        for actor in [self.coordinator, *self.stages]:
            ray.kill(actor)
        remove_placement_group(self.group)


def start_pipeline(
    config: PipelineConfig,
    host: str = "127.0.0.1",
    port: int | None = None,
    strategy: str = "pack",
    placement_timeout_s: float = 60.0,
) -> RunningPipeline:
    if strategy not in STRATEGIES:
        raise ConfigError(f"placement strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    valid = Entrance.check(config).tokenizer_size  # config-time checks, before any actor loads weights
    specs = config.stages
    bundles = [_bundle(s.resources) or {"CPU": 0.01} for s in specs]
    group = placement_group(bundles, strategy=STRATEGIES[strategy], name=f"pipespec-{config.name}")
    try:
        ray.get(group.ready(), timeout=placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"pipeline {config.name!r}: its stages' resources {bundles} could not be placed ({strategy}) within "
            f"{placement_timeout_s:.0f} s; the cluster has {ray.available_resources()} available"
        ) from None

    def actor(i: int, target_vocab: int | None):
        resources = dict(specs[i].resources)
        threads = max(1, int(resources.get("num_cpus", 1)))
        options = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            "num_cpus": resources.pop("num_cpus", 0),
            "num_gpus": resources.pop("num_gpus", 0),
            "resources": resources or None,
            "max_concurrency": 1000,
        }
        return StageActor.options(**options).remote(config, i, target_vocab, valid, threads)

    target = actor(len(specs) - 1, None)
    vocab = ray.get(target.vocab_size.remote())
    stages = [actor(i, vocab) for i in range(len(specs) - 1)] + [target]
    check_vocabularies(specs, ray.get([s.vocab_size.remote() for s in stages]))
    addresses = ray.get([s.serve.remote(host) for s in stages])
    ray.get([stages[i].connect_downstream.remote(addresses[i + 1]) for i in range(len(stages) - 1)])
    coordinator = CoordinatorActor.options(num_cpus=0, max_concurrency=1000).remote()
    info = ray.get(target.target_info.remote())
    address = ray.get(coordinator.serve.remote(config, addresses, info, host, config.server.port if port is None else port))
    ray.get([s.attached.remote() for s in stages], timeout=60)
    return RunningPipeline(address, stages, coordinator, group)
