"""LocalPipeline: the whole pipeline in one process, for tests, notebooks and debugging.

Same stages, same `StageRunner`s, same coordinator as the distributed runtime; only the links are
in-process. One background thread runs the asyncio event loop shared by every runner and the
coordinator; each runner has its own compute thread.

    with LocalPipeline(load_config("pipeline.yaml")) as p:
        r = p.generate("Describe the image.", max_new_tokens=32)
        print(r.text, r.stats.pairs)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipespec.config import PipelineConfig
from pipespec.engine.runner import StageRunner
from pipespec.engine.scheduler import schedulers_for
from pipespec.engine.stage import Stage
from pipespec.protocol.links import Inbox, InProcessLink, Link
from pipespec.protocol.messages import RequestSpec
from pipespec.requests.frontdoor import TargetInfo
from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.outputs import Delta, Generation, raise_error
from pipespec.serving.coordinator import Coordinator
from pipespec.serving.serving import Serving
from pipespec.wiring.assembly import Entrance, link_coordinator, link_in_process, link_to_verifier, serve_runner

if TYPE_CHECKING:
    from pipespec.serving.http_server import HttpServer


class LocalPipeline:
    def __init__(
        self,
        config: PipelineConfig,
        *,
        link_factory: Callable[[Inbox], Link] = InProcessLink,
        stages: Sequence[Stage] | None = None,  # already-built stages (to share weights across pipelines)
        torch_threads: int | None = 1,
        over_grpc: bool = False,
    ):
        """`torch_threads`: torch's intra-op pool is shared by every stage of this process; one thread
        each keeps concurrent stages from fighting over the cores (None leaves torch's setting).
        `over_grpc`: every stage behind its own gRPC server on 127.0.0.1, the links real gRPC
        streams (to measure the transport against in-process links; same process, same loop), open
        only to callers holding `secret` (this pipeline's, made here); `addresses`: each stage's."""
        self.config = config
        self.link_factory = link_factory
        self.over_grpc = over_grpc
        self.secret: str | None = None  # over_grpc only
        self.addresses: list[str] = []
        self._services: list = []  # each stage's gRPC service, and the clients of its streams (over_grpc only)
        self._clients: list = []
        self.entrance = Entrance.check(config)  # before any weights load
        if torch_threads is not None:  # before the stages are built: a compiled forward is compiled for this many
            import torch

            torch.set_num_threads(torch_threads)
        if stages is None:
            from pipespec.stages.build import load_stages

            stages = load_stages(config, self.entrance.tokenizer_size)
        self.stages = list(stages)
        self.front_door = self.entrance.front_door(TargetInfo.of(config.target, self.stages[-1]))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.runners: list[StageRunner] = []
        self.coordinator: Coordinator | None = None
        self.serving: Serving | None = None  # every way in to the coordinator (pipespec.serving), once started
        self._tasks: list[asyncio.Task] = []
        self._http: list[HttpServer] = []

    @property
    def tokenizer(self) -> Any | None:
        """The tokenizer every stage shares, None for mock stages."""
        return self.entrance.tokenizer

    # ---- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalPipeline:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pipespec-loop", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._wire(), self.loop).result()

    async def _wire(self) -> None:
        devices = schedulers_for(self.config.devices(), [s.name for s in self.config.stages])
        self.runners = [StageRunner.for_config(stage, self.config, i, devices[i]) for i, stage in enumerate(self.stages)]
        self.coordinator = self.entrance.coordinator()
        self.serving = Serving(self.coordinator, self.front_door)
        if self.over_grpc:
            await self._wire_grpc()
        else:
            link_in_process(self.runners, self.coordinator, self.link_factory)
        self._tasks = [asyncio.create_task(r.run(), name=f"runner-{r.name}") for r in self.runners]

    async def _wire_grpc(self) -> None:
        """Every link a gRPC stream, through a server per stage on 127.0.0.1 (as on a cluster)."""
        from pipespec.transport.auth import new_secret

        self.secret = secret = new_secret()
        served = [await serve_runner(r, self.config, secret) for r in self.runners]
        self._services = [service for _, _, service in served]
        self.addresses = [f"127.0.0.1:{port}" for _, port, _ in served]
        pairs = zip(self.runners[:-1], self.addresses[1:])
        self._clients = [await link_to_verifier(r, verifier, self.config, secret) for r, verifier in pairs]
        self._clients += await link_coordinator(self.coordinator, self.addresses, self.config, secret)
        for service in self._services:
            await service.attached()

    def close(self) -> None:
        if self.loop is None:
            return

        async def stop() -> None:
            for server in self._http:
                await server.stop()
            self._http = []
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for service in self._services:  # our own shutdown: no stream it ends is reported lost
                service.stopping = True
            for client in self._clients:
                await client.close()
            for service in self._services:
                await service.stop()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()
        for scheduler in {r.scheduler: None for r in self.runners}:  # let in-flight forwards finish while the loop runs
            scheduler.shutdown(wait=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
        self.loop = None

    def serve_http(self, host: str = "127.0.0.1", port: int = 0, allowed_media: str | Path | None = None) -> int:
        """Serve the OpenAI-compatible HTTP API (pipespec.serving.openai_app) on `host`:`port` (0: a free
        port) until `close()`; -> the port. `allowed_media`: the directory `image_url` file paths may
        name (None: data URLs only)."""
        from pipespec.serving.http_server import serve_http  # fastapi and uvicorn, when asked for

        media = Path(allowed_media) if allowed_media is not None else None
        server = self._run(serve_http(self.serving, host, port, media)).result()
        self._http.append(server)
        return server.port

    # ---- tracing (pipespec.engine.trace) ---------------------------------------------------------------

    def start_trace(self) -> None:
        """Begin recording where each stage's time goes."""
        self._on_loop(lambda: [r.trace.start() for r in self.runners])

    def stop_trace(self) -> list[dict]:
        """Stop recording; -> each stage's summary, upstream to downstream."""
        return self._on_loop(lambda: [r.trace.stop() for r in self.runners])

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()

        return self._run(call()).result()

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Run `coroutine` on the pipeline's loop; RuntimeError if the pipeline is not running."""
        if self.loop is None:
            coroutine.close()
            raise RuntimeError("this LocalPipeline is not running: use `with LocalPipeline(config) as p:` or call start() first")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    # ---- requests -----------------------------------------------------------------------------

    def request(self, prompt: str | None = None, **kwargs: Any) -> tuple[RequestSpec, tuple[str, ...]]:
        """Validate one request at the front door (see pipespec.requests.frontdoor); keywords as in `GenerateArgs`."""
        return self.front_door.request(GenerateArgs(prompt, **kwargs))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Yield deltas as the target commits them; leaving the loop early aborts the request. A bad
        request is a ValueError (the front door's); one that fails once started raises GenerationError
        after the deltas committed before it."""
        spec, stop = self.request(prompt, **kwargs)
        out: queue.Queue = queue.Queue()

        async def pump() -> None:
            async for delta in self.coordinator.generate(spec, stop):
                out.put(delta)

        self._run(pump())
        finished = False
        try:
            while not finished:
                delta = out.get()
                finished = delta.finish_reason is not None
                yield raise_error(delta)
        finally:
            if not finished:
                self.loop.call_soon_threadsafe(self.coordinator.abort, spec.request_id)

    def submit(self, prompt: str | None = None, **kwargs: Any) -> concurrent.futures.Future:
        """Start a request without waiting; the future resolves to its `Generation`."""
        spec, stop = self.request(prompt, **kwargs)

        async def collect() -> Generation:
            return Generation.from_deltas([d async for d in self.coordinator.generate(spec, stop)])

        return self._run(collect())

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return self.submit(prompt, **kwargs).result()
