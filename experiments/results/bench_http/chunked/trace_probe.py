"""The demo pipeline (demo_two_cores, in process, one torch thread a compute thread) with N requests at once, traced.

Where the target's time goes at 1 and at 16 requests in flight (README.md beside this file):

    python experiments/results/bench_http/chunked/trace_probe.py 16

Run from the repository root, with the demo models under models/demo. Prints, per run, the throughput, the
engine's trace table (pipespec.engine.trace) and the target's prefill share and drafts verified.
"""

import argparse
import json
import time
from pathlib import Path

from PIL import Image

from pipespec.config import load_config
from pipespec.engine.trace import table
from pipespec.local import LocalPipeline


def held_out(models: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in (models / "held_out.jsonl").read_text().splitlines()]
    requests = []
    for row in rows:
        with Image.open(models / row["image"]) as picture:
            requests.append({"prompt": row["text"], "image": picture.convert("RGB"), "max_new_tokens": 96})
    return (requests * (n // len(requests) + 1))[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, help="requests at once")
    parser.add_argument("--config", default="pipespec/configs/demo_two_cores.yaml")
    parser.add_argument("--models", type=Path, default=Path("models/demo"))
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    requests = held_out(args.models, args.n)
    with LocalPipeline(load_config(args.config)) as pipe:
        for future in [pipe.submit(**r) for r in requests]:  # warm: compiled buckets, caches
            future.result()
        for run in range(args.runs):
            pipe.start_trace()
            t0 = time.perf_counter()
            tokens = sum(len(f.result().token_ids) for f in [pipe.submit(**r) for r in requests])
            seconds = time.perf_counter() - t0
            summaries = pipe.stop_trace()
            target = summaries[-1]
            decode = target["steps"] - target["prefills"]
            print(f"run {run}: {args.n} at once: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s")
            print(table(summaries))
            print(
                f"target: prefill {target['prefill_compute_s'] / target['compute_s']:.0%} of its compute; {decode} decode "
                f"forwards ({target['verify_steps']} verifying), {tokens / decode:.1f} tokens a decode forward; "
                f"{target['drafts']} drafts verified, {target['accepted']} accepted"
            )


if __name__ == "__main__":
    main()
