"""The ZeroMQ van (kind "zmq", see geomx.transport.base): one node's endpoint on the network (the name and the
job come from ps-lite).

Every node binds one ZeroMQ ROUTER socket and reaches each peer through a DEALER socket connected to the
peer's ROUTER. Two threads, each owning its sockets (ZeroMQ sockets are not thread-safe):

* the receive thread decodes every frame set into a :class:`Message` and hands it to ``on_message``;
  malformed input is logged and dropped, never fatal. It reads the header frame first, so that
  ``receive_into`` (when set) can name arrays the tensor frames are received straight into: a pulled value
  lands in the caller's output without an extra allocation or copy;
* the send thread drains a queue ordered by (priority desc, arrival asc): FIFO among equal priorities,
  unlike ps-lite's heap, which reverses equal-priority backlogs. When nothing is queued and no send is in
  progress, ``send`` hands the message to ZeroMQ on the caller's thread instead (a zero-copy send returns
  at once): one thread wake-up less per message, which is most of a small message's latency on a busy
  host. The sockets are shared under one lock, which also keeps the order.

When a WAN emulator is configured, a message to a node of another DC goes to the emulator instead, behind a
small route frame (see :mod:`geomx.netem.emulator`); the receiver cannot tell the difference.
"""
from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import os
import secrets
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import zmq

from geomx.errors import ConfigError, ProtocolError
from geomx.transport.base import STALL_S, Van, register_van
from geomx.transport.message import Message, build_message, decode_header, encode, payload_nbytes
from geomx.transport.refusals import RefusalLog
from geomx.transport.security import Curve, Plain, Sealed

log = logging.getLogger("geomx.van")

_POLL_MS = 100

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MIB = 1024 * 1024
_allocator_tuned = False


def keep_freed_buffers() -> None:
    """Let glibc keep freed message buffers for reuse (once per process).

    ZeroMQ allocates every received message. By default glibc serves blocks of a few MiB straight from mmap
    and hands the top of a heap back to the OS once twice the last such size is free, so every round of
    4 MiB parts page-faults its buffers in again: half a millisecond per MiB on a loaded VM, a tenth of the
    transport's CPU time at 16 MiB. Here blocks up to 32 MiB (glibc's ceiling) come from the heap, and up
    to 128 MiB of free heap stays mapped."""
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * _MIB)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * _MIB)
    except (ValueError, OSError, AttributeError) as exc:    # not Linux/glibc: leave the allocator alone
        log.debug("allocator thresholds left as they are: %s", exc)


# messages one peer may have waiting for the receive thread; past it ZeroMQ stops reading that peer's
# connection, so a flood fills the sender's buffers (TCP back-pressure), not this process's memory. Senders
# never block on it: their own queues absorb a burst.
RECEIVE_QUEUE_PER_PEER = 256


_ID_HEX = 24


def new_node_id(prefix: str) -> str:
    """An id nobody can guess (96 random bits): the sender checks of every receiver rest on it."""
    return f"{prefix}-{secrets.token_hex(_ID_HEX // 2)}"


def public_name(node_id: str) -> str:
    """What logs, thread names and metrics files may show of an id: without the random part of a
    :func:`new_node_id`, which must stay unknown outside the deployment (a metrics file or a thread name is
    readable by more users than the processes are)."""
    head, _, tail = node_id.rpartition("-")
    return head if head and len(tail) == _ID_HEX and all(c in "0123456789abcdef" for c in tail) else node_id


