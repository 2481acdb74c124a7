"""The Ray actors: one per device (the stages placed on it, their runners and gRPC servers) and the coordinator.

A device actor holds every stage of one device (design 5b): its models, one StageRunner per stage,
and one DeviceScheduler, so the stages share one compute thread and run one forward at a time. Each
runner serves its own gRPC streams (its drafter's and the coordinator's); two neighbours on the same
device are linked in process instead. The actor's threads are pinned to its bundle's cores when it
is given them (pipespec.cluster.cores), and torch's thread count is set to the device's CPU share,
since Ray otherwise leaves small actors with one OpenMP thread.

Addresses: a device actor's servers bind the host the launcher gives it, or, given none, its own
node's address (`ray.util.get_node_ip_address()`), which is also what a wildcard host (0.0.0.0, ::)
advertises; the launcher decides which (pipespec.cluster.pipeline). Every stream carries the
pipeline's secret.

The coordinator's actor builds one `Serving` (pipespec.serving.serving) and serves it over gRPC
and, given an `HttpSpec`, over OpenAI-compatible HTTP too (pipespec.serving.http_server), both on
the actor's event loop: every way in shares one front door, one coordinator, one readiness. Told
to stop, it drains (pipespec.serving.drain): `stop_accepting`, then `drain`, which ends the requests
its grace does not see finished with an error and then stops its servers gracefully, so that every
client hears how its stream ended before the actor goes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ray

from pipespec.cluster.cores import CoreSlice, pin_process
from pipespec.commands.logs import setup_logging
from pipespec.config import PipelineConfig
from pipespec.requests.frontdoor import TargetInfo

log = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::")  # hosts that bind every interface: they advertise the node's address


def address(host: str, port: int) -> str:
    """host:port as gRPC takes it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _advertised(host: str) -> str:
    """What clients reach a server bound to `host` at: this node's address for a wildcard."""
    return ray.util.get_node_ip_address() if host in WILDCARDS else host


@dataclass(frozen=True)
class HttpSpec:
    """The coordinator's OpenAI-compatible HTTP server, beside its gRPC one."""

    port: int  # 0: any free port
    host: str | None = None  # None: the coordinator's (the config's server.host unless told otherwise)
    allowed_media: Path | None = None  # the directory `image_url` file paths may name (None: data URLs only)


@ray.remote
class DeviceActor:
    def __init__(
        self,
        config: PipelineConfig,
        indices: Sequence[int],
        valid: int | None,
        torch_threads: int,
        cores: CoreSlice | None,
    ):
        """`indices`: the stages on this device; `valid`: the shared tokenizer's size (pipespec.stages.vocabulary).
        Imports what builds them (seconds: torch, transformers), so that every device's process starts at
        once, before the target's vocabulary, which sizes the others, is known; `build` builds them."""
        setup_logging()  # as the launcher does (its runtime_env: pipespec.commands.logs.actor_env)
        import torch

        from pipespec.stages.build import prepare

        self.cores = pin_process(cores) if cores is not None else None
        torch.set_num_threads(torch_threads)
        self.config, self.valid = config, valid
        self.indices = tuple(sorted(indices))
        prepare(config.stages[i] for i in indices)
        self.stages: dict = {}
        self.runners: dict = {}
        self.services: dict = {}
        self.addresses: dict[int, str] = {}  # per stage, where it serves (once serving)

    def describe(self) -> dict:
        """What runs here: the stages, the cores pinned (None: not pinned), torch's threads, the process id."""
        import torch

        return {
            "stages": [self.config.stages[i].name for i in self.indices],
            "cores": self.cores,
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "addresses": [self.addresses[i] for i in self.indices] if self.addresses else None,
        }

    def pid(self) -> int:
        return os.getpid()

    def target_info(self) -> TargetInfo:
        i = len(self.config.stages) - 1
        return TargetInfo.of(self.config.stages[i], self.stages[i])

    def build(self, target_vocab_size: int | None) -> dict[int, int]:
        """Build this device's stages (again after a restart; once built, nothing); `target_vocab_size`: the
        target's, None when the target is one of them (it is built first). -> each stage's vocabulary size."""
        from pipespec.stages.build import build_stage

        config, target = self.config, len(self.config.stages) - 1
        for i in sorted(set(self.indices) - set(self.stages), key=lambda i: i != target):  # the others take its vocabulary
            self.stages[i] = build_stage(
                config.stages[i], config.stages[i:], target_vocab_size, self.valid, config.sends_features(i)
            )
            if i == target:
                target_vocab_size = self.stages[i].vocab_size
        return {i: stage.vocab_size for i, stage in self.stages.items()}

    async def serve(self, host: str | None, secret: str) -> dict[int, str]:
        """Start the runners, their gRPC servers (on `host`, None: this node's address; open to callers
        holding `secret`) and the device's scheduler; link neighbours placed here.
        -> per stage, the address its drafter and the coordinator use."""
        from pipespec.engine.runner import StageRunner
        from pipespec.engine.scheduler import DeviceScheduler
        from pipespec.protocol.links import InProcessLink
        from pipespec.wiring.assembly import serve_runner

        scheduler = DeviceScheduler("+".join(self.config.stages[i].name for i in self.indices))
        self.runners = {i: StageRunner.for_config(self.stages[i], self.config, i, scheduler) for i in self.indices}
        for i in self.indices:
            if i + 1 in self.runners:
                self.runners[i].connect(downstream=InProcessLink(self.runners[i + 1]))
                self.runners[i + 1].connect(upstream=InProcessLink(self.runners[i]))
        node = ray.util.get_node_ip_address()
        bind = node if host is None else host
        advertised = node if bind in WILDCARDS else bind
        self.addresses = {}
        for i, runner in self.runners.items():
            remote_drafter = i > 0 and i - 1 not in self.runners  # else linked in process, or none
            _, port, self.services[i] = await serve_runner(runner, self.config, secret, bind, remote_drafter)
            self.addresses[i] = address(advertised, port)
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(runner.run()) for runner in self.runners.values()]
        self.clients: dict = {}
        return self.addresses

    async def connect_downstream(self, index: int, address: str, secret: str) -> None:
        """Open stage `index`'s stream to its verifier on another device (again, when the verifier was
        restored): drafts go down it, verdicts come back."""
        from pipespec.wiring.assembly import link_to_verifier

        old = self.clients.pop(index, None)
        if old is not None:
            await old.close()
        self.clients[index] = await link_to_verifier(self.runners[index], address, self.config, secret)

    async def lifetime(self) -> None:
        """Never returns: the call fails when this actor dies (pipespec.cluster.supervisor watches it)."""
        await asyncio.Event().wait()

    async def attached(self) -> None:
        """Return once the coordinator (and each stage's drafter on another device) have connected."""
        for service in self.services.values():
            await service.attached()

    def open_requests(self) -> int:
        return sum(len(r.requests) for r in self.runners.values())

    def start_trace(self) -> None:
        for runner in self.runners.values():
            runner.trace.start()

    def stop_trace(self) -> dict[int, dict]:
        """-> per stage, its trace summary (pipespec.engine.trace)."""
        return {i: runner.trace.stop() for i, runner in self.runners.items()}


