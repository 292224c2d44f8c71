"""How long a scheduler waits for a member's next heartbeat before it counts the member as gone.

``MeasuredDeadline`` (the default; ``GEOMX_HEARTBEAT_TIMEOUT`` unset or ``auto``): each member's own deadline,
from the gaps between the heartbeats the scheduler actually received from it: the largest of 3 x the median gap,
the median + 8 x the median absolute deviation, and 1.5 x the longest of the recent gaps (a heartbeat that waited
behind a gradient on a slow WAN link), at least ``FLOOR_S`` and at most the fixed timeout, which also holds until
``MIN_GAPS`` gaps were measured. Members then heartbeat every 0.25 s (``NodeConfig.heartbeat_interval``, unless
``GEOMX_HEARTBEAT_INTERVAL`` says otherwise), so a dead member behind a WAN is found within about 2 s, and
one whose heartbeats come unevenly gets more time. A silence longer than that (a WAN cut for a few seconds) is
not waited out: the member is dropped, and rejoins once restarted (``geomx launch --rejoin-after``).

A member whose process is seen to run (a direct connection whose ZeroMQ answers the scheduler's probes: a peer
on the scheduler's own side of the WAN) gets the cap instead: its silence is a busy process's (a long call that
holds Python's lock, a loaded host), and a frozen one stops answering within ``connection_watch.PROBE_TIMEOUT_S``.

``FixedDeadline`` (``GEOMX_HEARTBEAT_TIMEOUT`` given in seconds): that many seconds, whatever the link, for
deployments that would rather wait out such cuts.
"""
from __future__ import annotations

import statistics
from collections import deque

# at least 8 heartbeat intervals: a member on a loaded host (or one holding Python's lock for a while) can be
# silent for a second without being gone; a 0.75 s floor once dropped such a worker, still training, from a job
# on a 2-core host running two deployments at once
FLOOR_S = 2.0
MIN_GAPS = 8
WINDOW = 64


def median_spread(values) -> tuple[float, float]:
    """The median of ``values`` and their median absolute deviation from it (what measured limits are built
    from here and in geomx.cluster.stuck_rounds)."""
    median = statistics.median(values)
    return median, statistics.median(abs(v - median) for v in values)


class FixedDeadline:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def heard(self, member: str, now: float) -> None:
        pass

    def deadline(self, member: str, *, running: bool = False) -> float:
        return self.timeout

    def describe(self) -> str:
        return f"{self.timeout:g} s (GEOMX_HEARTBEAT_TIMEOUT)"


class MeasuredDeadline:
    def __init__(self, cap: float) -> None:
        self.cap = cap
        self._last: dict[str, float] = {}
        self._gaps: dict[str, deque[float]] = {}

    def heard(self, member: str, now: float) -> None:
        last = self._last.get(member)
        self._last[member] = now
        if last is not None:
            self._gaps.setdefault(member, deque(maxlen=WINDOW)).append(now - last)

    def deadline(self, member: str, *, running: bool = False) -> float:
        """``running``: the member's process is known to run (its ZeroMQ answers the scheduler's probes), so its
        silence is a busy process's (a long call holding Python's lock), not a death: it gets the cap."""
        gaps = self._gaps.get(member)
        if running or gaps is None or len(gaps) < MIN_GAPS:
            return self.cap
        median, spread = median_spread(gaps)
        measured = max(3 * median, median + 8 * spread, 1.5 * max(gaps))
        return min(self.cap, max(FLOOR_S, measured))

    def describe(self) -> str:
        return f"measured from each member's heartbeats (at most {self.cap:g} s)"
