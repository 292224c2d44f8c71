"""Client side of the key-value protocol, shared by workers, the master worker and local servers.

A client talks to the servers of one tier: a worker in the HiPS topology to its DC's local server, a local
server (as a worker of the global tier), a flat-topology worker and the master worker to the global servers.
Every request returns a :class:`Handle`; replies are matched by request id.

Keys live whole on one global server. The master worker places each key on the server with the fewest bytes
so far and tells the others; any other client asks the key's home server (hash of the key), which answers
or redirects to the owner once it knows it.
"""
from __future__ import annotations

import itertools
import logging
import threading
import zlib
from typing import Any
from collections.abc import Callable

import numpy as np

from geomx.cluster.compressed import CODEC_FIELD, ClientWire, dense_push
from geomx.cluster.digest import value_digest
from geomx.cluster.protocol import Field, Op, is_round
from geomx.cluster.postoffice import NodeInfo, Postoffice, Tier
from geomx.compression import CompressionPolicy
from geomx.errors import ConfigError, DeadlineError, GeomxError, KVError, PeerLostError
from geomx.transport.ids import public_name
from geomx.transport.message import Message

log = logging.getLogger("geomx.client")


class Handle:
    """One asynchronous request. ``wait()`` returns its result or raises the error the server named."""

    def __init__(self, po: Postoffice, what: str, server: NodeInfo | None) -> None:
        self._po, self.what, self.server = po, what, server
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._lock = threading.Lock()
        # a partitioned key's request: each part's own (its reply lands on its own), [] for a single request
        self.parts: list[Handle] = []
        self.share = 1.0                 # a part's request: the share of its key's elements that it carries
        self.error_raised = False        # wait() raised an error: the caller has it, kv.close() must not again

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        timeout = self._po.cfg.op_timeout if timeout is None else timeout
        try:
            finished = self._po.wait_event(self._event, timeout)
        except PeerLostError as exc:
            self.error_raised = True
            raise PeerLostError(f"{self.what} failed: {exc}") from None
        if not finished:
            self.error_raised = True
            who = self.server.label if self.server else "the servers"
            raise DeadlineError(f"{self.what}: no answer from {who} within {timeout:g} s (GEOMX_TIMEOUT sets the "
                                f"limit)")
        if self._error is not None:
            self.error_raised = True
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def then(self, fn: Callable[[Any], Any], what: str | None = None) -> Handle:
        """A handle that finishes with ``fn(result)`` once this one has finished (errors pass through)."""
        nxt = Handle(self._po, what or self.what, self.server)
        nxt.parts = self.parts

        def go(h: Handle) -> None:
            if h.error is not None:
                nxt._finish(error=h.error)
                return
            try:
                nxt._finish(fn(h.result))
            except Exception as exc:
                nxt._finish(error=exc)

        self.add_done_callback(go)
        return nxt

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def result(self) -> Any:
        return self._result

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("callback of %s failed", self.what)


def gather(handles: list[Handle], combine: Callable[[list], Any], what: str) -> Handle:
    """A handle that finishes with ``combine(results)`` once all ``handles`` have, or with the first error."""
    first = handles[0]
    joined = Handle(first._po, what, first.server)
    joined.parts = list(handles)
    left = [len(handles)]
    lock = threading.Lock()

    def one(h: Handle) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if h.error is not None:
            joined._finish(error=h.error)
        elif last:
            try:
                joined._finish(combine([x.result for x in handles]))
            except Exception as exc:
                joined._finish(error=exc)

    for h in handles:
        h.add_done_callback(one)
    return joined


def home_server(key: int | str, num_servers: int) -> int:
    """Where a client first asks about ``key``: a stable hash, identical in every process."""
    if isinstance(key, int):
        return key % num_servers
    return zlib.crc32(str(key).encode()) % num_servers


