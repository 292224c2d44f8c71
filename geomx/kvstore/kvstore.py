"""The user-facing key-value store (MXNet/GeoMX KVStore semantics).

    kv = geomx.kvstore.create("dist_sync")      # or "dist_async" (MixedSync)
    kv.init("fc.weight", w)                      # the master worker's value wins
    kv.pull("fc.weight", out=w)                  # every worker starts from it
    kv.pushpull("fc.weight", grad, out=grad).wait()

push, pull and pushpull return a handle; ``handle.wait()`` returns once the reply arrived (and is in
``out``); ``kv.waitall()`` waits for everything outstanding. Values are torch tensors or numpy arrays.

Zero-copy, as torch.distributed's ``async_op=True`` and Horovod's async ops (and unlike MXNet, whose engine
snapshots the value): push and pushpull send ``value`` from its own memory, so leave it unchanged until the
handle has finished; a CPU, C-contiguous ``out`` of the key's dtype receives the reply straight from the
socket (``out`` may be ``value`` itself). Other outputs get a copy.
"""
from __future__ import annotations

import atexit
import functools
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from geomx.cluster.client import Handle, KVClient, check_key, gather
from geomx.cluster.compressed import compressible
from geomx.cluster.kvserver import layout_mismatch
from geomx.cluster.postoffice import Postoffice, Tier
from geomx.cluster.protocol import Command, Op
from geomx.compat import check as check_combination
from geomx.compression import CompressionPolicy, parse_policy
from geomx.config import MODES, REDUCTIONS, NodeConfig, config_from_env
from geomx.errors import ConfigError, GeomxError, KVError, PeerLostError
from geomx.kvstore.partition import LAN_PART_BYTES, check_user_key, part_views, plan_parts, wire_part_bytes
from geomx.lifeline import watch_launcher
from geomx.optim.schedules import parse_schedule
from geomx import uncaught
from geomx.profiles import CENTRAL_DC
from geomx.sync.settings import algorithm_rounds_are_steps, settings_from_env, sync_requested

log = logging.getLogger("geomx.kvstore")


def joins_mode(role: str, created: str, deployment_mode: str) -> bool:
    """Whether a kvstore of type ``created`` on ``role`` fits a deployment in ``deployment_mode``: the same
    type, or a worker's ``dist_sync`` in ``dist_async``. GeoMX's MixedSync scripts give the asynchronous type
    to the master worker only; their workers create ``dist_sync``, synchronous inside their DC, which is what
    MixedSync does there anyway."""
    return created == deployment_mode or (role == "worker" and created == "dist_sync"
                                          and deployment_mode == "dist_async")


def create(name: str | None = None, *, env: dict | None = None, reduction: str | None = None) -> KVStore:
    """Join the deployment described by the environment (set by ``geomx launch`` or by hand, see
    docs/environment.md) as a worker or as the master worker.

    ``reduction``: what a synchronous round gives back without a server optimizer, and what a server optimizer
    steps on: ``"sum"`` of the round's pushes (MXNet's and GeoMX's servers; the default) or their ``"mean"`` over
    all training workers (what ``DistributedOptimizer`` asks for). The master worker's choice holds for everyone;
    a worker that names one is checked against it at its first init."""
    cfg = config_from_env(env)
    if name is None:
        name = cfg.mode or "dist_sync"
    if name not in MODES:
        raise ConfigError(f"unknown kvstore type {name!r}; geomx offers {', '.join(MODES)}")
    if cfg.mode is not None and not joins_mode(cfg.role, name, cfg.mode):
        raise ConfigError(f"this script creates a {name!r} kvstore but the deployment runs in {cfg.mode!r} "
                          f"(geomx launch --mode / GEOMX_MODE)")
    check_combination(mode=name, mixedsync=cfg.mixedsync, checkpoint_seconds=cfg.checkpoint_seconds or None)
    if cfg.role not in ("worker", "master"):
        raise ConfigError(f"geomx.kvstore.create() runs on workers and the master worker, not on role "
                          f"{cfg.role!r}")
    check_reduction(reduction)
    watch_launcher(env)
    uncaught.watch()
    return KVStore(cfg, name, env=env, reduction=reduction)


