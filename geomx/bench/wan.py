"""``geomx bench wan``: the time-to-accuracy matrix over an emulated WAN.

Each registered configuration (:mod:`geomx.bench.configs`: flat PS, HiPS FSA, HiPS MixedSync, ..., and the
no-WAN control, where each DC trains alone) trains the workload (:mod:`geomx.bench.workloads`:
``examples/train_cnn.py`` on the digits, or ``--workload lm``: ``examples/train_lm.py``) with the same model,
data, hyperparameters, seed and number of steps, one configuration after another on the same machine,
``--dcs`` x ``--workers-per-dc`` workers behind the WAN profile. Every figure comes from the run's own records
(``geomx report``'s definitions, :mod:`geomx.report.summary`): time and steps to the target (test accuracy, or
validation loss for the LM; ``--target-step N``: what HiPS FSA reached at step N in the same invocation, so
the target needs cooperation), the evaluation at a fixed training-time budget, the first step that crossed the
WAN, WAN bytes per step (training phase), set-up excluded; speedup and byte reduction are against the flat
parameter server of the same invocation, and a row that misses the target says "not reached". With
``--out-dir`` the table goes to ``<dir>/wan-<model>-<profile>.md`` next to its plot.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from geomx.bench import workloads
from geomx.bench.common import command_line, emit_report, launch, markdown_table, run_directory, train_script_path
from geomx.bench.configs import BASELINE, BenchConfig, select
from geomx.bench.workloads import Workload, workload_of_command
from geomx.errors import ConfigError, GeomxError
from geomx.profiles import PROFILES

MB = 1e6
TARGET_ROW = "hips-fsa"        # --target-step: the target is this row's evaluation at that step
CONTROL_ROW = "no-wan"         # each DC alone: a target it reaches needs no cooperation


def run_config(config: BenchConfig, *, profile: str | None, wan_rate: str | None, wan_rtt: str | None, dcs: int,
               workers_per_dc: int, workload: Workload, model: str, steps: int, eval_every: int, seed: int,
               run_dir: Path, timeout: float, train_args: tuple[str, ...] = ()) -> float:
    """Train one row in a whole deployment; returns the deployment's wall time (s)."""
    from geomx.cli.topology import load_topology

    topo = load_topology(None, dcs=dcs, workers_per_dc=workers_per_dc, wan=None if wan_rate else profile,
                         wan_rate=wan_rate, wan_rtt=wan_rtt, topology=config.topology, mode=config.mode,
                         mixedsync=config.mixedsync, sync=dict(config.sync) or None,
                         slowdown=list(config.slowdown) or None)
    if not topo.profile.emulated:
        raise ConfigError(f"WAN profile {topo.profile.name!r} is not emulated: the WAN benchmark needs the emulator "
                          f"(choose another --profile)")
    topo.env.update(config.env)
    command = [sys.executable, str(train_script_path(workload.script)), workload.model_flag, model, "--steps",
               str(steps), "--eval-every", str(eval_every), "--seed", str(seed), *train_args, *config.train_args]
    return launch(topo, command, run_dir, timeout, f"WAN bench ({config.name})")


def tabulate_run(config: BenchConfig, run, run_dir: Path, *, target: float | None, workers: int | None = None,
                 steps: int | None = None, budget_s: float | None = None, target_step: int | None = None) -> dict:
    """One row of the table from a finished run (``run``, loaded from ``run_dir``; ``geomx report``'s figures).
    ``target_step``: also the row's evaluation at that step, i.e. after as many samples as HiPS FSA's target
    took."""
    from geomx.report.summary import eval_at_step, eval_at_time, summarize

    if (workers is not None and len(run.workers) != workers) or (steps is not None and run.steps != steps):
        raise GeomxError(f"WAN bench ({config.name}): {len(run.workers)} workers recorded up to step {run.steps}, "
                         f"expected {workers} workers and {steps} steps (see {run_dir})")
    wan = run.manifest.get("wan", {})
    known = PROFILES.get(wan.get("profile"))
    description = known.description if known else (f"{wan.get('uplink_bps', 0) / 1e6:g} Mbit/s, "
                                                    f"{wan.get('rtt_s', 0) * 1000:g} ms RTT")
    return {"config": config.name, "label": config.label, "profile": wan.get("profile"),
            "profile_description": description, "run_dir": str(run_dir), **summarize(run, target),
            "eval_at_budget": eval_at_time(run, budget_s) if budget_s is not None else None,
            "eval_at_target_step": eval_at_step(run, target_step) if target_step is not None else None}


