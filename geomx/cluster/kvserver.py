"""Request handling shared by local and global servers: keys, rounds, held pulls, replies.

Everything runs on the van's receive thread, one message at a time, so per-key state needs no locks; a
handler never blocks (requests that cannot be answered yet are held and answered later).

Consistency rule, the same on both tiers: a pull from client c that follows c's n-th push of a key is
answered once the server's value of that key reflects c's first n pushes. Pushes and pulls therefore keep
their order even when priorities reorder them on the way.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from geomx import statefile
from geomx.cluster.compressed import ServerWire, WireError, scale_dense
from geomx.cluster.digest import value_digest
from geomx.cluster.postoffice import NodeInfo, Postoffice
from geomx.cluster.protocol import Field, Op
from geomx.cluster.stuck_rounds import StuckRounds
from geomx.errors import ConfigError, GeomxError
from geomx.transport.ids import public_name
from geomx.transport.message import WIRE_DTYPES, Message

log = logging.getLogger("geomx.kvserver")


# requests held until this server's member table arrives (they may come from members who heard theirs first):
# at most this many, and this many bytes of tensors; beyond, they are dropped (logged): a stranger cannot fill
# the memory of a server that is still starting
_MAX_EARLY, _MAX_EARLY_BYTES = 10_000, 256 * 1024 * 1024
# rounds of one key that may wait for pushes at once: a client pushing on without the others (a stuck peer, a
# script that never pulls, a hostile member) is refused past it instead of growing the server by a copy of the
# key per round
MAX_OPEN_ROUNDS = 64


class Refused(Exception):
    """A request the server answers with an error (the message goes back to the client)."""


@dataclass
class Round:
    """The pushes of one synchronous round of one key, summed as they arrive.

    ``order_free``: the round expects three or more pushes. A float sum depends on its order and pushes
    arrive in a different order every run, so such a round sums in float64 (exact for the few terms of a
    round unless their magnitudes lie ~2^27 apart) and rounds to float32 once, when it completes
    (:meth:`finish`): the flat PS then trains the very model HiPS FSA does from the same seed. Two pushes need
    none of it (a + b == b + a) and keep the float32 sum.
    """
    total: np.ndarray | None = None
    contributors: list[str] = field(default_factory=list)
    priority: int = 0
    order_free: bool = False
    widened: bool = False       # an order-free float32 sum now held in float64, until finish()
    owned: bool = False         # total may be summed into in place (not saved: a restored total is a copy)
    opened: float = field(default_factory=time.monotonic)   # its first push (not saved: restored rounds restart)

    def add(self, src: str, value: np.ndarray, priority: int, *, reusable: bool = False) -> None:
        """``reusable``: ``value`` is a received buffer nobody else holds (Message.private), which may become
        the round's sum: a round of a large key then holds its pushes and no extra copy."""
        acc = accumulator_dtype(value.dtype)
        if self.total is None:
            # keep the first push as it came (no copy): a round of one client costs no pass over the data
            self.total, self.priority = value.astype(acc, copy=False), priority
            self.owned = reusable and self.total is value and value.flags.writeable
        else:
            if self.order_free and self.total.dtype != np.float64:       # the second push: widen once
                self.total, self.owned, self.widened = np.add(self.total, value, dtype=np.float64), True, True
            elif len(self.contributors) == 1 and not self.owned:   # the first push is someone else's buffer
                self.total = np.add(self.total, value, dtype=acc, casting="unsafe")   # a new array, one pass
            else:
                np.add(self.total, value, out=self.total, casting="unsafe")
            self.priority = max(self.priority, priority)
        self.contributors.append(src)

    def finish(self) -> Round:
        """The round is complete: its sum in the pushes' precision (an order-free sum is rounded once, here)."""
        if self.widened:
            self.total, self.widened = self.total.astype(np.float32), False
        return self

    def scale(self, factor: float) -> np.ndarray:
        """Multiply the sum by ``factor`` (in place where the round owns it); the new total."""
        if factor != 1 and self.total is not None:
            f = np.float32(factor) if self.total.dtype == np.float32 else factor
            self.total = np.multiply(self.total, f, out=self.total if self.owned else None)
            self.owned = True
        return self.total

    def state_dict(self) -> dict:
        return {"total": self.total, "contributors": list(self.contributors), "priority": self.priority,
                "order_free": self.order_free, "widened": self.widened}

    @classmethod
    def from_state_dict(cls, state: dict) -> Round:
        total = state["total"]
        return cls(None if total is None else np.array(total), list(state["contributors"]), state["priority"],
                   order_free=bool(state.get("order_free", False)), widened=bool(state.get("widened", False)))


