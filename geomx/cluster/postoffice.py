"""A node's runtime: its van, its membership in one or two tiers, heartbeats, barriers and abort.

A *tier* is one scheduler's cluster: a DC's local tier (its local server and workers), the central party's
tier (the global servers and the master worker) or the global tier (global servers and local servers, or
in the flat topology the workers themselves). Inside a tier every member is a "server" or a "worker".

Control messages carry the tier's name; everything else is data and goes to the role's handler. An abort
(a peer died, the topology is inconsistent) fails every pending wait with a message naming the cause.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable

from geomx import metrics
from geomx.config import NodeConfig
from geomx.errors import ConfigError, DeadlineError, PeerLostError, ProtocolError
from geomx.transport.message import Message
from geomx.transport.refusals import RefusalLog
from geomx.transport.security import mismatch_hint
from geomx.cluster.protocol import CONTROL_OPS, Field, Op
from geomx.transport.base import STALL_S, Van, is_node_address
from geomx.transport.ids import new_node_id, public_name

_METRICS_PERIOD_S = 1.0

log = logging.getLogger("geomx.postoffice")

# what a tier's scheduler sends its members; the other control ops go to schedulers only
FROM_SCHEDULER = {Op.TABLE, Op.REJECT, Op.BARRIER_DONE, Op.HEARTBEAT_ACK, Op.SHUTDOWN, Op.MEMBER_LEFT,
                  Op.MEMBER_JOINED, Op.ABORT}
TIER_ROLES = ("server", "worker")


def describe_node(kind: str, rank, dc: str, addr: str, pid) -> str:
    """'worker 1 of DC a (tcp://10.0.0.5:4000, pid 77)': how every log line and error names a node."""
    name = {"server": "local server", "global_server": "global server", "master": "master worker"}.get(kind, kind)
    if kind in ("worker", "global_server") and rank is not None:
        name += f" {rank}"
    if kind in ("worker", "server"):
        name += f" of DC {dc}"
    return f"{name} ({addr}, pid {pid})"


def _shown(entry):
    """A member table entry as an error may show it: its id's public part only."""
    return {**entry, "id": public_name(entry["id"])} if isinstance(entry, dict) and "id" in entry else entry


