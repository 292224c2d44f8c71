"""Fault injection for ``geomx launch --inject`` and tests, in the spirit of torchft's fault injector: faults at
given times, to named roles or to a training worker drawn with a seed.

    --inject kill:a-worker-1@10          SIGKILL a-worker-1's process group 10 s after every role started
    --inject stop:b-server@5+3           SIGSTOP b-server at 5 s (a frozen host), SIGCONT at 8 s
    --inject stop:random@4 --inject-seed 7   a training worker chosen by the seed
    --inject partition:b@6+2             cut every WAN link to and from DC b from 6 s to 8 s (a partition that
                                         heals; the WAN emulator applies it, geomx.netem.outages)
    --inject slow:b@6+10=10mbit          every WAN link of DC b carries 10 Mbit/s from 6 s to 16 s

Each action is a registered :class:`FaultAction`; the launcher calls :meth:`Injector.tick` from its monitor loop
and names every injected fault in its output, so a failure report can be read against it.
"""
from __future__ import annotations

import random
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from geomx.errors import ConfigError
from geomx.netem import outages
from geomx.profiles import parse_rate

_SPEC = re.compile(r"^(?P<action>[a-z]+):(?P<role>[A-Za-z0-9_.-]+)@(?P<at>\d+(?:\.\d+)?)(?:\+(?P<for>\d+(?:\.\d+)?))?"
                   r"(?:=(?P<rate>\S+))?$")


@dataclass(frozen=True)
class FaultAction:
    """What a fault does: a signal to a role's process group and the one that undoes it after ``+D`` (None:
    nothing can), or (``on_wan``) a cut or a slowing of a DC's WAN links, which the emulator applies for ``+D``
    seconds."""
    name: str
    signal: int | None
    undo: int | None
    on_wan: bool = False           # the target is a DC, the fault the WAN emulator's (a duration is required)
    takes_rate: bool = False       # =RATE: what the DC's links keep carrying (without one: nothing)


ACTIONS = {a.name: a for a in (FaultAction("kill", signal.SIGKILL, None),
                                 FaultAction("stop", signal.SIGSTOP, signal.SIGCONT),
                                 FaultAction("partition", None, None, on_wan=True),
                                 FaultAction("slow", None, None, on_wan=True, takes_rate=True))}


@dataclass
class Fault:
    action: FaultAction
    role: str                      # a role of the plan, or "random": a training worker chosen by the seed
    at_s: float                    # seconds after every role started
    for_s: float | None = None     # then undone (stop: SIGCONT)
    rate_bps: float | None = None  # slow: the rate the DC's links keep
    done: bool = False
    undone: bool = False

    @property
    def end_s(self) -> float | None:
        """When it is undone (or, for a WAN fault, ends); None: never."""
        return None if self.for_s is None else self.at_s + self.for_s


def parse_faults(specs: list[str]) -> list[Fault]:
    faults = []
    for spec in specs:
        m = _SPEC.match(spec.strip())
        if m is None:
            raise ConfigError(f"--inject {spec!r}: write ACTION:ROLE@SECONDS[+SECONDS], e.g. kill:a-worker-1@10 or "
                              f"stop:b-server@5+3 (or ACTION:DC@SECONDS+SECONDS[=RATE], e.g. slow:b@5+10=10mbit)")
        action = ACTIONS.get(m["action"])
        if action is None:
            raise ConfigError(f"--inject {spec!r}: unknown action {m['action']!r}; actions are {', '.join(ACTIONS)}")
        duration = float(m["for"]) if m["for"] else None
        if duration is not None and action.undo is None and not action.on_wan:
            raise ConfigError(f"--inject {spec!r}: a {action.name} cannot be undone after +{m['for']} s")
        if duration is None and action.on_wan:
            raise ConfigError(f"--inject {spec!r}: say how long the {action.name} lasts, e.g. "
                              f"{action.name}:{m['role']}@{m['at']}+2")
        if action.takes_rate != bool(m["rate"]):
            raise ConfigError(f"--inject {spec!r}: " + (f"say the rate the links keep, e.g. {spec}=10mbit"
                                                         if action.takes_rate else f"a {action.name} takes no rate"))
        try:        # checked here, as the emulator would: a bad one had stopped the whole deployment after it started
            rate = parse_rate(m["rate"]) if m["rate"] else None
            wrong = outages.problem((float(m["at"]), float(m["at"]) + duration, *([rate] if rate else []))) \
                if action.on_wan else None
        except ConfigError as exc:
            wrong = str(exc)
        if wrong:
            raise ConfigError(f"--inject {spec!r}: {wrong}")
        faults.append(Fault(action, m["role"], float(m["at"]), duration, rate))
    return faults