class OwnedState(Protocol):
    """What each owner keeps per key (see KeyState): saved and restored like torch's Optimizer state."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class KeyState:
    """One key on one server. The counters and open rounds are the server's (kvserver.py); every other part
    has one owner, which creates it and alone reads or writes it:

    * ``update``: the global server's update policy (global_update.py: a relay's pending gradients, a server
      optimizer's parameter and optimizer);
    * ``wire``: gradient compression (compressed.ServerWire: reply streams, codec memory, residuals);
    * ``upstream``: a local server's WAN rounds (local_server.UpstreamRounds: results applied in order);
    * ``overlap``: MixedSync overlap at a local server (wan_overlap.OverlapState);
    * ``hfa``: GeoMX's HFA server logic at a local server (hfa_rounds.HfaKeyState).

    Held requests (``waiting``, ``held_inits``, ``held_joins``) belong to connections, not to the state: they are
    not saved.
    """
    key: Any
    shape: tuple
    dtype: np.dtype
    value: np.ndarray | None = None                      # None until initialized
    first_round: int = 0        # rounds the job took before this server had the key (a DC that rejoined)
    pushes: dict[str, int] = field(default_factory=dict)   # pushes received, per client
    refused: dict[str, int] = field(default_factory=dict)  # pushes refused (bad shape...), per client
    applied: dict[str, int] = field(default_factory=dict)  # pushes reflected in `value`, per client
    rounds: dict[int, Round] = field(default_factory=dict)
    waiting: list[tuple[Message, int]] = field(default_factory=list)  # (pull or pushpull, pushes it follows)
    held_inits: list[Message] = field(default_factory=list)
    held_joins: list[Message] = field(default_factory=list)   # a rejoined client's init, until its round is applied
    update: OwnedState | None = None
    wire: Any = None                                     # compressed.WireKeyState (its state_dict takes the value)
    upstream: OwnedState | None = None
    overlap: OwnedState | None = None
    hfa: OwnedState | None = None

    def describe(self) -> str:
        return f"shape {tuple(self.shape)} {self.dtype.name}"

    def rounds_applied(self) -> int:
        """How many rounds ``value`` reflects (those of a client that took part in all of them)."""
        return max([self.first_round, *self.applied.values()])

    def state_dict(self) -> dict:
        """Everything but held requests; arrays are referenced, not copied (values are never mutated once
        set; a file written by geomx.statefile is a copy)."""
        return {"key": self.key, "shape": tuple(self.shape), "dtype": self.dtype.str, "value": self.value,
                "first_round": self.first_round,
                "pushes": dict(self.pushes), "refused": dict(self.refused), "applied": dict(self.applied),
                "rounds": {n: r.state_dict() for n, r in self.rounds.items()},
                "update": self.update.state_dict() if self.update is not None else None,
                "wire": self.wire.state_dict(self.value) if self.wire is not None else None,
                "upstream": self.upstream.state_dict() if self.upstream is not None else None,
                "overlap": self.overlap.state_dict() if self.overlap is not None else None,
                "hfa": self.hfa.state_dict() if self.hfa is not None else None}

    @classmethod
    def from_state_dict(cls, state: dict) -> KeyState:
        """The server's part; the owners load theirs (KVServer.load_state_dict)."""
        value = state["value"]
        return cls(state["key"], tuple(state["shape"]), np.dtype(state["dtype"]),
                   value=None if value is None else np.array(value), first_round=int(state.get("first_round", 0)),
                   pushes=dict(state["pushes"]), refused=dict(state["refused"]), applied=dict(state["applied"]),
                   rounds={int(n): Round.from_state_dict(r) for n, r in state["rounds"].items()})


