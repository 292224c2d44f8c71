"""Per-destination send queues with a byte cap: a peer that stops reading costs its senders a bounded amount of
memory and slows only the traffic to itself (issue 18: back-pressure, not unbounded memory).

A van keeps one :class:`Outbox` per socket it sends on. Messages wait there in (priority desc, arrival asc)
order while ZeroMQ's pipe to that peer is full (the pipe holds at most ``SEND_PIPE_MESSAGES``). A sender
that would take the outbox past its cap waits until the peer reads again: that is the back-pressure. A peer
that reads nothing for ``STUCK_S`` while its outbox is full makes such a send fail with
:class:`~geomx.errors.PeerLostError` (the failure detector has named it long before: this is the last resort,
so that no thread waits forever).

What one destination can hold: the outbox's cap plus ``SEND_PIPE_MESSAGES`` messages in ZeroMQ's pipe (with
the default parts of at most 16 MiB, 256 MiB + 256 MiB), plus the kernel's socket buffer. One message larger
than the cap is always admitted into an empty outbox, so no size of message can wait forever.
"""
from __future__ import annotations

import heapq
import os
import time
from dataclasses import dataclass, field

from geomx.errors import ConfigError

SEND_PIPE_MESSAGES = 16         # ZeroMQ's SNDHWM per peer: a count, so the byte cap lives in the outbox
DEFAULT_SEND_QUEUE_MB = 256
STUCK_S = 30.0
_RETRY_FIRST_S = 1e-4           # a full pipe usually drains within microseconds: retry soon, then back off
_RETRY_MAX_S = 0.02

__all__ = ["DEFAULT_SEND_QUEUE_MB", "Outbox", "Queued", "SEND_PIPE_MESSAGES", "STUCK_S", "send_queue_bytes"]


def send_queue_bytes(env=None) -> int:
    """The cap of one destination's outbox, from ``GEOMX_SEND_QUEUE_MB`` (MiB, default 256)."""
    text = (env if env is not None else os.environ).get("GEOMX_SEND_QUEUE_MB")
    if not text:
        return DEFAULT_SEND_QUEUE_MB << 20
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"GEOMX_SEND_QUEUE_MB={text!r} is not a number of MiB") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"GEOMX_SEND_QUEUE_MB={text!r} must be a positive number of MiB")
    return max(1, int(value * (1 << 20)))


@dataclass(order=True)
class Queued:
    """One message waiting for its socket. ``wire`` holds its frames as they go out (sealed, behind the
    emulator's route frame) once a send was tried: a seal's counter is spent then, so a retry must not seal
    again."""
    neg_priority: int
    seq: int
    addr: str = field(compare=False)            # the receiver (the socket's peer, or behind the emulator)
    socket: str = field(compare=False)          # the socket it leaves on: ``addr``, or the emulator's
    dst_dc: str | None = field(compare=False)
    frames: list = field(compare=False)
    nbytes: int = field(compare=False)
    wire: list | None = field(default=None, compare=False)
    park: bytes | None = field(default=None, compare=False)     # parked at its receiver (geomx.transport.parking)
    parked: bool = field(default=False, compare=False)          # ... and its frames already went there


class Outbox:
    """The messages waiting for one socket. Not thread-safe: the van guards it with its condition."""

    def __init__(self) -> None:
        self._heap: list[Queued] = []
        self.nbytes = 0                 # queued, including a message being tried
        self.busy = False               # the send thread is trying its head message
        self.retry_at = 0.0             # the pipe was full: do not try again before this
        self._backoff = _RETRY_FIRST_S
        self.last_progress = time.monotonic()   # the peer last read (or the outbox last filled from empty)

    def __len__(self) -> int:
        return len(self._heap) + self.busy

    def idle(self) -> bool:
        """Nothing queued or being tried: a new message may go straight to the socket."""
        return not self._heap and not self.busy

    def ready(self, now: float) -> bool:
        return bool(self._heap) and not self.busy and self.retry_at <= now

    def head(self) -> Queued:
        return self._heap[0]

    def full_for(self, nbytes: int, cap: int) -> bool:
        """Whether adding ``nbytes`` would pass ``cap`` (an empty outbox always takes one message)."""
        return self.nbytes > 0 and self.nbytes + nbytes > cap

    def put(self, item: Queued) -> None:
        if not self.nbytes:
            self.last_progress = time.monotonic()
        heapq.heappush(self._heap, item)
        self.nbytes += item.nbytes

    def take(self) -> Queued:
        """The head message, for the send thread to try (it stays counted until :meth:`sent`)."""
        self.busy = True
        return heapq.heappop(self._heap)

    def sent(self, item: Queued) -> None:
        self.busy = False
        self.nbytes -= item.nbytes
        self.retry_at = 0.0
        self._backoff = _RETRY_FIRST_S
        self.last_progress = time.monotonic()

    def refused(self, item: Queued) -> None:
        """The pipe was full: the message goes back (ahead of its equals) and waits a little longer each time."""
        self.busy = False
        heapq.heappush(self._heap, item)
        self.retry_at = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, _RETRY_MAX_S)

    def drop_all(self) -> int:
        """Forget every queued message (the van stopped); returns how many there were."""
        count = len(self._heap)
        self._heap.clear()
        self.nbytes = 0
        return count
