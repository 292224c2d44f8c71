#!/usr/bin/env bash
# Step time of the wide MLP (one 26 MB tensor) under FSA, 2 DCs x 2 workers, for each part size: what
# geomx.kvstore.partition.wan_partition_bytes was chosen from (docs/benchmarks.md, "Parts sized by wire time").
#   bash tests/scripts/parts_bench.sh PROFILE BYTES...     e.g. regional 1048576 4194304 16777216
# Each size is one `geomx launch` of 30 steps with GEOMX_PARTITION_BYTES set; prints geomx report's step time.
# LAUNCH_ARGS: more `geomx launch` options, e.g. LAUNCH_ARGS="--wan-link b=100mbit/180ms" (a DC on a slower link).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
out=${OUT:-/tmp/geomx-parts}
prof=$1; shift
mkdir -p "$out"
for size in "$@"; do
  run="$out/$prof-$size"
  rm -rf "$run"
  GEOMX_PARTITION_BYTES=$size timeout 900 "$py" -m geomx.cli.main launch --quiet --wan "$prof" ${LAUNCH_ARGS:-} --run-dir "$run" -- \
    "$py" "$here/examples/train_cnn.py" --model wide --steps 30 --eval-every 1000 > "$run.out" 2>&1
  printf '%s %s: ' "$prof" "$size"
  "$py" -m geomx.cli.main report "$run" | grep "training wall time"
done
