#!/usr/bin/env bash
# The CPU ablation in RESULTS.md ("Ablation"): the tiny dense and MoE presets, AdamW and Muon, cosine and WSD, all
# six strategies and the weight-decay variants, three seeds. Within a seed every variant starts from the same
# matrices and reads the same batches. Every call passes --resume: finished runs are reused, so a rerun (after a
# kill, or with more variants or seeds) trains only what is missing, and the last call of a group writes its table.
# Run folders are SIZE/VARIANT-lrLR-seedSEED (since issue 36; runs of the older VARIANT-seedSEED layout are not
# reused).
#
# The miniature of the paper's study (issue 36) on real text, DATASET a folder prepared with `scalevec-data prepare
# CORPUS --output DATASET --seq-len 128` (e.g. the corpus of benchmarks/bench_data.py: the standard library and
# site-packages, ~90 M tokens): `miniature-weight-decay` (the weight-decay variants at the tiny size, 4,000 steps of
# 8 x 128 = 4.1 M tokens a run, 10x the groups above, 3 seeds: 18 runs) and `miniature-ladder` (none, standard and
# unified at 2x64, 3x96 and 4x128 for 5 tokens per non-embedding parameter: 0.46 M, 1.5 M and 3.7 M tokens, learning
# rates 1e-3 and 3e-3, seeds 0 and 1: 36 runs). Estimated from 60-step runs on the shared 2-core machine (one
# thread, 2026-12-06: 2x64 0.06-0.07 s a step of 1,024 tokens, 3x96 and 4x128 0.13-0.14 s, 4x192 0.18-0.19 s, 4x256
# 0.26-0.34 s): ~9 minutes a run and ~2.7 hours for the first, ~12 minutes per variant, learning rate and seed and
# ~2.4 hours for the second, on one process each, plus evaluation. Several processes may share a group's folder:
# FLAGs `--shard 0/2` and `--shard 1/2` (then once more without --shard, or with `--report-only true`, for the report).
#
# Usage: benchmarks/ablation.sh [DIR [GROUP [FLAG...]]]
#   GROUP: pilot, dense-adamw-cosine, weight-decay, input-decay-1, moe-adamw-cosine, dense-muon-cosine,
#   dense-adamw-wsd, moe-muon-cosine, moe-adamw-wsd, moe-weight-decay, muon-weight-decay, or all (default: all but the
#   pilot, in that order, which is the order of priority); miniature-weight-decay, miniature-ladder (need DATASET).
#   FLAGs go to every scalevec-ablate call of the group and override the defaults below, e.g.
#   `--variants standard,unified` or `--seeds 0,1`.
set -euo pipefail
out=${1:-runs/ablation}
group=${2:-all}
extra=("${@:3}")
# One thread per process: with two, every small op of a tiny model waits for a second core that another job holds
# (3.5 s against 0.8 s a step on the shared 2-core machine).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
steps=400
data=(--model-size tiny --per-device-train-batch-size 8 --seq-len 128 --save-strategy no --report-to none
      --disable-tqdm true --scale-stats false)
common=("${data[@]}" --max-steps "$steps" --logging-steps 10 --seeds 0,1,2 --resume)
wsd=(--lr-scheduler-type warmup_stable_decay --lr-scheduler-kwargs "{\"num_decay_steps\": $((steps / 5))}")

ablate() { scalevec-ablate "${common[@]}" "$@" "${extra[@]}"; }
# The miniature reads DATASET, with its own --seq-len, and evaluates once, at the end: at 1,024 tokens a step an
# evaluation of 2^20 tokens every 1000 steps would add about a third to the training.
miniature=(--dataset "${DATASET:-}" --model-size tiny --per-device-train-batch-size 8 --eval-strategy no
           --save-strategy steps --save-steps 500 --save-total-limit 1 --report-to none --disable-tqdm true
           --scale-stats false --resume)
if [[ $group == miniature-* && -z ${DATASET:-} ]]; then echo "$group needs DATASET, a prepared folder" >&2; exit 2; fi

case $group in
    # How fast the loss still falls, and the cost of a step: one run at the peak learning rate (no decay).
    pilot) scalevec-train "${data[@]}" --scale-preset standard --max-steps 600 --logging-steps 20 \
        --lr-scheduler-type constant_with_warmup --warmup-steps 15 --output-dir "$out/pilot" "${extra[@]}" ;;
    dense-adamw-cosine) ablate --variants strategies --output-dir "$out/dense-adamw-cosine" ;;
    # Same folder as the strategies: standard and unified are reused, and the last call tabulates all ten.
    weight-decay)
        ablate --variants standard-input-exempt,unified-input-exempt,unified-output-norm,unified-output-norm-decayed \
            --output-dir "$out/dense-adamw-cosine"
        ablate --variants all --output-dir "$out/dense-adamw-cosine" ;;
    # At 400 steps, decay 0.1 shrinks a scale by 2 % at most (exp(-0.1 x the summed learning rate 0.2)): input-role
    # scales decayed 10x harder (18 %), against exempt.
    input-decay-1) ablate --variants standard,standard-input-exempt --input-scale-weight-decay 1.0 \
        --output-dir "$out/dense-adamw-cosine-input-decay-1" ;;
    moe-adamw-cosine) ablate --variants strategies --model-size tiny-moe --output-dir "$out/moe-adamw-cosine" ;;
    dense-muon-cosine) ablate --variants strategies --optim muon --output-dir "$out/dense-muon-cosine" ;;
    dense-adamw-wsd) ablate --variants strategies "${wsd[@]}" --output-dir "$out/dense-adamw-wsd" ;;
    moe-muon-cosine) ablate --variants strategies --model-size tiny-moe --optim muon --output-dir "$out/moe-muon-cosine" ;;
    moe-adamw-wsd) ablate --variants strategies --model-size tiny-moe "${wsd[@]}" --output-dir "$out/moe-adamw-wsd" ;;
    # The decay variants beside the MoE's and Muon's strategies (their folders; the last call tabulates all ten).
    moe-weight-decay) ablate --variants all --model-size tiny-moe --output-dir "$out/moe-adamw-cosine" ;;
    muon-weight-decay) ablate --variants all --optim muon --output-dir "$out/dense-muon-cosine" ;;
    miniature-weight-decay)
        scalevec-ablate "${miniature[@]}" --variants weight-decay --max-steps 4000 --logging-steps 50 --seeds 0,1,2 \
            --output-dir "$out/miniature-weight-decay" "${extra[@]}" ;;
    miniature-ladder)
        scalevec-ablate "${miniature[@]}" --sizes 2x64,3x96,4x128 --tokens-per-parameter 5 \
            --variants none,standard,unified --learning-rates 1e-3,3e-3 --seeds 0,1 --logging-steps 20 \
            --output-dir "$out/miniature-ladder" "${extra[@]}" ;;
    all) for g in dense-adamw-cosine weight-decay input-decay-1 moe-adamw-cosine dense-muon-cosine dense-adamw-wsd \
                 moe-muon-cosine moe-adamw-wsd moe-weight-decay muon-weight-decay; do
             "$0" "$out" "$g" "${extra[@]}"
         done ;;
    *) echo "unknown group $group" >&2; exit 2 ;;
esac
