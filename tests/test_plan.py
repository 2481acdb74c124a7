"""`pipespec plan`: the profile measures what mock stages emulate, and the plan picks the chain the model favours."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
import yaml

from pipespec.cli import main
from pipespec.config import load_config
from pipespec.engine.handoff import FeaturedVerifier as _FeaturedVerifier
from pipespec.errors import ConfigError
from pipespec.planning import profiling
from pipespec.planning.analytical import (
    PlacedChain,
    chain_rates,
    chain_rates_with_verify_cost,
    client_rate,
    forward_latency,
    sync_rate,
    sync_speedup,
)
from pipespec.planning.placement import Devices, label, on_devices, placements
from pipespec.planning.plan import (
    FEWER_STAGES,
    LOOKAHEADS,
    TIE,
    TRIAL_TIE,
    Trial,
    auto,
    candidate_config,
    contenders,
    explain,
    format_plan,
    recommend,
    recommended_config,
    tree_shape,
    tried,
    with_trees,
)
from pipespec.planning.profiling import PairProfile, Profile, Requests, StageProfile, profile
from pipespec.protocol.messages import PrefillFeatures, RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.tree_shape import TreeShape

VOCAB = 64


def mock_raw(**stages: dict) -> dict:
    """A mock pipeline config, stages upstream first (keyword order), the last one the target."""
    return {"name": "plan-test", "stages": [{"name": n, "kind": "mock", "vocab_size": VOCAB, **o} for n, o in stages.items()]}


# ---- profiling --------------------------------------------------------------------------------------


def test_profile_measures_the_emulated_latencies():
    raw = mock_raw(tiny={"latency_ms": 2, "agreement": 0.8}, target={"latency_ms": 15, "per_token_ms": 1})
    prof = profile(raw, prompts=["a b c"], max_new_tokens=12, verify_tokens=8, repeats=5)
    tiny, target = prof.stages
    for measured, expected in [(tiny.forward_s, 0.002), (target.forward_s, 0.016), (target.verify_s, 0.023)]:
        assert expected <= measured <= expected * 1.5 + 0.01, (measured, expected)  # sleeps only overshoot
    assert target.verify_tokens == 8
    timed = prof.requests  # the target alone in the runtime: 12 tokens, 11 of them after its first delta
    assert timed.tokens == (12,) and 0 < timed.first_s[0] < timed.seconds[0]
    assert target.forward_s * 0.9 <= timed.step_s <= target.forward_s * 1.5 + 0.01
    assert prof.host_s == max(0.0, timed.step_s - target.forward_s)
    assert tiny.forward_s * 0.9 <= tiny.step_s <= tiny.forward_s * 1.5 + 0.01  # the drafter alone in the runtime too
    assert tiny.host_s == max(0.0, tiny.step_s - tiny.forward_s) and target.step_s is None  # the target's: prof.requests


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores and Linux")
def test_the_profile_runs_pinned_to_a_devices_cores_and_lets_go_after(monkeypatch):
    allowed = os.sched_getaffinity(0)
    seen = []

    def spy(name):
        measure = getattr(profiling, name)

        def spied(*args, **kwargs):
            seen.append(os.sched_getaffinity(0))  # this thread's cores while it measures
            return measure(*args, **kwargs)

        monkeypatch.setattr(profiling, name, spied)

    for name in ("time_forwards", "_time_requests", "_profile_pair"):  # forwards, the runtime's requests, pairs
        spy(name)
    raw = mock_raw(tiny={"latency_ms": 1}, target={"latency_ms": 2})
    profile(raw, prompts=["a b c"], max_new_tokens=10, verify_tokens=4, repeats=2, torch_threads=1)
    assert len(seen) >= 5 and all(cores == {min(allowed)} for cores in seen)  # one device's thread: one core
    assert os.sched_getaffinity(0) == allowed
    seen.clear()
    # torch's own threads (None): not pinned
    profile(raw, prompts=["a b c"], max_new_tokens=10, verify_tokens=4, repeats=2, torch_threads=None)
    assert seen and all(cores == allowed for cores in seen)


def test_the_target_alone_is_predicted_as_it_was_timed_in_the_runtime_and_the_chains_as_a_client_sees_them():
    prof, raw = synthetic({"tiny": (1, 1), "target": (10, 10)}, {("tiny", "target"): 0.8})
    timed = Requests(tokens=(40, 5), first_s=(0.06, 0.05), seconds=(0.06 + 39 * 0.013, 0.05 + 4 * 0.013))
    measured = replace(prof, requests=timed)
    assert measured.host_s == pytest.approx(0.003)  # 13 ms a token in the runtime, 10 for the forward alone
    plan, untimed = recommend(measured, load_config(raw)), recommend(prof, load_config(raw))
    assert plan.target_tokens_per_s == pytest.approx(timed.tokens_per_s)
    chain = next(c for c in plan.chains if c.stages == ("tiny", "target"))
    decoding = PlacedChain(
        [0.001, 0.013], [0.001, 0.013], 8, [0.8], chain.windows, (0, 1)
    ).rate()  # the host cost on the target only
    assert chain.tokens_per_s == pytest.approx(client_rate(decoding, timed.tokens, timed.first_s))
    untimed_chain = next(c for c in untimed.chains if c.stages == ("tiny", "target") and c.lookaheads == chain.lookaheads)
    assert chain.tokens_per_s < untimed_chain.tokens_per_s * 0.9


@pytest.mark.parametrize("devices", [None, Devices(1, 2)])  # a device each, or one shared (synchronous there)
def test_a_drafters_step_is_its_forward_and_what_the_runtime_added_to_it_alone(devices):
    prof, raw = synthetic({"tiny": (1, 2), "target": (10, 12)}, {("tiny", "target"): 0.8})
    timed = replace(prof, stages=(replace(prof.stages[0], step_s=0.0025), prof.stages[1]))
    assert timed.stages[0].host_s == pytest.approx(0.0015)
    assert replace(prof.stages[0], step_s=0.0005).host_s == 0.0  # never below 0
    plan = recommend(timed, load_config(raw), devices)
    chain = next(c for c in plan.chains if c.stages == ("tiny", "target"))
    placement = (0, 1) if len(chain.placement) == 2 else (0, 0)  # the devices of tiny and target
    rate = PlacedChain([0.0025, 0.010], [0.0035, 0.012], 8, [0.8], chain.windows, placement).rate()  # 1.5 ms on each step
    assert chain.tokens_per_s == pytest.approx(rate)
    untimed = next(c for c in recommend(prof, load_config(raw), devices).chains if c.stages == ("tiny", "target"))
    assert chain.tokens_per_s < untimed.tokens_per_s
    (sync,) = plan.synchronous  # synchronous speculation pays it too, as the one-device candidate does
    gamma = sync.lookaheads[0]
    assert sync.tokens_per_s == pytest.approx(sync_rate(0.8, gamma, 0.0025, forward_latency(0.010, 0.012, 8, gamma + 1)))


def test_profile_measures_acceptance_as_the_mocks_agree():
    """Per-token alpha of each pair is the drafter's agreement with the stage after it: a mock drafter
    is built for the chain it would sit in (tiny -> target gives 0.8, not tiny's 0.8 x mid's 0.9)."""
    raw = mock_raw(tiny={"agreement": 0.8}, mid={"agreement": 0.9}, target={})
    prompts = ["the first prompt", "another one", "and a third", "one more to be sure"]
    prof = profile(raw, prompts=prompts, max_new_tokens=200, gamma=4)
    assert [p.skipped for p in prof.pairs] == [None, None, None]
    for drafter, verifier, want in [("tiny", "mid", 0.8), ("mid", "target", 0.9), ("tiny", "target", 0.8)]:
        got = prof.alpha(drafter, verifier)
        assert got == pytest.approx(want, abs=0.04), (drafter, verifier, got)
    pair = next(p for p in prof.pairs if p.drafter == "tiny" and p.verifier == "mid")
    assert pair.num_draft_tokens > 500 and 0 < pair.num_accepted_tokens < pair.num_draft_tokens


def test_a_stage_that_cannot_run_alone_is_not_timed_alone(llava_dream_zoo):
    """Cut from its chain, a DREAM stage would be a target: no config, so the profile times no step of it alone."""
    from pipespec.planning.profiling import _drafter_step_s, sub_config

    stages = [{"name": n, "kind": k, "model": llava_dream_zoo[n]} for n, k in (("dream", "dream"), ("target", "vlm"))]
    config = load_config({"stages": stages})
    with pytest.raises(ConfigError, match="a dream drafter cannot be the target"):
        sub_config(config, [0])
    assert _drafter_step_s(config, 0, None, ["a"], 8, 1) is None


def test_a_dream_verifier_gets_the_target_features_of_the_context_it_holds():
    """Outside a pipeline a DREAM verifier is fed the target's hidden states of every context position
    before its drafts, re-fed after a rollback, never twice."""

    class Target:
        name, vocab_size = "target", 8

        def open(self, request):
            return Session(request.prompt_token_ids, self)

    class Dream(Target):
        name = "dream"

    class Session:
        def __init__(self, prompt, stage):
            self.context, self.prompt_len, self.last_prompt_token = list(prompt[:-1]), len(prompt), prompt[-1]
            self.features, self.hidden = [], None
            zeros = torch.zeros(len(prompt) - 1, 2)
            self.prefill_features = PrefillFeatures(zeros, zeros, torch.zeros(len(prompt) - 1, dtype=torch.bool))

        def add_features(self, features):
            got = None if features.hidden is None else [int(h[0]) for h in features.hidden.float()]
            self.features.append((features.start, got))

        def forward(self, keep, tokens):
            del self.context[keep:]
            self.context.extend(tokens)
            self.hidden = torch.tensor([[float(t), 0.0] for t in tokens])  # "features" that name their token
            return torch.zeros(len(tokens), 8)

        def close(self):
            self.context = []

    spec = RequestSpec("r", (1, 2, 3), SamplingParams(), 8)
    session = _FeaturedVerifier(Dream(), Target()).open(spec)
    dream = session.dream
    assert dream.features == [(0, None)]  # the prefill
    session.forward(2, [3])
    session.forward(3, [4, 5, 6])
    assert dream.features[1:] == [(2, [3])]
    session.forward(4, [7])  # rollback: keep 4, 5 dropped
    assert dream.features[2:] == [(3, [4])]
    session.forward(4, [6])  # another rollback to the same place: nothing new for the target
    session.forward(3, [5])  # rollback before what the target fed
    session.forward(4, [1])
    assert dream.features[3:] == [(3, [5])]
    assert session.target.context == [1, 2, 3, 5]


def test_plan_profiles_a_text_drafter_a_dream_drafter_and_a_vlm_target(llava_dream_zoo, tmp_path):
    from PIL import Image

    picture = tmp_path / "picture.png"
    Image.fromarray((torch.rand(30, 40, 3) * 255).to(torch.uint8).numpy()).save(picture)
    kinds = {"tiny": "causal_lm", "dream": "dream", "target": "vlm"}
    raw = {
        "name": "zoo",
        "stages": [{"name": n, "kind": k, "model": llava_dream_zoo[n], "dtype": "float32"} for n, k in kinds.items()],
    }
    prof = profile(raw, prompts=["describe the picture"], image=str(picture), max_new_tokens=12)
    assert prof.image == str(picture) and [s.kind for s in prof.stages] == list(kinds.values())
    assert all(0 < s.forward_s < 1 and 0 < s.verify_s < 1 for s in prof.stages)
    assert [(p.drafter, p.verifier, p.skipped) for p in prof.pairs] == [
        ("tiny", "dream", None),  # the DREAM stage verifies with the target's features beside it
        ("tiny", "target", None),
        ("dream", "target", None),
    ]
    assert all(0 <= p.alpha <= 1 and p.num_draft_tokens > 0 for p in prof.pairs)
    tiny, dream, _ = prof.stages  # the text drafter timed alone in the runtime; a DREAM stage cannot run alone
    assert tiny.step_s is not None and tiny.step_s > 0 and dream.step_s is None and dream.host_s == 0.0
    plan = recommend(prof, load_config(raw))
    assert len(plan.chains) == 4
    assert recommended_config(load_config(raw), plan).stages[-1].name == "target"


# ---- the analytical helpers --------------------------------------------------------------------------


def test_flat_verify_costs_give_the_plain_chain_model_and_costly_ones_less():
    lat, alphas, windows = [0.001, 0.005, 0.04], [0.9, 0.8], [4, 8]
    assert chain_rates_with_verify_cost(lat, lat, 8, alphas, windows) == pytest.approx(chain_rates(lat, alphas, windows))
    costly = chain_rates_with_verify_cost(lat, [0.001, 0.006, 0.06], 8, alphas, windows)
    assert costly[-1] < chain_rates(lat, alphas, windows)[-1] * 0.9
    assert sync_rate(0.7, 4, 0.002, 0.04) == pytest.approx(sync_speedup(0.7, 4, 0.05) / 0.04)


# ---- recommendation ------------------------------------------------------------------------------------


def synthetic(latencies_ms: dict[str, tuple[float, float]], alphas: dict[tuple[str, str], float]) -> tuple[Profile, dict]:
    """A profile measured elsewhere: per stage (1-token, 8-token) ms, per pair alpha."""
    stages = tuple(StageProfile(n, "mock", a / 1e3, b / 1e3, 8) for n, (a, b) in latencies_ms.items())
    pairs = tuple(PairProfile(d, v, a) for (d, v), a in alphas.items())
    return Profile("synthetic", stages, pairs, ("p",), None, 64, 4), mock_raw(**{n: {} for n in latencies_ms})


def test_fast_agreeable_drafters_make_a_three_stage_chain():
    prof, raw = synthetic(
        {"tiny": (1, 1), "mid": (5, 5), "target": (40, 40)},
        {("tiny", "mid"): 0.9, ("tiny", "target"): 0.81, ("mid", "target"): 0.9},
    )
    plan = recommend(prof, load_config(raw))
    assert plan.recommended.stages == ("tiny", "mid", "target")
    two = max(c.tokens_per_s for c in plan.chains if len(c.stages) == 2)
    assert plan.recommended.tokens_per_s > two * (1 + FEWER_STAGES)
    assert plan.recommended.speedup == pytest.approx(plan.recommended.tokens_per_s * 0.040)
    assert len(plan.chains) == 4 and {c.stages for c in plan.synchronous} == {("mid", "target"), ("tiny", "target")}
    assert all(w == max(1, la // 2) for w, la in zip(plan.recommended.windows, plan.recommended.lookaheads))


def test_a_slow_drafter_is_left_out_for_the_cheap_one():
    prof, raw = synthetic(
        {"cheap": (2, 2), "slow": (35, 35), "target": (40, 40)},
        {("cheap", "slow"): 0.7, ("cheap", "target"): 0.7, ("slow", "target"): 0.5},
    )
    plan = recommend(prof, load_config(raw))
    assert plan.recommended.stages == ("cheap", "target")


def test_a_drafter_that_gains_less_than_the_margin_leaves_the_target_alone():
    prof, raw = synthetic({"slow": (38, 38), "target": (40, 40)}, {("slow", "target"): 0.1})
    plan = recommend(prof, load_config(raw))
    chain = next(c for c in plan.chains if c.stages == ("slow", "target"))
    # its drafts would add 1%, but through its rejections it supplies less than the target makes alone
    assert chain.speedup == pytest.approx(1.0)  # not worth a device
    assert plan.recommended.stages == ("target",) and plan.recommended.lookaheads == ()
    assert plan.recommended.speedup == pytest.approx(1.0)


@pytest.mark.parametrize("verify_ms, stages", [(40, ("d", "target")), (160, ("target",))])
def test_a_costly_verification_can_make_the_target_alone_best(verify_ms, stages):
    prof, raw = synthetic({"d": (5, 5), "target": (40, verify_ms)}, {("d", "target"): 0.4})
    assert recommend(prof, load_config(raw)).recommended.stages == stages


def test_the_smallest_lookahead_within_a_hair_of_the_best_wins():
    """A fast drafter: every longer window adds a little; a lookahead within TIE of the best is enough."""
    prof, raw = synthetic({"d": (1, 1), "target": (40, 40)}, {("d", "target"): 0.6})
    plan = recommend(prof, load_config(raw))
    (chosen,) = plan.recommended.lookaheads
    assert chosen < max(LOOKAHEADS)
    lat, alphas = [0.001, 0.040], [0.6]
    best = max(chain_rates(lat, alphas, [max(1, la // 2)])[-1] for la in LOOKAHEADS)
    assert best * (1 - TIE) <= plan.recommended.tokens_per_s < best
    assert all(chain_rates(lat, alphas, [max(1, la // 2)])[-1] < best * (1 - TIE) for la in LOOKAHEADS if la < chosen)


def test_chains_through_an_unmeasured_pair_are_not_candidates():
    prof, raw = synthetic(
        {"tiny": (1, 1), "mid": (5, 5), "target": (40, 40)},
        {("tiny", "mid"): None, ("tiny", "target"): 0.81, ("mid", "target"): 0.9},
    )
    raw["stages"][1]["relay_above"] = 1  # mid relays where it is in the middle
    plan = recommend(prof, load_config(raw))
    assert ("tiny", "mid", "target") not in [c.stages for c in plan.chains]
    assert plan.recommended.stages == ("mid", "target")
    assert recommended_config(load_config(raw), plan).stages[0].relay_above is None  # first there: it relays nothing


def test_the_recommended_config_drops_unused_stages_and_sets_lookaheads():
    prof, raw = synthetic(
        {"cheap": (2, 2), "slow": (35, 35), "target": (40, 40)},
        {("cheap", "slow"): 0.7, ("cheap", "target"): 0.7, ("slow", "target"): 0.5},
    )
    raw["stages"][0]["agreement"] = 0.7
    plan = recommend(prof, load_config(raw))
    config = recommended_config(load_config(raw), plan)
    assert [s.name for s in config.stages] == ["cheap", "target"]
    assert config.stages[0].max_lookahead == plan.recommended.lookaheads[0]
    assert config.stages[0].options.agreement == 0.7
    assert config.window(1) == plan.recommended.windows[0]


# ---- placements -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages, devices, count", [(1, 4, 1), (3, 1, 1), (3, 2, 4), (3, 3, 5), (4, 2, 8), (4, 4, 15)])
def test_placements_enumerate_each_grouping_once(stages, devices, count):
    """Set partitions of the stages into at most `devices` blocks (Stirling numbers summed; Bell numbers)."""
    got = placements(stages, devices)
    groupings = {frozenset(frozenset(i for i, d in enumerate(p) if d == dev) for dev in set(p)) for p in got}
    assert len(got) == len(groupings) == count
    assert all(max(p) < devices and p[0] == 0 for p in got)
    if devices >= stages:
        assert got[-1] == tuple(range(stages))  # a device per stage


def test_a_placement_names_its_devices():
    groups = on_devices(("tiny", "dream", "target"), (0, 1, 0))
    assert groups == (("tiny", "target"), ("dream",))
    assert label(groups) == "tiny+target | dream"


def test_devices_split_this_machines_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert Devices.of_this_machine() == Devices(2, 1)
    assert Devices.of_this_machine(1) == Devices(1, 2) and Devices(1, 2).threads == 2
    assert Devices.of_this_machine(3) == Devices(3, 0.66) and Devices(3, 0.66).threads == 1  # 3 x 0.66 <= 2
    with pytest.raises(ValueError, match="at least one device"):
        Devices.of_this_machine(0)


def test_every_chain_is_predicted_on_every_placement_that_fits():
    prof, raw = synthetic(
        {"tiny": (1, 1), "mid": (5, 5), "target": (40, 40)},
        {("tiny", "mid"): 0.9, ("tiny", "target"): 0.81, ("mid", "target"): 0.9},
    )
    plan = recommend(prof, load_config(raw), Devices(2, 1))
    three = {label(c.placement) for c in plan.chains if len(c.stages) == 3}
    assert three == {"tiny+mid+target", "tiny+mid | target", "tiny+target | mid", "tiny | mid+target"}
    assert len(plan.chains) == 1 + 2 * 2 + 4 and all(c.devices <= 2 for c in plan.chains)
    assert plan.recommended.stages == ("tiny", "mid", "target") and plan.recommended.devices == 2
    table = format_plan(plan)
    assert "placement" in table and "tiny+mid | target" in table and "2 devices of 1 core" in table
    assert "why: the fastest of 9 candidates on at most 2 devices; next: " in explain(plan)


def test_on_one_device_a_drafter_and_the_target_predict_synchronous_speculation():
    prof, raw = synthetic({"tiny": (1, 1.5), "target": (40, 48)}, {("tiny", "target"): 0.8})
    plan = recommend(prof, load_config(raw), Devices(1, 2))
    shared = next(c for c in plan.chains if c.stages == ("tiny", "target"))
    (sync,) = plan.synchronous
    assert shared.placement == (("tiny", "target"),) and sync.placement == shared.placement
    if shared.windows == sync.lookaheads:  # the same window: the same formula
        assert shared.tokens_per_s == pytest.approx(sync.tokens_per_s)
    assert shared.tokens_per_s == pytest.approx(sync.tokens_per_s, rel=0.02)  # the grids differ by a window at most
    assert plan.recommended == shared


def test_the_recommended_config_places_the_stages_on_devices():
    prof, raw = synthetic({"tiny": (1, 1), "target": (40, 40)}, {("tiny", "target"): 0.8})
    raw["stages"][0]["device_group"] = "elsewhere"  # the plan's placement replaces the config's
    plan = recommend(prof, load_config(raw), Devices(1, 2))
    config = recommended_config(load_config(raw), plan)
    assert [s.device_group for s in config.stages] == ["tiny+target", "tiny+target"]
    assert config.devices() == ((0, 1),) and all(s.resources == {"num_cpus": 2} for s in config.stages)
    apart = recommended_config(load_config(raw), recommend(prof, load_config(raw), Devices(2, 1)))
    if len(apart.stages) == 2 and len(apart.devices()) == 2:
        assert all(s.device_group is None and s.resources == {"num_cpus": 1} for s in apart.stages)


def test_on_a_near_tie_fewer_devices_win_and_the_plan_says_why():
    """An 8 ms drafter, alpha 0.6, for a 40 ms target: on its own device it is predicted 1.2% faster than
    sharing the target's; within 2%, one device is recommended."""
    prof, raw = synthetic({"d": (8, 8), "target": (40, 40)}, {("d", "target"): 0.6})
    plan = recommend(prof, load_config(raw), Devices(2, 1))
    fastest = plan.chains[0]
    assert fastest.placement == (("d",), ("target",)) and plan.recommended.placement == (("d", "target"),)
    assert plan.recommended.tokens_per_s >= (1 - FEWER_STAGES) * fastest.tokens_per_s
    lines = explain(plan).splitlines()
    assert len(lines) == 2 and lines[0].startswith("recommended: d -> target on 1 device (d+target)")
    assert "on fewer devices" in lines[1] and "d | target" in lines[1]


