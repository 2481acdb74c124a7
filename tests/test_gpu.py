"""Stages on a GPU (`device: cuda`): the pipeline still equals the target alone, token for token.

Every stage of a chain on one shared GPU, in one process (`LocalPipeline`): the toy Llamas (2 and 3
stages) and a small LLaVA with a DREAM drafter (the target's features handed over on the GPU), greedy
and coupled sampling, against the target alone on the same GPU. Then what leaves a stage from a GPU:
q rows (rejection sampling) and features over gRPC links (through the codec), and a drafter on the
CPU beside a target on the GPU (each stage moves what it receives to its own device).

Compiled, in bf16 (what GPU users run): the stages' forwards replay CUDA graphs (one per cache and width), and the
pipeline's answers are bitwise the compiled target alone's, greedy and seeded.

Every test here is marked `gpu`: skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipespec import LocalPipeline
from pipespec.config import PipelineConfig, StageSpec
from pipespec.schema.kinds import ModelOptions, kind_of
from pipespec.stages.causal_lm import CausalLMStage
from pipespec.stages.cuda_graphs import GraphedStep
from pipespec.stages.packed_forwards import PackedForwards
from tests.fixtures.exactness import (
    assert_same,
    image_requests,
    run_all,
    sampling_cases,
    text_chain,
    text_pipeline,
    vlm_chain,
)
from tests.fixtures.toy_models import prompt_ids

pytestmark = pytest.mark.gpu

CHAINS = {2: ["tiny", "target"], 3: ["tiny", "mid", "target"]}
NEW_TOKENS = 16
REJECTION = {"verify": "rejection"}


@pytest.fixture(scope="module")
def loaded(family):
    """The toy Llamas, each loaded once on the GPU (fp32) and shared by every pipeline here."""
    return {
        name: CausalLMStage(StageSpec(name, "causal_lm", family[name], dtype="float32", device="cuda"))
        for name in ("tiny", "mid", "target")
    }


@pytest.fixture(scope="module")
def toy_device() -> str:
    """The shared `reference` and `target_model` (tests/conftest.py) on the GPU too."""
    return "cuda"


@pytest.fixture(scope="module")
def prompts(family):
    return prompt_ids(family["target"], 8, length=12, seed=7)


def generate_kwargs(params) -> dict:
    return dict(
        max_new_tokens=NEW_TOKENS, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed
    )


def assert_equals_target_alone(pipe, reference, prompts, target_model) -> None:
    """Greedy and coupled sampling: every prompt equals the target alone; some drafts were accepted."""
    accepted = 0
    for params in sampling_cases():
        kw = generate_kwargs(params)
        futures = [(q, pipe.submit(prompt_token_ids=q, **kw), reference.submit(prompt_token_ids=q, **kw)) for q in prompts]
        for q, got, want in futures:
            got = got.result()
            assert_same(got.token_ids, want.result().token_ids, q, params, target_model)
            accepted += sum(pair.num_accepted_tokens for pair in got.stats.pairs)
    assert accepted > 0, "no draft was ever accepted: acceptance went untested"


def on_cpu(config: PipelineConfig, name: str) -> PipelineConfig:
    """`config` with stage `name` on the CPU."""
    stages = tuple(replace(s, device="cpu", resources={"num_cpus": 1}) if s.name == name else s for s in config.stages)
    return replace(config, stages=stages)


# ---- every stage on one GPU ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_text_chains_on_one_gpu_equal_the_target_alone(k, family, loaded, prompts, reference, target_model):
    assert all(next(loaded[n].model.parameters()).device.type == "cuda" for n in CHAINS[k])
    with text_pipeline(family, loaded, CHAINS[k], device="cuda") as p:
        assert_equals_target_alone(p, reference, prompts, target_model)


@pytest.fixture(scope="module")
def image_reference(llava_dream_zoo):
    with LocalPipeline(vlm_chain(llava_dream_zoo, ["target"], device="cuda")) as p:
        return [g.token_ids for g in run_all(p, image_requests())]


@pytest.mark.parametrize("names", [["dream", "target"], ["tiny", "dream", "target"]], ids=["k2", "k3"])
def test_dream_chains_on_one_gpu_equal_the_target_alone(llava_dream_zoo, image_reference, names):
    with LocalPipeline(vlm_chain(llava_dream_zoo, names, device="cuda")) as p:
        assert [stage.device for stage in p.stages] == [torch.device("cuda", torch.cuda.current_device())] * len(names)
        generations = run_all(p, image_requests())
    assert [g.token_ids for g in generations] == image_reference
    pairs = [pair for g in generations for pair in g.stats.pairs if pair.verifier == "target"]
    assert sum(pair.num_draft_tokens for pair in pairs) > 0  # the target verified the dream stage's drafts


# ---- what leaves a stage on the GPU -------------------------------------------------------------------


def test_features_cross_grpc_links_from_the_gpu(llava_dream_zoo, image_reference):
    """The target's features (bf16, on the GPU) are framed by the codec and land on the DREAM stage's GPU."""
    with LocalPipeline(vlm_chain(llava_dream_zoo, ["tiny", "dream", "target"], device="cuda"), over_grpc=True) as p:
        assert [g.token_ids for g in run_all(p, image_requests()[:4])] == image_reference[:4]


@pytest.mark.parametrize("over_grpc", [False, True], ids=["in-process", "grpc"])
def test_q_rows_leave_the_gpu(family, loaded, prompts, over_grpc):
    """Rejection sampling ships each drafter's q rows (on the GPU) to its verifier; the output's
    distribution is the target's (tests/test_rejection_chain.py), here it must just run through."""
    with text_pipeline(family, loaded, CHAINS[3], device="cuda", sampling=REJECTION, over_grpc=over_grpc) as p:
        futures = [
            p.submit(prompt_token_ids=q, max_new_tokens=NEW_TOKENS, temperature=0.8, seed=i) for i, q in enumerate(prompts)
        ]
        generations = [f.result() for f in futures]
    assert all(g.finish_reason in ("length", "stop") and g.token_ids for g in generations)
    assert sum(pair.num_draft_tokens for g in generations for pair in g.stats.pairs) > 0


