"""Roles started by hand, as on real machines: each process from its environment alone (docs/environment.md),
with GeoMX's variables, no `geomx launch` around them."""
from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest

from harness import Processes, logs, make_topology, wait_until, write_script

PY = sys.executable

PUSHPULL_SCRIPT = """
import numpy as np
import geomx
kv = geomx.kvstore.create(reduction="mean")
kv.init(1, np.ones(3, np.float32))
if not kv.is_master_worker:
    assert kv.pushpull(1, np.full(3, 4.0, np.float32)).wait().tolist() == [4.0] * 3
"""


def _start_by_hand(tmp_path, edit_env, *, script: str = PUSHPULL_SCRIPT, dcs: int = 1,
                   timeout_s: int = 30) -> tuple[Processes, dict, object]:
    """Every role of a ``dcs`` x 1-worker deployment started as its own process with the environment the docs
    give it, edited by ``edit_env(name, env)``."""
    from geomx.cli.launch import plan

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = write_script(tmp_path, script)
    topo = make_topology(dcs=dcs, workers_per_dc=1,
                         env={"GEOMX_TIMEOUT": str(timeout_s), "GEOMX_CONNECT_TIMEOUT": "60"})
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
        wait_until(lambda: master.poll() is not None, 45, "the master worker stopping")
        assert master.returncode != 0
        # well before GEOMX_CONNECT_TIMEOUT (60 s): refused at registration, not timed out
        assert time.monotonic() - began < 40
        text = (run_dir / "master.log").read_text()
        assert "GEOMX_DC" in text and "dc:centre" in text and "dc:central" in text, text[-3000:]
    finally:
        procs.close()


DIES_AT_SET_UP_SCRIPT = """
import os
import numpy as np
import geomx
kv = geomx.kvstore.create(reduction="mean")
kv.init(1, np.ones(3, np.float32))
if not kv.is_master_worker:
    if os.environ.get("GEOMX_DC") == "b":
        raise RuntimeError("the data directory is missing")
    for _ in range(3):
        kv.pushpull(1, np.full(3, 4.0, np.float32)).wait()
"""


@pytest.mark.parametrize("min_dcs", [1, 2])
def test_a_worker_dying_of_an_uncaught_error_stops_its_dc_at_once_naming_the_error(tmp_path, min_dcs):
    """Its DC's only worker dies at set-up: leaving with a goodbye had let that DC shut down as finished while the
    other DC's worker waited for its rounds until GEOMX_TIMEOUT (300 s here). It aborts instead, and within
    seconds the global tier drops its DC, naming the error, and the other DC trains on (GEOMX_MIN_DCS=1), or,
    with every DC needed (2), every role stops, the other worker naming the error."""
    began = time.monotonic()
    procs, started, run_dir = _start_by_hand(tmp_path, lambda name, env: env.update(GEOMX_MIN_DCS=str(min_dcs)),
                                             script=DIES_AT_SET_UP_SCRIPT, dcs=2, timeout_s=300)
    try:
        wait_until(lambda: all(p.poll() is not None for p in started.values()), 60, "every role exiting")
        assert time.monotonic() - began < 60
        codes = {name: p.returncode for name, p in started.items()}
        said = "worker 0 of DC b ended on RuntimeError: the data directory is missing"
        if min_dcs == 1:
            assert codes["b-worker-0"] != 0 and codes["a-worker-0"] == 0, f"{codes}\n{logs(run_dir)[-6000:]}"
            text = (run_dir / "global-server-0.log").read_text()
            assert said in text and "goes on with 1 of 2 DCs without DC b" in text, text[-3000:]
        else:
            assert codes["b-worker-0"] != 0 and codes["a-worker-0"] != 0, f"{codes}\n{logs(run_dir)[-6000:]}"
            text = (run_dir / "a-worker-0.log").read_text()
            assert said in text, text[-3000:]
    finally:
        procs.close()


SLEEPER_SCRIPT = """
import time
import numpy as np
import geomx
import kvhelp as h
kv = geomx.kvstore.create(reduction="mean")
kv.init(1, np.ones(3, np.float32))
if not kv.is_master_worker:
    (h.run_dir() / f"up-{h.worker_index()}").write_text("")
    time.sleep(120)
"""


def _processes_of_run(run_dir) -> list[int]:
    """Pids of the processes whose environment names this run directory."""
    import glob

    mark = f"GEOMX_RUN_DIR={run_dir}".encode()
    pids = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                if mark in f.read().split(b"\0"):
                    pids.append(int(path.split("/")[2]))
        except OSError:
            continue
    return pids


def test_no_role_outlives_a_launcher_killed_with_sigkill(tmp_path):
    """SIGKILL leaves the launcher no chance to stop its roles (each runs in its own session): the roles,
    the WAN emulator included, notice that the launcher is gone and stop themselves within seconds, even while
    the dead launcher is not reaped (this test waits for it only afterwards; a zombie still answers signal 0)."""
    import signal
    import subprocess

    run_dir = tmp_path / "run"
    script = write_script(tmp_path, SLEEPER_SCRIPT)
    launcher = subprocess.Popen([PY, "-m", "geomx.cli.main", "launch", "--dcs", "2", "--workers-per-dc", "1",
                                 "--wan", "regional", "--quiet", "--run-dir", str(run_dir), "--", PY, str(script)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(list(run_dir.glob("up-*"))) == 2, 60, "both workers initialized")
        roles = _processes_of_run(run_dir)
        # the emulator, the global scheduler and server, each DC's scheduler, local server and worker (and the
        # master worker until it finishes)
        assert len(roles) >= 9, roles
        launcher.send_signal(signal.SIGKILL)
        wait_until(lambda: not _processes_of_run(run_dir), 15, "every role stopping after the launcher died")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _processes_of_run(run_dir):
            os.kill(pid, signal.SIGKILL)


def test_a_script_run_without_geomx_launch_says_so_in_one_line_and_exits_2():
    """The examples end through geomx.run_main: a geomx error (here: no role in the environment) is one line,
    not a 19-line traceback."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "GEOMX_"))}
    res = subprocess.run([PY, "examples/train_cnn.py", "--steps", "2"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "train_cnn.py: error: no geomx role in the environment: set DMLC_ROLE (scheduler, server, worker) or "
        "DMLC_ROLE_GLOBAL, or start the script with `geomx launch`"], res.stderr


@pytest.mark.parametrize("ending, noted", [
    (lambda: sys.exit("train: worker 3 got no data"), "ConfigError: train: worker 3 got no data"),
    (lambda: 3, "SystemExit: 3"),
    (lambda: sys.exit(0), None),
    (lambda: None, None),
])
def test_a_script_refusing_on_its_own_leaves_by_aborting_not_with_a_goodbye(monkeypatch, ending, noted):
    """A script's own refusal after its kvstore exists (``raise SystemExit("...")``, a non-zero status) had left
    with a goodbye, and a hand-started job trained on without that worker. run_main notes it, so the kvstore
    aborts at exit as for an uncaught error: a message is a misconfiguration (ConfigError: the run stops), a bare
    status a crash; a clean end is still a goodbye."""
    from geomx import uncaught

    monkeypatch.setattr(uncaught, "_exception", None)
    with contextlib.suppress(SystemExit):
        uncaught.run_main(ending)
    died_of = uncaught.exception()
    assert (uncaught.describe(died_of) if died_of is not None else None) == noted