def test_auto_profiles_quickly_and_returns_the_recommended_config():
    raw = mock_raw(tiny={"agreement": 0.9, "latency_ms": 1}, target={"latency_ms": 10})
    config, plan = auto(raw, Devices(2, 1))
    assert plan.profile.prompts and len(plan.profile.prompts) == 1 and plan.profile.torch_threads == 1
    assert [s.name for s in config.stages] == list(plan.recommended.stages)
    assert len(config.devices()) == plan.recommended.devices
    assert all(s.resources == {"num_cpus": 1} for s in config.stages)


# ---- trials: candidates measured in place (pipespec.cli.trials runs them) ---------------------------


def trial_plan(devices: int = 2, alphas: tuple[float, float, float] = (0.8, 0.5, 0.6)):
    """A plan for a 2 ms tiny drafter, a 7 ms drafter d and a 40 ms target, profiled elsewhere, on `devices` of
    one core; `alphas`: tiny -> d, tiny -> target, d -> target."""
    stages = (StageProfile("tiny", "mock", 0.002, 0.002, 8), StageProfile("d", "mock", 0.007, 0.007, 8))
    stages += (StageProfile("target", "mock", 0.040, 0.040, 8),)
    names = (("tiny", "d"), ("tiny", "target"), ("d", "target"))
    pairs = tuple(PairProfile(a, b, alpha) for (a, b), alpha in zip(names, alphas, strict=True))
    raw = {"name": "trial-test", "stages": [{"name": s.name, "kind": "mock", "vocab_size": 64} for s in stages]}
    return recommend(Profile("synthetic", stages, pairs, ("p",), None, 64, 4), load_config(raw), Devices(devices, 1))