def check_reduction(reduction: str | None) -> None:
    if reduction is not None and reduction not in REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")


class KVStore:
    def __init__(self, cfg: NodeConfig, mode: str, *, env: Mapping[str, str] | None = None,
                 reduction: str | None = None) -> None:
        self.cfg, self.type = cfg, mode
        self._reduction = reduction     # as this process asked (None: the master worker's, "sum" by default)
        # a synchronization algorithm the environment asks for runs in DistributedOptimizer, which claims it
        # (claim_sync); a push without that claim is refused rather than silently running FSA
        self._unclaimed_sync = sync_requested(env)
        # GeoMX's HFA scripts push models through the raw kvstore (MXNET_KVSTORE_USE_HFA=1): the master worker
        # asks the servers for GeoMX's HFA server logic (geomx.cluster.hfa_rounds) unless DistributedOptimizer
        # claims the algorithm first
        settings = settings_from_env(env)
        self._server_hfa_k2 = settings.k2 if settings.algorithm == "hfa" else None
        # whether a step is one round of every key (FSA, P3): the global servers name their checkpoints by round,
        # which names a step only then. The environment's algorithm until DistributedOptimizer claims its own
        self._rounds_are_steps = algorithm_rounds_are_steps(settings.algorithm)
        self._mode_sent: dict | None = None     # the master worker's last set_mode, as the servers hold it
        self.po = Postoffice(cfg)
        self._client: KVClient | None = None
        self.po.on_data = self._on_data
        self._outstanding: list[Handle] = []
        self._initialized_keys: set = set()
        self._packed_keys: set = set()          # keys of packed tensors (tensor fusion): not the model
        self._lan_only_keys: set = set()        # keys cut into LAN-sized parts: DC-only rounds only
        self._layout: dict = {}           # key -> (shape, dtype, parts or None), from this worker's init
        self._compression: dict | None = None   # this worker's own set_gradient_compression, to check
        self._own_policy = None                 # the same as a policy (every process's, the master's too): parts
        self._cuts: dict = {}                   # key -> (lan_only, slice_elements) its init asked for
        self._closed = False
        self.po.start()
        try:
            self._join()
        except BaseException:
            self.po.close()
            raise
        atexit.register(self._close_at_exit)

    def _join(self) -> None:
        cfg = self.cfg
        dc_tier = self.po.join(cfg.local_tier, cfg.scheduler, cfg.dc, "worker",
                               {"num_workers": cfg.num_workers, "num_servers": cfg.num_servers}, rank=cfg.rank)
        self._dc_tier = dc_tier
        serving: Tier = dc_tier
        if cfg.role == "worker" and cfg.topology == "flat":
            # ranked after its DC rank among its DC's workers: the same global rank, and so the same codec
            # streams' seeds (its place), in every run
            serving = self.po.join("global", cfg.global_scheduler, CENTRAL_DC, "worker",
                                   {"num_global_servers": cfg.num_global_servers,
                                    "num_global_workers": cfg.num_global_workers,
                                    "num_all_workers": cfg.num_all_workers}, order=dc_tier.me.rank)
        self._client = KVClient(self.po, serving, master=self.is_master_worker)
        if self.is_master_worker:
            self._send_mode()

    def _send_mode(self) -> None:
        # GeoMX's HFA sums the DCs' shares: a kvstore that asked for the mean is not a GeoMX HFA script
        asks_server_hfa = self._unclaimed_sync is not None and (self._reduction or "sum") == "sum"
        hfa_k2 = self._server_hfa_k2 if asks_server_hfa else None
        mode = {"mode": self.type, "mixedsync": self.cfg.mixedsync, "reduction": self._reduction or "sum",
                "hfa_k2": hfa_k2, "rounds_are_steps": self._rounds_are_steps}
        if mode == self._mode_sent:     # the servers have it already
            return
        if hfa_k2 is not None:
            check_combination(mode=self.type, topology=self.cfg.topology, sync="hfa", k2=hfa_k2)
        for h in self._client.command(Command.SET_MODE, **mode):
            h.wait()
        self._mode_sent = mode

    def _on_data(self, msg) -> None:
        if msg.op == Op.REPLY and self._client is not None:
            self._client.handle_reply(msg)

    # properties -----------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Rank of this worker inside its DC."""
        return self._dc_tier.me.rank

    @property
    def num_workers(self) -> int:
        """Workers in this DC (the master worker's DC is the central party)."""
        return self.cfg.num_workers

    @property
    def num_all_workers(self) -> int:
        """Training workers world-wide (the master worker does not train)."""
        return self.cfg.num_all_workers

    @property
    def is_master_worker(self) -> bool:
        return self.cfg.role == "master"

    @property
    def dc(self) -> str:
        return self.cfg.dc

    @property
    def reduction(self) -> str:
        """"sum" or "mean" (see :func:`create`): the servers' once a key is initialized, else as asked here."""
        return self._client.info.get("reduction") or self._reduction or "sum"

    @property
    def asked_reduction(self) -> str | None:
        """The reduction this process asked for (create(reduction=) / set_reduction), None if it did not."""
        return self._reduction

    @property
    def server_updates(self) -> bool:
        """True when the global servers run the optimizer (pull returns weights, not gradients). Known after
        the first init."""
        return bool(self._client.info.get("server_optimizer"))

    @property
    def server_lr_schedule(self) -> dict | None:
        """The learning-rate schedule the global servers run with their optimizer (its spec,
        geomx.optim.schedules), or None. Known after the first init."""
        return self._client.info.get("lr_schedule")

    @property
    def joined_at(self) -> int:
        """0, or, for a worker restarted into a running job (it took a dropped worker's place), the rounds the
        job had under way when it joined: it takes no part in them and starts from the model after them. Known
        after the first init."""
        return self._client.joined_at

    def checkpoint_declared(self, step: int) -> bool:
        """Whether the global servers declared ``step`` (= round) a checkpoint round (``--checkpoint-seconds``,
        geomx.cluster.checkpoint_clock): known before this worker finishes that step."""
        return step in self._client.checkpoint_rounds

    @property
    def compression(self) -> dict | None:
        """The deployment's gradient compression (the master worker's setting, as sent to the servers), or
        None. Known after the first init."""
        return self._client.info.get("compression")

    def claim_sync(self, policy) -> None:
        """Called by ``DistributedOptimizer``: ``policy`` (geomx.sync) runs the synchronization algorithm the
        environment asks for, so pushes through this kvstore are that algorithm's. Call it before the first
        kv.init: the master worker's call takes back the request for GeoMX's HFA server logic."""
        # a policy chosen in code (sync=HFA(...)) where the environment names none: the servers
        # learn whether its rounds are steps from the master worker's mode, which they take before the first
        # kv.init only (a script's second DistributedOptimizer, over keys of its own, leaves it as it was)
        steps = algorithm_rounds_are_steps(getattr(policy, "name", None))
        announce = steps != self._rounds_are_steps and not self._initialized_keys
        if self._unclaimed_sync is None and not announce:
            return
        self._unclaimed_sync = None
        if announce:
            self._rounds_are_steps = steps
        if self.is_master_worker:
            self._send_mode()

    # configuration (master worker) ----------------------------------------------------------------------------
    def set_optimizer(self, optimizer: Any, *, lr_schedule=None, **kwargs) -> None:
        """Run ``optimizer`` (a torch.optim class, its name, or an instance) on the global servers. Only the
        master worker's call counts (others return at once, as in GeoMX). Before kv.init, or after it (MXNet's
        order) as long as no key has been pushed yet. ``lr_schedule``: a geomx.optim schedule
        (``WarmupCosine``, ``StepDecay``) or its spec, which the servers apply to the optimizer's rate at each
        key's update count (a scheduler on the workers does not reach them)."""
        schedule = parse_schedule(lr_schedule)
        if isinstance(optimizer, str):
            name = optimizer
        elif isinstance(optimizer, type):
            # torch's and geomx's classes by their public module; the user's own by theirs (the global servers
            # import it only if GEOMX_OPTIMIZER_MODULES there lists it)
            name = f"{optimizer.__module__.split('.')[0]}.optim.{optimizer.__name__}" \
                if optimizer.__module__.startswith(("torch.optim", "geomx.optim")) \
                else f"{optimizer.__module__}.{optimizer.__name__}"
        else:
            import torch

            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigError(f"set_optimizer takes a torch.optim optimizer class, name or instance, not "
                                  f"{type(optimizer).__name__}")
            import inspect

            # only what the class's constructor takes: AdamW's defaults hold decoupled_weight_decay, which its
            # __init__ does not accept
            accepted = inspect.signature(type(optimizer).__init__).parameters
            kwargs = {**{k: v for k, v in optimizer.defaults.items() if _plain(v) and k in accepted}, **kwargs}
            return self.set_optimizer(type(optimizer), lr_schedule=schedule, **kwargs)
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        bad = [k for k, v in kwargs.items() if not _plain(v)]
        if bad:
            raise ConfigError(f"optimizer arguments {bad} are not plain numbers, strings, booleans or lists")
        if not self.is_master_worker:
            log.debug("set_optimizer on a non-master worker is ignored (GeoMX semantics)")
            return
        spec = {"lr_schedule": schedule.to_spec()} if schedule is not None else {}
        for h in self._client.command(Command.SET_OPTIMIZER, optimizer=name, kwargs=kwargs, **spec):
            h.wait()
        self._client.info["server_optimizer"] = True

    def set_reduction(self, reduction: str) -> None:
        """Choose ``"sum"`` or ``"mean"`` (see :func:`create`) before the first kv.init. The master worker's call
        configures the global servers; another worker's is checked against the master's at init."""
        check_reduction(reduction)
        if self._initialized_keys and reduction == self.reduction:
            self._reduction = reduction     # a second DistributedOptimizer on this kvstore: nothing changes
            return
        if self._initialized_keys:
            raise ConfigError(f"set_reduction({reduction!r}) must come before the first kv.init (this kvstore "
                              f"already {'sums' if self.reduction == 'sum' else 'averages'})")
        self._reduction = reduction
        if self.is_master_worker:
            self._send_mode()

    def set_gradient_compression(self, compression: dict | str | None) -> None:
        """Compress gradients on the wire (docs/compression.md). GeoMX's forms: ``{"type": "bsc", "threshold":
        0.01}`` (WAN only), ``{"type": "fp16"}`` (both tiers), ``{"type": "mpq", "threshold": r,
        "size_lower_bound": n}``; or per tier: ``{"lan": "fp16", "wan": {"type": "dgc", "ratio": 0.001}}``.

        The master worker's call configures every server (before its first kv.init) and every worker follows
        it; another worker's call is checked against the master's at init (a mismatch is an error)."""
        policy = parse_policy(compression)
        if self._initialized_keys:
            raise ConfigError("set_gradient_compression must be called before the first kv.init")
        self._own_policy = policy
        if not self.is_master_worker:
            self._compression = policy.to_wire()
            return
        for h in self._client.command(Command.SET_COMPRESSION, policy=policy.to_wire()):
            h.wait()

    # saved state ----------------------------------------------------------------------------------------------
    def wire_state_dict(self) -> dict | None:
        """This worker's compression streams (codec memory, error-feedback residuals), None without
        compression; DistributedOptimizer.state_dict carries it."""
        return self._client.wire_state_dict()

    def load_wire_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`wire_state_dict` after the keys are initialized. Streams saved by a job that cut a
        tensor into other parts are re-cut to this process's parts (geomx.part_state)."""
        cuts = {key: [(p.key, p.start, p.stop, p.shape) for p in parts] if parts
                else [(key, 0, math.prod(shape), tuple(shape))] for key, (shape, _, parts) in self._layout.items()}
        self._client.load_wire_state_dict(state, cuts=cuts)

    # key-value operations -----------------------------------------------------------------------------------
    def init(self, key, value, *, slice_elements: int = 0, packed: bool = False, lan_only: bool = False) -> None:
        """Initialize one key (or a list of keys with a list of values). Blocks until the key exists
        everywhere; the master worker's value is the one every worker will pull. ``slice_elements`` (P3): cut
        each value into parts of at most that many elements (and of at most ``GEOMX_PARTITION_BYTES``); every
        process that initializes the key must give the same. ``packed``: the keys carry other keys' values
        packed together (tensor fusion, geomx.sync.fusion), so the model's dense size leaves them out.
        ``lan_only``: only DC-only rounds (``pushpull(scope="dc")``) will use the keys, so they are cut into
        parts of ``LAN_PART_BYTES``, not into the WAN's smaller parts; every process must give the same."""
        keys, values = _pairs(key, value)
        handles = []
        for k, v in zip(keys, values, strict=False):
            check_key(k)
            check_user_key(k)
            arr = np.ascontiguousarray(_as_numpy_view(_one_device(k, v)))   # init blocks until answered: no copy
            self._cuts[k] = (lan_only, slice_elements)
            parts = self._plan(k, arr.shape, arr.dtype, self._own_policy)
            self._layout[k] = (arr.shape, arr.dtype, parts)
            if parts is None:
                handles.append([self._client.init(k, arr)])
            else:
                handles.append([self._client.init(p.key, piece)
                                for p, piece in zip(parts, part_views(arr, parts), strict=True)])
        checked = False
        for k, hs in zip(keys, handles, strict=False):
            for h in hs:
                _, info = h.wait()
                self._check_info(info)
                if not checked:             # the first reply names the master's compression: before any hang
                    self._check_parts(info.get("compression"), keys)
                    checked = True
            self._initialized_keys.add(k)
            if packed:
                self._packed_keys.add(k)
            if lan_only:
                self._lan_only_keys.add(k)
        if self.po.metrics is not None:
            dense = sum(int(np.prod(shape)) * 4 for k, (shape, _, _) in self._layout.items()
                        if k not in self._packed_keys)
            self.po.metrics.write("model", keys=len(self._layout), dense_bytes=dense)

    def wire_part_bytes(self, key, shape: tuple, policy=None, dtype=np.float32) -> int:
        """The part size of a tensor ``key`` of ``shape`` and ``dtype`` that crosses the WAN: ``GEOMX_PARTITION_BYTES``
        of what its WAN codec puts on the wire (geomx.kvstore.partition.wire_part_bytes), the codec read from
        ``policy`` (default: this process's own ``set_gradient_compression``). Every process of a deployment
        must cut a key alike, and the servers' policy arrives only with an init's reply, too late for the plan
        of its parts: so a process plans by its own call, which is checked against the master's at that reply
        (:meth:`_check_parts`)."""
        policy = self._own_policy if policy is None else policy
        ratio = 1.0
        if policy is not None and compressible(dtype):     # other dtypes travel as they are
            ratio = policy.codec_for("wan", key, math.prod(shape)).wire_ratio(tuple(shape))
        return wire_part_bytes(self.cfg.partition_bytes, ratio)

    def _plan(self, key, shape: tuple, dtype, policy) -> list | None:
        """The parts of ``key`` (None: it travels whole), cut as its init asked (``self._cuts``) under ``policy``."""
        lan_only, slice_elements = self._cuts[key]
        itemsize = np.dtype(dtype).itemsize
        limit = self.cfg.partition_bytes
        if lan_only and limit:
            limit = max(limit, LAN_PART_BYTES)
        elif limit:
            limit = self.wire_part_bytes(key, shape, policy, dtype)
        if slice_elements:
            limit = min(limit, slice_elements * itemsize) if limit else slice_elements * itemsize
        return plan_parts(key, shape, itemsize, limit)

    def _check_parts(self, servers_policy: dict | None, keys: list) -> None:
        """A process that did not call set_gradient_compression (GeoMX lets workers follow the master's) cut its
        ``keys`` as if nothing were compressed; where the master's compression cuts one otherwise, its parts would
        never meet the master's (its init would wait for them until the deadline): refuse, naming the key and
        the fix. Called at the first reply of each init, before the wait for a part that may never come."""
        if self._own_policy is not None or servers_policy is None:
            return
        policy = CompressionPolicy.from_wire(servers_policy)
        for key in keys:
            shape, dtype, mine = self._layout[key]
            masters = self._plan(key, shape, dtype, policy)
            if [p.shape for p in mine or []] != [p.shape for p in masters or []]:
                raise ConfigError(f"key {key!r}: the master worker compresses gradients ({servers_policy}), which "
                                  f"cuts this tensor into {len(masters or [1])} part(s) by their wire bytes, but "
                                  f"this process did not call kv.set_gradient_compression and cut it into "
                                  f"{len(mine or [1])}: call it on every process, with the master's setting, "
                                  f"before the first kv.init")

    def push(self, key, value, priority: int = 0) -> Handle | list[Handle]:
        """Send a gradient (zero-copy: leave ``value`` unchanged until the handle has finished)."""
        keys, values = _pairs(key, value)
        hs = [self._track(self._request(Op.PUSH, k, v, None, priority)) for k, v in zip(keys, values, strict=False)]
        return hs if isinstance(key, (list, tuple)) else hs[0]

    def pull(self, key, out=None, priority: int = 0) -> Handle | list[Handle]:
        """Fetch the current value (after this worker's earlier pushes of the key) into ``out``;
        ``handle.wait()`` also returns it as a numpy array."""
        keys, outs = _pairs(key, out) if out is not None else (_keys(key), [None] * len(_keys(key)))
        hs = [self._track(self._request(Op.PULL, k, None, o, priority)) for k, o in zip(keys, outs, strict=False)]
        return hs if isinstance(key, (list, tuple)) else hs[0]

    def pushpull(self, key, value, out=None, priority: int = 0, *, scope: str | None = None) -> Handle | list[Handle]:
        """Push then pull in one message (one round trip). ``out`` may be ``value`` itself. ``scope="dc"``:
        the reply is the sum over this DC's workers' values, nothing crosses the WAN (HFA's DC rounds)."""
        if scope not in (None, "dc"):
            raise ConfigError(f"pushpull scope must be None or 'dc', got {scope!r}")
        if scope == "dc" and (self.cfg.topology != "hips" or self.is_master_worker):
            raise ConfigError("DC-only rounds (scope='dc') need a DC's local server: training workers of the "
                              "hips topology")
        op = Op.DC_PUSHPULL if scope == "dc" else Op.PUSHPULL
        keys, values = _pairs(key, value)
        outs = _pairs(key, out)[1] if out is not None else [None] * len(keys)
        hs = [self._track(self._request(op, k, v, o, priority)) for k, v, o in zip(keys, values, outs, strict=False)]
        return hs if isinstance(key, (list, tuple)) else hs[0]

    def waitall(self, timeout: float | None = None) -> None:
        """Wait for every request not yet waited for; raises the first error that no ``wait()`` raised."""
        outstanding, self._outstanding = self._outstanding, []
        for h in outstanding:
            if not h.error_raised:
                h.wait(timeout)

    def barrier(self, global_: bool = False) -> None:
        """Wait for every worker of this DC (``global_=True``: of every DC)."""
        if self.is_master_worker:
            return
        if self.cfg.topology == "flat" and global_:
            self.po.tiers["global"].barrier("worker")
            return
        self._dc_tier.barrier("worker")
        if global_:
            if self.rank == 0:
                self._client.command(Command.GLOBAL_BARRIER)[0].wait()
            self._dc_tier.barrier("worker")

    def close(self) -> None:
        """Leave the deployment (also run at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.po.aborted:
                self.waitall()
        finally:
            self.po.close()

    # internals ----------------------------------------------------------------------------------------------
    def _close_at_exit(self) -> None:
        died_of = uncaught.exception()
        if died_of is not None and not self._closed and not self.po.aborted:
            # not a goodbye: the others would take it for a finished worker and wait for its rounds. A fault
            # domain may absorb a crash; a misconfiguration must stop the run
            self.po.abort(f"{self.cfg.label} ended on {uncaught.describe(died_of)}",
                          fatal=isinstance(died_of, ConfigError), relayed=isinstance(died_of, PeerLostError))
        try:
            self.close()
        except GeomxError as exc:   # the error was (or will be) reported where it happened
            log.warning("closing the kvstore at exit: %s", exc)

    def _request(self, op: str, key, value, out, priority: int) -> Handle:
        """One push, pull or pushpull of a user key: of the whole tensor, or of each of its parts."""
        check_key(key)
        if key in self._lan_only_keys and op != Op.DC_PUSHPULL:
            raise KVError(f"key {key!r} was initialized for DC-only rounds (init(lan_only=True): cut into LAN-sized "
                          f"parts), but this {op} would cross the WAN: use pushpull(scope='dc'), or a key "
                          f"initialized without lan_only")
        if self._unclaimed_sync is not None and op != "pull" and not self._client.info.get("hfa_k2"):
            raise ConfigError(self._unclaimed_sync)
        src = _as_numpy_view(_device_sum(key, value)) if value is not None else None
        out, more_outs = (out[0], list(out[1:])) if isinstance(out, list | tuple) and out else (out, [])
        shape, dtype, parts = self._layout.get(key, (None, None, None))
        if out is not None and shape is not None and tuple(out.shape) != tuple(shape):
            raise KVError(f"{op} of key {key!r} into an output of shape {tuple(out.shape)}, but the key has shape "
                          f"{tuple(shape)}")
        target = _receivable(out)
        if parts is None:
            h = self._send(op, key, src, target, priority)
        else:
            if src is not None:
                problem = layout_mismatch(op, key, src.shape, src.dtype, shape, dtype)
                if problem:
                    raise KVError(problem)
                src = np.ascontiguousarray(src)
            into = None if op == Op.PUSH else (target if target is not None and target.shape == shape
                                               else np.empty(shape, dtype))
            values = part_views(src, parts) if src is not None else [None] * len(parts)
            outs = part_views(into, parts) if into is not None else [None] * len(parts)
            requests = [self._send(op, p.key, v, o, priority) for p, v, o in zip(parts, values, outs, strict=False)]
            for request, p in zip(requests, parts, strict=True):
                request.share = (p.stop - p.start) / parts[-1].stop
            h = gather(requests, lambda _: into, f"{op} of key {key!r}")
            target = into if into is target else None
        if op == Op.PUSH:
            return h
        h = h.then(_copier(key, out, target))
        for extra in more_outs:                  # MXNet's out=[o1, o2]: every device gets the value
            h = h.then(_copier(key, extra))
        return h

    def _send(self, op: str, key, value, out, priority: int) -> Handle:
        if op == Op.PUSH:
            return self._client.push(key, value, priority)
        if op == Op.PULL:
            return self._client.pull(key, priority, out=out)
        return self._client.pushpull(key, value, priority, out=out, scope="dc" if op == Op.DC_PUSHPULL else None)

    def _track(self, h: Handle) -> Handle:
        # keep what waitall must still wait for or report; a finished handle would pin its reply in memory
        if len(self._outstanding) > 16:
            self._outstanding = [x for x in self._outstanding
                                 if not x.error_raised and (not x.done() or x.error is not None)]
        self._outstanding.append(h)
        return h

    def _check_info(self, info: dict) -> None:
        mode = info.get("mode")
        if mode is not None and not joins_mode(self.cfg.role, self.type, mode):
            raise ConfigError(f"this worker created a {self.type!r} kvstore but the master worker created "
                              f"{mode!r}")
        if self._compression is not None and "compression" in info and not _same_codecs(info["compression"],
                                                                                        self._compression):
            raise ConfigError(f"this worker set gradient compression {self._compression} but the master worker set "
                              f"{info['compression']}")
        if self._reduction is not None and info.get("reduction", self._reduction) != self._reduction:
            raise ConfigError(f"this worker's kvstore asks for the {self._reduction} of each round but the master "
                              f"worker's gives the {info['reduction']} (kv.set_reduction / create(reduction=); "
                              f"DistributedOptimizer asks for the mean: wrap the optimizer on the master worker "
                              f"too)")
        if info.get("hfa_k2") and self._unclaimed_sync is None and self._server_hfa_k2 is not None:
            raise ConfigError("the global servers run GeoMX's HFA server logic (the master worker's script pushes "
                              "through the raw kvstore under MXNET_KVSTORE_USE_HFA) but this worker runs HFA in "
                              "DistributedOptimizer: use DistributedOptimizer on the master worker too, or on none")
        n = info.get("num_all_workers")
        if n is not None and n != self.cfg.num_all_workers:
            raise ConfigError(f"this worker counts DMLC_NUM_ALL_WORKER={self.cfg.num_all_workers} but the global "
                              f"servers count {n}")


def _same_codecs(servers: dict | None, mine: dict | None) -> bool:
    """The servers' policy against this worker's own call: the codecs must match; the size bound is the global
    servers' to set (GeoMX reads MXNET_KVSTORE_SIZE_LOWER_BOUND on its servers), and every client uses theirs."""
    def codecs(policy):
        return None if policy is None else {k: v for k, v in policy.items() if k != "size_lower_bound"}
    return codecs(servers) == codecs(mine)


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(_plain(x) for x in v))


