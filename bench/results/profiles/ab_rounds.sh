#!/bin/bash
# Side by side: ROUNDS rounds of `python -m bench --only ROW --repeat REPEAT`, one in each of
# two checkouts per round (A=/path, B=/path, each with its own .venv), the order alternating
# (A first in odd rounds); each run's record is copied to OUT/SIDE-ROUND.json.
#   A=/tmp/abA B=/tmp/abB bash ab_rounds.sh 4 hot_spare 4 /tmp/ab1
# ab_rows_show.py OUT ROW compares the two sides.
set -u
rounds=$1 row=$2 repeat=$3 out=$4
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  order="A B"; [ $((r % 2)) -eq 0 ] && order="B A"
  for side in $order; do
    if [ "$side" = A ]; then dir=$A; else dir=$B; fi
    (cd "$dir" && .venv/bin/python -m bench --only "$row" --repeat "$repeat" \
        > "$out/$side-$r.log" 2>&1; cp bench/results/partial.json "$out/$side-$r.json")
    echo "$(date +%T) round $r side $side done"
  done
done