@dataclass(frozen=True)
class NodeInfo:
    id: str
    kind: str        # process role: worker, master, server, global_server, ...
    tier_role: str   # "server" or "worker" inside the tier
    dc: str
    rank: int
    addr: str
    pid: int = 0
    weight: int = 1  # the training workers it stands for (a local server in the global tier: its DC's)

    @property
    def label(self) -> str:
        return describe_node(self.kind, self.rank, self.dc, self.addr, self.pid)

    @property
    def place(self) -> str:
        """'worker 1 of DC a': its role, rank and DC, the same in every run and unique in its tier (no address,
        no pid, no random id; the scheduler ranks by DC and order, not by ports, geomx.cluster.scheduler.assign_ranks):
        what seeds a client's own codec stream, so runs repeat."""
        return f"{self.kind} {self.rank} of DC {self.dc}"

    def to_wire(self) -> dict:
        return {"id": self.id, "kind": self.kind, "tier_role": self.tier_role, "dc": self.dc, "rank": self.rank,
                "addr": self.addr, "pid": self.pid, "weight": self.weight}

    @classmethod
    def from_wire(cls, d: dict) -> NodeInfo:
        """A member table entry, checked: ValueError names what is malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"member entry {_shown(d)!r} is not a map")
        info = cls(**{k: d.get(k) for k in ("id", "kind", "tier_role", "dc", "rank", "addr", "pid")},
                   weight=d.get("weight", 1))
        if not all(isinstance(v, str) and v for v in (info.id, info.kind, info.dc)):
            raise ValueError(f"member entry {_shown(d)!r} lacks an id, kind or DC")
        if info.tier_role not in TIER_ROLES or not isinstance(info.rank, int) or not is_node_address(info.addr):
            raise ValueError(f"member entry {_shown(d)!r} has a bad tier role, rank or address")
        if not isinstance(info.weight, int) or isinstance(info.weight, bool) or info.weight < 1:
            raise ValueError(f"member entry {_shown(d)!r} has a bad weight")
        return info


class Tier:
    """This node's membership in one scheduler's cluster."""

    def __init__(self, po: Postoffice, name: str, scheduler: tuple[str, int], scheduler_dc: str,
                 tier_role: str, declared: dict, on_table: Callable[[Tier], None] | None = None) -> None:
        self.on_table = on_table
        self.po, self.name, self.scheduler_dc, self.tier_role = po, name, scheduler_dc, tier_role
        self.scheduler_addr = po.van.peer_address(*scheduler)
        self.declared = declared
        # echoed by the scheduler in every control message to us: proves the sender is the scheduler we
        # registered with (a stranger never sees it), for the cost of one string comparison
        self.token = secrets.token_hex(16)
        self.members: list[NodeInfo] = []     # without those the scheduler dropped (member_left)
        self.me: NodeInfo | None = None
        self.closed = False             # the scheduler said shutdown: stop heartbeating
        self.last_ack = time.monotonic()
        self._table_ready = threading.Event()
        self._reject: str | None = None
        self._barrier_seq = 0
        self._barriers: dict[int, Callable[[], None]] = {}

    # members ----------------------------------------------------------------------------------------------
    def servers(self) -> list[NodeInfo]:
        return sorted((m for m in self.members if m.tier_role == "server"), key=lambda m: m.rank)

    def workers(self) -> list[NodeInfo]:
        return sorted((m for m in self.members if m.tier_role == "worker"), key=lambda m: m.rank)

    def send_to_scheduler(self, op: str, priority: int = 100, **fields) -> None:
        self.po.van.send(self.scheduler_addr, Message(op, fields={Field.TIER: self.name, **fields}, priority=priority),
                         dst_dc=self.scheduler_dc)

    def register(self, requested_rank: int | None, order: int | None = None) -> None:
        """``order``: without a requested rank, where this member comes among its DC's members of its role (the
        scheduler ranks them by DC, then order, then address)."""
        self.send_to_scheduler(Op.REGISTER, tier_role=self.tier_role, kind=self.po.cfg.role, dc=self.po.cfg.network_dc,
                               addr=self.po.van.address, rank=requested_rank, order=order, declared=self.declared,
                               pid=os.getpid(), hostname=socket.gethostname(), token=self.token)
        deadline = self.po.cfg.connect_timeout
        if not self.po.wait_event(self._table_ready, deadline):
            # a registration to another DC crosses the WAN emulator: a dead or refusing emulator looks the same
            # from here as a scheduler that is not running, so both are named
            emulator = self.po.van.emulator_for(self.scheduler_dc)
            via = "" if emulator is None else (
                f"; the registration went through the WAN emulator at {emulator} (GEOMX_WAN_EMULATOR): it may be "
                f"down, or refusing the route from DC {self.po.cfg.network_dc} to DC {self.scheduler_dc} (its log "
                f"says why, e.g. GEOMX_EMULATOR_DCS or GEOMX_EMULATOR_HOSTS)")
            raise DeadlineError(f"{self.po.cfg.label}: no answer from the {self.name} scheduler at "
                                f"{self.scheduler_addr} within {deadline:g} s (is it running? "
                                f"{mismatch_hint(self.po.cfg.security, 'the scheduler')} GEOMX_CONNECT_TIMEOUT sets "
                                f"the limit){via}")
        if self._reject:
            raise ConfigError(f"the {self.name} scheduler at {self.scheduler_addr} refused {self.po.cfg.label}: "
                              f"{self._reject}")

    def barrier(self, group: str = "worker", timeout: float | None = None) -> None:
        """Block until every member of ``group`` ("worker", "server" or "all") of this tier has arrived."""
        ev = threading.Event()
        seq = self.barrier_async(group, ev.set)
        timeout = self.po.cfg.op_timeout if timeout is None else timeout
        if not self.po.wait_event(ev, timeout):
            raise DeadlineError(f"{self.po.cfg.label}: barrier {seq} of the {self.name} tier ({group}s) not "
                                f"released within {timeout:g} s")

    def barrier_async(self, group: str, on_done: Callable[[], None]) -> int:
        """Enter a barrier without blocking (servers must never block their receive thread)."""
        self._barrier_seq += 1
        seq = self._barrier_seq
        self._barriers[seq] = on_done
        self.send_to_scheduler(Op.BARRIER, group=group, seq=seq)
        return seq

    # control messages from the scheduler ------------------------------------------------------------------
    def from_scheduler(self, msg: Message) -> bool:
        """Whether ``msg`` carries the token this tier registered with (see ``token``)."""
        return msg.get(Field.AUTH) == self.token

    def handle(self, msg: Message) -> None:
        """A control message that :meth:`from_scheduler` accepted. A table is installed once, and only whole
        and well formed (a malformed one is refused before anything is replaced)."""
        if msg.op == Op.TABLE:
            if self.me is not None or self._table_ready.is_set():
                raise ValueError("a second member table")
            members = [NodeInfo.from_wire(d) for d in msg[Field.MEMBERS]]
            me = [m for m in members if m.id == self.po.node_id]
            if len(me) != 1 or len({m.id for m in members}) != len(members):
                raise ValueError("a member table that does not list this node once, or lists a node twice")
            self.members, self.me = members, me[0]
            self.last_ack = time.monotonic()
            if self.on_table is not None:
                # runs on the receive thread, before any message from the new members can be handled
                self.on_table(self)
            self._table_ready.set()
            return
        self.last_ack = time.monotonic()
        if msg.op == Op.REJECT:
            if self._table_ready.is_set():
                raise ValueError("a rejection after the member table")
            self._reject = str(msg[Field.REASON])
            self._table_ready.set()
        elif msg.op == Op.BARRIER_DONE:
            on_done = self._barriers.pop(msg[Field.SEQ], None)
            if on_done is not None:
                on_done()
        elif msg.op == Op.SHUTDOWN:
            self.closed = True
            self.po.on_shutdown(self)
        elif msg.op == Op.MEMBER_LEFT:
            node, reason = msg[Field.NODE], str(msg.get(Field.REASON, ""))
            gone = [m for m in self.members if m.id == node]
            if not gone or gone[0] == self.me:
                raise ValueError(f"member_left names {node!r}, not another member of the tier")
            self.members.remove(gone[0])
            self.po.on_member_left(self, gone[0], reason, finished=msg.get(Field.FINISHED) is True)
        elif msg.op == Op.MEMBER_JOINED:
            joined = NodeInfo.from_wire(msg[Field.MEMBER])
            if any(m.id == joined.id for m in self.members):
                raise ValueError(f"member_joined names {public_name(joined.id)!r}, already a member of the tier")
            self.members.append(joined)
            self.po.on_member_joined(self, joined, str(msg[Field.REPLACES]))


class Postoffice:
    """One process's runtime. Roles build on it; see the module docstring."""

    def __init__(self, cfg: NodeConfig, *, on_data: Callable[[Message], None] | None = None,
                 node_id: str | None = None) -> None:
        self.cfg = cfg
        self.node_id = node_id or new_node_id(f"{cfg.role}-{cfg.dc}")
        self.refusals = RefusalLog(log)
        self.tiers: dict[str, Tier] = {}
        self.on_data = on_data
        self.aborted: str | None = None
        self._abort_listeners: list[Callable[[str], None]] = []
        self._shutdown_listeners: list[Callable[[Tier], None]] = []
        self._member_left_listeners: list[Callable[[Tier, NodeInfo, str], None]] = []
        self._member_joined_listeners: list[Callable[[Tier, NodeInfo, str], None]] = []
        self._periodic_checks: list[Callable[[], None]] = []
        self._abort_event = threading.Event()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        # metrics: the van's byte counters every second (and at close), plus what roles add (queue depths)
        # bytes are counted from the network the process sits in (a global server inside a DC: that DC's)
        self.metrics = metrics.open_process_writer(cfg.run_dir, cfg.role, cfg.network_dc)
        self.metrics_fields: list[Callable[[], dict]] = []
        self._metrics_thread: threading.Thread | None = None
        self.van = Van.create(cfg.van, node_id=self.node_id, dc=cfg.network_dc, on_message=self._dispatch,
                              host=cfg.host, port=cfg.port, bind_host=cfg.bind_host, emulator=cfg.emulator,
                              security=cfg.security, **cfg.van_options)

    def start(self) -> None:
        self.van.start()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._hb_thread.start()
        if self.metrics is not None:
            self._metrics_thread = threading.Thread(target=self._metrics_loop, name="metrics", daemon=True)
            self._metrics_thread.start()

    def join(self, name: str, scheduler: tuple[str, int], scheduler_dc: str, tier_role: str, declared: dict,
             rank: int | None = None, on_table: Callable[[Tier], None] | None = None,
             order: int | None = None) -> Tier:
        """Register with a tier's scheduler and wait for its member table (``rank``, ``order``: see
        :meth:`Tier.register`)."""
        tier = self.tiers[name] = Tier(self, name, scheduler, scheduler_dc, tier_role, declared, on_table)
        tier.register(rank, order)
        return tier

    def wait_event(self, event: threading.Event, timeout: float) -> bool:
        """Wait for ``event``; raise PeerLostError as soon as the cluster is aborted."""
        end = time.monotonic() + timeout
        while True:
            if event.is_set():
                return True
            if self.aborted:
                raise PeerLostError(self.aborted)
            left = end - time.monotonic()
            if left <= 0:
                return False
            event.wait(min(left, 0.1))

    # abort and shutdown -------------------------------------------------------------------------------------
    def add_abort_listener(self, fn: Callable[[str], None]) -> None:
        self._abort_listeners.append(fn)

    def add_shutdown_listener(self, fn: Callable[[Tier], None]) -> None:
        self._shutdown_listeners.append(fn)

    def add_member_left_listener(self, fn: Callable[..., None]) -> None:
        """``fn(tier, member, reason, finished=...)`` on the receive thread when a tier's scheduler drops a member,
        or (``finished``) a worker finished its training while others still train."""
        self._member_left_listeners.append(fn)

    def on_member_left(self, tier: Tier, member: NodeInfo, reason: str, *, finished: bool = False) -> None:
        log.log(logging.INFO if finished else logging.WARNING, "%s: %s left the %s tier: %s", self.cfg.label,
                member.label, tier.name, reason)
        for fn in self._member_left_listeners:
            fn(tier, member, reason, finished=finished)

    def add_periodic_check(self, fn: Callable[[], None]) -> None:
        """``fn()`` about every heartbeat interval on the heartbeat thread (it must only read what the receive
        thread owns, and be quick)."""
        self._periodic_checks.append(fn)

    def add_member_joined_listener(self, fn: Callable[[Tier, NodeInfo, str], None]) -> None:
        """``fn(tier, member, replaced_id)`` on the receive thread when a restarted member takes the place of one
        the tier's scheduler dropped."""
        self._member_joined_listeners.append(fn)

    def on_member_joined(self, tier: Tier, member: NodeInfo, replaces: str) -> None:
        log.warning("%s: %s joined the %s tier", self.cfg.label, member.label, tier.name)
        for fn in self._member_joined_listeners:
            fn(tier, member, replaces)

    def abort(self, reason: str, *, tell_schedulers: bool = True, fatal: bool = False, relayed: bool = False) -> None:
        """Fail every wait with ``reason``; tell our schedulers so the whole deployment learns of it. ``fatal``:
        a tier failed before it was complete (a misconfiguration): no tier may go on without us then.
        ``relayed``: we pass on another role's abort or loss (the launcher names where an abort began)."""
        if self.aborted:
            return
        self.aborted = reason
        log.error("%s: aborting: %s", self.cfg.label, reason)
        if tell_schedulers:
            flags = {**({Field.FATAL: True} if fatal else {}), **({Field.RELAYED: True} if relayed else {})}
            for tier in self.tiers.values():
                if not tier.closed:
                    tier.send_to_scheduler(Op.ABORT, reason=reason, **flags)
        for fn in self._abort_listeners:
            try:
                fn(reason)
            except Exception:
                log.exception("abort listener failed")
        self._abort_event.set()

    def on_shutdown(self, tier: Tier) -> None:
        for fn in self._shutdown_listeners:
            fn(tier)

    def close(self) -> None:
        """Leave every tier cleanly (so nobody mistakes us for dead), then stop the van."""
        self._hb_stop.set()
        if not self.aborted:
            for tier in self.tiers.values():
                if not tier.closed:
                    tier.send_to_scheduler(Op.BYE)
        self.van.stop()
        if self._metrics_thread is not None:
            self._metrics_thread.join(timeout=2)
            self._write_traffic()           # final counters, after the van flushed its queue

    def _metrics_loop(self) -> None:
        while not self._hb_stop.wait(_METRICS_PERIOD_S):
            self._write_traffic()

    def _write_traffic(self) -> None:
        extra: dict = {}
        for fn in self.metrics_fields:
            # a dict changed size under us on the receive thread: next time
            with contextlib.suppress(RuntimeError):
                extra.update(fn())
        self.metrics.write("traffic", **self.van.counters(), **extra)

    # internals ----------------------------------------------------------------------------------------------
    def _dispatch(self, msg: Message) -> None:
        if msg.op in CONTROL_OPS:
            self._control(msg)
        elif self.on_data is not None:
            self.on_data(msg)
        else:
            self.refusals.note(msg.src, "%s: data message %r from %r dropped: this role serves no data",
                               self.cfg.label, msg.op, public_name(msg.src))

    def _control(self, msg: Message) -> None:
        """Control ops count only from the scheduler of the tier they name (see ``Tier.token``)."""
        name = msg.get(Field.TIER)
        tier = self.tiers.get(name) if isinstance(name, str) else None
        if tier is None or msg.op not in FROM_SCHEDULER or not tier.from_scheduler(msg):
            self.refusals.note(msg.src, "%s: control message %r (tier %r) from %r refused: not from the scheduler "
                               "of one of its tiers", self.cfg.label, msg.op, name, public_name(msg.src))
            return
        if msg.op == Op.ABORT:
            self.abort(str(msg.get(Field.REASON, "aborted by a peer")), tell_schedulers=True,
                       fatal=msg.get(Field.FATAL) is True, relayed=True)
            return
        try:
            tier.handle(msg)
        except (ValueError, TypeError, ProtocolError) as exc:
            self.refusals.note(msg.src, "%s: control message %r from the %s scheduler refused: %s", self.cfg.label,
                               msg.op, tier.name, exc)

    def _heartbeat_loop(self) -> None:
        interval, timeout = self.cfg.heartbeat_interval, self.cfg.heartbeat_timeout
        while not self._hb_stop.wait(interval):
            if self.aborted:
                return
            now = time.monotonic()
            stalled = self.van.last_stall_end
            if self.van.handling_since is not None and now - self.van.handling_since > STALL_S:
                stalled = now
            for tier in list(self.tiers.values()):
                if tier.closed or tier.me is None:
                    continue
                tier.send_to_scheduler(Op.HEARTBEAT, priority=1000)
                # acks wait unread while our own receive thread is stuck: silence until then proves nothing
                heard = max(tier.last_ack, stalled)
                if now - heard > timeout:
                    self.abort(f"the {tier.name} scheduler at {tier.scheduler_addr} stopped answering heartbeats "
                               f"for {now - heard:.1f} s ({self.cfg.label} gives up)", relayed=True)
                    return
            for check in self._periodic_checks:
                try:
                    check()
                except Exception:  # a check's bug must not stop the heartbeats
                    log.exception("%s: periodic check failed", self.cfg.label)
