#!/usr/bin/env bash
# The lighthouse and two replica groups, each its own torchrun, as torchft's README runs
# them; the job ends when both groups have trained every step.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
steps="${1:-40}"
export TORCHFT_LIGHTHOUSE="http://localhost:${LIGHTHOUSE_PORT:-29510}"
torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 \
    --bind "[::]:${LIGHTHOUSE_PORT:-29510}" &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null || true' EXIT
groups=()
for group in 0 1; do
    REPLICA_GROUP_ID=$group NUM_REPLICA_GROUPS=2 torchrun --nnodes=1 --nproc-per-node=1 \
        --max-restarts=3 --monitor-interval=0.1 --master-port=$((29600 + group)) \
        --log-dir="$LOG_DIR/group$group" --redirects=3 "$here/train.py" "$steps" &
    groups+=($!)
done
status=0
for pid in "${groups[@]}"; do wait "$pid" || status=$?; done
exit "$status"
