"""``geomx bench wan``: the time-to-accuracy matrix over an emulated WAN.

Each registered configuration (:mod:`geomx.bench.configs`: flat PS, HiPS FSA, HiPS MixedSync, and whatever
later features register) trains ``examples/train_cnn.py`` with the same model, data, hyperparameters, seed
and number of steps, one configuration after another on the same machine, ``--dcs`` x ``--workers-per-dc``
workers behind the WAN profile. Every figure comes from the run's own records (``geomx report``'s
definitions, :mod:`geomx.report.summary`): time to the target accuracy, final accuracy, WAN bytes per step
(training phase), set-up excluded; speedup and byte reduction are against the flat parameter server of the
same invocation. With ``--out-dir`` the table goes to ``<dir>/wan-<model>-<profile>.md`` next to its plot.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from geomx.bench.common import command_line, emit_report, launch, markdown_table, run_directory, train_script_path
from geomx.bench.configs import BASELINE, BenchConfig, select
from geomx.errors import ConfigError, GeomxError
from geomx.profiles import PROFILES

MB = 1e6


def run_config(config: BenchConfig, *, profile: str | None, wan_rate: str | None, wan_rtt: str | None, dcs: int,
               workers_per_dc: int, model: str, steps: int, eval_every: int, seed: int, target_acc: float | None,
               run_dir: Path, timeout: float, train_args: tuple[str, ...] = ()) -> dict:
    from geomx.cli.topology import load_topology

    topo = load_topology(None, dcs=dcs, workers_per_dc=workers_per_dc, wan=None if wan_rate else profile,
                         wan_rate=wan_rate, wan_rtt=wan_rtt, topology=config.topology, mode=config.mode,
                         mixedsync=config.mixedsync,
                         slowdown=list(config.slowdown) or None)
    if not topo.profile.emulated:
        raise ConfigError(f"WAN profile {topo.profile.name!r} is not emulated: the WAN benchmark needs the emulator "
                          f"(choose another --profile)")
    topo.env.update(config.env)
    command = [sys.executable, str(train_script_path()), "--model", model, "--steps", str(steps),
               "--eval-every", str(eval_every), "--seed", str(seed), *train_args, *config.train_args]
    wall = launch(topo, command, run_dir, timeout, f"WAN bench ({config.name})")
    return {**tabulate_run(config, run_dir, target_acc=target_acc, workers=topo.num_all_workers, steps=steps),
            "deployment_s": wall}


def tabulate_run(config: BenchConfig, run_dir: Path, *, target_acc: float | None, workers: int | None = None,
                 steps: int | None = None) -> dict:
    """One row of the table from a finished run directory (``geomx report``'s figures)."""
    from geomx.report.run import load_run
    from geomx.report.summary import summarize

    run = load_run(run_dir)
    if (workers is not None and len(run.workers) != workers) or (steps is not None and run.steps != steps):
        raise GeomxError(f"WAN bench ({config.name}): {len(run.workers)} workers recorded up to step {run.steps}, "
                         f"expected {workers} workers and {steps} steps (see {run_dir})")
    wan = run.manifest.get("wan", {})
    known = PROFILES.get(wan.get("profile"))
    description = known.description if known else (f"{wan.get('uplink_bps', 0) / 1e6:g} Mbit/s, "
                                                    f"{wan.get('rtt_s', 0) * 1000:g} ms RTT")
    return {"config": config.name, "label": config.label, "profile": wan.get("profile"),
            "profile_description": description, "run_dir": str(run_dir), **summarize(run, target_acc)}


def retabulate(*, from_runs: str, configs: str | None, target_acc: float | None, out_dir: str | None,
               command: str | None = None) -> dict:
    """The table (and plot) again from the run directories a ``--run-dir`` invocation kept, with the current
    definitions: nothing is re-run."""
    base = Path(from_runs)
    rows = [c for c in select(configs) if (base / c.name).is_dir()]
    if not rows or rows[0].name != BASELINE:
        raise ConfigError(f"{base} holds no {BASELINE}/ run directory (keep runs with geomx bench wan --run-dir)")
    results = [tabulate_run(c, base / c.name, target_acc=target_acc) for c in rows]
    _compare(results)
    manifest = json.loads((base / BASELINE / "launch.json").read_text())
    result = {**_training_args(manifest), "target_acc": target_acc, "rows": results}
    if out_dir:
        started = manifest.get("started")
        when = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(started)) if started else "at an unknown time"
        result["files"] = _write_outputs(result, Path(out_dir), [base / c.name for c in rows], command,
                                         note=f"tabulating the runs an earlier invocation kept, started {when}")
    return result


