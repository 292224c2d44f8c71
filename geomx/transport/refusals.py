"""Rate-limited warnings about refused input, per peer.

A stranger can send junk as fast as the network carries it; one log line per message would fill the disk
and cost more CPU than dropping the message. Each peer gets a short burst of lines, then one line per
period that counts what was suppressed. The peers tracked are capped (a flood under ever new names shares
one bucket), so the bookkeeping itself stays bounded.
"""
from __future__ import annotations

import logging
import threading
import time

from geomx.transport.ids import public_name

BURST = 10               # lines a peer gets before its warnings are throttled
PERIOD_S = 10.0          # then at most one line per period, with the count of what was suppressed
MAX_PEERS = 256          # peers tracked one by one; the rest share the bucket named OTHERS
TOTAL_BURST = 50         # lines per period from all peers together (a stranger can claim many names)
OTHERS = "<other peers>"


class RefusalLog:
    """``note(peer, fmt, *args)`` logs a refusal unless ``peer`` has had its burst this period."""

    def __init__(self, logger: logging.Logger, *, burst: int = BURST, period_s: float = PERIOD_S,
                 max_peers: int = MAX_PEERS) -> None:
        self.logger, self.burst, self.period_s, self.max_peers = logger, burst, period_s, max_peers
        self.total = 0                                           # refusals noted, logged or not
        self.lines = 0                                           # lines logged
        self._window = [0.0, 0]                                  # [start of this period, lines in it]
        self._peers: dict[str, list] = {}                        # peer -> [period start, lines, suppressed]
        self._lock = threading.Lock()

    def note(self, peer, fmt: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            name = peer if isinstance(peer, str) else repr(peer)
            shown = public_name(peer)       # a peer is named by its id, which logs never show
            state = self._peers.get(name)
            if state is None:
                if len(self._peers) >= self.max_peers:
                    name = shown = OTHERS
                    state = self._peers.get(name)
                if state is None:
                    state = self._peers[name] = [now, 0, 0]    # [last line's time, lines, suppressed since]
            if now - self._window[0] >= self.period_s:
                self._window = [now, 0]
            if (state[1] >= self.burst and now - state[0] < self.period_s) or self._window[1] >= TOTAL_BURST:
                state[2] += 1
                return
            self._window[1] += 1
            suppressed = state[2]
            state[0], state[2] = now, 0
            state[1] += 1
            self.lines += 1
        if suppressed:
            fmt += " (%d similar refusals from %s suppressed in the last %.0f s)"
            args = (*args, suppressed, shown, self.period_s)
        self.logger.warning(fmt, *args)
