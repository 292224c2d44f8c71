"""Worker checkpoints of a training loop, and resuming from them (issue 16's "checkpoints", worker side).

Every ``every`` steps, and at every step the global servers declare a checkpoint round (``--checkpoint-seconds``,
``declared``: geomx.cluster.checkpoint_clock), each training worker writes ``worker-<index>-step-<N>.pt`` into
``directory``, atomically (temporary file, fsync, rename): the model, the :class:`DistributedOptimizer` (the wrapped
optimizer's state and the synchronization algorithm's: DiLoCo's outer momentum, HFA's round counters...),
any other object with ``state_dict`` (a learning-rate schedule), the local steps taken and torch's RNG. It keeps
the last ``keep`` of its own files.

Resuming (``geomx launch --resume RUN_DIR`` sets ``GEOMX_RESUME_FROM`` to that run's checkpoint directory,
``--resume-step N`` sets ``GEOMX_RESUME_STEP`` to go back to an earlier one): every worker loads the latest
step that *every* worker of the saved run checkpointed, so that all of them
restart from the same model, whichever worker died first. Under synchronous training (FSA, or any algorithm
whose rounds all workers take together) workers are at most one checkpoint apart, which ``keep=2`` covers. The
data position is restored by replaying the batch order without computing (``skip``), so the resumed run sees
exactly the batches the uninterrupted one would have: with deterministic kernels the result is bit-identical.

With ``--update-on server`` the model and its optimizer live on the global servers, which checkpoint them at the
same steps (geomx.cluster.server_checkpoint); the worker's file then keeps its step and data position. What is
not here yet: checkpoints on storage other than a directory every worker can read (one host, or a shared file
system, given as a path or a ``file://`` URL).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geomx.errors import ConfigError
from geomx.statefile import numbered_files, write_atomically

_FILE = re.compile(r"worker-(\d+)-step-(\d+)\.pt$")
FORMAT = "geomx-worker-checkpoint/1"


class Checkpointer:
    """Saves and restores one worker's training state; see the module docstring."""

    def __init__(self, directory: str | os.PathLike, *, worker: int, workers: int, every: int, keep: int = 2,
                 declared: Callable[[int], bool] | None = None, resume_from: str | os.PathLike | None = None,
                 resume_step: int | None = None, **stateful: Any) -> None:
        if every < 0 or keep < 1:
            raise ConfigError(f"checkpoint every {every} steps keeping {keep}: every must be >= 0 and keep >= 1")
        for name, obj in stateful.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ConfigError(f"checkpoint part {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        self.directory = Path(directory)
        self.worker, self.workers, self.every, self.keep, self.declared = worker, workers, every, keep, declared
        self.resume_from = Path(resume_from) if resume_from else None
        self.resume_step = resume_step
        self.stateful = stateful

    # saving -------------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether to save after ``step``: every ``every`` steps, or the servers declared it (either asks)."""
        if step <= 0:
            return False
        return (self.every > 0 and step % self.every == 0) or (self.declared is not None and self.declared(step))

    def save(self, step: int, *, local_steps: int) -> Path:
        """Write this worker's state at progress ``step`` (``local_steps`` batches consumed) and prune."""
        self.directory.mkdir(parents=True, exist_ok=True)
        state = {"format": FORMAT, "worker": self.worker, "workers": self.workers, "step": step,
                 "local_steps": local_steps, "torch_rng": torch.get_rng_state(),
                 "parts": {name: _loadable(obj.state_dict()) for name, obj in self.stateful.items()}}
        path = self.directory / checkpoint_name(self.worker, step)
        write_atomically(path, lambda f: torch.save(state, f))
        for old in sorted(steps_saved(self.directory).get(self.worker, []))[:-self.keep]:
            (self.directory / checkpoint_name(self.worker, old)).unlink(missing_ok=True)
        return path

    # resuming -----------------------------------------------------------------------------------------------
    def restore(self) -> int:
        """Load ``resume_step``, else the latest step every worker of the saved run has (0 and nothing loaded
        without ``resume_from``); returns the local steps (batches) to skip."""
        if self.resume_from is None:
            return 0
        step = common_step(self.resume_from, self.workers, self.resume_step)
        path = self.resume_from / checkpoint_name(self.worker, step)
        state = torch.load(path, weights_only=True)
        if state.get("format") != FORMAT or state.get("workers") != self.workers:
            raise ConfigError(f"{path}: a checkpoint of {state.get('workers')} workers (format "
                              f"{state.get('format')!r}); this run has {self.workers}")
        missing = set(self.stateful) - set(state["parts"])
        if missing:
            raise ConfigError(f"{path} has no state for {sorted(missing)}")
        for name, obj in self.stateful.items():
            obj.load_state_dict(_restored(state["parts"][name]))
        torch.set_rng_state(state["torch_rng"])
        return int(state["local_steps"])


def checkpoint_name(worker: int, step: int) -> str:
    return f"worker-{worker}-step-{step}.pt"      # what _FILE matches


_NDARRAY = "__ndarray__"


def _loadable(obj: Any) -> Any:
    """``obj`` with numpy scalars as Python numbers (HFA's weights are numpy floats) and numpy arrays as
    tensors marked for :func:`_restored` (compression residuals): ``torch.load`` with ``weights_only=True``,
    which never runs code from the file, refuses numpy objects."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.array(obj))}       # a copy: the saved state must not change
    if isinstance(obj, dict):
        return {k: _loadable(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):          # not a named tuple: its constructor takes fields, not an iterable
        return type(obj)(_loadable(v) for v in obj)
    return obj


def _restored(obj: Any) -> Any:
    """The inverse of :func:`_loadable` for arrays (the numbers stay numbers)."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _NDARRAY in obj:
            return obj[_NDARRAY].numpy()
        return {k: _restored(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_restored(v) for v in obj)
    return obj


def steps_saved(directory: Path) -> dict[int, list[int]]:
    """worker index -> the steps it has checkpoint files for."""
    return numbered_files(directory, _FILE)


def common_step(directory: Path, workers: int, step: int | None = None) -> int:
    """The latest step that each of ``workers`` workers has a checkpoint of in ``directory``; with ``step``,
    that step, checked."""
    found = steps_saved(directory)
    absent = [w for w in range(workers) if w not in found]
    saved_workers = _saved_workers(directory, found)
    if saved_workers is not None and saved_workers != workers:
        raise ConfigError(f"cannot resume from {directory}: its checkpoints are of a run of {saved_workers} workers, "
                          f"this run has {workers}: resume with the topology of the run it resumes (--dcs, "
                          f"--workers-per-dc)")
    if absent:
        raise ConfigError(f"cannot resume from {directory}: no checkpoint of worker(s) {absent} (found workers "
                          f"{sorted(found)}; was the run started with --checkpoint-every or --checkpoint-seconds?)")
    common = set.intersection(*(set(found[w]) for w in range(workers)))
    if step is not None and step not in common:
        raise ConfigError(f"cannot resume from {directory} at step {step}: every worker has only steps "
                          f"{sorted(common) or 'none in common'}")
    if not common:
        raise ConfigError(f"cannot resume from {directory}: the workers share no checkpointed step "
                          f"({ {w: sorted(s) for w, s in sorted(found.items())} })")
    return max(common) if step is None else step


def _saved_workers(directory: Path, found: dict[int, list[int]]) -> int | None:
    """How many workers the run that wrote ``directory``'s checkpoints had (each file says), if it holds any."""
    if not found:
        return None
    worker = min(found)
    try:
        # mapped, not read: only the header's count is wanted, and each worker loads its own file next
        saved = torch.load(directory / checkpoint_name(worker, max(found[worker])), weights_only=True, mmap=True)
    except Exception:       # unreadable: the resume itself names it
        return None
    workers = saved.get("workers") if isinstance(saved, dict) else None
    return workers if isinstance(workers, int) else None
