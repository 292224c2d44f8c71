"""Test harness for the end-to-end kvstore and fault tests: launch a real deployment, read its results.

Every deployment is real processes over real sockets on 127.0.0.1, started through
:class:`geomx.cli.launch.Launcher`, whose teardown stops every process it started (also when the run fails or
exceeds its deadline). Training scripts are written into the test's tmp_path and import ``kvhelp`` (next to
this file); they leave their results as JSON / npz files in the run directory.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import contextlib

SCRIPTS = Path(__file__).resolve().parent
TESTS = SCRIPTS.parent
REPO = TESTS.parent


# short liveness settings for tests that need death detection
FAST_HEARTBEAT = {"GEOMX_HEARTBEAT_INTERVAL": "0.2", "GEOMX_HEARTBEAT_TIMEOUT": "3"}
# every run gets deadlines far below the 300 s default so that a failure never stalls the suite
DEFAULT_ENV = {"GEOMX_TIMEOUT": "15", "GEOMX_CONNECT_TIMEOUT": "30"}


def write_script(directory: Path, text: str, name: str = "train.py") -> Path:
    """Write a training script that can ``import kvhelp``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"import sys\nsys.path.insert(0, {str(SCRIPTS)!r})\n" + textwrap.dedent(text))
    return path


def make_topology(*, dcs: int = 2, workers_per_dc=2, global_servers: int = 1, mode: str = "dist_sync",
                  topology: str = "hips", wan: str = "lan", env: dict | None = None, **flags):
    """``flags``: further ``load_topology`` arguments (slowdown, sync, ...). ``wan``: a profile, unless
    ``wan_rate``/``wan_rtt`` give a custom WAN (geomx launch refuses both)."""
    from geomx.cli.topology import load_topology

    if flags.get("wan_rate") is not None or flags.get("wan_rtt") is not None:
        wan = None
    topo = load_topology(None, dcs=dcs, workers_per_dc=workers_per_dc, global_servers=global_servers, mode=mode,
                         topology=topology, wan=wan, **flags)
    topo.env.update(DEFAULT_ENV)
    topo.env.update(env or {})
    return topo


def launch(tmp_path: Path, script: str | Path, *, dcs: int = 2, workers_per_dc=2, global_servers: int = 1,
           mode: str = "dist_sync", topology: str = "hips", wan: str = "lan", env: dict | None = None,
           timeout: float = 90, name: str = "run", edit_plan=None, watch=None, script_args: tuple[str, ...] = (),
           insecure: bool = False, resume: Path | None = None, inject: list[str] | None = None,
           launcher_flags: dict | None = None, **flags) -> tuple[int, Path, str]:
    """Run ``script`` (its text, or a path) on a whole deployment; returns (exit code, run dir, output).

    ``edit_plan(specs)`` may change the planned processes (e.g. one role's environment) before they start.
    ``watch(launcher, run_dir)`` is called about every 0.1 s while the deployment runs (e.g. to kill a role).
    ``insecure``: no per-run authentication token (tests whose script plays a stranger on the loopback).
    ``resume``: a previous run directory to resume from (``geomx launch --resume``).
    ``inject``: faults to inject (``geomx launch --inject``). ``launcher_flags``: other Launcher arguments.
    The output is the launcher's console (echoed worker output and its failure report).
    """
    path = Path(script) if isinstance(script, Path) else write_script(tmp_path / f"{name}-script", script)
    topo = make_topology(dcs=dcs, workers_per_dc=workers_per_dc, global_servers=global_servers, mode=mode,
                         topology=topology, wan=wan, env=env, **flags)
    from geomx.cli import launch as launch_mod

    run_dir = tmp_path / name
    run_dir.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    launcher = launch_mod.Launcher(topo, [sys.executable, str(path), *script_args], run_dir=run_dir, quiet=False,
                                   out=out, insecure=insecure, resume=resume, inject=inject, **(launcher_flags or {}))
    original_plan = launch_mod.plan
    if edit_plan is not None:
        def edited(*args, **kwargs):
            specs = original_plan(*args, **kwargs)
            edit_plan(specs)
            return specs
        launch_mod.plan = edited
    result: dict = {}

    def run() -> None:
        try:
            result["code"] = launcher.run(timeout=timeout)
        except BaseException as exc:  # reported below, in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="test-launcher", daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if watch is not None and thread.is_alive():
                watch(launcher, run_dir)
    finally:
        thread.join(timeout + 30)
        launch_mod.plan = original_plan
        for r in list(launcher.running):          # only if the launcher itself broke down
            if r.proc.poll() is None:
                _kill_group(r.proc)
                r.proc.wait(10)
    if "error" in result:
        raise result["error"]
    return result["code"], run_dir, out.getvalue()


