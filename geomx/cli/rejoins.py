"""``geomx launch --rejoin-after S``: a training worker its DC went on without is started again S seconds after it
ended, and rejoins the running job in its old place (geomx.cluster.scheduler gives it the dropped worker's rank,
its local server counts it in from the round after those under way: kvserver.KVServer.start_joiner).

Which ends are restarted: a worker killed by a signal, or one its scheduler dropped (a frozen one is killed first,
so that its place is free and it cannot run again). A worker that exits with an error on its own (a bug, a
refusal) is not: it would fail again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# variables a restarted worker must not inherit: it joins the running job, it does not resume an old step
NOT_INHERITED = ("GEOMX_RESUME_FROM", "GEOMX_RESUME_STEP")


@dataclass
class Rejoins:
    after_s: float
    pending: dict[str, float] = field(default_factory=dict)     # role name -> when to start it (monotonic)
    started: dict[str, int] = field(default_factory=dict)       # role name -> restarts so far

    def schedule(self, name: str, now: float) -> None:
        self.pending.setdefault(name, now + self.after_s)

    def due(self, now: float, ready: Callable[[str], bool]) -> list[str]:
        """The roles to start now: their time has come and ``ready(name)`` (its scheduler has dropped it: until
        then its place is not free)."""
        names = [name for name, at in self.pending.items() if at <= now and ready(name)]
        for name in names:
            del self.pending[name]
            self.started[name] = self.started.get(name, 0) + 1
        return names

    def log_name(self, name: str) -> str:
        """The restarted role's log (its first process's log is kept)."""
        return f"{name}.rejoin-{self.started[name]}.log"

    @staticmethod
    def env(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in NOT_INHERITED}
