"""The ZeroMQ van (kind "zmq", see geomx.transport.base): one node's endpoint on the network (the name and the
job come from ps-lite).

Every node binds one ZeroMQ ROUTER socket and reaches each peer through a DEALER socket connected to the
peer's ROUTER. Two threads, each owning its sockets (ZeroMQ sockets are not thread-safe):

* the receive thread decodes every frame set into a :class:`Message` and hands it to ``on_message``;
  malformed input is logged and dropped, never fatal. It reads the header frame first, so that
  ``receive_into`` (when set) can name arrays the tensor frames are received straight into: a pulled value
  lands in the caller's output without an extra allocation or copy;
* the send thread drains one outbox per peer (:mod:`geomx.transport.outbox`), each ordered by (priority desc,
  arrival asc): FIFO among equal priorities, unlike ps-lite's heap, which reverses equal-priority backlogs.
  It never blocks on one peer: ZeroMQ's pipe to a peer holds at most ``SEND_PIPE_MESSAGES``, a full one is
  tried again a little later while other peers are served. When nothing waits for that peer, ``send``
  hands the message to ZeroMQ on the caller's thread instead (a zero-copy send returns at once): one thread
  wake-up less per message, which is most of a small message's latency on a busy host. The sockets are
  shared under one lock, which also keeps the order.

When a WAN emulator is configured, a message to a node of another DC goes to the emulator instead, behind a
small route frame (see :mod:`geomx.netem.emulator`); the receiver cannot tell the difference. With
``emulator_bypass`` a large one to a node on this host is *parked* instead (:mod:`geomx.transport.parking`): its
bytes go straight to the receiver, which holds them until the emulator, handed only the route and the size,
releases them at the time its link model gives; on Linux its route and release take the emulator's same-host
channel (:mod:`geomx.transport.park_channel`), off ZeroMQ.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import zmq

from geomx.errors import ConfigError, PeerLostError, ProtocolError
from geomx.transport.base import STALL_S, Van, register_van
from geomx.transport.connection_watch import ConnectionWatch, heartbeat
from geomx.transport.ids import new_node_id, public_name
from geomx.transport.message import Message, build_message, decode_header, encode, payload_nbytes
from geomx.transport.outbox import SEND_PIPE_MESSAGES, STUCK_S, Outbox, Queued, send_queue_bytes
from geomx.transport.park_channel import VanChannel
from geomx.transport.parking import MARKER_BYTES, PARK, RELEASE, Parking, marker, new_id, read_marker
from geomx.transport.refusals import RefusalLog
from geomx.transport.security import Curve, HandshakeLog, Plain, Sealed

log = logging.getLogger("geomx.van")

_POLL_MS = 100
# a message to a node of another DC on this host is parked at its receiver, not relayed through the emulator,
# from this size: below it the relay costs little and the message keeps one path (control, heartbeats)
PARK_MIN_BYTES = 64 * 1024

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
                 context: zmq.Context | None = None, security: Sealed | Curve | Plain | None = None,
                 send_queue_mb: float | None = None, stuck_s: float = STUCK_S, liveness_probe: bool = False,
                 emulator_bypass: bool = False, max_frame_bytes: int = -1) -> None:
        """``liveness_probe``: heartbeat the connections to peers of this DC at ZeroMQ's level, so that a frozen
        peer's connection reads as down (geomx.transport.connection_watch; the schedulers' vans).
        ``emulator_bypass``: park large messages to nodes of other DCs on this host at their receiver and hand
        the emulator only their route (geomx.transport.parking). ``max_frame_bytes``: a peer that sends a larger
        frame is disconnected (geomx.config.max_frame_bytes; -1: no limit)."""
        super().__init__(node_id=node_id, dc=dc, on_message=on_message)
        self.host = host
        self._bind_host = bind_host or host
        self._port = port
        self._emulator = emulator
        self._bypass = emulator_bypass and emulator is not None
        self._max_frame_bytes = max_frame_bytes
        self._parking = Parking()           # messages parked here, waiting for the emulator's release
        # routes and releases of parked messages off ZeroMQ, where the emulator is on this host (park_channel)
        self._channel: VanChannel | None = None
        self._ctx = context or zmq.Context.instance()
        self._security = security
        self._seal = security.sealing(node_id) if security is not None else None   # Sealed: AES-GCM per message
        self._outboxes: dict[str, Outbox] = {}     # socket address -> messages waiting for it
        self._send_queue_bytes = (send_queue_bytes() if send_queue_mb is None
                                  else send_queue_bytes({"GEOMX_SEND_QUEUE_MB": str(send_queue_mb)}))
        self._stuck_s = stuck_s
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()      # held while a thread uses the DEALER sockets
        self._sockets: dict[str, zmq.Socket] = {}
        self._running = False
        self._stopped = False
        self._router: zmq.Socket | None = None
        self._handshakes = HandshakeLog(security)       # logs handshakes refused on either side of a connection
        self._threads: list[threading.Thread] = []
        self._receive_thread: threading.Thread | None = None
        # peers whose connection closed (a process ended)
        self._watch = ConnectionWatch(public_name(node_id), on_handshake_failed=self._handshakes.connecting)
        self._probe = liveness_probe
        self.sent_bytes: dict[str, int] = defaultdict(int)      # by destination DC, as handed to ZeroMQ
        self.sent_messages: dict[str, int] = defaultdict(int)
        self.received_bytes = 0
        self.dropped_messages = 0
        self.refusals = RefusalLog(log)

    @property
    def address(self) -> str:
        return tcp_address(self.host, self._port)

    @property
    def bound_address(self) -> str:
        """Where the socket listens: ``address`` unless GEOMX_BIND_HOST binds another (0.0.0.0 behind NAT)."""
        return tcp_address(self._bind_host, self._port)

    @property
    def same_host_channel(self) -> bool:
        """Whether parked messages' routes and releases take the emulator's same-host channel (park_channel)."""
        return self._channel is not None and not self._channel.down

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
        router.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
        if self._security is not None:
            self._security.server(router)
        self._handshakes.listen(router)
        try:
            if self._port:
                router.bind(tcp_address(self._bind_host, self._port))
            else:
                self._port = router.bind_to_random_port(f"tcp://{self._bind_host}")
        except zmq.ZMQError as exc:
            self._handshakes.close(router)
            router.close()
            if self._security is not None:
                self._security.release(self._ctx)
            raise ConfigError(f"cannot listen on {tcp_address(self._bind_host, self._port)}: {exc.strerror}"
                              + (" (port already in use)" if exc.errno == zmq.EADDRINUSE else "")) from None
        self._router = router
        if self._bypass:        # once: a running stream that changed its path could be overtaken (park_channel)
            self._channel = VanChannel.connect(self._emulator, self.address)
        self._running = True
        for target, name in ((self._receive_loop, "recv"), (self._send_loop, "send")):
            t = threading.Thread(target=target, name=f"van-{name}-{public_name(self.node_id)}", daemon=True)
            self._threads.append(t)
        self._receive_thread = self._threads[0]
        for t in self._threads:
            t.start()
        self._watch.start()

    def send(self, addr: str, msg: Message, *, dst_dc: str | None = None) -> None:
        """Queue ``msg`` for ``addr`` (a tcp:// address); ``dst_dc`` routes it through the WAN emulator.
        Waits while the outbox of that peer is full (see :mod:`geomx.transport.outbox`)."""
        if not msg.src:
            msg.src = self.node_id
        frames = encode(msg)
        sock_addr = self._socket_address(addr, dst_dc)
        item = Queued(-msg.priority, next(self._seq), addr, sock_addr, dst_dc, frames, payload_nbytes(frames))
        # with the same-host channel, small messages too: one sender's messages to a receiver keep one path
        if (self._bypass and sock_addr != addr and (item.nbytes >= PARK_MIN_BYTES or self.same_host_channel)
                and self._same_host(addr)):
            item.park = new_id()
        if self._send_lock.acquire(blocking=False):
            try:
                with self._cv:
                    box = self._outboxes.get(sock_addr)
                    direct = self._running and (box is None or box.idle())
                if direct and self._try_send(item):
                    return
            finally:
                self._send_lock.release()
        with self._cv:
            box = self._outboxes.get(sock_addr)
            if box is None:
                box = self._outboxes[sock_addr] = Outbox()
            # the receive thread never waits: two nodes whose handlers send to each other would each wait for
            # the other to read. Its sends go past the cap; they answer requests, which a peer that stopped
            # reading stops making (and the stuck deadline below still drops them)
            may_wait = threading.current_thread() is not self._receive_thread
            while self._running and box.full_for(item.nbytes, self._send_queue_bytes):
                if time.monotonic() - box.last_progress > self._stuck_s:
                    self.dropped_messages += 1
                    raise PeerLostError(
                        f"{public_name(self.node_id)}: {sock_addr} (DC {dst_dc or self.dc}) has read nothing for "
                        f"{self._stuck_s:.0f} s while {box.nbytes / _MIB:.1f} MiB waited for it (send queue cap "
                        f"{self._send_queue_bytes / _MIB:.0f} MiB, GEOMX_SEND_QUEUE_MB); {msg.op!r} dropped")
                if not may_wait:
                    break
                self._cv.wait(timeout=_POLL_MS / 1000)
            if self._stopped:
                self.dropped_messages += 1
                log.debug("%s is stopped: %r to %s dropped", public_name(self.node_id), msg.op, addr)
                return
            box.put(item)
            self._cv.notify_all()

    def _same_host(self, addr: str) -> bool:
        return addr[len("tcp://"):].rpartition(":")[0] == self.host

    def emulator_for(self, dst_dc: str | None) -> str | None:
        return self._emulator if dst_dc is not None and dst_dc != self.dc else None

    def _socket_address(self, addr: str, dst_dc: str | None) -> str:
        """The socket a message to ``addr`` leaves on: the emulator's for another DC when one is configured."""
        return self.emulator_for(dst_dc) or addr

    def counters(self) -> dict:
        """Cumulative traffic (see geomx.metrics, kind ``traffic``)."""
        return {"node": public_name(self.node_id), "sent": dict(self.sent_bytes),
                "sent_messages": dict(self.sent_messages), "received": self.received_bytes,
                "send_queue": sum(len(box) for box in self._outboxes.values())}

    def stop(self, flush_timeout: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout``), then close the sockets."""
        with self._cv:
            if not self._running:
                return
            self._cv.wait_for(lambda: all(box.idle() for box in self._outboxes.values()), timeout=flush_timeout)
            self._running = False
            self._stopped = True
            self._cv.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=flush_timeout + 1.0)
        self._watch.stop(timeout=1.0)

    def down_since(self, addr: str) -> float | None:
        return self._watch.down_since(addr)

    def answering(self, addr: str) -> bool:
        return self._watch.answering(addr)

    # -- threads -----------------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        sock, handshakes = self._router, self._handshakes
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if handshakes.socket is not None:
            poller.register(handshakes.socket, zmq.POLLIN)
        if self._channel is not None:
            poller.register(self._channel, zmq.POLLIN)
        try:
            while self._running:
                ready = poller.poll(_POLL_MS)
                if not ready:
                    continue
                router_ready = False
                for which, _ in ready:
                    if which is sock:
                        router_ready = True
                    elif which is handshakes.socket:
                        handshakes.read()
                    else:
                        try:
                            self._read_channel(poller)
                        except Exception as exc:
                            self.dropped_messages += 1
                            log.error("%s dropped a released message it could not handle: %s",
                                      public_name(self.node_id), exc, exc_info=True)
                while router_ready and self._running:       # drain what is there before polling again
                    try:
                        peer = sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._receive_one(sock, peer)
                    except Exception as exc:
                        # one bad message must not leave the node deaf: its peers would take it for dead
                        self._drop_rest(sock)
                        self.dropped_messages += 1
                        log.error("%s dropped a message from peer %s it could not handle: %s",
                                  public_name(self.node_id), public_name(peer.bytes), exc, exc_info=True)
        finally:
            if self._channel is not None:
                self._channel.close()
            handshakes.close(sock)
            sock.close(linger=0)
            if self._security is not None:
                self._security.release(self._ctx)

    def _read_channel(self, poller: zmq.Poller) -> None:
        """Hand on the parked messages the emulator released over the same-host channel."""
        channel = self._channel
        ids = channel.read_releases()
        if ids is None:
            poller.unregister(channel)
            log.warning("%s: the WAN emulator closed its same-host channel", public_name(self.node_id))
            return
        for ident in ids:
            self._release(ident)

    def _release(self, ident: bytes) -> None:
        """The emulator released parked message ``ident``: hand it on, or remember the release until it comes."""
        msg = self._parking.release(ident)
        if msg is not None:
            self.deliver(msg)

    @staticmethod
    def _drop_rest(sock: zmq.Socket) -> None:
        """Read what is left of the current message, so that the next one starts clean."""
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    def _receive_one(self, sock: zmq.Socket, peer: zmq.Frame) -> None:
        """Read the rest of one message (always all its frames, so the next message starts clean) and hand it on;
        a parked one (geomx.transport.parking) once the emulator released it, whichever of the two came first."""
        first = sock.recv(copy=False) if peer.more else None
        mark = read_marker(first.buffer) if first is not None and len(first) == MARKER_BYTES else None
        if mark is None:
            msg = self._read_message(sock, peer, first)
        elif mark[0] == RELEASE:
            self._release(mark[1])
            while sock.getsockopt(zmq.RCVMORE):     # the emulator sends the releases due at once together
                more = read_marker(sock.recv(copy=False).buffer)
                if more is not None and more[0] == RELEASE:
                    self._release(more[1])
            return
        else:
            msg = self._read_message(sock, peer, sock.recv(copy=False) if first.more else None)
            if msg is not None:
                msg = self._parking.park(mark[1], msg, sum(t.nbytes for t in msg.tensors))
        if msg is not None:
            self.deliver(msg)

    def _read_message(self, sock: zmq.Socket, peer: zmq.Frame, first: zmq.Frame | None) -> Message | None:
        """The message whose first frame (``first``: its sealed envelope, or its header) was just read: the rest
        read, opened when links are sealed, and decoded; None (logged) for a malformed one."""
        header, error, frames = None, None, []
        nbytes = 0
        letter, more = None, first is not None
        if more and self._seal is not None:
            envelope, first = first, None
            nbytes, more = len(envelope), envelope.more
            try:
                letter = self._seal.letter(envelope, self._port)
            except ProtocolError as exc:
                error = exc
        if more:
            head = first if first is not None else sock.recv(copy=False)
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
                        raise ProtocolError(f"a message sealed by {public_name(letter.sender)!r} claims to be "
                                            f"from {public_name(msg.src)!r}")
                    letter.accept()
            except ProtocolError as exc:
                msg, error = None, exc
        if msg is None:
            self.dropped_messages += 1
            self.refusals.note(bytes(peer.bytes), "%s dropped a malformed message from peer %r: %s",
                               public_name(self.node_id), public_name(peer.bytes), error)
        return msg

    def _send_loop(self) -> None:
        try:
            while True:
                with self._cv:
                    box = self._next_outbox()
                    if box is None:
                        return
                    item = box.take()
                with self._send_lock:
                    sent = self._try_send(item)
                with self._cv:
                    box.sent(item) if sent else box.refused(item)
                    self._cv.notify_all()
        finally:
            with self._cv:
                left = sum(box.drop_all() for box in self._outboxes.values())
            if left:
                self.dropped_messages += left
                log.warning("%s stopped with %d message(s) unsent: their peers were not reading",
                            public_name(self.node_id), left)
            with self._send_lock:
                for sock in self._sockets.values():
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disable_monitor()    # ends its ConnectionWatch stream before the socket goes
                    sock.close(linger=200)
                self._sockets.clear()

    def _next_outbox(self) -> Outbox | None:
        """Wait (holding the condition) for an outbox whose head may be tried now, the one with the most urgent
        head among them; None once the van stopped."""
        while self._running:
            now = time.monotonic()
            ready = [box for box in self._outboxes.values() if box.ready(now)]
            if ready:
                return min(ready, key=Outbox.head)
            waiting = [box.retry_at for box in self._outboxes.values() if len(box) and not box.busy]
            self._cv.wait(timeout=max(0.0, min(waiting) - now) if waiting else None)
        return None

    def _try_send(self, item: Queued) -> bool:
        """Hand one message to ZeroMQ without blocking (the caller holds the send lock). False: the peer's pipe
        is full, and ``item.wire`` keeps the frames as sealed for the next try. A message that cannot be sent at
        all (a malformed address) is dropped and counts as sent."""
        if item.park is not None:
            return self._try_park(item)
        if item.wire is None:
            frames = item.frames
            if self._seal is not None:      # here, not in send(): counters go out in order on each connection
                frames = self._seal.seal(frames, item.addr)
            if item.socket != item.addr:    # through the emulator, behind a route frame
                frames = [self._route(item)] + frames
            item.wire = frames
        sock_addr = item.socket
        try:
            # probed: a peer of this DC reached directly (over a WAN, a late answer is no sign of a frozen peer, and
            # a connection ZeroMQ closed would lose what the kernel had not delivered yet)
            local = sock_addr == item.addr and item.dst_dc in (None, self.dc)
            self._socket_for(sock_addr, probe=self._probe and local).send_multipart(item.wire, flags=zmq.NOBLOCK,
                                                                                   copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:   # e.g. a peer announced a malformed address: drop, keep sending
            self.dropped_messages += 1
            log.warning("%s cannot send to %r: %s; message dropped", public_name(self.node_id), sock_addr, exc)
            return True
        self._count_sent(item, item.wire[1:] if sock_addr != item.addr else item.wire)
        return True

    def _route(self, item: Queued, **parked) -> bytes:
        """The route frame the emulator reads (geomx.netem.emulator): where to, from where, at what priority; a
        parked message's id and size (``parked``)."""
        return msgpack.packb({"dst": item.addr, "src": self.address, "src_dc": self.dc, "dst_dc": item.dst_dc,
                              "prio": -item.neg_priority, **parked}, use_bin_type=True)

    def _count_sent(self, item: Queued, frames: list) -> None:
        dst = item.dst_dc or self.dc
        self.sent_bytes[dst] += payload_nbytes(frames)
        self.sent_messages[dst] += 1

    def _try_park(self, item: Queued) -> bool:
        """:meth:`_try_send` for a parked message: its frames (sealed as ever) straight to the receiver behind a
        PARK marker, then its route and size to the emulator; a retry sends only what did not go yet."""
        if item.wire is None:
            frames = item.frames if self._seal is None else self._seal.seal(item.frames, item.addr)
            route = self._route(item, park=item.park, n=payload_nbytes(frames))
            item.wire = [[marker(PARK, item.park), *frames], [route]]
        try:
            if not item.parked:
                self._socket_for(item.addr, probe=False).send_multipart(item.wire[0], flags=zmq.NOBLOCK, copy=False)
                item.parked = True
                self._count_sent(item, item.wire[0][1:])
            if self.same_host_channel:
                try:
                    return self._channel.send_route(item.wire[1][0])
                except OSError:         # the emulator closed it: this route and the next go over ZeroMQ
                    self._channel.down = True
            self._socket_for(item.socket, probe=False).send_multipart(item.wire[1], flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            self.dropped_messages += 1
            log.warning("%s cannot park a message at %r: %s; message dropped", public_name(self.node_id), item.addr,
                        exc)
        return True

    def _socket_for(self, addr: str, *, probe: bool) -> zmq.Socket:
        sock = self._sockets.get(addr)
        if sock is None:
            sock = self._sockets[addr] = self._connect(addr, probe=probe)
        return sock

    def _connect(self, addr: str, *, probe: bool = False) -> zmq.Socket:
        if not is_tcp_address(addr):
            raise zmq.ZMQError(zmq.EINVAL, f"{addr!r} is not a tcp://host:port address")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.node_id.encode())
        sock.setsockopt(zmq.SNDHWM, SEND_PIPE_MESSAGES)
        sock.setsockopt(zmq.LINGER, 0)
        if self._security is not None:
            self._security.client(sock)
        if probe:
            heartbeat(sock)
        # watched before it connects: a handshake that fails at once (another mechanism) is not tried again
        self._watch.watch(sock, addr, probed=probe)
        sock.connect(addr)
        return sock
