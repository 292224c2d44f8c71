"""Metrics as JSON lines in the run directory: one file per process, ``RUN_DIR/metrics/<role>-<dc>-<pid>.jsonl``.

A training script logs its own numbers with one call::

    geomx.metrics.log(step=step, loss=loss.item(), test_acc=acc)    # test_acc only when it evaluated

Every role also writes, on its own, what it counts where the bytes move. The schema (every record has ``t``,
Unix time in seconds, and ``kind``):

==========  ==========================================================================================
kind        fields
==========  ==========================================================================================
``start``   ``role``, ``dc``, ``pid``: first record of every file
``step``    ``step``; what the script passed (``loss``, ``test_acc``, ...); ``elapsed_s`` since the
            process's first record; ``comm_wait_s``: cumulative time the process waited for the network
            (``DistributedOptimizer.step``), so compute = elapsed - comm_wait; ``wan_rounds`` and
            ``wan_rounds_waited``: cross-DC rounds started so far, and those whose round trip the worker
            waited out (``DistributedOptimizer.wan_rounds``); with overlapped global averages (HFA/DiLoCo, D >=
            1) ``landings``, ``late_landings``, ``landing_wait_s``: those that reached their landing step, those
            not in yet there, and the seconds waited for them (``geomx.sync.averaging.LandingWaits``);
            ``wait_phases``: {phase: cumulative seconds} where the policy breaks its waiting down (HFA/DiLoCo:
            ``geomx.sync.averaging.WaitPhases``)
``ready``   ``elapsed_s``, ``comm_wait_s``: the worker is set up (joined, keys initialized, initial model
            pulled) and starts training; reports measure training from here
``resumed`` ``step``, and the cumulative counters of a step record (``wan_rounds``, ...): a worker that starts
            at ``step``, not 0 (``geomx launch --resume``, or restarted into the running job), with the
            counters its checkpoint restored; reports count this run's steps and rounds from them
``model``   ``keys``, ``dense_bytes``: fp32 bytes of every key this worker initialized (one dense copy)
``traffic`` ``sent``: {destination DC: bytes}, ``sent_messages``: {destination DC: count}, ``received``:
            bytes, cumulative counters of the process's van (header + tensor frames, as on the wire);
            ``send_queue``: messages waiting to be sent; servers add ``held_requests`` (pulls waiting for
            their round) and ``open_rounds``. Written every second and once more at exit.
==========  ==========================================================================================

Bytes between a node of DC X and one of DC Y count as WAN traffic X -> Y when X != Y (the central party,
``central``, is a DC of its own), LAN otherwise. Nothing is written when ``GEOMX_RUN_DIR`` is not set.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

METRICS_DIR = "metrics"
RESULT_PREFIX = "result-"     # result-<dc>-<rank>.json: a worker's final figures (geomx.torch.loop.write_result)


def result_name(dc: str, rank: int) -> str:
    return f"{RESULT_PREFIX}{dc}-{rank}.json"

_lock = threading.Lock()
_writer: MetricsWriter | None = None
_comm_wait_s = 0.0
_wan_rounds: tuple[int, int] | None = None
_landings: dict[str, float] = {}
_wait_phases: dict[str, dict[str, float]] = {}


class MetricsWriter:
    """Append-only JSON-lines file of one process; safe to call from any thread."""

    def __init__(self, run_dir: str | os.PathLike, role: str, dc: str) -> None:
        folder = Path(run_dir) / METRICS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{role}-{_safe(dc)}-{os.getpid()}.jsonl"
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - the writer's lifetime; close() ends it
        self._lock = threading.Lock()
        self.started = time.time()
        self.write("start", role=role, dc=dc, pid=os.getpid())

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "kind": kind, **fields}, default=_plain)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def open_process_writer(run_dir: str | None, role: str, dc: str) -> MetricsWriter | None:
    """The process's writer (created once; None without a run directory)."""
    global _writer
    with _lock:
        if _writer is None and run_dir:
            _writer = MetricsWriter(run_dir, role, dc)
        return _writer


def add_comm_wait(seconds: float) -> None:
    """Called by whoever blocks on the network on behalf of training (DistributedOptimizer.step)."""
    global _comm_wait_s
    with _lock:
        _comm_wait_s += seconds


def set_wan_rounds(started: int, waited: int) -> None:
    """Called by DistributedOptimizer after every step: cross-DC rounds started so far, and those whose round
    trip the worker waited out (step records carry both; reports charge one round trip per waited round)."""
    global _wan_rounds
    _wan_rounds = (int(started), int(waited))


def set_landings(landings: int, late: int, waited_s: float) -> None:
    """Called by DistributedOptimizer after every step of an overlapped model average: how its global averages
    landed so far (step records carry them)."""
    global _landings
    _landings = {"landings": int(landings), "late_landings": int(late), "landing_wait_s": float(waited_s)}


def set_wait_phases(phases: dict[str, float]) -> None:
    """Called by DistributedOptimizer after every step of a policy that breaks its network wait down by phase
    (cumulative seconds; step records carry them)."""
    global _wait_phases
    _wait_phases = {"wait_phases": {name: float(v) for name, v in phases.items()}}


def comm_wait_s() -> float:
    return _comm_wait_s


def _policy_counters() -> dict[str, Any]:
    """The cumulative counters a step record carries besides the script's numbers (a checkpoint restores them)."""
    rounds = {} if _wan_rounds is None else {"wan_rounds": _wan_rounds[0], "wan_rounds_waited": _wan_rounds[1]}
    return {**rounds, **_landings, **_wait_phases}


def log(*, step: int, **numbers: Any) -> None:
    """Record one training step's numbers (loss, test_acc, ...). A no-op outside a run directory."""
    writer = _writer
    if writer is None:
        return
    writer.write("step", step=int(step), elapsed_s=time.time() - writer.started, comm_wait_s=_comm_wait_s,
                 **_policy_counters(), **numbers)


def resumed(step: int) -> None:
    """Record that this worker starts training at ``step``, not 0 (resumed from a checkpoint, or restarted into
    the running job), with the counters it starts from: a report counts the steps and rounds of this run from
    them, not from 0."""
    writer = _writer
    if writer is not None:
        writer.write("resumed", step=int(step), **_policy_counters())


def ready() -> None:
    """Mark the end of set-up (DistributedOptimizer does it once the initial model is pulled)."""
    writer = _writer
    if writer is not None:
        writer.write("ready", elapsed_s=time.time() - writer.started, comm_wait_s=_comm_wait_s)


def parse_record(line: str | bytes) -> dict | None:
    """One metrics line -> its record; None for a line cut short by a crash (or anything else)."""
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and "kind" in rec else None


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of one metrics file; a line cut short by a crash is skipped."""
    with open(path) as f:
        return [rec for rec in map(parse_record, f) if rec is not None]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _plain(value):
    try:
        return float(value)        # numpy and torch scalars
    except (TypeError, ValueError):
        return str(value)
