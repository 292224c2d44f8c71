"""MXNet's own distributed kvstore checks (its tests/nightly/dist_sync_kvstore.py), ported and run under
``geomx launch`` on 2 DCs x 2 workers with 2 global servers: string keys, lists of keys, float16 and float32, big
arrays split into parts across the servers, init from a list of one device's value, and a server optimizer that
receives the sum of every round (MXNet's ``test`` optimizer: weights += rescale_grad * grad). The raw kvstore
asks for no reduction, so it gets MXNet's: the sum.

Left out: row-sparse keys (geomx has no sparse storage type) and the 2-bit compression checks (geomx has no
MXNet 2-bit codec; its codecs are tested in test_kvstore_compression)."""
from __future__ import annotations

import os

from harness import SCRIPTS, check_ok, launch, load_json

RATE = 2.0          # MXNet's rescale_grad in these checks
NREPEAT = 7
SCRIPT = f"""
import numpy as np
import geomx
import kvhelp as h
from custom_optim import RescaledAscent

RATE, NREPEAT = {RATE}, {NREPEAT}
SHAPE, BIG = (2, 3), (1200, 1200)         # BIG is above GEOMX_PARTITION_BYTES: it travels in parts
KEYS = {{"float32": ["3", "5", "7", "99"], "float16": ["4", "6", "8", "100"]}}
INIT_KEYS = [str(i) for i in range(200, 206)]
INIT_KEYS_BIG = [str(i) for i in range(300, 304)]


def shape_of(key):
    return BIG if key in ("99", "100") else SHAPE


kv = geomx.kvstore.create("dist_sync")
if kv.is_master_worker:
    kv.set_optimizer(RescaledAscent, rescale_grad=RATE)
n, me = kv.num_all_workers, h.worker_index()
failures = []


def check(what, got, expected):
    if not np.array_equal(got, np.full(got.shape, expected, got.dtype)):
        failures.append(f"{{what}}: expected {{expected}}, got {{np.unique(got)[:5]}}")


# test_sync_init: each key initialized from a list of one device's value, i; the first half float32
for keys, shape in ((INIT_KEYS, SHAPE), (INIT_KEYS_BIG, BIG)):
    for i, key in enumerate(keys):
        dtype = "float32" if i < len(keys) / 2 else "float16"
        kv.init(key, [np.ones(shape, dtype) * i])
        if not kv.is_master_worker:
            out = np.zeros(shape, dtype)
            kv.pull(key, out=out).wait()
            check(f"init {{key}} {{dtype}}", out, i)

# init_kv: lists of keys
for dtype, keys in KEYS.items():
    kv.init(keys[:3], [np.ones(SHAPE, dtype)] * 3)
    kv.init(keys[3:], [np.ones(BIG, dtype)])
if kv.is_master_worker:
    raise SystemExit(0)

# check_default_keys: push (rank + 1), pull: 1 + RATE * (1 + 2 + ... + n) per round so far
for dtype, keys in KEYS.items():
    for key in keys:
        for i in range(NREPEAT):
            kv.push(key, np.ones(shape_of(key), dtype) * (me + 1))
            out = np.zeros(shape_of(key), dtype)
            kv.pull(key, out=out)
            kv.waitall()
            check(f"key {{key}} {{dtype}} round {{i}}", out, (n + 1) * n * RATE / 2 * (i + 1) + 1)
h.dump(f"mxnet-{{me}}", {{"failures": failures, "num_all_workers": n, "reduction": kv.reduction}})
"""


def test_mxnets_dist_sync_kvstore_checks_pass_with_the_sum_reaching_the_server_optimizer(tmp_path):
    path = os.pathsep.join(p for p in (str(SCRIPTS), os.environ.get("PYTHONPATH")) if p)
    run_dir = check_ok(launch(tmp_path, SCRIPT, dcs=2, workers_per_dc=2, global_servers=2, timeout=120,
                              env={"PYTHONPATH": path, "GEOMX_OPTIMIZER_MODULES": "custom_optim",
                                   "GEOMX_PARTITION_BYTES": str(1 << 20)}))
    for me in range(4):
        report = load_json(run_dir, f"mxnet-{me}")
        assert report == {"failures": [], "num_all_workers": 4, "reduction": "sum"}, report
