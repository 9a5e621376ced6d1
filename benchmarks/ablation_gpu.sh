#!/usr/bin/env bash
# The paper's study at its smallest sizes on a GPU cluster: a ladder of four sizes up to the paper's smallest model
# (6x384, 8x512, 10x640 and the `0.12b` preset: N = 9.7 M, 23 M, 45 M, 75 M non-embedding parameters; 4 sizes, so
# the scaling fit is L = E + A N^-a), each trained on 20 tokens per non-embedding parameter (Chinchilla's ratio),
# every variant (the six strategies and the weight-decay ones), three peak learning rates, three seeds (a claim's
# verdict needs 3 paired seeds at least: with 2 every row is "unresolved"): 360 runs. The schedule is
# warmup-stable-decay with a cooldown of the last 20 % of the steps, and each run branches the cooldowns of 0.25 and
# 0.5 of its budget from its stable phase (--decay-at): 4 sizes x 3 budgets, so the report fits L(N, D) too.
# One Slurm array task per shard, all writing into one shared folder; then one call writes the report. The CPU
# miniature of the same study is benchmarks/ablation.sh.
#
#   # Once, on a CPU node: a corpus of at least ~2 B tokens on the shared file system (the 0.12b runs read 1.5 B;
#   # less data repeats it, and the held-out loss then also measures memorisation).
#   scalevec-data prepare /data/fineweb-edu/*.parquet --output /shared/prepared/web --tokenizer gpt2 \
#       --seq-len 1024 --num-proc 32
#   # The grid: task I of the array trains shard I/N (N = the array's size); a requeued or repeated task resumes
#   # (--resume: finished runs are reused, an interrupted one continues from its last checkpoint).
#   DATASET=/shared/prepared/web sbatch --array=0-31 --gpus=1 --cpus-per-task=8 --time=08:00:00 \
#       benchmarks/ablation_gpu.sh /shared/runs/study
#   # The report, once every task has ended; it trains nothing. After a failed task (afterany) the report names the
#   # missing runs, marks the rows that need them "incomplete", and this call exits 3: rerun the failed tasks (same
#   # settings), then the report call again.
#   DATASET=/shared/prepared/web sbatch --dependency=afterany:JOBID \
#       benchmarks/ablation_gpu.sh /shared/runs/study report
#   # Without Slurm: `benchmarks/ablation_gpu.sh DIR` trains the whole grid on one GPU (~100 GPU-hours, below);
#   # `SHARD=I/N benchmarks/ablation_gpu.sh DIR` trains one share (one process per GPU: CUDA_VISIBLE_DEVICES=I).
#
# Usage: benchmarks/ablation_gpu.sh [DIR [report] [FLAG...]]   FLAGs go to every scalevec-ablate call.
# Settings (environment): DATASET (required: a prepared folder, or text / jsonl / parquet files), SIZES,
# TOKENS_PER_PARAMETER (20), LEARNING_RATES (1e-3,2e-3,4e-3), SEEDS (0,1,2), VARIANTS (all), SHARD. Every call of
# one study must pass the same settings: the grid, its split into shards and the run folders follow from them.
#
# Budget, ESTIMATED (no GPU was lent to the session that wrote this; nothing here has run on one): a step of
# 32 x 4 accumulation x 1024 = 131,072 tokens; model FLOPs per token as `scalevec.train.throughput` counts them
# (6 x matmul weights with a 50,257-token vocabulary + attention): 6x384 1,485 steps (0.19 B tokens, 3.9e16 FLOPs),
# 8x512 3,540 (0.46 B, 1.6e17), 10x640 6,891 (0.90 B, 4.9e17), 0.12b 11,520 (1.51 B, 1.2e18). At an assumed 30 %
# MFU on an H100 (300 TFLOP/s of its 989 in bf16), 2, 9, 28 and 68 minutes: 1.8 GPU-hours for one variant, learning
# rate and seed at all four sizes, ~160 GPU-hours for the 90 of the grid, ~5 hours of wall time on 32 GPUs (each
# shard holds an even share of every size). The small sizes will reach a lower MFU than 30 %, but they are 7 % of
# the FLOPs. The --decay-at branches train their cooldowns only: 20 % of 0.25 and of 0.5 of each run's steps, about
# +15 % compute (~185 GPU-hours, ~6 hours of wall time on 32 GPUs). Check the assumption on the first runs: each prints its train_runtime and MFU (the run folder's
# run_summary.json); with a lower MFU, lower TOKENS_PER_PARAMETER or the learning rates or seeds.
set -euo pipefail
out=${1:-runs/study-gpu}
mode=()
if [[ ${2:-} == report ]]; then
    mode=(--report-only true)
    set -- "$out" "${@:3}"
elif [[ -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    mode=(--shard "$((SLURM_ARRAY_TASK_ID - ${SLURM_ARRAY_TASK_MIN:-0}))/$SLURM_ARRAY_TASK_COUNT")
elif [[ -n ${SHARD:-} ]]; then
    mode=(--shard "$SHARD")
fi
: "${DATASET:?set DATASET to a prepared folder (scalevec-data prepare) or text files: GPU nodes need local data}"
scalevec-ablate --sizes "${SIZES:-6x384,8x512,10x640,0.12b}" --tokens-per-parameter "${TOKENS_PER_PARAMETER:-20}" \
    --learning-rates "${LEARNING_RATES:-1e-3,2e-3,4e-3}" --seeds "${SEEDS:-0,1,2}" --variants "${VARIANTS:-all}" \
    --dataset "$DATASET" --bf16 true --tf32 true --attn-implementation sdpa \
    --per-device-train-batch-size 32 --gradient-accumulation-steps 4 --warmup-steps 0.05 \
    --lr-scheduler-type warmup_stable_decay --lr-scheduler-kwargs '{"num_decay_steps": 0.2}' --decay-at 0.25,0.5,1 \
    --logging-steps 50 --save-strategy steps --save-steps 1000 --save-total-limit 1 --report-to none \
    --disable-tqdm true --scale-stats false --dataloader-num-workers 4 --resume \
    "${mode[@]}" --output-dir "$out" "${@:2}"
if [[ ${mode[0]:-} == --report-only ]]; then
    missing=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["counts"]["missing"])' "$out/results.json")
    if ((missing > 0)); then
        echo "ablation_gpu.sh: the report is INCOMPLETE: $missing runs of the grid are missing (results.md names them);" \
            "rerun the failed shards with the same settings, then the report call" >&2
        exit 3
    fi
fi
