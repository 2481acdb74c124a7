"""Start a pipeline on a Ray cluster: a placement group, one actor per device, the coordinator, wired.

One bundle per device (the stages of one `device_group`, or a stage alone) from its `resources`
(`num_cpus`, `num_gpus`, or custom resources), packed on one node or spread across nodes; a bundle
of whole CPUs gets its own cores (pipespec.cluster.cores) unless `pin_cores` is off. The coordinator
is small and sits outside the group. The target's device is built first (an ngram drafter needs the
target's vocabulary), then each device serves gRPC, each drafter whose verifier is on another device
connects to it, the coordinator connects to every stage, and only when every stream is attached is
the pipeline's address returned. Every actor restarts when its process dies (`faults.max_restarts`);
`RunningPipeline.supervise()` puts a restarted one back in place (pipespec.cluster.supervisor).

Trust and addresses (design 5c): one secret per pipeline, made here and handed to every stage server,
every stream and the coordinator. The coordinator runs on the launcher's node and serves clients on
`host` (the config's server.host unless told otherwise: loopback by default). The stage servers bind
`host` too when every device is on the launcher's node; when the pipeline spans nodes (or lies on
another one), each device binds and advertises its own node's address (Ray's node IP), the only one
its neighbours and the coordinator can reach, unless `host` is a wildcard (0.0.0.0, ::), which every
stage binds and which advertises the node's address. On a single loopback node everything stays on
127.0.0.1.

HTTP (given an `HttpSpec`): the coordinator also serves OpenAI-compatible HTTP on the same event loop
and through the same `Serving` as its gRPC (pipespec.cluster.actors), on the HTTP host given, else on
the coordinator's `host` (loopback unless told otherwise); a restored coordinator serves it again on
the same port.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import ray
from ray.exceptions import RayError as ClusterError  # noqa: F401  (what a failed actor raises, for callers outside cluster/)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pipespec.pipeline.assembly import Entrance
from pipespec.cluster.actors import WILDCARDS, CoordinatorActor, DeviceActor, HttpSpec, address
from pipespec.cluster.bundles import STRATEGIES, bundle, unplaceable
from pipespec.cluster.cores import slices
from pipespec.cluster.supervisor import Supervisor
from pipespec.config import ConfigError, PipelineConfig
from pipespec.requests.frontdoor import TargetInfo
from pipespec.commands.logs import actor_env
from pipespec.stages import check_vocabularies
from pipespec.transport.auth import new_secret

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


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


@dataclass
class RunningPipeline:
    address: str  # what clients connect to
    devices: list  # DeviceActor handles, in the order of PipelineConfig.devices()
    coordinator: object
    group: object
    secret: str = field(repr=False)  # the pipeline's (pipespec.transport.auth): every stage call carries it
    config: PipelineConfig = field(repr=False)
    host: str  # what the coordinator binds
    stage_host: str | None  # what the stage servers bind (None: their node's address)
    addresses: dict[int, str]  # each stage's server (its drafter and the coordinator connect to it)
    target: TargetInfo = field(repr=False)
    http: HttpSpec | None = None  # the coordinator's HTTP server (None: none), its host resolved
    http_address: str | None = None  # its URL once serving (http://host:port)
    supervisor: Supervisor | None = None

    def placement(self) -> list[dict]:
        """Per device: its stages, the cores its threads are pinned to (None: not pinned), torch's threads,
        its pid, its node's address and each of its stages' addresses (what they advertise)."""
        return ray.get([d.describe.remote() for d in self.devices])

    def processes(self) -> dict[int, str]:
        """The process id of each device actor and of the coordinator -> what it runs."""
        named = {d["pid"]: "device " + "+".join(d["stages"]) for d in self.placement()}
        return named | {ray.get(self.coordinator.pid.remote()): "coordinator"}

    def pids(self) -> dict[str, int | None]:
        """Each actor's name (`name_of`) -> its process id; None for one that does not answer now (restarting)."""
        out: dict[str, int | None] = {}
        for actor in [self.coordinator, *self.devices]:
            try:
                out[self.name_of(actor)] = ray.get(actor.pid.remote(), timeout=5)
            except ray.exceptions.RayError:
                out[self.name_of(actor)] = None
        return out

    def name_of(self, actor: object) -> str:
        if actor is self.coordinator:
            return "the coordinator"
        indices = self.config.devices()[self.devices.index(actor)]
        return "device " + "+".join(self.config.stages[i].name for i in indices)

    def holds_target_or_coordinator(self, actor: object) -> bool:
        """Can the pipeline serve without `actor`? Not without the coordinator or the target's device."""
        return actor is self.coordinator or len(self.config.stages) - 1 in self.config.devices()[self.devices.index(actor)]

    def start_trace(self) -> None:
        ray.get([d.start_trace.remote() for d in self.devices])

    def stop_trace(self) -> list[dict]:
        """-> each stage's trace summary (pipespec.engine.trace), upstream to downstream."""
        by_stage = {i: s for summaries in ray.get([d.stop_trace.remote() for d in self.devices]) for i, s in summaries.items()}
        return [by_stage[i] for i in sorted(by_stage)]

    # ---- wiring, at start and after a restart (pipespec.cluster.supervisor) ------------------------

    def _device_of(self, i: int) -> object:
        return next(d for d, indices in zip(self.devices, self.config.devices()) if i in indices)

    def _link_downstream(self, stages: list[int], timeout: float | None) -> None:
        """Each of `stages` opens its stream to its verifier (those whose verifier is on another device)."""
        ray.get(
            [
                self._device_of(i).connect_downstream.remote(i, self.addresses[i + 1], self.secret)
                for i in stages
                if i + 1 < len(self.config.stages) and self._device_of(i) is not self._device_of(i + 1)
            ],
            timeout=timeout,
        )

    def device_lost(self, k: int) -> None:
        """Device k died: the coordinator stops waiting for its stages (their streams may not have noticed yet)."""
        ray.get(self.coordinator.stages_lost.remote(list(self.config.devices()[k])), timeout=self.config.faults.restore_s)

    def serve_device(self, k: int) -> None:
        """Device k was restarted: serve its stages again, link its neighbours on other devices to
        them and them to theirs, and give the coordinator their new streams (the requests rejoin)."""
        timeout = self.config.faults.restore_s
        indices = list(self.config.devices()[k])
        self.addresses.update(ray.get(self.devices[k].serve.remote(self.stage_host, self.secret), timeout=timeout))
        self._link_downstream(sorted({i - 1 for i in indices if i > 0} | set(indices)), timeout)
        ray.get(self.coordinator.relink.remote({i: self.addresses[i] for i in indices}), timeout=timeout)
        ray.get(self.devices[k].attached.remote(), timeout=timeout)

    def serve_coordinator(self, timeout: float | None = None) -> None:
        """Serve the coordinator on `host` at `address`'s port (0 at start: any free one), linked to every
        stage, and its HTTP server, if any, on the port it had (0 at start: any free one)."""
        port = int(self.address.rsplit(":", 1)[1])
        stages = [self.addresses[i] for i in range(len(self.config.stages))]
        self.address, self.http_address = ray.get(
            self.coordinator.serve.remote(self.config, stages, self.target, self.host, port, self.secret, self.http),
            timeout=timeout or self.config.faults.restore_s,
        )
        if self.http is not None:  # the port bound: a restored coordinator serves HTTP there again
            self.http = replace(self.http, port=int(self.http_address.rsplit(":", 1)[1]))

    def supervise(self, on_failure: Callable[[str], None] | None = None) -> Supervisor:
        """Start restoring actors that Ray restarts (pipespec.cluster.supervisor); `stop` stops it.
        `on_failure(why)`: an actor could not be restored."""
        self.supervisor = Supervisor(self, on_failure).start()
        return self.supervisor

    def stop(self) -> None:
        """Kill every actor and free the placement group; actors already dead are fine, so is stopping twice."""
        if self.supervisor is not None:
            self.supervisor.stop()
        _tear_down([self.coordinator, *self.devices], self.group)


