"""Time to first token with N questions arriving at once, in process, and what the target's prefills cost.

Where the relaying demo pipeline's TTFT goes against the target alone (README.md beside this file):

    python experiments/results/bench_http/relay/ttft_probe.py pipespec/configs/demo_two_cores.yaml \
        experiments/results/bench_http/frames/target_alone_one_core.yaml

Run from the repository root, with the demo models under models/demo. Each request streams to its first token
(the rest of it is then cancelled); per config and run it prints the median TTFT and the target's prefill time.
"""

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipespec.config import load_config
from pipespec.local import LocalPipeline

sys.path.insert(0, str(Path(__file__).parents[1] / "chunked"))
from trace_probe import held_out  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--n", type=int, default=16, help="questions at once")
    parser.add_argument("--models", type=Path, default=Path("models/demo"))
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    requests = held_out(args.models, args.n)
    for config in args.configs:
        with LocalPipeline(load_config(config)) as pipe:

            def first_token(request: dict) -> float:
                start = time.perf_counter()
                for delta in pipe.stream(**request):
                    if delta.token_ids:
                        break
                return time.perf_counter() - start

            for future in [pipe.submit(**r) for r in requests]:  # warm
                future.result()
            for run in range(args.runs):
                pipe.start_trace()
                with ThreadPoolExecutor(args.n) as pool:
                    firsts = sorted(pool.map(first_token, requests))
                target = pipe.stop_trace()[-1]
                prefill_ms = 1e3 * target["prefill_compute_s"] / max(1, target["prefills"])
                print(
                    f"{Path(config).name} run {run}: median TTFT {1e3 * firsts[len(firsts) // 2]:.0f} ms; "
                    f"target prefills {target['prefills']}, {prefill_ms:.1f} ms each"
                )


if __name__ == "__main__":
    main()
