#!/usr/bin/env bash
# Compute utilization of the best model-averaging rows with a core per process: issue 13's "compute utilization
# >= 0.9 for the best model-averaging row". On 2 shared cores four workers, their servers and the emulator take
# turns, so a worker waiting for its DC's average mostly waits for the other worker's compute (0.42-0.50 here,
# the no-WAN control 0.52; docs/benchmarks.md). The device machine has 16 CPU cores: this runs on those, no GPU.
#
# For the device machine: run(command="bash tests/scripts/device_cu.sh", carry=[".whl"], timeout_s=420), with
# the wheels that tests/scripts/device_env.sh says how to fetch. Check here first with ROWS=no-wan STEPS=20.
#
# One `geomx bench wan --workload lm` on issue 13's non-iid seed-1 settings (flat, its fixed baseline, for 25
# steps only: its speed is not the question), then each row's compute utilization from `geomx report`.
# Knobs: ROWS (the two best rows and the control), STEPS (400), PYTHON (python3).
set -u
source "$(dirname "$0")/device_env.sh" /tmp/geomx-device-cu
rows=${ROWS:-hips-hfa-dc5-overlap-int8-keep,hips-hfa-dc-overlap-fp16-keep,no-wan}
runs=/tmp/geomx-device-cu-runs
rm -rf "$runs"
timeout 380 "$py" -m geomx.cli.main bench wan --workload lm --model tiny --profile transpacific --configs "$rows" \
  --steps "${STEPS:-400}" --row-steps flat=25 --eval-every 25 --seed 1 \
  --train-args "--batch-size 2 --context 64 --split-by-package" --run-dir "$runs" \
  --output "$out/cu.md" --json "$out/cu.json" > "$out/cu.log" 2>&1
echo "exit $?"
for row in ${rows//,/ }; do
  echo "== $row"
  "$py" -m geomx.cli.main report "$runs/$row" | grep -E "training wall|compute utilization|final / best"
done
