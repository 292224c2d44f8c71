"""The same-host channel of parked messages: routes to the WAN emulator and releases back, off ZeroMQ.

A parked message (geomx.transport.parking) costs the emulator a small message in (its route) and one out (its
release). Over ZeroMQ each of those wakes a ZeroMQ I/O thread and crosses TCP on the loopback: a process that
only relays such messages spends about 100 us of CPU on each (tests/scripts/zmq_relay_floor.py), more than the
emulator's link model and bookkeeping together. Over a Unix ``SOCK_SEQPACKET`` socket (reliable, ordered, one
packet per message, no I/O thread) the same relay costs about 15 us.

So where vans and the emulator share a host (``geomx launch`` on one machine), each van that parks connects to
the emulator's channel when it starts, an abstract Unix name derived from the emulator's TCP address (Linux only:
nothing on disk, gone with the process). Its first packet says which address it receives on, and the emulator
answers ``ACK``; then each packet the van sends is one route (the msgpack map ZeroMQ's route frame carries), and
each packet the emulator sends it is a run of RELEASE markers. Both ends check the other's user id
(``SO_PEERCRED``): an abstract name has no file mode, so another user on the host could otherwise listen under
it or claim a van's releases; the van's connect never blocks, so a squatter cannot hold it either.

Order: a van with a channel parks every message to a receiver on this host, small ones too, and the emulator
releases what a channel routed over the receiver's channel. So each sender's messages to one receiver keep one
path, as the link model ordered them. The path is chosen once, when the van starts (``geomx launch`` starts the
other roles once the emulator listens): switching a running stream from ZeroMQ to the channel would let what
goes over the channel overtake what still waits in ZeroMQ's queues. Where the channel cannot be opened (another
OS, another network namespace, the emulator on another host or of an older version), everything goes over
ZeroMQ as before, and a van whose channel the emulator closed goes back to ZeroMQ for good.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import select
import socket
import struct
import sys
import time
from collections.abc import Callable

import msgpack
import zmq

from geomx.transport.parking import MARKER_BYTES, RELEASE, read_marker
from geomx.transport.refusals import RefusalLog

log = logging.getLogger("geomx.van")

MAX_PACKET = 64 * 1024                  # a route or a hello is far smaller; a run of releases is split to fit
MARKERS_PER_PACKET = MAX_PACKET // MARKER_BYTES
MAX_CONNECTIONS = 256                   # vans one emulator keeps a channel to (each an open file)
ACK = b"geomx-park-ok"
ACK_WAIT_S = 2.0                        # how long a starting van waits for the emulator to take its hello
PACKETS_PER_PASS = 64                   # read from one connection before the loop looks at the others
ACCEPTS_PER_PASS = 16
PAUSE_S = 1.0                           # the listener rests this long when the process is out of files
_UCRED = struct.Struct("3i")            # pid, uid, gid
# a send the kernel cannot take now (EAGAIN, or no memory for the packet): wait for the socket, not give up on it
_SEND_LATER = (errno.EAGAIN, errno.ENOBUFS, errno.ENOMEM)
_warned: set[str] = set()


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


def _read_packets(sock: socket.socket, buffer: bytearray, limit: int) -> tuple[list[bytes], bool]:
    """Up to ``limit`` packets waiting on ``sock`` (non-blocking), and whether the other end has closed it."""
    packets = []
    view = memoryview(buffer)
    while len(packets) < limit:
        try:
            n = sock.recv_into(buffer)
        except BlockingIOError:
            return packets, False
        except OSError:
            return packets, True
        if not n:
            return packets, True
        packets.append(bytes(view[:n]))
    return packets, False


def wait_for_channel(emulator_address: str, *, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Wait until the emulator at ``emulator_address`` listens on its channel, at most ``timeout_s`` and while
    ``alive()``: the vans started after that use it (a van looks for it once, when it starts). False at once
    where there can be none, and as soon as the emulator takes TCP connections without a channel (it opens the
    channel before its port: one that could not, an older version)."""
    host, _, port = emulator_address.removeprefix("tcp://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    while available() and alive() and time.monotonic() < deadline:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.setblocking(False)
        try:
            probe.connect(channel_name(emulator_address))
            return True
        except OSError:
            pass
        finally:
            probe.close()
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            return False
        except (OSError, ValueError):
            time.sleep(0.05)
    return False


class VanChannel:
    """A van's end: routes out (any thread holding the van's send lock), releases in (its receive thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray(MAX_PACKET)
        self.down = False       # the emulator closed it: routes go over ZeroMQ from then on

    @classmethod
    def connect(cls, emulator_address: str, own_address: str, *, wait_s: float = ACK_WAIT_S) -> VanChannel | None:
        """The channel to the emulator at ``emulator_address``, announcing ``own_address``, once the emulator has
        taken it; None where there is none (not Linux, no emulator listening on this host, one of another user,
        or one that did not answer within ``wait_s``)."""
        if not available():
            return None
        name = channel_name(emulator_address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)     # a listener whose queue is full (a squatter's) answers EAGAIN: no hang
        try:
            sock.connect(name)
            if not same_user(sock):
                if name not in _warned:
                    _warned.add(name)
                    log.warning("the WAN emulator's channel %r belongs to another user: parked messages' routes go "
                                "over ZeroMQ", name[1:])
                sock.close()
                return None
            sock.send(msgpack.packb({"addr": own_address}))
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            if not poller.poll(wait_s * 1000) or sock.recv(len(ACK) + 1) != ACK:
                sock.close()
                return None
        except OSError:
            sock.close()
            return None
        return cls(sock)

    def fileno(self) -> int:
        return self._sock.fileno()

    def send_route(self, route: bytes) -> bool:
        """Hand one route to the emulator; False: its buffer is full, try again later. OSError once it is gone."""
        try:
            self._sock.send(route)
        except OSError as exc:
            if exc.errno in _SEND_LATER:
                return False
            raise
        return True

    def read_releases(self) -> list[bytes] | None:
        """The parked ids released since the last call (an empty list: nothing yet); None once the emulator
        closed the channel."""
        packets, closed = _read_packets(self._sock, self._buffer, PACKETS_PER_PASS)
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
    __slots__ = ("sock", "fd", "addr", "backlog", "writable_wanted")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.fd, self.addr = sock, sock.fileno(), None
        self.backlog: collections.deque[bytes] = collections.deque()
        self.writable_wanted = False        # polled for POLLOUT: releases wait for room in the van's buffer


class EmulatorChannel:
    """The emulator's end: opened (listening) when the emulator starts, then used by its loop's thread alone,
    which :meth:`attach` es it to the zmq.Poller where the listener and each van's connection are registered.

    Releases a van's buffer has no room for wait here, in order, as they waited in ZeroMQ's queue before (its
    forward sockets have no high-water mark): the van's own payloads, which it does not read either, hold back
    its senders. The connection is then polled for room too, so the loop sleeps until the van reads."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._poller = None
        self._buffer = bytearray(MAX_PACKET)
        self._connections: dict[int, _Connection] = {}     # by file descriptor, as the poller names them
        self._by_address: dict[str, _Connection] = {}
        self._paused_until: float | None = None     # the listener rests: the process ran out of files
        self.refusals = RefusalLog(log)

    def attach(self, poller) -> None:
        self._poller = poller
        poller.register(self._listener, zmq.POLLIN)

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
    def waiting(self) -> bool:
        """Whether the loop must call :meth:`service`: the listener rests (the process ran out of files)."""
        return self._paused_until is not None

    def service(self, now: float) -> float:
        """Wake the listener after its rest; the seconds until this is due again."""
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self._poller.register(self._listener, zmq.POLLIN)
        return self._paused_until - now if self._paused_until is not None else float("inf")

    @property
    def backlogged(self) -> int:
        """Packets of releases waiting for room in their vans' buffers."""
        return sum(len(conn.backlog) for conn in self._connections.values())

    def ready(self, fd: int, events: int) -> list[tuple[str, bytes]]:
        """Serve ``fd``, a descriptor the poller named with ``events``: accept, send what waits for room; what
        it brought, ``(van address, route packet)`` each."""
        if fd == self._listener.fileno():
            self._accept()
            return []
        conn = self._connections.get(fd)
        if conn is None:                # forgotten earlier in this pass
            return []
        if events & zmq.POLLOUT:
            self._flush(conn)
        if not events & zmq.POLLIN or conn.fd not in self._connections:
            return []
        packets, closed = _read_packets(conn.sock, self._buffer, PACKETS_PER_PASS)
        routes = []
        for packet in packets:
            if conn.addr is None:
                if not self._hello(conn, packet):
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

    def close(self) -> None:
        for conn in list(self._connections.values()):
            self._forget(conn)
        if self._poller is not None and self._paused_until is None:
            self._poller.unregister(self._listener)
        self._listener.close()

    def _flush(self, conn: _Connection) -> None:
        while conn.backlog:
            try:
                conn.sock.send(conn.backlog[0])
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE and len(conn.backlog[0]) > MARKER_BYTES:
                    head = conn.backlog.popleft()      # larger than the socket's buffer: in halves
                    half = len(head) // MARKER_BYTES // 2 * MARKER_BYTES
                    conn.backlog.extendleft((head[half:], head[:half]))
                    continue
                if exc.errno not in _SEND_LATER:   # the van is gone, and what it was owed with it
                    self._forget(conn)
                    return
                if len(conn.backlog) > 1 and len(conn.backlog[-1]) + len(conn.backlog[-2]) <= MAX_PACKET:
                    last = conn.backlog.pop()       # what waits takes as few packets as it can
                    conn.backlog[-1] += last
                if not conn.writable_wanted:
                    conn.writable_wanted = True
                    self._poller.modify(conn.sock, zmq.POLLIN | zmq.POLLOUT)
                return
            conn.backlog.popleft()
        if conn.writable_wanted:
            conn.writable_wanted = False
            self._poller.modify(conn.sock, zmq.POLLIN)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_PASS):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:      # out of files (EMFILE, ENFILE): rest, not spin on a listener still ready
                self.refusals.note("same-host channel", "WAN emulator cannot accept on its same-host channel (%s); "
                                   "resting %g s", exc, PAUSE_S)
                self._poller.unregister(self._listener)
                self._paused_until = time.monotonic() + PAUSE_S
                return
            why = (f"{MAX_CONNECTIONS} already open" if len(self._connections) >= MAX_CONNECTIONS
                   else "another user's process" if not same_user(sock) else None)
            if why is not None:
                self.refusals.note("same-host channel", "WAN emulator refused a same-host channel: %s", why)
                sock.close()
                continue
            sock.setblocking(False)
            self._connections[sock.fileno()] = _Connection(sock)
            self._poller.register(sock, zmq.POLLIN)

    def _hello(self, conn: _Connection, packet: bytes) -> bool:
        try:
            addr = msgpack.unpackb(packet, raw=False).get("addr")
        except Exception:
            addr = None
        if not (isinstance(addr, str) and addr.startswith("tcp://")):
            self.refusals.note("same-host channel", "WAN emulator closed a same-host channel whose first packet "
                               "named no tcp:// address")
            self._forget(conn)
            return False
        try:
            conn.sock.send(ACK)
        except OSError:
            self._forget(conn)
            return False
        # a node restarted at the same address: its releases go to the new process; the old connection's routes
        # are still read until it closes
        conn.addr = addr
        self._by_address[addr] = conn
        return True

    def _forget(self, conn: _Connection) -> None:
        if self._connections.pop(conn.fd, None) is None:
            return
        if conn.addr is not None and self._by_address.get(conn.addr) is conn:
            del self._by_address[conn.addr]
        self._poller.unregister(conn.sock)
        conn.sock.close()
