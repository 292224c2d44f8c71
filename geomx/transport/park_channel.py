"""The same-host channel of parked messages: routes to the WAN emulator and releases back, off ZeroMQ.

A parked message (geomx.transport.parking) costs the emulator a small message in (its route) and one out (its
release). Over ZeroMQ each of those wakes a ZeroMQ I/O thread and crosses TCP on the loopback: a process that
only relays such messages spends about 110 us of CPU on each (tests/scripts/zmq_relay_floor.py), more than the
emulator's link model and bookkeeping together. Over a Unix ``SOCK_SEQPACKET`` socket (reliable, ordered, one
packet per message, no I/O thread) the same relay costs about 17 us.

So where vans and the emulator share a host (``geomx launch`` on one machine), each van that parks connects to
the emulator's channel, an abstract Unix name derived from the emulator's TCP address (Linux only: nothing on
disk, gone with the process). Its first packet says which address it receives on; then each packet it sends is
one route (the msgpack map ZeroMQ's route frame carries), and each packet the emulator sends it is a run of
RELEASE markers. Both ends check the other's user id (``SO_PEERCRED``): an abstract name has no file mode, so
another user on the host could otherwise listen under it or claim a van's releases.

Order: a van with a channel parks every message to a receiver on this host, small ones too, and the emulator
releases what a channel routed over the receiver's channel. So each sender's messages to one receiver keep one
path, as the link model ordered them. Where the channel cannot be opened (another OS, another network
namespace, the emulator on another host, an older emulator), everything goes over ZeroMQ as before.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import sys

import msgpack

from geomx.transport.parking import MARKER_BYTES, RELEASE, read_marker

log = logging.getLogger("geomx.van")

MAX_PACKET = 64 * 1024                  # a route or a hello is far smaller; a run of releases is split to fit
MARKERS_PER_PACKET = MAX_PACKET // MARKER_BYTES
MAX_CONNECTIONS = 1024                  # vans one emulator keeps a channel to
MAX_BACKLOG_PACKETS = 100_000           # releases waiting for a van that stopped reading, then dropped
_UCRED = struct.Struct("3i")            # pid, uid, gid


def channel_name(emulator_address: str) -> str:
    """The abstract Unix name of the channel of the emulator at ``emulator_address`` (tcp://host:port)."""
    return "\0geomx-park-" + emulator_address.removeprefix("tcp://")


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "SOCK_SEQPACKET")


def same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of ``sock`` runs as this process's user."""
    try:
        _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return False
    return uid == os.getuid()


def _read_packets(sock: socket.socket) -> tuple[list[bytes], bool]:
    """The packets waiting on ``sock`` (non-blocking), and whether the other end has closed it."""
    packets = []
    while True:
        try:
            packet = sock.recv(MAX_PACKET)
        except BlockingIOError:
            return packets, False
        except OSError:
            return packets, True
        if not packet:
            return packets, True
        packets.append(packet)


