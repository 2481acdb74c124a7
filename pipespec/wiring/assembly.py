"""Assembly: how a pipeline's parts are built and connected, in one place for every way it runs.

`LocalPipeline` (one process: in-process links, or gRPC streams on loopback) and the Ray actors
(pipespec.cluster: a process per stage and one for the coordinator) assemble a pipeline the same way:

- `Entrance`: the config-time checks, before any weights load (every stage shares the target's
  tokenizer; the target's image processor loads); it builds the front door and the coordinator.
- `link_in_process`: each runner to its drafter, its verifier and the coordinator, and the
  coordinator to every runner, all in one event loop.
- over gRPC, each stage serves its runner (`serve_runner`: the drafter's and the coordinator's
  streams become the runner's links as they attach), then `link_to_verifier` opens each drafter's
  stream to its verifier and `link_coordinator` the coordinator's to every stage. Every call carries
  the pipeline's secret (pipespec.transport.auth; one per pipeline, made by whoever launches it), and
  every stream takes the config's frame limit and loss detection (`limits`, `faults.detect_s`).

Runners and the coordinator take their links through their `connect` methods. No Ray here, and no
gRPC at import: the functions that open streams import the transport when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipespec.config import PipelineConfig
from pipespec.protocol.links import Inbox, InProcessLink, Link
from pipespec.requests.frontdoor import FrontDoor, TargetInfo
from pipespec.requests.images import load_target_processor
from pipespec.requests.tokenization import IncrementalDetokenizer, check_shared_tokenizer
from pipespec.schema.kinds import StandOptions, kind_of
from pipespec.serving.coordinator import Coordinator

if TYPE_CHECKING:
    from pipespec.engine.runner import StageRunner
    from pipespec.transport.streams import StageClient, StageService


@dataclass(frozen=True)
class Entrance:
    """The coordinator's side of a pipeline: its config, the tokenizer every stage shares (None for
    mock stages) and the target's image processor (None for a text target)."""

    config: PipelineConfig
    tokenizer: Any | None
    processor: Any | None

    @classmethod
    def check(cls, config: PipelineConfig) -> Entrance:
        """Load the tokenizer and processor, checking that every stage shares the tokenizer (ConfigError)."""
        return cls(config, check_shared_tokenizer(config), load_target_processor(config))

    @property
    def tokenizer_size(self) -> int | None:
        """The shared tokenizer's size, None without one (the `valid` of pipespec.stages.vocabulary)."""
        return len(self.tokenizer) if self.tokenizer is not None else None

    def front_door(self, target: TargetInfo) -> FrontDoor:
        return FrontDoor(self.config, target, self.tokenizer, self.processor)

    def coordinator(self) -> Coordinator:
        """A coordinator of the config's stages, not yet connected to them; it detokenizes if there is a tokenizer."""
        tokenizer = self.tokenizer
        detokenizer = (lambda: IncrementalDetokenizer(tokenizer)) if tokenizer is not None else None
        first = self.config.stages[0]
        learns_top = (first.options or StandOptions()).top_k if kind_of(first).learns_from_commits else 0
        return Coordinator([s.name for s in self.config.stages], detokenizer, self.config.faults.restore_s, learns_top)


def link_in_process(
    runners: Sequence[StageRunner], coordinator: Coordinator, link: Callable[[Inbox], Link] = InProcessLink
) -> None:
    """Connect `runners` (upstream to downstream) and `coordinator` in one event loop, each link made by `link`."""
    last = len(runners) - 1
    for i, runner in enumerate(runners):
        runner.connect(
            upstream=link(runners[i - 1]) if i > 0 else None,
            downstream=link(runners[i + 1]) if i < last else None,
            coordinator=link(coordinator),
        )
    coordinator.connect([link(r) for r in runners])


async def serve_runner(
    runner: StageRunner, config: PipelineConfig, secret: str, host: str = "127.0.0.1", drafter: bool | None = None
) -> tuple[Any, int, StageService]:
    """Serve `runner`'s streams on `host` (any free port) to callers holding `secret`, with the config's
    frame limit and loss detection; `drafter`: whether it takes a drafter stream (default: if it has a
    drafter; False when its drafter is linked in process). -> (server, port, service)."""
    from pipespec.transport.streams import serve_stage

    limits, detect_s = config.limits, config.faults.detect_s
    return await serve_stage(runner, host, 0, secret=secret, limits=limits, detect_s=detect_s, drafter=drafter)


def _client(address: str, config: PipelineConfig, secret: str) -> StageClient:
    from pipespec.transport.streams import StageClient

    return StageClient(address, secret=secret, limits=config.limits, detect_s=config.faults.detect_s)


async def link_to_verifier(runner: StageRunner, address: str, config: PipelineConfig, secret: str) -> StageClient:
    """Open `runner`'s stream to its verifier served at `address`: drafts go down it, verdicts come back
    (and its loss, to `runner.lost`). -> the client, to close when the pipeline stops."""
    client = _client(address, config, secret)
    await client.wait_ready()
    runner.connect(downstream=client.link(runner))
    return client


async def relink_coordinator(
    coordinator: Coordinator, addresses: Mapping[int, str], config: PipelineConfig, secret: str
) -> dict[int, StageClient]:
    """Open the coordinator's streams to the stages restored at `addresses` (by index): the running
    requests rejoin, once. -> the clients, to close when the pipeline stops."""
    clients = {i: _client(a, config, secret) for i, a in addresses.items()}
    for client in clients.values():
        await client.wait_ready()
    coordinator.restored({i: c.control(coordinator) for i, c in clients.items()})
    return clients


async def link_coordinator(
    coordinator: Coordinator, addresses: Sequence[str], config: PipelineConfig, secret: str
) -> list[StageClient]:
    """Open the coordinator's stream to every stage, served at `addresses` (upstream to downstream):
    opens and closes go down, commits, statistics and failures come back (and a stream's loss, to
    `coordinator.lost`). -> the clients, to close."""
    clients = [_client(a, config, secret) for a in addresses]
    for client in clients:
        await client.wait_ready()
    coordinator.connect([c.control(coordinator) for c in clients])
    return clients
