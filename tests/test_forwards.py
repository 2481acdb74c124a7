"""A position's logits do not depend on the block it is computed in (pipespec.stages.forwards).

On a model wide enough to show the difference (2 layers at hidden 1024: before static caches and
fixed widths, a 5-token block's logits in bf16 were up to 0.016 away from one-token decoding), the
target's logits for each generated position are bitwise equal whether it was fed alone or inside a
block of any width, at any offset, after rollbacks, in fp32, bf16 and fp16; and on the compiled path.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipespec.config import StageSpec
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.schema.kinds import ModelOptions
from pipespec.stages.causal_lm import CausalLMStage
from pipespec.stages.forwards import Shapes

PROMPT = tuple(range(3, 15))
TOKENS = [(17 * i + 5) % 500 + 3 for i in range(20)]  # the generated tokens, fed after the prompt


def _llama(path, hidden: int, layers: int) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=128,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    return _llama(tmp_path_factory.mktemp("wide"), 1024, 2)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    return _llama(tmp_path_factory.mktemp("small"), 128, 2)


def logits_in_blocks(stage: CausalLMStage, sizes: list[int]) -> torch.Tensor:
    """The logits of every generated position, fed in blocks of `sizes` (cycled), each block after a
    wrong one of the same size that is rolled back. -> [len(TOKENS) + 1, V]"""
    session = stage.open(RequestSpec("r", PROMPT, SamplingParams(), max_new_tokens=len(TOKENS) + 1))
    feed = [PROMPT[-1], *TOKENS]
    keep, rows = len(PROMPT) - 1, []
    for size in itertools.cycle(sizes):
        block = feed[keep - len(PROMPT) + 1 :][:size]
        if not block:
            return torch.cat(rows)
        session.forward(keep, [7] * len(block))  # a rejected draft: its keys stay in the cache, masked
        rows.append(session.forward(keep, block))
        keep += len(block)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_positions_logits_do_not_depend_on_its_block(wide, dtype):
    stage = CausalLMStage(StageSpec("target", "causal_lm", wide, dtype=dtype))
    alone = logits_in_blocks(stage, [1])
    for width in range(2, 9):
        for sizes in ([width], [width, 1], [width - 1, width]):
            inside = logits_in_blocks(stage, sizes)
            difference = (inside - alone).abs().max().item()
            assert torch.equal(inside, alone), f"{dtype}, blocks of {sizes}: logits differ by up to {difference}"


def test_compiled_forwards_keep_it(small):
    """Compiled (each width once, at the stage's start), blocks still give the same logits as one token alone."""
    spec = StageSpec("target", "causal_lm", small, dtype="float32", options=ModelOptions(compile=True, max_width=4))
    stage = CausalLMStage(spec)
    assert stage.forwards.compiled and stage.shapes.widths == (4,) and stage.forwards.warmup_s > 0
    alone = logits_in_blocks(stage, [1])
    for sizes in ([2], [3, 4], [4, 1]):
        assert torch.equal(logits_in_blocks(stage, sizes), alone), sizes


def test_shapes():
    cpu = torch.device("cpu")
    assert Shapes.of(ModelOptions(), 512, cpu, target=True) == Shapes(512, (4, 8))
    assert Shapes.of(ModelOptions(min_width=1), 512, cpu, target=True).widths == (1, 2, 4, 8)
    assert Shapes.of(ModelOptions(), 512, cpu, target=False).widths == (1, 2, 4, 8)  # a drafter
    assert Shapes.of(ModelOptions(max_context=64), None, cpu, target=True).capacity == 64 + 3 * 8  # and a tree's room
    assert Shapes.of(ModelOptions(), 512, torch.device("cuda"), target=True).widths == (8,)
    shapes = Shapes(100, (4, 8))
    assert shapes.pieces(3) == [(0, 3, 4)]
    assert shapes.pieces(13) == [(0, 8, 8), (8, 5, 8)]


def test_a_request_past_the_stage_context_is_refused(small):
    stage = CausalLMStage(StageSpec("target", "causal_lm", small, dtype="float32", options=ModelOptions(max_context=16)))
    session = stage.open(RequestSpec("r", PROMPT, SamplingParams(), max_new_tokens=4))
    session.forward(len(PROMPT) - 1, [PROMPT[-1], 5, 6, 7, 8])  # 16 context tokens: the whole context
    with pytest.raises(ValueError, match="17 context tokens exceed its max_context of 16"):
        session.forward(16, [9])


def test_a_reused_cache_gives_the_same_logits(small):
    """A request on a cache a longer request filled and gave back (its old entries still in place, past
    the new request's length) gets the logits it got on its own cache."""
    stage = CausalLMStage(StageSpec("target", "causal_lm", small, dtype="float32"))
    first = stage.open(RequestSpec("r", PROMPT, SamplingParams(), max_new_tokens=len(TOKENS) + 1))
    want = first.forward(len(PROMPT) - 1, [PROMPT[-1], *TOKENS[:3]])
    longer = stage.open(RequestSpec("long", PROMPT[::-1], SamplingParams(), max_new_tokens=len(TOKENS) + 1))
    longer.forward(len(PROMPT) - 1, [PROMPT[0], *TOKENS[::-1]])
    cache = longer.cache
    longer.close()
    again = stage.open(RequestSpec("again", PROMPT, SamplingParams(), max_new_tokens=len(TOKENS) + 1))
    assert again.cache is cache
    assert torch.equal(again.forward(len(PROMPT) - 1, [PROMPT[-1], *TOKENS[:3]]), want)
    first.close()
    again.close()
    assert stage.caches.made == 2  # `first` took the warm-up's cache back, `longer` made one, `again` took it back
