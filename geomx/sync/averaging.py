"""Model-averaging synchronization, run by each worker inside ``DistributedOptimizer``: HFA and DiLoCo.

HFA (GeoMX's Hierarchical Frequency Aggregation, HierFAVG): every worker takes local steps with the optimizer
it wrapped; every K1 steps the DC averages its workers' models (a DC-only round: the local server answers,
nothing crosses the WAN); every K2 DC averages the model is averaged across all DCs instead (one WAN round
trip per K1 x K2 steps). Every worker starts from the master worker's model; optimizer states stay local.

Weights: a worker's model counts by its number of samples (``num_samples``), so DCs weigh by their data;
``weights="equal"`` gives every DC the same weight in the global average (GeoMX's 1/G). Workers send their
models pre-scaled by their share, and the servers only sum, so no server needs to know the algorithm.

DiLoCo (Douillard et al. 2023): the same inner loop, but the global average does not replace the model: the
pseudo-gradient (global model before - average) feeds an outer Nesterov SGD (lr 0.7, momentum 0.9) whose
step gives the new global model. Every worker runs the identical outer step on identical inputs, so they
stay equal without a server-side optimizer. With outer lr 1 and momentum 0 it is HFA.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from geomx.errors import ConfigError
from geomx.sync.settings import check

WEIGHTS_KEY = "__geomx.sync.weights"


class HFA:
    name = "hfa"

    def __init__(self, *, k1: int = 1, k2: int = 1, weights: str = "samples") -> None:
        s = check(self.name, {"k1": k1, "k2": k2, "weights": weights})
        self.k1, self.k2, self.weights = s.k1, s.k2, s.weights
        self.steps = 0               # local steps taken
        self.dc_averages = 0         # K1 boundaries passed (each one a DC or a global average)
        self.global_averages = 0
        self.kv = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k1={self.k1}, k2={self.k2}, weights={self.weights!r})"

    # set-up ---------------------------------------------------------------------------------------------------
    def setup(self, kv, params: list[tuple[str, torch.nn.Parameter]], *, num_samples: float | None = None) -> None:
        """After the initial model was pulled: check the deployment, learn every worker's share."""
        if kv.type != "dist_sync":
            raise ConfigError(f"{self.name} averages models synchronously and needs a dist_sync kvstore, not "
                              f"{kv.type!r}")
        if kv.server_updates:
            raise ConfigError(f"{self.name} averages models: the global servers must not run an optimizer "
                              f"(no update_on_server / kv.set_optimizer)")
        if kv.cfg.topology != "hips" and (self.k2 > 1 or self.weights == "equal"):
            raise ConfigError(f"{self.name} with K2 = {self.k2} and {self.weights!r} weights needs DC rounds, i.e. the "
                              f"hips topology (the flat topology has no local servers); use K2 = 1 and samples")
        self.kv = kv
        self.params = [(n, p) for n, p in params if p.requires_grad]
        kv.init(WEIGHTS_KEY, np.zeros(2, np.float64))
        if kv.is_master_worker:
            return
        samples = 1.0 if num_samples is None else float(num_samples)
        if not samples > 0:
            raise ConfigError(f"num_samples must be > 0, got {num_samples}")
        n_all = kv.num_all_workers
        # one global round tells every worker the total of samples and the number of DCs
        mean = kv.pushpull(WEIGHTS_KEY, np.array([samples, 1.0 / kv.num_workers])).wait()
        total, dcs = mean[0] * n_all, int(round(mean[1] * n_all))
        dc_total = samples
        if kv.num_workers > 1 and kv.cfg.topology == "hips":
            dc_total = float(kv.pushpull(WEIGHTS_KEY, np.array([samples, 0.0]), scope="dc").wait()[0])
        self.dc_scale = samples / dc_total
        share = samples / total if self.weights == "samples" else self.dc_scale / dcs
        self.global_scale = n_all * share      # the global servers divide the sum by every worker
        self.start()

    def start(self) -> None:
        """The model is the global initial model: the base of the next global average's deltas."""
        self.base = [p.detach().clone() for _, p in self.params]

    # every step -----------------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *, compute_s: float = 0.0) -> float:
        """One training step: the local step, then an average when one is due. Returns the seconds spent
        waiting for the network."""
        optimizer.step()
        return self.after_step()

    def after_step(self) -> float:
        """Called after each local optimizer step; returns the seconds spent waiting for the network."""
        self.steps += 1
        if self.steps % self.k1:
            return 0.0
        self.dc_averages += 1
        started = time.perf_counter()
        if self.dc_averages % self.k2:
            if self.kv.num_workers > 1:       # a DC of one worker is its own average
                models = [p.data for _, p in self.params]
                self.average("dc", self.dc_scale, models, models)
        else:
            self.global_averages += 1
            self.global_average()
        return time.perf_counter() - started

    def global_average(self) -> None:
        models = [p.data for _, p in self.params]
        self.global_mean(models)
        self.base = [m.clone() for m in models]

    def global_mean(self, into: list[torch.Tensor]) -> None:
        """The weighted mean of every worker's model, into ``into``. Under gradient compression the models
        travel as their change since ``base``, the model every worker started the round from: a codec built
        for gradients, with its residual, compresses a change, not a model. Callers set the next ``base``."""
        if not compressed(self.kv):
            self.average(None, self.global_scale, [p.data for _, p in self.params], into)
            return
        with torch.no_grad():
            deltas = [p.detach() - b for (_, p), b in zip(self.params, self.base)]
        self.average(None, self.global_scale, deltas, deltas)
        with torch.no_grad():
            for b, d, out in zip(self.base, deltas, into):
                out.copy_(b + d)

    def average(self, scope: str | None, scale: float, tensors: list[torch.Tensor],
                into: list[torch.Tensor]) -> None:
        """Push every one of ``tensors`` (a model, or its change) times ``scale``; the sum over the DC (scope
        "dc") or the mean over all workers (the global servers divide by them) lands in ``into``."""
        names = [n for n, _ in self.params]
        with torch.no_grad():
            # scale 1 (equal shares): the tensor itself is sent, zero-copy (we wait before touching it)
            values = [t if scale == 1.0 else t * scale for t in tensors]
        handles = self.kv.pushpull(names, values, out=into, scope=scope)
        for h in handles:
            h.wait()


