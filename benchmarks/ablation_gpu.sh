#!/usr/bin/env bash
# The ablation of benchmarks/ablation.sh at the paper's smallest size, for one GPU and 15 minutes: the `0.12b`
# preset (12 x 768; 82 M parameters with the embedded 4k vocabulary, 125 M with a 32k one), bf16, the six
# strategies, one seed by default, then the same table as on CPU (mean ± std and paired differences once SEEDS
# holds several seeds).
#
# Budget, estimated (not measured: no GPU was lent when this was written): a 0.12b step costs about 6 x 82 M
# + attention ~ 0.6 GFLOP per token; an H200 gives ~790 TFLOP/s in bf16 matmuls, so even at 12 % of that in eager
# mode (small hidden size, no torch.compile) it trains ~150k tokens/s. STEPS=300 of 32 x 1024 tokens = 9.8 M tokens
# a run, ~65 s, plus ~25 s to build, evaluate and save: ~9 minutes for six runs, which leaves room for the machine's
# start and the first run's tokenizer training within 15 minutes. If the first run prints more than
# `train_runtime` 90 s, lower STEPS; with more time, add seeds (SEEDS=0,1,2 triples the time).
#
# Data: DATASET (local text / jsonl / parquet files; the GPU machine has no network) of at least ~40 MB of text,
# or by default the embedded corpus, which 9.8 M tokens repeat ~17 times: the held-out loss then also measures
# memorisation, unlike the paper's single pass. Needs `pip install -e ".[train]"` (where no index is reachable,
# carry wheels of datasets, evaluate, dill and multiprocess).
#
# Usage: benchmarks/ablation_gpu.sh [DIR [FLAG...]]     FLAGs go to scalevec-ablate, e.g. --variants weight-decay
set -euo pipefail
out=${1:-runs/ablation-gpu}
steps=${STEPS:-300}
dataset=()
if [[ -n ${DATASET:-} ]]; then dataset=(--dataset "$DATASET"); fi
scalevec-ablate --model-size 0.12b --bf16 true --tf32 true --attn-implementation sdpa \
    --per-device-train-batch-size 32 --seq-len 1024 --max-steps "$steps" --warmup-steps 0.05 --learning-rate 1e-3 \
    --logging-steps 10 --save-strategy no --report-to none --disable-tqdm true --scale-stats false \
    --dataloader-num-workers 4 --seeds "${SEEDS:-0}" --resume "${dataset[@]}" --output-dir "$out" "${@:2}"
