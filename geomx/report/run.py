"""Read one run directory (written by ``geomx launch``) into plain numbers: what every report and plot uses.

Sources, all in the run directory:

* ``launch.json``: the topology and the WAN profile (rates, RTT) of the run;
* ``metrics/*.jsonl``: every process's records (schema in :mod:`geomx.metrics`);
* ``wan_links.json``: the WAN emulator's per-link counters and throughput series (emulated runs only);
* ``result-*.json``: a worker's final figures, written when it finished (geomx.torch.loop.write_result), and
  ``aborted.jsonl``: the members whose own abort stopped a tier (geomx.dropped): whether the run ended.

A run's evaluation metric is what its workers logged: ``test_acc`` (higher is better) or, for a language model
(examples/train_lm.py), ``val_loss`` (lower is better).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from geomx.dropped import ABORTED_FILE, DropLog
from geomx.errors import GeomxError
from geomx.metrics import METRICS_DIR, RESULT_PREFIX, read_records
from geomx.profiles import CENTRAL_DC


# a target is reached within this relative tolerance: above the float noise between two summation orders of the same
# training (3.6e-6 measured), below what a loss curve still falling moves in a few steps (far below one image in 360)
REACH_RTOL = 1e-5


@dataclass(frozen=True)
class EvalMetric:
    """What a run's evaluations measure, and which way is better."""
    key: str                      # the step records' field
    label: str
    higher_is_better: bool

    def reached(self, value: float, target: float) -> bool:
        """At or beyond ``target``, within a relative REACH_RTOL: flat PS and HiPS FSA run the same algorithm but
        sum the workers' gradients in a different order, so their losses at a step differ in the fifth digit
        (measured: 3.1093297 against 3.1093185), and "not reached" must not turn on that."""
        slack = REACH_RTOL * abs(target)
        return value >= target - slack if self.higher_is_better else value <= target + slack

    def best(self, values):
        return max(values) if self.higher_is_better else min(values)


EVAL_METRICS = {m.key: m for m in (EvalMetric("test_acc", "test accuracy", True),
                                   EvalMetric("val_loss", "validation loss", False))}
ACCURACY = EVAL_METRICS["test_acc"]


@dataclass
class WorkerSeries:
    """One training process's step records, times relative to the run's training start."""
    dc: str
    pid: int
    start_step: int = 0             # the step it started training from: > 0 when resumed from a checkpoint
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)        # seconds since the run's first worker record
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float, float]] = field(default_factory=list)   # (step, time, the run's metric)
    eval_spent: list[float] = field(default_factory=list)   # per eval: seconds spent evaluating, this one included
    elapsed_s: float = 0.0          # the process's own clock at its last step record
    comm_wait_s: float = 0.0        # cumulative network wait at its last step record
    ready_t: float = 0.0            # set-up done (time since training start; 0 without a ready record)
    ready_elapsed_s: float = 0.0
    ready_comm_wait_s: float = 0.0
    # cross-DC rounds started in this run, at the last step (None: not recorded), and of those the ones whose
    # round trip the worker waited out; a resumed worker's counters went on from its checkpoint's, taken off here
    wan_rounds: int | None = None
    wan_rounds_waited: int | None = None
    first_wan_step: int | None = None       # the first step record that counts a cross-DC round
    # overlapped global averages (HFA/DiLoCo, D >= 1), in this run: landed, late at their landing step, and
    # the seconds waited for them (None: not recorded)
    landings: tuple[int, int, float] | None = None
    # seconds waited by phase of the policy's work, in this run (None: not recorded)
    wait_phases: dict[str, float] | None = None

    @property
    def compute_s(self) -> float:
        """Time after set-up not spent waiting for the network (its evaluations included)."""
        return (self.elapsed_s - self.ready_elapsed_s) - (self.comm_wait_s - self.ready_comm_wait_s)

    @property
    def eval_s(self) -> float:
        """Time spent evaluating (the probe every few steps), all of it after set-up."""
        return self.eval_spent[-1] if self.eval_spent else 0.0

    @property
    def utilization(self) -> float:
        """The share of the training time, evaluations left out, not spent waiting for the network. Evaluations
        are neither training nor waiting: counted as compute, every 10 steps they lifted a model-averaging row's
        figure from 0.82 to 0.89."""
        training = self.elapsed_s - self.ready_elapsed_s - self.eval_s
        return max(0.0, self.compute_s - self.eval_s) / max(1e-9, training)


