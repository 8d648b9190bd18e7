#!/bin/bash
# Decode step before and after the fewer-kernels change (issue 15, item 2): probe.py in the
# source tree of commit 10ca40f ("before") and of this checkout ("after"), with 1 and 2 threads,
# on a quiet machine and with one competing CPU-bound process. From the repository root:
#   bash results/decode-step/run.sh > results/decode-step/results.txt && python3 results/decode-step/summary.py
# Each condition runs twice, before and after alternating, so a drift of the machine shows.
set -euo pipefail
here=results/decode-step
before=$(mktemp -d)/kernelmix-before
git worktree add --quiet --detach "$before" 10ca40f
trap 'git worktree remove --force "$before"' EXIT
for load in quiet busy; do
  if [ $load = busy ]; then python3 -c "while True: pass" & hog=$!; sleep 2; fi
  for threads in 1 2; do
    for rep in 1 2; do
      for tree in before after; do
        src=$([ $tree = before ] && echo "$before/src" || echo "$PWD/src")
        PYTHONPATH=$src python3 $here/probe.py $threads | sed "s/^/$load threads=$threads rep=$rep $tree: /"
      done
    done
  done
  if [ $load = busy ]; then kill $hog; fi
done
