"""Start a pipeline on a Ray cluster: a placement group, one actor per device, the coordinator, wired.

One bundle per device (the stages of one `device_group`, or a stage alone) from its `resources`
(`num_cpus`, `num_gpus`, or custom resources), packed on one node or spread across nodes; a bundle
of whole CPUs gets its own cores (pipespec.cluster.cores) unless `pin_cores` is off. The coordinator
is small and sits outside the group. Every actor starts at once: the coordinator loads the tokenizer,
the target's device its models, and every other device imports what it builds with, then waits for the
target's vocabulary (it sizes a drafter's logits; an ngram drafter needs it) to build its own. Then
each device serves gRPC, each drafter whose verifier is on another device connects to it, the
coordinator connects to every stage, and only when every stream is attached is
the pipeline's address returned: `start_pipeline` checks what it can refuse before anything starts,
places the devices (the group, their nodes and cores), then starts and wires the actors. Every actor
restarts when its process dies (`faults.max_restarts`); `RunningPipeline.supervise()` puts a restarted
one back in place (pipespec.cluster.supervisor).

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import ray
from ray.exceptions import RayError as ClusterError  # noqa: F401  (what a failed actor raises, for callers outside cluster/)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pipespec.cluster.actors import WILDCARDS, CoordinatorActor, DeviceActor, HttpSpec, address
from pipespec.cluster.bundles import STRATEGIES, bundle, unplaceable
from pipespec.cluster.cores import CoreSlice, slices
from pipespec.cluster.supervisor import Supervisor
from pipespec.commands.logs import QUIET_ENV, actor_env
from pipespec.commands.ports import check_server_ports
from pipespec.config import PipelineConfig
from pipespec.errors import ConfigError
from pipespec.requests.frontdoor import TargetInfo
from pipespec.stages.build import check_vocabularies
from pipespec.transport.auth import new_secret
from pipespec.wiring.assembly import Entrance

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def ray_env() -> None:
    """Keep Ray on loopback, without auth tokens or usage stats (set before ray.init / ray start)."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


@contextmanager
def local_ray(num_cpus: float | None = None) -> Iterator[dict]:
    """A Ray session on this machine only (`pipespec demo`, benchmarks), shut down on exit; yields its resources.
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
    target_vocab_size: int  # what sizes every drafter's logits: a device restarted by Ray builds with it again
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
        holds_target = len(self.config.stages) - 1 in indices
        ray.get(self.devices[k].build.remote(None if holds_target else self.target_vocab_size), timeout=timeout)
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
            self.coordinator.serve.remote(stages, self.target, self.host, port, self.secret, self.http),
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
    `placement_timeout_s` for resources it has but not free; a failure once actors start removes them."""
    checked = _check(config, host, port, strategy, http)
    return _start(checked, _place(checked, placement_timeout_s, pin_cores))


@dataclass(frozen=True)
class _Checked:
    """A pipeline that can be started, as `_check` settled it."""

    config: PipelineConfig
    host: str  # what the coordinator binds
    port: int  # where it serves (0: any free port)
    strategy: str  # one of STRATEGIES
    http: HttpSpec | None  # the coordinator's HTTP server, its host resolved (None: none)
    tokenizer_size: int | None  # the shared tokenizer's (pipespec.stages.vocabulary), for every device
    bundles: list[dict[str, float]]  # one per device, in the order of config.devices()


@dataclass(frozen=True)
class _Placement:
    """Where `_place` put the devices: a ready placement group, one bundle per device."""

    group: object
    cores: list[CoreSlice | None]  # per device: the cores its threads are pinned to (None: not pinned)
    here: str  # the launcher's node: the coordinator's too
    stage_host: str | None  # what the stage servers bind (None: their node's address)


