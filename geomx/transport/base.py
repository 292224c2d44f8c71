"""The van interface: one node's endpoint, whatever carries its messages (ps-lite's ``Van::Create``).

A van is made by kind: ``Van.create("zmq", node_id=..., dc=..., on_message=...)``. Kinds register with
:func:`register_van`; geomx has

* ``zmq`` (:mod:`geomx.transport.van`): a ZeroMQ ROUTER per node, DEALERs to its peers, the WAN emulator as
  a process in between: what every deployment runs;
* ``inproc`` (:mod:`geomx.transport.inproc`): nodes in one process exchange the same encoded frames through
  a :class:`~geomx.transport.inproc.Hub`, optionally over emulated WAN links: servers and schedulers in tests,
  and a simulator driving the real server code.

A new transport (RDMA, UDP channels) subclasses :class:`Van`, registers a kind, and the postoffice and the
schedulers use it through ``NodeConfig.van`` / ``Scheduler(van=...)`` without any other change.

What every van guarantees: messages to one peer of one priority arrive in the order sent, higher priorities
may overtake; ``on_message`` runs on one receive thread, one message at a time; a handler's exception is
logged, never fatal; ``receive_into(header)`` may name arrays a reply's tensors land in.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from geomx.errors import ConfigError
from geomx.transport.ids import public_name
from geomx.transport.message import Message

log = logging.getLogger("geomx.van")

STALL_S = 0.5      # a handler that runs longer stalled its node's receive thread (heartbeats judge by it)

_KINDS: dict[str, type[Van]] = {}


def register_van(kind: str):
    """Class decorator: make a :class:`Van` subclass available as ``Van.create(kind, ...)``."""
    def add(cls: type[Van]) -> type[Van]:
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise ConfigError(f"van kind {kind!r} is registered twice ({_KINDS[kind].__name__}, {cls.__name__})")
        _KINDS[kind] = cls
        cls.kind = kind
        return cls
    return add


def van_kinds() -> list[str]:
    _load_builtin_kinds()
    return sorted(_KINDS)


def _load_builtin_kinds() -> None:
    # the built-in kinds register on import; importing them here keeps this module free of zmq
    import geomx.transport.inproc  # noqa: F401
    import geomx.transport.van  # noqa: F401


def is_node_address(addr) -> bool:
    """Whether ``addr`` is a node address of any van kind (member tables are checked with it)."""
    _load_builtin_kinds()
    return any(cls.is_address(addr) for cls in _KINDS.values())


class Van(ABC):
    kind: ClassVar[str] = "?"

    def __init__(self, *, node_id: str, dc: str, on_message: Callable[[Message], None]) -> None:
        self.node_id, self.dc = node_id, dc
        self._on_message = on_message
        # when the handler now running started (None between messages), and when the last handler that ran
        # longer than STALL_S ended: a node whose own receive thread was stuck (importing torch on a loaded
        # machine takes seconds) read nothing meanwhile, so it must not blame its peers' silence
        self.handling_since: float | None = None
        self.last_stall_end = 0.0
        # header -> an array (or None) per announced tensor to receive that frame into; called on the receive
        # thread, before the message is handed to on_message
        self.receive_into: Callable[[dict], Sequence[np.ndarray | None] | None] | None = None

    @staticmethod
    def create(kind: str, **kwargs) -> Van:
        """A van of ``kind`` ('zmq', 'inproc', or a registered one); ``kwargs`` go to its constructor."""
        _load_builtin_kinds()
        cls = _KINDS.get(kind)
        if cls is None:
            raise ConfigError(f"unknown van kind {kind!r}; kinds are {', '.join(sorted(_KINDS))}")
        return cls(**kwargs)

    @property
    @abstractmethod
    def address(self) -> str:
        """Where peers send to (valid once started)."""

    @classmethod
    @abstractmethod
    def is_address(cls, addr) -> bool:
        """Whether ``addr`` is an address this kind of van can send to (schedulers check registrations)."""

    @abstractmethod
    def peer_address(self, host: str, port: int) -> str:
        """The address of the node that a configuration names as (host, port) (a scheduler)."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def send(self, addr: str, msg: Message, *, dst_dc: str | None = None) -> None:
        """Queue ``msg`` for ``addr``; ``dst_dc``: the receiver's DC (cross-DC messages take the WAN)."""

    @abstractmethod
    def stop(self, flush_timeout: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout``), then stop receiving."""

    @abstractmethod
    def counters(self) -> dict:
        """Cumulative traffic (geomx.metrics kind ``traffic``): node, sent, sent_messages, received,
        send_queue."""

    def emulator_for(self, dst_dc: str | None) -> str | None:
        """The WAN emulator's address where a message to a node of ``dst_dc`` goes through it, else None (a deadline
        that waited on such a message names the emulator, not only its receiver)."""
        return None

    def down_since(self, addr: str) -> float | None:
        """When this node's direct connection to ``addr`` closed (time.monotonic; its process ended), None
        while it is up or where this van cannot tell: liveness checks then rely on heartbeats alone."""
        return None

    def answering(self, addr: str) -> bool:
        """Whether the process at ``addr`` is running, though perhaps too busy to heartbeat: this node's direct,
        probed connection to it is up and its ZeroMQ answers (geomx.transport.connection_watch). False where this
        van cannot tell (not probed, behind the WAN emulator, in memory)."""
        return False

    def deliver(self, msg: Message) -> None:
        """Hand one received message to ``on_message`` (on the receive thread), timing it for the heartbeat
        check; a handler's exception is logged, never fatal."""
        self.handling_since = start = time.monotonic()
        try:
            self._on_message(msg)
        except Exception:  # a handler bug must not kill the node's receive loop
            log.exception("%s failed to handle %r from %s", public_name(self.node_id), msg.op, public_name(msg.src))
        finally:
            self.handling_since = None
            end = time.monotonic()
            if end - start > STALL_S:
                self.last_stall_end = end

    def targets(self, header: dict) -> Sequence[np.ndarray | None]:
        """The arrays ``receive_into`` names for a message's tensors: only writable, contiguous, non-empty
        ones that match the announced spec (None for the others)."""
        if self.receive_into is None or not header["t"]:
            return ()
        try:
            targets = self.receive_into(header) or ()
        except Exception:
            log.exception("%s: receive_into failed; receiving into fresh buffers", public_name(self.node_id))
            return ()
        return [t if isinstance(t, np.ndarray) and t.flags.c_contiguous and t.flags.writeable and t.nbytes
                and (t.dtype, t.shape) == spec else None for t, spec in zip(targets, header["t"], strict=False)]
