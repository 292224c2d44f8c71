"""Scheduler: rendezvous, rank assignment, barriers, liveness and shutdown for one tier.

One scheduler per tier (each DC, the central party, the global tier). It waits until every expected member
has registered, checks that they all count the topology the same way, assigns ranks (a requested rank is
honoured; the rest go by DC, then by the order a member registered with, then in (host, port) order:
:func:`assign_ranks`) and sends everyone the member table. Afterwards it
releases barriers, watches heartbeats (a silent member aborts the tier with a message naming it) and, once
every worker has said goodbye, tells the servers to shut down.

Fault domains (a :class:`DropRule`): a DC's scheduler drops a silent training worker instead of aborting, as
long as ``GEOMX_MIN_WORKERS_PER_DC`` of the DC's workers remain; the global scheduler drops a silent local server
(its whole DC) as long as ``GEOMX_MIN_DCS`` DCs remain. The others hear ``member_left`` (the servers then
complete their rounds without it, see kvserver.py); the dropped member hears ``abort``, should it run again.
A restarted member that registers with the running tier takes a dropped one's place and rank; the others hear
``member_joined``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from geomx import dropped
from geomx.cluster.liveness import FixedDeadline, MeasuredDeadline
from geomx.cluster.postoffice import describe_node
from geomx.transport.message import Message
from geomx.transport.refusals import RefusalLog
from geomx.cluster.protocol import Field, Op
from geomx.transport.base import Van
from geomx.transport.ids import new_node_id, public_name

log = logging.getLogger("geomx.scheduler")

# a member whose connection closed (its process ended, or, on a direct connection, ZeroMQ's heartbeats went
# unanswered: it is frozen or unreachable; geomx.transport.connection_watch) and that has been silent this long is
# dead: far sooner than the heartbeat timeout, which stays the rule for members behind the WAN emulator
GONE_S = 1.0
CHECK_S = 0.25          # how often liveness is checked
# rejections a scheduler sends at all: each goes to an address the registration names, so without a cap a
# stranger could make it open a socket to every address it lists
MAX_REJECTIONS = 64


@dataclass(frozen=True)
class DropRule:
    """Which members a tier goes on without when they fall silent, and how many of them must remain."""
    kind: str           # the process kind dropped: "worker" (a DC's training workers), "server" (local servers)
    minimum: int
    variable: str       # the setting that gave ``minimum``, named when too few remain
    flag: str
    what: str           # how to count the remaining ones: "worker(s)", "DC(s)"


def worker_rule(minimum: int) -> DropRule:
    """A DC's tier: its training workers."""
    return DropRule("worker", minimum, "GEOMX_MIN_WORKERS_PER_DC", "--min-workers-per-dc", "worker(s)")


def dc_rule(minimum: int) -> DropRule:
    """The global tier (hips): the local servers, each standing for its DC."""
    return DropRule("server", minimum, "GEOMX_MIN_DCS", "--min-dcs", "DC(s)")