def on(plan, stages: tuple[str, ...], devices: int):
    """The plan's candidate for the chain `stages` on `devices` devices."""
    return next(c for c in plan.chains if c.stages == stages and c.devices == devices)


def test_the_recommended_candidate_the_best_on_each_number_of_devices_the_next_chains_and_the_target_alone_are_tried():
    plan = trial_plan()

    def key(c):
        return c.stages, c.devices

    tried_ones = contenders(plan, 3)
    assert tried_ones[0] == plan.recommended and tried_ones[-1].stages == ("target",)
    assert len(tried_ones) == 4 and len({key(c) for c in tried_ones}) == 4
    other = 3 - plan.recommended.devices  # the fastest predicted on the other number of devices comes next
    assert tried_ones[1] == max((c for c in plan.chains if c.devices == other), key=lambda c: c.tokens_per_s)
    untried = (c for c in plan.chains if key(c) not in {key(t) for t in tried_ones[:2]})
    assert tried_ones[2] == max(untried, key=lambda c: c.tokens_per_s)  # a drafter's pair, here also the fastest untried
    three = trial_plan(3)  # the three fastest predicted are on 2, 1 and 1 devices: 3 devices get tried all the same
    assert [c.devices for c in three.chains[:3]] == [2, 1, 1]
    assert {c.devices for c in contenders(three, 3)} == {1, 2, 3}
    assert {c.devices for c in plan.chains if c.stages == plan.recommended.stages} == {1, 2}
    assert on(plan, plan.recommended.stages, 3 - plan.recommended.devices) in contenders(plan, 10)  # the other device count
    every = contenders(plan, 100)  # no more than the chains there are, each on each number of devices once
    assert len(every) == len({key(c) for c in plan.chains})
    unplaced = replace(plan, chains=tuple(c for c in plan.chains if len(c.stages) > 1))  # no target-alone config
    assert all(len(c.stages) > 1 for c in contenders(unplaced, 3))
    with pytest.raises(ValueError, match="no trials"):
        tried(plan, ())


