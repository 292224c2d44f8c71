"""Roles started by hand, as on real machines: each process from its environment alone (docs/environment.md),
with GeoMX's variables, no `geomx launch` around them."""
from __future__ import annotations

import os
import sys
import time

from harness import Processes, logs, make_topology, wait_until, write_script

PY = sys.executable

PUSHPULL_SCRIPT = """
import numpy as np
import geomx
kv = geomx.kvstore.create()
kv.init(1, np.ones(3, np.float32))
if not kv.is_master_worker:
    assert kv.pushpull(1, np.full(3, 4.0, np.float32)).wait().tolist() == [4.0] * 3
"""


def _start_by_hand(tmp_path, edit_env) -> tuple[Processes, dict, object]:
    """Every role of a 1-DC x 1-worker deployment started as its own process with the environment the docs
    give it, edited by ``edit_env(name, env)``."""
    from geomx.cli.launch import plan

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = write_script(tmp_path, PUSHPULL_SCRIPT)
    topo = make_topology(dcs=1, workers_per_dc=1, env={"GEOMX_TIMEOUT": "10", "GEOMX_CONNECT_TIMEOUT": "20"})
    procs, started = Processes(), {}
    for spec in plan(topo, [PY, str(script)], run_dir):
        env = {**os.environ, **spec.env}
        edit_env(spec.name, env)
        started[spec.name] = procs.start(spec.argv, env, run_dir / f"{spec.name}.log")
    return procs, started, run_dir


def test_geomx_variables_alone_without_dc_names_start_a_deployment_that_completes(tmp_path):
    """GeoMX's scripts name no DC: its central scheduler is a plain DMLC_ROLE=scheduler that cannot know it is the
    central one, while the global server and master worker are in the central party. Every local tier is then
    named after its scheduler's address, so the central roles and their scheduler still meet."""
    procs, started, run_dir = _start_by_hand(tmp_path, lambda name, env: env.pop("GEOMX_DC", None))
    try:
        wait_until(lambda: all(p.poll() is not None for p in started.values()), 60, "every role exiting")
        codes = {name: p.returncode for name, p in started.items()}
        assert set(codes.values()) == {0}, f"{codes}\n{logs(run_dir)[-8000:]}"
    finally:
        procs.close()


def test_role_whose_dc_name_differs_from_its_schedulers_fails_fast_naming_geomx_dc(tmp_path):
    def rename_central_scheduler(name: str, env: dict) -> None:
        if name == "central-scheduler":
            env["GEOMX_DC"] = "centre"

    began = time.monotonic()
    procs, started, run_dir = _start_by_hand(tmp_path, rename_central_scheduler)
    try:
        master = started["master"]
        wait_until(lambda: master.poll() is not None, 15, "the master worker stopping")
        assert master.returncode != 0
        assert time.monotonic() - began < 15, "a misnamed tier must be refused at registration, not time out"
        text = (run_dir / "master.log").read_text()
        assert "GEOMX_DC" in text and "dc:centre" in text and "dc:central" in text, text[-3000:]
    finally:
        procs.close()