# ---- a drafter on the CPU, its verifier on the GPU --------------------------------------------------


def test_a_cpu_drafter_before_a_gpu_target(family, loaded, prompts, reference, target_model):
    stages = [CausalLMStage(StageSpec("tiny", "causal_lm", family["tiny"], dtype="float32")), loaded["target"]]
    with LocalPipeline(on_cpu(text_chain(family, CHAINS[2], device="cuda"), "tiny"), stages=stages) as p:
        assert_equals_target_alone(p, reference, prompts[:4], target_model)
    rejection = on_cpu(text_chain(family, CHAINS[2], device="cuda", sampling=REJECTION), "tiny")
    with LocalPipeline(rejection, stages=stages) as p:  # the drafter's q rows, on the CPU, reach the GPU
        outs = [p.generate(prompt_token_ids=q, max_new_tokens=NEW_TOKENS, temperature=0.8, seed=1) for q in prompts[:4]]
    assert all(o.token_ids for o in outs)


def test_a_cpu_dream_drafter_reads_a_gpu_targets_features(llava_dream_zoo, image_reference):
    config = on_cpu(vlm_chain(llava_dream_zoo, ["dream", "target"], device="cuda"), "dream")
    with LocalPipeline(config) as p:
        assert [stage.device.type for stage in p.stages] == ["cpu", "cuda"]
        assert [g.token_ids for g in run_all(p, image_requests()[:4])] == image_reference[:4]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_block_invariant_logits_on_the_gpu(tmp_path_factory, dtype, compiled):
    """A position's logits on the GPU are bitwise those of one token alone, whatever its block (every
    forward `max_width` wide there: pipespec.stages.forwards), eager and compiled with CUDA graphs."""
    from pipespec.schema.kinds import ModelOptions
    from tests.test_forwards import _llama, logits_in_blocks

    path = _llama(tmp_path_factory.mktemp("wide"), 1024, 2)
    options = ModelOptions(compile=compiled)
    stage = CausalLMStage(StageSpec("target", "causal_lm", path, dtype=dtype, device="cuda", options=options))
    assert stage.shapes.widths == (8,)
    alone = logits_in_blocks(stage, [1])
    for sizes in ([2], [3, 1], [5, 8], [8]):
        assert torch.equal(logits_in_blocks(stage, sizes), alone), sizes


# ---- compiled, in bf16: CUDA graphs, and exact ----------------------------------------------------------


def compiled_bf16(config: PipelineConfig) -> PipelineConfig:
    """`config` in bf16, every stage that takes ModelOptions (or a kind's subclass of them) compiled."""
    stages = tuple(
        replace(s, dtype="bfloat16", options=replace(s.options or options(), compile=True))
        if (options := kind_of(s).options) is not None and issubclass(options, ModelOptions)
        else replace(s, dtype="bfloat16")
        for s in config.stages
    )
    return replace(config, stages=stages)


def assert_replays_graphs(pipe: LocalPipeline) -> None:
    """Every compiled stage replays CUDA graphs, captured once per cache of its pool and width used."""
    for stage in pipe.stages:
        if hasattr(stage, "forwards"):
            forwards = stage.forwards  # a model stage's packed forwards keep their graphs beside their compiled step
            graphed = forwards.graphs if isinstance(forwards, PackedForwards) else forwards.step
            assert isinstance(graphed, GraphedStep), stage.name
            assert graphed.captured >= stage.caches.made, stage.name


def test_compiled_bf16_text_chains_replay_cuda_graphs_and_equal_the_target_alone(family, prompts):
    cases = [generate_kwargs(params) for params in sampling_cases()]
    with LocalPipeline(compiled_bf16(text_chain(family, ["target"], device="cuda"))) as alone:
        want = [[alone.generate(prompt_token_ids=q, **kw).token_ids for q in prompts] for kw in cases]
        assert_replays_graphs(alone)
    for names in CHAINS.values():
        with LocalPipeline(compiled_bf16(text_chain(family, names, device="cuda"))) as p:
            futures = [[p.submit(prompt_token_ids=q, **kw) for q in prompts] for kw in cases]  # requests in flight together
            got = [[f.result().token_ids for f in row] for row in futures]
            assert max(stage.caches.made for stage in p.stages) > 1  # several caches, each its own graphs
            assert_replays_graphs(p)
        assert got == want, names


def test_compiled_bf16_dream_chain_equals_the_target_alone(llava_dream_zoo):
    with LocalPipeline(compiled_bf16(vlm_chain(llava_dream_zoo, ["target"], device="cuda"))) as p:
        want = [g.token_ids for g in run_all(p, image_requests())]
    with LocalPipeline(compiled_bf16(vlm_chain(llava_dream_zoo, ["tiny", "dream", "target"], device="cuda"))) as p:
        assert [g.token_ids for g in run_all(p, image_requests())] == want
        assert_replays_graphs(p)