def launch_faulted(tmp_path: Path, script: str | Path, state: dict, **kwargs) -> tuple[Path, str]:
    """:func:`launch` with a ``watch`` that injects faults and records them in ``state`` (``state["frozen"]``: a
    pid it stopped, continued afterwards whatever happens); the run must have reached the faults and succeeded.
    Returns (run dir, output)."""
    try:
        code, run_dir, output = launch(tmp_path, script, **kwargs)
    finally:
        if "frozen" in state:
            with contextlib.suppress(ProcessLookupError):
                os.kill(state["frozen"], signal.SIGCONT)
    assert state, "the workers never trained\n" + describe(code, run_dir, output)
    assert code == 0, describe(code, run_dir, output)
    return run_dir, output


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def logs(run_dir: Path) -> str:
    """Every role's log in the run directory, each headed by its file name."""
    return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')}" for p in sorted(run_dir.glob("*.log")))


def describe(code: int, run_dir: Path, output: str) -> str:
    """What to print when a run did not go as expected."""
    return f"exit code {code}\n--- launcher output ---\n{output[-6000:]}\n--- logs ---\n{logs(run_dir)[-12000:]}"


def check_ok(result: tuple[int, Path, str]) -> Path:
    code, run_dir, output = result
    assert code == 0, describe(code, run_dir, output)
    return run_dir


def load_json(run_dir: Path, name: str):
    return json.loads((run_dir / f"{name}.json").read_text())


def load_npz(run_dir: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(run_dir / f"{name}.npz") as data:
        return {k: data[k] for k in data.files}


def node_env(**variables: str) -> dict[str, str]:
    """A minimal environment for ``python -m geomx.node`` (no DMLC_* or GEOMX_* leaking from ours)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "GEOMX_"))}
    base["PYTHONUNBUFFERED"] = "1"
    base["OMP_NUM_THREADS"] = "1"
    base.update({k: str(v) for k, v in variables.items()})
    return base


class Processes:
    """Processes a test starts itself, each in its own session; ``close()`` kills every group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict, log_path: Path | None = None, **kwargs) -> subprocess.Popen:
        if log_path is not None:
            with open(log_path, "wb") as f:
                proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                        cwd=str(REPO), **kwargs)
        else:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(REPO), **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def start_plan(tmp_path: Path, script: Path, topo, ready, timeout: float = 60):
    """Start every process of ``topo``'s plan ourselves (no launcher, so no kill-all on failure), each in its own
    session with a log file, and wait until ``ready(run_dir)``. Returns (Processes, {role name: Popen}, run dir);
    the caller must ``close()`` the Processes."""
    from geomx.cli.launch import plan

    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    specs = plan(topo, [sys.executable, str(script)], run_dir)
    procs = Processes()
    try:
        running = {s.name: procs.start(s.argv, {**os.environ, **s.env}, run_dir / f"{s.name}.log") for s in specs}
        end = time.monotonic() + timeout
        while not ready(run_dir):
            if time.monotonic() > end:
                raise AssertionError(f"the deployment was not ready within {timeout:g} s\n{logs(run_dir)[-12000:]}")
            time.sleep(0.1)
    except BaseException:
        procs.close()
        raise
    return procs, running, run_dir


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout:g} s")
        time.sleep(interval)


class Inbox:
    """An ``on_message`` callback for in-process Van tests that keeps what arrives."""

    def __init__(self):
        self.messages, self.event = [], threading.Event()

    def __call__(self, msg):
        self.messages.append(msg)
        self.event.set()

    def wait_for(self, n, timeout=5.0):
        end = time.monotonic() + timeout
        while len(self.messages) < n and time.monotonic() < end:
            time.sleep(0.01)
        return len(self.messages) >= n


class TimedInbox:
    """An ``on_message`` callback that keeps (arrival time, message), with a deadline-bounded wait."""

    def __init__(self) -> None:
        self.arrivals: list = []
        self._cv = threading.Condition()

    def __call__(self, msg) -> None:
        with self._cv:
            self.arrivals.append((time.monotonic(), msg))
            self._cv.notify_all()

    def wait_for(self, count: int, timeout: float = 5.0) -> list:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.arrivals) >= count, timeout), \
                f"only {len(self.arrivals)} of {count} messages arrived within {timeout} s"
            return list(self.arrivals)


@contextlib.contextmanager
def listening_van(security, node_id: str = "server"):
    """A started ZmqVan on the loopback with ``security``, and the Inbox of what it receives; stopped after."""
    from geomx.transport.van import ZmqVan

    inbox = Inbox()
    van = ZmqVan(node_id=node_id, dc="a", on_message=inbox, security=security)
    van.start()
    try:
        yield van, inbox
    finally:
        van.stop()
