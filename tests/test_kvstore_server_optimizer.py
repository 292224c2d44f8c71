"""A server-side optimizer under FSA (dist_sync): the pulled weights equal single-process training.

The master worker installs a torch.optim optimizer on the global servers before kv.init; workers push one
gradient per step and read back the weights. A reference computed here (float64, the textbook update rule on
the mean of all workers' gradients across both DCs) must match every worker's weights after every step.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvhelp
from harness import check_ok, launch, load_npz

SEED = 99
KEYS = {"w": (10,), "b": (3, 4)}
STEPS = 3
WORKERS_PER_DC = [2, 1]          # uneven DCs: the mean is over all 3 workers, not per DC
N = sum(WORKERS_PER_DC)

SCRIPT = f"""
import os
import numpy as np
import geomx
import kvhelp as h

SEED, STEPS, KEYS = {SEED}, {STEPS}, {KEYS!r}
how = os.environ["TEST_OPTIMIZER"]
kv = geomx.kvstore.create(reduction="mean")
if kv.is_master_worker:
    if how == "class":
        import torch
        kv.set_optimizer(torch.optim.SGD, lr=0.1)
    else:
        # the servers halve the rate at every update (a worker's scheduler would not reach them)
        kv.set_optimizer("SGD", lr=0.1, momentum=0.9, lr_schedule={{"name": "step", "step_size": 1, "gamma": 0.5}})
else:
    kv.set_optimizer("SGD", lr=123.0)      # only the master worker's call counts (GeoMX semantics)
tag = 0 if kv.is_master_worker else h.worker_index() + 1
for k, s in KEYS.items():
    kv.init(k, h.value(tag, k, s))
if kv.is_master_worker:
    raise SystemExit(0)
me = h.worker_index()
w = {{k: kv.pull(k).wait() for k in KEYS}}
out = {{f"{{k}}@start": v for k, v in w.items()}}
for step in range(STEPS):
    for k, s in KEYS.items():
        g = h.grad(SEED, me, step, k, s)
        if how == "class":       # torch tensors in and out (the other run uses numpy arrays)
            import torch
            weights = torch.zeros(s)
            kv.pushpull(k, torch.from_numpy(g), out=weights).wait()
            out[f"{{k}}@{{step}}"] = weights.numpy()
        else:
            out[f"{{k}}@{{step}}"] = kv.pushpull(k, g).wait()
for k in KEYS:                              # a plain pull after the last round reads the same weights
    out[f"{{k}}@final-pull"] = kv.pull(k).wait()
h.save(f"weights-{{me}}", out)
h.dump(f"server-updates-{{me}}", kv.server_updates)
"""


def reference(key, momentum: float, gamma: float = 1.0) -> list[np.ndarray]:
    """Single-process SGD on the mean gradient of all workers: w -= lr * (momentum buffer of the mean), the rate
    times ``gamma`` after each step (torch's StepLR with step_size 1)."""
    w = kvhelp.value(0, key, KEYS[key]).astype(np.float64)
    buf = None
    out = []
    for step in range(STEPS):
        lr = 0.1 * gamma ** step
        mean = np.mean([kvhelp.grad(SEED, i, step, key, KEYS[key]).astype(np.float64) for i in range(N)], axis=0)
        buf = mean if buf is None or momentum == 0 else momentum * buf + mean
        w = w - lr * buf
        out.append(w)
    return out


@pytest.mark.parametrize("how,momentum,gamma", [("class", 0.0, 1.0), ("name", 0.9, 0.5)],
                         ids=["sgd-class-torch-tensors", "momentum-sgd-name-numpy-step-schedule"])
def test_server_side_sgd_weights_match_single_process_reference(tmp_path, how, momentum, gamma):
    run_dir = check_ok(launch(tmp_path, SCRIPT, dcs=2, workers_per_dc=WORKERS_PER_DC,
                              env={"TEST_OPTIMIZER": how}))
    for me in range(N):
        got = load_npz(run_dir, f"weights-{me}")
        assert (run_dir / f"server-updates-{me}.json").read_text() == "true"
        for key, shape in KEYS.items():
            np.testing.assert_array_equal(got[f"{key}@start"], kvhelp.value(0, key, shape))
            expected = reference(key, momentum, gamma)
            for step in range(STEPS):
                np.testing.assert_allclose(got[f"{key}@{step}"], expected[step], rtol=0, atol=1e-6,
                                           err_msg=f"worker {me}, key {key}, step {step}")
            np.testing.assert_array_equal(got[f"{key}@final-pull"], got[f"{key}@{STEPS - 1}"])
    # the reference really distinguishes the rules and the schedule (and a worker's lr=123 would be far off)
    assert np.abs(reference("w", 0.9)[-1] - reference("w", 0.0)[-1]).max() > 1e-2
    assert np.abs(reference("w", 0.9, 0.5)[-1] - reference("w", 0.9)[-1]).max() > 1e-2