def test_the_chain_of_greatest_speedup_tried_is_tried_again_with_draft_trees_of_the_targets_width_and_calibration():
    plan = trial_plan()
    plan = replace(
        plan, profile=replace(plan.profile, pairs=(*plan.profile.pairs[:2], replace(plan.profile.pairs[2], temperature=0.7)))
    )
    raw = {"name": "trial-test", "stages": [{"name": n, "kind": "mock", "vocab_size": 64} for n in ("tiny", "d", "target")]}
    tried_ones = contenders(plan, 3)
    trials = [Trial(c, (10.0 + k,), (10.0,)) for k, c in enumerate(tried_ones)]  # the target alone last, the fastest
    (treed,) = with_trees(trials, plan, load_config(raw))
    chained = tried_ones[-2]  # the greatest speedup measured with a drafter
    calibrated = 0.7 if chained.stages[-2] == "d" else 1.0  # the profile fitted d's; tiny's: none (1.0)
    assert treed == replace(chained, tree=TreeShape(budget=7, temperature=calibrated))
    assert treed.chain == " -> ".join(chained.stages) + " (trees)"
    config = candidate_config(load_config(raw), treed, plan.devices)
    assert config.stages[-2].tree == treed.tree and all(s.tree is None for s in config.stages if s is not config.stages[-2])
    with_a_tree = {**raw, "stages": [*raw["stages"][:1], {**raw["stages"][1], "tree": {}}, raw["stages"][2]]}
    assert candidate_config(load_config(with_a_tree), on(plan, ("d", "target"), 1), plan.devices).stages[-2].tree is None
    predrafting = {**raw, "stages": [*raw["stages"][:1], {**raw["stages"][1], "predraft": 2}, raw["stages"][2]]}
    trees_of_d = replace(on(plan, ("d", "target"), 1), tree=TreeShape(budget=7))
    assert candidate_config(load_config(predrafting), trees_of_d, plan.devices).stages[-2].predraft == 0  # offers trees instead
    assert with_trees([t for t in trials if len(t.candidate.stages) == 1], plan, load_config(raw)) == []  # no drafter: no trees


