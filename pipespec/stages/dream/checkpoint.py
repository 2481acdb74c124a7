"""A DREAM drafter on disk: its blocks, frozen copies of the target's embedding table and LM head, its tokenizer.

    model_dir/dream_config.json  {"model_type": "pipespec-dream", "dream": DreamConfig, "keep_fraction": 0.75,
                                  "max_position_embeddings": its target's context, ...}
    model_dir/model.safetensors  block weights + "embed.weight" [V, H] + "lm_head.weight" [V, H]
    model_dir/tokenizer*         the target's tokenizer (stages must share it)

Self-contained, so a dream stage loads in its own actor without reading the target's checkpoint. The
config is not named config.json, so Hugging Face loaders (the tokenizer's) do not mistake it for theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipespec.errors import ConfigError
from pipespec.stages.dream.model import DreamConfig, DreamDrafter

MODEL_TYPE = "pipespec-dream"
CONFIG_NAME = "dream_config.json"


@dataclass
class DreamCheckpoint:
    drafter: DreamDrafter
    embed: torch.Tensor  # [V, H] the target's input embedding table (scaled as the target scales it)
    lm_head: torch.Tensor  # [V, H]
    keep_fraction: float  # visual token compression
    meta: dict[str, Any]  # training facts (supervised layer rule, target, steps, ...)
    max_context: int | None = None  # its target's context (max_position_embeddings): the positions a request may use


def init_from_target(target: torch.nn.Module, num_heads: int = 4, keep_fraction: float = 0.75, seed: int = 0) -> DreamCheckpoint:
    """A fresh (untrained) drafter at the target's hidden size, with its embedding table and LM head."""
    embeddings = target.get_input_embeddings()
    embed = embeddings.weight.detach().float() * float(getattr(embeddings, "embed_scale", 1.0))  # Gemma scales
    head = target.get_output_embeddings().weight.detach().float()
    hidden = embed.shape[1]
    config = DreamConfig(hidden_size=hidden, num_heads=num_heads, intermediate_size=2 * hidden, vocab_size=head.shape[0])
    context = getattr(target.config.get_text_config(decoder=True), "max_position_embeddings", None)
    torch.manual_seed(seed)
    return DreamCheckpoint(DreamDrafter(config), embed.clone(), head.clone(), keep_fraction, {}, context)


def save(path: str | Path, ckpt: DreamCheckpoint, tokenizer: Any | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write the checkpoint (weights in `dtype`: float16 for shipping); `load` casts to the stage's dtype."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in ckpt.drafter.state_dict().items()}
    tensors["embed.weight"] = ckpt.embed.detach().to(dtype).contiguous()
    tensors["lm_head.weight"] = ckpt.lm_head.detach().to(dtype).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    config = {"model_type": MODEL_TYPE, "dream": ckpt.drafter.config.to_dict(), "keep_fraction": ckpt.keep_fraction}
    config |= {"max_position_embeddings": ckpt.max_context} if ckpt.max_context is not None else {}
    config |= ckpt.meta
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DreamCheckpoint:
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise ConfigError(f"{str(path)!r} has no {CONFIG_NAME}: not a DREAM drafter checkpoint")
    raw = json.loads(config_file.read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"{str(path)!r} is not a DREAM drafter (model_type {raw.get('model_type')!r}, expected {MODEL_TYPE!r})")
    tensors = load_file(str(path / "model.safetensors"), device=str(device))
    embed, head = tensors.pop("embed.weight"), tensors.pop("lm_head.weight")
    drafter = DreamDrafter(DreamConfig(**raw.pop("dream")))
    drafter.load_state_dict(tensors)
    drafter.to(device=device, dtype=dtype).eval()
    keep = float(raw.pop("keep_fraction", 0.75))
    context = raw.pop("max_position_embeddings", None)
    raw.pop("model_type")
    return DreamCheckpoint(drafter, embed.to(dtype), head.to(dtype), keep, raw, context)
