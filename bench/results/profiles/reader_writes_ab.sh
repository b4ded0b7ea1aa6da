#!/bin/bash
set -u
# Side by side, in the served stack: 4 rounds of `python -m bench.serving --only durable --only bare
# --repeat 4` from each of two checkouts (A=/path, B=/path, each with its own .venv), order
# alternating, with the router-thread sampler on (PROFILES=the absolute path of
# bench/results/profiles); OUT/SIDE-ROUND/PID.json per router process. Compare with
# router_threads_show.py on a folder holding one side's PID.json files.
out=${OUT:-/tmp/abr}; rm -rf $out; mkdir -p $out
for r in 1 2 3 4; do
  order="A B"; [ $((r % 2)) -eq 0 ] && order="B A"
  for side in $order; do
    if [ $side = A ]; then dir=$A; else dir=$B; fi
    mkdir -p $out/$side-$r
    (cd $dir && ROUTER_THREADS_OUT=$out/$side-$r PYTHONPATH=$PROFILES/router_threads .venv/bin/python -m bench.serving --only durable --only bare --repeat 4 --out $out/$side-$r.bench > $out/$side-$r.log 2>&1)
    echo "$(date +%T) $r $side" >> $out/progress
  done
done