def _keys(key) -> list:
    return list(key) if isinstance(key, (list, tuple)) else [key]


def _pairs(key, value) -> tuple[list, list]:
    keys = _keys(key)
    values = list(value) if isinstance(key, (list, tuple)) else [value]
    if len(keys) != len(values):
        raise GeomxError(f"{len(keys)} keys but {len(values)} values")
    return keys, values


def _device_values(key, value) -> list:
    """MXNet's several devices' values of one key (``[v1, v2]``), checked to share a shape; else ``[value]``."""
    if not isinstance(value, list | tuple):
        return [value]
    if not value:
        raise GeomxError(f"an empty list of values for key {key!r}")
    arrays = [_as_numpy_view(v) for v in value]
    shapes = {tuple(a.shape) for a in arrays}
    if len(shapes) > 1:
        raise KVError(f"the values of key {key!r} from several devices have different shapes {sorted(shapes)}")
    return arrays


def _device_sum(key, value):
    """What a worker pushes for ``value``: MXNet sums a list of devices' values before it leaves the worker."""
    arrays = _device_values(key, value)
    return arrays[0] if len(arrays) == 1 else functools.reduce(np.add, arrays)


def _one_device(key, value):
    """An init's value: with several devices' values (as MXNet allows), the first (they start equal)."""
    return _device_values(key, value)[0]