def _training_args(manifest: dict) -> dict:
    """Steps, model, seed... of a kept run, from its launch manifest and training command."""
    cmd = manifest.get("command", [])

    def arg(flag: str, default):
        return type(default)(cmd[cmd.index(flag) + 1]) if flag in cmd else default

    per_dc = manifest.get("workers_per_dc")
    if isinstance(per_dc, list):
        per_dc = per_dc[0] if len(set(per_dc)) == 1 else "/".join(map(str, per_dc))
    return {"steps": arg("--steps", 0), "train_args": _shared_train_args(cmd), "eval_every": arg("--eval-every", 0),
            "model": arg("--model", "cnn"), "seed": arg("--seed", 0), "dcs": len(manifest.get("dcs", [])),
            "workers_per_dc": per_dc}


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
              model: str = "wide", seed: int = 0, target_acc: float | None = None, run_dir: str | None = None,
              out_dir: str | None = None, timeout: float = 900.0, command: str | None = None,
              row_steps: str | None = None, train_args: str | None = None) -> dict:
    if steps < 2:
        raise ConfigError(f"--steps must be >= 2, got {steps}")
    if bool(wan_rate) != bool(wan_rtt):
        raise ConfigError("--wan-rate and --wan-rtt go together")
    if target_acc is not None and not 0 < target_acc <= 1:
        raise ConfigError(f"--target-acc is a test accuracy in (0, 1], got {target_acc}")
    rows = select(configs)
    per_row = parse_row_steps(row_steps, rows)
    shared_args = tuple(shlex.split(train_args or ""))
    for flag in ("--model", "--steps", "--eval-every", "--seed"):
        if flag in shared_args:
            raise ConfigError(f"--train-args must not set {flag}: the benchmark's own option sets it for every row")
    train_script_path()         # a clear error before anything starts
    eval_every = eval_every or max(1, steps // 20)
    results = []
    with run_directory(run_dir, "wan") as rd:      # runs are kept only with --run-dir
        for config in rows:
            sub = rd / config.name
            sub.mkdir(parents=True, exist_ok=True)
            results.append(run_config(config, profile=profile, wan_rate=wan_rate, wan_rtt=wan_rtt, dcs=dcs,
                                      workers_per_dc=workers_per_dc, model=model,
                                      steps=per_row.get(config.name, steps), eval_every=eval_every, seed=seed,
                                      target_acc=target_acc, run_dir=sub, timeout=timeout, train_args=shared_args))
        _compare(results)
        result = {"steps": steps, "train_args": " ".join(shared_args), "eval_every": eval_every, "dcs": dcs,
                  "workers_per_dc": workers_per_dc, "model": model, "seed": seed, "target_acc": target_acc,
                  "rows": results}
        if out_dir:
            result["files"] = _write_outputs(result, Path(out_dir), [Path(r["run_dir"]) for r in results], command)
    return result


def _compare(results: list[dict]) -> None:
    """Speedup and byte reduction of every row against the flat PS (the first row)."""
    base = results[0]
    for r in results:
        if base["time_to_target_s"] and r["time_to_target_s"]:
            r["speedup"], r["speedup_basis"] = base["time_to_target_s"] / r["time_to_target_s"], "time to target"
        else:
            r["speedup"], r["speedup_basis"] = base["train_s"] / r["train_s"], "training time"
        r["speedup_no_eval"] = base["time_to_target_no_eval_s"] / r["time_to_target_no_eval_s"] \
            if base.get("time_to_target_no_eval_s") and r.get("time_to_target_no_eval_s") else math.nan
        r["byte_reduction"] = base["wan_bytes_per_step"] / r["wan_bytes_per_step"] \
            if r["wan_bytes_per_step"] else math.nan
        r["step_time_vs_flat"] = r["step_s"] / base["step_s"] if base["step_s"] else math.nan


def _write_outputs(result: dict, out_dir: Path, run_dirs: list[Path], command: str | None,
                   note: str | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"wan-{result['model']}-{result['rows'][0]['profile']}"
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

    target = r["target_acc"]
    rows = []
    for x in r["rows"]:
        ttt = num(x["time_to_target_s"], ".1f", " s") if target is not None else "-"
        if target is not None and x["time_to_target_s"] is None:
            ttt = "not reached"
        no_eval = (num(x.get("time_to_target_no_eval_s"), ".1f", " s") + " / "
                   + num(x.get("speedup_no_eval"), ".2f", "x"))
        rows.append([x["label"], str(x["steps"]), ttt, no_eval if x["time_to_target_s"] is not None else "-",
                     num(x["final_acc"], ".4f"), num(x["train_s"], ".1f"), num(x["step_s"], ".2f"),
                     num(x["wan_bytes_per_step"] / MB, ".2f"), num(x["speedup"], ".2f", "x"),
                     num(x["byte_reduction"], ".2f", "x"), num(x["step_time_vs_flat"], ".2f"),
                     num(x["compute_utilization"], ".0%"), num(x["efficiency"], ".2f")])
    first = r["rows"][0]
    header = ["configuration", "steps", f"time to {num(target, '.2f')} acc" if target is not None else "time to target",
              "without evaluations: time / speedup", "final acc", "training s", "s / step", "WAN MB / step",
              "speedup vs flat", "WAN bytes: flat / this",
              "step time / flat", "compute util.", "efficiency"]
    basis = {x["speedup_basis"] for x in r["rows"]}
    recipe = f" `{r['train_args']}`" if r.get("train_args") else ""
    return "\n".join([
        f"{r['dcs']} DCs x {r['workers_per_dc']} workers, WAN `{first['profile']}` ({first['profile_description']}), "
        f"examples/train_cnn.py `--model {r['model']}`{recipe}, steps per row as listed, evaluation every "
        f"{r['eval_every']} steps, seed {r['seed']}; the rows ran one after another on this machine.", "",
        markdown_table(header, rows, [False] + [True] * (len(header) - 1)), "",
        f"Training time starts when the first worker finished set-up (joined, keys initialized, initial model pulled). "
        f"WAN MB / step = training-phase bytes on all DC <-> central links / steps (MB = 10^6 bytes). Speedup = "
        f"flat's {' or '.join(sorted(basis))} / this row's. Efficiency = (compute + busiest WAN link's bytes / its "
        f"rate + one round trip per step) / training time. Without evaluations: each worker's clock less the "
        f"time it spent evaluating (the benchmark's probe, every {r['eval_every']} steps), and the speedup on that "
        f"basis. Definitions: `geomx report` (geomx/report/summary.py)."])


def cmd_wan(args) -> int:
    if args.from_runs:
        result = retabulate(from_runs=args.from_runs, configs=args.configs, target_acc=args.target_acc,
                            out_dir=args.out_dir, command=command_line(args))
    else:
        result = bench_wan(profile=args.profile, wan_rate=args.wan_rate, wan_rtt=args.wan_rtt, configs=args.configs,
                           steps=args.steps, eval_every=args.eval_every, dcs=args.dcs,
                           workers_per_dc=args.workers_per_dc, model=args.model, seed=args.seed,
                           target_acc=args.target_acc, run_dir=args.run_dir, out_dir=args.out_dir,
                           timeout=args.timeout, command=command_line(args), row_steps=args.row_steps,
                           train_args=args.train_args)
    emit_report(args, "geomx bench wan: time to accuracy over an emulated WAN", format_wan_report(result), result)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    from geomx.bench.configs import CONFIGS

    p = bsub.add_parser("wan", help="configurations (flat PS, HiPS FSA, MixedSync, ...) over an emulated WAN: "
                                    "time to accuracy, WAN bytes, efficiency")
    p.add_argument("--profile", default="transpacific",
                   choices=sorted(n for n, pr in PROFILES.items() if pr.emulated),
                   help="WAN profile (default transpacific)")
    p.add_argument("--wan-rate", help="custom WAN rate instead of --profile, e.g. 1gbit (with --wan-rtt)")
    p.add_argument("--wan-rtt", help="custom WAN round-trip time, e.g. 2ms (with --wan-rate)")
    p.add_argument("--configs", help=f"comma-separated rows (default all: {', '.join(CONFIGS)}); "
                                     f"{BASELINE} always runs as the baseline")
    p.add_argument("--target-acc", type=float, help="test accuracy whose time to reach is compared")
    p.add_argument("--steps", type=int, default=6, help="training steps per configuration (default 6)")
    p.add_argument("--row-steps", metavar="CONFIG=N,...",
                   help="rows that train another number of steps than --steps, e.g. hips-hfa=200 (HFA with K1 x K2 = "
                        "200 averages across DCs first at step 200); speedups compare times to the target")
    p.add_argument("--train-args", metavar="ARGS",
                   help="extra examples/train_cnn.py arguments for every row (the training recipe), e.g. "
                        "\"--optimizer sgd --lr 0.1\"")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default steps / 20)")
    p.add_argument("--dcs", type=int, default=2, help="data centers (default 2)")
    p.add_argument("--workers-per-dc", type=int, default=2, help="workers per DC (default 2)")
    p.add_argument("--model", choices=["wide", "cnn"], default="wide",
                   help="workload: examples/train_cnn.py --model wide (~6.7M-parameter MLP, default) or cnn")
    p.add_argument("--seed", type=int, default=0, help="training seed, the same for every row (default 0)")
    p.add_argument("--out-dir", help="write the table and the plot here (e.g. docs/benchmarks)")
    p.add_argument("--from-runs", metavar="DIR", help="run nothing: tabulate again the runs an earlier "
                                                       "invocation kept with --run-dir DIR")
    p.set_defaults(fn=cmd_wan)
    return p
