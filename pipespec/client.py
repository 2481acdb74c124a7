"""`Client`: stream generations from a running pipeline (`pipespec serve` / `pipespec.cluster.launch`).

    from pipespec import Client
    client = Client("127.0.0.1:50051")
    for delta in client.stream("Describe the image.", max_new_tokens=64):
        print(delta.text, end="", flush=True)
    print(delta.finish_reason, delta.stats.pairs)

`stream` yields true deltas (new text, new token ids); the last one has the finish reason and the
request's statistics. Leaving the loop early cancels the request on every stage. `astream` is the
async twin, `generate` collects a whole `Generation`. Sampling values left as None take the
pipeline config's defaults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from pipespec.generate_args import GenerateArgs
from pipespec.images import image_bytes
from pipespec.outputs import Delta, Generation


class Client:
    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout

    @staticmethod
    def _args(prompt: str | None, **kwargs: Any) -> GenerateArgs:
        """The request's keywords (`GenerateArgs`, the same as `LocalPipeline.generate`'s), the image encoded."""
        args = GenerateArgs(prompt, **kwargs)
        return replace(args, image=image_bytes(args.image)[0]) if args.image is not None else args

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Yield deltas as they are committed; keywords as in `GenerateArgs`."""
        from pipespec.transport.generate_client import stream

        yield from stream(self.address, self._args(prompt, **kwargs), self.timeout)

    async def astream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[Delta]:
        """The async twin of `stream`."""
        from pipespec.transport.generate_client import astream

        async for delta in astream(self.address, self._args(prompt, **kwargs), self.timeout):
            yield delta

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return Generation.from_deltas(self.stream(prompt, **kwargs))

    def health(self) -> str:
        from pipespec.transport.generate_client import health

        return health(self.address).status
