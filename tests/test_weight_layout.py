"""fp32 linear weights on a CPU stored column-major (pipespec.stages.weight_layout): same matrices, same answers."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipespec.config import StageSpec
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.causal_lm import CausalLMStage
from pipespec.stages.weight_layout import column_major


def _llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_every_linear_is_column_major_with_its_values():
    model = _llama(tied=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    column_major(model)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert module.weight.t().is_contiguous() and module.weight.stride(0) == 1, name
    after = dict(model.named_parameters(remove_duplicate=False))
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert model.model.embed_tokens.weight.is_contiguous()  # the tied table keeps its rows
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_half_precision_weights_keep_their_layout():
    model = _llama(tied=False).to(torch.bfloat16)
    column_major(model)
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_a_stage_answers_as_its_model_does(tmp_path):
    """The stage (column-major weights) gives the logits Hugging Face's own forward gives, up to fp32 rounding,
    and its greedy continuation is the model's."""
    model = _llama(tied=False)
    model.save_pretrained(tmp_path)
    stage = CausalLMStage(StageSpec("target", "causal_lm", str(tmp_path), dtype="float32"))
    assert stage.model.model.layers[0].mlp.up_proj.weight.stride(0) == 1
    prompt = (5, 9, 13, 21, 34)
    session = stage.open(RequestSpec("r", prompt, SamplingParams(), max_new_tokens=4))
    logits = session.forward(len(prompt) - 1, [prompt[-1], 7, 8])  # [3, V]
    with torch.no_grad():
        expected = model(torch.tensor([[*prompt, 7, 8]])).logits[0, -3:]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
