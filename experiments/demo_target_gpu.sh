#!/usr/bin/env bash
# The demo target's recipe on the lent GPU machine (issue 29; ../shared/gpu.md): runs side by side, each its
# own `python -m demo.train target --device cuda`, and their models come back as tar parts in $OUT.
#   run: bash experiments/demo_target_gpu.sh [NAME:STEPS:BATCH:SEED ...]   (no wheels needed: training imports
#   neither Ray nor gRPC). Default: the shipped recipe (5000 steps at batch 64, 2 min 46 s on one H200 beside
#   three other runs) on seeds 0 and 1, and 10000 steps at batch 64.
# Each run stops at MINUTES (default 6.5) so that the tar parts are written inside a 10-minute call; the
# files back are at most 8 (16 MiB each, 64 MiB together): three runs' models (about 19 MiB each, 2 parts).
# Then, here: cat $FILES/NAME.tar.* | tar -C DIR -xf -, copy models/demo/tokenizer into DIR, and
# python -m demo.train evaluate --models DIR.
set -u
OUT=${OUT:-/tmp/demo_target_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/log.txt" 2>&1
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(shipped:5000:64:0 seed1:5000:64:1 long:10000:64:0)
for run in "${runs[@]}"; do
  IFS=: read -r name steps batch seed <<< "$run"
  mkdir -p "/tmp/$name" && cp -r models/demo/tokenizer models/demo/tower "/tmp/$name/"
  (python3 -m demo.train target --models "/tmp/$name" --device cuda --steps "$steps" --batch-size "$batch" --seed "$seed" \
     --minutes "${MINUTES:-6.5}" --workers 4 > "/tmp/$name.log" 2>&1; echo "$name $steps x $batch seed $seed rc $?" >> "/tmp/$name.log") &
done
wait
for run in "${runs[@]}"; do
  name=${run%%:*}
  { tail -1 "/tmp/$name.log"; tr '\r' '\n' < "/tmp/$name.log" | grep "^target:" | tail -1; } >> "$OUT/log.txt"
  tar -C "/tmp/$name" -cf - target | split -b 15m - "$OUT/$name.tar."
done
cat "$OUT/log.txt"
