"""The default backend: every role a child process of the launcher on this machine, in a session of its own."""
from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from geomx.cli.backends.base import Backend, Sites
from geomx.lifeline import ENV as LAUNCHER_PID_ENV

if TYPE_CHECKING:
    from geomx.cli.launch import RoleSpec
    from geomx.cli.topology import Topology


class LocalRole:
    def __init__(self, popen: subprocess.Popen, pump: threading.Thread | None = None) -> None:
        self.popen, self.pid, self._pump = popen, popen.pid, pump

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        signal_group(self.pid, sig)

    def is_stopped(self) -> bool:
        return is_stopped(self.pid)

    def finish_output(self, timeout: float) -> None:
        if self._pump is not None:
            self._pump.join(timeout=timeout)


class LocalBackend(Backend):
    name = "local"

    def sites(self, topo: Topology) -> Sites:
        from geomx.cli.launch import one_host_sites

        return one_host_sites(topo)

    def start(self, spec: RoleSpec, env: dict[str, str], log_path: Path,
              on_line: Callable[[str], None] | None) -> LocalRole:
        # every role leads its own session: stopping it stops whatever its command started
        env = {**os.environ, **env, LAUNCHER_PID_ENV: str(os.getpid())}
        log_file = open(log_path, "wb")  # noqa: SIM115 - the role writes it until it exits; the pump closes it
        if on_line is None:
            with log_file:
                return LocalRole(subprocess.Popen(spec.argv, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        popen = subprocess.Popen(spec.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        pump = threading.Thread(target=copy_lines, args=(popen.stdout, log_file, on_line), daemon=True,
                                name=f"geomx-pump-{spec.name}")
        pump.start()
        return LocalRole(popen, pump)


def copy_lines(pipe, log_file, on_line: Callable[[str], None]) -> None:
    """Copy a role's output into its log, and each line to ``on_line``, until the role closes it."""
    with log_file:
        for line in iter(pipe.readline, b""):
            log_file.write(line)
            log_file.flush()
            on_line(line.decode(errors="replace").rstrip())


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state T in /proc; False where there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] in ("T", "t")
