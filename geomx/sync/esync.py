"""ESync (Li et al., IEEE TSC 2020): heterogeneous workers reach the synchronization point together.

A round: every worker takes local steps with the optimizer it wrapped, then the model deltas
(w - w_round_start) are averaged over all workers and added to the round's start model. The slowest worker
takes ``steps`` local steps per round; a worker k times faster takes round(k x steps), so nobody idles at the
average. ESync's state server measures every worker's time per step and hands out these counts; here the
state rides on the round itself: each worker pushes its measured time per step (compute, slowdown included)
into its slot of the key ``__geomx.esync.state``, and the global round returns every worker's time to every
worker, which then computes its own count for the next round (the same rule everywhere, no extra WAN round
trip, where ESync asks its state server over HTTP before every iteration). The first round, with nothing
measured, takes ``steps`` everywhere. Plain average over workers, as ESync does.

A run's length is counted in the slowest worker's steps (``progress`` = rounds x ``steps``), so every worker
stops after the same round.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from geomx.errors import ConfigError
from geomx.compat import check_kvstore
from geomx.sync.fusion import Fusion
from geomx.sync.settings import check, check_saved_algorithm

STATE_KEY = "__geomx.esync.state"
MAX_RATIO = 64          # a worker never takes more than this many times the slowest one's steps


class ESync:
    name = "esync"

    def __init__(self, *, steps: int = 1) -> None:
        self.steps = check(self.name, {"steps": steps}).steps
        self.rounds = 0
        self.schedule: list[int] = []     # this worker's local steps in each finished round
        self.local_steps = self.steps     # the current round's
        self._taken, self._compute_s = 0, 0.0

    def __repr__(self) -> str:
        return f"ESync(steps={self.steps})"

    @property
    def progress(self) -> int:
        return self.rounds * self.steps

    def setup(self, kv, params: list[tuple[str, torch.nn.Parameter]], *, num_samples: float | None = None) -> None:
        check_kvstore(kv, self.name)
        self.kv = kv
        self.params = [(n, p) for n, p in params if p.requires_grad]
        kv.init(STATE_KEY, np.zeros(kv.num_all_workers, np.float64))
        # dense model deltas travel fused (geomx.sync.fusion): a few buckets instead of a key per tensor
        self.fusion = Fusion.of(kv, "esync", self.params)
        if kv.is_master_worker:
            return
        index = os.environ.get("GEOMX_WORKER_INDEX", "")
        if not index.isdigit() or int(index) >= kv.num_all_workers:
            raise ConfigError(f"esync needs GEOMX_WORKER_INDEX (0..{kv.num_all_workers - 1}, set by geomx launch) to "
                              f"place its step time in the state, got {index!r}")
        self.index = int(index)
        self.start = [p.detach().clone() for _, p in self.params]    # the model at the round's start

    @property
    def wan_rounds(self) -> tuple[int, int]:
        """(cross-DC rounds started, those waited out): one per round, each waited for."""
        return self.rounds, self.rounds

    def step(self, optimizer: torch.optim.Optimizer, *, compute_s: float = 0.0) -> float:
        optimizer.step()
        self._taken += 1
        self._compute_s += compute_s
        if self._taken < self.local_steps:
            return 0.0
        started = time.perf_counter()
        n = self.kv.num_all_workers
        per_step = self._compute_s / self._taken
        state = np.zeros(n, np.float64)
        state[self.index] = per_step * n          # the servers divide by n: everyone reads every time back
        with torch.no_grad():
            deltas = [p.detach() - s for (_, p), s in zip(self.params, self.start, strict=False)]
        for h in [*self.fusion.pushpull(self.kv, deltas, deltas), self.kv.pushpull(STATE_KEY, state, out=state)]:
            h.wait()
        with torch.no_grad():
            for (_, p), s, d in zip(self.params, self.start, deltas, strict=False):
                s.add_(d)
                p.copy_(s)
        self.schedule.append(self._taken)
        self.rounds += 1
        slowest = float(state.max())
        ratio = slowest / per_step if per_step > 0 else 1.0
        self.local_steps = max(1, min(MAX_RATIO * self.steps, round(self.steps * ratio)))
        self._taken, self._compute_s = 0, 0.0
        return time.perf_counter() - started

    def state_dict(self) -> dict:
        """Rounds, this worker's schedule, the round under way (steps taken, compute measured) and its start
        model."""
        state = {"algorithm": self.name, "rounds": self.rounds, "schedule": list(self.schedule),
                 "local_steps": self.local_steps, "taken": self._taken, "compute_s": self._compute_s}
        if hasattr(self, "start"):          # the master worker trains nothing and has none
            state["start"] = [s.clone() for s in self.start]
        return state

    def load_state_dict(self, state: dict) -> None:
        check_saved_algorithm(self.name, state)
        self.rounds, self.schedule = state["rounds"], list(state["schedule"])
        self.local_steps, self._taken, self._compute_s = state["local_steps"], state["taken"], state["compute_s"]
        if "start" in state:
            self.start = [s.clone() for s in state["start"]]