__all__ = ["RECEIVE_QUEUE_PER_PEER", "STALL_S", "Van", "ZmqVan", "is_tcp_address", "keep_freed_buffers", "new_node_id",
           "public_name", "receive_multipart", "tcp_address"]


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def receive_multipart(sock: zmq.Socket, keep_going: Callable[[], bool]) -> Iterator[list]:
    """Yield the frame lists arriving on ``sock`` (not copied) while ``keep_going()``; then close it.
    Polls with a short timeout so that a stop request is noticed."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while keep_going():
            if poller.poll(_POLL_MS):
                yield sock.recv_multipart(copy=False)
    finally:
        sock.close(linger=0)


def is_tcp_address(addr) -> bool:
    if not isinstance(addr, str) or not addr.startswith("tcp://"):
        return False
    host, _, port = addr[6:].rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


@register_van("zmq")
class ZmqVan(Van):
    """Send and receive :class:`Message` objects over ZeroMQ; see the module docstring."""

    def __init__(self, *, node_id: str, dc: str, on_message: Callable[[Message], None], host: str = "127.0.0.1",
                 port: int = 0, bind_host: str | None = None, emulator: str | None = None,
                 context: zmq.Context | None = None, security: Sealed | Curve | Plain | None = None) -> None:
        super().__init__(node_id=node_id, dc=dc, on_message=on_message)
        self.host = host
        self._bind_host = bind_host or host
        self._port = port
        self._emulator = emulator
        self._ctx = context or zmq.Context.instance()
        self._security = security
        self._seal = security.sealing(node_id) if security is not None else None   # Sealed: AES-GCM per message
        self._queue: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()      # held while a thread uses the DEALER sockets
        self._sockets: dict[str, zmq.Socket] = {}
        self._running = False
        self._router: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []
        self.sent_bytes: dict[str, int] = defaultdict(int)      # by destination DC, as handed to ZeroMQ
        self.sent_messages: dict[str, int] = defaultdict(int)
        self.received_bytes = 0
        self.dropped_messages = 0
        self.refusals = RefusalLog(log)

    @property
    def address(self) -> str:
        return tcp_address(self.host, self._port)

    @property
    def port(self) -> int:
        return self._port

    @classmethod
    def is_address(cls, addr) -> bool:
        return is_tcp_address(addr)

    def peer_address(self, host: str, port: int) -> str:
        return tcp_address(host, port)

    def start(self) -> None:
        keep_freed_buffers()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_PER_PEER)
        if self._security is not None:
            self._security.server(router)
        try:
            if self._port:
                router.bind(tcp_address(self._bind_host, self._port))
            else:
                self._port = router.bind_to_random_port(f"tcp://{self._bind_host}")
        except zmq.ZMQError as exc:
            router.close()
            if self._security is not None:
                self._security.release(self._ctx)
            raise ConfigError(f"cannot listen on {tcp_address(self._bind_host, self._port)}: {exc.strerror}"
                              + (" (port already in use)" if exc.errno == zmq.EADDRINUSE else "")) from None
        self._router = router
        self._running = True
        for target, name in ((self._receive_loop, "recv"), (self._send_loop, "send")):
            t = threading.Thread(target=target, name=f"van-{name}-{public_name(self.node_id)}", daemon=True)
            t.start()
            self._threads.append(t)

    def send(self, addr: str, msg: Message, *, dst_dc: str | None = None) -> None:
        """Queue ``msg`` for ``addr`` (a tcp:// address); ``dst_dc`` routes it through the WAN emulator."""
        if not msg.src:
            msg.src = self.node_id
        frames = encode(msg)
        if self._send_lock.acquire(blocking=False):
            try:
                with self._cv:
                    direct = self._running and not self._queue
                if direct:
                    self._send_now(msg.priority, addr, dst_dc, frames)
                    return
            finally:
                self._send_lock.release()
        with self._cv:
            heapq.heappush(self._queue, (-msg.priority, next(self._seq), addr, dst_dc, frames))
            self._cv.notify()

    def counters(self) -> dict:
        """Cumulative traffic (see geomx.metrics, kind ``traffic``)."""
        return {"node": public_name(self.node_id), "sent": dict(self.sent_bytes),
                "sent_messages": dict(self.sent_messages), "received": self.received_bytes,
                "send_queue": len(self._queue)}

    def stop(self, flush_timeout: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout``), then close the sockets."""
        with self._cv:
            if not self._running:
                return
            self._cv.wait_for(lambda: not self._queue, timeout=flush_timeout)
            self._running = False
            self._cv.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=flush_timeout + 1.0)

    # -- threads -----------------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        sock = self._router
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while self._running:
                if not poller.poll(_POLL_MS):
                    continue
                while self._running:            # drain what is there before polling again
                    try:
                        peer = sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive_one(sock, peer)
        finally:
            sock.close(linger=0)
            if self._security is not None:
                self._security.release(self._ctx)

    def _receive_one(self, sock: zmq.Socket, peer: zmq.Frame) -> None:
        """Read the rest of one message (always all its frames, so the next message starts clean), open it when
        links are sealed, decode it and hand it on."""
        header, error, frames = None, None, []
        nbytes = 0
        letter, more = None, peer.more
        if more and self._seal is not None:
            envelope = sock.recv(copy=False)
            nbytes, more = len(envelope), envelope.more
            try:
                letter = self._seal.letter(envelope, self._port)
            except ProtocolError as exc:
                error = exc
        if more:
            head = sock.recv(copy=False)
            nbytes += len(head)
            if error is None:
                try:
                    header = decode_header(letter.open(0, head) if letter is not None else head)
                except ProtocolError as exc:
                    error = exc
            targets = self.targets(header) if header is not None else ()
            while sock.getsockopt(zmq.RCVMORE):
                target = targets[len(frames)] if len(frames) < len(targets) else None
                if target is None or letter is not None:
                    frame = sock.recv(copy=False)
                    nbytes += len(frame)
                    if letter is not None and error is None:
                        try:
                            frame = letter.open(len(frames) + 1, frame, into=target)
                        except ProtocolError as exc:
                            error = exc
                    frames.append(frame)
                    continue
                got = sock.recv_into(target.reshape(-1).view(np.uint8))
                nbytes += got
                if got != target.nbytes and error is None:
                    error = ProtocolError(f"a tensor frame of {got} bytes, but the header announced {target.nbytes}")
                frames.append(target)
        else:
            error = ProtocolError("a message without a header frame")
        self.received_bytes += nbytes
        msg = None
        if error is None:
            try:
                msg = build_message(header, frames)
                msg.private = all(t is None for t in targets)     # nothing received into a caller's array
                if letter is not None:
                    if msg.src != letter.sender:
                        raise ProtocolError(f"a message sealed by {letter.sender!r} claims to be from {msg.src!r}")
                    letter.accept()
            except ProtocolError as exc:
                msg, error = None, exc
        if msg is None:
            self.dropped_messages += 1
            self.refusals.note(bytes(peer.bytes[:32]), "%s dropped a malformed message from peer %r: %s",
                               public_name(self.node_id), bytes(peer.bytes[:32]), error)
            return
        self.deliver(msg)

    def _send_loop(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._queue or not self._running)
                    if not self._queue:
                        return
                with self._send_lock:
                    with self._cv:    # only this thread pops, and direct sends need an empty queue
                        neg_prio, _, addr, dst_dc, frames = heapq.heappop(self._queue)
                    self._send_now(-neg_prio, addr, dst_dc, frames)
                    with self._cv:
                        if not self._queue:
                            self._cv.notify_all()
        finally:
            with self._send_lock:
                for sock in self._sockets.values():
                    sock.close(linger=200)
                self._sockets.clear()

    def _send_now(self, priority: int, addr: str, dst_dc: str | None, frames: list) -> None:
        """Hand one message to ZeroMQ (the caller holds the send lock)."""
        if self._seal is not None:      # here, not in send(): counters go out in order on each connection
            frames = self._seal.seal(frames, addr)
        via_emulator = self._emulator is not None and dst_dc is not None and dst_dc != self.dc
        if via_emulator:
            route = msgpack.packb({"dst": addr, "src_dc": self.dc, "dst_dc": dst_dc, "prio": priority},
                                  use_bin_type=True)
            frames = [route] + frames
            addr = self._emulator
        try:
            sock = self._sockets.get(addr)
            if sock is None:
                sock = self._sockets[addr] = self._connect(addr)
            sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:   # e.g. a peer announced a malformed address: drop, keep sending
            self.dropped_messages += 1
            log.warning("%s cannot send to %r: %s; message dropped", self.node_id, addr, exc)
            return
        self.sent_bytes[dst_dc or self.dc] += payload_nbytes(frames[1:] if via_emulator else frames)
        self.sent_messages[dst_dc or self.dc] += 1

    def _connect(self, addr: str) -> zmq.Socket:
        if not is_tcp_address(addr):
            raise zmq.ZMQError(zmq.EINVAL, f"{addr!r} is not a tcp://host:port address")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.node_id.encode())
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if self._security is not None:
            self._security.client(sock)
        sock.connect(addr)
        return sock
