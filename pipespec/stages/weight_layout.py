"""A model's fp32 linear weights laid out for a CPU's few-row products: stored transposed (column-major).

`nn.Linear` keeps its weight W as [out, in], row-major, and computes x @ W^T. A decode or verification
feeds a few rows (1 to 8), and for so few rows MKL's fp32 product is fastest when W^T is the contiguous
one.

The values are the same tensor's; only its strides change, so `weight.shape`, `state_dict` and every
reader see the same matrix. A row's result still depends on the product's row count, but in two groups
(1-3 rows and 4-16: one kernel each) where row-major has three (1, 2-3, 4-16); the target's fixed widths
(pipespec.stages.forwards) stay inside the second group. Only fp32 on a CPU: bf16 and fp16 products
over this layout cost 2-4x more here, and a GPU's kernels take either layout.

On some CPUs the layout decides whether batched forwards can be exact at all: column-major, a row's result may
depend on the row count up to many more rows than row-major. A target stage measures it when it starts and, where
only row-major keeps a least row count, lays its weights back (`row_major`; pipespec.stages.invariance).
"""

from __future__ import annotations

import torch


def column_major(model: torch.nn.Module) -> torch.nn.Module:
    """Every fp32 `nn.Linear` weight of `model` on a CPU stored transposed, in place (a tied LM head gets a
    copy of its own; the embedding table keeps its rows); -> `model`."""
    for module in model.modules():
        weight = module.weight.detach() if isinstance(module, torch.nn.Linear) else None
        if weight is not None and weight is not (laid := column_major_weight(weight)):
            module.weight = torch.nn.Parameter(laid, requires_grad=False)
    return model


def column_major_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] stored transposed (strides (1, out)) if it is fp32 on a CPU, else `weight` itself."""
    if weight.dtype == torch.float32 and weight.device.type == "cpu":
        return weight.t().contiguous().t()
    return weight


def row_major(model: torch.nn.Module) -> torch.nn.Module:
    """Every `nn.Linear` weight of `model` stored row-major again (`column_major` undone), in place; -> `model`."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.is_contiguous():
            module.weight = torch.nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
    return model
