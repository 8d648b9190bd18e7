#!/bin/bash
cd "$(dirname "$0")"
for rep in 1 2; do
for load in quiet busy; do
  if [ $load = busy ]; then python -c "while True: pass" & HOG=$!; sleep 62; fi
  for t in 2 1 auto; do python probe.py $t | sed "s/^/$load rep$rep $(cut -d' ' -f1 /proc/loadavg) /"; done
  env OMP_WAIT_POLICY=PASSIVE python probe.py 2 | sed "s/^/$load rep$rep passive /"
  if [ $load = busy ]; then kill $HOG; sleep 30; fi
done
done
