"""``geomx doctor --probe-listen`` / ``--probe``: measure the RTT and rate of the network path between two hosts,
as a deployment's roles would see it over one TCP connection (a DC's host and the central party's, say), and how
far apart their clocks are (AES-GCM sealing refuses messages sealed too long before a receiver started, by the
sender's clock: ``GEOMX_SEAL_MAX_AGE_S``).

One end listens; the other connects, times ten 1-byte echoes (the median is the RTT) and then sends a bulk
payload, whose receiver times it from its first byte to its last (the goodput of one TCP stream, the way
geomx's links carry a message). Plain TCP: the probe carries no secrets, only zeros and timings.

Wire: the client sends ``E`` + 1 byte (echoed), or ``B`` + an 8-byte big-endian length + that many bytes (the
listener answers with the receive time, from the read that completes the first eighth of the payload to the
last, as a big-endian double, and the bytes received in that time as an 8-byte integer), or ``T`` (the listener
answers its wall-clock time, a big-endian double: the client takes the exchange with the shortest round trip and
reads the offset against the middle of it, as NTP does).

The listener answers one connection at a time, each for at most ``CONNECTION_S`` in all, and stops at the end
of its ``--probe-for`` even mid-connection: a peer that trickles bytes cannot keep it, or hold it from others,
for longer.
"""
from __future__ import annotations

import socket
import statistics
import struct
import time
from dataclasses import dataclass

from geomx.errors import ConfigError, GeomxError

_ECHOES = 10
_CLOCK_READINGS = 5
_CHUNK = 1 << 20
IO_TIMEOUT_S = 30.0
# the listener answers one connection at a time, and each for at most this long in all (a probe of 12 MB at
# 10 Mbit/s takes about 10 s): a timeout per read let a peer sending a byte every few seconds hold it for ever
CONNECTION_S = 60.0


@dataclass(frozen=True)
class ProbeResult:
    rtt_s: float
    nbytes: int
    receive_s: float
    clock_offset_s: float | None = None     # the listener's clock minus this host's; None: an older listener

    @property
    def rate_bps(self) -> float:
        return self.nbytes * 8 / self.receive_s if self.receive_s > 0 else float("inf")

    def __str__(self) -> str:
        clock = ("; the listener's clock reads "
                 f"{self.clock_offset_s * 1e3:+.1f} ms against this host's" if self.clock_offset_s is not None
                 else "; clocks not compared (the listener runs an older geomx)")
        return (f"RTT {self.rtt_s * 1e3:.2f} ms (median of {_ECHOES} echoes); {self.rate_bps / 1e6:.1f} Mbit/s "
                f"received over one TCP stream ({self.nbytes / 1e6:.1f} MB timed in {self.receive_s:.2f} s)"
                + clock)


def parse_endpoint(text: str, *, what: str, default_host: str | None = None) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host or default_host or ""
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT" + (" or PORT" if default_host else ""))
    return host, int(port)


def _receive_exactly(conn: socket.socket | _Bounded, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the connection closed mid-message")
        out += chunk
    return bytes(out)


def serve(host: str, port: int, *, seconds: float, on_ready=None, clock=time.time,
          connection_s: float = CONNECTION_S) -> int:
    """Answer probes on ``host:port`` for ``seconds``, even mid-connection, and each connection for at most
    ``connection_s``; returns the number of probes answered. ``clock``: the wall clock the listener reports (a
    test shifts it)."""
    answered = 0
    with socket.create_server((host, port), reuse_port=False) as server:
        if on_ready is not None:
            on_ready(server.getsockname())
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            server.settimeout(min(0.5, left))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    answered += _answer(_Bounded(conn, min(end, time.monotonic() + connection_s)), clock)
                except (OSError, ConnectionError, struct.error):
                    continue        # a broken probe (or a stranger's junk) ends its connection only
    return answered


class _Bounded:
    """A connection whose reads and writes all end by one deadline (time.monotonic): TimeoutError past it."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self._conn, self._deadline = conn, deadline

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the connection's time is up")
        self._conn.settimeout(left)

    def recv(self, n: int) -> bytes:
        self._arm()
        return self._conn.recv(n)

    def sendall(self, data: bytes) -> None:
        self._arm()       # sendall's timeout bounds the whole call, not each send in it
        self._conn.sendall(data)


def _answer(conn: _Bounded, clock) -> int:
    answered = 0
    while True:
        op = conn.recv(1)
        if not op:
            return answered
        if op == b"E":
            conn.sendall(_receive_exactly(conn, 1))
        elif op == b"T":
            conn.sendall(struct.pack(">d", clock()))
        elif op == b"B":
            (n,) = struct.unpack(">Q", _receive_exactly(conn, 8))
            # timed once the first eighth (at most 1 MiB) is in: a shaper's burst and TCP's slow start are
            # over by then, so the figure is the path's steady rate
            skip = min(n // 8, _CHUNK)
            first, timed, left = None, 0, n
            while left:
                chunk = conn.recv(min(left, _CHUNK))
                if not chunk:
                    raise ConnectionError("the connection closed mid-payload")
                left -= len(chunk)
                if first is not None:
                    timed += len(chunk)
                elif n - left >= skip:
                    first = time.perf_counter()
            conn.sendall(struct.pack(">dQ", time.perf_counter() - first if first is not None else 0.0, timed))
            answered += 1
        else:
            return answered


def probe(host: str, port: int, *, nbytes: int, timeout: float = IO_TIMEOUT_S) -> ProbeResult:
    """RTT and one-stream rate to a listener at ``host:port``."""
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise GeomxError(f"cannot reach the probe listener at {host}:{port}: {exc.strerror or exc} (is "
                         f"geomx doctor --probe-listen running there, and the port open?)") from None
    try:
        return _measure(conn, nbytes)
    except OSError as exc:      # closed, reset or silent: whatever answers there is no probe listener
        what = "timed out" if isinstance(exc, TimeoutError) else "closed the connection" if isinstance(
            exc, ConnectionError) else (exc.strerror or str(exc))
        raise GeomxError(f"the peer at {host}:{port} {what} during the probe: is it geomx doctor --probe-listen "
                         f"(the same geomx version)?") from None


def _measure(conn: socket.socket, nbytes: int) -> ProbeResult:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(_ECHOES):
            start = time.perf_counter()
            conn.sendall(b"E\x00")
            _receive_exactly(conn, 1)
            rtts.append(time.perf_counter() - start)
        conn.sendall(b"B" + struct.pack(">Q", nbytes))
        zeros = memoryview(bytes(_CHUNK))
        left = nbytes
        while left:
            sent = conn.send(zeros[:min(left, _CHUNK)])
            left -= sent
        receive_s, timed = struct.unpack(">dQ", _receive_exactly(conn, 16))
        offset = _clock_offset(conn)
    return ProbeResult(statistics.median(rtts), timed, receive_s, offset)


def _clock_offset(conn: socket.socket) -> float | None:
    """The listener's wall clock minus this host's, from the reading with the shortest round trip (its error is
    at most half that round trip); None if the listener does not answer ``T`` (an older geomx closes)."""
    best = None
    try:
        for _ in range(_CLOCK_READINGS):
            before = time.time()
            conn.sendall(b"T")
            (remote,) = struct.unpack(">d", _receive_exactly(conn, 8))
            after = time.time()
            if best is None or after - before < best[0]:
                best = (after - before, remote - (before + after) / 2)
    except (OSError, ConnectionError):
        return None
    return best[1]
