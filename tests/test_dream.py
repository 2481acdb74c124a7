"""The DREAM drafter: masks from positions, compression, its stage in a 3-stage pipeline, exactness.

The pipeline tests use small random VLMs (`tests.fixtures.vlm_zoo`) and an untrained drafter whose gates
are opened (so the memory matters); correctness does not depend on the drafter's quality.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipespec import LocalPipeline, load_config
from pipespec.config import ConfigError
from pipespec.stages.dream.compression import kept_positions
from pipespec.stages.dream.model import DreamConfig, DreamDrafter
from tests.fixtures.exactness import IMAGES, PROMPTS, image_requests, run_all, vlm_chain

CONFIG = DreamConfig(hidden_size=32, num_heads=4, intermediate_size=64, vocab_size=50)


def drafter(cross_attention: bool = True, seed: int = 0) -> DreamDrafter:
    torch.manual_seed(seed)
    model = DreamDrafter(DreamConfig(**{**CONFIG.to_dict(), "cross_attention": cross_attention})).eval()
    if cross_attention:
        with torch.no_grad():
            model.block1.attn_gate.fill_(1.0)
            model.block1.mlp_gate.fill_(1.0)
    return model


# ---- masks from positions -------------------------------------------------------------------------


@pytest.mark.parametrize("cross_attention", [True, False])
def test_a_query_never_sees_its_own_or_a_later_feature(cross_attention):
    model = drafter(cross_attention)
    positions = torch.tensor([0, 1, 2, 5, 6, 7])  # 3 and 4 dropped (compression): gaps are fine
    inputs = torch.randn(1, 6, 32)
    memory, memory_positions = torch.randn(1, 6, 32), positions.clone()
    with torch.no_grad():
        f, _ = model(inputs, positions, memory, memory_positions)
        for j in range(6):
            changed = memory.clone()
            changed[0, j] += 5.0
            g, _ = model(inputs, positions, changed, memory_positions)
            moved = (g - f).abs().amax(-1)[0] > 1e-6  # [6]
            for i in range(6):
                if memory_positions[j] >= positions[i]:
                    assert not moved[i], (j, i)  # own or later feature: invisible
            after = positions > memory_positions[j]
            if cross_attention:
                assert moved[after].all(), j  # every later query attends to it
            else:
                nxt = int(after.nonzero()[0]) if after.any() else None  # only the next query reads it
                assert nxt is None or moved[nxt], j


def test_masks_follow_positions_not_offsets():
    """The same entries in another order give the same features."""
    model = drafter()
    positions = torch.tensor([0, 1, 2, 3])
    inputs, memory = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    perm = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        f, _ = model(inputs, positions, memory, positions)
        g, _ = model(inputs, positions, memory[:, perm], positions[perm])
    torch.testing.assert_close(f, g)


def test_cached_steps_equal_one_forward():
    model = drafter()
    positions = torch.tensor([0, 1, 3, 4, 5])
    inputs, memory = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    with torch.no_grad():
        full, _ = model(inputs, positions, memory, positions)
        caches = model.new_caches(capacity=8)
        first, _ = model(inputs[:, :3], positions[:3], memory, positions, caches)
        model(inputs[:, 3:], positions[3:] + 10, memory, positions, caches)  # a wrong continuation, then rolled back
        caches.keep_before(4)  # positions 0, 1 and 3
        rest = [model(inputs[:, i : i + 1], positions[i : i + 1], memory, positions, caches)[0] for i in (3, 4)]
        assert caches.end() == 6 and int(caches.block0.length) == 5
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-5, atol=1e-5)


def test_a_packed_forward_of_several_requests_equals_each_alone():
    """`forward_packed` (a dream stage's batched step): each request's rows over its own caches and memory, the
    products over all of them; a request's features are its own forward's, and its caches end as they would."""
    from pipespec.stages.dream.model import Memory

    model = drafter()
    rng = torch.Generator().manual_seed(1)
    requests = []
    for n_cached, n_new in ((3, 1), (0, 4), (5, 2)):
        memory = torch.randn(1, 8, 32, generator=rng)
        requests.append((torch.randn(1, n_cached + n_new, 32, generator=rng), n_cached, memory))
    with torch.no_grad():
        alone, packed_caches, rows, spans, offset = [], [], [], [], 0
        for inputs, n_cached, memory in requests:
            positions, kv = torch.arange(inputs.shape[1]), model.block1.project(memory)
            caches, other = model.new_caches(capacity=8), model.new_caches(capacity=8)
            for c in (caches, other) if n_cached else ():
                model(inputs[:, :n_cached], positions[:n_cached], None, torch.arange(8), c, kv)
            alone.append(model(inputs[:, n_cached:], positions[n_cached:], None, torch.arange(8), caches, kv)[0][0])
            rows.append((inputs[0, n_cached:], positions[n_cached:]))
            n = inputs.shape[1] - n_cached
            spans.append((slice(offset, offset + n), other, Memory(kv, torch.arange(8), torch.ones(8, dtype=torch.bool))))
            packed_caches.append((caches, other))
            offset += n
        inputs = torch.cat([x for x, _ in rows])[None]
        f = model.forward_packed(inputs, torch.cat([p for _, p in rows]), spans)[0]
    for want, (span, _, _), (caches, other) in zip(alone, spans, packed_caches):
        torch.testing.assert_close(f[span], want, rtol=1e-5, atol=1e-5)
        assert int(other.block0.length) == int(caches.block0.length) and other.end() == caches.end()


@pytest.mark.parametrize("cross_attention", [True, False])
def test_the_fixed_capacity_memory_equals_the_held_entries_alone(cross_attention):
    """FeatureMemory keeps each entry (and its keys and values, projected when stored) at its position; a
    step over the whole buffer, the entries not held masked, equals one over the held entries alone."""
    from pipespec.stages.dream.stage import FeatureMemory

    model = drafter(cross_attention)
    positions = torch.tensor([0, 1, 3, 4, 5])
    inputs, memory = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    project = model.block1.project if cross_attention else None
    store = FeatureMemory(model.config, 8, torch.device("cpu"), torch.float32, project)
    with torch.no_grad():
        store.put_own(torch.tensor([4, 5, 6]), torch.cat([memory[0, 3:], torch.randn(1, 32)]))  # out of order, own first
        assert store.put_target([0, 1, 3, 4], memory[0, :4]) == 4  # replaces own 4 with the target's
        store.drop_own_from(5)  # drops own 5 and 6
        store.put_own(torch.tensor([4, 5]), torch.cat([torch.randn(1, 32), memory[0, 4:]]))  # 4 stays the target's
    assert store.held_positions() == [0, 1, 3, 4, 5] and store.from_target(4) and not store.from_target(5)
    with pytest.raises(ValueError, match="position 8 is past the dream stage's 8 positions"):
        store.put_target([8], memory[0, :1])
    with torch.no_grad():
        f, _ = model(inputs, positions, memory, positions)
        kv = (store.kv[0][None], store.kv[1][None]) if cross_attention else None
        g, _ = model(inputs, positions, store.features[None], store.positions, memory_kv=kv, memory_held=store.held)
    torch.testing.assert_close(g, f, rtol=1e-5, atol=1e-5)


def test_closed_gates_ignore_the_memory():
    """Gates start at 0 (tanh): a fresh drafter's output does not depend on the memory."""
    torch.manual_seed(0)
    model = DreamDrafter(CONFIG).eval()
    positions = torch.arange(4)
    inputs = torch.randn(1, 4, 32)
    with torch.no_grad():
        f, _ = model(inputs, positions, torch.randn(1, 4, 32), positions)
        g, _ = model(inputs, positions, torch.randn(1, 4, 32), positions)
    torch.testing.assert_close(f, g)


# ---- compression ----------------------------------------------------------------------------------


def test_compression_keeps_the_most_attended_image_tokens():
    image = torch.tensor([False, True, True, True, True, False, False])
    attention = torch.tensor([9.0, 0.1, 0.5, 0.3, 0.9, 0.0, 0.0])
    assert kept_positions(image, attention, 0.5).tolist() == [True, False, True, False, True, True, True]
    assert kept_positions(image, attention, 0.75).tolist() == [True, False, True, True, True, True, True]
    assert kept_positions(image, attention, 1.0).all()
    assert kept_positions(image, None, 0.5).all()


def test_the_intermediate_regression_does_not_depend_on_the_residual_streams_scale():
    """Mid-layer residual streams run 5-18x the post-norm last hidden state: the first block regresses
    onto the selected layer RMS-normalised, so scaling that layer changes nothing in the loss."""
    from training.features import SequenceFeatures
    from training.loss import sequence_loss
    from training.variants import Variant

    torch.manual_seed(0)
    T, P, H, V, L = 12, 5, CONFIG.hidden_size, CONFIG.vocab_size, 4
    layers = torch.randn(L, T, H)

    def features(scale: float) -> SequenceFeatures:
        g = torch.Generator().manual_seed(1)
        return SequenceFeatures(
            ids=torch.randint(0, V, (T,), generator=g),
            prompt_len=P,
            embeddings=torch.randn(T, H, generator=g),
            hidden=torch.randn(T, H, generator=g),
            logits=torch.randn(T, V, generator=g),
            layer_hidden=layers * scale,
            entropy=torch.rand(L - 1, T, generator=g),
            candidates=tuple(range(L - 1)),
            image_mask=torch.zeros(T, dtype=torch.bool),
            attention_received=torch.rand(P - 1, generator=g),
        )

    head = torch.randn(V, H)
    for variant in (Variant("dream"), Variant("layer_50", layer=0.5)):
        _, small = sequence_loss(drafter(), features(1.0), head, variant)
        _, large = sequence_loss(drafter(), features(20.0), head, variant)
        assert small["intermediate"] == pytest.approx(large["intermediate"], rel=1e-5)
        assert small["intermediate"] < 1.0  # on the unit scale, not in SmoothL1's linear regime


# ---- the stage in a pipeline ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def world(request, tmp_path_factory):
    """A zoo family plus an untrained DREAM drafter for its target (gates opened), saved to disk."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from pipespec.stages.dream.checkpoint import init_from_target, save
    from tests.fixtures.vlm_zoo import build_zoo_family

    root = tmp_path_factory.mktemp("dream")
    paths = {k: str(v) for k, v in build_zoo_family(request.param, root / request.param).items()}
    target = AutoModelForImageTextToText.from_pretrained(paths["target"])
    ckpt = init_from_target(target, keep_fraction=0.75)
    with torch.no_grad():
        ckpt.drafter.block1.attn_gate.fill_(0.5)
        ckpt.drafter.block1.mlp_gate.fill_(0.5)
    paths["dream"] = str(save(root / "dream", ckpt, AutoTokenizer.from_pretrained(paths["target"])))
    return paths


@pytest.fixture(scope="module")
def reference(world):
    with LocalPipeline(vlm_chain(world, ["target"])) as p:
        return [g.token_ids for g in run_all(p, image_requests())]


@pytest.mark.parametrize("names", [["dream", "target"], ["tiny", "dream", "target"]], ids=["k2", "k3"])
def test_dream_pipeline_equals_the_target_alone(world, reference, names):
    with LocalPipeline(vlm_chain(world, names)) as p:
        generations = run_all(p, image_requests())
    assert [g.token_ids for g in generations] == reference
    pairs = [pair for g in generations for pair in g.stats.pairs if pair.verifier == "target"]
    assert sum(p.num_draft_tokens for p in pairs) > 0  # the target verified the dream stage's drafts


def test_a_dream_drafter_offers_trees_the_target_checks(world, reference):
    """DREAM right before the target offers its drafts' siblings (its `tree` section), over real gRPC streams; the
    target checks trees of them, and DREAM reads the target's features of each path it took."""
    stages = [
        {
            "name": "dream",
            "kind": "dream",
            "model": world["dream"],
            "max_lookahead": 4,
            "dtype": "float32",
            "tree": {"budget": 6, "branching": 3},
        },
        {"name": "target", "kind": "vlm", "model": world["target"], "dtype": "float32"},
    ]
    with LocalPipeline(load_config({"stages": stages}), over_grpc=True) as p:
        target = p.stages[-1]
        run, trees = target.forward_batch, []
        target.forward_batch = lambda feeds: trees.extend(f.nodes.tree for f in feeds if f.nodes) or run(feeds)
        try:
            generations = run_all(p, image_requests())
        finally:
            del target.forward_batch
    assert [g.token_ids for g in generations] == reference
    assert any(len(set(tree.parents)) < len(tree) for tree in trees)  # some had siblings beside the line


def test_dream_pipeline_over_grpc(world, reference):
    """Features travel as bf16-exact tensors over real gRPC streams."""
    with LocalPipeline(vlm_chain(world, ["tiny", "dream", "target"]), over_grpc=True) as p:
        assert [g.token_ids for g in run_all(p, image_requests()[:2])] == reference[:2]


def test_dream_session_keeps_memory_and_inputs_consistent(world):
    """Compression drops the same image positions from the inputs and from the memory."""
    with LocalPipeline(vlm_chain(world, ["dream", "target"])) as p:
        spec, _ = p.request(PROMPTS[0], image=IMAGES[0], max_new_tokens=4)
        dream, target = p.stages
    from pipespec.protocol.messages import TargetFeatures

    t = target.open(spec)
    target.taps.last_attention.keep_weights = False
    d = dream.open(spec)
    d.add_features(TargetFeatures(spec.request_id, 0, prefill=t.prefill_features))
    P = len(spec.prompt_token_ids)
    image = t.prefill_features.image_mask
    d.forward(P - 1, [spec.prompt_token_ids[-1]])
    kept_prompt = set(d.kept.nonzero().squeeze(-1).tolist())
    assert len(kept_prompt) == P - 1 - int(image.sum()) + int(np.ceil(0.75 * int(image.sum())))
    block0 = d.state.caches.block0
    cached = set(block0.positions[: int(block0.length)].tolist())
    in_memory = set(d.state.memory.held_positions())
    assert cached == kept_prompt | {P - 1}
    assert in_memory == cached  # the prompt's target features, plus our own f at P - 1
    assert not d.state.memory.from_target(P - 1)  # our own feature
    t.close()
    d.close()


def test_compiled_dream_forwards_draft_what_eager_ones_do(world):
    """Compiled (each width once, at the stage's start), the stage's logits are the eager stage's: over the
    prefill, blocks of several widths, a rollback, and target features that replace own ones already
    read (a recompute), on a state a longer request used and gave back."""
    from pipespec.protocol.messages import TargetFeatures
    from pipespec.schema.kinds import DreamOptions
    from pipespec.stages.dream.checkpoint import load
    from pipespec.stages.dream.stage import DreamStage

    with LocalPipeline(vlm_chain(world, ["dream", "target"])) as p:
        spec, _ = p.request(PROMPTS[0], image=IMAGES[0], max_new_tokens=12)
        dream, target = p.stages
    t = target.open(spec)
    prefill = TargetFeatures(spec.request_id, 0, prefill=t.prefill_features)
    P, H = len(spec.prompt_token_ids), t.prefill_features.hidden.shape[1]
    verified = TargetFeatures(spec.request_id, P - 1, hidden=torch.randn(3, H, generator=torch.Generator().manual_seed(0)))
    t.close()

    def drafted(compiled: bool) -> list[torch.Tensor]:
        ckpt = load(world["dream"])
        options = DreamOptions(compile=compiled, max_width=4, refresh=True)
        stage = DreamStage("dream", ckpt, dream.vocab_size, dream.fit.valid, options)
        assert stage.forwards.compiled == compiled and stage.shapes.widths == (1, 2, 4)
        longer = stage.open(spec)
        longer.add_features(prefill)
        longer.forward(P - 1, [spec.prompt_token_ids[-1], *range(5, 16)])
        used = longer.state
        longer.close()
        session = stage.open(spec)
        assert session.state is used  # reused: the longer request's entries still in place
        session.add_features(prefill)
        rows = [session.forward(P - 1, [spec.prompt_token_ids[-1]]), session.forward(P, [5, 6, 7])]
        rows.append(session.forward(P, [8]))  # [5, 6, 7] rejected
        session.add_features(verified)  # the target's features for P - 1 .. P + 1, over own ones read since
        rows += [session.forward(P + 1, [9, 10]), session.forward(P + 3, [11, 12, 13, 14, 15])]  # a recompute; two pieces
        session.close()
        return rows

    for eager, compiled in zip(drafted(False), drafted(True), strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("refresh", [True, False])
def test_a_target_feature_over_an_own_one_already_read_is_fed_again_only_with_refresh(world, refresh):
    from pipespec.protocol.messages import TargetFeatures
    from pipespec.schema.kinds import DreamOptions
    from pipespec.stages.dream.checkpoint import load
    from pipespec.stages.dream.stage import DreamStage

    with LocalPipeline(vlm_chain(world, ["dream", "target"])) as p:
        spec, _ = p.request(PROMPTS[0], image=IMAGES[0], max_new_tokens=12)
        dream, target = p.stages
    t = target.open(spec)
    P, H = len(spec.prompt_token_ids), t.prefill_features.hidden.shape[1]
    stage = DreamStage("dream", load(world["dream"]), dream.vocab_size, dream.fit.valid, DreamOptions(refresh=refresh))
    feeds = []
    forwards = stage.forwards
    stage.forwards = lambda cache, keep, tokens: feeds.append((keep, len(tokens))) or forwards(cache, keep, tokens)
    session = stage.open(spec)
    session.add_features(TargetFeatures(spec.request_id, 0, prefill=t.prefill_features))
    t.close()
    session.forward(P - 1, [spec.prompt_token_ids[-1]])
    session.forward(P, [5, 6])  # own features at P - 1 .. P + 1, read by P and P + 1
    session.add_features(TargetFeatures(spec.request_id, P - 1, hidden=torch.randn(2, H)))  # the target's at P - 1, P
    session.forward(P + 2, [7])
    assert feeds[-1] == ((P, 3) if refresh else (P + 2, 1))  # again from P (the first to read P - 1), or only the new token
    session.close()


def test_a_dream_stage_must_sit_right_before_a_vlm_target(world):
    with pytest.raises(ConfigError, match="must come right before a vlm target"):
        vlm_chain(world, ["dream", "tiny", "target"])


# ---- training ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(world):
    from pipespec.config import StageSpec
    from pipespec.requests.images import load_processor
    from pipespec.stages.vlm import VLMStage
    from training.data import examples_for, noise_samples

    stage = VLMStage(StageSpec("target", "vlm", world["target"], dtype="float32"))
    examples = examples_for(stage, load_processor(world["target"], "target"), noise_samples("train", 3, 0), 12)
    return stage, examples


def test_target_features_and_entropy_selection(trainer):
    from training.features import FeatureExtractor

    stage, examples = trainer
    ex = examples[0]
    feats = FeatureExtractor(stage)(list(ex.prompt_ids), list(ex.answer_ids), stage.tensors(ex.image))
    T = len(ex.prompt_ids) + len(ex.answer_ids)
    assert feats.hidden.shape == (T, stage.model.get_input_embeddings().embedding_dim)
    assert feats.entropy.shape == (len(feats.candidates), T) and torch.isfinite(feats.entropy).all()
    assert (feats.entropy >= 0).all()
    chosen = feats.supervision(None)
    best = torch.tensor(feats.candidates)[feats.entropy.argmin(0)]
    for t in (0, T // 2, T - 1):
        torch.testing.assert_close(chosen[t], feats.layer_hidden[best[t], t])
    torch.testing.assert_close(feats.supervision(1.0), feats.layer_hidden[-1])
    # the features match what the pipeline's target session computes at prefill
    session = stage.open(__import__("pipespec.protocol.messages", fromlist=["RequestSpec"]).RequestSpec(
        "r", ex.prompt_ids, __import__("pipespec.protocol.params", fromlist=["SamplingParams"]).SamplingParams(), 4, image=ex.image
    ))  # fmt: skip
    P = len(ex.prompt_ids)
    torch.testing.assert_close(session.prefill_features.hidden, feats.hidden[: P - 1], rtol=1e-4, atol=1e-4)
    session.close()


@pytest.mark.parametrize("variant", ["dream", "no_cross_attention", "compression_0.5", "layer_50"])
def test_training_loss_falls_on_a_small_fixed_batch(trainer, variant):
    from training.evaluation import mean_acceptance_length
    from training.loop import train
    from training.variants import VARIANTS

    stage, examples = trainer
    chosen = next(v for v in VARIANTS if v.name == variant)
    ckpt, curve = train(stage, examples, chosen, steps=40, lr=3e-3, progress=False)
    assert np.mean(curve[-8:]) < 0.7 * np.mean(curve[:8]), (curve[:8], curve[-8:])
    # a drafter trained on this example drafts it: every round gains well over the target's one token
    assert mean_acceptance_length(stage, ckpt, examples[:1]) > 2.0


def test_every_fast_parameter_name_matches_a_cross_attention_parameter():
    """A rename must not silently drop the gates or the q/k scales back to the slow learning rate."""
    from training.loop import FAST_PARAMETERS

    names = [n for n, _ in drafter().named_parameters()]
    for suffix in FAST_PARAMETERS:
        assert any(n.endswith(suffix) for n in names), (suffix, names)
    assert not any(n.endswith(FAST_PARAMETERS) for n, _ in drafter(cross_attention=False).named_parameters())


def test_synchronous_speculation_with_a_dream_drafter_equals_the_target_alone(world, reference):
    from pipespec.engine.synchronous import generate_sync

    pipe = LocalPipeline(vlm_chain(world, ["dream", "target"]))  # never started: its stages and front door
    dream, target = pipe.stages
    for r, expected in list(zip(image_requests(), reference))[:4]:
        r = dict(r)
        spec, _ = pipe.request(r.pop("prompt"), max_new_tokens=16, **r)
        result = generate_sync(target, spec, dream, gamma=3)
        assert result.token_ids == expected
        assert result.pair.num_draft_tokens > 0


def test_synchronous_trees_with_a_dream_drafter_equal_the_target_alone(world, reference):
    """A DREAM drafter grows trees by its own forwards (its line, pipespec.engine.tree_drafting.LineExpander) and
    gets the target's features of each accepted path; the target verifies each tree in one forward."""
    from pipespec.engine.synchronous import generate_sync
    from pipespec.protocol.tree_shape import TreeShape

    pipe = LocalPipeline(vlm_chain(world, ["dream", "target"]))  # never started: its stages and front door
    dream, target = pipe.stages
    for r, expected in list(zip(image_requests(), reference))[:4]:
        r = dict(r)
        spec, _ = pipe.request(r.pop("prompt"), max_new_tokens=16, **r)
        result = generate_sync(target, spec, dream, tree=TreeShape(budget=5, depth=3, branching=2))
        assert result.token_ids == expected
        assert result.pair.num_draft_tokens > 0