@ray.remote
class CoordinatorActor:
    def __init__(self, config: PipelineConfig) -> None:
        """Loads the tokenizer and processor: started first, it does so while the devices load their models.
        (What could refuse them, the launcher checked before anything started: `pipeline._check`.)"""
        setup_logging()  # as the launcher does (its runtime_env: pipespec.commands.logs.actor_env)
        from pipespec.wiring.assembly import Entrance

        self.config = config
        self.entrance = Entrance.check(config)

    async def serve(
        self, stage_addresses: list[str], target: TargetInfo, host: str, port: int, secret: str, http: HttpSpec | None = None
    ) -> tuple[str, str | None]:
        """Link the coordinator to every stage, then serve clients on host:port (placed on the launcher's
        node) and, given `http` (its host resolved), over HTTP. -> the address gRPC clients connect to,
        and the HTTP server's URL (None without one)."""
        from pipespec.serving.serving import Serving
        from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator
        from pipespec.wiring.assembly import link_coordinator

        config, entrance = self.config, self.entrance
        self.coordinator = entrance.coordinator()
        self.secret = secret
        self.clients = dict(enumerate(await link_coordinator(self.coordinator, stage_addresses, config, secret)))
        serving = Serving(self.coordinator, entrance.front_door(target))
        service = CoordinatorService(serving, config.name, secret=secret)
        self.server, bound = await serve_coordinator(service, host, port)
        self.http = None
        url = None
        if http is not None:
            from pipespec.serving.http_server import serve_http

            self.http = await serve_http(serving, http.host, http.port, http.allowed_media)
            url = "http://" + address(_advertised(http.host), self.http.port)
        return address(_advertised(host), bound), url

    async def lifetime(self) -> None:
        """Never returns: the call fails when this actor dies (pipespec.cluster.supervisor watches it)."""
        await asyncio.Event().wait()

    def stop_accepting(self) -> int:
        """Refuse new requests from now on, naming the drain (pipespec.serving.drain); -> how many are running."""
        from pipespec.serving.drain import begin_drain

        begin_drain(self.coordinator)
        return len(self.coordinator.live)

    async def drain(self, grace_s: float) -> int:
        """Let the running requests finish for up to `grace_s` seconds, end those left with an error, then
        stop the servers once their clients have heard how their streams ended. -> how many were ended so."""
        from pipespec.serving.drain import CLOSE_S, drain

        cut = await drain(self.coordinator, grace_s)
        if self.http is not None:
            await self.http.stop()  # stops accepting, lets the responses send their last events
        await self.server.stop(CLOSE_S)
        return cut

    async def wait_lost(self) -> list[int]:
        """-> the stages whose link is lost, once there is one."""
        await self.coordinator.any_lost.wait()
        return self.lost_stages()

    def lost_stages(self) -> list[int]:
        """The stages whose link is lost now."""
        return sorted(self.coordinator.lost_at)

    def stages_lost(self, indices: list[int]) -> None:
        """The supervisor saw these stages' actor die (their streams may not have noticed yet)."""
        for i in indices:
            link = self.coordinator.stages[i]
            if link is not None:
                self.coordinator.lost(link)

    async def relink(self, addresses: dict[int, str]) -> None:
        """These stages were restored at `addresses`: link to them; the running requests rejoin."""
        from pipespec.wiring.assembly import relink_coordinator

        for i in addresses:
            await self.clients.pop(i).close()
        self.clients |= await relink_coordinator(self.coordinator, addresses, self.config, self.secret)

    def pid(self) -> int:
        return os.getpid()

    def live_requests(self) -> int:
        return len(self.coordinator.live)
