"""DeviceScheduler: one device's compute thread, shared by the stage runners placed on it (design 5b).

A device (a set of CPU cores, or one GPU) runs one forward at a time. The runners placed on it do not
own threads: whenever one of them may have work (after every message it handles), it pokes the
device's scheduler; if the device is free, the scheduler asks each runner for its next batch and runs
the most urgent on the device's compute thread:

1. a prefill or a verification (a step that checks drafts) before any other step, the runner nearest
   the target first (runners are kept in that order);
2. then a drafter's next draft, the runner farthest from the target first: the head of the chain
   drafts, the stage after it verifies what it drafted, as synchronous speculation runs on one device;
3. last a step no stage waits for: the target generating alone, a pre-drafted branch
   (pipespec.engine.outcome_cache), nearest the target first.

Rule 2 is what lets a drafter and its target share a device: were the target's lone step first, it would always
have no draft to check, and the drafter would never draft.

The device stays busy until the runner that owns the finished batch has taken its results (on the
event loop), so a runner never plans from state its own forward is about to change.

A batch holds a list of plans, one request each: one, or, where the runner's stage batches
(pipespec.engine.stage.BatchingStage), as many as its `max_batch`, run as one forward. Everything here
runs on the event loop the runners share, except what `Worker.launch` returns: the compute thread
runs it. While a runner has unread messages nothing is launched (it pokes again once it has read
them), so a batch is never chosen from news that has arrived but not been read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Priority(IntEnum):
    """What a batch's forward is for, most urgent first (the module docstring's rules)."""

    CHECK = 0  # a prefill or a verification: drafters and the client wait on it
    DRAFT = 1  # a drafter's next draft: the stage after it waits for drafts to check
    ALONE = 2  # what no stage waits for: the target generating alone, a pre-drafted branch


@dataclass(frozen=True)
class Batch:
    """The work of one forward on a device: plans of one runner, one request each."""

    worker: Worker
    plans: tuple[Any, ...]
    priority: Priority

    @property
    def urgent(self) -> bool:
        """A prefill or a verification."""
        return self.priority is Priority.CHECK

    def order(self) -> tuple[int, int]:
        """Sorts the batches a device is offered, the one to run first first."""
        depth = self.worker.depth
        return self.priority, -depth if self.priority is Priority.DRAFT else depth


@dataclass(frozen=True)
class Done:
    """A finished batch, posted back to its runner's inbox: one outcome per plan."""

    batch: Batch
    future: Future  # -> list of outcomes, aligned with batch.plans


class Worker(Protocol):
    """What a device scheduler asks of a stage runner."""

    name: str
    depth: int  # hops to the target: 0 is the target
    has_mail: bool  # messages wait in its inbox: it pokes again once it has read them

    def next_batch(self) -> Batch | None:
        """The runner's next work, or None; the scheduler may not take it."""
        ...

    def launch(self, batch: Batch) -> Callable[[], list[Any]]:
        """The scheduler takes `batch`: update what must change on the loop; -> what the compute thread runs."""
        ...

    def wait_for_device(self, batch: Batch) -> None:
        """The runner had `batch` to run but another runner's went first."""
        ...

    def deliver(self, message: Any) -> None: ...


class DeviceScheduler:
    """One device: one compute thread, one forward at a time, for the runners placed on it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.workers: list[Worker] = []  # nearest the target first
        self.running: Worker | None = None  # whose batch the device is computing (or whose results are unread)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"device-{name}")

    def join(self, worker: Worker) -> None:
        self.workers.append(worker)
        self.workers.sort(key=lambda w: w.depth)

    def leave(self, worker: Worker) -> None:
        """`worker` stops; the thread shuts down with the last one (in-flight work is not awaited)."""
        if worker in self.workers:
            self.workers.remove(worker)
        if self.running is worker:
            self.running = None
        if not self.workers:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def poke(self) -> None:
        """Run the most urgent batch any runner has, if the device is free."""
        if self.running is not None or any(w.has_mail for w in self.workers):
            return  # busy, or news not yet read: whoever has it pokes again once it has read it
        offered = sorted((b for b in (w.next_batch() for w in self.workers) if b is not None), key=Batch.order)
        if not offered:
            return
        chosen = offered[0]
        for batch in offered[1:]:
            batch.worker.wait_for_device(batch)
        work = chosen.worker.launch(chosen)
        loop = asyncio.get_running_loop()
        future = self.executor.submit(work)
        self.running = chosen.worker
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(chosen.worker.deliver, Done(chosen, f)))

    def release(self, worker: Worker) -> None:
        """`worker` has taken its batch's results: the device is free."""
        if self.running is worker:
            self.running = None

    def run_later(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the compute thread after what is queued (e.g. freeing a closed request's cache)."""
        self.executor.submit(fn)

    def shutdown(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=True)


def schedulers_for(devices: Sequence[Sequence[int]], names: Sequence[str]) -> list[DeviceScheduler]:
    """One scheduler per device, indexed by stage: `devices` are the stage indices on each device."""
    out: list[DeviceScheduler | None] = [None] * len(names)
    for indices in devices:
        scheduler = DeviceScheduler("+".join(names[i] for i in indices))
        for i in indices:
            out[i] = scheduler
    return out  # type: ignore[return-value]
