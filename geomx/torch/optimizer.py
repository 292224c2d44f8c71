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

Tuning: gradients are pushed with priority ``-index`` (first layers first), so the tensors the next forward
pass needs first travel first on a congested link. ``backward_passes_per_step`` > 1 accumulates several
backward passes locally before pushing (fewer, larger WAN rounds).
"""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from geomx import metrics
from geomx.errors import ConfigError
from geomx.sync import create as create_sync
from geomx.sync.slowdown import Slowdown


class DistributedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]] | None = None, *,
                 kvstore=None, update_on_server: bool = False, backward_passes_per_step: int = 1, sync=None,
                 num_samples: float | None = None) -> None:
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if kvstore is None:
            import geomx.kvstore
            kvstore = geomx.kvstore.create()
        self.optimizer, self.kv = optimizer, kvstore
        self.backward_passes_per_step = backward_passes_per_step
        self.params = _named(optimizer, named_parameters)
        self._index = {id(p): i for i, (_, p) in enumerate(self.params)}
        self._handles: dict[int, object] = {}
        self._passes: dict[int, int] = {}
        self.comm_wait_s = 0.0      # time step() spent waiting for the network (cumulative)
        self.sync = create_sync(sync)    # None: FSA / MixedSync (gradients pushed from hooks); else a policy
        if self.sync is not None and update_on_server:
            raise ConfigError(f"{self.sync!r} updates on the workers; it cannot run with update_on_server")
        if self.sync is not None and backward_passes_per_step != 1:
            raise ConfigError(f"{self.sync!r} steps on every step() call; accumulate gradients yourself instead of "
                              f"backward_passes_per_step={backward_passes_per_step}")
        self.slowdown = Slowdown.from_env()
        self.steps_taken = 0        # step() calls
        if update_on_server and kvstore.is_master_worker:
            kvstore.set_optimizer(optimizer)
        names = [n for n, _ in self.params]
        kvstore.init(names, [p.detach() for _, p in self.params])
        kvstore.pull(names, out=[p.data for _, p in self.params])
        kvstore.waitall()
        self.server_updates = kvstore.server_updates
        if update_on_server and not self.server_updates and kvstore.is_master_worker:
            raise ConfigError("update_on_server=True but the global servers run no optimizer")
        if self.sync is not None:
            self.sync.setup(kvstore, self.params, num_samples=num_samples)
        else:
            for _, p in self.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad)
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
        if rounds is not None:
            return rounds
        overlapped = self.kv.type == "dist_async" and self.kv.cfg.mixedsync != "wait"
        return self.steps_taken, 0 if overlapped else self.steps_taken

    # the wrapped optimizer's API ---------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.slowdown.compute_starts()

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state) -> None:
        self.optimizer.load_state_dict(state)

    def step(self, closure=None):
        """Wait for every parameter's result, then update (locally, or by copying the servers' weights)."""
        if closure is not None:
            raise ConfigError("DistributedOptimizer.step does not take a closure")
        compute = self.slowdown.pause()
        self.steps_taken += 1
        if self.sync is not None:
            waited = self.sync.step(self.optimizer, compute_s=compute)
            self.comm_wait_s += waited
            metrics.add_comm_wait(waited)
            metrics.set_wan_rounds(*self.wan_rounds)
            self.slowdown.compute_starts()
            return
        results = self.synchronize()
        with torch.no_grad():
            for (_, p), value in zip(self.params, results, strict=False):
                if value is None:
                    continue
                if self.server_updates:
                    p.copy_(value)
                else:
                    p.grad = value if value.device == p.device else value.to(p.device)
        if not self.server_updates:
            self.optimizer.step()
        metrics.set_wan_rounds(*self.wan_rounds)
        self.slowdown.compute_starts()

    def finish(self) -> None:
        """Call after the last step: lands what a synchronization algorithm still has on the way (HFA/DiLoCo
        with ``overlap``: the last global average), so every worker ends on the same model. Idempotent."""
        finish = getattr(self.sync, "finish", None)
        if finish is not None:
            waited = finish()
            self.comm_wait_s += waited
            metrics.add_comm_wait(waited)

    def synchronize(self) -> list:
        """Push what backward did not push (parameters without a gradient this step push zeros, so the
        round completes everywhere) and wait for all results: per parameter, the tensor its gradient was
        pushed from, now holding the reply (mean gradient, or new weights when the servers update)."""
        for i, (_, p) in enumerate(self.params):
            if p.requires_grad and i not in self._handles:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                self._push(i, p, grad)
        start = time.perf_counter()
        results = []
        for i, _ in enumerate(self.params):
            entry = self._handles.pop(i, None)
            if entry is not None:
                entry[0].wait()
            results.append(entry[1] if entry is not None else None)
        waited = time.perf_counter() - start
        self.comm_wait_s += waited
        metrics.add_comm_wait(waited)
        self._passes.clear()
        return results

    # internals ----------------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        self._passes[i] = self._passes.get(i, 0) + 1
        if self._passes[i] == self.backward_passes_per_step and i not in self._handles:
            grad = p.grad if self.backward_passes_per_step == 1 else p.grad / self.backward_passes_per_step
            self._push(i, p, grad)

    def _push(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        # zero-copy both ways: the reply lands in the buffer the gradient was sent from, which nothing writes
        # before step() (the next backward comes after it)
        if grad.device.type != "cpu" or not grad.is_contiguous():
            grad = grad.detach().cpu().contiguous()
        self._handles[i] = (self.kv.pushpull(self.params[i][0], grad, out=grad, priority=-i), grad)


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
