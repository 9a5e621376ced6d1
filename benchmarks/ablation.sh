#!/usr/bin/env bash
# The CPU ablation in RESULTS.md ("Ablation"): the tiny dense and MoE presets, AdamW and Muon, cosine and WSD, all
# six strategies and the weight-decay variants, three seeds. Within a seed every variant starts from the same
# matrices and reads the same batches. Every call passes --resume: finished runs are reused, so a rerun (after a
# kill, or with more variants or seeds) trains only what is missing, and the last call of a group writes its table.
# Run folders are SIZE/VARIANT-lrLR-seedSEED (since issue 36; runs of the older VARIANT-seedSEED layout are not
# reused).
#
# The miniature of the paper's study (issue 36, RESULTS.md "CPU miniature of the paper's study") on real text,
# DATASET a folder prepared with `scalevec-data prepare CORPUS --output DATASET --seq-len 256` (the corpus of
# benchmarks/bench_data.py: the standard library and site-packages, 86 M training tokens). Every size trains 5.56
# tokens per non-embedding parameter (so that 4x128 runs exactly 2,000 steps of 8 x 256 tokens) and is evaluated
# once, at the end, on the same 2^19 held-out tokens. `miniature-ladder`: none, standard and unified at 2x64, 3x96
# and 4x128 (0.51 M, 1.6 M and 4.1 M tokens), learning rates 1e-3 and 3e-3, seeds 0 and 1 (36 runs);
# `miniature-ladder-lr`: the same at 1e-2 for the two smaller sizes (12 runs; at 3x96 1e-2 was already 0.4 nats
# worse than 3e-3, so 4x128 was not run there); `miniature-weight-decay`: the decay variants and the decay toward 1
# at 4x128, learning rate 3e-3, seeds 0, 1 and 2 (24 runs, 4 shared with the ladder). On the shared 2-core machine,
# one thread and two processes: about 1, 3.5 and 10-15 minutes a run. Several processes may share the folder: FLAGs
# `--shard 0/2` and `--shard 1/2`. The tables of RESULTS.md are `miniature-ladder --learning-rates 1e-3,3e-3,1e-2
# --report-only true` and `miniature-weight-decay --report-only true` (each writes the folder's report). Since
# issue 42 a report judges only complete sweeps with 3 seeds or more: these groups' reports mark 4x128 incomplete (1e-2
# was not run there) and their 2-seed rows unresolved. The learning rate is chosen on one half of the held-out blocks
# and Δ measured on the other, so runs from before issue 42 (which logged no halves) have no rate to select.
# `miniature-wsd` (issue 42, RESULTS.md "The CPU miniature under the verdict rules"): none, standard and unified at
# five sizes from 1x32 to 2x64, learning rates 3e-3 and 1e-2, seeds 0, 1 and 2 (90 runs), warmup-stable-decay with
# a cooldown of the last 20 % and the budgets 0.25, 0.5 and 1 (--decay-at), evaluated on 2^17 held-out tokens, each
# final model also with int8 and int4 weights (--quantize); about 70 minutes on two idle cores as two shards. Its
# DATASET is the first 12 M tokens of the same corpus (`bench_data.build_corpus(folder, 12e6)`, prepared likewise).
# The 4x128 models of issue 43 (RESULTS.md "The miniature's 4x128 models"): `miniature-ladder --sizes 4x128
# --learning-rates 3e-3 --seeds 0,1,2 --quantize int8,int4` on that DATASET, then benchmarks/miniature_tasks.py.
# The every-claim study (issue 50, RESULTS.md "The every-claim study: the power plan"): a 512-token vocabulary, so
# that non-embedding parameters are the larger part of every model, WSD budgets, five seeds, three learning rates per
# size. `every-claim-data` writes its DATASET, DIR/data-v512 (the miniature-wsd's 12 M-token corpus, tokenized by
# the embedded BPE trained to 512 tokens); then `every-claim-headline` (none, standard and unified at 4x128, 50 runs,
# standard above 6e-3 as well), `every-claim-headline-seeds` (seeds 5-9 at their best rates, 15 runs),
# `every-claim-variants` (the other strategies and the weight-decay variants at 4x128, 105 runs) and
# `every-claim-ladder` (none, standard and unified at 2x64, 2x96 and 3x96, 135 runs), all in DIR/every-claim;
# `every-claim-moe` and `every-claim-muon` (none, standard and unified at 3x96, 45 runs each, folders of their own).
#
# Usage: benchmarks/ablation.sh [DIR [GROUP [FLAG...]]]
#   GROUP: pilot, dense-adamw-cosine, weight-decay, input-decay-1, moe-adamw-cosine, dense-muon-cosine,
#   dense-adamw-wsd, moe-muon-cosine, moe-adamw-wsd, moe-weight-decay, muon-weight-decay, or all (default: all but the
#   pilot, in that order, which is the order of priority); miniature-ladder, miniature-ladder-lr,
#   miniature-weight-decay, miniature-wsd, every-claim-headline, every-claim-headline-seeds, every-claim-variants,
#   every-claim-ladder, every-claim-moe, every-claim-muon (need DATASET); every-claim-data.
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
# The miniature reads DATASET, with its own --seq-len, and evaluates once, at the end: at 2,048 tokens a step an
# evaluation of 2^20 tokens every 1000 steps would add about a sixth to the training.
miniature=(--dataset "${DATASET:-}" --model-size tiny --tokens-per-parameter 5.5555 --per-device-train-batch-size 8
           --eval-strategy no --max-eval-tokens 524288 --save-strategy steps --save-steps 500 --save-total-limit 1
           --logging-steps 50 --report-to none --disable-tqdm true --scale-stats false --resume
           --output-dir "$out/miniature")