def _tear_down(actors: list, group: object) -> None:
    for actor in actors:
        if actor is not None:
            ray.kill(actor)
    remove_placement_group(group)


def _check_port(host: str, port: int, what: str = "the coordinator", key: str = "server.port") -> None:
    """ConfigError at once if `what` could not bind host:port here (the coordinator runs on this node)."""
    if port == 0:
        return
    try:
        family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        socket.create_server(where, family=family).close()  # SO_REUSEADDR, as gRPC and uvicorn bind
    except OSError as e:
        raise ConfigError(f"{what} cannot serve on {host}:{port}: {e.strerror or e} ({key}; 0 picks a free port)") from None


def start_pipeline(
    config: PipelineConfig,
    host: str | None = None,
    port: int | None = None,
    strategy: str = "pack",
    placement_timeout_s: float = 60.0,
    pin_cores: bool = True,
    http: HttpSpec | None = None,
) -> RunningPipeline:
    """Place and start `config`'s pipeline; -> its handle once every stream is attached. `host`, `port`:
    where the coordinator serves (default: the config's server.host and .port); `http`: its HTTP server
    too (its host defaults to the coordinator's). ConfigError, before anything starts, for a strategy
    it does not know, a port in use and resources the cluster can never hold; after
    `placement_timeout_s` for resources it has but not free."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"placement strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    host = config.server.host if host is None else host
    port = config.server.port if port is None else port
    _check_port(host, port)
    if http is not None:
        http = replace(http, host=host if http.host is None else http.host)
        if http.port != 0 and (http.host, http.port) == (host, port):
            raise ConfigError(f"the HTTP server and the coordinator's gRPC cannot share {address(host, port)} (--http-port)")
        _check_port(http.host, http.port, "the HTTP server", "--http-port")
    valid = Entrance.check(config).tokenizer_size  # config-time checks, before any actor loads weights
    specs = config.stages
    devices = config.devices()
    bundles = [bundle(specs[d[0]].resources) or {"CPU": 0.01} for d in devices]
    why = unplaceable(bundles, [n["Resources"] for n in ray.nodes() if n["Alive"]], strategy)
    if why is not None:
        raise ConfigError(f"pipeline {config.name!r}: its stages' resources {bundles} can never be placed ({strategy}): {why}")
    group = placement_group(bundles, strategy=STRATEGIES[strategy], name=f"pipespec-{config.name}")
    try:
        ray.get(group.ready(), timeout=placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"pipeline {config.name!r}: its stages' resources {bundles} could not be placed ({strategy}) within "
            f"{placement_timeout_s:.0f} s; the cluster has {ray.available_resources()} available"
        ) from None
    node_of = ray.util.placement_group_table(group)["bundles_to_node_id"]
    nodes = [node_of[k] for k in range(len(bundles))]
    cores = slices([b.get("CPU", 0.0) for b in bundles], nodes)
    here = ray.get_runtime_context().get_node_id()  # the launcher's node: the coordinator's too
    # stages bind `host` when the whole pipeline is on this node (or `host` binds every interface);
    # else each binds and advertises its own node's address, the one its neighbours can reach
    stage_host = host if all(n == here for n in nodes) or host in WILDCARDS else None
    secret = new_secret()
    runtime_env = {"env_vars": env} if (env := actor_env()) else None  # the actors log as this process does

    def actor(k: int, target_vocab: int | None):
        resources = dict(specs[devices[k][0]].resources)
        threads = max(1, int(resources.get("num_cpus", 1)))
        options = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=k),
            "num_cpus": resources.pop("num_cpus", 0),
            "num_gpus": resources.pop("num_gpus", 0),
            "resources": resources or None,
            "max_concurrency": 1000,
            "max_restarts": config.faults.max_restarts,
            "runtime_env": runtime_env,
        }
        return DeviceActor.options(**options).remote(
            config, devices[k], target_vocab, valid, threads, cores[k] if pin_cores else None
        )

    last = next(k for k, d in enumerate(devices) if len(specs) - 1 in d)  # the target's device
    actors: list = [None] * len(devices)
    coordinator = None
    try:
        actors[last] = actor(last, None)
        vocab = ray.get(actors[last].vocab_sizes.remote())[len(specs) - 1]
        actors = [a if a is not None else actor(k, vocab) for k, a in enumerate(actors)]
        sizes = {i: v for d in ray.get([a.vocab_sizes.remote() for a in actors]) for i, v in d.items()}
        check_vocabularies(specs, [sizes[i] for i in range(len(specs))])
        served = {i: a for d in ray.get([a.serve.remote(stage_host, secret) for a in actors]) for i, a in d.items()}
        info = ray.get(actors[last].target_info.remote())
        on_this_node = NodeAffinitySchedulingStrategy(here, soft=False)
        coordinator = CoordinatorActor.options(
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=on_this_node,
            max_restarts=config.faults.max_restarts,
            runtime_env=runtime_env,
        ).remote()
        running = RunningPipeline(
            address(host, port), actors, coordinator, group, secret, config, host, stage_host, served, info, http
        )
        running._link_downstream(list(range(len(specs) - 1)), None)
        running.serve_coordinator(timeout=60)
        ray.get([a.attached.remote() for a in actors], timeout=60)
    except BaseException:
        _tear_down([coordinator, *actors], group)
        raise
    return running
