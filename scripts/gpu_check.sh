#!/usr/bin/env bash
# Every GPU check in one go, on a node where lightning_ray runs (`make setup`, or the offline bundle on PYTHONPATH):
# the `gpu` tests (with each iteration's phase split; LoRA with an adapter per agent among them), a whole iteration's
# phase split on a Qwen2.5-0.5B-shaped model (random init, PPO: the colocated job at a real model's size), the HF
# engine's batched decoding against one call at a time on that model and its sampler, the learner's
# update (full and LoRA) against a bare PyTorch loop and the weight sync against a pinned host copy, on random-init
# Qwen2.5 shapes, a weight update landing on calls in flight per serve.drain, then asynchronous vs synchronous
# training of the tiny model with learner and engine sharing the GPU. Logs and JSON lines go to OUT.
#   scripts/gpu_check.sh [OUT]   (default gpu-check/; PYTHON=... picks the interpreter; NO_BENCH=1: tests only;
#                                 DEADLINE=<epoch seconds>: each step is cut off there, for a node lent for a while;
#                                 STEPS="tests async ...": only those of tests, iteration-0.5b, engine-0.5b,
#                                 sampling, update-0.5b, update-1.5b, weight-sync, drain, async, in that order,
#                                 for a node lent for less than all of them; PYTEST_ARGS="-k vllm": the tests'
#                                 step runs only those). Exits non-zero where a step failed.
set -uo pipefail
py=${PYTHON:-python3}
out=$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)
cd "$(dirname "$0")/.."  # the repository: tests/, benchmarks/
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
start=$(date +%s)
deadline=${DEADLINE:-$(( start + 86400 ))}
[ -n "${NO_BENCH:-}" ] && STEPS=tests
failed=0
lap() { echo "== $1: rc=$2, $(( $(date +%s) - start )) s in all" | tee -a "$out/summary.txt"; }
step() {  # step NAME LOG COMMAND...: runs it (if STEPS names it) until the deadline, its JSON lines into results.jsonl
    local name=$1 log=$2 left=$(( deadline - $(date +%s) )); shift 2
    [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $name "* ]] || return 1
    if (( left <= 10 )); then lap "$name (skipped: past the deadline)" -; failed=1; return 1; fi
    timeout -k 20 "$left" "$@" > "$out/$log" 2>&1  # -k: a step that hangs in its shutdown is killed too
    local rc=$?; lap "$name" $rc
    # what a step cut off left running (the local Ray cluster it started, Serve's replicas) holds GPU memory the next
    # one needs (not where the steps joined a cluster of RAY_ADDRESS: that one is not ours to stop)
    if (( rc == 124 || rc == 137 )) && [ -z "${RAY_ADDRESS:-}" ]; then
        $py -m ray.scripts.scripts stop --force > /dev/null 2>&1
    fi
    (( rc == 0 )) || failed=1
    # each line tagged with its step and run: runs into the same OUT (STEPS=... one after another) append
    grep '^{' "$out/$log" | sed "s/^{/{\"step\": \"$name\", \"run\": $start, /" >> "$out/results.jsonl"
    return 0
}
echo "== run $start ($(date -u +%FT%TZ)): ${STEPS:-every step}" >> "$out/summary.txt"
nvidia-smi -L | tee -a "$out/summary.txt" || { echo "no NVIDIA GPU answers here" >&2; exit 1; }

step tests pytest.log $py -m pytest -m gpu -rP -p no:cacheprovider ${PYTEST_ARGS:-} \
    tests/integration/trainer/test_gpu.py tests/integration/weight_sync/test_weight_transports.py \
    && tail -1 "$out/pytest.log" | tee -a "$out/summary.txt"
step iteration-0.5b iteration-0.5b.log $py benchmarks/iteration.py --models qwen2.5-0.5b
# the HF engine's batch against the same engine one call at a time, at that size (max_tokens each: ignore_eos)
step engine-0.5b engine-0.5b.log $py benchmarks/engine_throughput.py --model qwen2.5-0.5b --engines hf hf_one \
    --prompts digits --requests 32 --concurrency 32 --max-tokens 64
# its sampler: a batch's rows at once against a row at a time (Qwen2.5's vocabulary; seconds)
step sampling sampling.log $py benchmarks/sampling.py
for model in qwen2.5-0.5b qwen2.5-1.5b; do  # 64 x 1,024 tokens, as the GPU node's bare-PyTorch anchors
    # on the 0.5B, LoRA's update on the same batch too, on all 24 layers and on the top 12 (against full
    # fine-tuning's: 1.21-1.30x on 2 CPU cores), and a frozen base's bare step (LoRA's floor: 1.59-1.77x there)
    step "update-${model#qwen2.5-}" "update-$model.log" $py benchmarks/update_speed.py --model $model --prompt-tokens 768 \
        --response-tokens 256 --transitions 64 --micro-batch-tokens 8192 --layouts 1x4 --steps 3 \
        $([ $model = qwen2.5-0.5b ] && echo --lora --lora-layers 12 --frozen-bound)
done
step weight-sync weight-sync.log $py benchmarks/weight_sync.py --models 0.5b 1.5b --transports cuda_ipc
# a weight update landing on calls in flight, per serve.drain (the HF engine on the GPU, weights over CUDA IPC)
step drain drain.log $py benchmarks/partial_rollouts.py --calls 16 --tokens 448 experiment=calc_tiny \
    placement=colocated engine.sleep_while_training=false
# one GPU, the engine awake while the learner trains (no sleeping: that is what lets rollouts overlap the update)
step async async.log $py benchmarks/async_training.py --runs=sync,async experiment=calc_tiny \
    placement=colocated engine.sleep_while_training=false rollout.tasks_per_iteration=16 \
    rollout.agents_per_worker=16 trainer.iterations=4 trainer.eval_every=4 task.eval_size=32
grep -s "\"run\": $start," "$out/results.jsonl"
exit $failed  # non-zero where a step failed or was cut off