def test_a_target_one_row_wide_is_offered_no_trees(family):
    pair = [{"name": n, "kind": "causal_lm", "model": family[n]} for n in ("tiny", "target")]
    assert tree_shape(trial_plan().profile, load_config({"stages": pair}), "tiny") == TreeShape(budget=7)
    pair[1]["max_width"] = 1
    assert tree_shape(trial_plan().profile, load_config({"stages": pair}), "tiny") is None


def test_every_drafter_s_pair_with_the_target_is_tried_though_ranked_low():
    """d -> target ranks first on both numbers of devices and tiny -> d -> target next; tiny -> target,
    ranked far below, is tried all the same: the model's error depends on the drafter."""
    plan = trial_plan(alphas=(0.2, 0.3, 0.95))
    assert [(c.stages, c.devices) for c in plan.chains[:4]] == [
        (("d", "target"), 2), (("tiny", "d", "target"), 2), (("tiny", "d", "target"), 2), (("d", "target"), 1),
    ]  # fmt: skip
    tried_ones = contenders(plan, 3)
    assert [(c.stages, c.devices) for c in tried_ones] == [
        (("d", "target"), 2), (("d", "target"), 1), (("tiny", "target"), 1), (("target",), 1),
    ]  # fmt: skip
    assert tried_ones[2] == max((c for c in plan.chains if c.stages == ("tiny", "target")), key=lambda c: c.tokens_per_s)
    assert contenders(plan, 4)[3] == on(plan, ("tiny", "d", "target"), 2)  # then the fastest predicted of the rest
    three = trial_plan(3, alphas=(0.2, 0.3, 0.95))  # each number of devices first: a pair only where there is room
    assert ("tiny", "target") not in {c.stages for c in contenders(three, 3)}
    assert ("tiny", "target") in {c.stages for c in contenders(three, 4)}


