"""``geomx report RUN_DIR``: one table per run, every figure computed from what the run recorded.

Training is measured from the moment the first worker finished set-up (``ready``: joined, keys initialized,
initial model pulled) to the last step; set-up is reported apart. A resumed run is measured alone: its steps
and its cumulative counters (rounds, landings, wait phases) count from where it resumed
(:func:`geomx.report.run.inferred_start`, the workers' ``resumed`` records). Definitions:

* accuracy at a step = mean test accuracy over the workers that evaluated it (the plots' curve); a language
  model's runs evaluate validation loss instead (``val_loss``, lower is better: "reaching" a target is getting
  at or below it; :class:`geomx.report.run.EvalMetric`); time to target = the first moment at which the mean
  of every worker's latest test accuracy is at or above the target (time-aligned: in dist_async a fast DC
  is at a later step than a slow one at the same moment, and its models count when they exist; in
  synchronous runs this is when the last worker evaluated the step);
* WAN bytes = bytes the roles handed to the network between different DCs (the emulator counts the same);
  per step = bytes from the first whole second of the emulator's per-second series after the *last* worker
  finished set-up / the steps begun after that moment, bytes counted from when the first of them began
  (counted from the first worker's set-up, another DC's initial model download, dense and one-time, would be
  charged to the steps; a step that began before and ended after sent its bytes before: not counted); fewer
  than MIN_STEADY_STEPS such steps: "too short to measure";
* compression ratio = the dense fp32 bytes the same protocol would move per step (one model copy up and one
  down per DC in HiPS, per worker in the flat topology, each counted for the steps it took: a DC dropped
  part-way counts for its share) / the measured WAN bytes per step;
* compute utilization = share of the workers' training time, their evaluations left out, not spent waiting for the
  network (an overlapped average in flight travels while a worker evaluates, so frequent evaluations hide WAN
  time from it: the small LM's K1=5/K2=2 row read 0.81 with one every 10 steps and 0.54 with one at the end);
* cross-DC rounds = what the workers' step records count (``wan_rounds``: every step in FSA and MixedSync,
  every global average in HFA/DiLoCo; runs recorded before the count existed: every step); round trips = one
  WAN RTT per round whose round trip a worker waits out (``wan_rounds_waited``: not HFA's overlapped global
  averages, not MixedSync's overlap, one in D + 1 for DGA); first cross-DC step = the first step whose record
  counts a round;
* landings (overlapped global averages, D >= 1) = those that reached their landing step, the most any worker
  counted; late = of those, the ones not in yet there (the worker waited: the round trip outlasted the D DC
  periods it travelled behind); waited = seconds per worker, the mean over workers (part of the waiting that
  compute utilization excludes); each late one = the mean wait per late landing, also in steps of this run's
  mean step time: about how many more steps of overlap would have hidden it;
* network wait by phase = the seconds per worker (mean over workers) the synchronization policy spent in
  each kind of its work that stopped training, where it records them (HFA/DiLoCo: DC averages waited for,
  overlapped DC sends and landings, global averages waited for, overlapped global sends and landings;
  ``geomx.sync.averaging.WaitPhases``), beside the whole network wait per worker;
* serial bound = compute time + the busiest directed WAN link's bytes / its rate + round trips: what a run
  that never overlaps communication with compute needs; overlapped bound = max(compute, busiest link's bytes
  / rate) + round trips: what no schedule can beat; efficiency = overlapped bound / measured training time
  (1.0: only the WAN or compute, whichever is longer, and the round trips cost time; never above 1).
"""
from __future__ import annotations

import math
from statistics import mean

from geomx.profiles import CENTRAL_DC
from geomx.report.run import EvalMetric, Run

MB = 1e6


