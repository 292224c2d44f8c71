"""The model-averaging worker of test_sync: plain SGD on deterministic gradients (kvhelp), wrapped in a
DistributedOptimizer, recording the model after every step. One body for both ways the tests run it: as the
training script of a real deployment (AVERAGING_SCRIPT) and as a thread of an in-process one."""
from __future__ import annotations

import dataclasses
import time

import torch

import kvhelp

SEED = 31
KEYS = {"w": (10,), "b": (3, 4)}
LR = 0.1


def train(kv, me: int, steps: int, *, samples=None, sync=None, compute_s: float = 0.0) -> tuple[dict, dict]:
    """(the model by "key@step" and "key@final", the sync policy's record); both empty on the master worker
    (``me`` = -1), which only initializes the model. ``sync``: a policy object, or None for the environment's.
    ``compute_s``: a sleep standing in for compute, which --slowdown stretches."""
    from geomx.torch import DistributedOptimizer

    tag = 0 if kv.is_master_worker else me + 1        # workers start from their own values: the master's must win
    params = {k: torch.nn.Parameter(torch.from_numpy(kvhelp.value(tag, k, s))) for k, s in KEYS.items()}
    opt = DistributedOptimizer(torch.optim.SGD(params.values(), lr=LR), list(params.items()), kvstore=kv,
                               num_samples=samples, sync=sync)
    if kv.is_master_worker:
        return {}, {}
    out = {}
    for step in range(steps):
        opt.zero_grad()
        time.sleep(compute_s)
        for k, p in params.items():
            p.grad = torch.from_numpy(kvhelp.grad(SEED, me, step, k, KEYS[k]))
        opt.step()
        for k, p in params.items():
            out[f"{k}@{step}"] = p.detach().numpy().copy()
    opt.finish()                                       # overlap: the last global average lands
    for k, p in params.items():
        out[f"{k}@final"] = p.detach().numpy().copy()
    return out, {"algorithm": repr(opt.sync), "factor": opt.slowdown.factor, "slept_s": opt.slowdown.slept_s,
                 "global_averages": getattr(opt.sync, "global_averages", None),
                 "landings": _landings(opt.sync), "wait_phases": getattr(opt.sync, "wait_phases", None),
                 "comm_wait_s": opt.comm_wait_s, "dc_workers": kv.num_workers}


def _landings(sync) -> dict | None:
    waits = getattr(sync, "landing_waits", None)
    return None if waits is None else dataclasses.asdict(waits)
