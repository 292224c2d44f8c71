#!/usr/bin/env bash
# Every device check of the open issues in one call (a session's device time is 15 minutes, a machine's start
# included): the LM's compute time on the GPU and the batch that makes compute about as long as the WAN
# transfer (tests/scripts/lm_compute_time.py), P3 against FSA at that batch and at a small one over `regional`
# and `transatlantic` (tests/scripts/device_p3.sh), then compute utilization on 16 cores
# (tests/scripts/device_cu.sh). Everything is packed into $OUT/device.tgz (the tool brings back at most 8 files).
#
#   run(command="bash tests/scripts/device_all.sh", carry=[".whl"], timeout_s=600)
#
# Every part gets at most its own cap and what is left of TOTAL_S, so the whole ends inside one call's limit; the
# last part (P3 at the small batch) runs only if 60 s are left.
# Knobs: MODEL (small), BATCHES (candidates, "16,64,128,256,512"), SMALL_BATCH (16), P3_STEPS (12), SKIP_CU,
# TOTAL_S (560).
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
timeout "$(left 90)" "$py" "$scripts/lm_compute_time.py" --device "${DEVICE:-cuda}" --sizes "$model" \
  --batches "${BATCHES:-16,64,128,256,512}" --pick regional,transatlantic | tee "$work/compute.txt"
pairs=""
for prof in regional transatlantic; do
  picked=$(awk -v m="$model" -v p="$prof" '$1 == "pick" && $2 == m && $3 == p {print $4}' "$work/compute.txt")
  pairs="$pairs $prof:$model:${picked:-64}"
done
OUT="$work/p3" PAIRS="$pairs" STEPS=${P3_STEPS:-12} EACH_S=$(( $(left 340) / 2 )) bash "$scripts/device_p3.sh"
if [ -z "${SKIP_CU:-}" ]; then
  OUT="$work/cu" CU_S=$(left 170) bash "$scripts/device_cu.sh"
fi
if [ "$(left 100)" -ge 60 ]; then
  OUT="$work/p3-small" PAIRS="regional:$model:${SMALL_BATCH:-16}" STEPS=${P3_STEPS:-12} EACH_S=$(left 100) \
    bash "$scripts/device_p3.sh"
fi
echo "device_all: ${SECONDS} s"
