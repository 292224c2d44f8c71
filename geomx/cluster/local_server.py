"""Local server: one per DC. Sums its workers' pushes, then acts as a worker of the global tier.

Per round of a key: when every worker of the DC has pushed, the DC sum crosses the WAN in one fused
push-and-pull to the key's global server (one WAN round trip, where GeoMX spends two: push, ack, pull,
reply); the reply becomes the DC's value and answers the workers' pulls. Rounds may overlap (workers can
push round n+1 before round n returns); results are applied in round order. That is the ``wait`` round
policy (:class:`WaitForWan`); the others, MixedSync ``overlap`` (wan_overlap.py), which answers the workers
without waiting for the WAN, and GeoMX's HFA server logic (hfa_rounds.py), are registered the same way
(round_policies.py), and the global servers name the one a deployment runs.

A DC is a fault domain: when its scheduler drops a silent worker (``member_left``), the rounds that waited for
it complete with the workers that pushed, and the DC's sum is scaled to its configured size (the DC's mean
stands in for the missing gradients), so the global round weighs every DC as before and nothing upstream
changes. A restarted worker may take the dropped one's place (``member_joined``): it starts from the DC's
current model and counts in the rounds after those under way (kvserver.KVServer.start_joiner).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from geomx.cluster import dc_rounds
from geomx.cluster.client import Handle, KVClient, check_key
from geomx.cluster.compressed import ServerWire
from geomx.cluster.hfa_rounds import HfaKeyState
from geomx.cluster.round_policies import ROUND_POLICIES, register_round_policy
from geomx.cluster.kvserver import KeyState, KVServer, Refused, Round, init_layout
from geomx.cluster.postoffice import NodeInfo, Postoffice, Tier
from geomx.cluster.protocol import Command, Field, Op
from geomx.cluster.wan_overlap import OverlapState
from geomx.compression import CompressionPolicy
from geomx.config import NodeConfig
from geomx.errors import GeomxError, KVError, PeerLostError
from geomx.profiles import CENTRAL_DC
from geomx.transport.message import Message

log = logging.getLogger("geomx.local_server")


@dataclass
class UpstreamRounds:
    """A key's WAN rounds at a local server: replies arrive in any order and are applied in round order."""
    applied_rounds: int = 0
    done: dict[int, tuple[np.ndarray, list[str]]] = field(default_factory=dict)   # round -> (value, contributors)

    def state_dict(self) -> dict:
        return {"applied_rounds": self.applied_rounds,
                "done": {n: {"value": v, "contributors": list(c)} for n, (v, c) in self.done.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.applied_rounds = state["applied_rounds"]
        self.done = {int(n): (np.array(d["value"]), list(d["contributors"])) for n, d in state["done"].items()}


class LocalServer(KVServer):
    def __init__(self, po: Postoffice) -> None:
        super().__init__(po)
        self.dc_tier: Tier | None = None
        self.global_tier: Tier | None = None
        self.upstream: KVClient | None = None
        self._saved_upstream: dict | None = None    # the upstream client's saved state, until it exists
        self.dc_rounds = dc_rounds.DCRounds(self)
        # one instance of each registered round policy (round_policies.py); the global servers name the one
        # this deployment runs
        self.round_policies = {name: cls(self) for name, cls in ROUND_POLICIES.items()}

    def attach_global(self, tier: Tier) -> None:
        self.global_tier = tier
        self.upstream = KVClient(self.po, tier)
        if self._saved_upstream is not None:        # state loaded before this server joined the global tier
            self.upstream.load_state_dict(self._saved_upstream)
            self._saved_upstream = None

    def attach_dc(self, tier: Tier) -> None:
        self.dc_tier = tier
        self.round_weights = {m.id: m.weight for m in tier.workers()}
        self.add_clients(tier.members)

    def on_member_left(self, tier: Tier, member: NodeInfo, reason: str, *, finished: bool = False) -> None:
        """A worker of this DC was dropped, or finished its training before the others: its held requests go,
        the rounds that waited only for it complete."""
        if tier is not self.dc_tier:
            return
        left = len(tier.workers())
        log.log(logging.INFO if finished else logging.WARNING, "DC %s goes on with %d of %d workers without %s%s: "
                "rounds it misses count the DC's mean in its place", self.po.cfg.dc, left, self.po.cfg.num_workers,
                member.label, " (it finished its training)" if finished else "")
        self.drop_client(member)
        self.dc_rounds.drop(member.id)

    def on_member_joined(self, tier: Tier, member: NodeInfo, replaces: str) -> None:
        """A restarted worker took a dropped one's place in this DC: it counts in rounds once it asks for the
        model (KVServer.start_joiner)."""
        if tier is self.dc_tier:
            self.admit_client(member, replaces)

    def round_clients(self) -> list[NodeInfo]:
        return self.dc_tier.workers()

    def dispatch(self, msg: Message) -> None:
        if msg.op == Op.REPLY and self.upstream is not None and msg.src not in self.clients:
            self.upstream.handle_reply(msg)
        else:
            self.handle(msg)

    # init: the master worker's value, fetched once per key from the global tier ----------------------------
    def on_init(self, msg: Message, client: NodeInfo) -> None:
        key, (shape, dtype) = msg.get(Field.KEY), init_layout(msg)
        try:
            check_key(key)
        except KVError as exc:
            raise Refused(str(exc)) from None
        st = self.keys.get(key)
        if st is None:
            st = self.keys[key] = KeyState(key, shape, dtype)
            st.held_inits.append(msg)
            self.upstream.init_layout(key, shape, dtype).add_done_callback(lambda h: self._initialized(st, h))
            return
        self.check_layout(st, shape, dtype, "init")
        if st.value is None:
            st.held_inits.append(msg)
        else:
            self.reply_init(msg, st)

    def _initialized(self, st: KeyState, h: Handle) -> None:
        held, st.held_inits = st.held_inits, []
        if h.error is None:
            value, info = h.result
            if tuple(value.shape) != tuple(st.shape) or value.dtype != st.dtype:
                h._error = KVError(f"key {st.key!r}: DC {self.po.cfg.dc} initializes it with {st.describe()} but "
                                   f"the master worker with shape {tuple(value.shape)} {value.dtype.name}")
            else:
                self.info.update(info)
                self._configure_compression()
                st.value = value
                self._join_rounds_under_way(st)
                for msg in held:
                    self.reply_init(msg, st)
                return
        del self.keys[st.key]   # a later init may try again
        for msg in held:
            self.reply(msg, error=str(h.error))

    def _join_rounds_under_way(self, st: KeyState) -> None:
        """This DC rejoined a running job (a restarted local server): the global servers count it in from the
        round after those under way (their init reply said which), so its own rounds of the key continue from
        there, and its workers start at that step (KVServer.reply_init tells them)."""
        base = self.upstream.joined.get(st.key, 0)
        if not base:
            return
        st.first_round = base
        st.upstream = UpstreamRounds(applied_rounds=base)
        for worker in self.dc_tier.workers():
            self.joined_at.setdefault(worker.id, base)

    # rounds -------------------------------------------------------------------------------------------------
    def _configure_compression(self) -> None:
        """The master worker's compression setting arrives with the first init reply, before any push."""
        wire = self.info.get("compression")
        if wire is not None and self.wire is None:
            policy = CompressionPolicy.from_wire(wire)
            self.wire = ServerWire(policy, "lan", weights=bool(self.info.get("server_optimizer")),
                                   per_client=False, salt=self.po.cfg.label, place_of=self.client_place)

    def on_round(self, st: KeyState, number: int, rnd: Round) -> None:
        self.stand_in_for_departed(rnd)
        name = self.info.get("round_policy", "wait")
        policy = self.round_policies.get(name)
        if policy is None:
            raise GeomxError(f"the global servers ask for round policy {name!r}, which this local server does not "
                             f"have ({', '.join(sorted(self.round_policies))}): is it the same geomx version?")
        policy.on_round(st, number, rnd)

    def reply_notices(self) -> dict:
        """The latest checkpoint round the global servers declared, passed on to the workers (checkpoint_clock.py
        says why the latest is enough)."""
        latest = self.upstream.latest_checkpoint_round if self.upstream is not None else 0
        return {Field.CHECKPOINT_ROUND: latest} if latest else {}

    # saved state ----------------------------------------------------------------------------------------------
    def config_state(self) -> dict:
        return {"dc_rounds": self.dc_rounds.state_dict(),
                "upstream": self.upstream.state_dict() if self.upstream is not None else self._saved_upstream}

    def load_config_state(self, config: dict) -> None:
        self._configure_compression()
        self.dc_rounds.load_state_dict(config["dc_rounds"])
        saved = config.get("upstream")      # which global server owns each key, the pushes sent, the streams
        if saved is not None and self.upstream is not None:
            self.upstream.load_state_dict(saved)
        else:
            self._saved_upstream = saved

    def load_owned_state(self, st, saved):
        super().load_owned_state(st, saved)
        if saved["upstream"] is not None:
            st.upstream = UpstreamRounds()
            st.upstream.load_state_dict(saved["upstream"])
        if saved["overlap"] is not None:
            st.overlap = OverlapState()
            st.overlap.load_state_dict(saved["overlap"])
        if saved.get("hfa") is not None:
            st.hfa = HfaKeyState()
            st.hfa.load_state_dict(saved["hfa"])

    def handle_other(self, msg: Message, client: NodeInfo) -> None:
        if msg.op != Op.DC_PUSHPULL:
            super().handle_other(msg, client)
            return
        try:
            self.dc_rounds.on_push(msg, client)
        except Refused as exc:
            self.reply(msg, error=str(exc))

    # commands ---------------------------------------------------------------------------------------------
    def on_command(self, msg: Message, client: NodeInfo) -> None:
        if msg.get(Field.NAME) == Command.GLOBAL_BARRIER:
            # the DC's workers already met in their own barrier; the local servers meet for their DCs
            self.global_tier.barrier_async("worker", lambda: self.reply(msg))
        else:
            super().on_command(msg, client)


@register_round_policy("wait")
class WaitForWan:
    """Every DC round crosses the WAN as one fused push-and-pull; the reply answers the DC. Replies may arrive
    in any order and are applied in round order (``st.upstream``, :class:`UpstreamRounds`)."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server

    def on_round(self, st: KeyState, number: int, rnd: Round) -> None:
        # the fp32 sum: the client sends it in the key's dtype (a 16-bit key's sum as the mean, see dense_push).
        # It stands for the DC's configured workers, also when a dropped one is missing (stand_in_for_departed):
        # the count must not change from round to round (see wan_overlap.py)
        h = self.server.upstream.pushpull(st.key, rnd.total, priority=rnd.priority,
                                          count=self.server.po.cfg.num_workers)
        contributors = rnd.contributors     # not the round: its sum is freed once sent, not at the reply
        h.add_done_callback(lambda h: self._round_done(st, number, contributors, h))

    def _round_done(self, st: KeyState, number: int, contributors: list[str], h: Handle) -> None:
        if h.error is not None:
            self.server.fail_waiting(st, f"the global round {number} of key {st.key!r} failed: {h.error}",
                                     lost=isinstance(h.error, PeerLostError))
            return
        rounds = st.upstream
        if rounds is None:
            rounds = st.upstream = UpstreamRounds()
        rounds.done[number] = (h.result, contributors)
        while rounds.applied_rounds + 1 in rounds.done:
            rounds.applied_rounds += 1
            value, who = rounds.done.pop(rounds.applied_rounds)
            self.server.set_value(st, value, who)


def start_local_server(cfg: NodeConfig, done: threading.Event, *, node_id: str | None = None) -> LocalServer:
    """A local server joined to the global tier and its DC's, serving on its van's receive thread; ``done`` is
    set when it should stop. The caller closes ``server.po``."""
    po = Postoffice(cfg, node_id=node_id)
    server = LocalServer(po)
    po.on_data = server.dispatch
    po.add_member_left_listener(server.on_member_left)
    po.add_member_joined_listener(server.on_member_joined)
    po.add_abort_listener(lambda reason: done.set())
    po.add_shutdown_listener(lambda tier: done.set() if tier.name.startswith("dc:") else None)
    po.start()
    try:
        po.join("global", cfg.global_scheduler, CENTRAL_DC, "worker",
                {"num_global_servers": cfg.num_global_servers, "num_global_workers": cfg.num_global_workers,
                 "dc_workers": cfg.num_workers}, on_table=server.attach_global)
        po.join(cfg.local_tier, cfg.scheduler, cfg.dc, "server",
                {"num_workers": cfg.num_workers, "num_servers": cfg.num_servers}, rank=0,
                on_table=server.attach_dc)
    except BaseException:
        po.close()
        raise
    log.info("local server of DC %s ready at %s", cfg.dc, po.van.address)
    return server


def run_local_server(cfg: NodeConfig) -> int:
    done = threading.Event()
    server = start_local_server(cfg, done)
    try:
        done.wait()
    finally:
        server.po.close()
    return 1 if server.po.aborted else 0
