"""``geomx launch --rejoin-after S``: a training worker its DC went on without, or a DC the others went on
without, is started again S seconds after it was lost, and rejoins the running job in its old place
(geomx.cluster.scheduler gives a restarted worker the dropped one's rank and a restarted DC's local server the old
one's place in the global tier; their servers count them in from the round after those under way:
kvserver.KVServer.start_joiner).

Which losses are restarted: a role killed by a signal, or one its scheduler dropped (a frozen one is killed first,
so that its place is free and it cannot run again). A worker that exits with an error on its own (a bug, a
refusal) is not: it would fail again. A DC restarts whole (its scheduler, local server and workers) once every
role of it has ended and the global tier has dropped its old local server.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# variables a restarted worker must not inherit: it joins the running job, it does not resume an old step
NOT_INHERITED = ("GEOMX_RESUME_FROM", "GEOMX_RESUME_STEP")


@dataclass
class Rejoins:
    after_s: float
    # what to restart: a worker's role name, or dc_key(DC) for a whole DC
    pending: dict[str, float] = field(default_factory=dict)     # -> when to start it (monotonic)
    started: dict[str, int] = field(default_factory=dict)       # -> restarts so far

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

    def log_name(self, what: str, role: str) -> str:
        """The log of ``role``, restarted as (part of) ``what``; the earlier process's log is kept."""
        kind = "dc-rejoin" if what.startswith("dc:") else "rejoin"
        return f"{role}.{kind}-{self.started[what]}.log"

    def cancel(self, what: str) -> None:
        self.pending.pop(what, None)

    def waiting(self, what: str) -> bool:
        return what in self.pending

    @staticmethod
    def env(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in NOT_INHERITED}


def dc_key(dc: str) -> str:
    """What a whole DC's restart is filed under (role names never contain a colon)."""
    return f"dc:{dc}"
