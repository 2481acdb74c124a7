"""The supervisor: puts a running pipeline back together after Ray restarts one of its actors.

Every actor (a device's, the coordinator's) is started with `max_restarts` (the config's
`faults.max_restarts`), so Ray restarts a process that dies; a restarted actor has run its
constructor again (its models loaded) and nothing else. The supervisor watches each actor's
`lifetime` call, which only ever ends when the actor dies, and then, from the driver:

- a device: serves its stages again (new ports), links each stage's drafter on another device to it
  and it to its verifier on another device, and gives the coordinator its new control links; the
  coordinator tells the stages which requests rejoin (pipespec.serving.coordinator);
- the coordinator: serves it again on the same address, linked to every stage, and its HTTP
  server, if it has one, on the same port. The requests it held are gone with it (their clients
  saw the stream fail); each stage closed them when it lost the coordinator's stream.

A link can also be lost while both processes live on (a peer silent past `faults.detect_s`, a
stream refused). When the coordinator's link to a stage stays lost for a grace period (twice
`detect_s`, during which an actor that did die is restored as above), the supervisor kills the
stage's actor so that Ray restarts it, and restores it the same way: one path back for every fault.

Until then the stages degrade on their own (a verifier without its drafter goes on alone) and the
coordinator fails the requests of a lost target after `faults.restore_s`. A restore that does not
succeed within `restore_s` (restarts exhausted, a constructor that fails) is fatal for the target's
device or the coordinator: `on_failure` is called with the reason, and `pipespec serve` exits
non-zero. A device of drafters only that cannot come back is left out: the pipeline serves without it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import ray

from pipespec.config import PipelineConfig

log = logging.getLogger(__name__)


class Supervised(Protocol):
    """What the supervisor watches and puts back together: a running pipeline's actors and the calls
    that rewire them (pipespec.cluster.pipeline.RunningPipeline)."""

    @property
    def coordinator(self) -> object: ...

    @property
    def devices(self) -> Sequence[object]: ...  # the device actors, in the order of config.devices()

    @property
    def config(self) -> PipelineConfig: ...

    def name_of(self, actor: object) -> str: ...

    def holds_target_or_coordinator(self, actor: object) -> bool: ...

    def device_lost(self, k: int) -> None: ...

    def serve_device(self, k: int) -> None: ...

    def serve_coordinator(self, timeout: float | None = None) -> None: ...


class Supervisor:
    def __init__(self, running: Supervised, on_failure: Callable[[str], None] | None = None) -> None:
        self.running = running
        self.on_failure = on_failure  # called (on the supervisor's thread) when a restore failed
        self.why: str | None = None  # why the pipeline could not be restored
        self.restores = 0  # actors restored so far
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._watch()), name="pipespec-supervisor", daemon=True)
        self._started = threading.Event()

    def start(self) -> Supervisor:
        self._thread.start()
        self._started.wait()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # it has just ended on its own (a failed restore)
                pass
        self._thread.join()

    async def _watch(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        running = self.running
        actors = [running.coordinator, *running.devices]
        self._pids = dict(zip(map(id, actors), await asyncio.gather(*(a.pid.remote() for a in actors))))
        watches = {asyncio.ensure_future(_lifetime(a)): a for a in actors}
        self._restoring: set[int] = set()  # id() of the actors being restored now
        self._left_out: set[int] = set()  # id() of drafters' devices that could not be restored
        self._started.set()
        links = asyncio.ensure_future(self._watch_links())
        stop = asyncio.ensure_future(self._stop.wait())
        while not self._stop.is_set():
            done, _ = await asyncio.wait([stop, *watches], return_when=asyncio.FIRST_COMPLETED)
            for watch in done - {stop}:
                actor = watches.pop(watch)
                if self._stop.is_set():
                    break
                self._restoring.add(id(actor))
                try:
                    restored = await asyncio.to_thread(self._restore, actor)
                except Exception as error:  # noqa: BLE001 (reported; fatal unless a drafter's device)
                    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
                    why = f"could not restore {running.name_of(actor)}: {type(error).__name__}: {first_line}"
                    if not running.holds_target_or_coordinator(actor):  # degrade, don't die: serve without it
                        log.error("supervisor: %s; serving without it", why)
                        self._left_out.add(id(actor))
                        continue
                    self.why = why
                    log.error("supervisor: %s", why)
                    if self.on_failure is not None:
                        self.on_failure(why)
                    return
                finally:
                    self._restoring.discard(id(actor))
                self.restores += restored
                watches[asyncio.ensure_future(_lifetime(actor))] = actor
        links.cancel()
        for watch in watches:
            watch.cancel()

    async def _watch_links(self) -> None:
        """Restart the actor behind a link the coordinator lost while that actor lives on."""
        running = self.running
        grace = 2 * running.config.faults.detect_s
        while True:
            try:
                await running.coordinator.wait_lost.remote()
                await asyncio.sleep(grace)  # an actor that died is being restored by now
                lost = await running.coordinator.lost_stages.remote()
            except ray.exceptions.RayError:  # the coordinator died: its own restore relinks everything
                await asyncio.sleep(grace)
                continue
            for k in {k for k, indices in enumerate(running.config.devices()) for i in lost if i in indices}:
                actor = running.devices[k]
                if id(actor) not in self._restoring | self._left_out:
                    log.warning("supervisor: %s lost its link but lives on; restarting it", running.name_of(actor))
                    ray.kill(actor, no_restart=False)
            await asyncio.sleep(grace)

    def _restore(self, actor: object) -> bool:
        """Put `actor` back once Ray has restarted it; -> False if it had not died (a call failed, the
        process lives on: nothing to restore)."""
        running = self.running
        device = None if actor is running.coordinator else running.devices.index(actor)
        try:
            pid = _wait_restarted(actor, running.config.faults.restore_s)
        except Exception:
            if device is not None:  # its requests fail in time, naming it
                running.device_lost(device)
            raise
        if pid == self._pids[id(actor)]:
            return False
        self._pids[id(actor)] = pid
        log.warning("supervisor: %s died and was restarted; restoring it", running.name_of(actor))
        if device is None:
            running.serve_coordinator()
        else:
            running.device_lost(device)  # its streams may not have noticed yet
            running.serve_device(device)
        log.warning("supervisor: %s restored", running.name_of(actor))
        return True


def _wait_restarted(actor: object, timeout: float) -> int:
    """-> `actor`'s process id once it answers (Ray restarts a dead one: its constructor runs again);
    raise if it cannot within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(actor.pid.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:  # restarting: calls are refused until it is up
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def _lifetime(actor: object) -> None:
    """Returns (with the error swallowed) when `actor` dies, or the call fails for another reason."""
    try:
        await actor.lifetime.remote()
    except ray.exceptions.RayError as error:
        log.debug("supervisor: lifetime call ended: %s", error)
