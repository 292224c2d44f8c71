"""DGA, delayed gradient averaging (Zhu et al., NeurIPS 2021), run by each worker in ``DistributedOptimizer``.

Every step a worker pushes its gradient g_t and goes on without waiting: the global average of step t is
applied D steps later, when the communication has had D steps of compute to hide behind. To keep the
model on the averaged trajectory, the worker swaps its own stale gradient for the average (the correction):

    step with   g_t - g_{t-D} + mean(g_{t-D})        (the first D steps: g_t alone, nothing has arrived)

With D = 0 this is FSA exactly (the mean itself); the wrapped optimizer (SGD, Adam...) takes the corrected
gradient as its gradient. Rounds are ordinary FSA rounds of the servers (dist_sync, no server optimizer).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from geomx.errors import ConfigError
from geomx.compat import check_kvstore
from geomx.sync.fusion import Fusion
from geomx.sync.settings import check, check_saved_algorithm


class DGA:
    name = "dga"

    def __init__(self, *, delay: int = 1) -> None:
        self.delay = check(self.name, {"delay": delay}).delay
        # per step: (handles, own gradients, buffers the means land in); no handles once landed (restored)
        self.in_flight: deque[tuple[list, list[torch.Tensor], list[torch.Tensor]]] = deque()
        self.steps = 0

    def __repr__(self) -> str:
        return f"DGA(delay={self.delay})"

    def setup(self, kv, params: list[tuple[str, torch.nn.Parameter]], *, num_samples: float | None = None) -> None:
        check_kvstore(kv, self.name)
        self.kv = kv
        self.params = [(n, p) for n, p in params if p.requires_grad]
        # dense gradients travel fused (geomx.sync.fusion): a few buckets instead of a key per tensor
        self.fusion = Fusion.of(kv, "dga", self.params)

    @property
    def wan_rounds(self) -> tuple[int, int]:
        """(cross-DC rounds started, round trips on the critical path): one round per step, and step k needs
        round k - D, so D + 1 round trips run side by side."""
        return self.steps, self.steps // (self.delay + 1)

    def step(self, optimizer: torch.optim.Optimizer, *, compute_s: float = 0.0) -> float:
        owns = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for _, p in self.params]
        means = [own.cpu().clone() for own in owns]       # sent, then overwritten by the mean
        handles = self.fusion.pushpull(self.kv, means, means, first_tensors_first=True)
        self.in_flight.append((handles, owns, means))
        self.steps += 1
        waited = 0.0
        if len(self.in_flight) > self.delay:
            started = time.perf_counter()
            arrived, stale, mean_of = self.in_flight.popleft()
            for h in arrived:
                h.wait()
            waited = time.perf_counter() - started
            with torch.no_grad():
                for (_, p), own, mean in zip(self.params, stale, mean_of, strict=True):
                    mean = mean.to(p.device)
                    if self.delay == 0:       # the mean itself: bit for bit FSA
                        p.grad = mean
                    else:                     # swap the stale own gradient for the mean
                        current = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                        p.grad = current.sub(own).add_(mean)
        optimizer.step()
        return waited

    def state_dict(self) -> dict:
        """The steps and the last D steps' gradients: each one's own and, waited for, its global mean."""
        history = []
        for handles, owns, means in self.in_flight:
            for h in handles:
                h.wait()
            history.append([(own.clone(), mean.clone()) for own, mean in zip(owns, means, strict=True)])
        return {"algorithm": self.name, "delay": self.delay, "steps": self.steps, "history": history}

    def load_state_dict(self, state: dict) -> None:
        check_saved_algorithm(self.name, state)
        if state["delay"] != self.delay:
            raise ConfigError(f"the saved dga state has delay {state['delay']}, this optimizer {self.delay}")
        self.steps = state["steps"]
        self.in_flight = deque(([], [own.clone() for own, _ in sent], [mean.clone() for _, mean in sent])
                               for sent in state["history"])
