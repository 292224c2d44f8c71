"""Model-averaging synchronization, run by each worker inside ``DistributedOptimizer``: HFA and DiLoCo.

HFA (GeoMX's Hierarchical Frequency Aggregation, HierFAVG): every worker takes local steps with the optimizer
it wrapped; every K1 steps the DC averages its workers' models (a DC-only round: the local server answers,
nothing crosses the WAN); every K2 DC averages the model is averaged across all DCs instead (one WAN round
trip per K1 x K2 steps). Every worker starts from the master worker's model; optimizer states stay local.

Weights: a worker's model counts by its number of samples (``num_samples``), so DCs weigh by their data;
``weights="equal"`` gives every DC the same weight in the global average (GeoMX's 1/G). Workers send their
models pre-scaled by their share, and the servers only sum, so no server needs to know the algorithm.

Overlap (``overlap`` D >= 1, Streaming-DiLoCo style): the global average no longer stops training. At a
global boundary each worker sends its model (or change) and goes on with local steps; D DC periods (D x K1
steps) later it adopts the result while keeping its own progress since the send: w = avg + keep x (w - w_sent),
``overlap_keep`` (keep) 1 by default; 0.5 trained better in every one of 6 runs measured (docs/benchmarks.md).
The WAN round is hidden as long as D x K1 steps of compute outlast it (a transpacific 27 MB model average:
about 4.5 s). D may exceed K2 (up to 4 x K2): several averages then travel at once, each landing D DC
periods after it left, oldest first, which hides a round longer than a global period. Within a DC every
worker lands the same average at the same step, and the DC average that follows brings them together again.
D = 0 (default) waits for the average at the boundary. Each worker counts the averages that were not in yet at
their landing step and the time it waited for them (``landing_waits``, in every step record; ``geomx report``
shows them): the sign that D is too short for the WAN. The seconds spent in each kind of averaging work that
stops training (DC average, DC send and landing, global average, send and landing: ``wait_phases``) go into
the step records too, so a report says which one to overlap next.

DC overlap (``dc_overlap`` S in [1, K1], K2 >= 2): a DC-only average travels S local steps behind training. At
a DC boundary each worker sends a copy of its model to its local server and goes on; S steps later it adopts
w = avg + (w - w_sent), the steps taken meanwhile kept in full (S = K1: at the next DC boundary). Without it
every DC round waits for the DC's slowest worker and for the local server, which on a fast step is most of the
time not spent computing (docs/benchmarks.md: the tiny LM's control row computed 52% of its time on 2 cores, 72%
on 16). One step is enough to hide a LAN round and most of a sibling's lag, and costs the average less than a
whole period late. The workers of a DC then differ by their own steps since the send, which the next average
folds in; S <= K1, so a DC average always lands by the next boundary and a global average starts from models
that include it.

DiLoCo (Douillard et al. 2023): the same inner loop, but the global average does not replace the model: the
pseudo-gradient (global model before - average) feeds an outer Nesterov SGD (lr 0.7, momentum 0.9) whose
step gives the new global model. Every worker runs the identical outer step on identical inputs, so they
stay equal without a server-side optimizer. With outer lr 1 and momentum 0 it is HFA.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np
import torch

from geomx.compat import check_kvstore
from geomx.errors import ConfigError
from geomx.sync.fusion import Fusion, PackedRound, bucket_bytes_for, compressed
from geomx.sync.settings import check, check_saved_algorithm, check_saved_options

WEIGHTS_KEY = "__geomx.sync.weights"


class HFA:
    name = "hfa"
    # what a saved state depends on: its counters count K1 and K2 boundaries, its averages in flight land overlap DC
    # periods (a DC one dc_overlap steps) after they left, and its shares are the weights'
    SAVED_OPTIONS: ClassVar[tuple[str, ...]] = ("k1", "k2", "overlap", "dc_overlap", "weights")

    def __init__(self, *, k1: int = 1, k2: int = 1, weights: str = "samples", overlap: int = 0,
                 overlap_keep: float = 1.0, dc_sync: str = "models", dc_overlap: int = 0) -> None:
        s = check(self.name, {"k1": k1, "k2": k2, "weights": weights, "overlap": overlap,
                              "overlap_keep": overlap_keep, "dc_sync": dc_sync, "dc_overlap": dc_overlap})
        self.k1, self.k2, self.weights, self.overlap, self.dc_sync = s.k1, s.k2, s.weights, s.overlap, s.dc_sync
        self.overlap_keep, self.dc_overlap = s.overlap_keep, s.dc_overlap
        self.flights: deque[InFlight] = deque()     # global averages travelling (overlap > 0), oldest first
        self.dc_flight: InFlight | None = None      # the DC average travelling (dc_overlap)
        self._dc_round: PackedRound | None = None    # dc_overlap's buffers (model sent, result), made once
        self._free_rounds: list[PackedRound] = []    # global averages' buffers, free for the next one to leave
        self.steps = 0               # local steps taken
        self.dc_averages = 0         # K1 boundaries passed (each one a DC or a global average)
        self.global_averages = 0
        # overlapped global averages that reached their landing step, those the workers had to wait for
        # (late: the round trip outlasted the D DC periods it travelled behind), and the seconds waited for them
        self.landings = LandingWaits()
        self.waits = WaitPhases()
        self.kv = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(k1={self.k1}, k2={self.k2}, weights={self.weights!r}, "
                f"overlap={self.overlap}, overlap_keep={self.overlap_keep}, dc_sync={self.dc_sync!r}, "
                f"dc_overlap={self.dc_overlap})")

    # set-up ---------------------------------------------------------------------------------------------------
    def setup(self, kv, params: list[tuple[str, torch.nn.Parameter]], *, num_samples: float | None = None) -> None:
        """After the initial model was pulled: check the deployment, learn every worker's share."""
        check_kvstore(kv, self.name, k2=self.k2, weights=self.weights)
        if self.dc_sync == "gradients" and kv.cfg.topology != "hips":
            raise ConfigError(f"{self.name} dc_sync='gradients' (GEOMX_HFA_DC_SYNC) averages gradients in DC rounds, "
                              f"which the {kv.cfg.topology!r} topology has none of (GEOMX_TOPOLOGY, --topology): use "
                              f"hips")
        self.kv = kv
        self.params = [(n, p) for n, p in params if p.requires_grad]
        kv.init(WEIGHTS_KEY, np.zeros(2, np.float64))
        # dense averages travel fused (geomx.sync.fusion): a few buckets instead of a key per tensor; a DC-only
        # round's buckets may be larger than one that crosses the WAN
        self.fusion = Fusion.of(kv, "average", self.params)
        self.dc_fusion = self.fusion
        if bucket_bytes_for(kv, crosses_wan=False) != self.fusion.bucket_bytes:
            self.dc_fusion = Fusion.of(kv, "average-dc", self.params, crosses_wan=False)
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
        waited = 0.0
        if self.dc_sync == "gradients" and self.kv.num_workers > 1:    # a DC of one has its mean gradient
            started = time.perf_counter()
            self.dc_gradient_average()
            waited = self.waits.add("dc_average", started) - started
        optimizer.step()
        return waited + self.after_step()

    def dc_gradient_average(self) -> None:
        """``dc_sync="gradients"``: the DC's workers step on their mean gradient (a DC-only round), so they keep
        one optimizer state and one model, as data-parallel training within the DC does. A parameter without a
        gradient this step counts zeros, so the round completes in the DC."""
        with torch.no_grad():
            for _, p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for _, p in self.params]
        for h in self.dc_fusion.pushpull(self.kv, grads, grads, scale=self.dc_scale, scope="dc"):
            h.wait()

    def after_step(self) -> float:
        """Called after each local optimizer step; returns the seconds spent waiting for the network."""
        self.steps += 1
        started = now = time.perf_counter()
        # the DC average sent S steps ago lands first (S <= K1: by this boundary at the latest)
        if self.dc_flight is not None and self.steps - self.dc_flight.period >= self.dc_overlap:
            self.land_dc()
            now = self.waits.add("dc_landing", now)
        if self.steps % self.k1:
            return now - started
        self.dc_averages += 1
        # then the global averages due here (D = K2: the previous one lands as the next leaves)
        while self.flights and self.dc_averages - self.flights[0].period == self.overlap:
            self.land(scheduled=True)
            now = self.waits.add("global_landing", now)
        if self.dc_averages % self.k2:
            # a DC of one worker is its own average; one that averages its gradients has one model already
            if self.kv.num_workers > 1 and self.dc_sync == "models":
                if self.dc_overlap:
                    self.send_dc()
                    now = self.waits.add("dc_send", now)
                else:
                    self.dc_average()
                    now = self.waits.add("dc_average", now)
        else:
            self.global_averages += 1
            if not self.overlap:
                self.global_average()
                now = self.waits.add("global_average", now)
            else:
                self.send_global()
                now = self.waits.add("global_send", now)
        return now - started

    @property
    def landing_waits(self) -> LandingWaits | None:
        """How the overlapped global averages landed (None without overlap: every average is waited for)."""
        return self.landings if self.overlap else None

    @property
    def wait_phases(self) -> dict[str, float]:
        """Seconds spent so far in each kind of averaging work that stopped training (:class:`WaitPhases`)."""
        return asdict(self.waits)

    @property
    def wan_rounds(self) -> tuple[int, int]:
        """(cross-DC rounds started, those whose round trip the worker waits out): the global averages; with
        ``overlap`` their round trips run behind local steps."""
        return self.global_averages, 0 if self.overlap else self.global_averages

    def finish(self) -> float:
        """Land the global averages still travelling (overlap > 0), e.g. after the last step; returns the
        seconds waited. Without it, a run that ends between a send and its landing ignores that average.

        Several in flight (D > K2): the earlier ones only move the global model (DiLoCo's outer steps, in order),
        and the last one alone lands in the model, keeping the steps taken since it left. Landing each in turn
        had kept each one's ``w - w_sent`` of this worker's own, so the workers ended apart; the last average is
        of models every earlier one would only have brought together (HFA: the weighted mean of those leftovers
        is 0). So a run that ends at a global boundary ends on one model on every worker, as with D <= K2."""
        started = now = time.perf_counter()
        if self.dc_flight is not None:
            self.land_dc()
            now = self.waits.add("dc_landing", now)
        while self.flights:
            self.land(into_model=len(self.flights) == 1)
            now = self.waits.add("global_landing", now)
        return now - started

    # saving and restoring --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Counters, the round's base model, the worker's shares, and the global averages still travelling
        (waited for, not yet adopted: loading them lands each at the same step as it would have)."""
        state = {"algorithm": self.name, "options": self._saved_options(), "steps": self.steps,
                 "dc_averages": self.dc_averages,
                 "global_averages": self.global_averages, "landings": asdict(self.landings),
                 "wait_phases": asdict(self.waits),
                 "in_flight": [flight.state_dict() for flight in self.flights],
                 # its period: the step it left at (states saved on 2026-11-28 held "dc_in_flight", the DC period)
                 "dc_in_flight_step": None if self.dc_flight is None else self.dc_flight.state_dict()}
        if hasattr(self, "base"):          # the master worker trains nothing and has none
            state.update(base=_clones(self.base), dc_scale=self.dc_scale, global_scale=self.global_scale)
        return state

    def _saved_options(self) -> dict:
        return {k: getattr(self, k) for k in self.SAVED_OPTIONS}

    def load_state_dict(self, state: dict) -> None:
        check_saved_algorithm(self.name, state)
        check_saved_options(self.name, state.get("options"), self._saved_options())   # absent before 2026-12-05
        self.steps, self.dc_averages = state["steps"], state["dc_averages"]
        self.global_averages = state["global_averages"]
        self.landings = LandingWaits(**state.get("landings", {}))      # absent from states saved before 2026-11-27
        self.waits = WaitPhases(**state.get("wait_phases", {}))        # absent from states saved before 2026-11-28
        if "base" in state:
            self.base = _clones(state["base"])
            self.dc_scale, self.global_scale = state["dc_scale"], state["global_scale"]
        saved = state["in_flight"]          # a list; states saved before 2026-11-27 held one average or None
        saved = [] if saved is None else [saved] if isinstance(saved, dict) else saved
        self.flights = deque(InFlight.from_state_dict(flight) for flight in saved)
        dc_saved = state.get("dc_in_flight_step")
        self.dc_flight = None if dc_saved is None else InFlight.from_state_dict(dc_saved)
        by_period = state.get("dc_in_flight")       # saved on 2026-11-28: left at DC boundary ``period``
        if by_period is not None:
            self.dc_flight = InFlight.from_state_dict({**by_period, "period": by_period["period"] * self.k1})

    def global_average(self) -> None:
        """Wait for the global average of every worker's model and adopt it."""
        flight = self.start_global_mean([p.detach() for _, p in self.params])
        self.adopt(flight.land_into())
        self._release(flight)

    def adopt(self, averaged: list[torch.Tensor], flight: InFlight | None = None) -> None:
        """The global average of the models is in: the new global model (HFA: the average itself) becomes
        every worker's model and the next round's base. ``flight``: the average as it travelled behind training
        (overlap), whose record of the model sent gives the local steps taken meanwhile, kept on top times
        ``overlap_keep``. Every update in place: no copy of the model is made."""
        new = self.global_model(averaged)
        with torch.no_grad():
            for i, ((_, p), g) in enumerate(zip(self.params, new, strict=True)):
                if flight is None or flight.sent is None:
                    p.copy_(g)
                elif self.overlap_keep == 1.0:
                    flight.subtract_sent(i, p.add_(g))
                else:
                    flight.subtract_sent(i, p).mul_(self.overlap_keep).add_(g)
        self._rebase(new)

    def _rebase(self, new: list[torch.Tensor]) -> None:
        """``new`` becomes the base of the next rounds: copied into the base's own tensors, unless a compressed
        average still travelling was sent as a change from them (D > K2), which then keeps them."""
        if not any(f.base is self.base for f in self.flights):
            with torch.no_grad():
                for b, g in zip(self.base, new, strict=True):
                    b.copy_(g)
        else:
            self.base = [g.detach().clone() for g in new]

    def global_model(self, averaged: list[torch.Tensor]) -> list[torch.Tensor]:
        return averaged

    def start_global_mean(self, models: list[torch.Tensor]) -> InFlight:
        """Send ``models`` for the weighted global mean. They are packed once, times their share, into buffers
        of the flight's own (:class:`PackedRound`, reused once it landed), which stay its record of what was
        sent (``sent``), and the mean lands in its result buffers. Under gradient compression the models travel
        as their change since ``base``, the model every worker started the round from: a codec built for
        gradients, with its residual, compresses a change, not a model; the mean change lands, and landing adds
        ``base`` to it in place."""
        packed = self._free_rounds.pop() if self._free_rounds else PackedRound(self.fusion, self.kv, models)
        if compressed(self.kv):
            handles = packed.pushpull(self.kv, models, scale=self.global_scale, minus=self.base)
            flight = InFlight(handles, packed.result_views, deltas=packed.result_views, base=self.base)
            flight.sent_relative = True
        else:
            flight = InFlight(packed.pushpull(self.kv, models, scale=self.global_scale), packed.result_views)
        flight.sent, flight.sent_scale, flight.packed = packed.sent_views, self.global_scale, packed
        return flight

    def _release(self, flight: InFlight) -> None:
        """A flight was adopted: its buffers may carry the next global average."""
        if flight.packed is not None:
            self._free_rounds.append(flight.packed)
            flight.packed = None

    def send_global(self) -> None:
        flight = self.start_global_mean([p.detach() for _, p in self.params])
        flight.period = self.dc_averages
        self.flights.append(flight)

    def dc_average(self) -> None:
        """Wait for the DC's average of its workers' models and adopt it."""
        flight = self.start_dc_mean()
        with torch.no_grad():
            for (_, p), avg in zip(self.params, flight.land_into(), strict=True):
                p.copy_(avg)

    def start_dc_mean(self) -> InFlight:
        """Send the model for the DC's average. One DC average travels at a time, so its buffers are allocated
        once and reused; the scaled copy packed for sending is also the record of what was sent (no second copy
        of the model), and the average is read where it landed."""
        models = [p.detach() for _, p in self.params]
        if self._dc_round is None:
            self._dc_round = PackedRound(self.dc_fusion, self.kv, models, scope="dc")
        packed = self._dc_round
        flight = InFlight(packed.pushpull(self.kv, models, scale=self.dc_scale), packed.result_views)
        flight.sent, flight.sent_scale = packed.sent_views, self.dc_scale
        return flight

    def send_dc(self) -> None:
        """dc_overlap: send the model for the DC's average, adopted ``dc_overlap`` steps later."""
        self.dc_flight = self.start_dc_mean()
        self.dc_flight.period = self.steps      # a DC average: the step it left at

    def land_dc(self) -> None:
        """Adopt the DC average sent ``dc_overlap`` steps ago, keeping every step taken since in full."""
        flight, self.dc_flight = self.dc_flight, None
        averaged = flight.land_into()
        with torch.no_grad():
            for i, ((_, p), avg) in enumerate(zip(self.params, averaged, strict=True)):
                flight.subtract_sent(i, p.add_(avg))

    def land(self, *, scheduled: bool = False, into_model: bool = True) -> None:
        """Adopt the oldest global average in flight, waiting for it if need be. ``scheduled``: at its landing
        step (not at the end of the run, where waiting is expected), so it counts in ``landings``.
        ``into_model`` False (finish(), a later average in flight too): only the global model and the base move."""
        flight = self.flights.popleft()
        averaged = flight.land_into()
        if scheduled:
            self.landings.count(flight.waited_s)
        if into_model:
            self.adopt(averaged, flight)
        else:
            self._rebase(self.global_model(averaged))
        self._release(flight)


