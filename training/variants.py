"""The DREAM drafter variants the ablations compare: its architecture, supervision layer and compression.

`dream` is the drafter as shipped (cross-attention, entropy-selected supervision layer, no
compression); `no_cross_attention` is EAGLE-style (one block fed the previous feature);
`compression_*` keep that fraction of the image positions; `layer_*` supervise the first block with
a fixed layer at that fraction of the target's depth.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str = "dream"
    cross_attention: bool = True
    layer: float | None = None  # None: entropy-adaptive; else a fixed fraction of the depth
    keep_fraction: float = 1.0


VARIANTS = (
    Variant("dream"),
    Variant("no_cross_attention", cross_attention=False),
    Variant("compression_0.75", keep_fraction=0.75),
    Variant("compression_0.5", keep_fraction=0.5),
    Variant("layer_25", layer=0.25),
    Variant("layer_50", layer=0.5),
    Variant("layer_75", layer=0.75),
)
