"""Which training workers ``geomx launch`` may lose and go on: a DC is a fault domain.

A DC's scheduler drops a worker that stops sending heartbeats while ``--min-workers-per-dc`` of the DC's
workers remain (geomx.cluster.scheduler), and the DC's local server completes its rounds without it. The
launcher makes the same decision for a worker process that exits with an error or a signal, or that is still
frozen (SIGSTOP) when every other trainer finished: it names the worker and goes on instead of stopping the
deployment. The flat topology has no local servers, so there every worker is needed.
"""
from __future__ import annotations

from collections import Counter

MIN_WORKERS_ENV = "GEOMX_MIN_WORKERS_PER_DC"


class WorkerLosses:
    def __init__(self, workers: dict[str, str], min_workers: int | None) -> None:
        """``workers``: role name -> DC of every training worker; ``min_workers``: None when none may be lost."""
        self.workers, self.min_workers = dict(workers), min_workers
        self.per_dc = Counter(self.workers.values())
        self.lost: dict[str, str] = {}          # role name -> what happened to it

    def remaining(self, dc: str) -> int:
        return self.per_dc[dc] - sum(1 for name in self.lost if self.workers[name] == dc)

    def may_lose(self, name: str) -> bool:
        if self.min_workers is None or name not in self.workers or name in self.lost:
            return False
        return self.remaining(self.workers[name]) - 1 >= self.min_workers

    def lose(self, name: str, what: str) -> str:
        """Record the loss; the line the launcher prints."""
        self.lost[name] = what
        dc = self.workers[name]
        return (f"geomx: {name} {what}; DC {dc} goes on with {self.remaining(dc)} of {self.per_dc[dc]} workers "
                f"(--min-workers-per-dc {self.min_workers})")

    def summary(self) -> str:
        return ", ".join(f"{name} ({what})" for name, what in self.lost.items())
