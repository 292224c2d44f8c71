#!/usr/bin/env bash
# P3 against FSA, both with the servers' optimizer, with compute on a GPU: issue 15's "P3 >= 1.3x faster per step
# where compute and WAN time are comparable" (on 2 shared CPU cores the servers and the emulator eat what P3
# overlaps; docs/benchmarks.md, "P3 with slices against FSA").
#
# Prepared for the device machine (the `run` tool; /work/.library/device/README.md). It has torch but not pyzmq
# or cryptography: carry their cp312 wheels. Once, here, in the repo's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pyzmq cryptography cffi pycparser
# then run(command="bash tests/scripts/device_p3.sh", carry=[".whl"], timeout_s=540).
#
# Each (profile, batch) pair is one `geomx bench wan --workload lm` of the rows flat (its fixed baseline),
# hips-fsa-server and hips-p3, every worker on the GPU (--device); tables and JSON go to $OUT.
# Knobs: DEVICE (cuda), MODEL (small), PROFILES ("regional transatlantic"), BATCHES ("16 64"), STEPS (30),
# PYTHON (python3), EACH_S (seconds allowed per pair, 150).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
py=${PYTHON:-python3}
out=${OUT:-/tmp/geomx-device-p3}
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$here" PYTHONUNBUFFERED=1
"$py" -c "import torch, zmq; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.__version__)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for prof in ${PROFILES:-regional transatlantic}; do
  for batch in ${BATCHES:-16 64}; do
    name="p3-$prof-b$batch"
    echo "== $name"
    timeout "${EACH_S:-150}" "$py" -m geomx.cli.main bench wan --workload lm --model "${MODEL:-small}" \
      --profile "$prof" --configs hips-fsa-server,hips-p3 --steps "${STEPS:-30}" --eval-every "${STEPS:-30}" \
      --train-args "--device ${DEVICE:-cuda} --batch-size $batch" --output "$out/$name.md" --json "$out/$name.json" \
      > "$out/$name.log" 2>&1
    echo "exit $?"
    grep '^|' "$out/$name.log" | cut -d'|' -f2,11-13,16-17
  done
done
