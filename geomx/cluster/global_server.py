"""Global server: aggregates the DC aggregates (or, in the flat topology, every worker's gradient).

It is a server in two tiers: the global tier, whose workers are the local servers (flat: the workers), and
the central party's tier, whose worker is the master worker that initializes and configures every key.
"""
from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path

import numpy as np

from geomx.cluster.global_update import (GradientRelay, RoundGradient, ServerOptimizer, UpdatePolicy,
                                         resolve_optimizer)
from geomx.cluster.compressed import ServerWire
from geomx.cluster.kvserver import KeyState, KVServer, Refused, accumulator_dtype, init_layout
from geomx.cluster.postoffice import NodeInfo, Postoffice, Tier
from geomx.cluster.round_policies import round_policy_name
from geomx.cluster.checkpoint_clock import CheckpointClock
from geomx.cluster.server_checkpoint import ServerCheckpoints
from geomx.cluster.protocol import Command, Field, Op, is_round
from geomx.compat import conflict
from geomx.compression import CompressionPolicy
from geomx.config import MIXEDSYNC, MODES, REDUCTIONS, NodeConfig, checkpoint_directory, round_divisor
from geomx.errors import ConfigError
from geomx.optim.schedules import parse_schedule
from geomx.profiles import CENTRAL_DC
from geomx.sync.settings import rounds_are_steps
from geomx.transport.message import Message

log = logging.getLogger("geomx.global_server")

_ANNOUNCE_PRIORITY = 1000      # checkpoint_at: before any push waiting beside it (gradients go below 0)
_TORCH_IMPORT_DEADLINE_S = 120.0  # a loaded 2-core machine imports torch in seconds; a stuck import must not hang us