def test_the_greatest_speedup_measured_is_recommended_and_its_measurement_is_the_prediction():
    """d+target ran while the machine was fast (more tok/s, but less than the target alone beside it)."""
    plan = trial_plan()
    apart, shared, alone = on(plan, ("d", "target"), 2), on(plan, ("d", "target"), 1), on(plan, ("target",), 1)
    trials = (
        Trial(shared, (80.0, 80.0, 80.0), (100.0, 100.0, 100.0)),
        Trial(alone, (30.0, 31.0, 29.0), (40.0, 40.0, 40.0)),
        Trial(apart, (60.0, 62.0, 70.0), (40.0, 40.0, 35.0)),
    )
    result = tried(plan, trials)
    assert result.recommended == apart and result.predicted == 62.0 and result.predicted_speedup == 1.55
    assert [t.candidate for t in result.trials] == [apart, shared, alone]  # the greatest speedup first
    assert result.predicted != apart.tokens_per_s  # the model's figure stays beside it, not as the prediction
    lines = explain(result).splitlines()
    assert lines[0].endswith(
        "62.0 tok/s measured in place, 1.55x the target alone in this process (40.0 tok/s, side by side); "
        f"the model predicted {apart.tokens_per_s:.1f} ({apart.speedup:.2f}x)"
    )
    assert lines[1] == "why: the greatest speedup of 3 tried in place; next: d -> target on d+target, 80.0 tok/s (0.80x)"
    table = format_plan(result)
    assert "tried in place (a local Ray, 3 rounds" in table and "60.0 (40.0) / 62.0 (40.0) / 70.0 (35.0)" in table
    assert f"{apart.tokens_per_s:>10.1f}{62.0:>10.1f}{1.55:>8.2f}x" in table  # the model's prediction beside the measurement


