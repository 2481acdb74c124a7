"""Where a stage computes: its config's `device` made a `torch.device`, checked when the stage is built.

`cpu`; `cuda:N`, the N-th GPU this process sees; or `cuda`, the current CUDA device of the process
building the stage. A Ray actor given `num_gpus` sees only the GPUs Ray assigned it (Ray sets
CUDA_VISIBLE_DEVICES), so there `cuda` is the actor's own GPU. The index is fixed here, once: the
compute thread that later runs the forwards has a current device of its own, and every tensor a
stage creates must land where its weights are.

The kinds that run a model (causal_lm, vlm, dream) build through here and keep the model and every
tensor they create on the device; their logits may stay there. What leaves a stage's process goes
through the codec, which moves tensors to the CPU (pipespec.protocol.codec); what a stage receives (a
drafter's q rows, its target's features) it moves to its own device before use.
"""

from __future__ import annotations

import os

import torch

from pipespec.errors import ConfigError

GIB = 2**30
KV_SHARE = 0.25  # of a device's memory, a stage's KV caches by default (`ModelOptions.kv_budget_gib`)


def kv_budget(device: torch.device, gib: float | None) -> int:
    """A stage's KV cache budget in bytes: `gib` GiB, or by default a quarter of its device's memory (a
    GPU's, or this machine's for the CPU)."""
    if gib is not None:
        return int(gib * GIB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(KV_SHARE * total)


def stage_device(stage: str, device: str) -> torch.device:
    """The torch device of stage `stage` for its config's `device` (cpu, cuda or cuda:N).

    A CUDA device this process cannot use is a ConfigError naming the stage and the device."""
    resolved = torch.device(device)
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible to this process"
        raise ConfigError(
            f"stage {stage!r}: device {device!r} needs a GPU, but {why}; run the stage where one is visible, or on the cpu"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= count:
        raise ConfigError(
            f"stage {stage!r}: device {device!r} does not exist; this process sees {count} GPU(s), cuda:0..cuda:{count - 1}"
        )
    return torch.device("cuda", index)
