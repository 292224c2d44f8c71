#!/bin/bash
# The tiny LM, 2 DCs x 1 worker, no WAN emulation, 200 steps, three ways (docs/benchmarks.md, "A learning-rate
# schedule on the servers"): AdamW on the workers with the example's warm-up and cosine schedule; AdamW on the
# global servers at its peak rate (the checkout BEFORE, which had no server-side schedule); AdamW on the servers
# with the schedule (this checkout).  Usage: BEFORE=/path/to/older/checkout SEED=0 OUT=/tmp/sched bash $0
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
out=${OUT:-/tmp/server-schedule}
seed=${SEED:-0}
mkdir -p "$out"
for spec in "worker $here" "server-before ${BEFORE:?set BEFORE to a checkout without server schedules}" "server $here"; do
  set -- $spec
  name=$1; tree=$2; update=${name%%-*}
  rm -rf "$out/s$seed-$name"
  PYTHONPATH=$tree "$py" -P -m geomx.cli.main launch --dcs 2 --workers-per-dc 1 --wan lan --run-dir "$out/s$seed-$name" \
    --quiet -- "$py" "$tree/examples/train_lm.py" --model-size tiny --steps 200 --batch-size 16 --update-on "$update" \
    --eval-every 50 --seed "$seed" > "$out/s$seed-$name.out" 2>&1
  echo "$name (seed $seed, exit $?): $(grep -h 'final validation' "$out/s$seed-$name/a-worker-0.log")"
done