class Scheduler:
    def __init__(self, *, tier: str, dc: str, expected: dict[str, int], host: str = "127.0.0.1", port: int,
                 emulator: str | None = None, heartbeat_timeout: float = 10.0, connect_timeout: float = 120.0,
                 bind_host: str | None = None, security=None, metrics=None, van: str = "zmq",
                 van_options: dict | None = None, drop_rule: DropRule | None = None,
                 run_dir: str | None = None, measured_liveness: bool = False, topology: str = "hips") -> None:
        """``topology``: the global tier's workers are the DCs' local servers under hips (named as DCs while the
        tier waits for them), training workers under flat."""
        self.tier, self.dc, self.expected, self.topology = tier, dc, dict(expected), topology
        self.drop_rule = drop_rule          # None: every member is needed (a silent one aborts the tier)
        self.run_dir = run_dir              # where dropped members are recorded for the launcher (geomx.dropped)
        self.heartbeat_timeout, self.connect_timeout = heartbeat_timeout, connect_timeout
        # how long a member may be silent (geomx.cluster.liveness): fixed, or measured from its heartbeats
        self.liveness = MeasuredDeadline(heartbeat_timeout) if measured_liveness else FixedDeadline(heartbeat_timeout)
        self.van = Van.create(van, node_id=new_node_id(f"scheduler-{tier}"), dc=dc, on_message=self._on_message,
                              host=host, port=port, emulator=emulator, bind_host=bind_host, security=security,
                              liveness_probe=True, **(van_options or {}))
        self._lock = threading.Lock()
        self._pending: dict[str, dict] = {}           # node id -> registration
        self._members: dict[str, dict] = {}           # node id -> table entry (after rendezvous)
        self._last_seen: dict[str, float] = {}
        self._left: set[str] = set()
        self._departed: dict[str, str] = {}            # node id -> why it was dropped (fault domain)
        self._refilled: dict[str, str] = {}            # dropped node id -> the restarted member in its place
        self._barriers: dict[tuple[str, int], set[str]] = defaultdict(set)
        self._done = threading.Event()
        self.failure: str | None = None
        self._started = time.monotonic()
        self._metrics = metrics           # geomx.metrics.MetricsWriter or None
        self.refusals = RefusalLog(log)
        self._rejections = 0

    @property
    def address(self) -> str:
        return self.van.address

    def start(self) -> None:
        self.van.start()
        bound = getattr(self.van, "bound_address", self.van.address)
        log.info("scheduler of the %s tier listening on %s%s, expecting %s", self.tier, self.van.address,
                 f" (bound to {bound})" if bound != self.van.address else "", self.expected)

    def serve(self) -> int:
        """Run until every worker left (0) or the tier aborted (1)."""
        self.start()
        try:
            ticks = 0
            while not self._done.wait(CHECK_S):
                self._check_liveness()
                ticks += 1
                if self._metrics is not None and ticks % round(1.0 / CHECK_S) == 0:
                    self._metrics.write("traffic", **self.van.counters())
        finally:
            self.van.stop()
            if self._metrics is not None:
                self._metrics.write("traffic", **self.van.counters())
        return 1 if self.failure else 0

    def stop(self) -> None:
        self._done.set()

    # -------------------------------------------------------------------------------------------------------
    def _send(self, entry: dict, op: str, **fields) -> None:
        # "auth" echoes the token the member registered with: how it knows this message is ours
        self.van.send(entry["addr"], Message(op, fields={Field.TIER: self.tier, Field.AUTH: entry["token"], **fields},
                                             priority=1000), dst_dc=entry["dc"])

    def _reject(self, entry: dict, reason: str, **fields) -> None:
        self.refusals.note(entry["id"], "%s scheduler: registration from %s refused: %s", self.tier,
                           self._label(entry), reason)
        if self._rejections < MAX_REJECTIONS:
            self._rejections += 1
            self._send(entry, Op.REJECT, reason=reason, **fields)

    def _label(self, entry: dict) -> str:
        # a worker's rank in the global tier (flat topology) is not its rank in its DC: name the DC rank
        rank = entry.get("rank") if self.tier.startswith("dc:") or entry["kind"] != "worker" else None
        return describe_node(entry["kind"], rank, entry["dc"], entry["addr"], entry.get("pid", "?"))

    def _on_message(self, msg: Message) -> None:
        with self._lock:
            handler = {Op.REGISTER: self._register, Op.HEARTBEAT: self._heartbeat, Op.BARRIER: self._barrier,
                       Op.BYE: self._bye, Op.ABORT: self._remote_abort}.get(msg.op)
            if handler is None:
                self.refusals.note(msg.src, "%s scheduler: unexpected %r from %r dropped", self.tier, msg.op,
                                   public_name(msg.src))
                return
            if handler != self._register and msg.src not in self._members and msg.src not in self._pending:
                # members' ops count only from the ids this scheduler admitted (ids are unguessable)
                self.refusals.note(msg.src, "%s scheduler: %r from %r refused: not a member of the tier",
                                   self.tier, msg.op, public_name(msg.src))
                return
            if msg.src in self._departed:
                # a dropped worker that runs again (it was frozen) hears abort from us; its own abort, heartbeats
                # and barriers no longer concern the tier
                log.info("%s scheduler: %r from dropped member %r ignored", self.tier, msg.op, public_name(msg.src))
                return
            try:
                handler(msg)
            except Exception as exc:
                self.refusals.note(msg.src, "%s scheduler: bad %r from %r dropped: %s", self.tier, msg.op,
                                   public_name(msg.src), exc)

    def _register(self, msg: Message) -> None:
        entry = {"id": msg.src, "kind": msg[Field.KIND], "tier_role": msg[Field.TIER_ROLE], "dc": msg[Field.DC],
                 "addr": msg[Field.ADDR], "rank": msg.get(Field.RANK), "order": msg.get(Field.ORDER),
                 "pid": msg.get(Field.PID, 0),
                 "declared": msg.get(Field.DECLARED) or {}, "token": msg.get(Field.TOKEN)}
        role = entry["tier_role"]
        if not self.van.is_address(entry["addr"]) or not isinstance(entry["token"], str) \
                or not isinstance(msg.src, str) or not isinstance(entry["dc"], str) \
                or not isinstance(entry["declared"], dict):
            self.refusals.note(msg.src, "%s scheduler: malformed registration from %r (address %r) dropped",
                               self.tier, public_name(msg.src), entry["addr"])
            return
        if msg.src in self._pending or msg.src in self._members:
            self.refusals.note(msg.src, "%s scheduler: second registration from %r dropped", self.tier,
                               public_name(msg.src))
            return
        if msg.get(Field.TIER) != self.tier:
            # answered under the tier name the member used, so that it stops at once naming the cause
            self._reject(entry, f"the scheduler at {self.van.address} serves the {self.tier} tier, not "
                                f"{msg.get(Field.TIER)}: give this role and its scheduler the same GEOMX_DC (or leave "
                                f"it unset on both)", tier=msg.get(Field.TIER))
            return
        if role not in self.expected or self.expected[role] == 0:
            self._reject(entry, f"the {self.tier} tier has no place for a {role}")
            return
        miscount = self._miscounted(entry)
        if self._members:
            # a running tier: a restarted member may take a dropped one's place; a misconfigured one is turned
            # away without disturbing those at work
            if miscount:
                self._reject(entry, miscount)
            else:
                self._rejoin(entry)
            return
        if miscount:
            self._fail(miscount, entry)
            return
        same = [e for e in self._pending.values() if e["tier_role"] == role]
        if len(same) >= self.expected[role]:
            self._reject(entry, f"the {self.tier} tier expects only {self.expected[role]} {role}s")
            return
        rank = entry["rank"]
        if rank is not None and (not 0 <= rank < self.expected[role] or any(e["rank"] == rank for e in same)):
            self._fail(f"{self._label(entry)} asks for {role} rank {rank}, which is out of range or taken in the "
                       f"{self.tier} tier", entry)
            return
        self._pending[entry["id"]] = entry
        if all(sum(e["tier_role"] == r for e in self._pending.values()) == n for r, n in self.expected.items()):
            self._complete()

    def _miscounted(self, entry: dict) -> str | None:
        for name, want in self.expected.items():
            got = entry["declared"].get(f"num_{name}s")
            if got is not None and got != want:
                return (f"{self._label(entry)} counts {got} {name}s in the {self.tier} tier but its scheduler "
                        f"expects {want}: inconsistent topology (check DMLC_NUM_* on every role)")
        return None

    def _rejoin(self, entry: dict) -> None:
        """``entry`` registered with the running tier: give it the place (and rank) of a dropped member of its
        kind and DC (one of its order first), send it the member table and tell the others it joined (the servers
        count it in from the round it starts at, see kvserver.py). Never another DC's place: a DC's local server
        restarted in another's counted that DC's workers in place of its own."""
        vacant = sorted((e for i, e in self._members.items() if i in self._departed and i not in self._refilled
                         and e["kind"] == entry["kind"] and e["tier_role"] == entry["tier_role"]
                         and e["dc"] == entry["dc"]),
                        key=lambda e: (e.get("order") != entry.get("order"), e["rank"]))
        if entry["rank"] is not None:
            vacant = [e for e in vacant if e["rank"] == entry["rank"]]
        if self.drop_rule is None or not vacant:
            wanted = f" with rank {entry['rank']}" if entry["rank"] is not None else ""
            self._reject(entry, f"the {self.tier} tier is already complete: no dropped {entry['kind']}{wanted} of DC "
                                f"{entry['dc']} whose place {self._label(entry)} could take")
            return
        place = vacant[0]
        entry["rank"] = place["rank"]
        self._refilled[place["id"]] = entry["id"]
        self._members[entry["id"]] = entry
        self._last_seen[entry["id"]] = time.monotonic()
        live = [e for i, e in self._members.items() if i not in self._departed and i not in self._left]
        self._send(entry, Op.TABLE, members=[_table_entry(e) for e in live])
        for e in live:
            if e is not entry:
                self._send(e, Op.MEMBER_JOINED, member=_table_entry(entry), replaces=place["id"])
        log.warning("%s tier: %s rejoined in the place of the dropped %s", self.tier, self._label(entry),
                    self._label(place))
        if self._metrics is not None:
            self._metrics.write("member_joined", node=self._label(entry), replaces=self._label(place))

    def _complete(self) -> None:
        for role in self.expected:
            assign_ranks([e for e in self._pending.values() if e["tier_role"] == role])
        miscounted = self._count_all_workers()
        if miscounted:
            self._fail(*miscounted, members=list(self._pending.values()))
            return
        now = time.monotonic()
        self._members = dict(self._pending)
        table = [_table_entry(e) for e in self._members.values()]
        for e in self._members.values():
            self._last_seen[e["id"]] = now
            self._send(e, Op.TABLE, members=table)
        log.info("%s tier complete: %s", self.tier, ", ".join(self._label(e) for e in self._members.values()))

    def _count_all_workers(self) -> tuple[str, dict] | None:
        """Every role that states the world-wide worker count must agree with what actually registered: the
        problem and the first member that does not."""
        entries = list(self._pending.values())
        dc_sizes = [e["declared"]["dc_workers"] for e in entries if "dc_workers" in e["declared"]]
        flat_workers = [e for e in entries if e["kind"] == "worker" and e["tier_role"] == "worker"]
        total = sum(dc_sizes) if dc_sizes else (len(flat_workers) if flat_workers else None)
        if total is None:
            return None
        for e in entries:
            said = e["declared"].get("num_all_workers")
            if said is not None and said != total:
                return (f"{self._label(e)} says DMLC_NUM_ALL_WORKER={said} but the DCs that registered with the "
                        f"{self.tier} scheduler have {total} workers in all: inconsistent topology"), e
        return None

    def _heartbeat(self, msg: Message) -> None:
        entry = self._members.get(msg.src)
        if entry is None:       # registered, table not sent yet
            return
        self._last_seen[msg.src] = now = time.monotonic()
        self.liveness.heard(msg.src, now)
        self._send(entry, Op.HEARTBEAT_ACK)

    def _barrier(self, msg: Message) -> None:
        group, seq = msg[Field.GROUP], int(msg[Field.SEQ])
        if msg.src not in self._members or group not in ("all", *self.expected):
            raise ValueError(f"barrier of group {group!r} before the member table or of no group of the tier")
        self._barriers[(group, seq)].add(msg.src)
        self._release_barriers()

    def _release_barriers(self) -> None:
        """Release every barrier that all its members (those not dropped, nor gone) have entered."""
        for (group, seq), arrived in list(self._barriers.items()):
            members = [e for i, e in self._members.items() if i not in self._departed and i not in self._left
                       and (group == "all" or e["tier_role"] == group)]
            if all(e["id"] in arrived for e in members):
                for e in members:
                    self._send(e, Op.BARRIER_DONE, seq=seq)
                del self._barriers[(group, seq)]

    def _bye(self, msg: Message) -> None:
        if msg.src not in self._members:
            return
        self._left.add(msg.src)
        if self._shut_down_when_workers_left():
            return
        entry = self._members[msg.src]
        if entry["tier_role"] == "worker" and entry["kind"] != "master" and msg.src not in self._departed:
            # a worker that finished its steps while others still train (uneven data): they go on without it, as
            # without a dropped one, instead of waiting for its next push until GEOMX_TIMEOUT (DDP's Join). It
            # left after its last round completed, so no round it took part in misses it
            reason = f"{self._label(entry)} finished its training and left"
            for i, e in self._members.items():
                if i not in self._left and i not in self._departed:
                    self._send(e, Op.MEMBER_LEFT, node=entry["id"], reason=reason, finished=True)
        self._release_barriers()

    def _shut_down_when_workers_left(self) -> bool:
        workers = [i for i, e in self._members.items() if e["tier_role"] == "worker" and i not in self._departed]
        if not all(i in self._left for i in workers):
            return False
        for i, e in self._members.items():
            if i not in self._left and i not in self._departed:
                self._send(e, Op.SHUTDOWN)
        log.info("%s tier: every worker left; shutting down", self.tier)
        self._done.set()
        return True

    def _remote_abort(self, msg: Message) -> None:
        reason = str(msg.get(Field.REASON, "aborted"))
        entry = self._members.get(msg.src)
        # a member the tier may go on without (a local server whose DC stopped) drops out instead, unless what
        # stopped it was a tier that never completed: a misconfiguration, which must stop the run
        fatal, began_here = msg.get(Field.FATAL) is True, msg.get(Field.RELAYED) is not True
        if entry is not None and not fatal and self._cannot_drop(entry) is None:
            self._drop(entry, f"{self._label(entry)} stopped: {reason}", own_abort=began_here)
            return
        self._fail(reason, entry if began_here else None, skip=msg.src, fatal=fatal, notify_culprit=False)

    def _fail(self, reason: str, culprit: dict | None, *, skip: str | None = None,
              members: list[dict] | None = None, fatal: bool = False, notify_culprit: bool = True) -> None:
        """Abort every member. ``culprit``: the member the failure began with, recorded for the launcher to name
        (geomx.dropped) before the abort goes on. ``fatal`` (a member's own abort was): no tier may go on without
        them, as when this tier never completed."""
        if self.failure:
            return
        self.failure = reason
        log.error("%s scheduler: %s", self.tier, reason)
        if culprit is not None:
            dropped.record(self.run_dir, tier=self.tier, pid=culprit["pid"], member=self._label(culprit),
                           reason=reason, file=dropped.ABORTED_FILE)
        targets = members if members is not None else list(self._members.values() or self._pending.values())
        if notify_culprit and culprit is not None and culprit["id"] not in {t["id"] for t in targets}:
            targets.append(culprit)
        flags = {Field.FATAL: True} if fatal or not self._members else {}
        for e in targets:
            if e["id"] != skip and e["id"] not in self._left:
                self._send(e, Op.ABORT, reason=reason, **flags)
        self._done.set()

    def _check_liveness(self) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._members:
                if now - self._started > self.connect_timeout:
                    self._fail(f"the {self.tier} tier is incomplete after {self.connect_timeout:g} s: still waiting "
                               f"for {self._missing()}", None)
                return
            for node_id, seen in list(self._last_seen.items()):
                if node_id in self._left or node_id in self._departed:
                    continue
                entry = self._members[node_id]
                down = self.van.down_since(entry["addr"])
                if down is not None and now - down > GONE_S and now - seen > GONE_S:
                    reason = (f"{self._label(entry)} lost its connection {now - down:.1f} s ago and has been "
                              f"silent since (its process ended, or it froze)")
                elif now - max(seen, self.van.last_stall_end) > (
                        deadline := self.liveness.deadline(node_id, running=self.van.answering(entry["addr"]))):
                    # (a stall of our own receive thread left its heartbeats unread: no evidence against it; a
                    # member whose ZeroMQ still answers runs, and may be busy: it gets the longest deadline)
                    reason = (f"{self._label(entry)} stopped sending heartbeats {now - seen:.1f} s ago (it died, "
                              f"is frozen or its host is unreachable; deadline {deadline:.2f} s, "
                              f"{self.liveness.describe()})")
                else:
                    continue
                problem = self._cannot_drop(entry)
                if problem is None:
                    self._drop(entry, reason)
                    continue
                self._fail(reason + problem, None, skip=node_id)
                return

    def _missing(self) -> str:
        """What the tier still waits for at start-up, in the user's words, with who did register: the global
        tier's workers (hips) are the DCs' local servers, named by DC."""
        waiting = []
        for role, n in self.expected.items():
            came = [e for e in self._pending.values() if e["tier_role"] == role]
            if len(came) >= n:
                continue
            if self.tier == "global" and role == "worker" and self.topology == "hips":
                dcs = sorted(e["dc"] for e in came)
                waiting.append(f"{n - len(came)} of {n} DCs' local servers (registered: "
                               f"{'DC ' + ', '.join(dcs) if dcs else 'none'})")
                continue
            what = {("global", "server"): "global server(s)"}.get((self.tier, role), f"{role}(s)")
            came_names = ", ".join(self._label(e) for e in came[:4]) + (f" and {len(came) - 4} more" if len(came) > 4
                                                                        else "")
            waiting.append(f"{n - len(came)} of {n} {what} (registered: {came_names or 'none'})")
            if self.tier != "global" and role == "server":
                # a tier's servers (a DC's local server, the central party's global servers) register here only
                # once the global tier is complete: one that runs may be waiting there, unseen from here
                waiting[-1] += (" - a server registers here only after the global tier is complete: if it runs, "
                                "it is waiting for the global tier, whose scheduler names what is missing there")
        return "; ".join(waiting)

    def _droppable_remaining(self, but: str) -> int:
        rule = self.drop_rule
        return sum(1 for i, e in self._members.items() if e["kind"] == rule.kind and e["tier_role"] == "worker"
                   and i != but and i not in self._departed and i not in self._left)

    def _cannot_drop(self, entry: dict) -> str | None:
        """None when the tier may go on without ``entry``; else what to add to the failure's reason (empty where
        the tier is no fault domain or ``entry`` is not of the kind it drops)."""
        rule = self.drop_rule
        if rule is None or entry["kind"] != rule.kind or entry["tier_role"] != "worker":
            return ""
        remaining = self._droppable_remaining(entry["id"])
        if remaining < rule.minimum:
            return (f"; the {self.tier} tier would go on with {remaining} {rule.what}, fewer than {rule.variable}="
                    f"{rule.minimum} (geomx launch {rule.flag})")
        return None

    def _drop(self, entry: dict, reason: str, *, own_abort: bool = False) -> None:
        """Go on without a silent member, or one that aborted (``own_abort``: on an error of its own, not one it
        passed on): tell the others, release what waited for it."""
        self._departed[entry["id"]] = reason
        remaining = [e for i, e in self._members.items() if i not in self._departed and i not in self._left]
        left = self._droppable_remaining(entry["id"])
        log.warning("%s tier: %s; it goes on with %d %s", self.tier, reason, left, self.drop_rule.what)
        if self._metrics is not None:
            self._metrics.write("member_left", node=self._label(entry), reason=reason, remaining=left)
        dropped.record(self.run_dir, tier=self.tier, pid=entry["pid"], member=self._label(entry), reason=reason,
                       own_abort=own_abort)
        self._send(entry, Op.ABORT, reason=f"dropped from the {self.tier} tier: {reason}")
        for e in remaining:
            self._send(e, Op.MEMBER_LEFT, node=entry["id"], reason=reason)
        self._release_barriers()
        self._shut_down_when_workers_left()


