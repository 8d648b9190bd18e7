#!/usr/bin/env bash
# How far does each mixer's final loss move when its training is nudged by a rounding-sized
# amount? The main job's settings (mini preset, 300 steps x 2,048 tokens, lr 3e-3), at T=256, seeds
# 0 and 1, each trained three times: at lr 3e-3 and at lr 3e-3 x (1 + 1e-6) and x (1 + 2e-6) --
# a change of a few float32 ulps in every update, far below anything a user would tune. The spread
# over those three is the loss's sensitivity to rounding (a different thread count or CPU changes
# results by as much); the spread over seeds is the usual one. Run from the repository root:
#   bash results/rounding/run.sh && python3 results/rounding/answer.py
# Each compare reuses its finished runs, so an interrupted run continues where it stopped.
set -euo pipefail
common=(--mixers softmax,cubit,deltaformer,performer --lengths 256 --seeds 0,1 --threads 2)
for lr in 0.003 0.003000003 0.003000006; do
  kernelmix compare "${common[@]}" --lr "$lr" --out "results/rounding/lr-$lr"
done
