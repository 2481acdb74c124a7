"""Does a row's result depend on the other rows it is computed with? This CPU's answer, before batched steps.

    python -m dev.batch_invariance [--rows 1 2 4 8 16 32 64 128 256 512] [--threads 1 2]
                                           [--dtypes float32 bfloat16] [--repeats 5] [--out DIR]

Batched steps (issue 56) put many requests' tokens into one forward: a request's rows then sit among
other requests' rows, as many as the batch holds. A request's logits must stay bitwise those it gets
alone (design section 1), so what a matrix product's row does as the row count and the other rows change
decides the buckets a batched forward must pad to. Three questions, for the matrix shapes of a
Llama-2-7B-proportioned layer at hidden 1024 (q/o 1024x1024, MLP up 2816x1024 and down 1024x2816, a head
of 32000 rows) on random inputs:

- content: at a fixed row count, is row 0 the same whatever the other rows hold (two draws of them)?
- count: which row counts give row 0 the same bits as each other? Printed as classes of counts that
  agree (`1 / 2-3 / 4-512`: three kernels' worth of answers).
- threads: at each count, is row 0 the same on one torch thread and on two?

and one about a whole model: a random 2-layer Llama at hidden 1024 (`ModelShape`), a batch of
equal-length sequences without padding or cache, the first sequence's logits at every batch size against
alone, and on one thread against two; and a target stage's own forwards (`stage_threads`) on one thread
against two, at a Llama's and at Qwen2.5-1.5B's layer shapes. Beside them the cost: milliseconds per
product at each count, so a bucket's padding can be priced. Written to --out (default experiments/results/batch_invariance/): `invariance.md`
and `invariance.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipespec.commands.logs import parse_logged
from pipespec.stages.causal_lm import DTYPES

log = logging.getLogger(__name__)

HIDDEN = 1024
PRODUCTS = {  # name -> (out, in) of the weight
    "q/o 1024x1024": (HIDDEN, HIDDEN),
    "up 2816x1024": (2816, HIDDEN),
    "down 1024x2816": (HIDDEN, 2816),
    "head 32000x1024": (32000, HIDDEN),
}
ROWS = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512)


def classes(rows: Sequence[int], results: dict[int, torch.Tensor]) -> list[list[int]]:
    """Row counts grouped by bitwise equal results, each group in ascending order, groups by their first count."""
    groups: list[tuple[torch.Tensor, list[int]]] = []
    for n in rows:
        for value, members in groups:
            if torch.equal(value, results[n]):
                members.append(n)
                break
        else:
            groups.append((results[n], [n]))
    return [members for _, members in groups]


def spans(rows: Sequence[int], groups: list[list[int]]) -> str:
    """Groups as text: a run of consecutive tested counts as its ends, others listed ("1 / 2-3 / 4-512", "1,64 / 2-32")."""

    def one(group: list[int]) -> str:
        at = [rows.index(n) for n in group]
        if len(group) > 1 and at == list(range(at[0], at[0] + len(group))):
            return f"{group[0]}-{group[-1]}"
        return ",".join(map(str, group))

    return " / ".join(one(g) for g in groups)


@dataclass(frozen=True)
class ProductRow:
    product: str
    dtype: str
    threads: int
    classes: str  # row counts whose row 0 agrees bitwise, grouped
    content_invariant: bool  # at every count, row 0 the same whatever the other rows hold
    thread_invariant: bool | None  # at every count, row 0 the same on one thread as on this many (None: this is one)
    ms: dict[int, float]  # median milliseconds per product, per row count


def with_threads(threads: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def product_row(
    name: str, dtype: torch.dtype, threads: int, rows: Sequence[int], repeats: int, product=torch.nn.functional.linear
) -> tuple[ProductRow, dict[int, torch.Tensor]]:
    """`product(x, w)` for x of each row count, row 0 always the same vector; -> the row and row 0's results."""
    out_features, in_features = PRODUCTS[name]
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(dtype)
    first = torch.randn(1, in_features, generator=g).to(dtype)
    most = max(rows)
    others = [torch.randn(most, in_features, generator=g).to(dtype) for _ in range(2)]  # two draws of the other rows
    results, content, ms = {}, True, {}
    with torch.inference_mode():
        for n in rows:
            draws = []
            for other in others:
                x = torch.cat([first, other[: n - 1]])
                draws.append(with_threads(threads, lambda x=x: product(x, w))[0].clone())
            content &= torch.equal(draws[0], draws[1])
            results[n] = draws[0]
            x = torch.cat([first, others[0][: n - 1]])
            with_threads(threads, lambda x=x: product(x, w))  # warm
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                with_threads(threads, lambda x=x: product(x, w))
                times.append(time.perf_counter() - t0)
            ms[n] = 1e3 * statistics.median(times)
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    return ProductRow(name, dtype_name, threads, spans(list(rows), classes(rows, results)), content, None, ms), results


@dataclass(frozen=True)
class ModelShape:
    hidden: int = HIDDEN
    layers: int = 2
    heads: int = 16
    intermediate: int = 2816
    vocab: int = 32000
    length: int = 16  # tokens per sequence