def tabulate(rows: list[BenchConfig], base: Path, *, target: float | None, target_step: int | None,
             budget_s: float | None, expected: dict[str, tuple[int, int]] | None = None) -> dict:
    """Every row's figures from its run directory under ``base``. ``target_step``: the target is HiPS FSA's
    evaluation at that step in these runs; the budget (unless given) is flat's time for target_step / 10 steps."""
    from geomx.report.run import load_run
    from geomx.report.summary import eval_at_step, time_at_step

    runs = {c.name: load_run(base / c.name) for c in rows}      # each run read once, whatever it serves

    def run_of(name: str):
        return runs[name] if name in runs else load_run(base / name)

    if target_step is not None:
        fsa = run_of(TARGET_ROW)
        target = eval_at_step(fsa, target_step)
        if target is None:
            evaluated = sorted({s for w in fsa.workers for s, _, _ in w.evals})
            raise ConfigError(f"--target-step {target_step}: HiPS FSA evaluated steps {evaluated}, not "
                              f"{target_step} (pick a multiple of --eval-every, or the last step)")
        if budget_s is None:
            budget_s = time_at_step(run_of(BASELINE), max(1, target_step // 10))
    results = []
    for c in rows:
        workers, steps = (expected or {}).get(c.name, (None, None))
        results.append(tabulate_run(c, runs[c.name], base / c.name, target=target, workers=workers, steps=steps,
                                    budget_s=budget_s, target_step=target_step))
    _compare(results)
    out = {"target": target, "target_step": target_step, "budget_s": budget_s, "rows": results}
    if target_step is not None and CONTROL_ROW in runs:
        out["control_misses_from_step"] = first_step_the_control_misses(fsa, runs[CONTROL_ROW])
    return out


def first_step_the_control_misses(fsa, control) -> int | None:
    """The first step at which HiPS FSA's evaluation is a target that the no-WAN control never reaches in its run
    (None: it reaches every one): the smallest ``--target-step`` that needs cooperation, for a table whose
    target turned out too easy."""
    from geomx.report.summary import accuracy_curve

    reached = [value for _, _, value in accuracy_curve(control)]
    for step, _, target in accuracy_curve(fsa):
        if not any(control.metric.reached(value, target) for value in reached):
            return step
    return None


def retabulate(*, from_runs: str, configs: str | None, target: float | None, out_dir: str | None,
               command: str | None = None, target_step: int | None = None, budget_s: float | None = None) -> dict:
    """The table (and plot) again from the run directories a ``--run-dir`` invocation kept, with the current
    definitions: nothing is re-run."""
    base = Path(from_runs)
    rows = [c for c in select(configs) if (base / c.name).is_dir()]
    if not rows or rows[0].name != BASELINE:
        raise ConfigError(f"{base} holds no {BASELINE}/ run directory (keep runs with geomx bench wan --run-dir)")
    if target_step is not None and not (base / TARGET_ROW).is_dir():
        raise ConfigError(f"--target-step needs the {TARGET_ROW} row's run, which {base} does not hold")
    manifest = json.loads((base / BASELINE / "launch.json").read_text())
    result = {**_training_args(manifest), **tabulate(rows, base, target=target, target_step=target_step,
                                                     budget_s=budget_s)}
    if out_dir:
        started = manifest.get("started")
        when = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(started)) if started else "at an unknown time"
        result["files"] = _write_outputs(result, Path(out_dir), [base / c.name for c in rows], command,
                                         note=f"tabulating the runs an earlier invocation kept, started {when}")
    return result


def _training_args(manifest: dict) -> dict:
    """Steps, model, seed... of a kept run, from its launch manifest and training command."""
    cmd = manifest.get("command", [])
    work = workload_of_command(cmd)

    def arg(flag: str, default):
        return type(default)(cmd[cmd.index(flag) + 1]) if flag in cmd else default

    per_dc = manifest.get("workers_per_dc")
    if isinstance(per_dc, list):
        per_dc = per_dc[0] if len(set(per_dc)) == 1 else "/".join(map(str, per_dc))
    return {"steps": arg("--steps", 0), "train_args": _shared_train_args(cmd), "eval_every": arg("--eval-every", 0),
            "workload": work.name, "model": arg(work.model_flag, work.default_model), "seed": arg("--seed", 0),
            "dcs": len(manifest.get("dcs", [])), "workers_per_dc": per_dc}


def _shared_train_args(cmd: list[str]) -> str:
    """The ``--train-args`` a kept run was started with: what follows its training command's ``--seed N``
    (every row's own arguments come last, so a row's are included: good enough to name the recipe)."""
    return " ".join(cmd[cmd.index("--seed") + 2:]) if "--seed" in cmd else ""


def parse_row_steps(text: str | None, rows: list[BenchConfig]) -> dict[str, int]:
    """``--row-steps hips-hfa=200,hips-diloco=200``: rows that train longer (or shorter) than ``--steps``, e.g.
    HFA with K1 x K2 = 200, whose first global average comes at step 200."""
    out: dict[str, int] = {}
    names = {c.name for c in rows}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not value.strip().isdigit():
            raise ConfigError(f"--row-steps: {item.strip()!r} is not CONFIG=STEPS (e.g. hips-hfa=200)")
        if name not in names:
            raise ConfigError(f"--row-steps names {name!r}, which is not among the rows run: "
                              f"{', '.join(sorted(names))}")
        if int(value) < 2:
            raise ConfigError(f"--row-steps: {name} must train >= 2 steps, got {value.strip()}")
        out[name] = int(value)
    return out


def bench_wan(*, profile: str | None = "transpacific", wan_rate: str | None = None, wan_rtt: str | None = None,
              configs: str | None = None, steps: int = 6, eval_every: int = 0, dcs: int = 2, workers_per_dc: int = 2,
              model: str | None = None, seed: int = 0, target: float | None = None, run_dir: str | None = None,
              out_dir: str | None = None, timeout: float = 900.0, command: str | None = None,
              row_steps: str | None = None, train_args: str | None = None, workload: str = "digits",
              target_step: int | None = None, budget_s: float | None = None) -> dict:
    work = workloads.workload(workload)
    model = workloads.model_for(work, model)
    if steps < 2:
        raise ConfigError(f"--steps must be >= 2, got {steps}")
    if bool(wan_rate) != bool(wan_rtt):
        raise ConfigError("--wan-rate and --wan-rtt go together")
    if target is not None and target_step is not None:
        raise ConfigError("--target-step sets the target (HiPS FSA's evaluation at that step): give no other target")
    if target is not None and work.name == "digits" and not 0 < target <= 1:
        raise ConfigError(f"--target-acc is a test accuracy in (0, 1], got {target}")
    rows = select(configs)
    if target_step is not None and TARGET_ROW not in {c.name for c in rows}:
        raise ConfigError(f"--target-step needs the {TARGET_ROW} row (add it to --configs)")
    per_row = parse_row_steps(row_steps, rows)
    if target_step is not None and not 1 <= target_step <= per_row.get(TARGET_ROW, steps):
        raise ConfigError(f"--target-step {target_step} is not a step {TARGET_ROW} trains "
                          f"(1..{per_row.get(TARGET_ROW, steps)})")
    shared_args = tuple(shlex.split(train_args or ""))
    for flag in (work.model_flag, "--steps", "--eval-every", "--seed"):
        if flag in shared_args:
            raise ConfigError(f"--train-args must not set {flag}: the benchmark's own option sets it for every row")
    train_script_path(work.script)         # a clear error before anything starts
    eval_every = eval_every or max(1, steps // 20)
    expected = {}
    with run_directory(run_dir, "wan") as rd:      # runs are kept only with --run-dir
        walls = {}
        for config in rows:
            sub = rd / config.name
            sub.mkdir(parents=True, exist_ok=True)
            row_steps_n = per_row.get(config.name, steps)
            walls[config.name] = run_config(config, profile=profile, wan_rate=wan_rate, wan_rtt=wan_rtt, dcs=dcs,
                                            workers_per_dc=workers_per_dc, workload=work, model=model,
                                            steps=row_steps_n, eval_every=eval_every, seed=seed, run_dir=sub,
                                            timeout=timeout, train_args=shared_args)
            expected[config.name] = (dcs * workers_per_dc, row_steps_n)
        table = tabulate(rows, rd, target=target, target_step=target_step, budget_s=budget_s, expected=expected)
        for r in table["rows"]:
            r["deployment_s"] = walls[r["config"]]
        result = {"steps": steps, "train_args": " ".join(shared_args), "eval_every": eval_every, "dcs": dcs,
                  "workers_per_dc": workers_per_dc, "workload": work.name, "model": model, "seed": seed, **table}
        if out_dir:
            result["files"] = _write_outputs(result, Path(out_dir), [Path(r["run_dir"]) for r in result["rows"]],
                                             command)
    return result


def _measured(per_step) -> bool:
    """A per-step figure that was measured: not None (JSON's NaN), not NaN, not 0."""
    return bool(per_step) and not math.isnan(per_step)


def _compare(results: list[dict]) -> None:
    """Speedup and byte reduction of every row against the flat PS (the first row). With a target, speedup
    is the ratio of times to the target, and there is none when either row missed it (never a ratio of
    training times across different numbers of steps); without one, the ratio of training times of rows that
    trained the same number of steps."""
    base = results[0]
    with_target = any(r["target"] is not None for r in results)
    for r in results:
        if with_target:
            reached = base["time_to_target_s"] and r["time_to_target_s"]
            r["speedup"] = base["time_to_target_s"] / r["time_to_target_s"] if reached else None
            r["speedup_basis"] = "time to target"
        else:
            same = r["steps"] == base["steps"] and r["train_s"]
            r["speedup"] = base["train_s"] / r["train_s"] if same else None
            r["speedup_basis"] = "training time"
        r["speedup_no_eval"] = base["time_to_target_no_eval_s"] / r["time_to_target_no_eval_s"] \
            if base.get("time_to_target_no_eval_s") and r.get("time_to_target_no_eval_s") else math.nan
        # a row too short to measure per step (geomx report: "too short to measure") has no reduction
        measured = _measured(base["wan_bytes_per_step"]) and _measured(r["wan_bytes_per_step"])
        r["byte_reduction"] = base["wan_bytes_per_step"] / r["wan_bytes_per_step"] if measured else math.nan
        r["step_time_vs_flat"] = r["step_s"] / base["step_s"] if base["step_s"] else math.nan
    fsa = next((r for r in results if r["config"] == TARGET_ROW and r.get("eval_at_target_step") is not None), None)
    for r in results:        # the same number of samples as FSA's target step: how far from FSA's evaluation
        mine = r.get("eval_at_target_step")
        r["vs_fsa_at_target_step"] = (mine - fsa["eval_at_target_step"]) / abs(fsa["eval_at_target_step"]) \
            if fsa is not None and mine is not None and fsa["eval_at_target_step"] else None


def _write_outputs(result: dict, out_dir: Path, run_dirs: list[Path], command: str | None,
                   note: str | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = "" if result.get("workload", "digits") == "digits" else f"{result['workload']}-"
    stem = f"wan-{prefix}{result['model']}-{result['rows'][0]['profile']}"
    files = {"table": str(out_dir / f"{stem}.md")}
    try:
        from geomx.report.plot import plot_runs
        from geomx.report.run import load_run
    except ImportError:          # plotting needs matplotlib
        plot_runs = None
    if plot_runs is not None:
        png = out_dir / f"{stem}.png"
        plot_runs([load_run(p) for p in run_dirs], png, labels=[r["label"] for r in result["rows"]])
        files["plot"] = str(png)
    from geomx.bench.common import machine_description

    head = [f"# geomx bench wan: `--model {result['model']}` over `{result['rows'][0]['profile']}`", ""]
    if command:
        head.append(f"* command: `{command}`" + (f" ({note})" if note else ""))
    head += [f"* date: {time.strftime('%Y-%m-%d %H:%M %Z')}", f"* machine: {machine_description()}", "", ""]
    body = "\n".join(head) + format_wan_report(result)
    if "plot" in files:
        body += f"\n\n![{stem}]({Path(files['plot']).name})\n"
    Path(files["table"]).write_text(body + "\n")
    return files


def format_wan_report(r: dict) -> str:
    from geomx.report.summary import fmt_number as num

    target, rows = r["target"], []
    first = r["rows"][0]
    metric = first.get("metric_label", "test accuracy")
    spec = ".4f"
    budget = r.get("budget_s")
    for x in r["rows"]:
        reached = x["time_to_target_s"] is not None
        ttt = "-" if target is None else (num(x["time_to_target_s"], ".1f", " s") if reached else "not reached")
        steps_to = "-" if target is None else (str(x["steps_to_target"]) if reached else "not reached")
        no_eval = (num(x.get("time_to_target_no_eval_s"), ".1f", " s") + " / "
                   + num(x.get("speedup_no_eval"), ".2f", "x"))
        first_wan = "never" if x.get("first_wan_step") is None else str(x["first_wan_step"])
        speedup = num(x["speedup"], ".2f", "x") if x["speedup"] is not None else (
            "not reached" if target is not None else "-")
        at_step = "-"
        if x.get("eval_at_target_step") is not None:
            rel = x.get("vs_fsa_at_target_step")
            at_step = num(x["eval_at_target_step"], spec) + ("" if rel is None else f" ({rel:+.1%})")
        rows.append([x["label"], str(x["steps"]), ttt, steps_to, no_eval if reached else "-",
                     num(x.get("eval_at_budget"), spec) if budget is not None else "-", at_step,
                     num(x["final_eval"], spec), first_wan, num(x["train_s"], ".1f"), num(x["step_s"], ".2f"),
                     num(x["wan_bytes_per_step"] / MB if _measured(x["wan_bytes_per_step"]) else None, ".2f"),
                     speedup,
                     num(x["byte_reduction"], ".2f", "x"), num(x["step_time_vs_flat"], ".2f"),
                     num(x["compute_utilization"], ".0%"), num(x["efficiency"], ".2f")])
    header = ["configuration", "steps", f"time to {metric} {num(target, '.4g')}" if target is not None
              else "time to target", "steps to target", "without evaluations: time / speedup",
              f"{metric} at {num(budget, '.1f', ' s')}" if budget is not None else f"{metric} at budget",
              f"{metric} at step {r['target_step']} (vs FSA)" if r.get("target_step") is not None
              else f"{metric} at FSA's target step", f"final {metric}", "first cross-DC step", "training s",
              "s / step", "WAN MB / step",
              "speedup vs flat", "WAN bytes: flat / this", "step time / flat", "compute util.", "efficiency"]
    basis = {x["speedup_basis"] for x in r["rows"]}
    recipe = f" `{r['train_args']}`" if r.get("train_args") else ""
    work = workloads.workload(r.get("workload", "digits"))
    lines = [
        f"{r['dcs']} DCs x {r['workers_per_dc']} workers, WAN `{first['profile']}` ({first['profile_description']}), "
        f"examples/{work.script} `{work.model_flag} {r['model']}`{recipe}, steps per row as listed, evaluation every "
        f"{r['eval_every']} steps, seed {r['seed']}; the rows ran one after another on this machine.", ""]
    if r.get("target_step") is not None:
        lines += [f"Target: {metric} {num(target, '.4g')}, what HiPS FSA reached at step {r['target_step']} in this "
                  f"run. Budget: {num(budget, '.1f', ' s')} of training (flat PS's time for "
                  f"{max(1, r['target_step'] // 10)} steps).", ""]
    if work.schedule_spans_steps and len({x["steps"] for x in r["rows"]}) > 1:
        lines += [f"**The rows train different numbers of steps, and examples/{work.script}'s learning-rate schedule "
                  f"(warm-up, cosine decay) spans a row's own steps: a longer row also learns at other rates. "
                  f"Give every row the same --steps to compare like with like.**", ""]
    control = next((x for x in r["rows"] if x["config"] == CONTROL_ROW), None)
    if control is not None and target is not None and control["time_to_target_s"] is not None:
        lines += ["**The target is too easy: the no-WAN control (each DC training alone, nothing crossing the WAN) "
                  "reaches it too.**", ""]
        if "control_misses_from_step" in r:
            harder = r["control_misses_from_step"]
            lines += [f"The first of HiPS FSA's evaluations that the control never reaches is at step {harder}: "
                      f"`--target-step {harder}` (from these runs: `--from-runs`) makes a target that needs "
                      f"cooperation." if harder is not None else
                      "The control reaches every one of HiPS FSA's evaluations in this run: no target from these "
                      "runs needs cooperation; train longer.", ""]
    lines += [
        markdown_table(header, rows, [False] + [True] * (len(header) - 1)), "",
        f"Training time starts when the first worker finished set-up (joined, keys initialized, initial model pulled). "
        f"WAN MB / step = training-phase bytes on all DC <-> central links / steps (MB = 10^6 bytes). Speedup = "
        f"flat's {' or '.join(sorted(basis))} / this row's (\"not reached\": this row or flat missed the target). "
        f"{metric[0].upper() + metric[1:]} at the budget: the mean of every worker's latest evaluation by then. "
        f"At step N: the mean evaluation after as many samples as HiPS FSA's target took, and its relative "
        f"difference from FSA's. First "
        f"cross-DC step: the first step that started a round across the WAN (\"never\": the no-WAN control). "
        f"Efficiency = (max(compute, busiest WAN link's bytes / its rate) + one round trip per cross-DC round the "
        f"workers waited out) / training time. Compute util. = the share of the workers' training time, their "
        f"evaluations left out, not spent waiting for the network. Without evaluations: each worker's clock less the "
        f"time it spent evaluating (the benchmark's probe, every {r['eval_every']} steps), and the speedup on that "
        f"basis. A row whose averages travel while it trains (overlapped) has them travel during its evaluations "
        f"too, so both of these flatter it: measure utilization with --eval-every equal to --steps. "
        f"Definitions, and where a row's waiting went (by phase of its averages): `geomx report` of the row's run "
        f"directory (geomx/report/summary.py)."]
    return "\n".join(lines)


def cmd_wan(args) -> int:
    target = args.target_loss if args.target_loss is not None else args.target_acc
    given = "--target-loss" if args.target_loss is not None else "--target-acc" if target is not None else None
    expected = workloads.workload(args.workload).target_flag
    if given is not None and not args.from_runs and given != expected:
        # a loss target read as an accuracy, or the other way round, is never reached or reached at once
        raise ConfigError(f"{given} {target:g}: the {args.workload} workload evaluates "
                          f"{'validation loss' if expected == '--target-loss' else 'test accuracy'}: give "
                          f"{expected}")
    if args.profile and (args.wan_rate or args.wan_rtt):
        # both named: one would be ignored in silence (the rate used to win over the profile)
        raise ConfigError(f"give --profile {args.profile} or --wan-rate/--wan-rtt, not both")
    profile = args.profile or ("transpacific" if not (args.wan_rate or args.wan_rtt) else None)
    if args.from_runs:
        result = retabulate(from_runs=args.from_runs, configs=args.configs, target=target,
                            out_dir=args.out_dir, command=command_line(args), target_step=args.target_step,
                            budget_s=args.budget_s)
    else:
        result = bench_wan(profile=profile, wan_rate=args.wan_rate, wan_rtt=args.wan_rtt, configs=args.configs,
                           steps=args.steps, eval_every=args.eval_every, dcs=args.dcs,
                           workers_per_dc=args.workers_per_dc, model=args.model, seed=args.seed,
                           target=target, run_dir=args.run_dir, out_dir=args.out_dir,
                           timeout=args.timeout, command=command_line(args), row_steps=args.row_steps,
                           train_args=args.train_args, workload=args.workload, target_step=args.target_step,
                           budget_s=args.budget_s)
    emit_report(args, "geomx bench wan: time to accuracy over an emulated WAN", format_wan_report(result), result)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    from geomx.bench.configs import CONFIGS
    from geomx.bench.workloads import WORKLOADS

    p = bsub.add_parser("wan", help="configurations (flat PS, HiPS FSA, MixedSync, ...) over an emulated WAN: "
                                    "time to accuracy, WAN bytes, efficiency")
    p.add_argument("--profile", default=None,
                   choices=sorted(n for n, pr in PROFILES.items() if pr.emulated),
                   help="WAN profile (default transpacific, unless --wan-rate/--wan-rtt describe the link)")
    p.add_argument("--wan-rate", help="custom WAN rate instead of --profile, e.g. 1gbit (with --wan-rtt)")
    p.add_argument("--wan-rtt", help="custom WAN round-trip time, e.g. 2ms (with --wan-rate)")
    p.add_argument("--configs", help=f"comma-separated rows (default all: {', '.join(CONFIGS)}); "
                                     f"{BASELINE} always runs as the baseline")
    p.add_argument("--workload", choices=list(WORKLOADS), default="digits",
                   help="what every row trains: digits (examples/train_cnn.py, quick) or lm (examples/train_lm.py, "
                        "a byte-level GPT on the standard library's source; validation loss)")
    targets = p.add_mutually_exclusive_group()
    targets.add_argument("--target-acc", type=float, help="test accuracy whose time to reach is compared (digits)")
    targets.add_argument("--target-loss", type=float, help="validation loss whose time to reach is compared (lm)")
    p.add_argument("--target-step", type=int, metavar="N",
                   help="the target is the evaluation HiPS FSA reaches at step N in this run (a target that needs "
                        "cooperation); N must be an evaluated step")
    p.add_argument("--budget-s", type=float, help="compare every row's evaluation this many seconds into training "
                                                  "(default with --target-step: flat's time for N / 10 steps)")
    p.add_argument("--steps", type=int, default=6, help="training steps per configuration (default 6)")
    p.add_argument("--row-steps", metavar="CONFIG=N,...",
                   help="rows that train another number of steps than --steps, e.g. hips-hfa=200 (HFA with K1 x K2 = "
                        "200 averages across DCs first at step 200); speedups compare times to the target. The "
                        "language model's learning-rate schedule (warm-up, cosine decay) spans a row's own steps, "
                        "so a longer row also learns at other rates: for a like-for-like table give every row "
                        "the same --steps")
    p.add_argument("--train-args", metavar="ARGS",
                   help="extra arguments of the workload's script for every row (the training recipe), e.g. "
                        "\"--optimizer sgd --lr 0.1\"")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default steps / 20)")
    p.add_argument("--dcs", type=int, default=2, help="data centers (default 2)")
    p.add_argument("--workers-per-dc", type=int, default=2, help="workers per DC (default 2)")
    p.add_argument("--model", choices=sorted({m for w in WORKLOADS.values() for m in w.models}),
                   help="the workload's model: digits: wide (~6.7M-parameter MLP, default), cnn or deep (8 alike conv "
                        "layers, P3's case); lm: tiny (default), small or base")
    p.add_argument("--seed", type=int, default=0, help="training seed, the same for every row (default 0)")
    p.add_argument("--out-dir", help="write the table and the plot here (e.g. docs/benchmarks)")
    p.add_argument("--from-runs", metavar="DIR", help="run nothing: tabulate again the runs an earlier "
                                                       "invocation kept with --run-dir DIR")
    p.set_defaults(fn=cmd_wan)
    return p
