"""What the coupled-sampling noise costs on the CPU (pipespec.engine.noise), as built and as it was.

As built, `uniform_rows` hashes on the CPU in numpy's uint32; as it was, in int64 tensors (32x16-bit partial
products) everywhere, with Python integers up to 32 elements. Both give the same bits (tests/test_noise.py).

1. The noise alone: `gumbel_rows` for 1 and 5 rows (a one-token step, a verification of 4 drafts) at three
   vocabulary sizes (the demo's 512, a Llama's 32,000, a Qwen2's 151,936), median of 7 calls, one thread.
2. A pipeline: a random toy Llama target (8 layers, 128 wide) and its first layer as the drafter, both with
   a vocabulary of 151,936, seeded sampling (temperature 0.8), 4 prompts x 32 tokens in one process, one
   thread; the two sides alternated `--rounds` times, tokens per second and whether their tokens agree.

    python -m dev.noise_cost --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.engine import noise

VOCABS = (512, 32_000, 151_936)
BIG = 151_936


def _uniform_rows_as_it_was(seed: int, start: int, rows: int, num: int, stream: int = 0, device: str = "cpu") -> torch.Tensor:
    if rows * num <= 32:
        values = [noise._uniforms(seed, start + r, num, stream) for r in range(rows)]
        return torch.tensor(values, dtype=torch.float64).reshape(rows, num)
    return noise._uniform_tensor([noise.counter_key(seed, start + r, stream) for r in range(rows)], num, device)


SIDES: dict[str, Callable] = {"as built": noise.uniform_rows, "as it was": _uniform_rows_as_it_was}


@contextmanager
def side(name: str) -> Iterator[None]:
    """`noise.uniform_rows` as the side `name` computes it, for the duration."""
    built = noise.uniform_rows
    noise.uniform_rows = SIDES[name]
    try:
        yield
    finally:
        noise.uniform_rows = built


def median_ms(call: Callable[[], object], times: int = 7) -> float:
    call()
    spans = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        spans.append(time.perf_counter() - start)
    return statistics.median(spans) * 1e3


def noise_alone() -> list[str]:
    lines = ["| vocabulary | rows | as built (ms) | as it was (ms) |", "|---|---|---|---|"]
    for vocab in VOCABS:
        for rows in (1, 5):
            ms = {}
            for name in SIDES:
                with side(name):
                    ms[name] = median_ms(lambda: noise.gumbel_rows(1, 10, rows, vocab))  # noqa: B023
            lines.append(f"| {vocab:,} | {rows} | {ms['as built']:.2f} | {ms['as it was']:.2f} |")
    return lines


def build_pair(out: Path, vocab: int = BIG) -> dict[str, str]:
    from tests.fixtures.toy_models import llama_config, random_llama, save, train_tokenizer, truncate

    tokenizer = train_tokenizer()
    target = random_llama(llama_config(vocab, hidden=128, layers=8, heads=4), 0, 0.005)
    return {
        "target": str(save(target, tokenizer, out / "target")),
        "tiny": str(save(truncate(target, 1), tokenizer, out / "tiny")),
    }


def pipeline_rates(paths: dict[str, str], rounds: int, new_tokens: int = 32) -> tuple[dict[str, list[float]], bool]:
    """-> tokens per second per side, one per round, and whether both sides generated the same tokens."""
    stage = lambda n: {"name": n, "kind": "causal_lm", "model": paths[n], "dtype": "float32"}  # noqa: E731
    prompts = [[1, 40 + i, 50, 60, 70] for i in range(4)]
    rates: dict[str, list[float]] = {name: [] for name in SIDES}
    tokens: dict[str, list] = {}
    with LocalPipeline(load_config({"stages": [stage("tiny"), stage("target")]})) as pipeline:
        for r in range(rounds):
            for name in list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]:
                with side(name):
                    start = time.perf_counter()
                    out = [
                        pipeline.generate(prompt_token_ids=q, max_new_tokens=new_tokens, temperature=0.8, seed=7) for q in prompts
                    ]
                    rates[name].append(sum(len(g.token_ids) for g in out) / (time.perf_counter() - start))
                tokens.setdefault(name, [g.token_ids for g in out])
    return rates, tokens["as built"] == tokens["as it was"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two sides in the pipeline (default: 4)")
    args = parse_logged(parser, argv)
    torch.set_num_threads(1)
    print("\n".join(noise_alone()))
    with tempfile.TemporaryDirectory() as tmp:
        rates, same = pipeline_rates(build_pair(Path(tmp)), args.rounds)
    print(f"\ntiny -> target, vocabulary {BIG:,}, seeded sampling; same tokens on both sides: {same}")
    for name, runs in rates.items():
        print(f"- {name}: {statistics.median(runs):.1f} tok/s (median; runs {', '.join(f'{x:.1f}' for x in runs)})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
