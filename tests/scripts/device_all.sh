#!/usr/bin/env bash
# Every device check of the open issues in one call (a session's device time is 15 minutes, a machine's start
# included): the LM's compute time on the GPU and the batch at which P3 has most to overlap
# (tests/scripts/lm_compute_time.py), P3 against FSA at that batch over `regional` and `transatlantic`, each pair
# REPEATS times for the spread (tests/scripts/device_p3.sh), then compute utilization on 16 cores
# (tests/scripts/device_cu.sh; by default the small model's K1=5/K2=2 overlapped row with 8-bit global averages,
# with its DC averages late too, and the control, the next measurement docs/benchmarks.md names; one evaluation,
# at the end, since evaluations let an overlapped average travel and flatter the figure). Everything is packed
# into $OUT/device.tgz (the tool brings back at most 8 files).
#
#   run(command="bash tests/scripts/device_all.sh", carry=[".whl"], timeout_s=600)
#
# 2026-11-27 (an H200, the first version of this script): 377 s; P3 1.00-1.41x, CU of the tiny rows 0.41-0.43.
# 2026-11-28 (session 33, with PAIRS): P3 1.33-1.50x over regional (batches 64-128), 1.24-1.28x over
# transatlantic (512, 640); CU of the small 8-bit row 0.61 on 16 cores (docs/benchmarks.md, "The device machine again").
# Next (session 40): P3 against FSA in its new order (gradients cross as backward makes them, docs/benchmarks.md
# "Gradients in the order backward makes them") at session 33's pairs, then the CU rows, e.g.
#   PAIRS="regional:small:96 transatlantic:small:512" P3_STEPS=16 REPEATS=1 P3_S=220 TOTAL_S=440
# (a transatlantic pair of 16 steps takes about 90 s: a share under that is cut and leaves no result).
# Every part gets at most its own cap and what is left of TOTAL_S, so the whole ends inside one call's limit.
# Knobs: MODEL (small), PAIRS (PROFILE:MODEL:BATCH ..., skips the probe that picks them), BATCHES (candidates,
# "16,64,128,256,512"), P3_STEPS (12), REPEATS (2), P3_S (seconds for all P3 pairs, 320), SKIP_CU, CU_ROWS
# ("hips-hfa-short-overlap-int8,hips-hfa-short-overlap2-int8-keep,no-wan": the row at 0.61 on 16 cores in session 33,
# the same with its average allowed twice as long, and the control), CU_MODEL (small), CU_STEPS (120),
# TOTAL_S (560), DEVICE (cuda).
set -u
total=${TOTAL_S:-560}
left() { local rest=$((total - SECONDS)); echo $(( rest < $1 ? rest : $1 )); }
scripts=$(cd "$(dirname "$0")" && pwd)
final=${OUT:-/tmp/geomx-device-all}
work=/tmp/geomx-device-work
rm -rf "$work"; mkdir -p "$work" "$final"
pack() { tar czf "$final/device.tgz" -C "$work" . ; }
trap pack EXIT
source "$scripts/device_env.sh" "$work"
model=${MODEL:-small}
pairs=${PAIRS:-}
if [ -z "$pairs" ]; then
  timeout "$(left 90)" "$py" "$scripts/lm_compute_time.py" --device "${DEVICE:-cuda}" --sizes "$model" \
    --batches "${BATCHES:-16,64,128,256,512}" --pick regional,transatlantic | tee "$work/compute.txt"
  for prof in regional transatlantic; do
    picked=$(awk -v m="$model" -v p="$prof" '$1 == "pick" && $2 == m && $3 == p {print $4}' "$work/compute.txt")
    pairs="$pairs $prof:$model:${picked:-64}"
  done
fi
repeats=${REPEATS:-2}
n_pairs=$(echo $pairs | wc -w)
for run in $(seq "$repeats"); do
  OUT="$work/p3-run$run" PAIRS="$pairs" STEPS=${P3_STEPS:-12} \
    EACH_S=$(( $(left $(( ${P3_S:-320} / repeats ))) / n_pairs )) bash "$scripts/device_p3.sh"
done
if [ -z "${SKIP_CU:-}" ] && [ "$(left 200)" -ge 100 ]; then
  OUT="$work/cu" CU_S=$(left 200) MODEL=${CU_MODEL:-small} \
    ROWS=${CU_ROWS:-hips-hfa-short-overlap-int8,hips-hfa-short-overlap2-int8-keep,no-wan} \
    STEPS=${CU_STEPS:-120} EVAL_EVERY=${CU_STEPS:-120} SEED=0 FLAT_STEPS=${CU_FLAT_STEPS:-6} bash "$scripts/device_cu.sh"
fi
echo "device_all: ${SECONDS} s"