@dataclass
class LandingWaits:
    """How overlapped global averages landed: ``late`` of ``landings`` were not in yet at their landing step, and
    the workers waited ``waited_s`` for them. Many late landings mean the round trip outlasts the D DC periods
    it travels behind: a longer overlap (or K2) hides it. Only a landing that waited over ``LATE_S`` counts as
    late: waiting on handles that are done costs microseconds."""
    LATE_S: ClassVar[float] = 0.001
    landings: int = 0
    late: int = 0
    waited_s: float = 0.0

    def count(self, waited_s: float) -> None:
        self.landings += 1
        self.waited_s += waited_s
        self.late += waited_s > self.LATE_S


@dataclass
class WaitPhases:
    """Seconds a worker spent in each kind of averaging work that stops its training, cumulative: what
    ``geomx report`` breaks the network wait into. A waited-for round counts whole (its sends, the wait, the
    adoption); an overlapped one counts its send where it leaves and its landing (mostly waiting for what is
    not in yet) where it lands. The sum is the policy's share of ``DistributedOptimizer.comm_wait_s``."""
    dc_average: float = 0.0      # DC-only rounds waited for (models, or gradients before every step)
    dc_send: float = 0.0         # dc_overlap: packing and sending the model
    dc_landing: float = 0.0      # dc_overlap: waiting for the DC average and adopting it
    global_average: float = 0.0  # global rounds waited for (overlap 0)
    global_send: float = 0.0     # overlap: packing and sending the model or its change
    global_landing: float = 0.0  # overlap: waiting for the global average and adopting it

    def add(self, phase: str, since: float) -> float:
        """Charge the time since ``since`` (a perf_counter reading) to ``phase``; returns the reading now."""
        now = time.perf_counter()
        setattr(self, phase, getattr(self, phase) + now - since)
        return now


