"""No role outlives its launcher.

``geomx launch`` starts every role in a session of its own (so that it can stop each role's whole process group)
and tells it the launcher's pid in ``GEOMX_LAUNCHER_PID``. If the launcher dies without stopping them (SIGKILL,
a crash, a closed terminal), the roles would run on: each role watches the launcher's pid (not its own parent:
the training command may be a shell that runs python) and, once the launcher is gone, stops its own process
group as the launcher would have (SIGTERM, then SIGKILL after a grace period). Roles started by hand have no
such variable and no watch.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

ENV = "GEOMX_LAUNCHER_PID"
POLL_S = 0.5
GRACE_S = 10.0

log = logging.getLogger("geomx.lifeline")
_started = False
_lock = threading.Lock()


def watch_launcher(env=None) -> bool:
    """Start the watch once per process, if a launcher started us; returns whether it runs."""
    global _started
    env = os.environ if env is None else env
    raw = env.get(ENV)
    if not raw:
        return False
    try:
        launcher = int(raw)
    except ValueError:
        log.warning("%s=%r is not a process id: not watching the launcher", ENV, raw)
        return False
    with _lock:
        if _started:
            return True
        _started = True
    threading.Thread(target=_watch, args=(launcher,), name="geomx-lifeline", daemon=True).start()
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # exists, owned by another user
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A launcher killed but not yet reaped (its parent, a script rather than a shell, may never wait for it)
    still answers signal 0: it is dead all the same."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:                  # no /proc (not Linux), or gone meanwhile
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"Z"


def _watch(launcher: int) -> None:
    while alive(launcher):
        time.sleep(POLL_S)
    _stop_group(launcher)


def _stop_group(launcher: int) -> None:
    log.error("the launcher (pid %d) is gone: stopping this role (pid %d) and its children", launcher, os.getpid())
    group = os.getpgrp()
    target = (lambda sig: os.killpg(group, sig)) if group == os.getpid() else (lambda sig: os.kill(os.getpid(), sig))
    target(signal.SIGTERM)
    time.sleep(GRACE_S)
    target(signal.SIGKILL)
