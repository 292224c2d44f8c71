"""Milliseconds a worker spends in each phase of HFA's averages, with a sleep standing in for compute: the
small LM's parameters (examples/train_lm.py), plain SGD at learning rate 0, so only the averaging costs.

    geomx launch --dcs 2 --workers-per-dc 2 --wan regional --sync hfa --hfa-k1 5 --hfa-k2 2 --hfa-overlap 1 \\
        --hfa-dc-overlap 1 --run-dir DIR --quiet -- python tests/scripts/averaging_phases.py
    grep -h PHASES DIR/*worker*.log

Each worker prints one line: phase -> [calls, mean ms]; send_dc / land_dc are the overlapped DC average's send
and landing, send_global / land the overlapped global average's, dc_average / global_average waited-for ones.
``PROF=PHASE`` adds a cProfile of that phase; ``STEPS`` (40) and ``COMPUTE`` (0.2 s a step) set the run;
``COMPRESSION`` (JSON, as the examples' ``--compression``) the deployment's gradient compression.
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

import geomx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_lm import SIZES, ByteGPT  # noqa: E402

from geomx.sync import averaging  # noqa: E402
from geomx.torch import DistributedOptimizer  # noqa: E402

PHASES = ("send_dc", "land_dc", "dc_average", "send_global", "land", "global_average")


def main() -> None:
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in PHASES}
    profile, profiled = cProfile.Profile(), os.environ.get("PROF")

    def timed(name, method):
        def wrapper(self, *args, **kwargs):
            started = time.perf_counter()
            if name == profiled:
                profile.enable()
            try:
                return method(self, *args, **kwargs)
            finally:
                if name == profiled:
                    profile.disable()
                times[name].append(time.perf_counter() - started)
        return wrapper

    for name in PHASES:
        setattr(averaging.HFA, name, timed(name, getattr(averaging.HFA, name)))
    model = ByteGPT(SIZES["small"])
    kv = geomx.kvstore.create()
    if os.environ.get("COMPRESSION"):
        kv.set_gradient_compression(json.loads(os.environ["COMPRESSION"]))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), kvstore=kv)
    if opt.kv.is_master_worker:
        return
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(int(os.environ.get("STEPS", "40"))):
        time.sleep(float(os.environ.get("COMPUTE", "0.2")))
        opt.step()
    opt.finish()
    phases = {name: [len(v), round(1000 * sum(v) / len(v), 1) if v else 0.0] for name, v in times.items()}
    print("PHASES", json.dumps(phases), "waited s", round(opt.comm_wait_s, 2), flush=True)
    if profiled:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
