#!/usr/bin/env bash
# P3 against FSA, both with the servers' optimizer, with compute on a GPU: issue 15's "P3 >= 1.3x faster per step
# where compute and WAN time are comparable" (on 2 shared CPU cores the servers and the emulator eat what P3
# overlaps; docs/benchmarks.md, "P3 with slices against FSA").
#
# For the device machine: run(command="bash tests/scripts/device_p3.sh", carry=[".whl"], timeout_s=540), with
# the wheels that tests/scripts/device_env.sh says how to fetch; tests/scripts/device_all.sh runs it with batches
# picked by tests/scripts/lm_compute_time.py.
#
# Each PROFILE:MODEL:BATCH of PAIRS is one `geomx bench wan --workload lm` of the rows flat (its fixed baseline,
# FLAT_STEPS steps only: its speed is not the question), hips-fsa-server and hips-p3, every worker on the GPU
# (--device); tables and JSON go to $OUT.
# Knobs: DEVICE (cuda), PAIRS ("regional:small:16 regional:small:64 transatlantic:small:16 transatlantic:small:64"),
# STEPS (30), FLAT_STEPS (WARMUP, and never fewer: examples/train_lm.py refuses a warm-up longer than its row's
# steps, which had failed every pair's flat row since WARMUP came in), PYTHON (python3), EACH_S (seconds allowed
# per pair, 150), WARMUP (4: the workers' warm-up steps; a run of 16 steps otherwise warms up for one, and at
# batch 96 both rows diverged in session 33), CONFIGS (hips-fsa-server,hips-p3: P3 in the parts sized for the WAN;
# add hips-p3-sliced for its 50,000-element slices, the cut of the GPU runs before session 41).
set -u
source "$(dirname "$0")/device_env.sh" /tmp/geomx-device-p3
warmup=${WARMUP:-4}
flat_steps=${FLAT_STEPS:-$warmup}
(( flat_steps < warmup )) && flat_steps=$warmup
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for pair in ${PAIRS:-regional:small:16 regional:small:64 transatlantic:small:16 transatlantic:small:64}; do
  IFS=: read -r prof model batch <<< "$pair"
  name="p3-$prof-$model-b$batch"
  echo "== $name"
  timeout "${EACH_S:-150}" "$py" -m geomx.cli.main bench wan --workload lm --model "$model" --profile "$prof" \
    --configs "${CONFIGS:-hips-fsa-server,hips-p3}" --steps "${STEPS:-30}" --row-steps "flat=$flat_steps" \
    --eval-every "${STEPS:-30}" --train-args "--device ${DEVICE:-cuda} --batch-size $batch --warmup $warmup" \
    --output "$out/$name.md" --json "$out/$name.json" > "$out/$name.log" 2>&1
  echo "exit $?"
  grep '^|' "$out/$name.log" | cut -d'|' -f2,11-13,16-17
done
