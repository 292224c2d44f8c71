#!/bin/bash
# Issue 16 (docs/benchmarks.md, "A global server killed, the job restarted from its last checkpoint"): the LM with
# the servers' AdamW, failure-free, then with its global server killed at 60 s and --restart-failed 1; prints each
# run's exit code and wall time. Compare the runs' final models with their checkpoints (worker-*-step-200.pt).
cd "$(dirname "$0")/../.." || exit 1
G=.venv/bin/geomx
CMD=".venv/bin/python examples/train_lm.py --model-size tiny --steps 200 --eval-every 50 --update-on server"
OUT=${OUT:-/tmp}
rm -rf "$OUT/rs-free" "$OUT/rs-kill"
s=$(date +%s.%N)
$G launch --wan lan --run-dir "$OUT/rs-free" --checkpoint-every 20 --quiet -- $CMD > "$OUT/rs-free.out" 2>&1
echo "failure-free rc=$? wall=$(echo "$(date +%s.%N) - $s" | bc) s"
s=$(date +%s.%N)
$G launch --wan lan --run-dir "$OUT/rs-kill" --checkpoint-every 20 --restart-failed 1 \
    --inject kill:global-server-0@60 -- $CMD > "$OUT/rs-kill.out" 2>&1
echo "killed and restarted rc=$? wall=$(echo "$(date +%s.%N) - $s" | bc) s"
