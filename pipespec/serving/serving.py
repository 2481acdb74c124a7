"""`Serving`: what every way in to a running coordinator shares (design: one front door).

    admitted = await serving.admit(args)        # ValueError naming the bad value or the limit
    async for delta in serving.stream(admitted):  # the coordinator's deltas; leaving early aborts
        ...

`admit` validates a request at the front door off the event loop (an image runs through the
processor); `stream` runs it on the coordinator and records it in the metrics (time to first token,
inter-token latency, end-to-end latency, running requests, finish reasons, speculative-decoding
counters per drafter and verifier pair). `trouble()` is None when every stage is linked and
answering, else why not: readiness for `/health` and grpc.health.v1. Runs on the coordinator's
event loop; torch-free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pipespec.coordinator import Coordinator
from pipespec.frontdoor import FrontDoor
from pipespec.generate_args import GenerateArgs
from pipespec.messages import RequestSpec
from pipespec.outputs import Delta
from pipespec.serving.metrics import Metrics


@dataclass(frozen=True)
class Admitted:
    """A request the front door accepted."""

    spec: RequestSpec
    stop: tuple[str, ...]
    arrived: float = field(default_factory=time.perf_counter)  # when it came to the front door: latencies count from here


class Serving:
    def __init__(self, coordinator: Coordinator, front_door: FrontDoor):
        self.coordinator = coordinator
        self.front_door = front_door
        names = coordinator.stage_names
        self.metrics = Metrics(pairs=list(zip(names[:-1], names[1:])))  # each stage drafts for the next

    @property
    def model(self) -> str:
        """The name clients know this pipeline by (its config's name)."""
        return self.front_door.config.name

    async def admit(self, args: GenerateArgs) -> Admitted:
        """Validate `args` at the front door, off the loop (an image runs through the processor).
        Raises ValueError naming the bad value or the limit."""
        arrived = time.perf_counter()
        spec, stop = await asyncio.to_thread(self.front_door.request, args)
        return Admitted(spec, stop, arrived)

    async def stream(self, admitted: Admitted) -> AsyncIterator[Delta]:
        """Run an admitted request: its deltas as the target commits them; closing early aborts it."""
        record = self.metrics.request(len(admitted.spec.prompt_token_ids), admitted.arrived)
        try:
            async for delta in self.coordinator.generate(admitted.spec, admitted.stop):
                record.observe(delta)
                yield delta
        finally:
            record.close()

    def trouble(self) -> str | None:
        """None when every stage is linked and answering; else why not."""
        if not self.coordinator.stages:
            return "the stages are not linked yet"
        return self.coordinator.trouble()