def accuracy_curve(run: Run) -> list[tuple[int, float, float]]:
    """(step, mean time s, mean test accuracy) at every evaluated step, over the workers that evaluated it."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for w in run.workers:
        for step, t, acc in w.evals:
            by_step.setdefault(step, []).append((t, acc))
    return [(step, mean(t for t, _ in pts), mean(a for _, a in pts)) for step, pts in sorted(by_step.items())]


def time_to_accuracy(run: Run, target: float, *, without_evals: bool = False) -> tuple[int, float] | None:
    """(step, time s) of the first moment, once every worker has evaluated, at which the mean of the workers'
    latest evaluations (test accuracy; validation loss: at or below) reaches ``target``; the step is the one
    every worker had evaluated by then. In a synchronous run whose workers evaluate the same steps, a step is
    judged once every worker evaluated it: a mean of some workers' new evaluations and the others' old ones
    had been taken for the old step reaching the target.

    ``without_evals``: each worker's clock runs without the time it spent evaluating (``eval_s`` in its step
    records), this evaluation included. Evaluation is the benchmark's probe, not training: on a compute-bound
    run that evaluates every few steps it can cost more than the training steps themselves."""
    events = sorted((t - (w.eval_spent[k] if without_evals and w.eval_spent else 0.0), i, step, acc)
                    for i, w in enumerate(run.workers) for k, (step, t, acc) in enumerate(w.evals))
    shared = set.intersection(*({s for s, _, _ in w.evals} for w in run.workers)) if run.workers else set()
    step_by_step = run.manifest.get("mode") == "dist_sync" and bool(shared)
    latest: dict[int, tuple[int, float]] = {}
    for t, i, step, acc in events:
        latest[i] = (step, acc)
        if len(latest) < len(run.workers):
            continue
        steps = {s for s, _ in latest.values()}
        if step_by_step and len(steps) > 1:
            continue        # synchronous: this step is judged once the last worker has evaluated it
        if run.metric.reached(mean(a for _, a in latest.values()), target):
            return min(steps), t
    return None


def eval_at_step(run: Run, step: int) -> float | None:
    """The mean evaluation at ``step`` over the workers that evaluated it (None: nobody did)."""
    return next((value for s, _, value in accuracy_curve(run) if s == step), None)


def time_at_step(run: Run, step: int) -> float | None:
    """Seconds of training (from the first worker's set-up) until every worker had recorded ``step``."""
    ready_t = min((w.ready_t for w in run.workers), default=0.0)
    done = [next((t for s, t in zip(w.steps, w.times, strict=True) if s >= step), None) for w in run.workers]
    return None if not done or None in done else max(done) - ready_t


def eval_at_time(run: Run, seconds: float) -> float | None:
    """The mean of every worker's latest evaluation ``seconds`` into training (from the first worker's set-up);
    None when some worker had not evaluated by then."""
    cut = seconds + min((w.ready_t for w in run.workers), default=0.0)
    latest = [next((v for _, t, v in reversed(w.evals) if t <= cut), None) for w in run.workers]
    return None if not latest or None in latest else mean(latest)


def steady_start(run: Run) -> float:
    """When per-step WAN bytes start counting: the first whole second of the emulator's series after the last
    worker finished set-up. A prorated partial second could hold part of a DC's initial model download (tens
    of MB, against a few hundred kB per step of a sparsified run)."""
    all_ready_t = max((w.ready_t for w in run.workers), default=0.0)
    if not run.links:
        return all_ready_t
    offset = run.start_t - run.links["t0_unix"]          # emulator clock = run clock + offset
    return math.ceil(all_ready_t + offset) - offset


def training_link_bytes(run: Run, since_t: float) -> dict[tuple[str, str], float]:
    """Bytes per WAN link after ``since_t`` (s after training start), from the emulator's per-second series
    (the partial second is prorated); without an emulator, the roles' totals."""
    if not run.links:
        return {k: float(v) for k, v in run.sent.items() if k[0] != k[1]}
    cut = since_t + run.start_t - run.links["t0_unix"]      # seconds on the emulator's clock
    out = {}
    for lk in run.links["links"].values():
        total = 0.0
        for second, nbytes in enumerate(lk.get("series", [])):
            total += nbytes * min(1.0, max(0.0, second + 1 - cut))
        out[(lk["src_dc"], lk["dst_dc"])] = total
    return out


# fewer steps than this in the steady window and per-step WAN bytes are not measured: the emulator counts bytes per
# second, prorated within one, so a window of a step or so is mostly the guess of where that step's bytes fell
MIN_STEADY_STEPS = 2


def _steady_steps(run: Run, steady_t: float) -> list[tuple[int, float | None]]:
    """Per worker: (steps that began at or after ``steady_t``, when the first of them began; None: none did). A
    step begins when the one before it ended (the first this run: when the worker finished set-up); a step that
    merely ended after ``steady_t`` had sent part or all of its bytes before it (counted, a dense 20-step run
    read 1 step against 142 bytes and "2024x")."""
    out = []
    for w in run.workers:
        begins = [w.ready_t, *w.times[:-1]]
        counted = [b for b in begins if b >= steady_t]
        out.append((len(counted), counted[0] if counted else None))
    return out


def _steady_window(run: Run, link_bytes: dict[tuple[str, str], float], steps: int,
                   per_worker: list[tuple[int, float | None]]) -> tuple[dict[tuple[str, str], float], int]:
    """(bytes per WAN link, steps) that per-step WAN bytes divide: the steps that began after ``steady_start``
    (``per_worker``: _steady_steps), and the bytes from when the first of them began. Steps 0: too few to measure
    (MIN_STEADY_STEPS); the figures are then missing rather than the set-up's leftovers divided by a step or two."""
    if not run.links:
        return link_bytes, steps
    steady_steps = max((n for n, _ in per_worker), default=0)
    if steady_steps < MIN_STEADY_STEPS:
        return {}, 0
    return training_link_bytes(run, min(t for _, t in per_worker if t is not None)), steady_steps


def _senders_per_step(run: Run, hips: bool, steady_steps: int,
                      per_worker: list[tuple[int, float | None]] | None = None) -> float:
    """How many DCs (HiPS) or workers (flat) sent a dense copy each step, on average over the steps that per-step
    WAN bytes divide (``per_worker``: _steady_steps, None without an emulator: every step): a DC dropped part-way
    sent for the steps it took, not for all (counted whole, the dense baseline of a run that lost one of two DCs
    read 2.00x with no compression at all)."""
    counts = [n for n, _ in per_worker] if per_worker is not None else [len(w.times) for w in run.workers]
    taken: dict[str, int] = {}
    for i, (w, n) in enumerate(zip(run.workers, counts, strict=True)):
        who = w.dc if hips else str(i)
        taken[who] = max(taken.get(who, 0), n)
    if not steady_steps or not taken:
        return float(len(taken))
    return sum(min(n, steady_steps) for n in taken.values()) / steady_steps


def wan_rounds(run: Run) -> tuple[int, int, int | None]:
    """(cross-DC rounds, rounds whose round trip was waited out, first step that crossed the WAN; None: no step
    did), the most any worker recorded; a run recorded without the counts: one waited round per step."""
    recorded = [w for w in run.workers if w.wan_rounds is not None]
    if not recorded:
        return run.steps, run.steps, (run.resumed_at or 0) + 1 if run.steps else None
    first = [w.first_wan_step for w in recorded if w.first_wan_step is not None]
    return (max(w.wan_rounds for w in recorded), max(w.wan_rounds_waited for w in recorded),
            min(first) if first else None)


def landings(run: Run) -> tuple[int | None, int | None, float | None]:
    """(overlapped global averages landed, of which late, seconds waited for them per worker): the most any
    worker counted, and the mean wait; None where no worker recorded them (no overlap)."""
    recorded = [w.landings for w in run.workers if w.landings is not None]
    if not recorded:
        return None, None, None
    return max(n for n, _, _ in recorded), max(late for _, late, _ in recorded), mean(s for _, _, s in recorded)


def wait_per_late_landing(run: Run) -> float | None:
    """The mean over workers of each one's seconds waited per late landing (None: no late landing)."""
    per_worker = [s / late for _, late, s in (w.landings for w in run.workers if w.landings is not None) if late]
    return mean(per_worker) if per_worker else None


def wait_by_phase(run: Run) -> dict[str, float] | None:
    """The mean over workers of the seconds waited in each phase of the policy's work (None: not recorded)."""
    recorded = [w.wait_phases for w in run.workers if w.wait_phases is not None]
    if not recorded:
        return None
    return {phase: mean(r.get(phase, 0.0) for r in recorded) for phase in recorded[0]}


def planned_steps(run: Run) -> int | None:
    """The ``--steps N`` of the run's training command (launch.json), None when it names none."""
    cmd = run.manifest.get("command") or []
    try:
        return int(cmd[cmd.index("--steps") + 1])
    except (ValueError, IndexError, TypeError):
        return None


def outcome(run: Run) -> tuple[str, str | None]:
    """("complete" | "incomplete" | "failed", what is known of why; None when complete). Failed: a member's own
    abort stopped a tier (aborted.jsonl) and some worker wrote no result file. Incomplete: some worker wrote no
    result file (geomx.torch.loop.write_result, at the end) and the run shows it stopped early: another worker
    did write one, its steps fell short of the command's ``--steps``, or it trained none and was not resumed.
    A script that writes no result files and trained its steps is taken as complete."""
    workers = len(run.workers) + run.idle_workers
    if run.results is None or run.results >= workers > 0:
        return "complete", None
    wrote = f"{run.results} of {workers} workers wrote a result file"
    if run.aborts:
        first = run.aborts[0]
        return "failed", (f"{first.get('member', '?')} aborted ({first.get('reason', 'no reason given')}); "
                          f"{wrote} (aborted.jsonl)")
    planned, last = planned_steps(run), (run.resumed_at or 0) + run.steps
    if planned is not None and last < planned:
        return "incomplete", f"stopped at step {last} of {planned}; {wrote} (killed, timed out or hung?)"
    if run.results or (not run.steps and not run.resumed_at):
        return "incomplete", f"{wrote} (killed, timed out or hung?)"
    return "complete", None


def summarize(run: Run, target: float | None = None, target_metric: EvalMetric | None = None) -> dict:
    """The report's figures. ``target``: a value of ``target_metric`` to time (default: what the run evaluated);
    a run that evaluated something else reaches no target of it."""
    target_metric = target_metric or run.metric
    m = run.manifest
    wan = m.get("wan", {})
    steps = run.steps
    # training starts when the first worker is set up: in dist_async a DC trains while another still sets up
    ready_t = min((w.ready_t for w in run.workers), default=0.0)
    train_s = run.wall_s - ready_t
    curve = accuracy_curve(run)
    timed = target is not None and target_metric == run.metric
    reached = time_to_accuracy(run, target) if timed else None
    reached_train = time_to_accuracy(run, target, without_evals=True) if timed else None
    link_bytes = training_link_bytes(run, ready_t)
    per_worker = _steady_steps(run, steady_start(run)) if run.links else None     # both figures divide these
    steady, steady_steps = _steady_window(run, link_bytes, steps, per_worker)
    up = sum(v for (src, dst), v in steady.items() if dst == CENTRAL_DC and src != dst)
    down = sum(v for (src, dst), v in steady.items() if src == CENTRAL_DC and src != dst)
    senders = _senders_per_step(run, m.get("topology") == "hips", steady_steps, per_worker)
    dense_per_step = 2 * run.dense_bytes * senders if run.dense_bytes else None
    # every cross-DC link: up and down, and between DCs (a global server placed inside a DC)
    between = sum(v for (src, dst), v in steady.items() if CENTRAL_DC not in (src, dst) and src != dst)
    per_step = (up + down + between) / steady_steps if steady_steps else math.nan
    compute = mean(w.compute_s for w in run.workers) if run.workers else math.nan
    utilization = mean(w.utilization for w in run.workers) if run.workers else math.nan
    wire = _wire_time(link_bytes, wan)
    rtt = float(wan.get("rtt_s") or 0.0)
    rounds, waited_rounds, first_wan_step = wan_rounds(run)
    landed, late, landing_wait = landings(run)
    round_trips = waited_rounds * rtt
    overlapped = max(compute, wire) + round_trips
    final = curve[-1][2] if curve else math.nan
    best = run.metric.best([a for _, _, a in curve]) if curve else math.nan
    accuracy = run.metric.key == "test_acc"
    status, status_detail = outcome(run)
    return {
        "status": status, "status_detail": status_detail,
        "run": run.name, "topology": m.get("topology"), "mode": m.get("mode"), "wan": wan.get("profile"),
        "workers": len(run.workers) + run.idle_workers, "steps": steps, "resumed_at": run.resumed_at,
        "setup_s": ready_t, "train_s": train_s,
        "step_s": train_s / steps if steps else math.nan,
        "metric": run.metric.key, "metric_label": run.metric.label, "final_eval": final, "best_eval": best,
        "final_acc": final if accuracy else math.nan, "best_acc": best if accuracy else math.nan,
        "target": target, "target_metric": target_metric.key, "target_label": target_metric.label,
        "time_to_target_s": reached[1] - ready_t if reached else None,
        "steps_to_target": reached[0] if reached else None,
        "time_to_target_no_eval_s": reached_train[1] - ready_t if reached_train else None,
        "eval_s": mean(w.eval_s for w in run.workers) if run.workers else 0.0,
        "wan_bytes_total": run.wan_bytes("all"),
        "wan_bytes_up_per_step": up / steady_steps if steady_steps else math.nan,
        "wan_bytes_down_per_step": down / steady_steps if steady_steps else math.nan, "wan_bytes_per_step": per_step,
        "wan_bytes_between_dcs_per_step": between / steady_steps if steady_steps else math.nan,
        "dense_bytes": run.dense_bytes,
        "compression_ratio": dense_per_step / per_step if dense_per_step and per_step else math.nan,
        "wan_steady_steps": steady_steps,
        "compute_s": compute, "compute_utilization": utilization, "wire_s": wire, "wan_rounds": rounds,
        "wan_rounds_waited": waited_rounds, "first_wan_step": first_wan_step, "round_trips_s": round_trips,
        "landings": landed, "late_landings": late, "landing_wait_s": landing_wait,
        "wait_per_late_landing_s": wait_per_late_landing(run),
        "comm_wait_s": mean(w.comm_wait_s - w.ready_comm_wait_s for w in run.workers) if run.workers else math.nan,
        "wait_by_phase": wait_by_phase(run),
        "lower_bound_s": compute + wire + round_trips, "overlapped_bound_s": overlapped,
        "efficiency": overlapped / train_s if train_s > 0 else math.nan,
        "bytes_roles_vs_links": _consistency(run),
    }


def _wire_time(link_bytes: dict[tuple[str, str], float], wan: dict) -> float:
    """The busiest directed link's bytes / its rate. Links are full duplex and run side by side, and a
    partitioned round streams its reply while later parts still go up, so no run can beat this."""
    worst = 0.0
    for (src, dst), nbytes in link_bytes.items():
        if src == dst:
            continue
        rate = wan.get("downlink_bps") if src == CENTRAL_DC else wan.get("uplink_bps")   # profiles' rate_for
        if rate:              # not emulated (lan): the WAN costs nothing measurable
            worst = max(worst, nbytes * 8 / float(rate))
    return worst


def _consistency(run: Run) -> tuple[int, int] | None:
    """(bytes the roles sent across DCs, bytes the emulated links counted), when there is an emulator."""
    links = run.link_bytes()
    if not links:
        return None
    return run.wan_bytes("all"), sum(links.values())


def fmt_number(x, spec: str, suffix: str = "") -> str:
    """A figure for a table: "-" when it is missing (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec) + suffix


def _late_landings(s: dict) -> str:
    if s["landings"] is None:
        return "-"
    text = f"{s['late_landings']} of {s['landings']}, {fmt_number(s['landing_wait_s'], '.1f', ' s')} waited per worker"
    each = s.get("wait_per_late_landing_s")
    if each:
        text += f"; {1e3 * each:.0f} ms each, about {each / s['step_s']:.1f} steps"
    return text


def _waits(s: dict) -> str:
    """The whole network wait per worker, and its phases that took 0.05 s or more."""
    text = fmt_number(s["comm_wait_s"], ".1f", " s")
    phases = s.get("wait_by_phase")
    if phases:
        shown = [f"{phase} {seconds:.1f} s" for phase, seconds in phases.items() if seconds >= 0.05]
        text += ": " + (", ".join(shown) if shown else "no phase over 0.05 s")
    return text


def _time_to_target(s: dict) -> str:
    num = fmt_number
    if s["target"] is None:
        return "- (no --target-acc / --target-loss)"
    if s.get("target_metric", s["metric"]) != s["metric"]:
        # a loss target on a run that measured accuracy (or the reverse) can be neither reached nor missed
        return f"- (the run evaluated {s['metric_label']}, not {s['target_label']})"
    if s["time_to_target_s"] is None:
        return "not reached"
    text = f"{num(s['time_to_target_s'], '.1f', ' s')} (step {s['steps_to_target']})"
    if s["eval_s"]:
        text += (f"; {num(s['time_to_target_no_eval_s'], '.1f', ' s')} without the workers' evaluations "
                 f"({num(s['eval_s'], '.1f', ' s')} each in the whole run)")
    return text


def _training_time(s: dict) -> str:
    num = fmt_number
    if not s["steps"]:
        if not s["workers"]:        # nobody reached training: the run failed first (its logs say why)
            return "no steps trained: no worker finished set-up (the run failed before training: see its logs)"
        if not s.get("resumed_at"):
            return f"no steps trained: {s['workers']} workers set up and recorded no step"
        # not a broken run: a job resumed at its last step sets up, evaluates its model and trains nothing
        return (f"no steps trained: {s['workers']} workers resumed at step {s['resumed_at']} and recorded no step "
                f"(a job resumed at its last step trains none)")
    resumed = f"; resumed at step {s['resumed_at']}" if s.get("resumed_at") else ""
    return (f"{num(s['train_s'], '.1f', ' s')} for {s['steps']} steps ({num(s['step_s'], '.3f', ' s')} per step; "
            f"set-up {num(s['setup_s'], '.1f', ' s')}{resumed})")


def _too_short(s: dict) -> str | None:
    """What the per-step WAN rows say when too few steps began after set-up's last whole second to divide."""
    if not s["steps"] or s.get("wan_steady_steps", s["steps"]):
        return None
    return (f"too short to measure (fewer than {MIN_STEADY_STEPS} steps began after the first whole second "
            f"once every worker was set up)")


def format_report(s: dict) -> str:
    num = fmt_number
    spec = ".4f"
    first_wan = "never" if s["first_wan_step"] is None else f"step {s['first_wan_step']}"
    rows = [
        ("run", f"{s['run']} ({s['topology']}, {s['mode']}, WAN {s['wan']}, {s['workers']} workers)"),
        *([("outcome", f"{s['status'].upper()}: {s['status_detail']}; the figures below cover what it recorded")]
          if s.get("status", "complete") != "complete" else []),
        ("training wall time", _training_time(s)),
        (f"final / best {s['metric_label']}", f"{num(s['final_eval'], spec)} / {num(s['best_eval'], spec)}"),
        (f"time to {s.get('target_label', s['metric_label'])} {num(s['target'], '.3f')}", _time_to_target(s)),
        ("WAN MB per step, up / down / between DCs", _too_short(s) or (
            f"{num(s['wan_bytes_up_per_step'] / MB, '.2f')} / {num(s['wan_bytes_down_per_step'] / MB, '.2f')} / "
            f"{num(s['wan_bytes_between_dcs_per_step'] / MB, '.2f')}")),
        ("WAN MB in the whole run (set-up included)", num(s["wan_bytes_total"] / MB, ".1f")),
        # not a codec's ratio alone: fewer rounds (HFA) and a global server inside a DC shrink WAN bytes too
        ("WAN bytes: dense fp32 every step / this run", _too_short(s) or num(s["compression_ratio"], ".2f", "x")),
        ("compute utilization", num(s["compute_utilization"], ".0%")),
        ("cross-DC rounds (waited out) / first at", f"{s['wan_rounds']} ({s['wan_rounds_waited']}) / {first_wan}"),
        ("overlapped global averages: late at landing", _late_landings(s)),
        ("network wait per worker (by phase)", _waits(s)),
        ("serial bound: compute + busiest link + round trips", f"{num(s['lower_bound_s'], '.1f', ' s')} = "
         f"{num(s['compute_s'], '.1f')} + {num(s['wire_s'], '.1f')} + {num(s['round_trips_s'], '.1f')} s"),
        ("overlapped bound: max(compute, busiest link) + round trips",
         f"{num(s['overlapped_bound_s'], '.1f', ' s')}"),
        ("efficiency (overlapped bound / measured)", num(s["efficiency"], ".2f")),
    ]
    if s["bytes_roles_vs_links"]:
        roles, links = s["bytes_roles_vs_links"]
        rows.append(("WAN bytes: sent by roles / counted by links", f"{roles:,} / {links:,}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
