"""The demo target's picture path (demo/tower.py, demo/train.py's build_target): what the tower learnt
reaches the projector through the real serving path.

A tower is pretrained on the fly for a few dozen steps, saved in half precision with its processor,
loaded back through `pipespec.requests.images.load_processor` and the `vlm` stage, and asked about fresh
pictures: the projector's input, captured by a hook, must be read by the pretraining's own heads as
well as the tower's training output was (each patch's colour). That catches a recipe that feeds
another layer than the one pretrained, normalises pictures differently at serving time or loses the
features to the dtype.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from demo.tower import DenseProbe, cell_labels, cell_of_patches, pretrain_tower
from demo.train import IMAGE_SIZE, PATCH, build_target, load_tokenizer
from demo.world import random_scene, render
from tests.fixtures import DEMO_MODELS as MODELS

STEPS = 100  # in fp32: about a minute here, and the probe reads 0.62 of the colours (bf16 autocast: 16x slower a step)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[Path, DenseProbe, float]:
    """A target whose tower is pretrained for STEPS steps, saved as the recipe saves it; -> (directory,
    probe, colour accuracy of the probe on the patches of the tower's own last states)."""
    torch.manual_seed(0)
    model, processor = build_target(load_tokenizer(MODELS), seed=0)
    # no time budget: STEPS steps whatever the machine's speed
    tower, image_processor = model.model.vision_tower, processor.image_processor
    _, probe = pretrain_tower(tower, image_processor, IMAGE_SIZE, PATCH, math.inf, STEPS, seed=0)
    scenes = fresh_scenes(seed=11)
    with torch.no_grad():
        pixels = processor.image_processor(images=[render(s, IMAGE_SIZE) for s in scenes], return_tensors="pt")["pixel_values"]
        states = model.model.vision_tower(pixel_values=pixels).last_hidden_state  # [B, 1 + N, H]
    colour = colour_accuracy(probe, states[:, 1:], scenes)
    out = tmp_path_factory.mktemp("target")
    model.to(torch.float16).save_pretrained(out)
    processor.save_pretrained(out)
    return out, probe, colour


def fresh_scenes(seed: int, n: int = 48) -> list:
    rng = np.random.default_rng(seed)
    return [random_scene(rng) for _ in range(n)]


def colour_accuracy(probe: DenseProbe, patches: torch.Tensor, scenes: list) -> float:
    """patches [B, N, H] -> the probe's colour accuracy over the patches of cells holding a shape."""
    cells = torch.stack([cell_labels(s)[cell_of_patches(IMAGE_SIZE // PATCH)] for s in scenes])  # [B, N, 4]
    with torch.no_grad():
        colour = probe.cell[1](patches.float()).argmax(-1)  # [B, N]
    shaped = cells[..., 1] > 0
    return (colour == cells[..., 1])[shaped].float().mean().item()


def served_projector_input(model_dir: Path, scene) -> torch.Tensor:
    """[N, H] what the `vlm` stage's model feeds its projector for `scene`'s picture, through the
    serving path: the saved processor via pipespec.requests.images, the chat template, the stage's prefill."""
    from pipespec.protocol.messages import RequestSpec
    from pipespec.protocol.params import SamplingParams
    from pipespec.requests.chat import ChatMessage, Part
    from pipespec.requests.images import encode_image_prompt, load_processor

    stage = served_stage(str(model_dir))
    processor = load_processor(str(model_dir), "test")
    messages = (ChatMessage("user", (Part(image=True), Part(text="Describe the image."))),)
    prompt = encode_image_prompt(processor, messages, render(scene, IMAGE_SIZE))
    seen: list[torch.Tensor] = []
    hook = stage.model.model.multi_modal_projector.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    try:
        stage.open(RequestSpec("r", prompt.prompt_token_ids, SamplingParams(), 4, image=prompt.image))
    finally:
        hook.remove()
    return seen[0][0].float()


@functools.cache
def served_stage(model_dir: str):
    from pipespec.config import StageSpec
    from pipespec.stages.vlm import VLMStage

    return VLMStage(StageSpec("target", "vlm", model_dir, dtype="float32"))


def test_the_projector_receives_what_the_tower_learnt(pretrained):
    model_dir, probe, trained_colour = pretrained
    assert trained_colour > 0.5  # the few steps taught it something to pass on
    scenes = fresh_scenes(seed=11)
    patches = torch.stack([served_projector_input(model_dir, s) for s in scenes])  # [B, N, H]
    assert patches.shape[1] == (IMAGE_SIZE // PATCH) ** 2  # the patches; the recipe drops the class token
    assert colour_accuracy(probe, patches, scenes) >= trained_colour - 0.02
