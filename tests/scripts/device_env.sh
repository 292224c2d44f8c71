# Sourced by the tests/scripts/device_*.sh scripts: the device machine (the `run` tool;
# /work/.library/device/README.md) has torch but not pyzmq or cryptography, so their cp312 wheels travel in .whl
# (carry=[".whl"]). Once, here, in the repo's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pyzmq cryptography cffi pycparser
# Sets: here (the repo's root, the working directory), py (the interpreter, PYTHON or python3), out ($OUT, or
# the given default), PYTHONPATH (the wheels, then the repo).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$here"
py=${PYTHON:-python3}
out=${OUT:-$1}
mkdir -p "$out"
# once per call: device_all.sh sources this, then runs scripts that source it again with its environment
if [ -z "${GEOMX_DEVICE_ENV_READY:-}" ]; then
  if ls .whl/*.whl > /dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$here" PYTHONUNBUFFERED=1 GEOMX_DEVICE_ENV_READY=1
  "$py" -c "import torch, zmq; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.__version__)"
  echo "cpu cores: $(nproc)"
fi
