#!/usr/bin/env bash
# The GPU check: the GPU figures of docs/benchmarks.md in one command of at most 600 s
# (docs/development.md#the-gpu-check). Usage, from the repository root:
#   OUT=/tmp/gpu_check_out bash .ci/gpu_check.sh
# It needs a machine with one NVIDIA GPU (a CUDA build of torch; bf16 needs compute capability 8.0+),
# python3 with the packages of requirements.txt -- or, on a machine without internet, their wheels
# in .whl/ (`pip download -r requirements.txt -d .whl`), installed into /tmp/site first -- and
# CIFAR-10 as JPEG folders (train/<class>/*.jpg, test/<class>/*.jpg) in $DATA/cifar10-jpeg, or
# packed as .data/cifar10-jpeg.tar.xz, which is unpacked there.
# The whole script keeps to GPU_CHECK_BUDGET_S (570 s, counted from its start): each part has a cap,
# gets at most what is left, and is skipped (logged) when less than its minimum is left. In order:
#   bench_step   the raw-DDP baseline's pipeline vs our step vs under Ray, both stems, FLOP share (cap 150 s)
#   vs_ddp       the baseline's loop and ours, under torchrun and Ray Train, 1 worker (the GPU)  (cap 150 s)
#   checkpoints  steady img/s with a checkpoint per CIFAR-10 epoch: none vs sync vs async, stall (cap 100 s)
#   train_fast   --recipe fast on the CIFAR-10 JPEG copy, 1 GPU                             (cap 200 s)
#   predict      the train_fast run's model over the CIFAR-10 JPEG test folder, 1 actor on the GPU (cap 90 s)
#   other_model  convnext_tiny (not a ResNet) on the CIFAR-10 JPEG copy, 1 GPU, 200 steps     (cap 90 s)
#   bench_memory vit_l_16 at 224 px, batch 64: ddp vs fsdp, each with and without activation
#                checkpointing: model-state bytes, peak GPU memory, img/s (1 GPU: one worker)     (cap 120 s)
#   scale        1 vs 2 workers sharing the GPU (0.5 GPU each: gloo), 20 steps a point        (cap 120 s)
#   bench_compile  CIFAR stem with torch.compile (last: the least needed)                     (cap 120 s)
# It writes everything under $OUT (default /tmp/gpu_check_out): log.txt, gpu.txt,
# bench_step.{txt,json}, vs_ddp.{txt,json}, checkpoints.{txt,json}, train_fast.txt + metrics/summary
# JSON, predict.txt + predictions.csv, other_model.txt + other_model_metrics.jsonl, bench_memory.{txt,json,md}, scale.txt + scaling.{md,json,png}, bench_compile.{txt,json}.
# Not measured here (nor anywhere yet): more than one GPU -- NCCL between GPUs and between nodes, so
# the scaling of real GPU workers --, checkpoints to object storage from a GPU, and --recipe fast to
# its final accuracy (24 epochs: longer than this check's 200 s).
set -euo pipefail
OUT=${OUT:-/tmp/gpu_check_out}
DATA=${DATA:-/tmp/data}
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
mkdir -p "$OUT" "$DATA"
log() { printf '%s [gpu_check] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/log.txt" >&2; }

# The timeout for the next part: its cap, or what is left of the budget; fails (and logs) when
# that is below the part's minimum.
budget_for() {
  local name=$1 cap=$2 min=$3 rest=$((BUDGET_S - SECONDS))
  if ((rest < cap)); then cap=$rest; fi
  if ((cap < min)); then
    log "$name: skipped, ${rest}s left of the ${BUDGET_S}s budget (needs ${min}s)"
    return 1
  fi
  echo "$cap"
}

setup() {
  export PYTHONPATH=$PWD RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  fi
  if [[ -f .data/cifar10-jpeg.tar.xz ]]; then tar xJf .data/cifar10-jpeg.tar.xz -C "$DATA"; fi
  if [[ ! -d $DATA/cifar10-jpeg/train ]]; then
    log "no CIFAR-10 JPEG folders in $DATA/cifar10-jpeg: train_fast and scale will fail (see the header)"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)" | tee -a "$OUT/gpu.txt"
}

run_bench_step() {
  local t
  t=$(budget_for bench_step 150 60) || return 0
  log "bench step: the baseline's pipeline vs our step vs Ray, ImageNet and CIFAR stems (up to ${t}s)"
  timeout "$t" python3 -m ray_job bench step --out "$OUT/bench_step.json" 2>&1 | tee "$OUT/bench_step.txt" | tail -n 20
}

run_vs_ddp() {
  local t
  t=$(budget_for vs_ddp 150 90) || return 0
  log "bench vs-ddp: torchrun vs Ray Train, the baseline's loop vs ours, 1 worker (up to ${t}s)"
  timeout "$t" python3 -m ray_job bench vs-ddp --workers 1 --model resnet50 --stem imagenet \
    --out "$OUT/vs_ddp.json" 2>&1 | tee "$OUT/vs_ddp.txt" | tail -n 12
}

