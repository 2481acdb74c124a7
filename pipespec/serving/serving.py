"""`Serving`: what every way in to a running coordinator shares (design: one front door).

    admitted = await serving.admit(args)        # args() builds the GenerateArgs; ValueError names the bad value
    async for delta in serving.stream(admitted):  # the coordinator's deltas; leaving early aborts
        ...

`admit` builds a request's arguments (which checks them) and validates them at the front door, both
off the event loop (a long prompt's ids are checked one by one, an image runs through the processor);
`admit_choices` does it once for several choices of one request (OpenAI's `n`), each its own request
with its own seed. `stream` runs a request on the coordinator and records it in the
metrics (time to first token, inter-token latency, end-to-end latency, running requests, finish
reasons, speculative-decoding counters per drafter and verifier pair).

Two questions with two answers: `trouble()` is None when every stage is linked and answering and
the server is not draining, else why not: readiness for `/health` and grpc.health.v1 (a lost drafter
shows there). `refusal()` is None while new requests are served, else why not: the stages not linked
yet, the server draining to shut down (pipespec.serving.drain), or the target lost (the coordinator's
own rule, `Coordinator.refusal`); a lost drafter costs speed only, so it refuses nothing. Runs on the
coordinator's event loop; torch-free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from pipespec.protocol.messages import RequestSpec
from pipespec.requests.frontdoor import FrontDoor, new_request_id
from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.outputs import Delta
from pipespec.serving.coordinator import Coordinator
from pipespec.serving.metrics import Metrics

NOT_LINKED = "the stages are not linked yet"


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

    async def admit(self, args: Callable[[], GenerateArgs]) -> Admitted:
        """Build the request's arguments with `args()` (building checks them) and validate them at the
        front door, both off the loop. Raises ValueError naming the bad value or the limit."""
        arrived = time.perf_counter()
        spec, stop = await asyncio.to_thread(lambda: self.front_door.request(args()))
        return Admitted(spec, stop, arrived)

    async def admit_choices(self, args: Callable[[], GenerateArgs], seeds: Sequence[int]) -> list[Admitted]:
        """The request `args()` admitted once (its image decoded and processed once) as `len(seeds)`
        choices: choice i its own request (a fresh id) seeded `seeds[i]`. Raises ValueError as `admit`
        does, or naming a seed out of range."""
        first = await self.admit(lambda: dataclasses.replace(args(), seed=seeds[0]))
        return [first, *(_choice(first, seed) for seed in seeds[1:])]

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
        """None when every stage is linked and answering and the server is not draining; else why not (readiness)."""
        if not self.coordinator.stages:
            return NOT_LINKED
        return self.coordinator.draining or self.coordinator.trouble()

    def refusal(self) -> str | None:
        """None while new requests are served; else why not (not linked yet, the target lost, draining)."""
        if not self.coordinator.stages:
            return NOT_LINKED
        return self.coordinator.refusal()


def _choice(first: Admitted, seed: int) -> Admitted:
    """Another choice of `first`'s request: the same admitted prompt, its own id and seed."""
    params = dataclasses.replace(first.spec.params, seed=seed)  # SamplingParams checks the seed's range
    return dataclasses.replace(first, spec=dataclasses.replace(first.spec, request_id=new_request_id(), params=params))
