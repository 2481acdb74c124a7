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

A refused request ends in one delta with `finish_reason="error"` and the message `LocalPipeline`
raises for it (`generate` raises GenerationError with it): what the Client can see itself (a bad
type or range, a missing image file: `GenerateArgs.checked()`) is refused before anything is sent,
what needs the pipeline (its limits, its tokenizer) by the server's front door.
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
    def _args(prompt: str | None, **kwargs: Any) -> GenerateArgs | Delta:
        """The request's keywords (`GenerateArgs`, the same as `LocalPipeline.generate`'s) checked, the image
        encoded; or the error delta refusing them."""
        try:
            args = GenerateArgs(prompt, **kwargs).checked()
            return replace(args, image=image_bytes(args.image)[0]) if args.image is not None else args
        except ValueError as e:
            return Delta("", (), "error", error=str(e))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Yield deltas as they are committed; keywords as in `GenerateArgs`."""
        from pipespec.transport.generate_client import stream

        args = self._args(prompt, **kwargs)
        if isinstance(args, Delta):
            yield args
            return
        yield from stream(self.address, args, self.timeout)

    async def astream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[Delta]:
        """The async twin of `stream`."""
        from pipespec.transport.generate_client import astream

        args = self._args(prompt, **kwargs)
        if isinstance(args, Delta):
            yield args
            return
        async for delta in astream(self.address, args, self.timeout):
            yield delta

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return Generation.from_deltas(self.stream(prompt, **kwargs))

    def health(self) -> str:
        from pipespec.transport.generate_client import health

        return health(self.address).status