def test_within_the_noise_of_the_greatest_speedup_fewer_devices_win():
    plan = trial_plan()
    apart, shared, alone = on(plan, ("d", "target"), 2), on(plan, ("d", "target"), 1), on(plan, ("target",), 1)
    near = 60.0 * (1 - TRIAL_TIE) + 0.5
    result = tried(plan, (Trial(apart, (60.0,), (30.0,)), Trial(shared, (near,), (30.0,)), Trial(alone, (25.0,), (30.0,))))
    assert result.recommended == shared and result.predicted == near
    why = explain(result).splitlines()[1]
    assert why.startswith(
        f"why: within {TRIAL_TIE:.0%} of the greatest speedup tried (d -> target on d | target"
    ) and why.endswith("on fewer devices")
    result = tried(plan, (Trial(apart, (60.0,), (30.0,)), Trial(shared, (near - 1.0,), (30.0,)), Trial(alone, (25.0,), (30.0,))))
    assert result.recommended == apart


def test_an_untried_plan_predicts_with_the_model():
    plan = trial_plan()
    assert plan.trials == () and plan.predicted == plan.recommended.tokens_per_s
    assert plan.predicted_speedup == plan.recommended.speedup
    assert "tried in place" not in format_plan(plan) and "tok/s predicted" in explain(plan)


