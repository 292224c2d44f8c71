#!/bin/bash
# Issue 16 (docs/benchmarks.md, "Workers and a DC killed and restarted: they rejoin the running job"): the LM with the
# servers' AdamW over the transpacific WAN, DCS (2) DCs x 2 workers, failure-free, then with a random worker killed
# every 60 s and DC b's local server killed at 90 s (with 3 DCs, DC c's frozen at 150 s as well), each restarted 30 s
# later (--rejoin-after 30). Prints each run's exit code and wall time; the runs' logs and results are in $OUT/rj-free and $OUT/rj-faults (rejoin_bench.py reads them).
# The roles inherit GEOMX_ variables: GEOMX_HEARTBEAT_TIMEOUT=10 gives the fixed-deadline column (measured is the default).
cd "$(dirname "$0")/../.." || exit 1
G=.venv/bin/geomx
STEPS=${STEPS:-250}
SEED=${SEED:-1}
DCS=${DCS:-2}
FREEZE=""
[ "$DCS" -ge 3 ] && FREEZE="--inject stop:c-server@150+60"
CMD=".venv/bin/python examples/train_lm.py --model-size tiny --steps $STEPS --eval-every 50 --update-on server"
OUT=${OUT:-/tmp}
rm -rf "$OUT/rj-free" "$OUT/rj-faults"
s=$(date +%s.%N)
$G launch --wan transpacific --dcs "$DCS" --run-dir "$OUT/rj-free" --quiet -- $CMD > "$OUT/rj-free.out" 2>&1
echo "failure-free rc=$? wall=$(echo "$(date +%s.%N) - $s" | bc) s"
s=$(date +%s.%N)
$G launch --wan transpacific --dcs "$DCS" --run-dir "$OUT/rj-faults" --rejoin-after 30 --inject-seed "$SEED" \
    --inject kill:random@60 --inject kill:random@120 --inject kill:random@180 --inject kill:random@240 \
    --inject kill:b-server@90 $FREEZE -- $CMD > "$OUT/rj-faults.out" 2>&1
echo "faults rc=$? wall=$(echo "$(date +%s.%N) - $s" | bc) s"
