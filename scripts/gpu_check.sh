#!/usr/bin/env bash
# Every GPU check in one go, on a node where lightning_ray runs (`make setup`, or the offline bundle on PYTHONPATH):
# the `gpu` tests (with each iteration's phase split), then the learner's update against a bare PyTorch loop and the
# weight sync against a pinned host copy, on random-init Qwen2.5 shapes. Logs and JSON lines go to OUT.
#   scripts/gpu_check.sh [OUT]        (default gpu-check/; PYTHON=... picks the interpreter; NO_BENCH=1: tests only)
set -uo pipefail
py=${PYTHON:-python3}
out=$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)
cd "$(dirname "$0")/.."  # the repository: tests/, benchmarks/
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
start=$(date +%s)
lap() { echo "== $1: rc=$2, $(( $(date +%s) - start )) s in all" | tee -a "$out/summary.txt"; }
nvidia-smi -L | tee "$out/summary.txt" || { echo "no NVIDIA GPU answers here" >&2; exit 1; }

$py -m pytest -m gpu -rP -p no:cacheprovider tests/integration/trainer/test_gpu.py \
    tests/integration/weight_sync/test_weight_transports.py > "$out/pytest.log" 2>&1
rc=$?; lap "gpu tests ($(tail -1 "$out/pytest.log"))" $rc
[ -n "${NO_BENCH:-}" ] && exit 0
for model in qwen2.5-0.5b qwen2.5-1.5b; do  # 64 x 1,024 tokens, as the GPU node's bare-PyTorch anchors
    $py benchmarks/update_speed.py --model $model --prompt-tokens 768 --response-tokens 256 --transitions 64 \
        --micro-batch-tokens 8192 --layouts 1x4 --steps 3 > "$out/update-$model.log" 2>&1
    rc=$?; lap "update $model" $rc
    grep '^{' "$out/update-$model.log" >> "$out/results.jsonl"
done
$py benchmarks/weight_sync.py --models 0.5b 1.5b --transports cuda_ipc object_store > "$out/weight-sync.log" 2>&1
rc=$?; lap "weight sync" $rc
grep '^{' "$out/weight-sync.log" >> "$out/results.jsonl"
cat "$out/results.jsonl"