# ---- the command line ----------------------------------------------------------------------------------


def test_cli_prints_the_table_and_writes_json_and_a_config_that_loads(tmp_path, capsys):
    raw = mock_raw(tiny={"agreement": 0.9, "latency_ms": 1}, mid={"agreement": 0.9, "latency_ms": 3}, target={"latency_ms": 12})
    path = tmp_path / "mock.yaml"
    path.write_text(yaml.safe_dump(raw))
    out_json, out_yaml = tmp_path / "plan.json", tmp_path / "rec.yaml"
    argv = ["plan", str(path), "--prompt", "one prompt", "--prompt", "two", "--max-new-tokens", "24", "--trials", "0"]
    assert main([*argv, "--json", str(out_json), "--write-config", str(out_yaml)]) == 0
    out = capsys.readouterr().out
    for text in ("1-token fwd", "tiny -> mid", "mid -> target", "recommended:", "sync", "2 prompts x 24 new tokens"):
        assert text in out
    figures = json.loads(out_json.read_text())
    assert [s["name"] for s in figures["profile"]["stages"]] == ["tiny", "mid", "target"]
    assert figures["recommended"]["stages"][-1] == "target" and figures["recommended"]["speedup"] > 1.0
    written = load_config(out_yaml)
    assert [s.name for s in written.stages] == figures["recommended"]["stages"]
    assert [s.max_lookahead for s in written.stages[:-1]] == figures["recommended"]["lookaheads"]


@pytest.mark.parametrize(
    "edit, args, message",
    [
        (lambda raw: raw["stages"][0].update(agreemnt=0.5), [], "agreemnt"),
        (lambda raw: None, ["--image", "no-such-picture.png"], "does not take images"),
        (lambda raw: None, ["--max-new-tokens", "4"], "max_new_tokens"),
        (lambda raw: None, ["--trials", "-1"], "--trials must be 0 or more, got -1"),
    ],
    ids=["unknown-key", "image-for-a-text-target", "too-few-tokens", "negative-trials"],
)
def test_cli_bad_inputs_are_named(tmp_path, capsys, edit, args, message):
    raw = mock_raw(tiny={}, target={})
    edit(raw)
    path = tmp_path / "mock.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_names_a_missing_config_and_a_missing_image(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err
    (tmp_path / "vlm").mkdir()  # a vlm target: the image is checked before anything loads
    path = tmp_path / "vlm.yaml"
    path.write_text(yaml.safe_dump({"stages": [{"name": "target", "kind": "vlm", "model": str(tmp_path / "vlm")}]}))
    assert main(["plan", str(path), "--image", str(tmp_path / "cat.png")]) == 2
    assert "cat.png" in capsys.readouterr().err


def test_cli_plans_for_the_devices_it_is_given(tmp_path, capsys):
    raw = mock_raw(tiny={"agreement": 0.9, "latency_ms": 1}, target={"latency_ms": 10})
    path, out_yaml = tmp_path / "mock.yaml", tmp_path / "rec.yaml"
    path.write_text(yaml.safe_dump(raw))
    argv = ["plan", str(path), "--devices", "1", "--max-new-tokens", "16", "--trials", "0", "--write-config", str(out_yaml)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1 device of" in out and "tiny+target" in out and "why:" in out
    written = load_config(out_yaml)
    assert len(written.devices()) == 1
    assert main(["plan", str(path), "--devices", "0"]) == 2
    assert "at least one device" in capsys.readouterr().err


def test_cli_plans_a_shipped_example_by_name(capsys):
    assert main(["plan", "mock3", "--devices", "1", "--max-new-tokens", "16", "--trials", "0"]) == 0
    assert "pipespec plan: mock3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "mock3", "--devices", "2"], "--plan auto"),
        (["serve", "mock3", "--image", "x.png"], "--plan auto"),
        (["serve", "absent.yaml", "--plan", "auto"], "absent.yaml"),
        (["serve", "mock3", "--plan", "auto", "--devices", "0"], "at least one device"),
        (["demo", "--runs", "0"], "--runs"),
        (["demo", "--plan", "none", "--devices", "2"], "--plan auto"),
        (["demo", "--plan", "auto", "--devices", "-1"], "at least one device"),
    ],
    ids=[
        "serve-devices",
        "serve-image",
        "serve-missing-config",
        "serve-no-device",
        "demo-runs",
        "demo-devices",
        "demo-no-device",
    ],
)
def test_cli_plan_auto_errors_are_named_before_anything_starts(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_plan_takes_auto_only():
    with pytest.raises(SystemExit):
        main(["serve", "mock3", "--plan", "manual"])
