"""Which peers' connections are down, from ZeroMQ's socket monitor: the fast half of dead-peer detection.

A process that ends (killed, crashed, exited) has its TCP connections closed by the kernel at once, and the
DEALER socket a node keeps to it reports ``EVENT_DISCONNECTED``; heartbeats alone would take their whole
timeout (10 s by default) to say the same. A frozen process (SIGSTOP) or an unreachable host keeps its
connections open, so a van that probes (``liveness_probe``: the schedulers') has ZeroMQ send ZMTP heartbeats on
its connections to peers of its own DC: a peer whose ZeroMQ I/O thread answers none for PROBE_TIMEOUT_S has its
connection closed (over a WAN a late answer says nothing, and geomx's own heartbeats stay the rule there).
That thread is not Python's, so a peer busy holding the GIL still answers; only a stopped process or an
unreachable host does not. A connection counts as up again only once ZeroMQ's handshake succeeds (a frozen
peer's kernel still accepts the TCP reconnection, its ZeroMQ never greets). Only direct connections tell: a
peer in another DC behind the WAN emulator is reached through the emulator's socket, which stays up.
The same answers tell a busy peer from a frozen one (``answering``): a probed connection that is up belongs to a
process that runs, even while it is too busy to send heartbeats of its own.
A handshake that fails (another secret, mechanism or token: geomx.transport.security.HandshakeLog) is handed to
``on_handshake_failed``; the connection is retried as ZeroMQ decides.

ZeroMQ sockets are not thread-safe: the van's sending side creates each monitor socket (a PAIR) next to the
DEALER it watches and hands it over under a lock; from then on only the watch thread touches it.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from geomx.transport.security import HANDSHAKE_FAILED

log = logging.getLogger("geomx.van")

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
_POLL_MS = 100
PROBE_INTERVAL_S = 0.25         # a ZMTP heartbeat this often on a probing van's connections
PROBE_TIMEOUT_S = 1.25          # no answer this long: ZeroMQ closes the connection (a frozen or unreachable peer)


def heartbeat(sock: zmq.Socket) -> None:
    """Have ZeroMQ heartbeat ``sock``'s connection (before it connects)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(PROBE_INTERVAL_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PROBE_TIMEOUT_S * 1000))


class ConnectionWatch:
    def __init__(self, name: str, on_handshake_failed: Callable[[str, dict], None] | None = None) -> None:
        """``on_handshake_failed(addr, event)``: a connection's handshake failed (``HANDSHAKE_FAILED``), on the
        watch thread."""
        self._on_handshake_failed = on_handshake_failed
        self._lock = threading.Lock()
        self._handed_over: list[tuple[zmq.Socket, str]] = []
        self._down: dict[str, float] = {}           # peer address -> when its connection went down (monotonic)
        self._probed: set[str] = set()              # peer addresses whose connections ZeroMQ heartbeats
        self._answering: set[str] = set()           # probed peers greeted and not disconnected since
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"van-watch-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def watch(self, sock: zmq.Socket, addr: str, *, probed: bool = False) -> None:
        """Watch the connection of ``sock`` (a DEALER to ``addr``, heartbeated by ZeroMQ if ``probed``); call on
        the thread that owns it, before it connects (so that no event of its first handshake is missed)."""
        if probed:
            self._probed.add(addr)
        # a name of our own: pyzmq's default names the endpoint after the socket's file descriptor, which a new
        # socket reuses while ZeroMQ may still hold the closed one's endpoint
        try:
            monitor = sock.get_monitor_socket(_EVENTS, addr=f"inproc://geomx-watch-{secrets.token_hex(8)}")
        except zmq.ZMQError as exc:     # watching is an optimization: heartbeats still cover this peer
            log.debug("cannot watch the connection to %s: %s", addr, exc)
            return
        with self._lock:
            self._handed_over.append((monitor, addr))

    def down_since(self, addr: str) -> float | None:
        """When the connection to ``addr`` went down (time.monotonic), None while it is up or never watched."""
        return self._down.get(addr)

    def answering(self, addr: str) -> bool:
        """Whether ``addr``'s ZeroMQ answers this node's probes: its connection is probed, greeted and up."""
        return addr in self._answering

    def _loop(self) -> None:
        poller, monitors = zmq.Poller(), {}
        try:
            while not self._stop.is_set():
                with self._lock:
                    new, self._handed_over = self._handed_over, []
                for monitor, addr in new:
                    poller.register(monitor, zmq.POLLIN)
                    monitors[monitor] = addr
                if not monitors:            # zmq's poll returns at once when it has no socket to watch
                    self._stop.wait(_POLL_MS / 1000)
                    continue
                for monitor, _ in poller.poll(_POLL_MS):
                    self._read(poller, monitors, monitor)
        finally:
            with self._lock:
                leftovers, self._handed_over = self._handed_over, []
            for monitor in [*monitors, *(m for m, _ in leftovers)]:
                monitor.close(linger=0)

    def _read(self, poller: zmq.Poller, monitors: dict, monitor: zmq.Socket) -> None:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        addr = monitors[monitor]
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._answering.discard(addr)
            self._down.setdefault(addr, time.monotonic())
            log.debug("connection to %s closed", addr)
        elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._down.pop(addr, None)
            if addr in self._probed:
                self._answering.add(addr)
        elif event["event"] & HANDSHAKE_FAILED:
            if self._on_handshake_failed is not None:
                self._on_handshake_failed(addr, event)
        elif event["event"] == zmq.EVENT_MONITOR_STOPPED:      # its DEALER was closed
            poller.unregister(monitor)
            del monitors[monitor]
            monitor.close(linger=0)