def _check(config: PipelineConfig, host: str | None, port: int | None, strategy: str, http: HttpSpec | None) -> _Checked:
    """What can be refused before anything starts, refused with a ConfigError: a strategy not known,
    the coordinator's or the HTTP server's port in use here (or the two on one address), a config whose
    stages cannot share a tokenizer (pipespec.wiring.assembly.Entrance, before any actor loads
    weights), devices whose resources this cluster can never hold. Starts nothing."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"placement strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    host = config.server.host if host is None else host
    port = config.server.port if port is None else port
    if http is not None:
        http = replace(http, host=host if http.host is None else http.host)
    # the coordinator runs on this node; `port` is the config's server.port unless the caller chose it
    check_server_ports(host, port, "server.port", None if http is None else http.host, None if http is None else http.port)
    tokenizer_size = Entrance.check(config).tokenizer_size
    bundles = [bundle(config.stages[d[0]].resources) or {"CPU": 0.01} for d in config.devices()]
    why = unplaceable(bundles, [n["Resources"] for n in ray.nodes() if n["Alive"]], strategy)
    if why is not None:
        raise ConfigError(f"pipeline {config.name!r}: its stages' resources {bundles} can never be placed ({strategy}): {why}")
    return _Checked(config, host, port, strategy, http, tokenizer_size, bundles)


def _place(checked: _Checked, timeout_s: float, pin_cores: bool) -> _Placement:
    """Reserve one bundle per device (a placement group) and wait for it; ConfigError, the group removed,
    when it is not placed within `timeout_s`. Then give each bundle of whole CPUs its own cores on its
    node (unless not `pin_cores`) and choose what the stage servers bind: `host` when the whole pipeline
    is on the launcher's node (or `host` binds every interface), else each its own node's address, the
    one its neighbours can reach."""
    config, bundles, strategy = checked.config, checked.bundles, checked.strategy
    group = placement_group(bundles, strategy=STRATEGIES[strategy], name=f"pipespec-{config.name}")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"pipeline {config.name!r}: its stages' resources {bundles} could not be placed ({strategy}) within "
            f"{timeout_s:.0f} s; the cluster has {ray.available_resources()} available"
        ) from None
    node_of = ray.util.placement_group_table(group)["bundles_to_node_id"]
    nodes = [node_of[k] for k in range(len(bundles))]
    cores = slices([b.get("CPU", 0.0) for b in bundles], nodes) if pin_cores else [None] * len(bundles)
    here = ray.get_runtime_context().get_node_id()
    stage_host = checked.host if all(n == here for n in nodes) or checked.host in WILDCARDS else None
    return _Placement(group, cores, here, stage_host)


def _start(checked: _Checked, placed: _Placement) -> RunningPipeline:
    """Start the pipeline in its placement, every actor at once: the coordinator on the launcher's node
    (it loads the tokenizer meanwhile), the target's device, and the others, which build their stages
    once the target's vocabulary is known (it sizes theirs); check that their vocabularies agree; serve
    every stage, link each drafter to its verifier on another device, serve the coordinator, linked to
    every stage; -> the pipeline once every stream is attached. On any failure every
    actor started and the placement group are removed."""
    config = checked.config
    specs, devices = config.stages, config.devices()
    secret = new_secret()
    # the actors log as this process does, and its libraries are as quiet (on any node: not inherited there)
    env = actor_env() | {name: os.environ[name] for name in QUIET_ENV if name in os.environ}
    runtime_env = {"env_vars": env} if env else None

    def device_actor(k: int) -> object:
        resources = dict(specs[devices[k][0]].resources)
        cpus, gpus = resources.pop("num_cpus", 0), resources.pop("num_gpus", 0)
        return DeviceActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placed.group, placement_group_bundle_index=k),
            num_cpus=cpus,
            num_gpus=gpus,
            resources=resources or None,
            max_concurrency=1000,
            max_restarts=config.faults.max_restarts,
            runtime_env=runtime_env,
        ).remote(config, devices[k], checked.tokenizer_size, max(1, int(cpus)), placed.cores[k])

    last = next(k for k, d in enumerate(devices) if len(specs) - 1 in d)  # the target's device
    actors: list = []
    coordinator = None
    try:
        coordinator = CoordinatorActor.options(
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(placed.here, soft=False),
            max_restarts=config.faults.max_restarts,
            runtime_env=runtime_env,
        ).remote(config)
        actors = [device_actor(k) for k in range(len(devices))]
        sizes = ray.get(actors[last].build.remote(None))
        vocab = sizes[len(specs) - 1]
        sizes |= {i: v for d in ray.get([a.build.remote(vocab) for a in actors if a is not actors[last]]) for i, v in d.items()}
        check_vocabularies(specs, [sizes[i] for i in range(len(specs))])
        stage_host = placed.stage_host
        served = {i: a for d in ray.get([a.serve.remote(stage_host, secret) for a in actors]) for i, a in d.items()}
        info = ray.get(actors[last].target_info.remote())
        host, http = checked.host, checked.http
        running = RunningPipeline(
            address(host, checked.port),
            actors,
            coordinator,
            placed.group,
            secret,
            config,
            host,
            stage_host,
            served,
            info,
            vocab,
            http,
        )
        running._link_downstream(list(range(len(specs) - 1)), None)
        running.serve_coordinator(timeout=60)
        ray.get([a.attached.remote() for a in actors], timeout=60)
    except BaseException:
        _tear_down([coordinator, *actors], placed.group)
        raise
    return running
