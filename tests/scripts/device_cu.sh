#!/usr/bin/env bash
# Compute utilization of the best model-averaging rows with a core per process: issue 13's "compute utilization
# >= 0.9 for the best model-averaging row". The device machine has 16 CPU cores: this runs on those, no GPU.
# Measured there on 2026-11-27 with the defaults (the tiny model): 0.41-0.43, no better than on 2 cores, since
# the global average (~0.4 s over transpacific) takes longer than the 5-10 steps it travels behind (~0.026 s each
# on 16 cores); docs/benchmarks.md, "Compute utilization on 16 cores". The next measurement is the small model's
# K1=5/K2=2 overlapped row with 8-bit global averages, the small model's fastest to FSA's target (2 cores, one
# evaluation at the end: 0.87, 0.91 with its DC averages late; an evaluation every 10 steps would flatter it,
# since its global average travels meanwhile):
#   ROWS=hips-hfa-short-overlap-int8,hips-hfa-short-overlap-int8-dcstep,no-wan MODEL=small STEPS=120 EVAL_EVERY=120 \
#     SEED=0 FLAT_STEPS=6 bash tests/scripts/device_cu.sh
#
# For the device machine: run(command="bash tests/scripts/device_cu.sh", carry=[".whl"], timeout_s=420), with
# the wheels that tests/scripts/device_env.sh says how to fetch. Check here first with ROWS=no-wan STEPS=20.
#
# One `geomx bench wan --workload lm` (flat, its fixed baseline, for FLAT_STEPS steps only: its speed is not the
# question), then each row's compute utilization from `geomx report`.
# Knobs (defaults: issue 13's non-iid seed-1 table): ROWS (the best tiny-model row and the control, each with
# its DC averages waited for and one step late: on 2 cores that lifted them from 0.54-0.56 / 0.51-0.55 to
# 0.60-0.67 / 0.68-0.70 in the same time), MODEL
# (tiny), STEPS (400), EVAL_EVERY (25), SEED (1), FLAT_STEPS (25), TRAIN_ARGS ("--batch-size 2 --context 64
# --split-by-package"), CU_S (seconds allowed, 380), PYTHON (python3).
set -u
source "$(dirname "$0")/device_env.sh" /tmp/geomx-device-cu
rows=${ROWS:-hips-hfa-dc5-land-int8-keep,hips-hfa-dc5-land-int8-keep-dcoverlap,no-wan,no-wan-dcoverlap}
runs=/tmp/geomx-device-cu-runs
rm -rf "$runs"
timeout "${CU_S:-380}" "$py" -m geomx.cli.main bench wan --workload lm --model "${MODEL:-tiny}" \
  --profile transpacific --configs "$rows" --steps "${STEPS:-400}" --row-steps "flat=${FLAT_STEPS:-25}" \
  --eval-every "${EVAL_EVERY:-25}" --seed "${SEED:-1}" \
  --train-args "${TRAIN_ARGS:---batch-size 2 --context 64 --split-by-package}" --run-dir "$runs" \
  --output "$out/cu.md" --json "$out/cu.json" > "$out/cu.log" 2>&1
echo "exit $?"
for row in ${rows//,/ }; do
  echo "== $row"
  "$py" -m geomx.cli.main report "$runs/$row" | grep -E "training wall|compute utilization|final / best"
done
