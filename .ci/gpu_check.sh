#!/usr/bin/env bash
# The GPU check of issues 4 and 5, prepared to run as is on the lent GPU machine (one H200) through
# the device tool, in one call of about 10 minutes:
#   printf '.whl/\n.data/\n' >> .git/info/exclude
#   ../shared/device/make_kit.sh .whl && mkdir -p .data && cp ../shared/data/cifar10-jpeg.tar.xz .data/
#   device run, carry [".whl", ".data"], timeout 600:   bash .ci/gpu_check.sh
# It writes everything it measured under $OUT (the device tool brings that folder back):
#   gpu.txt, bench.{txt,json}, bench_compile.{txt,json}, train_fast.txt + metrics/summary JSON,
#   scale.txt + scaling.{md,json,png}.
set -euo pipefail
OUT=${OUT:-/tmp/gpu_check_out}
DATA=${DATA:-/tmp/data}
mkdir -p "$OUT" "$DATA"
log() { printf '%s [gpu_check] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/log.txt"; }

setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0
  tar xJf .data/cifar10-jpeg.tar.xz -C "$DATA"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)" | tee -a "$OUT/gpu.txt"
}

run_bench() {
  log "bench: seed pipeline vs fast path vs Ray, ImageNet and CIFAR stems"
  timeout 240 python3 -m ray_job bench --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -n 20
  log "bench: CIFAR stem with torch.compile"
  timeout 150 python3 -m ray_job bench --stems cifar --compile --no-ray --seed-steps 20 \
    --out "$OUT/bench_compile.json" 2>&1 | tee "$OUT/bench_compile.txt" | tail -n 12
}

run_fast_recipe() {
  log "train --recipe fast on the CIFAR-10 JPEG copy (50k train / 5k test), 1 GPU"
  timeout 300 python3 -m ray_job train --recipe fast --data imagefolder \
    --data-dir "$DATA/cifar10-jpeg" --num-workers 1 --storage-path /tmp/results --name fast \
    --log-every 0 2>&1 | tee "$OUT/train_fast.txt" | grep -E "epoch [0-9]+/|results|best|error" || true
  cp /tmp/results/fast/{metrics.jsonl,summary.json,config.json} "$OUT/" 2>/dev/null || true
}

run_scale() {
  log "scale: 1 worker vs 2 workers sharing the GPU (gloo, 0.5 GPU each)"
  timeout 300 python3 -m ray_job scale --workers 1,2 --mode both --gpus-per-worker 0.5 \
    --backend gloo --model resnet50 --stem cifar --data imagefolder --data-dir "$DATA/cifar10-jpeg" \
    --batch-size 512 --steps-per-epoch 30 --storage-path /tmp/results --name scale_gpu \
    2>&1 | tee "$OUT/scale.txt" | tail -n 20
  cp /tmp/results/scale_gpu/scaling.* "$OUT/" 2>/dev/null || true
}

setup
run_bench || log "bench failed (see bench.txt)"
run_fast_recipe || log "fast recipe failed (see train_fast.txt)"
run_scale || log "scale failed (see scale.txt)"
log "done"
