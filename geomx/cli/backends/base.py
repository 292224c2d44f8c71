"""What a launcher backend provides (geomx.cli.backends)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from geomx.cli.launch import RoleSpec
    from geomx.cli.topology import Topology


@dataclass(frozen=True)
class Sites:
    """Where a deployment's fixed addresses are: every site's host (a DC, or the central party under
    geomx.profiles.CENTRAL_DC) and the ports its listening roles bind: the global scheduler, the central
    scheduler, the WAN emulator (all three at the central site), then each DC's scheduler, then (with
    ``--global-server-link``) each global server (Topology.fixed_ports)."""
    hosts: dict[str, str]
    ports: list[int]


class RoleHandle(Protocol):
    """One running role, as the launcher sees it (a subset of subprocess.Popen's interface, plus signals)."""
    pid: int

    def poll(self) -> int | None:
        """The exit status once the role ended (negative: killed by that signal), else None."""

    def wait(self, timeout: float) -> int:
        """The exit status; raises subprocess.TimeoutExpired after ``timeout`` seconds."""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the role's whole process group (nothing if it already ended)."""

    def is_stopped(self) -> bool:
        """Whether the role is frozen by a signal (SIGSTOP): alive but not running."""

    def finish_output(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the role's last output to reach its log."""


class Backend(ABC):
    name: str
    # whether roles may run on other hosts: then every link needs the shared secret (geomx.config refuses to
    # listen off loopback without it), so the launcher seals every message unless told --insecure
    across_hosts: bool = False

    @abstractmethod
    def sites(self, topo: Topology) -> Sites:
        """Choose the host of every site and free ports there (before any role starts)."""

    def prepare(self, specs: list[RoleSpec]) -> None:  # noqa: B027 - a backend that places nothing ahead
        """Get ready to start ``specs`` (all of them at once, where that is quicker than one by one)."""

    @abstractmethod
    def start(self, spec: RoleSpec, env: dict[str, str], log_path: Path,
              on_line: Callable[[str], None] | None) -> RoleHandle:
        """Start ``spec`` with ``env`` over the environment of the place it runs; its output goes to
        ``log_path`` (and, line by line, to ``on_line`` when given)."""

    def placement(self) -> dict[str, str]:
        """Role name -> where it runs, for the run's manifest (empty where every role runs here)."""
        return {}

    def close(self) -> None:  # noqa: B027 - most backends hold nothing
        """Release what the backend holds once every role has ended."""
