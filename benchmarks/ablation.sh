#!/usr/bin/env bash
# The CPU ablation recorded in RESULTS.md: the dense strategies with AdamW + cosine, then unified vs standard with
# Muon, with WSD and with experts. Same data, tokens and seed within each group. Usage: benchmarks/ablation.sh [DIR]
set -euo pipefail
out=${1:-runs/ablation}
common=(--model-size tiny --max-steps 400 --per-device-train-batch-size 8 --seq-len 256 --logging-steps 10
        --save-strategy no --report-to none --disable-tqdm true)
scalevec-ablate "${common[@]}" --output-dir "$out/dense-adamw-cosine"
scalevec-ablate "${common[@]}" --variants standard,unified --optim muon --output-dir "$out/dense-muon-cosine"
scalevec-ablate "${common[@]}" --variants standard,unified --lr-scheduler-type warmup_stable_decay \
    --lr-scheduler-kwargs '{"num_decay_steps": 80}' --output-dir "$out/dense-adamw-wsd"
scalevec-ablate "${common[@]}" --variants standard,unified --model-size tiny-moe --output-dir "$out/moe-adamw-cosine"
