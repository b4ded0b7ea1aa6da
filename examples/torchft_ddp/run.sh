#!/usr/bin/env bash
# The lighthouse and two replica groups, each its own torchrun, as torchft's README runs
# them; the job ends when both groups have trained every step.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
steps="${1:-40}"
# Three ports the kernel says are free now, held together so that they differ (the
# lighthouse's, unless LIGHTHOUSE_PORT gives it, and each group's store): fixed ones would
# let two runs on one machine meet each other's lighthouse and stores.
read -r -a ports < <(python3 -c 'import socket
held = [socket.socket() for _ in range(3)]
for s in held:
    s.bind(("", 0))
print(*(s.getsockname()[1] for s in held))')
lighthouse_port="${LIGHTHOUSE_PORT:-${ports[0]}}"
export TORCHFT_LIGHTHOUSE="http://localhost:$lighthouse_port"
torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 \
    --bind "[::]:$lighthouse_port" &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null || true' EXIT
groups=()
for group in 0 1; do
    REPLICA_GROUP_ID=$group NUM_REPLICA_GROUPS=2 torchrun --nnodes=1 --nproc-per-node=1 \
        --max-restarts=3 --monitor-interval=0.1 --master-port="${ports[1 + group]}" \
        --log-dir="$LOG_DIR/group$group" --redirects=3 "$here/train.py" "$steps" &
    groups+=($!)
done
status=0
for pid in "${groups[@]}"; do wait "$pid" || status=$?; done
exit "$status"
