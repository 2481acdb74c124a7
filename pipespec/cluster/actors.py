"""The Ray actors: one per stage (its model, its StageRunner, its gRPC server) and the coordinator.

Every actor is async: its event loop runs the runner (or the coordinator) and its gRPC server; the
stage's forward passes run on the runner's compute thread. torch's thread count is set to the
actor's CPU share, since Ray otherwise leaves small actors with one OpenMP thread.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from pipespec.config import PipelineConfig
from pipespec.frontdoor import TargetInfo

log = logging.getLogger(__name__)


@ray.remote
class StageActor:
    def __init__(self, config: PipelineConfig, index: int, target_vocab_size: int | None, valid: int | None, torch_threads: int):
        """`target_vocab_size`: None for the target itself; `valid`: the shared tokenizer's size (pipespec.stages.vocabulary)."""
        import torch

        from pipespec.stages import build_stage

        torch.set_num_threads(torch_threads)
        self.config = config
        self.index = index
        spec = config.stages[index]
        self.stage = build_stage(spec, config.stages[index:], target_vocab_size, valid, config.sends_features(index))
        self.runner = None
        self.service = None
        self.clients: list = []

    def target_info(self) -> TargetInfo:
        return TargetInfo.of(self.config.stages[self.index], self.stage)

    def vocab_size(self) -> int:
        return self.stage.vocab_size

    async def serve(self, host: str) -> str:
        """Start the runner and its gRPC server; -> the address its drafter and the coordinator use."""
        from pipespec.runner import StageRunner
        from pipespec.transport.streams import serve_stage

        self.runner = StageRunner.for_config(self.stage, self.config, self.index)
        self.server, port, self.service = await serve_stage(self.runner, host, 0)
        self.task = asyncio.get_running_loop().create_task(self.runner.run())
        return f"{host}:{port}"

    async def connect_downstream(self, address: str) -> None:
        """Open the stream to our verifier: drafts go down it, verdicts come back."""
        from pipespec.assembly import link_to_verifier

        self.clients.append(await link_to_verifier(self.runner, address))

    async def attached(self) -> None:
        """Return once the coordinator (and our drafter, if any) have connected."""
        await self.service.attached()

    def open_requests(self) -> int:
        return len(self.runner.requests) if self.runner else 0


@ray.remote
class CoordinatorActor:
    async def serve(self, config: PipelineConfig, stage_addresses: list[str], target: TargetInfo, host: str, port: int) -> str:
        from pipespec.assembly import Entrance, link_coordinator
        from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator

        entrance = Entrance.check(config)
        self.coordinator = entrance.coordinator()
        self.clients = await link_coordinator(self.coordinator, stage_addresses)
        service = CoordinatorService(self.coordinator, entrance.front_door(target), config.name)
        self.server, bound = await serve_coordinator(service, host, port)
        return f"{host}:{bound}"

    def live_requests(self) -> int:
        return len(self.coordinator.live)