class GlobalServer(KVServer):
    def __init__(self, po: Postoffice, num_all_workers: int) -> None:
        super().__init__(po)
        self.num_all_workers = num_all_workers
        self.rank = -1
        self.global_tier: Tier | None = None
        self.mode: str = "dist_sync"
        self.mixedsync: str = "wait"               # dist_async: do local servers wait for the WAN (config.MIXEDSYNC)
        self.reduction: str = "sum"                # a round's sum or mean (config.REDUCTIONS)
        self.hfa_k2: int | None = None             # GeoMX's HFA server logic at the local servers (hfa_rounds.py)
        # a step is one round of every key (FSA, P3), so a round names a step: the environment's algorithm until
        # the master worker's mode says (its DistributedOptimizer's, which may be chosen in code)
        self.rounds_are_steps = rounds_are_steps()
        self.optimizer: tuple | None = None      # (class, kwargs)
        self.optimizer_name: str | None = None     # as the master worker named it
        self.lr_schedule = None                     # the optimizer's (geomx.optim.schedules), if any
        self.compression: CompressionPolicy | None = None
        self.policy: UpdatePolicy | None = None
        self.directory: dict = {}                  # key -> owning global server rank
        self.held_inits: dict = {}                 # key -> init requests waiting for the master's init
        self.tables_pending = 2                    # the global tier and the central party's tier
        self.checkpoints: ServerCheckpoints | None = None   # with a synchronous server optimizer (resume)

    def attach(self, tier: Tier) -> None:
        if tier.name == "global":
            self.global_tier, self.rank = tier, tier.me.rank
            self.round_weights = {m.id: m.weight for m in tier.workers()}   # a local server: its DC's workers
        self.add_clients(tier.members)

    def round_clients(self) -> list[NodeInfo]:
        return self.global_tier.workers()

    def on_member_joined(self, tier: Tier, member: NodeInfo, replaces: str) -> None:
        """A dropped DC is back (its restarted local server took the old one's place): it counts in rounds once
        it asks for the model (KVServer.start_joiner)."""
        if tier is self.global_tier:
            self.admit_client(member, replaces)

    def on_member_left(self, tier: Tier, member: NodeInfo, reason: str, *, finished: bool = False) -> None:
        """A DC dropped out of the global tier (its local server fell silent), or its workers finished their
        training before the others: rounds go on without it."""
        if tier is not self.global_tier:
            return
        log.log(logging.INFO if finished else logging.WARNING, "global server %d goes on with %d of %d DCs without "
                "DC %s%s: rounds it misses weigh the others' mean in its place", self.rank, len(tier.workers()),
                len(self.round_weights), member.dc, " (it finished its training)" if finished else "")
        self.drop_client(member)

    # configuration from the master worker ------------------------------------------------------------------
    def on_command(self, msg: Message, client: NodeInfo) -> None:
        name, args = msg.get(Field.NAME), msg.get(Field.ARGS) or {}
        if client.kind != "master":
            raise Refused(f"only the master worker configures the global servers ({client.label} sent {name!r})")
        if self.policy is not None:
            self._reconfigure(msg, name, args)
            return
        if name == Command.SET_MODE:
            if args.get("mode") not in MODES:
                raise Refused(f"unknown kvstore mode {args.get('mode')!r}; modes are {', '.join(MODES)}")
            mixedsync = args.get("mixedsync", "wait")
            if mixedsync not in MIXEDSYNC:
                raise Refused(f"unknown MixedSync variant {mixedsync!r}; variants are {', '.join(MIXEDSYNC)}")
            reduction = args.get("reduction", "sum")
            if reduction not in REDUCTIONS:
                raise Refused(f"unknown reduction {reduction!r}; reductions are {', '.join(REDUCTIONS)}")
            hfa_k2 = args.get("hfa_k2")
            if hfa_k2 is not None and (not isinstance(hfa_k2, int) or isinstance(hfa_k2, bool) or hfa_k2 < 1):
                raise Refused(f"HFA's K2 must be a whole number >= 1, got {hfa_k2!r}")
            steps = args.get("rounds_are_steps", True)
            if not isinstance(steps, bool):
                raise Refused(f"rounds_are_steps must be true or false, got {steps!r}")
            if hfa_k2 is not None and reduction != "sum":
                raise Refused("GeoMX's HFA server logic sums the DCs' shares of the model change: it needs the sum "
                              "reduction, not the mean")
            problem = conflict(mode=args["mode"], mixedsync=mixedsync, server_optimizer=self.optimizer is not None,
                               sync="hfa" if hfa_k2 else None,
                               checkpoint_seconds=self.po.cfg.checkpoint_seconds or None)
            if problem:
                raise Refused(problem)
            self.mode, self.mixedsync, self.reduction, self.hfa_k2 = args["mode"], mixedsync, reduction, hfa_k2
            self.rounds_are_steps = steps
        elif name == Command.SET_OPTIMIZER:
            self._set_optimizer(args)
        elif name == Command.SET_COMPRESSION:
            try:
                self.compression = CompressionPolicy.from_wire(args.get("policy"))
                bound = self.po.cfg.size_lower_bound
                if bound is not None:   # GeoMX sets the size bound on its servers: theirs decides for everyone
                    self.compression = CompressionPolicy.from_wire({**self.compression.to_wire(),
                                                                    "size_lower_bound": bound})
            except ConfigError as exc:
                raise Refused(str(exc)) from None
        else:
            raise Refused(f"unknown command {name!r}")
        log.info("global server %d: %s %s", self.rank, name, args)
        self.reply(msg)

    def _set_optimizer(self, args: dict) -> None:
        problem = conflict(mode=self.mode, mixedsync=self.mixedsync, server_optimizer=True,
                           sync="hfa" if self.hfa_k2 else None)
        if problem:
            raise Refused(problem)
        kwargs = dict(args.get("kwargs") or {})
        self.optimizer = (resolve_optimizer(str(args.get("optimizer")), kwargs, self.po.cfg.optimizer_modules),
                          kwargs)
        self.optimizer_name = str(args.get("optimizer"))
        self.lr_schedule = _schedule(args.get("lr_schedule"))

    def _reconfigure(self, msg: Message, name: str, args: dict) -> None:
        """A command after the first kv.init. MXNet's own order, init then set_optimizer, is served while no key
        has seen a push: every key's value is still its initial weights, which the optimizer starts from."""
        pushed = [st.key for st in self.keys.values() if st.pushes]
        if name != Command.SET_OPTIMIZER or self.optimizer is not None or self.compression is not None or pushed:
            raise Refused(f"{name} must come before the first kv.init (keys are already initialized"
                          + (f"; key {pushed[0]!r} has been pushed" if pushed else "") + ")")
        self._set_optimizer(args)
        self._configure()
        for st in self.keys.values():
            self.policy.init_key(st)
            if self.checkpoints is not None:     # made afresh by _configure: resumed keys count on, state and all
                self._resume_key(st)
        log.info("global server %d: %s %s after %d key(s) were initialized", self.rank, name, args, len(self.keys))
        self.reply(msg)

    def _choose_policy(self) -> UpdatePolicy:
        sync = self.mode == "dist_sync"
        divisor = round_divisor(self.reduction, self.num_all_workers)
        if self.optimizer is not None:
            return ServerOptimizer(divisor, *self.optimizer, synchronous=sync, lr_schedule=self.lr_schedule)
        if sync:
            return RoundGradient(divisor)
        # overlap: a local server hands its DC's own gradients to its workers itself, so reads carry the others'
        return GradientRelay(divisor, [w.id for w in self.global_tier.workers()],
                             echo_own=self.mixedsync != "overlap")

    def _configure(self) -> None:
        """At the first key: the configuration is final; choose the update policy and the wire."""
        self.policy = self._choose_policy()
        self.info = {"mode": self.mode, "mixedsync": self.mixedsync, "reduction": self.reduction,
                     "hfa_k2": self.hfa_k2,
                     "round_policy": round_policy_name(mixedsync=self.mixedsync, hfa_k2=self.hfa_k2),
                     "server_optimizer": self.optimizer is not None,
                     "lr_schedule": self.lr_schedule.to_spec() if self.lr_schedule is not None else None,
                     "num_all_workers": self.num_all_workers,
                     "compression": self.compression.to_wire() if self.compression else None}
        if self.compression is not None:
            self.wire = ServerWire(self.compression, "wan", weights=self.optimizer is not None,
                                   per_client=not self.policy.synchronous, salt=self.po.cfg.label,
                                   place_of=self.client_place)
        cfg = self.po.cfg
        if self.policy.synchronous and (cfg.checkpoint_every or cfg.checkpoint_seconds or cfg.resume_from):
            # the model (a server optimizer) or the reply codecs' residuals live here: checkpoint them, and resume
            # from a checkpoint (server_checkpoint.py); rank 0 keeps the time (checkpoint_clock.py). Residuals
            # only where a round is a step (FSA, P3): under HFA or DiLoCo a key's round N is no step N, so a
            # checkpoint of it would name no step the workers saved; their resumed streams start afresh
            clock = CheckpointClock(cfg.checkpoint_seconds) if cfg.checkpoint_seconds and self.rank == 0 else None
            self.checkpoints = ServerCheckpoints(
                rank=self.rank, every=cfg.checkpoint_every, directory=checkpoint_directory(cfg),
                saves=self.optimizer is not None or (self.wire is not None and self.rounds_are_steps),
                holds_model=self.optimizer is not None, clock=clock,
                resume_from=Path(cfg.resume_from) if cfg.resume_from else None, resume_round=cfg.resume_step)

    # saved state ----------------------------------------------------------------------------------------------
    def config_state(self) -> dict:
        return {"num_all_workers": self.num_all_workers, "mode": self.mode, "mixedsync": self.mixedsync,
                "reduction": self.reduction, "hfa_k2": self.hfa_k2, "rounds_are_steps": self.rounds_are_steps,
                "optimizer": None if self.optimizer is None else [self.optimizer_name, self.optimizer[1]],
                "lr_schedule": self.lr_schedule.to_spec() if self.lr_schedule is not None else None,
                "compression": self.compression.to_wire() if self.compression is not None else None,
                "configured": self.policy is not None, "directory": dict(self.directory)}

    def load_config_state(self, config: dict) -> None:
        if config["num_all_workers"] != self.num_all_workers:
            raise ConfigError(f"the saved global server served {config['num_all_workers']} workers, this one "
                              f"{self.num_all_workers}")
        self.mode, self.mixedsync = config["mode"], config["mixedsync"]
        self.reduction = config.get("reduction", "mean")     # saved before reductions existed: the mean
        self.hfa_k2 = config.get("hfa_k2")
        self.rounds_are_steps = config.get("rounds_are_steps", True)
        if config["optimizer"] is not None:
            name, kwargs = config["optimizer"]
            try:
                self.optimizer, self.optimizer_name = (resolve_optimizer(name, dict(kwargs),
                                                                         self.po.cfg.optimizer_modules),
                                                       dict(kwargs)), name
            except Refused as exc:
                raise ConfigError(f"saved server optimizer: {exc}") from None
            self.lr_schedule = parse_schedule(config.get("lr_schedule"))
        if config["compression"] is not None:
            self.compression = CompressionPolicy.from_wire(config["compression"])
        self.directory = dict(config["directory"])
        if config["configured"]:
            if self.global_tier is None:
                raise ConfigError("join the global tier before loading a global server's state (its update "
                                  "policy counts the tier's clients)")
            self._configure()

    def load_owned_state(self, st, saved):
        super().load_owned_state(st, saved)
        self.policy.init_key(st)
        if (st.update is None) != (saved["update"] is None):
            raise ValueError(f"saved with {'no ' if saved['update'] is None else ''}update policy state, but "
                             f"{type(self.policy).__name__} {'keeps' if st.update is not None else 'keeps none'}")
        if st.update is not None:
            st.update.load_state_dict(saved["update"])

    # keys -----------------------------------------------------------------------------------------------------
    def on_init(self, msg: Message, client: NodeInfo) -> None:
        key = msg.get(Field.KEY)
        if msg.get(Field.MASTER):
            value = self.single_tensor(msg)
            if client.kind != "master":
                raise Refused(f"{client.label} is not the master worker")
            if key in self.keys:
                raise Refused(f"key {key!r} is initialized twice by the master worker")
            if self.policy is None:
                self._configure()
            st = KeyState(key, tuple(value.shape), value.dtype, value=np.array(value))
            self.policy.init_key(st)
            if self.checkpoints is not None:
                self._resume_key(st)
            self.keys[key] = st
            self.reply_init(msg, st)
            for held in self.held_inits.pop(key, []):
                self._answer_init(held, st)
            return
        owner = self.directory.get(key, self.rank if key in self.keys else None)
        if owner is None:
            self.held_inits.setdefault(key, []).append(msg)
        elif owner != self.rank:
            self.reply(msg, redirect=owner)
        else:
            self._answer_init(msg, self.keys[key])

    def _resume_key(self, st: KeyState) -> None:
        """Start ``st`` from the checkpoint being resumed (when resuming): its value and optimizer state (a server
        optimizer's), and its reply codec's state."""
        try:
            saved = self.checkpoints.resumed_state(st.key, st.shape)
            if saved is None:
                return
            if st.update is not None:
                self.check_value(st, np.asarray(saved["value"]), "the checkpointed value")
                st.update.load_state_dict(saved["update"])
            if saved.get("wire") is not None:
                if self.wire is None:
                    raise ConfigError(f"the checkpoint of key {st.key!r} holds compression state, but this job "
                                      f"compresses nothing (kv.set_gradient_compression)")
                st.wire = self.wire.key_state(st)
                st.wire.load_shared_state_dict(saved["wire"])
        except (ConfigError, KeyError, TypeError, ValueError) as exc:
            raise Refused(f"resuming key {st.key!r}: {exc}") from None
        if st.update is not None:
            st.value = np.array(saved["value"])

    def _answer_init(self, msg: Message, st: KeyState) -> None:
        try:
            self.check_layout(st, *init_layout(msg), "init")
        except Refused as exc:
            self.reply(msg, error=f"{exc} by the master worker")
            return
        self.reply_init(msg, st)

    def handle_other(self, msg: Message, client: NodeInfo) -> None:
        if msg.op == Op.KEY_OWNER and client.kind == "master":
            key, owner = msg.get(Field.KEY), int(msg.get(Field.OWNER))
            self.directory[key] = owner
            for held in self.held_inits.pop(key, []):
                self.reply(held, redirect=owner)
        elif msg.op == Op.CHECKPOINT_AT and client.kind == "global_server" and client.rank == 0:
            round_ = msg.get(Field.ROUND)
            if not is_round(round_):
                super().handle_other(msg, client)
            elif self.checkpoints is not None:      # None: this server owns no key, or rounds are asynchronous
                self.checkpoints.hear(round_)
        else:
            super().handle_other(msg, client)

    def _announce_checkpoint(self, round_: int) -> None:
        """The timekeeper declared ``round_``: the other global servers checkpoint it too. Ahead of any push
        (priority): checkpoint_clock.py."""
        for server in self.global_tier.servers():
            if server.id != self.po.node_id:
                self.po.van.send(server.addr, Message(Op.CHECKPOINT_AT, fields={Field.ROUND: round_},
                                                      priority=_ANNOUNCE_PRIORITY), dst_dc=server.dc)
        log.info("global server %d: checkpoint declared at round %d", self.rank, round_)

    def note_push_fields(self, st, msg: Message) -> None:
        """A push names the latest checkpoint round its client heard: this server may not have heard of it yet
        (checkpoint_clock.py)."""
        round_ = msg.get(Field.CHECKPOINT_ROUND)
        if round_ is not None and self.checkpoints is not None:
            self.checkpoints.hear(round_, key=st.key, src=msg.src)

    def reply_notices(self) -> dict:
        latest = self.checkpoints.latest_declared if self.checkpoints is not None else 0
        return {Field.CHECKPOINT_ROUND: latest} if latest else {}

    def accept_push(self, st, src, number, value, priority, *, reusable=False):
        if self.policy.synchronous:
            super().accept_push(st, src, number, value, priority, reusable=reusable)
        else:
            self.policy.apply(self, st, value.astype(accumulator_dtype(value.dtype)), [src])

    def on_round(self, st, number, rnd):
        self.stand_in_for_departed(rnd)
        self.policy.apply(self, st, rnd.total, rnd.contributors)    # the round's replies go out here
        if self.checkpoints is not None:
            declared = self.checkpoints.round_done(st, len(self.keys))
            if declared is not None:
                self._announce_checkpoint(declared)

    def read_value(self, st, src):
        return self.policy.read(st, src)