def _as_numpy_view(value) -> np.ndarray:
    """A numpy view of a tensor or array (no copy when it is already on the CPU)."""
    if isinstance(value, np.ndarray):
        return value
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    raise GeomxError(f"values are torch tensors or numpy arrays, not {type(value).__name__}")


def _receivable(out) -> np.ndarray | None:
    """A numpy view of ``out`` that a reply can be received into directly, or None (then it gets a copy)."""
    if out is None:
        return None
    if isinstance(out, np.ndarray):
        view = out
    else:
        import torch

        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or out.dtype == torch.bfloat16:
            return None
        view = out.detach().numpy()
    return view if view.flags.c_contiguous and view.flags.writeable and view.nbytes else None


def _copier(key, out, received_into: np.ndarray | None = None):
    if out is None:
        return lambda arr: arr

    def copy(arr: np.ndarray) -> np.ndarray:
        if arr is received_into:             # the reply was received straight into ``out``
            return arr
        if tuple(out.shape) != tuple(arr.shape):
            raise KVError(f"pull of key {key!r} into an output of shape {tuple(out.shape)}, but the value has "
                          f"shape {tuple(arr.shape)}")
        if isinstance(out, np.ndarray):
            np.copyto(out, arr)
        else:
            import torch

            with torch.no_grad():
                if out.device.type == "cpu":
                    np.copyto(out.detach().numpy(), arr, casting="same_kind")
                else:
                    out.copy_(torch.from_numpy(np.array(arr)))
        return arr

    return copy
