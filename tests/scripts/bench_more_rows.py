"""More rows for a table whose runs a ``geomx bench wan --run-dir DIR`` invocation kept, without running its rows
(flat's above all) again; then ``geomx bench wan --from-runs DIR --configs ...`` tabulates them all together.

    python tests/scripts/bench_more_rows.py --run-dir DIR --configs hips-dga,hips-diloco-short \\
        --model tiny --steps 400 --eval-every 25 --seed 0 --train-args '--batch-size 2 --context 64'

Give it the settings of the invocation that made DIR (its launch.json files hold the command each row ran); a
row whose directory exists is left alone. The LM workload, 2 DCs x 2 workers.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from geomx.bench import workloads
from geomx.bench.configs import select
from geomx.bench.wan import run_config


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--configs", required=True)
    p.add_argument("--profile", default="transpacific")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-args", default="")
    args = p.parse_args()
    for config in select(args.configs):
        sub = args.run_dir / config.name
        if sub.exists():
            continue
        wall = run_config(config, profile=args.profile, wan_rate=None, wan_rtt=None, dcs=2, workers_per_dc=2,
                          workload=workloads.workload("lm"), model=args.model, steps=args.steps,
                          eval_every=args.eval_every, seed=args.seed, run_dir=sub, timeout=900.0,
                          train_args=tuple(shlex.split(args.train_args)))
        print(f"{config.name}: {wall:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
