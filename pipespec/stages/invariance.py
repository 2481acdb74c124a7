"""What keeps a row's result independent of how many rows share its forward, measured where the stage runs.

A batched forward (pipespec.stages.packing) gives a request's rows bitwise what they get alone only if the
kernels compute a row the same whatever the row count. That is a property of the device, its math library
and its thread count, not of the model, and it differs between CPUs that look alike:
- on the 2-core AMD EPYC of issue 56 (experiments/results/batch_invariance), one torch thread or two, a
  product's row depended on the row count only below 4 rows, and an attention query row on the query count
  only below 4;
- on a 2-core Intel Xeon (AVX-512) a session later, one thread: a product's row depends on the count below 16
  rows (1 / 2-15 / 16 and up) with row-major weights, and up to 160 rows with the column-major weights the fp32
  stages use for speed (pipespec.stages.weight_layout); an attention row depends on the tail of its query block
  (torch's CPU flash attention splits queries in blocks of 32 or more: a row in a tail of 1-2 rows, 1-5 at head
  dim 128, is computed otherwise). On two threads the products split their rows between the threads by the row
  count, and at some shapes no least count holds up to 512 rows.

So a target stage on a CPU measures it when it starts (`measure`), at its own thread count, dtype and layer
shapes: the least row count from which every row of each of its products is what it is at the most rows it
will run (laying its weights out row-major where only that keeps one: `fit_model`), and the query step
(queries padded to a multiple of it) from which every attention row is. Its
forwards then have at least `rows` rows and its attention runs over a multiple of `queries` query rows. Where
no least count holds (`holds` false), the stage says so in its log: its answers may then depend on what
shares its forwards (run it on one thread, or at `max_batch: 1`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pipespec.stages.weight_layout import row_major

log = logging.getLogger(__name__)

_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)  # least row counts and query steps tried, smallest first


@dataclass(frozen=True)
class Invariance:
    """The shapes at which a row's result does not depend on its forward's other rows (module docstring)."""

    rows: int = 1  # a forward's products run over at least this many rows
    queries: int = 1  # a piece's attention runs over a multiple of this many query rows (its last one repeated)
    holds: bool = True  # False: none found up to the most rows measured (a request's answer may depend on its batch)

    def query_rows(self, n: int) -> int:
        """The query rows a piece of `n` rows attends with."""
        return self.queries * math.ceil(n / self.queries)


NONE_NEEDED = Invariance()  # a drafter's: its logits pick drafts, never the answer


def measure(
    weights: Iterable[torch.Tensor], heads: int, head_dim: int, capacity: int, dtype: torch.dtype, most: int
) -> Invariance:
    """On this CPU at torch's current thread count: products with each of `weights` ([out, in], as laid out in memory:
    the library's path depends on it, pipespec.stages.weight_layout), and attention of `heads` x `head_dim` over a
    `capacity`-key cache, at row counts up to `most`. -> the least row count and query step that hold (where none
    does, no padding, and `holds` false)."""
    generator = torch.Generator().manual_seed(0)
    counts = _counts(most)
    rows, holds = 1, True
    distinct = {(tuple(w.shape), w.stride()): w for w in weights}
    with torch.inference_mode():
        for weight in distinct.values():
            x = torch.randn(most, weight.shape[1], generator=generator).to(dtype)
            full = torch.nn.functional.linear(x, weight)
            bad = [m for m in counts if not torch.equal(torch.nn.functional.linear(x[:m], weight), full[:m])]
            least = next((c for c in _CANDIDATES if all(m < c for m in bad)), None)
            holds &= least is not None
            rows = max(rows, least or _CANDIDATES[-1])
        queries, attention_holds = _query_step(heads, head_dim, min(capacity, 1024), dtype, most, counts, generator)
    if not (holds and attention_holds):
        return Invariance(holds=False)  # padding would buy nothing
    return Invariance(rows, queries)


def _counts(most: int) -> list[int]:
    """The row counts measured: every count to 64, then steps of 16 to 256, then of 64, and `most`."""
    counts = list(range(1, min(most, 64) + 1)) + list(range(80, min(most, 256) + 1, 16)) + list(range(320, most + 1, 64))
    return sorted(set(counts) | {most})


def _query_step(
    heads: int, head_dim: int, capacity: int, dtype: torch.dtype, most: int, counts: list[int], generator: torch.Generator
) -> tuple[int, bool]:
    """The least query step at which every masked attention row over a `capacity`-key cache, its query rows padded
    to a multiple of the step, is what it is at `most` query rows; -> (step, whether one holds)."""
    keys = torch.randn(1, heads, capacity, head_dim, generator=generator).to(dtype)
    values = torch.randn(1, heads, capacity, head_dim, generator=generator).to(dtype)
    queries = torch.randn(1, heads, most, head_dim, generator=generator).to(dtype)
    positions = torch.arange(most) * capacity // most  # [most]: spread over the cache
    agrees: dict[int, bool] = {}

    def attend(n: int) -> torch.Tensor:
        mask = torch.arange(capacity)[None, :] <= positions[:n, None]  # [n, C]
        return torch.nn.functional.scaled_dot_product_attention(queries[:, :, :n], keys, values, attn_mask=mask[None, None])

    full = attend(most)
    for step in _CANDIDATES:
        padded = {min(most, step * math.ceil(n / step)) for n in counts}
        for n in padded - agrees.keys():
            agrees[n] = torch.equal(attend(n), full[:, :, :n])
        if all(agrees[n] for n in padded):
            return step, True
    return _CANDIDATES[-1], False


def fit_model(name: str, model: torch.nn.Module, least: int, capacity: int, most: int) -> Invariance:
    """What stage `name`'s forwards of `model` need (`measure`), over its text layers' and head's weights, its
    attention over caches of `capacity` keys, up to `most` rows a forward; where the weights' column-major layout
    keeps no least row count and row-major does, they are laid out row-major (pipespec.stages.weight_layout). Only a
    target on a CPU measures: a drafter's logits (`least` 1) never decide the answer, and on a GPU the promise is
    one request a forward (pipespec.stages.packed_forwards)."""
    parameter = next(model.parameters())
    if least == 1 or parameter.device.type != "cpu":
        return NONE_NEEDED
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads

    def weights() -> list[torch.Tensor]:
        modules = [*model.get_decoder().modules(), model.get_output_embeddings()]
        return [m.weight for m in modules if isinstance(m, torch.nn.Linear)]

    found = measure(weights(), heads, head_dim, capacity, parameter.dtype, most)
    if not found.holds and any(not w.is_contiguous() for w in weights()):
        plain = measure([w.contiguous() for w in weights()], heads, head_dim, capacity, parameter.dtype, most)
        if plain.holds:
            log.info("stage %r: its weights laid out row-major: column-major, a row's result depends on the row count", name)
            row_major(model)
            found = plain
    how = f"{torch.get_num_threads()} torch threads, {parameter.dtype}"
    if found.holds:
        log.info(
            "stage %r: a row's result is its own from %d rows a forward, attention by %d queries (%s)",
            name,
            found.rows,
            found.queries,
            how,
        )
    else:
        log.warning(
            "stage %r: on this CPU at %s a product's or an attention row depends on the row count up to %d rows: a "
            "request's answer may depend on what shares its forwards (serve it on one thread, or at max_batch: 1)",
            name,
            how,
            most,
        )
    return found