@dataclass
class Run:
    path: Path
    name: str
    manifest: dict
    workers: list[WorkerSeries]
    # (src DC, dst DC) -> bytes / messages handed to the network by every process of src DC
    sent: dict[tuple[str, str], int]
    sent_messages: dict[tuple[str, str], int]
    dense_bytes: int | None                  # one dense fp32 copy of the model (every initialized key)
    links: dict | None                       # wan_links.json, if the run had a WAN emulator
    start_t: float                           # Unix time of the first worker record
    server_queues: list[dict]                # traffic records of servers (held_requests, send_queue, ...)
    metric: EvalMetric = ACCURACY            # what the workers' evaluations measured
    resumed_at: int | None = None            # the step a resumed run started from (None: from the start)
    idle_workers: int = 0                    # workers that set up but recorded no step (resumed at the last step)
    # result-*.json files the workers wrote at the end (geomx.torch.loop.write_result; None: not read), and the
    # lines of aborted.jsonl: members whose own abort stopped a tier (geomx.dropped)
    results: int | None = None
    aborts: list[dict] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Steps trained in this run: a resumed run's start from its checkpoint's step, not from 0."""
        return max((w.steps[-1] - w.start_step for w in self.workers if w.steps), default=0)

    @property
    def wall_s(self) -> float:
        """Training wall time: first worker record to the last step record of any worker."""
        return max((w.times[-1] for w in self.workers if w.times), default=0.0)

    def wan_bytes(self, direction: str) -> int:
        """Bytes the roles sent across the WAN: ``up`` (DC -> central), ``down`` (central -> DC) or ``all``."""
        total = 0
        for (src, dst), n in self.sent.items():
            if src == dst:
                continue
            if direction == "all" or (direction == "up" and dst == CENTRAL_DC) or (
                    direction == "down" and src == CENTRAL_DC):
                total += n
        return total

    def link_bytes(self) -> dict[tuple[str, str], int]:
        """The emulator's count per directed link (empty without an emulator)."""
        if not self.links:
            return {}
        return {(lk["src_dc"], lk["dst_dc"]): lk["bytes"] for lk in self.links["links"].values()}


def load_run(path: str | Path) -> Run:
    path = Path(path)
    manifest_file = path / "launch.json"
    if not manifest_file.exists():
        raise GeomxError(f"{path} is not a geomx run directory (no launch.json; runs come from geomx launch)")
    manifest = json.loads(manifest_file.read_text())
    files = sorted((path / METRICS_DIR).glob("*.jsonl"))
    if not files:
        raise GeomxError(f"{path} has no metrics ({path / METRICS_DIR}/*.jsonl): was the run started by a geomx "
                         f"version that writes them, with GEOMX_RUN_DIR set?")
    workers: list[WorkerSeries] = []
    sent: dict[tuple[str, str], int] = {}
    sent_messages: dict[tuple[str, str], int] = {}
    dense: int | None = None
    queues: list[dict] = []
    raw_workers = []
    idle: list[dict | None] = []          # per worker set up without a step record: its resumed record, if any
    for f in files:
        records = read_records(f)
        if not records or records[0]["kind"] != "start":
            continue
        head = records[0]
        role, dc = head["role"], head["dc"]
        last_traffic = None
        for rec in records:
            if rec["kind"] == "traffic":
                last_traffic = rec
                if role in ("server", "global_server"):
                    queues.append({"role": role, "dc": dc, **rec})
            elif rec["kind"] == "model":
                # cumulative over this process's kv.init calls: the last record covers every key
                dense = max(dense or 0, int(rec["dense_bytes"]))
        if last_traffic is not None:
            for dst, n in last_traffic.get("sent", {}).items():
                sent[(dc, dst)] = sent.get((dc, dst), 0) + int(n)
            for dst, n in last_traffic.get("sent_messages", {}).items():
                sent_messages[(dc, dst)] = sent_messages.get((dc, dst), 0) + int(n)
        steps = [r for r in records if r["kind"] == "step"]
        ready = next((r for r in records if r["kind"] == "ready"), None)
        resumed = next((r for r in records if r["kind"] == "resumed"), None)
        if role == "worker" and steps:
            raw_workers.append((head, steps, ready, resumed))
        elif role == "worker" and (ready or resumed):
            idle.append(resumed)
    start_t = min((head["t"] for head, _, _, _ in raw_workers), default=0.0)
    metric = next((EVAL_METRICS[k] for k in EVAL_METRICS
                   if any(r.get(k) is not None for _, steps, _, _ in raw_workers for r in steps)), ACCURACY)
    for head, steps, ready, resumed in raw_workers:
        start = resumed if resumed is not None else inferred_start(steps)
        workers.append(_worker_series(head, steps, ready, start, start_t, metric))
    links_file = path / "wan_links.json"
    links = json.loads(links_file.read_text()) if links_file.exists() else None
    starts = [w.start_step for w in workers] + [int(r["step"]) for r in idle if r is not None]
    return Run(path=path, name=path.name, manifest=manifest, workers=workers, sent=sent,
               sent_messages=sent_messages, dense_bytes=dense, links=links, start_t=start_t,
               server_queues=queues, metric=metric, resumed_at=min(starts, default=0) or None,
               idle_workers=len(idle), results=len(list(path.glob(f"{RESULT_PREFIX}*.json"))),
               aborts=_aborts(path))


