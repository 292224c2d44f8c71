"""P3 (GeoMX's ``ENABLE_P3=1``, ``geomx launch --sync p3``): the next forward pass overlaps the rest of the
synchronization, layer by layer.

FSA's ``step()`` waits for every parameter's reply before the next forward pass may start. Under P3 the servers
run the optimizer (each reply is a parameter's new weights), ``step()`` only makes sure every gradient is on its
way, and each module waits for its own parameters' replies in a forward pre-hook, just before it needs them. The
gradients travel tail first (:class:`geomx.sync.wire_order.TailFirst`, priorities honoured at the worker's send
queue, in the local and global servers' queues and on the emulated WAN's links): the last layers, as many bytes
as the uplink carries during a backward pass, in the order backward makes them, then the others first layers
first. So the uplink finishes whole uploads while backward runs, their replies come down meanwhile, the first
layers' weights come back first once it ends, and the forward pass starts while the rest are still on the wire.
The model after k steps is FSA's, bit for bit: the same replies land, only later.

Gradients leave from, and replies land in, buffers of P3's own (never ``.grad``, which the next backward pass or
``zero_grad(set_to_none=False)`` writes while the round is still on its way), and every parameter
lands before anything reads it outside a forward pass: ``model.state_dict()`` (a state-dict pre-hook),
``DistributedOptimizer.finish()`` / ``synchronize()`` / ``state_dict()``.
"""
from __future__ import annotations

import time

import torch

from geomx.compat import check_kvstore
from geomx.errors import ConfigError
from geomx.sync.fsa import FSA
from geomx.sync.settings import check
from geomx.sync.wire_order import TailFirst, check_tail_fraction


class P3(FSA):
    name = "p3"

    def __init__(self, *, backward_passes_per_step: int = 1, slice: int = 50_000) -> None:
        super().__init__(backward_passes_per_step=backward_passes_per_step)
        # each parameter travels in slices of at most this many elements (DistributedOptimizer initializes its
        # keys so), each its own key: a layer's first slices are summed and answered while its last still travel
        self.slice_elements = check(self.name, {"slice": slice}).slice
        self._landing: dict[int, tuple] = {}     # parameter index -> (handle, buffer): replies not yet applied
        self._waited = 0.0                       # seconds forward pre-hooks waited since the last step()
        self._in_step = False                    # step() is pushing what backward did not
        self._saved_tail_fraction = 1.0          # the tail's share set-up starts from (a state loaded before it)

    def __repr__(self) -> str:
        return f"P3(backward_passes_per_step={self.backward_passes_per_step}, slice={self.slice_elements})"

    def setup(self, kv, params: list[tuple[str, torch.nn.Parameter]], *, num_samples: float | None = None) -> None:
        super().setup(kv, params, num_samples=num_samples)
        check_kvstore(kv, self.name)
        self.order = TailFirst([p.numel() * p.element_size() if p.requires_grad else 0 for _, p in params],
                               tail_fraction=self._saved_tail_fraction)

    def attach_module(self, module: torch.nn.Module | None) -> None:
        """Hook every module that owns parameters: before its forward runs, its parameters' replies land."""
        if not isinstance(module, torch.nn.Module):
            raise ConfigError("p3 waits for each layer's weights in the forward pass, so it needs the model: "
                              "DistributedOptimizer(optimizer, model, ...)")
        index = {id(p): i for i, (_, p) in enumerate(self.params)}
        owned = {id(p) for p in module.parameters()}
        missing = [name for name, p in self.params if id(p) not in owned]
        if missing:
            raise ConfigError(f"p3: parameters {missing[:3]} belong to no module of the model given to "
                              f"DistributedOptimizer; no forward pass would land their weights")
        for m in module.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if own:
                m.register_forward_pre_hook(lambda _m, _args, own=own: self._wait_in_forward(own))
        module.register_state_dict_pre_hook(lambda *_: self._wait_in_forward(list(self._landing)))

    def step(self, optimizer: torch.optim.Optimizer, *, compute_s: float = 0.0) -> float:
        """Every gradient on its way; nothing waited for here (the forward pre-hooks wait). Returns the seconds
        the pre-hooks waited since the last step."""
        self._in_step = True                    # what is pushed now had no gradient from backward
        try:
            self._push_the_rest()
        finally:
            self._in_step = False
        self.order.end_backward(time.monotonic())
        self._landing.update(self._handles)
        self._handles.clear()
        self._passes.clear()
        self.steps += 1
        waited, self._waited = self._waited, 0.0
        return waited

    def synchronize(self) -> tuple[list, float]:
        raise ConfigError("p3 lands each parameter in the forward pass: call DistributedOptimizer.finish() to land "
                          "them all instead of synchronize()")

    def finish(self) -> float:
        return self.land_all()

    def land_all(self) -> float:
        """Apply every reply still on its way (before the model is read outside a forward pass)."""
        return self._land(list(self._landing))

    def state_dict(self) -> dict:
        self._wait_in_forward(list(self._landing))
        return {**super().state_dict(), "tail_fraction": self.order.tail_fraction}

    def load_state_dict(self, state: dict) -> None:
        # checked before anything is set: a refused state leaves the policy as it was
        fraction = check_tail_fraction(state["tail_fraction"]) if "tail_fraction" in state else None
        super().load_state_dict(state)
        if fraction is None:                  # a checkpoint of before the tail-first order
            return
        self._saved_tail_fraction = fraction
        if hasattr(self, "order"):              # set up already
            self.order = TailFirst(self.order.sizes, tail_fraction=fraction)

    # internals ----------------------------------------------------------------------------------------------
    def _push(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        if i in self._landing:                     # its previous reply first (a parameter no forward used)
            self._wait_in_forward([i])
        # a copy of its own: step() returns with the push maybe still unsent (sent without a copy), and the next
        # backward pass, or zero_grad(set_to_none=False), writes .grad in place; the reply lands in it as well
        sent = grad.detach().to("cpu", copy=True).contiguous()
        priority = self.order.begin_push(i, time.monotonic(), from_backward=not self._in_step)
        handle = self.kv.pushpull(self.params[i][0], sent, out=sent, priority=priority)
        # each part's landing, with its share of the bytes: the pace of the replies is read from them, and a
        # big parameter's parts land over a long time, most of them maybe before backward ends
        for part in handle.parts or [handle]:
            part.add_done_callback(lambda h, i=i: self.order.landed(i, time.monotonic(), share=h.share))
        self._handles[i] = (handle, sent)

    def _wait_in_forward(self, indices: list[int]) -> None:
        """Land ``indices`` between steps; the wait is counted at the next step()."""
        self._waited += self._land(indices)

    def _land(self, indices: list[int]) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for i in indices:
                entry = self._landing.pop(i, None)
                if entry is not None:
                    entry[0].wait()
                    self.params[i][1].copy_(entry[1])
        return time.perf_counter() - start
