"""Name what a synchronous round is waiting for once it has waited far longer than the server's rounds take
(issue 16: no hang without a named cause). A member that died or froze is dropped by its scheduler; one that is
alive but stopped pushing (a script stuck in a loop, a rank that skipped a key) would otherwise only show as a
deadline expiring at the workers, naming the server rather than the member that holds the round up.

The limit is measured: the median duration of this server's recent rounds + 8 x their spread, at least
``FLOOR_S``. Each stuck round is reported once, in the server's log, with the members whose push it lacks.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

from geomx.cluster.liveness import median_spread

if TYPE_CHECKING:
    from geomx.cluster.kvserver import KVServer, Round

log = logging.getLogger("geomx.kvserver")

FLOOR_S = 10.0


class StuckRounds:
    def __init__(self, server: KVServer) -> None:
        self.server = server
        self.durations: deque[float] = deque(maxlen=64)      # seconds from a round's first push to its last
        self.reported: set[tuple] = set()                    # (key, round) already named

    def completed(self, rnd: Round) -> None:
        self.durations.append(time.monotonic() - rnd.opened)

    def limit(self) -> float:
        if len(self.durations) < 2:
            return FLOOR_S
        median, spread = median_spread(self.durations)
        return max(FLOOR_S, median + 8 * spread)

    def check(self) -> None:
        """Runs on the postoffice's heartbeat thread: reads the rounds (a dict changing under it is read next
        time) and only logs."""
        try:
            rounds = [(st, number, rnd) for st in list(self.server.keys.values())
                      for number, rnd in list(st.rounds.items())]
        except RuntimeError:
            return
        now, limit = time.monotonic(), self.limit()
        open_now = set()
        for st, number, rnd in rounds:
            open_now.add((st.key, number))
            if (st.key, number) in self.reported or now - rnd.opened < limit:
                continue
            self.reported.add((st.key, number))
            missing = [c.label for c in self.server.round_waits_for(rnd, number)]
            log.warning("%s: round %d of key %r has waited %.0f s (rounds here take %.2f s, at most %.0f s before "
                        "this is said) for the push of %s", self.server.po.cfg.label, number, st.key,
                        now - rnd.opened, statistics.median(self.durations) if self.durations else 0.0, limit,
                        ", ".join(missing) or "(no one: it is being completed)")
        self.reported &= open_now