class VanChannel:
    """A van's end: routes out (any thread holding the van's send lock), releases in (its receive thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.down = False

    @classmethod
    def connect(cls, emulator_address: str, own_address: str) -> VanChannel | None:
        """The channel to the emulator at ``emulator_address``, announcing ``own_address``; None where there is
        none (not Linux, no emulator listening on this host, or one of another user)."""
        if not available():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(channel_name(emulator_address))
            if not same_user(sock):
                log.warning("the WAN emulator's channel %r belongs to another user: parked messages' routes go "
                            "over ZeroMQ", channel_name(emulator_address)[1:])
                sock.close()
                return None
            sock.sendall(msgpack.packb({"addr": own_address}))
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        return cls(sock)

    def fileno(self) -> int:
        return self._sock.fileno()

    def send_route(self, route: bytes) -> bool:
        """Hand one route to the emulator; False: its buffer is full, try again later. OSError once it is gone."""
        try:
            self._sock.send(route)
        except BlockingIOError:
            return False
        return True

    def read_releases(self) -> list[bytes] | None:
        """The parked ids released since the last call (an empty list: nothing yet); None once the emulator
        closed the channel."""
        packets, closed = _read_packets(self._sock)
        ids: list[bytes] = []
        for packet in packets:
            for at in range(0, len(packet) - MARKER_BYTES + 1, MARKER_BYTES):
                mark = read_marker(packet[at:at + MARKER_BYTES])
                if mark is not None and mark[0] == RELEASE:
                    ids.append(mark[1])
        if closed:
            self.down = True
        return ids or (None if closed else [])

    def close(self) -> None:
        self._sock.close()


class _Connection:
    __slots__ = ("sock", "addr", "backlog")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.addr = sock, None
        self.backlog: collections.deque[bytes] = collections.deque()


class EmulatorChannel:
    """The emulator's end: opened (listening) when the emulator starts, then used by its loop's thread alone,
    which :meth:`attach` es it to the zmq.Poller where the listener and each van's connection are registered."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._poller = None
        self._connections: dict[int, _Connection] = {}     # by file descriptor, as the poller names them
        self._by_address: dict[str, _Connection] = {}
        self._waiting: set[_Connection] = set()     # with releases their van's buffer had no room for
        self.dropped_releases = 0

    def attach(self, poller) -> None:
        self._poller = poller
        poller.register(self._listener, 1)      # zmq.POLLIN

    @classmethod
    def open(cls, emulator_address: str) -> EmulatorChannel | None:
        """Listen for the vans of this host; None where no channel can be opened (logged)."""
        if not available():
            return None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(channel_name(emulator_address))
            listener.listen(64)
        except OSError as exc:
            listener.close()
            log.info("WAN emulator: no same-host channel for parked messages (%s); their routes go over ZeroMQ", exc)
            return None
        listener.setblocking(False)
        return cls(listener)

    @property
    def pending(self) -> bool:
        """Whether releases wait for a van's buffer to drain (the loop then comes back within a millisecond)."""
        return bool(self._waiting)

    def readable(self, fd: int) -> list[tuple[str, bytes]]:
        """What ``fd`` (a descriptor the poller said is readable) brought: ``(van address, route packet)`` each."""
        if fd == self._listener.fileno():
            self._accept()
            return []
        conn = self._connections.get(fd)
        if conn is None:                # forgotten earlier in this pass (the same van connected again)
            return []
        packets, closed = _read_packets(conn.sock)
        routes = []
        for packet in packets:
            if conn.addr is None:
                conn.addr = self._hello(conn, packet)
                if conn.addr is None:
                    return routes
            else:
                routes.append((conn.addr, packet))
        if closed:
            self._forget(conn)
        return routes

    def release(self, addr: str, marks: list[bytes]) -> bool:
        """Send ``marks`` (RELEASE markers) to the van receiving at ``addr``; False: it has no channel."""
        conn = self._by_address.get(addr)
        if conn is None:
            return False
        for at in range(0, len(marks), MARKERS_PER_PACKET):
            conn.backlog.append(b"".join(marks[at:at + MARKERS_PER_PACKET]))
        self._flush(conn)
        return True

    def flush(self) -> None:
        for conn in list(self._waiting):
            self._flush(conn)

    def close(self) -> None:
        for conn in list(self._connections.values()):
            self._forget(conn)
        if self._poller is not None:
            self._poller.unregister(self._listener)
        self._listener.close()

    def _flush(self, conn: _Connection) -> None:
        while conn.backlog:
            try:
                conn.sock.send(conn.backlog[0])
            except BlockingIOError:
                break
            except OSError:             # the van is gone: what it was owed goes with it
                self.dropped_releases += sum(len(p) // MARKER_BYTES for p in conn.backlog)
                self._forget(conn)
                return
            conn.backlog.popleft()
        if not conn.backlog:
            self._waiting.discard(conn)
            return
        self._waiting.add(conn)
        if len(conn.backlog) > MAX_BACKLOG_PACKETS:
            lost = sum(len(p) // MARKER_BYTES for p in conn.backlog)
            self.dropped_releases += lost
            log.error("WAN emulator dropped %d releases for %s, which has read none of them: its parked messages "
                      "are lost", lost, conn.addr)
            self._forget(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("WAN emulator: accepting on its same-host channel failed: %s", exc)
                return
            if len(self._connections) >= MAX_CONNECTIONS or not same_user(sock):
                log.warning("WAN emulator refused a same-host channel: %s", "another user's process"
                            if len(self._connections) < MAX_CONNECTIONS else f"{MAX_CONNECTIONS} already open")
                sock.close()
                continue
            sock.setblocking(False)
            self._connections[sock.fileno()] = _Connection(sock)
            self._poller.register(sock, 1)

    def _hello(self, conn: _Connection, packet: bytes) -> str | None:
        try:
            addr = msgpack.unpackb(packet, raw=False).get("addr")
        except Exception:
            addr = None
        if not (isinstance(addr, str) and addr.startswith("tcp://")):
            log.warning("WAN emulator closed a same-host channel whose first packet named no tcp:// address")
            self._forget(conn)
            return None
        previous = self._by_address.get(addr)
        if previous is not None:        # a node restarted at the same address: the new connection is its
            self._forget(previous)
        self._by_address[addr] = conn
        return addr

    def _forget(self, conn: _Connection) -> None:
        if self._connections.pop(conn.sock.fileno(), None) is None:
            return
        self._waiting.discard(conn)
        if conn.addr is not None and self._by_address.get(conn.addr) is conn:
            del self._by_address[conn.addr]
        self._poller.unregister(conn.sock)
        conn.sock.close()
