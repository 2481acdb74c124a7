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

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from pipespec.images import image_bytes
from pipespec.outputs import Delta, Generation


class Client:
    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout

    def _request(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image: Any = None,
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
    ):
        """The request's keywords, the same as `LocalPipeline.generate`'s, into a GenerateRequest."""
        from pipespec.transport.generate_client import build_request

        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
        ids = list(prompt_token_ids) if prompt_token_ids is not None else None
        return build_request(
            prompt, ids, image_bytes(image)[0] if image is not None else None, max_new_tokens, sampling, list(stop or [])
        )

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Yield deltas as they are committed; keywords as in `_request`."""
        from pipespec.transport.generate_client import stream

        yield from stream(self.address, self._request(prompt, **kwargs), self.timeout)

    async def astream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[Delta]:
        """The async twin of `stream`."""
        from pipespec.transport.generate_client import astream

        async for delta in astream(self.address, self._request(prompt, **kwargs), self.timeout):
            yield delta

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return Generation.from_deltas(self.stream(prompt, **kwargs))

    def health(self) -> str:
        from pipespec.transport.generate_client import health

        return health(self.address).status
