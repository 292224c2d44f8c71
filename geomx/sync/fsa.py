"""FSA, fully synchronous gradient aggregation: the default policy of ``DistributedOptimizer``, in the same place
PyTorch's DDP puts its default ``allreduce_hook``.

Every gradient is pushed from a backward hook as soon as backward produced it, at a priority that makes them
cross in the order backward made them, the last layers first (``step()`` waits for them all, so another order
buys nothing, and each upload finishing in turn lets its reply come down while backward still runs:
geomx.sync.wire_order).
``step()`` waits for every result and either steps the wrapped optimizer on the mean gradient over all workers of
all DCs (worker-side update) or copies the weights the global servers computed (a server optimizer). MixedSync
(``dist_async``) is the same policy: only the servers' answer differs.

Gradient accumulation: with ``backward_passes_per_step`` k, the hook pushes after the k-th backward pass,
the sum of the k passes (``.grad`` accumulates them, as in single-process PyTorch: scale the loss by 1 / k for
their mean). A (k+1)-th backward pass before ``step()`` is an error naming the fix: its gradient would land in
the buffer already on the wire and be lost.
"""
from __future__ import annotations

import time

import torch

from geomx.errors import ConfigError
from geomx.sync.fusion import Fusion, GradientBuckets
from geomx.sync.settings import check_backward_passes, check_saved_algorithm
from geomx.sync.wire_order import backward_order


class FSA:
    name = "fsa"

    def __init__(self, *, backward_passes_per_step: int = 1) -> None:
        self.backward_passes_per_step = check_backward_passes(backward_passes_per_step)
        self._handles: dict[int, tuple] = {}      # parameter index -> (handle, buffer the reply lands in)
        self._passes: dict[int, int] = {}         # parameter index -> backward passes since the last step
        self.steps = 0

    def __repr__(self) -> str:
        return f"FSA(backward_passes_per_step={self.backward_passes_per_step})"

    def setup(self, kv, params: list[tuple[str, torch.nn.Parameter]], *, num_samples: float | None = None) -> None:
        self.kv, self.params = kv, params
        self.server_updates = kv.server_updates
        self.priorities = backward_order(len(params))
        self._index = {id(p): i for i, (_, p) in enumerate(params)}
        for _, p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.buckets = self._plan_buckets()

    def _plan_buckets(self) -> GradientBuckets | None:
        """Dense mean gradients travel fused (geomx.sync.fusion) where the servers only sum them: synchronous,
        worker-side update. A server optimizer keeps each parameter's weights under its own key (what a restarted
        worker pulls), and MixedSync's servers answer per key; those push a key per parameter, as every round
        does under a codec that must see each tensor as it is (decided once: the deployment's codecs are known
        from the first init on and never change)."""
        if self.server_updates or self.kv.type != "dist_sync" or not Fusion.fuses(self.kv):
            return None
        trainable = [i for i, (_, p) in enumerate(self.params) if p.requires_grad]
        fusion = Fusion.of(self.kv, "gradients", [self.params[i] for i in trainable])
        return GradientBuckets(fusion, trainable, self.priorities) if fusion.buckets else None

    def step(self, optimizer: torch.optim.Optimizer, *, compute_s: float = 0.0) -> float:
        """Wait for every parameter's result, then update (locally, or by copying the servers' weights)."""
        results, waited = self.synchronize()
        self.steps += 1
        with torch.no_grad():
            for (_, p), value in zip(self.params, results, strict=True):
                if value is None:
                    continue
                if self.server_updates:
                    p.copy_(value)
                else:
                    p.grad = value if value.device == p.device else value.to(p.device)
        if not self.server_updates:
            optimizer.step()
        return waited

    @property
    def wan_rounds(self) -> tuple[int, int]:
        """(cross-DC rounds started, those whose round trip the worker waited out): one round per step, waited
        for except under MixedSync's overlap (the local server answers before the WAN round)."""
        overlapped = self.kv.type == "dist_async" and self.kv.cfg.mixedsync != "wait"
        return self.steps, 0 if overlapped else self.steps

    def synchronize(self) -> tuple[list, float]:
        """Push what backward did not push (parameters without a gradient this step push zeros, so the round
        completes everywhere) and wait for all results. Returns, per parameter, the tensor its gradient was
        pushed from, now holding the reply (mean gradient, or new weights when the servers update), and the
        seconds waited."""
        self._push_the_rest()
        start = time.perf_counter()
        results = []
        for i in range(len(self.params)):
            entry = self._handles.pop(i, None)
            if entry is not None:
                entry[0].wait()
            results.append(entry[1] if entry is not None else None)
        self._passes.clear()
        return results, time.perf_counter() - start

    def state_dict(self) -> dict:
        if self._handles or (self.buckets is not None and self.buckets.pending):
            raise ConfigError("state_dict() between backward() and step(): gradients are on the wire; save after "
                              "step()")
        return {"algorithm": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        check_saved_algorithm(self.name, state)
        self.steps = state["steps"]

    # internals ----------------------------------------------------------------------------------------------
    def _push_the_rest(self) -> None:
        """Push every gradient backward did not push (zeros for a parameter without one this step, so that the
        round completes everywhere)."""
        for i, (_, p) in enumerate(self.params):
            if p.requires_grad and i not in self._handles:
                self._send(i, p, p.grad if p.grad is not None else torch.zeros_like(p))

    def _on_grad(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        passes = self._passes[i] = self._passes.get(i, 0) + 1
        k = self.backward_passes_per_step
        if passes > k:
            raise ConfigError(f"backward pass {passes} before step() for parameter {self.params[i][0]!r}, but "
                              f"DistributedOptimizer pushed its gradient after {k} (backward_passes_per_step={k}): "
                              f"call step() after every {k} backward pass(es), or pass "
                              f"backward_passes_per_step={passes} to sum {passes} passes")
        if passes == k and i not in self._handles:
            self._send(i, p, p.grad)

    def _send(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Push parameter ``i``'s gradient: into its bucket where it has one, else alone."""
        if self.buckets is not None and i in self.buckets.bucket_of:
            self.buckets.add(self.kv, i, grad, self._handles)
        else:
            self._push(i, p, grad)

    def _push(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        # zero-copy both ways: the reply lands in the buffer the gradient was sent from, which nothing writes
        # before step() (a further backward pass is refused above)
        if grad.device.type != "cpu" or not grad.is_contiguous():
            grad = grad.detach().cpu().contiguous()
        self._handles[i] = (self.kv.pushpull(self.params[i][0], grad, out=grad, priority=self.priorities[i]), grad)