def layout_mismatch(what: str, key, value_shape, value_dtype, shape, dtype) -> str | None:
    """The error for a value whose shape or dtype is not the key's (servers, and workers for partitioned keys)."""
    if tuple(value_shape) == tuple(shape) and np.dtype(value_dtype) == np.dtype(dtype):
        return None
    return (f"{what} of key {key!r} has shape {tuple(value_shape)} {np.dtype(value_dtype).name}, but the key was "
            f"initialized with shape {tuple(shape)} {np.dtype(dtype).name}")


def init_layout(msg: Message) -> tuple[tuple, np.dtype]:
    """Shape and dtype of an init. Only the master worker's init carries a value; the others carry
    ``layout = [shape, dtype name]`` (the value they would send is thrown away: across the WAN it costs a
    model's worth of bytes per DC)."""
    layout = msg.get(Field.LAYOUT)
    if layout is None:
        if len(msg.tensors) != 1:
            raise Refused(f"init of key {msg.get('key')!r} carries neither a value nor a layout")
        return tuple(msg.tensors[0].shape), msg.tensors[0].dtype
    try:
        shape, name = layout
        if name not in WIRE_DTYPES or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                               for n in shape):
            raise ValueError
        return tuple(shape), np.dtype(name)
    except (TypeError, ValueError):
        raise Refused(f"init of key {msg.get('key')!r} has a malformed layout {layout!r}") from None


