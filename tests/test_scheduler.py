"""Tests for pipespec/engine/scheduler.py: stages placed on one device share one compute thread.

The scheduler alone, with fake runners: one batch at a time, prefills and verifications before other
steps, the stage nearest the target first, the device busy until its runner took the results. Then
real runners of mock stages sharing devices (all on one; the drafters on one) under random link
delays: the output still equals the target alone, and the traced forwards of one device never
overlap in time.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from pipespec import LocalPipeline, load_config
from pipespec.engine.scheduler import Batch, DeviceScheduler, Done, schedulers_for
from pipespec.protocol.links import DelayLink


@dataclass(eq=False)
class FakeRunner:
    name: str
    depth: int
    work: list[Batch | None] = field(default_factory=list)  # what next_batch offers
    ran: list[str] = field(default_factory=list)  # shared log of launched batches
    done: list[Done] = field(default_factory=list)
    waited: int = 0
    has_mail: bool = False
    arrived: asyncio.Event | None = None  # set by deliver; made by drain, inside its event loop

    def offer(self, urgent: bool) -> None:
        self.work.append(Batch(self, (f"{self.name}-{len(self.work)}",), urgent))

    def next_batch(self) -> Batch | None:
        return self.work[0] if self.work else None

    def launch(self, batch: Batch):
        self.work.remove(batch)
        self.ran.append(batch.plans[0])
        return lambda: list(batch.plans)

    def wait_for_device(self, batch: Batch) -> None:
        assert batch.worker is self
        self.waited += 1

    def deliver(self, message) -> None:
        self.done.append(message)
        self.arrived.set()


async def drain(scheduler: DeviceScheduler, runners: list[FakeRunner]) -> list[str]:
    """Run every offered batch to completion, releasing the device as a runner would."""
    for r in runners:
        r.arrived = asyncio.Event()
    while any(r.work for r in runners):
        scheduler.poke()
        owner = scheduler.running
        assert owner is not None
        await owner.arrived.wait()
        owner.arrived.clear()
        done = owner.done.pop()
        assert done.future.result() == list(done.batch.plans)
        scheduler.poke()  # still busy: results not yet taken
        assert scheduler.running is owner
        scheduler.release(owner)
    return runners[0].ran


def test_urgent_first_then_nearest_the_target():
    log: list[str] = []
    drafter, mid, target = FakeRunner("drafter", 2, ran=log), FakeRunner("mid", 1, ran=log), FakeRunner("target", 0, ran=log)
    scheduler = DeviceScheduler("all")
    for r in (drafter, target, mid):
        scheduler.join(r)
    drafter.offer(urgent=False)
    mid.offer(urgent=True)
    target.offer(urgent=False)
    drafter.offer(urgent=False)
    try:
        order = asyncio.run(drain(scheduler, [drafter, mid, target]))
    finally:
        scheduler.shutdown(wait=True)
    assert order == ["mid-0", "target-0", "drafter-0", "drafter-1"]
    assert drafter.waited >= 1 and target.waited >= 1  # they had work while another went first


def test_nothing_launches_while_a_runner_has_unread_news():
    a, b = FakeRunner("a", 1), FakeRunner("b", 0)
    scheduler = DeviceScheduler("ab")
    scheduler.join(a)
    scheduler.join(b)
    a.offer(urgent=False)
    b.has_mail = True

    async def poke():
        scheduler.poke()

    try:
        asyncio.run(poke())
        assert scheduler.running is None and a.ran == []
        b.has_mail = False
        asyncio.run(poke())
        assert scheduler.running is a
    finally:
        scheduler.shutdown(wait=True)


def test_a_runner_that_leaves_frees_the_device_and_the_last_stops_the_thread():
    a, b = FakeRunner("a", 1), FakeRunner("b", 0)
    scheduler = DeviceScheduler("ab")
    scheduler.join(a)
    scheduler.join(b)
    scheduler.running = a
    scheduler.leave(a)
    assert scheduler.running is None and scheduler.workers == [b]
    scheduler.leave(b)
    assert scheduler.executor._shutdown


def test_schedulers_for_maps_each_stage_to_its_device():
    got = schedulers_for(((0, 2), (1,)), ["tiny", "dream", "target"])
    assert got[0] is got[2] and got[1] is not got[0]
    assert got[0].name == "tiny+target" and got[1].name == "dream"


# ---- real runners sharing devices ------------------------------------------------------------------


def mock_config(groups: list[str], lookahead: int = 4):
    agreements = [0.6] * (len(groups) - 1) + [1.0]
    return load_config(
        {
            "stages": [
                {
                    "name": f"m{i}",
                    "kind": "mock",
                    "agreement": a,
                    "latency_ms": 0.5,
                    "max_lookahead": lookahead,
                    "vocab_size": 50,
                    "device_group": g,
                }
                for i, (a, g) in enumerate(zip(agreements, groups))
            ]
        }
    )


def requests(n=8):
    return [
        dict(prompt_token_ids=[i % 7 + 1, i % 5 + 2, 3], max_new_tokens=30, temperature=0.0 if i % 2 else 1.0, seed=i)
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def target_alone():
    with LocalPipeline(mock_config(["t"])) as p:
        yield p


@pytest.mark.parametrize("groups", [["d", "d", "d"], ["d", "d", "t"], ["a", "t", "t"], ["d", "t"], ["d", "d"]])
def test_shared_devices_keep_output_exact_and_one_forward_at_a_time(groups, target_alone):
    config = mock_config(groups, lookahead=random.Random(str(groups)).randint(1, 6))
    rng = random.Random(str(groups))
    with LocalPipeline(config, link_factory=lambda peer: DelayLink(peer, 0.002, rng)) as p:
        assert len({r.scheduler for r in p.runners}) == len(set(groups))
        p.start_trace()
        futures = [(p.submit(**r), target_alone.submit(**r)) for r in requests()]
        results = [(f.result(timeout=60), ref.result(timeout=60)) for f, ref in futures]
        p.stop_trace()
        steps = {r.name: list(r.trace.steps) for r in p.runners}
    for got, want in results:
        assert got.token_ids == want.token_ids
    for group in set(groups):  # on a device, a step is planned only once the one before it was taken
        timeline = sorted((s.planned, s.handled) for name, g in zip(steps, groups) if g == group for s in steps[name])
        assert len(timeline) > 10
        for (_, handled), (planned, _) in zip(timeline, timeline[1:]):
            assert planned >= handled, f"a step on device {group!r} was planned before the one in flight was taken"


def test_a_plan_that_fails_fails_its_request_not_the_device(target_alone):
    """A runner whose planning raises for one request (a bug, or a peer's bad frame) fails that
    request; the other runner on its device and the other requests go on exactly."""
    from pipespec import GenerationError

    with LocalPipeline(mock_config(["d", "d"])) as p:
        target = p.runners[-1]
        plan = target._plan

        def broken(rid, req):
            if req.spec.max_new_tokens == 7:
                raise ValueError("broken plan")
            return plan(rid, req)

        target._plan = broken
        bad = p.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=7)
        good = [p.submit(**r) for r in requests(4)]
        with pytest.raises(GenerationError, match="broken plan"):
            bad.result(timeout=30)
        for fut, r in zip(good, requests(4)):
            assert fut.result(timeout=30).token_ids == target_alone.submit(**r).result(timeout=30).token_ids
