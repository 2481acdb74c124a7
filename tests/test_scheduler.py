"""Tests for pipespec/engine/scheduler.py: stages placed on one device share one compute thread.

The scheduler alone, with fake runners: one batch at a time, prefills and verifications first (the stage
nearest the target first), then drafts (the stage farthest from it first), then what no stage waits
for; the device busy until its runner took the results. A real target sharing a device with its
drafter verifies drafts, where it used to generate alone. Then
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
from pipespec.engine.scheduler import Batch, DeviceScheduler, Done, Priority, schedulers_for
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

    def offer(self, priority: Priority) -> None:
        self.work.append(Batch(self, (f"{self.name}-{len(self.work)}",), priority))

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


def three_on_one_device() -> tuple[DeviceScheduler, list[FakeRunner]]:
    log: list[str] = []
    drafter, mid, target = FakeRunner("drafter", 2, ran=log), FakeRunner("mid", 1, ran=log), FakeRunner("target", 0, ran=log)
    scheduler = DeviceScheduler("all")
    for r in (drafter, target, mid):
        scheduler.join(r)
    return scheduler, [drafter, mid, target]


def run(scheduler: DeviceScheduler, runners: list[FakeRunner]) -> list[str]:
    try:
        return asyncio.run(drain(scheduler, runners))
    finally:
        scheduler.shutdown(wait=True)


def test_checks_first_nearest_the_target_then_drafts_farthest_from_it_then_what_no_stage_waits_for():
    scheduler, (drafter, mid, target) = three_on_one_device()
    for runner, offers in [(target, [Priority.CHECK, Priority.ALONE]), (mid, [Priority.CHECK, Priority.DRAFT])]:
        for priority in offers:
            runner.offer(priority)
    drafter.offer(Priority.DRAFT)
    order = run(scheduler, [drafter, mid, target])  # each forward, the best of the runners' first offers
    assert order == ["target-0", "mid-0", "drafter-0", "mid-1", "target-1"]
    assert drafter.waited >= 1 and target.waited >= 1  # they had work while another went first


def test_a_draft_goes_before_its_verifier_generating_alone():
    """Synchronous speculation on one device: the target with nothing to check waits while its drafter drafts."""
    scheduler, (drafter, _, target) = three_on_one_device()
    target.offer(Priority.ALONE)
    drafter.offer(Priority.DRAFT)
    drafter.offer(Priority.DRAFT)
    assert run(scheduler, [drafter, target]) == ["drafter-0", "drafter-1", "target-0"]


def test_nothing_launches_while_a_runner_has_unread_news():
    a, b = FakeRunner("a", 1), FakeRunner("b", 0)
    scheduler = DeviceScheduler("ab")
    scheduler.join(a)
    scheduler.join(b)
    a.offer(Priority.DRAFT)
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


@pytest.mark.parametrize("groups", [["d", "d"], ["d", "d", "d"]])
def test_a_verifier_sharing_its_drafters_device_verifies_its_drafts(groups, target_alone):
    """Greedy, one request at a time: every verifier on its drafter's device checks drafts, at least once
    per three tokens (13-19 verifications per 30 tokens here; before drafts went before generating
    alone, none: the drafters' steps never ran)."""
    with LocalPipeline(mock_config(groups, lookahead=4)) as p:
        for request in requests(4)[1::2]:  # the greedy ones
            got = p.generate(**request)
            assert got.token_ids == target_alone.generate(**request).token_ids
            for pair in got.stats.pairs:
                assert pair.num_drafts * 3 >= len(got.token_ids) and pair.num_accepted_tokens > 0, pair


def test_a_plan_that_fails_fails_its_request_not_the_device(target_alone):
    """A runner whose planning raises for one request (a bug, or a peer's bad frame) fails that
    request; the other runner on its device and the other requests go on exactly."""
    from pipespec import GenerationError

    with LocalPipeline(mock_config(["d", "d"])) as p:
        target = p.runners[-1]
        plan = target._plan

        def broken(proto):
            if proto.req.spec.max_new_tokens == 7:
                raise ValueError("broken plan")
            return plan(proto)

        target._plan = broken
        bad = p.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=7)
        good = [p.submit(**r) for r in requests(4)]
        with pytest.raises(GenerationError, match="broken plan"):
            bad.result(timeout=30)
        for fut, r in zip(good, requests(4)):
            assert fut.result(timeout=30).token_ids == target_alone.submit(**r).result(timeout=30).token_ids
