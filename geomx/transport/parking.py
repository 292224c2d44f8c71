"""Payloads that skip the WAN emulator: the bytes go straight to their receiver, the emulator decides when.

Relaying a message through the emulator process costs it a receive and a send of every byte (ZeroMQ's and the
kernel's copies, about a millisecond of CPU per MB on a 2-core host: the biggest consumer of an emulated
deployment's CPU above 1 Gbit/s). Where sender and receiver are on the same host as the emulator (``geomx
launch`` on one machine), a van may instead *park* the message at its receiver and send the emulator only its
route and size:

* the payload goes straight to the receiver, behind a marker frame ``PARK + id``; the receiving van reads and
  checks it as any message (sealed or not) but holds it;
* the emulator queues the message's size on its links as if the bytes were there (same chunks, priorities,
  counters) and, when the model delivers it, sends the receiver ``RELEASE + id``, which hands the held message
  on (the releases one pump of its engine delivers to one receiver travel as the frames of one message). A
  release that overtakes its payload waits for it.

So the receiver sees every message at the time the link model gives it, and the WAN bytes are counted as
before; only the copies through the emulator's process are gone. On Linux the routes and releases travel over
the emulator's same-host channel instead of ZeroMQ (geomx.transport.park_channel), where a van can open it.
A marker frame starts with 0xC1, which begins no msgpack value (an unsealed message's header) and no sealed
envelope (whose first byte is its version).

:class:`Parking` is the receiving side's store. Held messages and early releases are bounded in age
(``max_age_s``: one never matched is dropped and logged; by default as long as a request may wait for it,
``GEOMX_TIMEOUT``, at least 300 s, so a long WAN backlog is not cut short), in number, and held bytes in all
(``max_bytes``, ``GEOMX_PARK_MB``, default 4096: a deployment's WAN backlog towards one node is held there, where
it used to wait in the emulator; a peer that parks and never has its messages released cannot grow a node past it).
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

from geomx.errors import ConfigError

log = logging.getLogger("geomx.van")

PARK, RELEASE = b"\xc1P", b"\xc1R"
ID_BYTES = 12
MARKER_BYTES = len(PARK) + ID_BYTES
MAX_AGE_S = 300.0
MAX_ENTRIES = 100_000
DEFAULT_PARK_MB = 4096


def new_id() -> bytes:
    return os.urandom(ID_BYTES)


def marker(kind: bytes, ident: bytes) -> bytes:
    return kind + ident


def read_marker(frame: bytes | memoryview) -> tuple[bytes, bytes] | None:
    """``(PARK or RELEASE, id)`` for a marker frame, else None (an ordinary message's first frame)."""
    if len(frame) != MARKER_BYTES or frame[0] != 0xC1:
        return None
    kind = bytes(frame[:len(PARK)])
    return (kind, bytes(frame[len(PARK):])) if kind in (PARK, RELEASE) else None


class Parking:
    """Held messages by id, and releases that came first. Used by one thread (the van's receive thread)."""

    def __init__(self, *, max_age_s: float | None = None, max_entries: int = MAX_ENTRIES,
                 max_bytes: int | None = None) -> None:
        self.max_age_s = max_age_s if max_age_s is not None else _env_max_age()
        self.max_entries = max_entries
        self.max_bytes = max_bytes if max_bytes is not None else _env_park_bytes()
        self._held: OrderedDict[bytes, tuple[float, object, int]] = OrderedDict()   # id -> (since, message, bytes)
        self._released: OrderedDict[bytes, float] = OrderedDict()                   # id -> since
        self.held_bytes = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._held)

    def park(self, ident: bytes, msg, nbytes: int = 0) -> object | None:
        """Hold ``msg`` (of ``nbytes``); returns it at once if its release came first."""
        self._expire()
        if self._released.pop(ident, None) is not None:
            return msg
        self._held[ident] = (time.monotonic(), msg, nbytes)
        self.held_bytes += nbytes
        self._expire()
        return None

    def release(self, ident: bytes) -> object | None:
        """The held message ``ident``, or None (its payload has not come yet: remember the release)."""
        self._expire()
        held = self._held.pop(ident, None)
        if held is not None:
            self.held_bytes -= held[2]
            return held[1]
        self._released[ident] = time.monotonic()
        return None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held:
            since = next(iter(self._held.values()))[0]
            why = (f"more than {self.max_entries} messages waited" if len(self._held) > self.max_entries else
                   f"more than {self.max_bytes >> 20} MiB waited (GEOMX_PARK_MB)" if self.held_bytes > self.max_bytes
                   else f"it waited {now - since:.0f} s (GEOMX_TIMEOUT)" if now - since > self.max_age_s else None)
            if why is None:
                break
            self.held_bytes -= self._held.popitem(last=False)[1][2]
            self._drop("message", why)
        while self._released and (len(self._released) > self.max_entries
                                  or now - next(iter(self._released.values())) > self.max_age_s):
            self._released.popitem(last=False)
            self._drop("release", f"no message came for it within {self.max_age_s:.0f} s")

    def _drop(self, what: str, why: str) -> None:
        # lost: the request it belongs to waits until its deadline, so say which limit to raise
        self.dropped += 1
        log.error("a parked %s, still waiting for its %s from the WAN emulator, was dropped: %s", what,
                  "release" if what == "message" else "message", why)


def _env_max_age() -> float:
    """As long as a request may wait (GEOMX_TIMEOUT, checked where the role's configuration is read), at least
    MAX_AGE_S: a message held behind a long WAN backlog is still on its way."""
    try:
        return max(MAX_AGE_S, float(os.environ.get("GEOMX_TIMEOUT") or 0))
    except ValueError:
        return MAX_AGE_S


def _env_park_bytes() -> int:
    text = os.environ.get("GEOMX_PARK_MB")
    try:
        value = float(text) if text else DEFAULT_PARK_MB
    except ValueError:
        raise ConfigError(f"GEOMX_PARK_MB={text!r} is not a number of MiB") from None
    if not value > 0:
        raise ConfigError(f"GEOMX_PARK_MB={text!r} must be a positive number of MiB")
    return int(value * (1 << 20))
