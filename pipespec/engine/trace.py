"""Where a stage's time goes: a per-step trace of one runner, off by default, cheap enough to leave on.

A runner's wall time is a sequence of steps and the gaps between them. A traced runner records, per
forward, four instants (all `time.perf_counter`, one clock per process):

    planned --dispatch--> started --compute--> ended --handoff--> handled
    (event loop           (compute thread       (compute thread    (event loop has applied
     submits the work)     begins)               returns)           the result)

and the compute thread's CPU seconds over the forward (`time.thread_time`): compute wall time beyond
them is time the thread was runnable but not running (another process or thread had the core).
After `handled` the runner looks for its next work; until it finds some, or from when it found none,
the stage is idle for the reason it gave:

- `waiting`: a verifier holds back for more drafts (pipespec.engine.patience);
- `starved`: a verifier has no drafts and may not or need not step (nothing to verify yet);
- `bounded`: a drafter is at its lookahead bound, or its requests are done, or it has none;
- `device`: its work waits while the device runs another stage's forward (stages sharing one device).

`StageTrace.summary()` adds these up over the traced window, whose length is measured: the seconds in
each bucket, `other` (in none of them: between a result applied and the next look for work, and a
forward already in flight when the window began), the busy fraction (compute / window), and the busy
fraction while drafts were available (the target's steady state: compute over the dispatch, compute
and handoff of verification steps plus the waits while drafts were pending). It also counts the event
loop's seconds spent on this runner (its messages, planning, sending), which overlap the buckets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

IDLE_REASONS = ("waiting", "starved", "bounded", "device")


@dataclass(frozen=True)
class Step:
    """One forward of one stage: its kind, its tokens and its four instants (seconds)."""

    kind: str  # prefill, verify (drafts checked), generate (no drafts)
    drafts: int
    accepted: int
    planned: float
    started: float
    ended: float
    handled: float
    cpu_s: float  # the compute thread's CPU seconds within started..ended
    requests: int = 1  # how many requests the forward carried (a batch: pipespec.engine.stage.BatchingStage)

    @property
    def compute_s(self) -> float:
        return self.ended - self.started


@dataclass(frozen=True)
class Timing:
    """What the compute thread reports of one forward."""

    started: float
    ended: float
    cpu_s: float

    @staticmethod
    def around(fn, *args):
        """Run fn(*args) on this thread; -> (its result, its Timing)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        result = fn(*args)
        c1, t1 = time.thread_time(), time.perf_counter()
        return result, Timing(t0, t1, c1 - c0)


@dataclass
class StageTrace:
    """The trace of one runner; `enabled` False costs one attribute test per event."""

    stage: str
    enabled: bool = False
    steps: list[Step] = field(default_factory=list)
    idle_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(IDLE_REASONS, 0.0))
    pending_idle_s: float = 0.0  # idle seconds while drafts were pending (within `waiting`)
    loop_s: float = 0.0  # event-loop seconds handling this runner's messages
    messages: int = 0
    _idle_since: float | None = None
    _idle_reason: str = "bounded"
    _idle_pending: bool = False
    _began: float = 0.0
    _window_s: float | None = None

    def start(self) -> None:
        """Begin a fresh window."""
        self._began, self._window_s = time.perf_counter(), None
        self.enabled = True
        self.steps, self.idle_s = [], dict.fromkeys(IDLE_REASONS, 0.0)
        self.pending_idle_s = self.loop_s = 0.0
        self.messages = 0
        self._idle_since = None

    def stop(self) -> dict:
        """End the window; -> its summary."""
        now = time.perf_counter()
        self._close_idle(now)
        self._window_s = now - self._began
        self.enabled = False
        return self.summary()

    def idle(self, reason: str, drafts_pending: bool) -> None:
        """The runner looked for work and found none, for `reason` (one of IDLE_REASONS)."""
        now = time.perf_counter()
        self._close_idle(now)
        self._idle_since, self._idle_reason, self._idle_pending = now, reason, drafts_pending

    def planned(self) -> float:
        """Work was submitted: the idle gap before it ends now."""
        now = time.perf_counter()
        self._close_idle(now)
        return now

    def step(self, kind: str, drafts: int, accepted: int, planned: float, timing: Timing, requests: int = 1) -> None:
        now = time.perf_counter()
        self.steps.append(Step(kind, drafts, accepted, planned, timing.started, timing.ended, now, timing.cpu_s, requests))

    def handled(self, seconds: float) -> None:
        self.messages += 1
        self.loop_s += seconds

    def _close_idle(self, now: float) -> None:
        if self._idle_since is not None:
            gap = now - self._idle_since
            self.idle_s[self._idle_reason] += gap
            if self._idle_pending:
                self.pending_idle_s += gap
            self._idle_since = None

    def summary(self) -> dict:
        return summarise(self.stage, self.steps, self.idle_s, self.pending_idle_s, self.loop_s, self.messages, self._window_s)


