"""``DistributedOptimizer``: a single-process training loop becomes distributed by wrapping its optimizer.

    kv = geomx.kvstore.create()
    opt = geomx.torch.DistributedOptimizer(torch.optim.Adam(model.parameters(), 1e-3), model, kvstore=kv)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # each gradient is pushed as soon as backward produces it
        opt.step()                        # waits for the aggregated gradients (or new weights), then steps

Construction initializes one key per parameter (its name) and pulls the master worker's values, so every
worker starts from the same model. Two modes:

* worker-side update (default): the servers return the mean gradient over all workers of all DCs; the
  wrapped optimizer steps locally, exactly as single-process training on the union of the batches would;
* server-side update (``update_on_server=True``, set on the master worker): the global servers run the
  wrapped optimizer's class and hyper-parameters and workers receive weights; the local optimizer is unused.

Synchronization (``sync=``, or ``geomx launch --sync``, see geomx.sync): ``"fsa"`` (default) pushes every
gradient as above; ``"hfa"`` and ``"diloco"`` step locally with the wrapped optimizer and average models
every K1 steps in the DC and every K1 x K2 steps across DCs (``num_samples``: this worker's training
samples, its weight in the averages); ``"dga"`` steps on the average of D steps ago, corrected; ``"esync"``
lets faster workers take more local steps per round (count the run's length in :attr:`progress`). A worker
started with ``GEOMX_SLOWDOWN=F`` (``geomx launch --slowdown``) makes every step take F times its compute time
(geomx.sync.slowdown).

It is a ``torch.optim.Optimizer``: its ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own
objects, so an LR scheduler on it (``torch.optim.lr_scheduler.StepLR(opt, ...)``) changes the wrapped optimizer's
learning rate (with ``update_on_server`` the servers' optimizer keeps the hyper-parameters it had at set-up, and the
first step() after the learning rate changed here warns that the schedule does not reach it: give the servers theirs
instead, ``server_lr_schedule=geomx.WarmupCosine(...)`` or ``geomx.StepDecay(...)``, which they apply at each key's
update count, as MXNet's servers ran the optimizer's scheduler); ``zero_grad(set_to_none=)`` and step hooks work;
``state_dict()`` is the wrapped optimizer's plus a ``"geomx"`` entry with the synchronization policy's state
(HFA/DiLoCo base model and outer momentum, DGA's gradient history, ESync's round), the step count and this worker's
compression streams (codec memory, error-feedback residuals), and ``load_state_dict`` restores them.

Tuning: gradients cross a congested link in the order backward makes them (FSA waits for every reply, and
gradients that overtook one another would leave the downlink idle until backward ends); P3 sends the last
layers first and the rest first layers first (geomx.sync.wire_order). ``backward_passes_per_step`` k > 1 sums
k backward passes locally before pushing (fewer, larger WAN rounds; scale the loss by 1 / k for their mean); one
more backward pass before ``step()`` raises an error naming this option (geomx.sync.fsa). A policy object sums its own
(``sync=geomx.FSA(backward_passes_per_step=k)``): a different value given here beside it is refused.
"""
from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable

import torch

from geomx import metrics
from geomx.compat import check as check_combination
from geomx.errors import ConfigError
from geomx.optim.schedules import parse_schedule
from geomx.sync import create as create_sync
from geomx.sync.slowdown import Slowdown

log = logging.getLogger("geomx.optimizer")

STATE_KEY = "geomx"        # DistributedOptimizer's own entry in state_dict(), next to the wrapped optimizer's
# what torch.optim.Optimizer.__init__ sets up besides the parameters (which are the wrapped optimizer's here)
_HOOK_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                "_optimizer_load_state_dict_post_hooks")