run_checkpoints() {
  local t
  t=$(budget_for checkpoints 100 50) || return 0
  # every 98 steps: one CIFAR-10 epoch (50,000 images) at batch 512; the last one 8 steps before the end
  log "bench checkpoints: none vs sync vs async, a local folder (up to ${t}s)"
  timeout "$t" python3 -m ray_job bench checkpoints --model resnet50 --stem cifar --batch-size 512 \
    --steps 302 --every 98 --repeats 1 --storage /tmp/results/bench_ckpt --out "$OUT/checkpoints.json" \
    2>&1 | tee "$OUT/checkpoints.txt" | tail -n 8
}

run_fast_recipe() {
  local t
  t=$(budget_for train_fast 200 150) || return 0
  log "train --recipe fast on the CIFAR-10 JPEG copy (50k train / 10k test), 1 GPU (up to ${t}s)"
  timeout "$t" python3 -m ray_job train --recipe fast --data imagefolder \
    --data-dir "$DATA/cifar10-jpeg" --num-workers 1 --storage-path /tmp/results --name fast \
    --log-every 0 2>&1 | tee "$OUT/train_fast.txt" | grep -E "epoch [0-9]+/|results|best|error" || true
  cp /tmp/results/fast/{metrics.jsonl,summary.json,config.json} "$OUT/" 2>/dev/null || true
}

run_predict() {
  local t
  [[ -d /tmp/results/fast ]] || { log "predict: skipped, no train_fast run"; return 0; }
  t=$(budget_for predict 90 60) || return 0
  log "predict: the train_fast run's best checkpoint over the CIFAR-10 JPEG test folder, 1 GPU actor (up to ${t}s)"
  timeout "$t" python3 -m ray_job predict /tmp/results/fast --checkpoint latest --images "$DATA/cifar10-jpeg/test" \
    --out "$OUT/predictions.csv" --overwrite --batch-size 256 2>&1 | tee "$OUT/predict.txt" | grep -E "^predict:|^accuracy|error" || true
}

run_other_model() {
  local t
  t=$(budget_for other_model 90 60) || return 0
  log "train convnext_tiny on the CIFAR-10 JPEG copy, 1 GPU, 200 steps (up to ${t}s)"
  timeout "$t" python3 -m ray_job train --model convnext_tiny --data imagefolder --data-dir "$DATA/cifar10-jpeg" \
    --num-workers 1 --epochs 1 --steps-per-epoch 200 --batch-size 256 --storage-path /tmp/results \
    --name convnext --log-every 50 2>&1 | tee "$OUT/other_model.txt" | grep -E "img/s|epoch [0-9]+/|error" || true
  cp /tmp/results/convnext/metrics.jsonl "$OUT/other_model_metrics.jsonl" 2>/dev/null || true
}

run_bench_memory() {
  local t
  t=$(budget_for bench_memory 120 60) || return 0
  log "bench memory: vit_l_16 at 224 px, ddp vs fsdp, with and without activation checkpointing (up to ${t}s)"
  timeout "$t" python3 -m ray_job bench memory --model vit_l_16 --image-size 224 --workers 1 --batch-size 64 \
    --strategies ddp,fsdp --activation-checkpointing --steps 5 --out "$OUT/bench_memory.json" \
    2>&1 | tee "$OUT/bench_memory.txt" | tail -n 12
}

run_scale() {
  local t
  t=$(budget_for scale 120 90) || return 0
  log "scale sweep: 1 worker vs 2 workers sharing the GPU (0.5 GPU each, gloo) (up to ${t}s)"
  timeout "$t" python3 -m ray_job scale sweep --workers 1,2 --mode both --gpus-per-worker 0.5 \
    --model resnet50 --stem cifar --data imagefolder --data-dir "$DATA/cifar10-jpeg" \
    --batch-size 512 --steps-per-epoch 20 --storage-path /tmp/results --name scale_gpu \
    2>&1 | tee "$OUT/scale.txt" | tail -n 20
  cp /tmp/results/scale_gpu/scaling.* "$OUT/" 2>/dev/null || true
}

run_bench_compile() {
  local t
  t=$(budget_for bench_compile 120 60) || return 0
  log "bench step: CIFAR stem with torch.compile (up to ${t}s)"
  timeout "$t" python3 -m ray_job bench step --stems cifar --compile --no-ray --baseline-steps 20 \
    --out "$OUT/bench_compile.json" 2>&1 | tee "$OUT/bench_compile.txt" | tail -n 12
}

setup
run_bench_step || log "bench step failed or timed out (see bench_step.txt)"
run_vs_ddp || log "vs_ddp failed or timed out (see vs_ddp.txt)"
run_checkpoints || log "checkpoints failed or timed out (see checkpoints.txt)"
run_fast_recipe || log "fast recipe failed (see train_fast.txt)"
run_predict || log "predict failed or timed out (see predict.txt)"
run_other_model || log "other model failed or timed out (see other_model.txt)"
run_bench_memory || log "bench_memory failed or timed out (see bench_memory.txt)"
run_scale || log "scale failed or timed out (see scale.txt)"
run_bench_compile || log "bench_compile failed or timed out (see bench_compile.txt)"
log "done in ${SECONDS}s (budget ${BUDGET_S}s)"