def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """Sums of low-precision tensors are kept in fp32 (GeoMX sums fp16 in fp16, which overflows)."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


class KVServer:
    """Base of LocalServer and GlobalServer; subclasses decide what a complete round or an init does."""

    def __init__(self, po: Postoffice) -> None:
        self.po = po
        self.keys: dict[Any, KeyState] = {}
        self.clients: dict[str, NodeInfo] = {}   # node id -> member of a tier we serve
        self.info: dict = {}                      # sent with init replies: mode, server optimizer, ...
        self.wire: ServerWire | None = None       # gradient compression, once configured
        self.tables_pending = 1                   # member tables still to come; subclasses set it
        # round client id -> the training workers it stands for (NodeInfo.weight), kept once a client is dropped:
        # what a round short of dropped clients is scaled to (stand_in_for_departed)
        self.round_weights: dict[str, int] = {}
        # rejoin (a restarted client in a dropped one's place): admitted, not yet asked for a key -> the dropped
        # client it replaces; then -> the rounds already under way when it first asked, which it takes no part in
        self.joining: dict[str, str] = {}
        self.joined_at: dict[str, int] = {}
        self.refilled: set[str] = set()            # dropped clients whose places were taken (weigh no more)
        self._early: list[Message] = []           # requests that overtook our own member table
        self._early_bytes = 0
        po.metrics_fields.append(self.queue_depths)
        self.stuck_rounds = StuckRounds(self)     # names what a round that waits far too long is waiting for
        po.add_periodic_check(self.stuck_rounds.check)

    def queue_depths(self) -> dict:
        """For the metrics: requests held until their round completes, and rounds still collecting pushes."""
        states = list(self.keys.values())
        return {"held_requests": sum(len(st.waiting) for st in states) + len(self._early),
                "open_rounds": sum(len(st.rounds) for st in states)}

    # to be provided by subclasses ---------------------------------------------------------------------------
    def round_clients(self) -> list[NodeInfo]:
        """The clients whose pushes complete a synchronous round: those still members of their tier."""
        raise NotImplementedError

    def round_complete(self, st: KeyState, rnd: Round, number: int) -> bool:
        """Whether every client still in the tier pushed ``rnd``, round ``number`` (a push that a client dropped
        since made before it went silent counts; a rejoined client counts from the round after it joined)."""
        return not self.round_waits_for(rnd, number)

    def round_waits_for(self, rnd: Round, number: int) -> list[NodeInfo]:
        """The clients whose push round ``number`` still lacks."""
        return [c for c in self.round_clients() if c.id not in self.joining
                and number > self.joined_at.get(c.id, 0) and c.id not in rnd.contributors]

    def stand_in_for_departed(self, rnd: Round) -> np.ndarray:
        """The round's sum, scaled to the weight of every round client when dropped ones are missing from it:
        the mean over the clients that pushed, each weighed by the workers it stands for, takes their place."""
        full = sum(w for src, w in self.round_weights.items() if src not in self.refilled)
        pushed = sum(self.round_weights.get(src, 1) for src in rnd.contributors)
        return rnd.scale(full / pushed) if 0 < pushed < full else rnd.total

    def client_place(self, src: str) -> str:
        """``src``'s place in its tier (``NodeInfo.place``), the same in every run; its id if not a member."""
        member = self.clients.get(src)
        return src if member is None else member.place

    def drop_client(self, member: NodeInfo) -> None:
        """``member`` left its tier (its scheduler dropped it): forget its held requests, complete the rounds
        that waited only for it."""
        self.clients.pop(member.id, None)
        for st in self.keys.values():
            st.waiting = [(msg, after) for msg, after in st.waiting if msg.src != member.id]
            for number in sorted(st.rounds):
                if number in st.rounds and self.round_complete(st, st.rounds[number], number):
                    self.complete_round(st, number)

    def admit_client(self, member: NodeInfo, replaces: str) -> None:
        """A restarted client takes the place of ``replaces``, a client its tier dropped. It counts in rounds
        once it asks for its first key (:meth:`start_joiner`): until then its DC goes on without it."""
        self.clients[member.id] = member
        self.joining[member.id] = replaces
        self.round_weights[member.id] = member.weight
        self.refilled.add(replaces)
        log.warning("%s: %s takes the place of %s; it counts in rounds from its first init", self.po.cfg.label,
                    member.label, public_name(replaces))

    def start_joiner(self, member: NodeInfo) -> None:
        """``member``'s first init: it takes part in every round after those already under way (on any key), and
        starts from the value after them. Only where the model lives on the servers (their optimizer): a worker
        that updates its own copy has nothing to start from."""
        under_way = max((n for st in self.keys.values() for n in st.pushes.values()), default=0)
        if under_way and not self.info.get("server_optimizer"):
            raise Refused(f"{member.label} cannot rejoin the running job: the workers update their own copies of "
                          f"the model, so there is no current model to start from; rejoining needs the servers to "
                          f"run the optimizer (--update-on server)")
        del self.joining[member.id]
        self.joined_at[member.id] = under_way
        log.warning("%s: %s rejoined at round %d", self.po.cfg.label, member.label, under_way)

    def on_init(self, msg: Message, client: NodeInfo) -> None:
        raise NotImplementedError

    def on_round(self, st: KeyState, number: int, rnd: Round) -> None:
        """All expected clients pushed round ``number``; eventually call :meth:`set_value`."""
        raise NotImplementedError

    def on_command(self, msg: Message, client: NodeInfo) -> None:
        raise Refused(f"unknown command {msg.get('name')!r}")

    def note_push_fields(self, st: KeyState, msg: Message) -> None:
        """An accepted push's fields, before its round may complete (a global server hears of checkpoint rounds
        there); nothing by default."""

    def accept_push(self, st: KeyState, src: str, number: int, value: np.ndarray, priority: int, *,
                    reusable: bool = False) -> None:
        """Default (synchronous) aggregation: sum the round, complete it when everyone pushed. ``reusable``: see
        :meth:`Round.add`."""
        rnd = st.rounds.get(number)
        if rnd is None:
            rnd = st.rounds[number] = self.new_round()
        rnd.add(src, value, priority, reusable=reusable)
        if self.round_complete(st, rnd, number):
            self.complete_round(st, number)

    def new_round(self) -> Round:
        """A round of this tier's clients: order-free when three or more push (see :class:`Round`)."""
        return Round(order_free=len(self.round_clients()) > 2)

    def complete_round(self, st: KeyState, number: int) -> None:
        rnd = st.rounds.pop(number).finish()
        self.stuck_rounds.completed(rnd)
        try:
            self.on_round(st, number, rnd)
        except GeomxError as exc:   # the round cannot go on: its waiting clients hear why now, not at a deadline
            self.fail_waiting(st, f"round {number} of key {st.key!r} failed at {self.po.cfg.label}: {exc}")

    def read_value(self, st: KeyState, src: str) -> np.ndarray:
        return st.value

    # saved state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole server: its configuration, and per key the value, the counters, the open rounds and what
        each owner keeps (KeyState). The state is the receive thread's alone: call this from a handler, or
        while no request is in flight. Held requests are not part of it (their clients time out or retry)."""
        return {"server": type(self).__name__, "info": dict(self.info), "config": self.config_state(),
                "keys": [st.state_dict() for st in self.keys.values()], "joined_at": dict(self.joined_at)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a fresh server that has joined its tiers (client ids must be those
        of the saved run)."""
        if state.get("server") != type(self).__name__:
            raise ConfigError(f"a {state.get('server')} state cannot be loaded into a {type(self).__name__}")
        if self.keys:
            raise ConfigError(f"{self.po.cfg.label} already has keys ({', '.join(map(repr, list(self.keys)[:5]))}): "
                              f"load state into a fresh server")
        self.info = dict(state["info"])
        self.joined_at = {str(c): int(n) for c, n in state.get("joined_at", {}).items()}
        self.load_config_state(state["config"])
        for saved in state["keys"]:
            st = KeyState.from_state_dict(saved)
            try:
                self.load_owned_state(st, saved)
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"saved state of key {st.key!r} does not fit this server: {exc}") from None
            self.keys[st.key] = st

    def save(self, path) -> None:
        """:meth:`state_dict` to ``path``, atomically (geomx.statefile: msgpack, never pickle)."""
        statefile.save(path, self.state_dict())

    def load(self, path) -> None:
        self.load_state_dict(statefile.load(path))

    def config_state(self) -> dict:
        """What the subclass was configured with (mode, optimizer...)."""
        return {}

    def load_config_state(self, config: dict) -> None:
        pass

    def load_owned_state(self, st: KeyState, saved: dict) -> None:
        """Recreate each owner's part of ``st`` and load it (subclasses add theirs)."""
        if saved["wire"] is not None:
            if self.wire is None:
                raise ValueError("it carries compression state, but no compression is configured")
            st.wire = self.wire.key_state(st)
            st.wire.load_state_dict(saved["wire"], st.value)

    # dispatch -----------------------------------------------------------------------------------------------
    def add_clients(self, members: list[NodeInfo]) -> None:
        """Install one tier's member table (on the receive thread) and answer what arrived before it: the
        scheduler sends every member its table at once, so a client may hear first and ask first."""
        self.clients.update({m.id: m for m in members if m.id != self.po.node_id})
        self.tables_pending -= 1
        early, self._early, self._early_bytes = self._early, [], 0
        for msg in early:
            self.handle(msg)

    def handle(self, msg: Message) -> None:
        client = self.clients.get(msg.src)
        if client is None and self.tables_pending > 0:
            nbytes = sum(t.nbytes for t in msg.tensors)
            if len(self._early) < _MAX_EARLY and self._early_bytes + nbytes <= _MAX_EARLY_BYTES:
                self._early.append(msg)
                self._early_bytes += nbytes
                return
        if client is None:
            self.po.refusals.note(msg.src, "%s: %r from unknown sender %r dropped (not a member of any tier this "
                                  "server serves)", self.po.cfg.label, msg.op, public_name(msg.src))
            return
        if msg.op == Op.INIT and msg.src in self.joining:
            try:
                self.start_joiner(client)
            except Refused as exc:
                self.reply(msg, error=str(exc))
                return
        handler = {Op.INIT: self.on_init, Op.PUSH: self._on_push, Op.PUSHPULL: self._on_push, Op.PULL: self._on_pull,
                   Op.COMMAND: self.on_command}.get(msg.op)
        if handler is None:
            self.handle_other(msg, client)
            return
        try:
            handler(msg, client)
        except Refused as exc:
            self.reply(msg, error=str(exc))

    def handle_other(self, msg: Message, client: NodeInfo) -> None:
        self.po.refusals.note(msg.src, "%s: unexpected %r from %s dropped", self.po.cfg.label, msg.op, client.label)

    def reply(self, request: Message, *, error: str | None = None, tensors=(), **fields) -> None:
        client = self.clients.get(request.src)
        if client is None:      # its tier dropped it while the request was held (drop_client)
            log.info("%s: reply to dropped member %r not sent", self.po.cfg.label, public_name(request.src))
            return
        out = {Field.REQ: request.get(Field.REQ), **fields}
        if error:
            out[Field.ERROR] = error
        self.po.van.send(client.addr, Message(Op.REPLY, fields=out, tensors=list(tensors),
                                              priority=request.priority), dst_dc=client.dc)

    # shared handlers ----------------------------------------------------------------------------------------
    def key_state(self, msg: Message) -> KeyState:
        key = msg.get(Field.KEY)
        st = self.keys.get(key)
        if st is None:
            raise Refused(f"key {key!r} was never initialized (call kv.init({key!r}, value) before push or pull)")
        return st

    def check_value(self, st: KeyState, value: np.ndarray, what: str) -> None:
        self.check_layout(st, value.shape, value.dtype, what)

    def check_layout(self, st: KeyState, shape, dtype, what: str) -> None:
        problem = layout_mismatch(what, st.key, shape, dtype, st.shape, st.dtype)
        if problem:
            raise Refused(problem)

    def single_tensor(self, msg: Message) -> np.ndarray:
        if len(msg.tensors) != 1:
            raise Refused(f"{msg.op} of key {msg.get('key')!r} must carry exactly one tensor, got {len(msg.tensors)}")
        return msg.tensors[0]

    def _on_push(self, msg: Message, client: NodeInfo) -> None:
        st = self.key_state(msg)
        try:
            # before decoding: a refused push must not advance the codec's streams
            if len(st.rounds) >= MAX_OPEN_ROUNDS and st.pushes.get(msg.src, 0) + 1 not in st.rounds:
                raise Refused(f"push of key {st.key!r} from {client.label} refused: {len(st.rounds)} rounds of "
                              f"this key already wait for other workers' pushes (at most {MAX_OPEN_ROUNDS}); "
                              f"pull between pushes, or find the worker that stopped pushing")
            value = self.push_value(st, msg)
            if client.tier_role != "worker" or client.kind == "master":
                raise Refused(f"{client.label} does not train; only workers push gradients")
        except Refused:
            # the client counted this push: later pulls must not wait for it
            st.refused[msg.src] = st.refused.get(msg.src, 0) + 1
            self.serve_waiting(st)
            raise
        number = st.pushes[msg.src] = st.pushes.get(msg.src, 0) + 1
        if msg.op == Op.PUSH:
            self.reply(msg)
        else:
            # waiting entries count pushes as the client does, refused ones included
            st.waiting.append((msg, number + st.refused.get(msg.src, 0)))
        reusable = msg.private and len(msg.tensors) == 1 and value is msg.tensors[0]
        msg.tensors = []        # a held pushpull must not keep its pushed tensor alive (the round has it)
        self.note_push_fields(st, msg)
        self.accept_push(st, msg.src, number, value, msg.priority, reusable=reusable)
        self.serve_waiting(st)

    def push_value(self, st: KeyState, msg: Message) -> np.ndarray:
        """The pushed tensor, decoded if it came compressed; Refused if it does not fit the key."""
        try:
            decoded = self.wire.decode_push(st, msg.fields, msg.tensors) if self.wire is not None else None
            if decoded is not None:
                return decoded
            value = self.single_tensor(msg)
            self.check_value(st, value, msg.op)
            return scale_dense(value, msg.fields)
        except WireError as exc:
            raise Refused(f"{msg.op} of key {st.key!r}: {exc}") from None

    def _on_pull(self, msg: Message, client: NodeInfo) -> None:
        st = self.key_state(msg)
        st.waiting.append((msg, int(msg.get(Field.AFTER) or 0)))
        self.serve_waiting(st)

    def set_value(self, st: KeyState, value: np.ndarray, contributors=()) -> None:
        """``value`` now reflects one more push of each contributor. Never mutate it afterwards: replies are
        sent without copying."""
        st.value = value
        if self.wire is not None and contributors:
            self.wire.on_new_value(st, value)
        for src in contributors:
            st.applied[src] = st.applied.get(src, 0) + 1
        if st.held_joins:
            held, st.held_joins = st.held_joins, []
            for msg in held:
                self.reply_init(msg, st)
        self.serve_waiting(st)

    def serve_waiting(self, st: KeyState) -> None:
        if st.value is None or not st.waiting:
            return
        still = []
        for msg, after in st.waiting:
            refused = st.refused.get(msg.src, 0)
            if st.applied.get(msg.src, 0) + refused >= after and st.pushes.get(msg.src, 0) + refused >= after:
                self.reply_value(msg, st)
            else:
                still.append((msg, after))
        st.waiting = still

    def reply_value(self, msg: Message, st: KeyState) -> None:
        value = self.read_value(st, msg.src)
        notices = self.reply_notices()
        # the master worker does not train and keeps no codec streams: it reads whole values (a pull it sends
        # right after init can be answered after a round, when the round's compressed reply is at hand)
        if self.wire is None or self.clients[msg.src].kind == "master":
            self.reply(msg, tensors=[value], **notices)
            return
        tensors, fields = self.wire.encode_reply(st, msg.src, value)
        self.reply(msg, tensors=tensors, **fields, **notices)

    def reply_notices(self) -> dict:
        """Fields every value reply carries (the latest checkpoint round, geomx.cluster.checkpoint_clock)."""
        return {}

    def reply_init(self, msg: Message, st: KeyState) -> None:
        """Answer an init with the key's current value (what the client starts from, sent whole). A rejoined
        client's waits until the value reflects the rounds it takes no part in; the reply tells it how many."""
        joined_at = self.joined_at.get(msg.src)
        if joined_at is not None and msg.src not in st.pushes:
            if st.rounds_applied() < joined_at:
                st.held_joins.append(msg)
                return
            st.pushes[msg.src] = st.applied[msg.src] = joined_at    # its first push is round joined_at + 1
        if self.wire is not None:
            self.wire.note_dense(st, msg.src, st.value)
        rejoin = {Field.JOINED_AT: joined_at, Field.DIGEST: value_digest(st.value)} if joined_at else {}
        self.reply(msg, tensors=[st.value], info=self.info, **rejoin)

    def fail_waiting(self, st: KeyState, error: str, *, lost: bool = False) -> None:
        """Answer every held request of ``st`` with ``error`` (``lost``: because a peer died)."""
        waiting, st.waiting = st.waiting, []
        for msg, _ in waiting:
            self.reply(msg, error=error, **({Field.LOST: True} if lost else {}))
