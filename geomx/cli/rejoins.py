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

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from geomx.cli.fault_domains import Losses
    from geomx.cli.launch import Running

# variables a restarted worker must not inherit: it joins the running job, it does not resume an old step
NOT_INHERITED = ("GEOMX_RESUME_FROM", "GEOMX_RESUME_STEP")
# restarts of one worker or DC before the launcher stops trying: one lost again and again (a DC whose worker
# fails the same way each time) would otherwise be restarted until --timeout
MAX_RESTARTS = 3


@dataclass
class Rejoins:
    after_s: float
    # what to restart: a worker's role name, or dc_key(DC) for a whole DC
    pending: dict[str, float] = field(default_factory=dict)     # -> when to start it (monotonic)
    started: dict[str, int] = field(default_factory=dict)       # -> restarts so far
    killed: set[int] = field(default_factory=set)               # pids killed so that their place frees up
    given_up: dict[str, bool] = field(default_factory=dict)      # -> whether the launcher has said so

    def schedule(self, name: str, now: float) -> None:
        if self.started.get(name, 0) >= MAX_RESTARTS:
            self.given_up.setdefault(name, False)
            return
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

    def note_loss(self, r: Running, losses: Losses, dropped: set[int]) -> None:
        """The run goes on without ``r`` (it ended, or its tier dropped it while it still runs): start it again
        later if it was a worker its DC lost, or restart its DC if the DC was lost, to a signal or a drop (not to a
        role that failed on its own)."""
        killed = r.returncode is not None and r.returncode < 0
        if r.spec.dc is None or not (killed or r.proc.pid in dropped):
            return
        if r.spec.kind == "worker" and r.spec.name in losses.lost:
            self.schedule(r.spec.name, time.monotonic())
        elif r.spec.dc in losses.lost_dcs:
            self.schedule(dc_key(r.spec.dc), time.monotonic())

    def tend(self, running: list[Running], losses: Losses, dropped: set[int],
             restart: Callable[[Running, str], None], say: Callable[[str], None], elapsed_s: float) -> None:
        """Kill the dropped workers still running (frozen ones: their place must be free, and they must not run
        again) and the roles of a lost DC waiting for its restart, then ``restart(role, log name)`` what is due."""
        for what, said in self.given_up.items():
            if not said:
                self.given_up[what] = True
                name = f"DC {what.removeprefix('dc:')}" if what.startswith("dc:") else what
                say(f"geomx: {name} was lost again after {MAX_RESTARTS} restarts; the run goes on without it "
                    f"(--rejoin-after restarts a worker or DC at most {MAX_RESTARTS} times)")
        for r in running:
            if r.returncode is not None or r.proc.pid in self.killed:
                continue
            if r.spec.kind == "worker" and r.proc.pid in dropped:
                self._kill(r, f"{r.spec.name} was dropped by its DC but is still there (frozen?)", say)
            elif r.spec.dc in losses.lost_dcs and self.waiting(dc_key(r.spec.dc)):
                self._kill(r, f"{r.spec.name} of the lost DC {r.spec.dc} is still there", say)
        ended = {r.spec.name: r for r in running if r.returncode is not None}

        def ready(what: str) -> bool:
            """A worker's or a DC's place is free: the tier dropped it (and every role of the DC ended). A worker
            whose whole DC was lost since waits for the DC's restart, which starts it too."""
            if what in ended:
                return ended[what].proc.pid in dropped and ended[what].spec.dc not in losses.lost_dcs
            roles = [r for r in running if dc_key(r.spec.dc or "") == what]
            return all(r.returncode is not None for r in roles) and any(
                r.spec.kind == "server" and r.proc.pid in dropped for r in roles)

        for what in self.due(time.monotonic(), ready):
            old = [ended[what]] if what in ended else [r for r in running if dc_key(r.spec.dc or "") == what]
            for r in old:
                self.cancel(r.spec.name)        # a worker of a restarted DC starts with it
                restart(r, self.log_name(what, r.spec.name))
            dc = old[0].spec.dc
            losses.rejoined(what, dc)
            say(f"geomx: restarted {what if what in ended else 'DC ' + dc} at {elapsed_s:.1f} s to rejoin "
                + (f"DC {dc} (log {self.log_name(what, what)})" if what in ended else "the global rounds"))

    def _kill(self, r: Running, why: str, say: Callable[[str], None]) -> None:
        self.killed.add(r.proc.pid)
        say(f"geomx: {why}; killing it so that it can be restarted")
        r.proc.signal(signal.SIGKILL)
        r.proc.signal(signal.SIGCONT)

    @staticmethod
    def env(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in NOT_INHERITED}


def dc_key(dc: str) -> str:
    """What a whole DC's restart is filed under (role names never contain a colon)."""
    return f"dc:{dc}"
