"""Fault injection for ``geomx launch --inject`` and tests, in the spirit of torchft's fault injector: faults at
given times, to named roles or to a training worker drawn with a seed.

    --inject kill:a-worker-1@10          SIGKILL a-worker-1's process group 10 s after every role started
    --inject stop:b-server@5+3           SIGSTOP b-server at 5 s (a frozen host), SIGCONT at 8 s
    --inject stop:random@4 --inject-seed 7   a training worker chosen by the seed

Each action is a registered :class:`FaultAction`; the launcher calls :meth:`Injector.tick` from its monitor loop
and names every injected fault in its output, so a failure report can be read against it.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

from geomx.errors import ConfigError

_SPEC = re.compile(r"^(?P<action>[a-z]+):(?P<role>[A-Za-z0-9_.-]+)@(?P<at>\d+(?:\.\d+)?)(?:\+(?P<for>\d+(?:\.\d+)?))?$")


@dataclass(frozen=True)
class FaultAction:
    """What a fault does to a role's process group, and what undoes it after ``+D`` (None: nothing can)."""
    name: str
    signal: int
    undo: int | None


ACTIONS = {a.name: a for a in (FaultAction("kill", signal.SIGKILL, None),
                                 FaultAction("stop", signal.SIGSTOP, signal.SIGCONT))}


@dataclass
class Fault:
    action: FaultAction
    role: str                      # a role of the plan, or "random": a training worker chosen by the seed
    at_s: float                    # seconds after every role started
    for_s: float | None = None     # then undone (stop: SIGCONT)
    done: bool = False
    undone: bool = False


def parse_faults(specs: list[str]) -> list[Fault]:
    faults = []
    for spec in specs:
        m = _SPEC.match(spec.strip())
        if m is None:
            raise ConfigError(f"--inject {spec!r}: write ACTION:ROLE@SECONDS[+SECONDS], e.g. kill:a-worker-1@10 or "
                              f"stop:b-server@5+3")
        action = ACTIONS.get(m["action"])
        if action is None:
            raise ConfigError(f"--inject {spec!r}: unknown action {m['action']!r}; actions are {', '.join(ACTIONS)}")
        duration = float(m["for"]) if m["for"] else None
        if duration is not None and action.undo is None:
            raise ConfigError(f"--inject {spec!r}: a {action.name} cannot be undone after +{m['for']} s")
        faults.append(Fault(action, m["role"], float(m["at"]), duration))
    return faults


class Injector:
    """Applies ``faults`` to the processes of a running deployment (``pids``: role name -> process group id)."""

    def __init__(self, faults: list[Fault], *, seed: int = 0) -> None:
        self.faults = faults
        self._rng = random.Random(seed)

    def bind(self, roles: list[str], workers: list[str]) -> None:
        """Resolve ``random`` to a training worker and check every named role exists (before anything runs)."""
        for fault in self.faults:
            if fault.role == "random":
                fault.role = self._rng.choice(workers)
            elif fault.role not in roles:
                raise ConfigError(f"--inject: no role {fault.role!r} in this deployment; roles: {', '.join(roles)}")

    def tick(self, elapsed_s: float, pids: dict[str, int], say: Callable[[str], None]) -> None:
        for fault in self.faults:
            if not fault.done and elapsed_s >= fault.at_s:
                fault.done = True
                self._signal(pids.get(fault.role), fault.action.signal)
                say(f"geomx: injected {fault.action.name} of {fault.role} at {elapsed_s:.1f} s"
                    + (f" for {fault.for_s:g} s" if fault.for_s is not None else ""))
            if fault.done and not fault.undone and fault.for_s is not None and elapsed_s >= fault.at_s + fault.for_s:
                fault.undone = True
                self._signal(pids.get(fault.role), fault.action.undo)
                say(f"geomx: undid the {fault.action.name} of {fault.role} at {elapsed_s:.1f} s")

    def release(self, pids: dict[str, int]) -> None:
        """Undo what is still in effect (a stopped role must run again to be stopped by SIGTERM)."""
        for fault in self.faults:
            if fault.done and not fault.undone and fault.action.undo is not None:
                fault.undone = True
                self._signal(pids.get(fault.role), fault.action.undo)

    @staticmethod
    def _signal(pgid: int | None, sig: int) -> None:
        if pgid is None:
            return
        with contextlib.suppress(ProcessLookupError):     # the role already exited
            os.killpg(pgid, sig)
