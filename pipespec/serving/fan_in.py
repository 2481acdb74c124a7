"""Several requests' streams as one: the deltas of an OpenAI request's `n` choices, as they come.

    async with contextlib.aclosing(fan_in(streams)) as deltas:
        async for i, delta in deltas:   # i: the index of the stream it came from
            ...

Each stream is pumped by a task of its own, so the choices run concurrently and their deltas
interleave. Closing the iterator early (a client gone, a choice failed) cancels every pump, which
closes its stream and so aborts its request on every stage (pipespec.serving.Serving.stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from pipespec.requests.outputs import Delta


async def fan_in(streams: Sequence[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    queue: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta, None))
        except Exception as error:  # a bug below: raised again by the reader
            queue.put_nowait((i, None, error))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s), name=f"choice-{i}") for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                running -= 1
                continue
            yield i, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
