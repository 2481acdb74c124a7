#!/usr/bin/env bash
# The deployed pipeline on a lent GPU (issue 55): an actor per stage linked by gRPC, bf16, compiled forwards
# (CUDA graphs), Llama shapes, over random models that agree (experiments/agreeing_family.py). One call:
#
#   on the device machine (../shared/gpu.md; carry .whl):   bash experiments/device_ray.sh
#   its rehearsal here, the project's venv and full Ray:     bash experiments/device_ray.sh --device cpu
#
# Steps, each under its own time limit (seconds, overridable: INSTALL_S RAY_S FAMILY_S SMALL_S LARGE_S; on the
# device 45 + 45 + 100 + 110 + 230 = 530 s), and all of them under one deadline (DEADLINE_S, default 540 s
# on the device: a step gets at most what is left of it, 10 s kept for copying what came back), each stopped
# with SIGINT at its limit (its Ray shut down, its tables already written after each method's pass through
# the prompts), SIGKILL 5 s later, and whatever it left killed by its session; the script exits with the
# first failed step's status:
#   1. install (the device: the trimmed Ray and the wheels of .whl) and check that Ray sees the GPU and that an
#      actor given an eighth of it can use it;
#   2. build the family on the device: 68M, 0.5B and 7B Llama shapes in bf16, the drafters agreeing with the
#      7B at 0.75 (68M) and 0.9 (0.5B) teacher-forced; on the CPU three tiny shapes;
#   3. a short 68M -> 0.5B bench on Ray: the 0.5B alone in process, sync and the asynchronous pair (a result
#      even if the 7B fails);
#   4. 68M -> 0.5B -> 7B: the 7B alone and synchronous speculation in process, the asynchronous pipeline at
#      2 stages (0.5B -> 7B) and at 3, every stage its own actor on an eighth of the GPU, every row's `exact`
#      against the 7B alone; nvidia-smi sampled beside it every 500 ms.
# What comes back (at most 8 files, in $OUT): steps.txt (each step's exit status and seconds, the versions,
# Ray's resources), family.json, bench_small.md, bench_large.md and .json (the tables, and where each stage's
# time went: its trace), smi.csv, log.txt (the tail of every step's log). Models and logs stay in $WORK.
set -u +m  # no job control: each step's `setsid` runs in place, its pid its session's id
DEVICE=cuda
while [ $# -gt 0 ]; do
  case $1 in
    --device) [ $# -ge 2 ] || { echo "--device: cuda or cpu" >&2; exit 2; }; DEVICE=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--device cuda|cpu]" >&2; exit 2 ;;
  esac
done
case $DEVICE in cuda|cpu) ;; *) echo "--device: cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/device_ray}
WORK=${WORK:-/tmp/device_ray_work}
rm -rf "$WORK"  # nothing of an earlier run is taken for this one's
mkdir -p "$OUT" "$WORK"
rm -f "$OUT"/{steps.txt,family.json,bench_small.md,bench_large.md,bench_large.json,smi.csv,log.txt}
: > "$OUT/steps.txt"; : > "$OUT/log.txt"
if [ "$DEVICE" = cuda ]; then DEADLINE=$((SECONDS + ${DEADLINE_S:-540})); else DEADLINE=$((SECONDS + ${DEADLINE_S:-3600})); fi
FAILED=0
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
  RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0

# step NAME LIMIT COMMAND...: COMMAND in a session of its own, SIGINT at LIMIT seconds or what is left of the
# deadline (SIGKILL 5 s later), then whatever is left of its session killed; its status and seconds to steps.txt,
# its log's tail to log.txt.
step() {
  local name=$1 limit=$2 began=$SECONDS rc left=$((DEADLINE - SECONDS - 15))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "$name: skipped, the deadline is near" >> "$OUT/steps.txt"; [ "$FAILED" -eq 0 ] && FAILED=124; return 124
  fi
  setsid timeout -s INT -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1 &
  local session=$!
  wait "$session"; rc=$?
  pkill -KILL -s "$session" 2> /dev/null
  echo "$name: rc $rc in $((SECONDS - began)) s (limit $limit s)" >> "$OUT/steps.txt"
  { echo "==== $name (rc $rc)"; tail -n "${TAIL:-40}" "$WORK/$name.log"; } >> "$OUT/log.txt"
  [ "$rc" -ne 0 ] && [ "$FAILED" -eq 0 ] && FAILED=$rc
  return $rc
}