def model_classes(shape: ModelShape, dtype: torch.dtype, threads: int, batches: Sequence[int]) -> dict:
    """A random Llama's logits for the first of `b` equal-length sequences at each batch size b: grouped as
    `classes`, and whether two draws of the other sequences give the same at every b."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, shape.vocab, (1, shape.length), generator=g)
    others = [torch.randint(0, shape.vocab, (max(batches), shape.length), generator=g) for _ in range(2)]
    results, content = {}, True
    with torch.inference_mode():
        for b in batches:
            draws = [
                with_threads(threads, lambda o=o, b=b: model(input_ids=torch.cat([first, o[: b - 1]])).logits[0].float().clone())
                for o in others
            ]
            content &= torch.equal(draws[0], draws[1])
            results[b] = draws[0]
    return {"classes": spans(list(batches), classes(batches, results)), "content_invariant": content, "logits": results}


STAGE_SHAPES = {  # 2 layers of each, random weights
    "Llama, hidden 1024": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16),
    "Qwen2.5-1.5B (GQA 12/2, MLP 8960, tied)": dict(
        hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True
    ),
}


def stage_threads(shape: str, dtype: str, prompt: int = 300) -> bool:
    """Through a target stage's own path (pipespec.stages.causal_lm: eager, a static cache, width 4): a
    `prompt`-token prefill, then a 4-token verification and a 1-token step, on one thread and on two; ->
    whether every logit is the same bitwise."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipespec.config import StageSpec
    from pipespec.protocol.messages import RequestSpec
    from pipespec.protocol.params import SamplingParams
    from pipespec.schema.kinds import ModelOptions
    from pipespec.stages.causal_lm import CausalLMStage

    config = Qwen2Config(vocab_size=32000, num_hidden_layers=2, **STAGE_SHAPES[shape])
    spec = StageSpec(
        "target", "causal_lm", "(random weights)", dtype=dtype, options=ModelOptions(compile=False, max_context=prompt + 64)
    )

    def forwards() -> list[torch.Tensor]:
        torch.manual_seed(0)
        stage = CausalLMStage(spec, model=Qwen2ForCausalLM(config))
        session = stage.open(RequestSpec("r", tuple(range(100, 100 + prompt)), SamplingParams(), 8))
        try:
            return [session.forward(prompt - 1, [99 + prompt, 5, 6, 7]), session.forward(prompt + 3, [8])]
        finally:
            session.close()

    got = {threads: with_threads(threads, forwards) for threads in (1, 2)}
    return all(torch.equal(a, b) for a, b in zip(got[1], got[2]))


def run(rows: Sequence[int], threads: Sequence[int], dtypes: Sequence[str], repeats: int, batches: Sequence[int]) -> dict:
    products, models = [], []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for name in PRODUCTS:
            alone = None
            for t in threads:
                row, results = product_row(name, dtype, t, rows, repeats)
                if alone is None:
                    alone = results
                else:
                    row = ProductRow(**{**asdict(row), "thread_invariant": all(torch.equal(alone[n], results[n]) for n in rows)})
                products.append(row)
                log.info("%s %s %d threads: %s", name, dtype_name, t, row.classes)
        alone = None
        for t in threads:
            found = model_classes(ModelShape(), dtype, t, batches)
            logits = found.pop("logits")
            same = None if alone is None else all(torch.equal(alone[b], logits[b]) for b in batches)
            alone = logits if alone is None else alone
            models.append({"dtype": dtype_name, "threads": t, **found, "thread_invariant": same})
    stages = [
        {"shape": shape, "dtype": d, "thread_invariant": stage_threads(shape, d)} for shape in STAGE_SHAPES for d in dtypes
    ] if 1 in threads and 2 in threads else []  # fmt: skip
    return {
        "rows": list(rows), "products": [asdict(p) for p in products], "models": models, "stages": stages,
        "torch": torch.__version__,
    }  # fmt: skip


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        f"# Batch invariance on this CPU (torch {result['torch']})",
        "",
        "Row 0 of a matrix product among other rows, against itself at other row counts (`classes`: counts whose "
        "row 0 agrees bitwise), against other contents of the other rows at the same count, and on 1 against 2 threads.",
        "",
        "| product | dtype | threads | classes of row counts | same whatever the other rows | same as 1 thread | "
        + " | ".join(f"ms at {n}" for n in rows)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(rows),
    ]
    for p in result["products"]:
        same = "-" if p["thread_invariant"] is None else "yes" if p["thread_invariant"] else "**no**"
        cells = " | ".join(f"{p['ms'][n]:.3f}" for n in rows)
        lines.append(
            f"| {p['product']} | {p['dtype']} | {p['threads']} | {p['classes']} | "
            f"{'yes' if p['content_invariant'] else '**no**'} | {same} | {cells} |"
        )
    lines += ["", "A random 2-layer Llama at hidden 1024, the first of b equal-length sequences (16 tokens), its logits:", ""]
    lines += [
        "| dtype | threads | classes of batch sizes | same whatever the other sequences | same as 1 thread |",
        "|---|---|---|---|---|",
    ]
    for m in result["models"]:
        same = "-" if m.get("thread_invariant") is None else "yes" if m["thread_invariant"] else "**no**"
        lines.append(
            f"| {m['dtype']} | {m['threads']} | {m['classes']} | {'yes' if m['content_invariant'] else '**no**'} | {same} |"
        )
    if result.get("stages"):
        lines += ["", "Through a target stage's own path (eager, a static cache): a 300-token prefill, a 4-token "
                  "verification and a 1-token step, on one thread against two:", ""]  # fmt: skip
        lines += ["| shape (2 layers) | dtype | same bitwise |", "|---|---|---|"]
        lines += [
            f"| {st['shape']} | {st['dtype']} | {'yes' if st['thread_invariant'] else '**no**'} |" for st in result["stages"]
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16], help="the model's batch sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/batch_invariance"))
    args = parse_logged(parser, argv)
    if min(args.rows) < 1 or min(args.threads) < 1 or min(args.batches) < 1:
        parser.error("--rows, --threads and --batches take counts of at least 1")
    result = run(sorted(set(args.rows)), args.threads, args.dtypes, args.repeats, sorted(set(args.batches)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "invariance.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (args.out / "invariance.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
