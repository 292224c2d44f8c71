"""GeoMX's own example, ported (tests/scripts/geomx_cnn.py: its examples/cnn.py line for line, on the digits),
trains under ``geomx launch`` at GeoMX's hyperparameters through the raw KVStore's GeoMX semantics: the server
optimizer (Adam, lr 0.01) steps on the sum of the workers' gradients divided by their batch size."""
from __future__ import annotations

import os

from harness import SCRIPTS, check_ok, launch, load_json

# seeds 0-3 on this machine: 0.947, 0.919, 0.922, 0.908 after 60 batches per worker (chance: 0.10)
ACCURACY_BAR = 0.85


def test_geomx_cnn_example_trains_lenet_with_the_server_optimizer_at_its_own_hyperparameters(tmp_path):
    path = os.pathsep.join(p for p in (str(SCRIPTS), os.environ.get("PYTHONPATH")) if p)
    run_dir = check_ok(launch(tmp_path, SCRIPTS / "geomx_cnn.py", dcs=2, workers_per_dc=2, timeout=120,
                              script_args=("--iterations", "60"), env={"PYTHONPATH": path}))
    reports = [load_json(run_dir, f"geomx-cnn-{i}") for i in range(4)]
    assert {r["reduction"] for r in reports} == {"sum"}
    accuracies = {r["test_acc"] for r in reports}
    assert len(accuracies) == 1, reports          # every worker pulled the servers' weights: one model
    assert accuracies.pop() >= ACCURACY_BAR, reports
