"""Emulated slow workers: ``geomx launch --slowdown DC[:RANK]=FACTOR`` sets ``GEOMX_SLOWDOWN=FACTOR`` on the
chosen workers, and :class:`DistributedOptimizer` makes each of their steps take FACTOR times its compute time
by sleeping (FACTOR - 1) x the compute it measured. Heterogeneous DCs can so be studied on one machine: the
sleep is what a slower accelerator would add, and it overlaps nothing (it counts as compute in the reports).
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

from geomx.errors import ConfigError

ENV = "GEOMX_SLOWDOWN"


def parse_factor(text: str, where: str) -> float:
    """A slowdown factor: a finite number >= 1 (1 = normal speed)."""
    try:
        factor = float(text)
    except ValueError:
        raise ConfigError(f"{where}: slowdown factor {text!r} is not a number") from None
    if not factor >= 1.0 or factor == float("inf"):
        raise ConfigError(f"{where}: slowdown factor must be a finite number >= 1 (a worker can be slowed, not "
                          f"sped up), got {text}")
    return factor


class Slowdown:
    """Measures a worker's compute per step (from ``zero_grad`` or the previous step to ``step``) and sleeps
    (factor - 1) times as long."""

    def __init__(self, *, factor: float = 1.0) -> None:
        self.factor = parse_factor(str(factor), "Slowdown")
        self._since = time.perf_counter()
        self.slept_s = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Slowdown:
        raw = (os.environ if env is None else env).get(ENV, "")
        return cls(factor=parse_factor(raw, ENV) if raw.strip() else 1.0)

    def compute_starts(self) -> None:
        self._since = time.perf_counter()

    def pause(self) -> float:
        """Called when the step's compute is done: sleep so that it took ``factor`` times as long. Returns the
        step's compute time, the sleep included."""
        compute = time.perf_counter() - self._since
        if self.factor > 1.0:
            extra = (self.factor - 1.0) * compute
            time.sleep(extra)
            self.slept_s += extra
            compute += extra
        return compute