miniature() { scalevec-ablate "${miniature[@]}" "$@" "${extra[@]}"; }
every_claim=(--dataset "${DATASET:-}" --model-size tiny --config-overrides '{"vocab_size": 512}'
             --tokens-per-parameter 5.5555 --per-device-train-batch-size 8 --eval-strategy no --max-eval-tokens 131072
             --save-strategy steps --save-steps 500 --save-total-limit 1 --logging-steps 50 --report-to none
             --disable-tqdm true --scale-stats false --resume --warmup-steps 0.05
             --lr-scheduler-type warmup_stable_decay --lr-scheduler-kwargs '{"num_decay_steps": 0.2}'
             --decay-at 0.25,0.5,1 --quantize int8,int4 --seeds 0,1,2,3,4 --output-dir "$out/every-claim")
every_claim() { scalevec-ablate "${every_claim[@]}" "$@" "${extra[@]}"; }
if [[ ($group == miniature-* || ($group == every-claim-* && $group != every-claim-data)) && -z ${DATASET:-} ]]; then echo "$group needs DATASET, a prepared folder" >&2; exit 2; fi

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
    miniature-ladder) miniature --sizes 2x64,3x96,4x128 --variants none,standard,unified --learning-rates 1e-3,3e-3 \
        --seeds 0,1 ;;
    miniature-ladder-lr) miniature --sizes 2x64,3x96 --variants none,standard,unified --learning-rates 1e-2 --seeds 0,1 ;;
    miniature-wsd) miniature --sizes 1x32,2x32,3x32,4x32,2x64 --variants none,standard,unified --learning-rates 3e-3,1e-2 \
        --seeds 0,1,2 --warmup-steps 0.05 --lr-scheduler-type warmup_stable_decay \
        --lr-scheduler-kwargs '{"num_decay_steps": 0.2}' --decay-at 0.25,0.5,1 --quantize int8,int4 \
        --max-eval-tokens 131072 --save-strategy no --logging-steps 5 --output-dir "$out/miniature-wsd" ;;
    miniature-weight-decay) miniature --sizes 4x128 --learning-rates 3e-3 --seeds 0,1,2 \
        --variants weight-decay,standard-decay-to-one,unified-decay-to-one ;;
    every-claim-data) python - "$out" "$(dirname "$0")" <<'PYTHON'
import subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import bench_data
from scalevec.data.corpus import default_tokenizer
out = Path(sys.argv[1])
corpus = bench_data.build_corpus(out, 12e6)
default_tokenizer(512).save_pretrained(out / "tokenizer-512")
subprocess.run(["scalevec-data", "prepare", str(corpus), "--output", str(out / "data-v512"), "--tokenizer",
                str(out / "tokenizer-512"), "--seq-len", "256", "--quiet"], check=True)
PYTHON
        ;;
    every-claim-headline) every_claim --sizes 4x128 --variants none,standard,unified --learning-rates 1.5e-3,3e-3,6e-3
        every_claim --sizes 4x128 --variants standard --learning-rates 1.2e-2 ;;  # standard's best was 6e-3, the edge
    # Seeds 5-9 at the headline's best rates as seeds 0-4 chose them (RESULTS.md, "Decision"): they narrow its rows
    # and take no part in the choice.
    every-claim-headline-seeds) every_claim --sizes 4x128 --variants none,unified --learning-rates 3e-3 --seeds 5,6,7,8,9
        every_claim --sizes 4x128 --variants standard --learning-rates 6e-3 --seeds 5,6,7,8,9 ;;
    every-claim-variants) every_claim --sizes 4x128 --variants strategies,weight-decay \
        --learning-rates 1.5e-3,3e-3,6e-3 ;;
    every-claim-ladder) every_claim --sizes 2x64,2x96,3x96 --variants none,standard,unified \
        --learning-rates 3e-3,6e-3,1.2e-2 ;;
    # The claims with an MoE model and with Muon, one size each, in folders of their own (the preset and the optimizer
    # apply to every run of a call); the ladder's rates at 3x96 first, extended where the best lands on an edge.
    every-claim-moe) every_claim --model-size tiny-moe --sizes 3x96 --variants none,standard,unified \
        --learning-rates 3e-3,6e-3,1.2e-2 --output-dir "$out/every-claim-moe" ;;
    every-claim-muon) every_claim --optim muon --sizes 3x96 --variants none,standard,unified \
        --learning-rates 3e-3,6e-3,1.2e-2 --output-dir "$out/every-claim-muon" ;;
    all) for g in dense-adamw-cosine weight-decay input-decay-1 moe-adamw-cosine dense-muon-cosine dense-adamw-wsd \
                 moe-muon-cosine moe-adamw-wsd moe-weight-decay muon-weight-decay; do
             "$0" "$out" "$g" "${extra[@]}"
         done ;;
    *) echo "unknown group $group" >&2; exit 2 ;;
esac