def _aborts(run_dir: Path) -> list[dict]:
    """The members whose own abort stopped a tier, in the order recorded (geomx.dropped's reader: a line cut short
    by a killed writer is skipped)."""
    log = DropLog(run_dir, file=ABORTED_FILE)
    log.refresh()
    return [{"member": log.members[pid], "reason": log.reasons[pid]} for pid in log.order]


def _worker_series(head: dict, steps: list[dict], ready: dict | None, start: dict, start_t: float,
                   metric: EvalMetric) -> WorkerSeries:
    """One worker's records as a series; ``start``: the step and counters it started this run from."""
    w = WorkerSeries(dc=head["dc"], pid=head["pid"], start_step=int(start.get("step", 0)))
    if ready is not None:
        w.ready_t, w.ready_elapsed_s = ready["t"] - start_t, float(ready["elapsed_s"])
        w.ready_comm_wait_s = float(ready["comm_wait_s"])
    for r in steps:
        t = r["t"] - start_t
        w.steps.append(int(r["step"]))
        w.times.append(t)
        if r.get("loss") is not None:
            w.losses.append(float(r["loss"]))
        if r.get("wan_rounds") is not None and _since(r, start, "wan_rounds") > 0 and w.first_wan_step is None:
            w.first_wan_step = int(r["step"])
        if r.get(metric.key) is not None:
            w.evals.append((int(r["step"]), t, float(r[metric.key])))
            w.eval_spent.append((w.eval_spent[-1] if w.eval_spent else 0.0) + float(r.get("eval_s") or 0.0))
    last = steps[-1]
    w.elapsed_s = float(last.get("elapsed_s", 0.0))
    w.comm_wait_s = float(last.get("comm_wait_s", 0.0))       # the process's own: never restored
    _take_counters_in_run(w, last, start)
    return w


def _take_counters_in_run(w: WorkerSeries, last: dict, start: dict) -> None:
    """The policy's cumulative counters at ``last``, less those the run started from (a checkpoint's)."""
    if last.get("wan_rounds") is not None:
        w.wan_rounds = _since(last, start, "wan_rounds")
        w.wan_rounds_waited = _since(last, start, "wan_rounds_waited")
    if last.get("landings") is not None:
        w.landings = (_since(last, start, "landings"), _since(last, start, "late_landings"),
                      float(last["landing_wait_s"]) - float(start.get("landing_wait_s", 0.0)))
    if last.get("wait_phases") is not None:
        started = start.get("wait_phases") or {}
        w.wait_phases = {name: float(v) - float(started.get(name, 0.0)) for name, v in last["wait_phases"].items()}


def _since(record: dict, start: dict, counter: str) -> int:
    """A cumulative count of ``record`` less the value it started this run from."""
    return int(record[counter]) - int(start.get(counter, 0))


def inferred_start(steps: list[dict]) -> dict:
    """Where a worker recorded before ``resumed`` records existed started: step 0 and every counter at 0, unless
    its step records begin above step 1 and go one step at a time (geomx.torch.loop logs every step; a script
    that logs every tenth step starts at 10 from 0). Then it resumed at the step before its first record, and its
    counters there are its first record's prorated over the steps so far: exact for a count that grows every step
    (FSA's rounds), off by at most one for a count that grows every K steps (HFA's global averages) when the
    first step trained completed one."""
    if len(steps) < 2 or steps[0]["step"] <= 1 or steps[1]["step"] != steps[0]["step"] + 1:
        return {}
    first, start_step = steps[0], steps[0]["step"] - 1
    share = start_step / first["step"]
    start: dict = {"step": start_step}
    for counter in ("wan_rounds", "wan_rounds_waited", "landings", "late_landings"):
        if first.get(counter) is not None:
            start[counter] = round(first[counter] * share)
    if first.get("landing_wait_s") is not None:
        start["landing_wait_s"] = first["landing_wait_s"] * share
    if first.get("wait_phases") is not None:
        start["wait_phases"] = {name: v * share for name, v in first["wait_phases"].items()}
    return start
