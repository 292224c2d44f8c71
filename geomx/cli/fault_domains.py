"""Which roles ``geomx launch`` may lose and go on: DCs and their workers are fault domains.

A DC's scheduler drops a worker that falls silent while ``--min-workers-per-dc`` of the DC's workers remain,
and the global scheduler drops a DC whose local server falls silent while ``--min-dcs`` DCs remain
(geomx.cluster.scheduler); the servers complete their rounds without them. The launcher makes the same decision
for a process that exits with an error or a signal, or that is still frozen (SIGSTOP) when every other trainer
finished: it names what was lost and goes on instead of stopping the deployment. A worker is lost alone where
its DC can spare it; any other role of a DC (its scheduler, its local server, a worker it cannot spare) loses
the whole DC, and every role of a lost DC may end as it does. The flat topology has no local servers, so
there every role is needed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MIN_WORKERS_ENV = "GEOMX_MIN_WORKERS_PER_DC"
MIN_DCS_ENV = "GEOMX_MIN_DCS"


@dataclass(frozen=True)
class DcRole:
    kind: str       # worker, server, scheduler
    dc: str


class Losses:
    def __init__(self, roles: dict[str, DcRole], *, min_workers: int | None, min_dcs: int | None) -> None:
        """``roles``: role name -> kind and DC of every role that belongs to a DC (not the central party's);
        ``min_workers`` / ``min_dcs``: None where nothing may be lost."""
        self.roles, self.min_workers, self.min_dcs = dict(roles), min_workers, min_dcs
        self.workers_per_dc = Counter(r.dc for r in self.roles.values() if r.kind == "worker")
        self.lost: dict[str, str] = {}          # worker role name -> what happened to it (its DC goes on)
        self.lost_dcs: dict[str, str] = {}      # DC -> what made it drop out

    def workers_left(self, dc: str) -> int:
        return self.workers_per_dc[dc] - sum(1 for name in self.lost if self.roles[name].dc == dc)

    def may_absorb(self, name: str) -> bool:
        """Whether the run could go on without ``name`` at all: a DC's role, where DCs or workers may be lost."""
        return name in self.roles and (self.min_workers is not None or self.min_dcs is not None)

    def absorbed(self, name: str) -> bool:
        """Whether ``name`` belongs to a DC already lost (its end changes nothing)."""
        role = self.roles.get(name)
        return role is not None and role.dc in self.lost_dcs

    def judge(self, name: str, what: str) -> str | None:
        """``name`` ended (``what``): the line to print when the run goes on without it ("" when its DC was
        already lost), None when the run must stop."""
        role = self.roles.get(name)
        if role is None:
            return None
        if role.dc in self.lost_dcs:
            return ""
        if role.kind == "worker" and self.min_workers is not None and name not in self.lost \
                and self.workers_left(role.dc) - 1 >= self.min_workers:
            self.lost[name] = what
            return (f"geomx: {name} {what}; DC {role.dc} goes on with {self.workers_left(role.dc)} of "
                    f"{self.workers_per_dc[role.dc]} workers (--min-workers-per-dc {self.min_workers})")
        dcs = len(self.workers_per_dc)
        if self.min_dcs is not None and dcs - len(self.lost_dcs) - 1 >= self.min_dcs:
            self.lost_dcs[role.dc] = f"{name} {what}"
            return (f"geomx: DC {role.dc} drops out ({name} {what}); the run goes on with "
                    f"{dcs - len(self.lost_dcs)} of {dcs} DCs (--min-dcs {self.min_dcs})")
        return None

    def rejoined(self, what: str, dc: str) -> None:
        """The lost worker ``what``, or the whole lost DC ``dc``, was started again (geomx.cli.rejoins): the run
        counts it once more."""
        if what in self.lost:
            del self.lost[what]
            return
        self.lost_dcs.pop(dc, None)
        for name in [n for n in self.lost if self.roles[n].dc == dc]:
            del self.lost[name]

    def __bool__(self) -> bool:
        """Whether anything was lost."""
        return bool(self.lost or self.lost_dcs)

    def summary(self) -> str:
        return ", ".join([*(f"{name} ({what})" for name, what in self.lost.items()),
                          *(f"DC {dc} ({what})" for dc, what in self.lost_dcs.items())])