class KVClient:
    """Requests to the servers of ``tier``; see the module docstring."""

    def __init__(self, po: Postoffice, tier: Tier, *, master: bool = False) -> None:
        self.po, self.tier, self.master = po, tier, master
        self.servers = tier.servers()
        if not self.servers:
            raise GeomxError(f"the {tier.name} tier has no servers for {po.cfg.label} to talk to")
        self._req = itertools.count(1)
        # request id -> (handle, reply -> result, the array the reply's tensor is received into or None)
        self._pending: dict[int, tuple[Handle, Callable[[Message], Any] | None, np.ndarray | None]] = {}
        self._lock = threading.Lock()
        self._owner: dict[Any, int] = {}
        self._pushes: dict[Any, int] = {}
        self._placed_bytes = [0] * len(self.servers)
        self._layout: dict[Any, tuple[tuple, np.dtype]] = {}   # key -> shape, dtype (from its init reply)
        self.info: dict = {}
        self.wire: ClientWire | None = None      # gradient compression, from the servers' info
        # rejoined a running job: per key, the rounds already under way, which it takes no part in
        self.joined: dict[Any, int] = {}
        # --checkpoint-seconds: the rounds the global servers declared checkpoint rounds (checkpoint_clock.py)
        self.checkpoint_rounds: set[int] = set()
        self.latest_checkpoint_round = 0            # what a local server tells its workers
        po.add_abort_listener(self._fail_all)
        po.van.receive_into = self.receive_into

    # saved state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where each key lives, its layout, the pushes sent per key (a pull waits for the server to have that
        many), the servers' info, and the compression streams (codec memory, residuals). Call it while no
        request is in flight."""
        return {"owner": [[k, r] for k, r in self._owner.items()], "pushes": [[k, n] for k, n in self._pushes.items()],
                "layout": [[k, list(shape), dtype.str] for k, (shape, dtype) in self._layout.items()],
                "info": dict(self.info), "wire": self.wire.state_dict() if self.wire is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a fresh client of the same tier, whose servers hold the saved run's
        state (a restored server)."""
        self._owner = {k: int(r) for k, r in state["owner"]}
        self._pushes = {k: int(n) for k, n in state["pushes"]}
        self._layout = {k: (tuple(shape), np.dtype(dtype)) for k, shape, dtype in state["layout"]}
        self.info = dict(state["info"])
        self._configure_compression()
        self.load_wire_state_dict(state["wire"])

    def wire_state_dict(self) -> dict | None:
        """The compression streams alone (what a worker's checkpoint keeps: a resumed job talks to new
        servers, so the other counters start afresh, and so do the weight replicas: the new servers send the
        whole weights at init)."""
        return self.wire.state_dict(replicas=False) if self.wire is not None else None

    def load_wire_state_dict(self, state: dict | None, *, cuts=None) -> None:
        """``cuts``: how this process cuts each tensor into parts (ClientWire.load_state_dict)."""
        if state is None:
            return
        if self.wire is None:
            raise ConfigError(f"{self.po.cfg.label}: saved compression streams, but this deployment compresses "
                              f"nothing")
        self.wire.load_state_dict(state, cuts=cuts)

    @property
    def joined_at(self) -> int:
        """0, or the rounds the job had under way when this client rejoined it (the most over its keys)."""
        return max(self.joined.values(), default=0)

    # requests ---------------------------------------------------------------------------------------------
    def init(self, key, value: np.ndarray, priority: int = 0) -> Handle:
        """Register ``key``. Result: (the value every worker starts from, the servers' info dict)."""
        check_key(key)
        if self.master:
            rank = min(range(len(self.servers)), key=lambda r: (self._placed_bytes[r], r))
            self._placed_bytes[rank] += value.nbytes
            self._owner[key] = rank
            for other in self.servers:
                if other.rank != rank:
                    self._send(other, Message(Op.KEY_OWNER, fields={Field.KEY: key, Field.OWNER: rank}))
            return self._request(Op.INIT, key, rank, {Field.MASTER: True}, [value], priority,
                                 lambda m: self._init_result(key, m))
        return self.init_layout(key, value.shape, value.dtype, priority)

    def init_layout(self, key, shape, dtype, priority: int = 0) -> Handle:
        """Register ``key`` as a client that does not provide the value: only its shape and dtype travel."""
        check_key(key)
        handle = Handle(self.po, f"init of key {key!r}", None)
        layout = {Field.LAYOUT: [[int(n) for n in shape], np.dtype(dtype).name]}

        def ask(rank: int) -> None:
            inner = self._request(Op.INIT, key, rank, layout, [], priority, lambda m: m)
            inner.add_done_callback(lambda h: on_answer(h, rank))

        def on_answer(h: Handle, rank: int) -> None:
            if h.error is not None:
                handle._finish(error=h.error)
            elif h.result.get(Field.REDIRECT) is not None:
                ask(int(h.result[Field.REDIRECT]))
            else:
                self._owner[key] = rank
                try:
                    handle._finish(self._init_result(key, h.result))
                except Exception as exc:
                    handle._finish(error=exc)

        ask(self._owner.get(key, home_server(key, len(self.servers))))
        return handle

    def push(self, key, value: np.ndarray, priority: int = 0, *, count: int | None = None) -> Handle:
        """``count``: set by servers that push an fp32 sum of ``count`` workers' gradients (it travels in the
        key's dtype, as a mean where that is 16 bits or compressed); a worker's own push leaves it None and
        goes as it is (a wrong dtype is the server's to refuse)."""
        rank = self._owner_of(key)
        tensors, fields = self._encode(key, value, count)
        self._mark_checkpoint_round(fields)
        self._pushes[key] = self._pushes.get(key, 0) + 1
        return self._request(Op.PUSH, key, rank, fields, tensors, priority, None)

    def pull(self, key, priority: int = 0, *, out: np.ndarray | None = None) -> Handle:
        """The result is the value; with ``out`` (a writable C-contiguous array of the key's shape and dtype)
        the reply is received straight into it and the result is ``out`` itself."""
        rank = self._owner_of(key)
        return self._request(Op.PULL, key, rank, {Field.AFTER: self._pushes.get(key, 0)}, [], priority,
                             self._value_of(key), out)

    def pushpull(self, key, value: np.ndarray, priority: int = 0, *, out: np.ndarray | None = None,
                 count: int | None = None, scope: str | None = None) -> Handle:
        """``value`` is sent without a copy: leave it unchanged until the handle finishes. ``out`` as in
        :meth:`pull` (it may be ``value`` itself: the reply arrives only after the push was received).
        ``count`` as in :meth:`push`. ``scope="dc"``: a DC-only round (geomx.cluster.dc_rounds), apart from
        the key's ordinary rounds (LAN only, never compressed)."""
        rank = self._owner_of(key)
        if scope == "dc":
            return self._request(Op.DC_PUSHPULL, key, rank, {}, [value], priority, lambda m: m.tensors[0], out)
        tensors, fields = self._encode(key, value, count)
        self._mark_checkpoint_round(fields)
        self._pushes[key] = self._pushes.get(key, 0) + 1
        return self._request(Op.PUSHPULL, key, rank, fields, tensors, priority, self._value_of(key), out)

    def command(self, name: str, **args) -> list[Handle]:
        """Send a configuration command to every server of the tier."""
        return [self._request(Op.COMMAND, None, s.rank, {Field.NAME: name, Field.ARGS: args}, [], 1000, None)
                for s in self.servers]

    # replies ------------------------------------------------------------------------------------------------
    def receive_into(self, header: dict) -> list[np.ndarray | None]:
        """Van hook: the ``out`` array of the request a reply answers, if it came from the server asked."""
        if header["op"] != Op.REPLY or len(header["t"]) != 1 or CODEC_FIELD in header["f"]:
            return []
        req = header["f"].get(Field.REQ)
        with self._lock:
            entry = self._pending.get(req) if isinstance(req, int) else None
        if entry is None or entry[2] is None or entry[0].server.id != header.get("src"):
            return []
        return [entry[2]]

    def handle_reply(self, msg: Message) -> None:
        """A reply counts only from the server its request went to: the request id alone is guessable."""
        req = msg.get(Field.REQ)
        with self._lock:
            entry = self._pending.get(req) if isinstance(req, int) else None
            if entry is not None and entry[0].server.id == msg.src:
                del self._pending[req]
            else:
                entry = None
        if entry is None:
            self.po.refusals.note(msg.src, "%s: reply to request %r from %r dropped: no such request to that "
                                  "sender", self.po.cfg.label, req, public_name(msg.src))
            return
        handle, convert, out = entry
        if msg.get(Field.ERROR):
            kind = PeerLostError if msg.get(Field.LOST) else KVError
            handle._finish(error=kind(f"{handle.what} refused by {handle.server.label}: {msg['error']}"))
            return
        if msg.get(Field.INFO):
            self.info.update(msg[Field.INFO])
            self._configure_compression()
        self._note_checkpoint_round(msg.get(Field.CHECKPOINT_ROUND))    # before the handle's callbacks run
        try:
            result = convert(msg) if convert else None
            if out is not None and result is not None and not np.shares_memory(result, out):
                # not received in place (a compressed reply, decoded here): the result still goes to ``out``,
                # which may be one part of a larger tensor that nothing else fills
                result = np.asarray(result)
                if result.size != out.size:
                    raise KVError(f"{handle.what}: the value has shape {result.shape}, the output shape "
                                  f"{out.shape}")
                np.copyto(out, result.reshape(out.shape), casting="same_kind")
                result = out
            handle._finish(result)
        except Exception as exc:
            handle._finish(error=exc)

    def _mark_checkpoint_round(self, fields: dict) -> None:
        """A push carries the latest checkpoint round this client heard: a global server then hears of it no later
        than the pushes of that round, whatever overtakes rank 0's ``checkpoint_at`` (checkpoint_clock.py)."""
        if self.latest_checkpoint_round:
            fields[Field.CHECKPOINT_ROUND] = self.latest_checkpoint_round

    def _note_checkpoint_round(self, round_) -> None:
        if is_round(round_):
            self.checkpoint_rounds.add(round_)
            self.latest_checkpoint_round = max(self.latest_checkpoint_round, round_)

    # compression ----------------------------------------------------------------------------------------------
    def _configure_compression(self) -> None:
        wire = self.info.get("compression")
        if wire is not None and self.wire is None:
            # seeded from this client's place in its tier, with the rank its scheduler gave it: a rank the
            # process was not started with leaves cfg.label the same for every worker of a DC (same random draws)
            self.wire = ClientWire(CompressionPolicy.from_wire(wire), "wan" if self.tier.name == "global" else "lan",
                                   weights=bool(self.info.get("server_optimizer")), salt=self.tier.me.place)

    def _encode(self, key, value: np.ndarray, count: int | None) -> tuple[list, dict]:
        dtype = self._layout[key][1] if count is not None and key in self._layout else value.dtype
        if self.wire is None:
            return dense_push(value, count or 1, dtype)
        return self.wire.encode_push(key, value, dtype, count or 1)

    def _init_result(self, key, msg: Message) -> tuple[np.ndarray, dict]:
        value, info = msg.tensors[0], dict(msg.get(Field.INFO) or {})
        self._layout[key] = (tuple(value.shape), value.dtype)
        joined_at = msg.get(Field.JOINED_AT)
        if joined_at:       # our first push of the key counts as round joined_at + 1 (kvserver.reply_init)
            if value_digest(value) != msg.get(Field.DIGEST):
                raise KVError(f"key {key!r}: the value {self.po.cfg.label} received to rejoin the running job at "
                              f"round {joined_at} does not match its server's digest (corrupted on the way)")
            self._pushes[key] = self.joined[key] = int(joined_at)
        if self.wire is not None:
            self.wire.note_dense(key, value)
        return value, info

    def _value_of(self, key) -> Callable[[Message], np.ndarray]:
        """Turns a reply into the key's value (decoding it where it came compressed)."""
        def convert(msg: Message) -> np.ndarray:
            if self.wire is None:
                return msg.tensors[0]
            shape, dtype = self._layout[key]
            return self.wire.decode_reply(key, msg.fields, msg.tensors, shape, dtype)
        return convert

    # internals ----------------------------------------------------------------------------------------------
    def _owner_of(self, key) -> int:
        try:
            return self._owner[key]
        except KeyError:
            raise KVError(f"key {key!r} was never initialized by {self.po.cfg.label}: call kv.init({key!r}, "
                          f"value) first") from None

    def _request(self, op: str, key, rank: int, fields: dict, tensors: list, priority: int,
                 convert: Callable[[Message], Any] | None, out: np.ndarray | None = None) -> Handle:
        server = self.servers[rank]
        what = f"{op} of key {key!r}" if key is not None else f"command {fields.get(Field.NAME)!r}"
        handle = Handle(self.po, what, server)
        req = next(self._req)
        with self._lock:
            self._pending[req] = (handle, convert, out)
        if self.po.aborted:
            self._fail_all(self.po.aborted)
        self._send(server, Message(op, fields={Field.REQ: req, Field.KEY: key, **fields}, tensors=tensors,
                                   priority=priority))
        return handle

    def _send(self, server: NodeInfo, msg: Message) -> None:
        self.po.van.send(server.addr, msg, dst_dc=server.dc)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for handle, _, _ in pending.values():
            handle._finish(error=PeerLostError(f"{handle.what} failed: {reason}"))


def check_key(key) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise KVError(f"key {key!r} has type {type(key).__name__}; keys are ints or strings")