if [ "$DEVICE" = cuda ]; then
  PY=python3
  export PYTHONPATH=/tmp/site:$PWD
  install() {
    mkdir -p /tmp/site && tar -xJf .whl/ray-trim.tar.xz -C /tmp/site &&
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  }
  step install "${INSTALL_S:-45}" bash -c "$(declare -f install); install" || { cat "$OUT/steps.txt"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/steps.txt" 2>&1
  SHAPES=(68m 0.5b 7b); AGREE=(0.75 0.9)
else
  PY=${PY:-.venv/bin/python}
  export PYTHONPATH=$PWD
  SHAPES=(cpu-s cpu-m cpu-l); AGREE=(0.75 0.9)
fi
S=${SHAPES[0]} M=${SHAPES[1]} T=${SHAPES[2]}
FAMILY=$WORK/family

cat > "$WORK/ray_check.py" << 'PY'
import sys, torch, transformers, ray
device = sys.argv[1]
print(f"torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}, python {sys.version.split()[0]}")
ray.init(address="local", include_dashboard=False)
print("ray resources:", {k: v for k, v in ray.cluster_resources().items() if "memory" not in k and "node" not in k})
if device == "cuda":
    assert ray.cluster_resources().get("GPU", 0) >= 1, "Ray sees no GPU"
    @ray.remote(num_gpus=0.125, num_cpus=1)
    def probe():
        return ray.get_gpu_ids(), torch.cuda.is_available() and torch.cuda.get_device_name()
    print("a task on an eighth of the GPU:", ray.get(probe.remote(), timeout=30))
ray.shutdown()
PY
step ray "${RAY_S:-45}" "$PY" "$WORK/ray_check.py" "$DEVICE" || { cat "$OUT/steps.txt"; exit 1; }  # both benches need it
grep -h "^torch \|^ray resources\|^a task" "$WORK/ray.log" >> "$OUT/steps.txt"

step family "${FAMILY_S:-100}" "$PY" -m experiments.agreeing_family "$FAMILY" --shapes "${SHAPES[@]}" \
  --agreement "${AGREE[@]}" --device "$DEVICE" --dtype bfloat16 --prompts "${PROMPTS:-8}"
cp "$FAMILY/family.json" "$OUT/" 2> /dev/null || { cat "$OUT/steps.txt"; exit 1; }

BENCH=(--prompts "$FAMILY/prompts.jsonl" --runs "${RUNS:-2}" --max-new-tokens "${NEW_TOKENS:-64}")
step small "${SMALL_S:-110}" "$PY" -m experiments.bench "$FAMILY/$S-$M.yaml" "${BENCH[@]}" \
  --only "sync $S->$M\$" "async $S->$M" --out "$WORK/bench_small"
cp "$WORK/bench_small/bench.md" "$OUT/bench_small.md" 2> /dev/null

if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv -lms 500 > "$OUT/smi.csv" 2>&1 &
  SMI=$!
fi
step large "${LARGE_S:-230}" "$PY" -m experiments.bench "$FAMILY/$S-$M-$T.yaml" "${BENCH[@]}" \
  --only "sync $S->$T\$" "sync $M->$T\$" "async $M->$T" "async $S->$M->$T" --out "$WORK/bench_large"
[ -n "${SMI:-}" ] && kill "$SMI"
cp "$WORK/bench_large/bench.md" "$OUT/bench_large.md" 2> /dev/null
cp "$WORK/bench_large/bench.json" "$OUT/bench_large.json" 2> /dev/null
cat "$OUT/steps.txt"
exit "$FAILED"
