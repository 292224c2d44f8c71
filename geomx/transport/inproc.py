"""The in-memory van: nodes inside one process exchange messages through a :class:`Hub`.

A message is encoded to the same frames the ZeroMQ van sends and decoded on the receiving side (so a
receiver never shares an array with its sender, and the wire format is exercised as in a deployment);
``receive_into`` works as there. Each van has one receive thread that hands messages to ``on_message`` in
(priority desc, arrival asc) order. Addresses are ``mem://<hub>:<n>``.

A hub may carry an emulated WAN: ``Hub(link=...)`` is called once per directed DC pair and returns an object
with ``enqueue(nbytes, priority, deliver)`` (geomx.netem.link.EmulatedLink has that interface); a message to a
node of another DC goes through it and arrives when the link model delivers it. Without ``link`` every
message is delivered at once. The transport layer imports nothing of the emulator: the caller injects it.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from geomx.errors import ConfigError, ProtocolError
from geomx.transport.base import Van, register_van
from geomx.transport.ids import public_name
from geomx.transport.message import Message, build_message, decode_header, encode, payload_nbytes

log = logging.getLogger("geomx.van")

_IDLE_WAIT_S = 0.5      # every wait has a timeout, so a stop is noticed


def _frame_bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


class Hub:
    """The vans of one process that can reach each other (one per test or simulation; ``DEFAULT`` else)."""

    _names = itertools.count()

    def __init__(self, *, link: Callable[[str, str], object] | None = None, name: str | None = None) -> None:
        self.name = name or f"hub{next(self._names)}"
        self._link_factory = link
        self._links: dict[tuple[str, str], object] = {}
        self._vans: dict[str, InProcVan] = {}
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def attach(self, van: InProcVan) -> str:
        with self._lock:
            addr = f"mem://{self.name}:{next(self._numbers)}"
            self._vans[addr] = van
        return addr

    def detach(self, addr: str) -> None:
        with self._lock:
            self._vans.pop(addr, None)

    def route(self, src_dc: str, dst_dc: str | None, addr: str, frames: list[bytes], priority: int) -> bool:
        """Carry ``frames`` to the van at ``addr`` (through the DC pair's link, if any); False if none is there."""
        with self._lock:
            target = self._vans.get(addr)
            link = None
            if target is not None and self._link_factory is not None and dst_dc is not None and dst_dc != src_dc:
                link = self._links.get((src_dc, dst_dc))
                if link is None:
                    link = self._links[(src_dc, dst_dc)] = self._link_factory(src_dc, dst_dc)
        if target is None:
            return False
        if link is None:
            target.enqueue(priority, frames)
        else:
            link.enqueue(sum(len(f) for f in frames), priority, lambda: target.enqueue(priority, frames))
        return True

    def links(self) -> dict[tuple[str, str], object]:
        with self._lock:
            return dict(self._links)

    def close(self) -> None:
        """Close the links the hub made (those with a ``close``); what they still held is dropped."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            if hasattr(link, "close"):
                link.close()


DEFAULT = Hub(name="default")


@register_van("inproc")
class InProcVan(Van):
    """See the module docstring. ``host``, ``port`` and ``bind_host`` are accepted (a NodeConfig carries them)
    and unused; an emulator process or CurveZMQ make no sense without sockets and are refused."""

    def __init__(self, *, node_id: str, dc: str, on_message: Callable[[Message], None], hub: Hub | None = None,
                 host: str = "127.0.0.1", port: int = 0, bind_host: str | None = None, emulator: str | None = None,
                 security=None, liveness_probe: bool = False) -> None:
        # liveness_probe: nothing in memory freezes apart from its own process
        super().__init__(node_id=node_id, dc=dc, on_message=on_message)
        if emulator is not None:
            raise ConfigError(f"{public_name(node_id)}: the in-memory van cannot use the WAN emulator at {emulator}; "
                              f"give its Hub a link model instead")
        if security is not None:
            raise ConfigError(f"{public_name(node_id)}: the in-memory van has no sockets to secure (GEOMX_SECRET is "
                              f"for 'zmq')")
        self.hub = hub or DEFAULT
        self._address: str | None = None
        self._inbox: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self.sent_bytes: dict[str, int] = defaultdict(int)
        self.sent_messages: dict[str, int] = defaultdict(int)
        self.received_bytes = 0
        self.dropped_messages = 0

    @property
    def address(self) -> str:
        if self._address is None:
            raise ConfigError(f"{public_name(self.node_id)}: an in-memory van has an address once started")
        return self._address

    @property
    def port(self) -> int:
        """The address's number (schedulers order ranks by it, as by a TCP port)."""
        return int(self._address.rpartition(":")[2]) if self._address else 0

    @classmethod
    def is_address(cls, addr) -> bool:
        return isinstance(addr, str) and addr.startswith("mem://") and addr.rpartition(":")[2].isdigit()

    def peer_address(self, host: str, port: int) -> str:
        """(hub name, number): a node of this process, e.g. a scheduler at ``(hub.name, scheduler.van.port)``."""
        return f"mem://{host}:{port}"

    def start(self) -> None:
        self._running = True
        self._address = self.hub.attach(self)
        self._thread = threading.Thread(target=self._receive_loop, name=f"van-recv-{public_name(self.node_id)}",
                                        daemon=True)
        self._thread.start()

    def send(self, addr: str, msg: Message, *, dst_dc: str | None = None) -> None:
        if not msg.src:
            msg.src = self.node_id
        # copies: the receiver must not share memory with the sender's arrays, as over a socket
        frames = [_frame_bytes(f) for f in encode(msg)]
        if not self.hub.route(self.dc, dst_dc, addr, frames, msg.priority):
            self.dropped_messages += 1
            # as a socket would: a peer that left (a scheduler that stopped) just never reads it
            log.info("%s cannot send %r to %r: no such node in hub %s; message dropped", public_name(self.node_id),
                     msg.op, addr, self.hub.name)
            return
        self.sent_bytes[dst_dc or self.dc] += payload_nbytes(frames)
        self.sent_messages[dst_dc or self.dc] += 1

    def enqueue(self, priority: int, frames: list[bytes]) -> None:
        """Called by the hub (any thread): one message for this van."""
        with self._cv:
            if self._running:
                heapq.heappush(self._inbox, (-priority, next(self._seq), frames))
                self._cv.notify()

    def stop(self, flush_timeout: float = 2.0) -> None:
        with self._cv:
            if not self._running:
                return
            self._running = False
            self._cv.notify_all()
        self.hub.detach(self._address)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=flush_timeout + 1.0)

    def counters(self) -> dict:
        return {"node": public_name(self.node_id), "sent": dict(self.sent_bytes),
                "sent_messages": dict(self.sent_messages), "received": self.received_bytes, "send_queue": 0}

    def _receive_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._inbox or not self._running, timeout=_IDLE_WAIT_S)
                if not self._running:
                    return
                if not self._inbox:
                    continue
                _, _, frames = heapq.heappop(self._inbox)
            self.received_bytes += payload_nbytes(frames)
            try:
                msg = self._decode(frames)
            except ProtocolError as exc:
                self.dropped_messages += 1
                log.warning("%s dropped a malformed message: %s", public_name(self.node_id), exc)
                continue
            self.deliver(msg)

    def _decode(self, frames: list[bytes]) -> Message:
        header = decode_header(frames[0])
        tensors: list = list(frames[1:])
        for i, target in enumerate(self.targets(header)):
            if target is not None and i < len(tensors) and len(tensors[i]) == target.nbytes:
                target.reshape(-1).view(np.uint8)[:] = np.frombuffer(tensors[i], np.uint8)   # straight into it
                tensors[i] = target
        return build_message(header, tensors)
