#!/usr/bin/env bash
# The length sweep of issue 14: softmax and Cubit at training lengths 256, 1024 and 4096, seeds 0
# and 1, the main job's 614,400 training tokens per run (150 steps x 4,096 tokens: a step must hold
# one 4,096-token window), first at equal tokens, then at equal training FLOPs (softmax's for those
# tokens; Cubit gets fewer steps). Run from the repository root:
#   bash results/length-sweep/run.sh
# Each compare reuses its finished runs, so an interrupted sweep continues where it stopped.
set -euo pipefail
common=(--mixers softmax,cubit --lengths 256,1024,4096 --seeds 0,1 --tokens-per-step 4096 --steps 150
        --threads 2)
kernelmix compare "${common[@]}" --budget tokens --out results/length-sweep/tokens
kernelmix compare "${common[@]}" --budget flops --out results/length-sweep/flops
# T=4096 again with twice the steps (300 x 4,096 tokens), once the first two showed both models
# still above the bigram line there at 150 steps
kernelmix compare --mixers softmax,cubit --lengths 4096 --seeds 0,1 --tokens-per-step 4096 --steps 300 --threads 2 \
  --budget tokens --out results/length-sweep/tokens-4096-300