def summarise(
    stage: str,
    steps: list[Step],
    idle_s: dict[str, float],
    pending_idle_s: float,
    loop_s: float,
    messages: int,
    window_s: float | None = None,
) -> dict:
    """Seconds per bucket and the busy fractions of one stage's traced window (see the module docstring);
    `window_s`: the window's measured length (None: the sum of the buckets)."""
    verify = [s for s in steps if s.kind == "verify"]
    seconds = {
        "prefills": sum(s.kind == "prefill" for s in steps),
        "steps": len(steps),
        "verify_steps": len(verify),
        "generate_steps": sum(s.kind == "generate" for s in steps),
        "drafts": sum(s.drafts for s in verify),
        "accepted": sum(s.accepted for s in verify),
        "compute_s": sum(s.compute_s for s in steps),
        "prefill_compute_s": sum(s.compute_s for s in steps if s.kind == "prefill"),
        "compute_on_cpu_s": sum(min(s.cpu_s, s.compute_s) for s in steps),
        "dispatch_s": sum(s.started - s.planned for s in steps),
        "handoff_s": sum(s.handled - s.ended for s in steps),
        **{f"idle_{reason}_s": seconds for reason, seconds in idle_s.items()},
        "loop_s": loop_s,
        "messages": messages,
        "verify_compute_s": sum(s.compute_s for s in verify),
        "with_drafts_s": sum(s.handled - s.planned for s in verify) + pending_idle_s,
        "window_s": window_s or 0.0,
    }
    return {"stage": stage, **seconds, **_derived(seconds)}


def decode_step_s(summary: dict) -> float:
    """A stage's mean decode step in a summary: its forward and the host work the runtime adds to it
    (dispatch to the compute thread, handoff of the result to the event loop; prefills' included).
    ValueError for a window without a decode step."""
    steps = summary["steps"] - summary["prefills"]
    if steps < 1:
        raise ValueError(f"stage {summary['stage']!r} took no decode step in this window")
    decode = summary["compute_s"] - summary["prefill_compute_s"] + summary["dispatch_s"] + summary["handoff_s"]
    return decode / steps


def combine(summaries: list[dict]) -> dict:
    """Several windows of one stage (e.g. one per run) as one."""
    additive = [k for k, v in summaries[0].items() if isinstance(v, (int, float)) and k not in DERIVED]
    seconds = {k: sum(s[k] for s in summaries) for k in additive}
    return {"stage": summaries[0]["stage"], **seconds, **_derived(seconds)}


DERIVED = ("wall_s", "other_s", "busy", "busy_with_drafts", "mean_drafts", "mean_accepted")


def _derived(s: dict) -> dict:
    buckets = s["dispatch_s"] + s["compute_s"] + s["handoff_s"] + sum(s[f"idle_{r}_s"] for r in IDLE_REASONS)
    wall = s["window_s"] or buckets
    verify = s["verify_steps"]
    return {
        "wall_s": wall,
        "other_s": max(wall - buckets, 0.0),  # in no bucket: applying results and sending, between steps
        "busy": s["compute_s"] / wall if wall else 0.0,
        "busy_with_drafts": s["verify_compute_s"] / s["with_drafts_s"] if s["with_drafts_s"] else 0.0,
        "mean_drafts": s["drafts"] / verify if verify else 0.0,
        "mean_accepted": s["accepted"] / verify if verify else 0.0,
    }


def table(summaries: list[dict]) -> str:
    """The summaries as a markdown table: per stage, ms per step and the share of its wall time per bucket."""
    head = (
        "| stage | steps | verify | drafts/acc. | compute (ms per decode step) | on CPU | dispatch | handoff | waiting | starved "
        "| bounded | device | other | busy w/ drafts | loop ms/msg |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        steps = s["steps"] or 1
        decode = (s["steps"] - s["prefills"]) or 1
        share = {k: f"{100 * s[k] / (s['wall_s'] or 1.0):.0f}%" for k in s if k.endswith("_s")}
        lines.append(
            f"| {s['stage']} | {s['steps']} | {s['verify_steps']} | {s['mean_drafts']:.1f}/{s['mean_accepted']:.1f} "
            f"| {share['compute_s']} ({1e3 * (s['compute_s'] - s['prefill_compute_s']) / decode:.1f} ms) | {100 * s['compute_on_cpu_s'] / (s['compute_s'] or 1):.0f}% "
            f"| {share['dispatch_s']} ({1e3 * s['dispatch_s'] / steps:.2f} ms) | {share['handoff_s']} ({1e3 * s['handoff_s'] / steps:.2f} ms) "
            f"| {share['idle_waiting_s']} | {share['idle_starved_s']} | {share['idle_bounded_s']} | {share['idle_device_s']} "
            f"| {share['other_s']} "
            f"| {100 * s['busy_with_drafts']:.0f}% | {1e3 * s['loop_s'] / (s['messages'] or 1):.2f} |"
        )
    return "\n".join(lines)
