"""`Client`: stream generations from a running pipeline (`pipespec serve` / `pipespec.cluster.launch`).

    from pipespec import Client
    with Client("127.0.0.1:50051") as client:
        for delta in client.stream("Describe the image.", image="cat.png", max_new_tokens=64):
            print(delta.text, end="", flush=True)
        print(delta.finish_reason, delta.stats.pairs)
        answer = client.generate(messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "What is red?"}])

`stream` yields true deltas (new text, new token ids); the last one has the finish reason and the
request's statistics. Leaving the loop early cancels the request on every stage. `astream` is the
async twin, `generate` collects a whole `Generation`. The keywords are `GenerateArgs`' (those of
`LocalPipeline.generate`): `prompt` or `messages` (a conversation; an image in one of its parts is
sent like `image=`) or `prompt_token_ids`; sampling values left as None take the pipeline config's
defaults.

A request that fails raises `GenerationError`, from `stream` after the deltas committed before it,
with the message `LocalPipeline` gives. A refused one raises its subclass `RequestRefused`, also a
ValueError as `LocalPipeline`'s refusal is: what the Client can see itself (a bad type or range, a
missing image file: building the request's `GenerateArgs`) from the call to `stream` / `astream` /
`generate` itself, before anything is sent, and what needs the pipeline (its limits, its tokenizer)
from the server's front door. A failure inside the pipeline, and a coordinator that cannot be reached
or is lost (naming its address), raise `GenerationError`. A loop over `stream` never ends without a
finish reason or an error. `max_new_tokens` means what it means on every way in (left out: 64; None:
as many as the pipeline's limits allow; pipespec.requests.generate_args).

A Client holds one gRPC channel (one connection), made on its first request and reused by every
request after it, from any thread; `astream` holds one per event loop. `close()` (`aclose()` in
async code) or leaving a `with` (`async with`) block closes them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.images import image_bytes
from pipespec.requests.outputs import Delta, Generation, RequestRefused


class Client:
    def __init__(self, address: str, timeout: float | None = None):
        """`timeout`: seconds a request may take in all (None: no limit). No channel is opened here."""
        from pipespec.transport.generate_client import CoordinatorClient  # grpc: imported with the first Client

        self.address = address
        self.timeout = timeout
        self.coordinator = CoordinatorClient(address)

    @staticmethod
    def _args(prompt: str | None, **kwargs: Any) -> GenerateArgs:
        """The request's `GenerateArgs` (checked as they are built), the image encoded for the wire;
        RequestRefused naming a bad value."""
        try:
            args = GenerateArgs(prompt, **kwargs)
            return replace(args, image=image_bytes(args.image)[0]) if args.image is not None else args
        except ValueError as e:
            raise RequestRefused(str(e)) from None

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """The deltas as they are committed, yielded as the result is iterated; keywords as in
        `GenerateArgs`. A bad value raises RequestRefused from this call, before anything is sent."""
        return self.coordinator.stream(self._args(prompt, **kwargs), self.timeout)

    def astream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[Delta]:
        """The async twin of `stream` (`async for delta in client.astream(...)`); a bad value raises
        RequestRefused from this call."""
        return self.coordinator.astream(self._args(prompt, **kwargs), self.timeout)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return Generation.from_deltas(self.stream(prompt, **kwargs))

    def health(self) -> str:
        return self.coordinator.health().status

    # ---- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channels; a later request opens new ones."""
        self.coordinator.close()

    async def aclose(self) -> None:
        """Close the channels, this event loop's once its calls are closed."""
        await self.coordinator.aclose()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