def _numbers(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# policy -> the DistributedOptimizer it serves: a policy holds one optimizer's state (its parameters, DGA's
# history, HFA's base model), so two optimizers sharing one object would mix theirs
_SERVING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _claim(policy, optimizer) -> None:
    try:
        serving = _SERVING.get(policy)
    except TypeError:       # an object that cannot be weakly referenced: nothing to check
        return
    if serving is not None and serving() is not None:
        raise ConfigError(f"sync={policy!r} already serves another DistributedOptimizer; give each optimizer a "
                          f"policy object of its own (or the algorithm's name)")
    _SERVING[policy] = weakref.ref(optimizer)


def _warn(message: str, *, stacklevel: int) -> None:
    """In the log (a deployment's role logs) and as a Python warning (a notebook's user sees it at once)."""
    log.warning(message)
    warnings.warn(message, stacklevel=stacklevel)


def _groups_unlike_defaults(optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter groups whose numeric hyper-parameters differ from the optimizer's defaults, which alone
    reach the servers (KVStore.set_optimizer sends the defaults)."""
    unlike = []
    for i, group in enumerate(optimizer.param_groups):
        own = {k: group[k] for k, v in _numbers(optimizer.defaults).items() if k in group and group[k] != v}
        if own:
            unlike.append(f"parameter group {i}'s {own}")
    return unlike


class DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]] | None = None, *,
                 kvstore=None, update_on_server: bool = False, backward_passes_per_step: int | None = None, sync=None,
                 num_samples: float | None = None, server_lr_schedule=None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        schedule = parse_schedule(server_lr_schedule)
        if schedule is not None and not update_on_server:
            raise ConfigError("server_lr_schedule is the global servers' schedule, for update_on_server=True; "
                              "on the workers use a torch.optim.lr_scheduler on the wrapped optimizer")
        # torch.optim.Optimizer.__init__ would build param_groups of its own: the wrapped optimizer's are used
        # (properties below), only the hook tables and the step patch are set up here
        for table in _HOOK_TABLES:
            setattr(self, table, OrderedDict())
        self._patch_step_function()
        self.optimizer = optimizer
        self.params = _named(optimizer, named_parameters)
        self.comm_wait_s = 0.0      # time step() spent waiting for the network (cumulative)
        sync = create_sync(sync, backward_passes_per_step=backward_passes_per_step)
        # None: the policy's own (FSA(backward_passes_per_step=k)); one that differs was refused by create_sync
        backward_passes_per_step = getattr(sync, "backward_passes_per_step", 1)
        # a policy object (sync=DGA(...)) is checked here; a name was checked by create_sync
        # update_on_server=False on a worker says nothing of the servers (the master worker sets their optimizer)
        check_combination(sync=getattr(sync, "name", None), server_optimizer=update_on_server or None,
                          backward_passes_per_step=backward_passes_per_step)
        _claim(sync, self)
        self.sync = sync
        if kvstore is None:
            import geomx.kvstore
            kvstore = geomx.kvstore.create(reduction="mean")
        elif kvstore.asked_reduction == "sum":
            raise ConfigError("DistributedOptimizer averages the workers' gradients, but this kvstore was created "
                              "with reduction='sum': create it without a reduction (or with 'mean')")
        # time-based checkpoints name a step by the servers' round: only where one step is one round of every key
        check_combination(sync=getattr(sync, "name", None), checkpoint_seconds=kvstore.cfg.checkpoint_seconds or None)
        kvstore.claim_sync(sync)
        # FSA's step, the server optimizer and the algorithms' model averages read a round as the mean (the master
        # worker sends its mode again only where it changed)
        kvstore.set_reduction("mean")
        self.kv = kvstore
        self.backward_passes_per_step = backward_passes_per_step
        self.slowdown = Slowdown.from_env()
        self.steps_taken = 0        # step() calls
        if update_on_server and kvstore.is_master_worker:
            kvstore.set_optimizer(optimizer, lr_schedule=schedule)
        names = [n for n, _ in self.params]
        started = time.perf_counter()
        # a policy that slices its parameters (P3) says how finely; every process initializes the keys alike
        kvstore.init(names, [p.detach() for _, p in self.params], slice_elements=getattr(sync, "slice_elements", 0))
        kvstore.pull(names, out=[p.data for _, p in self.params])
        kvstore.waitall()
        self.rejoin_s: float | None = None      # restarted into a running job: how long getting its model took
        if kvstore.joined_at:
            # restarted into a running job: the servers' model after the rounds under way is where it starts
            # (only with the servers' optimizer, which they check), one round per step
            self.steps_taken = kvstore.joined_at
            self.rejoin_s = time.perf_counter() - started
        self.server_updates = kvstore.server_updates
        if update_on_server and not self.server_updates and kvstore.is_master_worker:
            raise ConfigError("update_on_server=True but the global servers run no optimizer")
        # the servers' optimizer took these learning rates at set-up and keeps them: a change here (a scheduler)
        # never reaches it, which step() says once rather than let a schedule do nothing unnoticed
        self._servers_lrs = [g.get("lr") for g in optimizer.param_groups] if update_on_server else None
        # only the master worker's schedule reaches the servers (GeoMX's set_optimizer): another worker's must be
        # the same, or it would think it trains under a schedule the servers do not run
        self._servers_schedule = kvstore.server_lr_schedule if update_on_server else None
        if kvstore.is_master_worker:        # its own call set them up
            self._servers_schedule = schedule.to_spec() if schedule is not None else None
        elif schedule is not None and update_on_server and schedule.to_spec() != self._servers_schedule:
            raise ConfigError(f"server_lr_schedule={schedule!r} on this worker, but the global servers run "
                              f"{self._servers_schedule or 'no schedule'} (the master worker's): give every worker "
                              f"the master worker's, or leave it out on the workers")
        unlike = _groups_unlike_defaults(optimizer) if update_on_server else []
        if unlike:
            message = (f"with update_on_server=True the global servers run one set of hyper-parameters, the "
                       f"optimizer's defaults ({_numbers(optimizer.defaults)}): {'; '.join(unlike)} are not "
                       f"applied there")
            _warn(message, stacklevel=3)
        self.sync.setup(kvstore, self.params, num_samples=num_samples)
        attach = getattr(self.sync, "attach_module", None)    # P3: waits per layer in the forward pass
        if attach is not None:
            attach(named_parameters if isinstance(named_parameters, torch.nn.Module) else None)
        metrics.ready()
        self.slowdown.compute_starts()

    @property
    def progress(self) -> int:
        """Training progress in steps, to measure a run's length by: step() calls, except with ESync, where
        workers take different numbers of local steps per round and a round counts as the slowest worker's."""
        progress = getattr(self.sync, "progress", None)
        return self.steps_taken if progress is None else progress

    @property
    def wan_rounds(self) -> tuple[int, int]:
        """(rounds that crossed the WAN, those whose round trip this worker waited out): what a report's lower
        bound charges one WAN round trip each. FSA and MixedSync: one round per step, waited for except under
        MixedSync's overlap; an algorithm (geomx.sync) counts its own (HFA: its global averages)."""
        rounds = getattr(self.sync, "wan_rounds", None)
        # a policy object of the user's that does not count them: one round per step, waited for
        return rounds if rounds is not None else (self.steps_taken, self.steps_taken)

    # the wrapped optimizer's own objects: a scheduler or a hook that changes them changes the wrapped optimizer
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigError("DistributedOptimizer cannot take new parameters after construction (each parameter is "
                          "a kvstore key, initialized by every worker): give the wrapped optimizer every group "
                          "before wrapping it")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.slowdown.compute_starts()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict, plus ``"geomx"``: the synchronization policy's state, the step
        count and this worker's compression streams (codec memory, error-feedback residuals). Call it after
        step() (not between backward() and step())."""
        state = self.optimizer.state_dict()
        sync_state = self.sync.state_dict() if callable(getattr(self.sync, "state_dict", None)) else None
        state[STATE_KEY] = {"steps_taken": self.steps_taken, "sync": sync_state, "wire": self.kv.wire_state_dict(),
                            "update_on_server": bool(self.server_updates)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` (or a plain optimizer state_dict: the wrapped optimizer's part only)."""
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        saved_on_server = (ours or {}).get("update_on_server")
        if saved_on_server is not None and saved_on_server != bool(self.server_updates):
            # the model and its optimizer lived on the servers or on the workers: resumed the other way, training
            # would go on from the wrong optimizer state (or none) without a word
            where = {True: "the global servers ran the optimizer (--update-on server)",
                     False: "the workers ran the optimizer (--update-on worker)"}
            raise ConfigError(f"the checkpoint was saved where {where[saved_on_server]}, but this run is set up "
                              f"where {where[bool(self.server_updates)]}: resume with the --update-on of the run "
                              f"it resumes")
        self.optimizer.load_state_dict(state_dict)
        if ours is None:
            return
        self.steps_taken = ours["steps_taken"]
        self.kv.load_wire_state_dict(ours.get("wire"))
        if ours["sync"] is not None:
            if not callable(getattr(self.sync, "load_state_dict", None)):
                raise ConfigError(f"the saved state has synchronization state, but {self.sync!r} cannot load it")
            self.sync.load_state_dict(ours["sync"])

    def step(self, closure=None):
        """One training step through the synchronization policy (FSA: wait for every parameter's result, then
        update locally or copy the servers' weights)."""
        if closure is not None:
            raise ConfigError("DistributedOptimizer.step does not take a closure")
        compute = self.slowdown.pause()
        if self._servers_lrs is not None:
            self._check_learning_rates()
        self.steps_taken += 1
        self._count_wait(self.sync.step(self.optimizer, compute_s=compute))
        self._record_counters()
        self.slowdown.compute_starts()

    def _check_learning_rates(self) -> None:
        now, then = [g.get("lr") for g in self.optimizer.param_groups], self._servers_lrs
        if now == then:
            return
        group = next((i for i, (a, b) in enumerate(zip(now, then, strict=False)) if a != b), min(len(now), len(then)))
        was = f"{then[group]:g}" if group < len(then) else "no group of its own"
        message = (f"the learning rate of parameter group {group} is {now[group] if group < len(now) else None} on "
                   f"this worker (an LR scheduler?), but with update_on_server=True the global servers run the "
                   f"optimizer with what it had at set-up ({was}): a schedule on the workers does not reach them"
                   + (f" (they run the master worker's server_lr_schedule, {self._servers_schedule})"
                      if self._servers_schedule is not None else
                      "; give them one with DistributedOptimizer(server_lr_schedule=geomx.WarmupCosine(...))"))
        _warn(message, stacklevel=4)
        self._servers_lrs = None        # said once

    def _record_counters(self) -> None:
        """Hand the policy's counters to the next step record."""
        metrics.set_wan_rounds(*self.wan_rounds)
        landings = getattr(self.sync, "landing_waits", None)
        if landings is not None:
            metrics.set_landings(landings.landings, landings.late, landings.waited_s)
        phases = getattr(self.sync, "wait_phases", None)     # a policy that breaks its waiting down by phase
        if phases is not None:
            metrics.set_wait_phases(phases)

    def record_resumed(self, step: int) -> None:
        """Write the ``resumed`` metrics record: training starts at ``step`` from the counters a checkpoint (or
        the running job) gave this worker, which reports subtract to count this run alone."""
        self._record_counters()
        metrics.resumed(step)

    def finish(self) -> None:
        """Call after the last step: lands what a synchronization algorithm still has on the way (HFA/DiLoCo
        with ``overlap``: the last global averages), so every worker ends on the same model (HFA/DiLoCo: when the
        last step ended a global period; stopped within one, each worker keeps its own steps since). Idempotent."""
        finish = getattr(self.sync, "finish", None)
        if finish is not None:
            self._count_wait(finish())
            self._record_counters()       # the last step record (written after it) counts its waits too

    def synchronize(self) -> list:
        """FSA: push what backward did not push and wait for all results (see geomx.sync.fsa.FSA.synchronize)."""
        synchronize = getattr(self.sync, "synchronize", None)
        if synchronize is None:
            raise ConfigError(f"{self.sync!r} synchronizes inside step(); synchronize() is FSA's")
        results, waited = synchronize()
        self._count_wait(waited)
        return results

    def _count_wait(self, waited: float) -> None:
        self.comm_wait_s += waited
        metrics.add_comm_wait(waited)


def _named(optimizer: torch.optim.Optimizer, named) -> list[tuple[str, torch.nn.Parameter]]:
    if named is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    if isinstance(named, torch.nn.Module):
        named = named.named_parameters()
    pairs = list(named)
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError("parameter names must be unique (they are the kvstore keys)")
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in pairs if id(p) not in in_optimizer and p.requires_grad]
    if missing:
        raise ConfigError(f"parameters {missing[:3]} are not in the wrapped optimizer")
    return pairs