class InFlight:
    """An average on its way: the request handles, where the result lands, and (overlap) the model sent and
    when it left (``period``: a global average's DC period, a DC average's local step)."""

    def __init__(self, handles: list, into: list[torch.Tensor], *, deltas: list[torch.Tensor] | None = None,
                 base: list[torch.Tensor] | None = None) -> None:
        self.handles, self.into, self.deltas, self.base = handles, into, deltas, base
        self.sent: list[torch.Tensor] | None = None
        self.period = 0
        self.sent_scale = 1.0        # ``sent`` holds the model sent times this (a packed average: its share)
        self.sent_relative = False   # ``sent`` holds the model's change since ``base`` (a compressed average)
        self.packed: PackedRound | None = None      # the buffers it travels in, while it is not adopted
        self.waited_s = 0.0          # seconds land_into blocked on the network

    def state_dict(self) -> dict:
        """Waits for the result (it lands in ``into``, or ``deltas``), then copies everything."""
        for h in self.handles:
            h.wait()
        self.handles = []
        return {"into": _clones(self.into), "deltas": _clones(self.deltas), "base": _clones(self.base),
                "sent": _clones(self.sent), "sent_scale": self.sent_scale, "sent_relative": self.sent_relative,
                "period": self.period}

    @classmethod
    def from_state_dict(cls, state: dict) -> InFlight:
        """An average that has landed (no handles) but is not adopted yet."""
        flight = cls([], _clones(state["into"]), deltas=_clones(state["deltas"]), base=_clones(state["base"]))
        flight.sent, flight.period = _clones(state["sent"]), state["period"]
        flight.sent_scale = state.get("sent_scale", 1.0)       # absent from older states: the model sent as is
        flight.sent_relative = state.get("sent_relative", False)
        return flight

    def subtract_sent(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """``p`` less the ``i``-th tensor of the model sent, in place; returns ``p``."""
        p.sub_(self.sent[i], alpha=1.0 / self.sent_scale)
        if self.sent_relative:
            p.sub_(self.base[i])
        return p

    def land_into(self) -> list[torch.Tensor]:
        """Wait for the result; returns the averaged models (base + mean change, under compression)."""
        started = time.perf_counter()
        for h in self.handles:
            h.wait()
        self.waited_s += time.perf_counter() - started
        if self.deltas is not None:
            with torch.no_grad():
                for b, d, out in zip(self.base, self.deltas, self.into, strict=False):
                    torch.add(b, d, out=out)
        return self.into


class DiLoCo(HFA):
    name = "diloco"
    # loading the outer optimizer's state restores the lr and momentum it was saved with, whatever this one's
    SAVED_OPTIONS = (*HFA.SAVED_OPTIONS, "outer_lr", "outer_momentum")

    def __init__(self, *, k1: int = 1, k2: int = 1, weights: str = "samples", overlap: int = 0,
                 overlap_keep: float = 1.0, dc_sync: str = "models", dc_overlap: int = 0, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9) -> None:
        s = check(self.name, {"k1": k1, "k2": k2, "weights": weights, "overlap": overlap,
                              "overlap_keep": overlap_keep, "dc_sync": dc_sync, "dc_overlap": dc_overlap,
                              "outer_lr": outer_lr, "outer_momentum": outer_momentum})
        super().__init__(k1=s.k1, k2=s.k2, weights=s.weights, overlap=s.overlap, overlap_keep=s.overlap_keep,
                         dc_sync=s.dc_sync, dc_overlap=s.dc_overlap)
        self.outer_lr, self.outer_momentum = s.outer_lr, s.outer_momentum

    def __repr__(self) -> str:
        return (f"DiLoCo(k1={self.k1}, k2={self.k2}, weights={self.weights!r}, overlap={self.overlap}, "
                f"overlap_keep={self.overlap_keep}, dc_sync={self.dc_sync!r}, dc_overlap={self.dc_overlap}, "
                f"outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum})")

    def start(self) -> None:
        super().start()
        # the global model, kept apart from the parameters the inner optimizer moves
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for _, p in self.params]
        m = self.outer_momentum
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=m, nesterov=m > 0)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if hasattr(self, "anchor"):
            state.update(anchor=_clones([a.detach() for a in self.anchor]), outer=self.outer.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "anchor" in state:
            with torch.no_grad():
                for a, saved in zip(self.anchor, state["anchor"], strict=True):
                    a.copy_(saved)
            self.outer.load_state_dict(state["outer"])

    def global_model(self, averaged: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outer step on the pseudo-gradient (global model before - average) gives the new global model."""
        with torch.no_grad():
            for a, avg in zip(self.anchor, averaged, strict=False):
                a.grad = a.detach() - avg
            self.outer.step()
        return [a.detach() for a in self.anchor]


def _clones(tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """Copies that later in-place updates of the originals leave alone (saved state must not move)."""
    return None if tensors is None else [t.detach().clone() for t in tensors]
