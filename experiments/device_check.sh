#!/usr/bin/env bash
# The GPU checks of issue 27, as one short run on the lent device machine (../shared/gpu.md):
#   run: bash experiments/device_check.sh   (carry .whl; figures and logs land in $OUT)
# 1. a 7B-shaped random-weight target's forwards, eager and compiled (CUDA graphs), beside its floor;
# 2. the `gpu` tests, the compiled bf16 path among them;
# 3. the demo models on one GPU in this process: the target alone, sync and async, compiled.
# Each step has its own time limit, so a stuck step still leaves the others' results.
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
export TORCH_LOGS=perf_hints  # names every CUDA graph skipped, and why
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$OUT/gpu.txt" 2>&1

timeout "${FLOOR_S:-130}" python3 -m experiments.forward_floor --shape 7b --json "$OUT/forward_floor_7b.json" \
  > "$OUT/forward_floor_7b.log" 2>&1; echo "forward_floor rc=$?" >> "$OUT/rc.txt"

timeout "${TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 \
  tests/test_gpu.py tests/test_device.py tests/test_codec.py tests/test_noise.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/rc.txt"

python3 - "$OUT/demo_gpu.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open("pipespec/configs/demo.yaml"))
config["name"] = "demo_gpu"
for stage in config["stages"]:
    stage.update(device="cuda", resources={"num_cpus": 1, "num_gpus": 0.1})
yaml.safe_dump(config, open(sys.argv[1], "w"))
PY
timeout "${BENCH_S:-180}" python3 -m experiments.bench "$OUT/demo_gpu.yaml" --prompts experiments/prompts/world_held_out.jsonl \
  --backend local --limit 12 --runs 2 --only "sync tiny->target" "async tiny" --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/rc.txt"