class DiLoCo(HFA):
    name = "diloco"

    def __init__(self, *, k1: int = 1, k2: int = 1, weights: str = "samples", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9) -> None:
        s = check(self.name, {"k1": k1, "k2": k2, "weights": weights, "outer_lr": outer_lr,
                              "outer_momentum": outer_momentum})
        super().__init__(k1=s.k1, k2=s.k2, weights=s.weights)
        self.outer_lr, self.outer_momentum = s.outer_lr, s.outer_momentum

    def __repr__(self) -> str:
        return (f"DiLoCo(k1={self.k1}, k2={self.k2}, weights={self.weights!r}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum})")

    def start(self) -> None:
        super().start()
        # the global model, kept apart from the parameters the inner optimizer moves
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for _, p in self.params]
        m = self.outer_momentum
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=m, nesterov=m > 0)

    def global_average(self) -> None:
        averaged = [torch.empty_like(p) for _, p in self.params]
        self.global_mean(averaged)
        with torch.no_grad():
            for a, avg, (_, p) in zip(self.anchor, averaged, self.params):
                a.grad = a.detach() - avg           # the pseudo-gradient
            self.outer.step()
            for a, (_, p) in zip(self.anchor, self.params):
                p.copy_(a)
            self.base = [a.detach().clone() for a in self.anchor]    # the next round's deltas start here


def compressed(kv) -> bool:
    """Whether the deployment compresses gradients on some tier (the master worker's setting)."""
    policy = kv.compression or {}
    return any((policy.get(tier) or {}).get("type", "none") != "none" for tier in ("lan", "wan", "small"))


ALGORITHMS = {"hfa": HFA, "diloco": DiLoCo}
