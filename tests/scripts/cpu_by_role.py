"""CPU seconds of a running deployment's processes, summed by role, every PERIOD seconds (docs/benchmarks.md).

    python tests/scripts/cpu_by_role.py RUN_DIR SECONDS [PERIOD]

Finds the processes whose environment names ``GEOMX_RUN_DIR=RUN_DIR`` (every role geomx launch starts) and prints,
every PERIOD seconds (default 3) for SECONDS, the cumulative user + system CPU of each role kind (emulator,
scheduler, server = local servers, global_server, worker, master): the difference between two lines is what
each kind spent in between.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time

from geomx.bench.link import process_cpu_s


def sample(run_dir: str) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            if env.get(b"GEOMX_RUN_DIR") != run_dir.encode():
                continue
            role = (env.get(b"GEOMX_ROLE") or env.get(b"DMLC_ROLE_GLOBAL") or env.get(b"DMLC_ROLE") or b"?").decode()
            if env.get(b"DMLC_ROLE_MASTER_WORKER"):
                role = "master"
            totals[role] += process_cpu_s(int(pid))
        except (OSError, ValueError):      # the process ended meanwhile
            continue
    return dict(totals)


def main() -> int:
    run_dir, seconds = sys.argv[1], float(sys.argv[2])
    period = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        totals = sample(run_dir)
        if totals:
            print(f"{time.monotonic() - start:6.1f} s", json.dumps({k: round(v, 2) for k, v in sorted(totals.items())}),
                  flush=True)
        time.sleep(period)
    return 0


if __name__ == "__main__":
    sys.exit(main())