class Signalled(Protocol):
    def signal(self, sig: int) -> None: ...


class Injector:
    """Applies ``faults`` to the roles of a running deployment (``roles``: role name -> its handle, whose
    ``signal(sig)`` reaches the role's whole process group wherever it runs: geomx.cli.backends)."""

    def __init__(self, faults: list[Fault], *, seed: int = 0) -> None:
        self.faults = faults
        self._rng = random.Random(seed)

    def bind(self, roles: list[str], workers: list[str], dcs: list[str] = ()) -> None:
        """Resolve ``random`` to a training worker and check every named role (or, for a fault of the WAN, DC)
        exists (before anything runs)."""
        for fault in self.faults:
            if fault.action.on_wan:
                if fault.role not in dcs:
                    raise ConfigError(f"--inject {fault.action.name}: no DC {fault.role!r} in this deployment"
                                      + (f"; DCs: {', '.join(dcs)}" if dcs else " (its WAN is not emulated)"))
            elif fault.role == "random":
                fault.role = self._rng.choice(workers)
            elif fault.role not in roles:
                raise ConfigError(f"--inject: no role {fault.role!r} in this deployment; roles: {', '.join(roles)}")

    def wan_outages(self) -> dict[str, list[tuple]]:
        """The faults the WAN emulator applies, by DC (geomx.netem.outages): (start, end[, rate kept])."""
        out: dict[str, list[tuple]] = {}
        for fault in self.faults:
            if fault.action.on_wan and not fault.done:      # a restarted job (--restart-failed) is spared it
                kept = () if fault.rate_bps is None else (fault.rate_bps,)
                out.setdefault(fault.role, []).append((fault.at_s, fault.end_s, *kept))
        return out

    def tick(self, elapsed_s: float, roles: Mapping[str, Signalled], say: Callable[[str], None]) -> None:
        for fault in self.faults:
            if fault.action.on_wan:        # applied by the emulator on its own clock: only said here
                self._announce_wan(fault, elapsed_s, say)
                continue
            if not fault.done and elapsed_s >= fault.at_s:
                fault.done = True
                self._signal(roles.get(fault.role), fault.action.signal)
                say(f"geomx: injected {fault.action.name} of {fault.role} at {elapsed_s:.1f} s"
                    + (f" for {fault.for_s:g} s" if fault.for_s is not None else ""))
            if fault.done and not fault.undone and fault.end_s is not None and elapsed_s >= fault.end_s:
                fault.undone = True
                self._signal(roles.get(fault.role), fault.action.undo)
                say(f"geomx: undid the {fault.action.name} of {fault.role} at {elapsed_s:.1f} s")

    def wan_faults_in_effect(self, elapsed_s: float) -> list[str]:
        """The WAN faults under way at ``elapsed_s`` (a second of slack: the emulator's clock starts a little
        after the launcher's), e.g. ``["partition of DC b (4-24 s)"]``."""
        return [f"{f.action.name} of DC {f.role} ({f.at_s:g}-{f.end_s:g} s)" for f in self.faults
                if f.action.on_wan and f.at_s <= elapsed_s <= f.end_s + 1.0]

    @staticmethod
    def _announce_wan(fault: Fault, elapsed_s: float, say: Callable[[str], None]) -> None:
        if not fault.done and elapsed_s >= fault.at_s:
            fault.done = True
            what = "cuts" if fault.rate_bps is None else f"slows to {fault.rate_bps:.6g} bit/s"
            say(f"geomx: the WAN emulator {what} every link of DC {fault.role} ({fault.action.name}) at "
                f"{fault.at_s:g} s for {fault.for_s:g} s")
        if fault.done and not fault.undone and elapsed_s >= fault.end_s:
            fault.undone = True
            say(f"geomx: the {fault.action.name} of DC {fault.role} ended at {fault.end_s:g} s")

    def release(self, roles: Mapping[str, Signalled]) -> None:
        """Undo what is still in effect (a stopped role must run again to be stopped by SIGTERM)."""
        for fault in self.faults:
            if fault.done and not fault.undone and fault.action.undo is not None:
                fault.undone = True
                self._signal(roles.get(fault.role), fault.action.undo)

    @staticmethod
    def _signal(role: Signalled | None, sig: int) -> None:
        if role is not None:            # None: the role already exited
            role.signal(sig)