def _table_entry(e: dict) -> dict:
    """What every member learns of ``e``. Weight: the training workers a member stands for (a local server: its
    DC's), which weighs its pushes when a tier goes on without some members (geomx.cluster.global_server)."""
    return {**{k: e[k] for k in ("id", "kind", "tier_role", "dc", "rank", "addr", "pid")},
            "weight": _weight(e["declared"])}


def _weight(declared: dict) -> int:
    n = declared.get("dc_workers", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def assign_ranks(group: list[dict]) -> None:
    """Rank the registrations of one role that asked for none, in the ranks no other took: by DC, then by their
    ``order`` (a flat worker's rank in its DC), then by address. A member's place in its tier ("worker 1 of DC
    a") seeds its codec streams, so it must not hang on the ports a run happened to get: ranked by address
    alone, a DC's local server came first in the global tier in about half the runs, and a sampled codec's runs
    did not repeat."""
    taken = {e["rank"] for e in group if e["rank"] is not None}
    free = iter(r for r in range(len(group)) if r not in taken)

    def place(e: dict) -> tuple:
        order = e.get("order")
        return e["dc"], not isinstance(order, int), order if isinstance(order, int) else 0, _host_port(e["addr"])

    for e in sorted((e for e in group if e["rank"] is None), key=place):
        e["rank"] = next(free)


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port) if port.isdigit() else 0