def start_global_server(cfg: NodeConfig, done: threading.Event, *, node_id: str | None = None) -> GlobalServer:
    """A global server joined to its two tiers, serving on its van's receive thread; ``done`` is set when it
    should stop (shutdown or abort). The caller closes ``server.po``."""
    po = Postoffice(cfg, node_id=node_id)
    server = GlobalServer(po, cfg.num_all_workers)
    po.on_data = server.handle
    po.add_member_left_listener(server.on_member_left)
    po.add_member_joined_listener(server.on_member_joined)
    po.add_abort_listener(lambda reason: done.set())
    po.add_shutdown_listener(lambda tier: done.set() if tier.name == "global" else None)
    po.start()
    try:
        tier = po.join("global", cfg.global_scheduler, CENTRAL_DC, "server",
                       {"num_global_servers": cfg.num_global_servers, "num_global_workers": cfg.num_global_workers,
                        "num_all_workers": cfg.num_all_workers}, rank=cfg.rank, on_table=server.attach)
        # one rank for both tiers, so the master worker and the local servers agree on who owns a key
        po.join(cfg.local_tier, cfg.scheduler, cfg.dc, "server",
                {"num_workers": cfg.num_workers, "num_servers": cfg.num_servers}, rank=tier.me.rank,
                on_table=server.attach)
    except BaseException:
        po.close()
        raise
    log.info("global server %d ready at %s", tier.me.rank, po.van.address)
    return server


def run_global_server(cfg: NodeConfig) -> int:
    # a server optimizer (DCASGD, SGD...) may arrive once the tiers are up, and importing torch then, on the
    # receive thread, would stall it for seconds on a loaded machine: import it meanwhile, beside the joining
    # (which waits on the network), instead of before it (every deployment's start then waited for it)
    importer = threading.Thread(target=importlib.import_module, args=("torch",), name="import-torch", daemon=True)
    importer.start()
    done = threading.Event()
    try:
        server = start_global_server(cfg, done)
        try:
            done.wait()
        finally:
            server.po.close()
    finally:
        # a short run may end while torch is still importing: finalizing the interpreter under an import half
        # done aborts the process in torch's C++ ("terminate called without an active exception", signal 6)
        importer.join(timeout=_TORCH_IMPORT_DEADLINE_S)
    return 1 if server.po.aborted else 0


def _schedule(spec):
    """The master worker's learning-rate schedule (its spec), refused naming what is wrong."""
    if spec is None:
        return None
    try:
        return parse_schedule(spec)
    except ConfigError as exc:
        raise Refused(str(exc)) from None
