"""``geomx bench wan``: HiPS vs flat parameter server over an emulated WAN, same training run.

Two deployments started with the launcher, identical but for ``--topology``: ``--dcs`` DCs x
``--workers-per-dc`` workers, the WAN profile, ``dist_sync``, and the same training command
``examples/train_cnn.py --model M --steps N --eval-every 1 --seed S`` (the same seed, so both runs train the
same model on the same batches: their losses and accuracies must agree).

Measured per run:

* WAN bytes: the emulator's per-link counters (``wan_links.json``: header + tensor frames of every message
  that crossed a link), summed over the links DC -> central (up) and central -> DC (down). Per step = the
  run's total / N; the total includes the one-time setup and the heartbeats, so it is above the steady-state
  rate. Setup: in HiPS each local server forwards one init (one model copy up) and receives the master's
  values (one copy down); in the flat topology every worker sends its init values (one copy up), receives the
  master's in the init reply and pulls them once more (two copies down).
* wall time per step: from each worker's ``result-<dc>-<rank>.json`` history (one entry per step, recorded
  after the step and its test evaluation): (time of step N - time of step 1) / (N - 1), averaged over the
  workers. The evaluation is identical in both runs.
* communication wait per step: the workers' ``comm_wait_s`` (time ``opt.step()`` waited for the network) / N,
  averaged over the workers; unlike the wall time it includes step 1 (which also waits for the slowest
  worker to start).

In HiPS one aggregate per DC crosses the WAN each way per step; in the flat topology every worker's
gradient does, so with 2 workers per DC HiPS should move about half the bytes.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from geomx.bench.common import (emit_report, launch, markdown_table, ratio, read_json, run_directory,
                                train_script_path)
from geomx.errors import ConfigError, GeomxError
from geomx.profiles import CENTRAL_DC, PROFILES

MB = 1e6
TOPOLOGIES = ("hips", "flat")


def run_one(topology: str, *, profile: str | None, wan_rate: str | None, wan_rtt: str | None, dcs: int,
            workers_per_dc: int, model: str, steps: int, seed: int, run_dir: Path, timeout: float) -> dict:
    from geomx.cli.topology import load_topology

    topo = load_topology(None, dcs=dcs, workers_per_dc=workers_per_dc, wan=None if wan_rate else profile,
                         wan_rate=wan_rate, wan_rtt=wan_rtt, topology=topology, mode="dist_sync")
    if not topo.profile.emulated:
        raise ConfigError(f"WAN profile {topo.profile.name!r} is not emulated: the WAN benchmark needs the emulator "
                          f"(choose another --profile)")
    command = [sys.executable, str(train_script_path()), "--model", model, "--steps", str(steps),
               "--eval-every", "1", "--seed", str(seed)]
    wall = launch(topo, command, run_dir, timeout, f"WAN bench ({topology})")
    stats = read_json(run_dir / "wan_links.json", f"WAN bench ({topology})")
    up = down = other = 0
    up_msgs = down_msgs = 0
    for link in stats["links"].values():
        if link["dst_dc"] == CENTRAL_DC:
            up += link["bytes"]
            up_msgs += link["messages"]
        elif link["src_dc"] == CENTRAL_DC:
            down += link["bytes"]
            down_msgs += link["messages"]
        else:
            other += link["bytes"]
    workers = [read_json(p, f"WAN bench ({topology})") for p in sorted(run_dir.glob("result-*.json"))]
    if len(workers) != topo.num_all_workers:
        raise GeomxError(f"WAN bench ({topology}): {len(workers)} worker results in {run_dir}, expected "
                         f"{topo.num_all_workers}")
    per_step, waits = [], []
    for w in workers:
        hist = w["history"]
        if w["steps"] != steps or len(hist) < 2 or hist[0]["step"] != 1 or hist[-1]["step"] != steps:
            raise GeomxError(f"WAN bench ({topology}): worker {w['dc']}/{w['rank']} ran {w['steps']} steps with "
                             f"history steps {[h['step'] for h in hist]}, expected every step 1..{steps}")
        per_step.append((hist[-1]["wall_s"] - hist[0]["wall_s"]) / (steps - 1))
        waits.append(w["comm_wait_s"] / steps)
    params = None
    m = re.search(r"initialized ([\d,]+) parameters", (run_dir / "master.log").read_text(errors="replace")) \
        if (run_dir / "master.log").exists() else None
    if m:
        params = int(m.group(1).replace(",", ""))
    first = workers[0]["history"][-1]
    return {"topology": topology, "profile": topo.profile.name, "profile_description": topo.profile.description,
            "deployment_s": wall, "wan_bytes_up": up, "wan_bytes_down": down, "wan_bytes_other": other,
            "wan_bytes": up + down + other, "wan_messages_up": up_msgs, "wan_messages_down": down_msgs,
            "bytes_per_step": (up + down + other) / steps, "bytes_up_per_step": up / steps,
            "bytes_down_per_step": down / steps, "step_s": sum(per_step) / len(per_step),
            "step_s_per_worker": per_step, "comm_wait_per_step_s": sum(waits) / len(waits),
            "parameters": params, "model_bytes": params * 4 if params else None,
            "final_loss": first["loss"], "final_test_acc": first["test_acc"],
            "final_test_acc_all": [w["final_test_acc"] for w in workers]}


def bench_wan(*, profile: str | None = "transpacific", wan_rate: str | None = None, wan_rtt: str | None = None,
              steps: int = 6, dcs: int = 2, workers_per_dc: int = 2, model: str = "wide", seed: int = 0,
              run_dir: str | None = None, timeout: float = 900.0) -> dict:
    if steps < 2:
        raise ConfigError(f"--steps must be >= 2 (time per step is measured between step 1 and step N), got {steps}")
    if bool(wan_rate) != bool(wan_rtt):
        raise ConfigError("--wan-rate and --wan-rtt go together")
    train_script_path()         # a clear error before anything starts
    runs = {}
    with run_directory(run_dir, "wan") as rd:
        for topology in TOPOLOGIES:
            sub = rd / topology
            sub.mkdir(parents=True, exist_ok=True)
            runs[topology] = run_one(topology, profile=profile, wan_rate=wan_rate, wan_rtt=wan_rtt, dcs=dcs,
                                     workers_per_dc=workers_per_dc, model=model, steps=steps, seed=seed,
                                     run_dir=sub, timeout=timeout)
    h, f = runs["hips"], runs["flat"]
    ratios = {k: ratio(h[k], f[k]) for k in ("bytes_per_step", "bytes_up_per_step", "bytes_down_per_step", "step_s",
                                             "comm_wait_per_step_s")}
    return {"steps": steps, "dcs": dcs, "workers_per_dc": workers_per_dc, "model": model, "seed": seed,
            "runs": runs, "ratios": ratios}


def format_wan_report(r: dict) -> str:
    h, f, q = r["runs"]["hips"], r["runs"]["flat"], r["ratios"]

    def mb(x):
        return f"{x / MB:.1f}"

    rows = [["WAN MB per step, DC -> central (up)", mb(h["bytes_up_per_step"]), mb(f["bytes_up_per_step"]),
             f"{q['bytes_up_per_step']:.2f}"],
            ["WAN MB per step, central -> DC (down)", mb(h["bytes_down_per_step"]), mb(f["bytes_down_per_step"]),
             f"{q['bytes_down_per_step']:.2f}"],
            ["WAN MB per step, both directions", mb(h["bytes_per_step"]), mb(f["bytes_per_step"]),
             f"{q['bytes_per_step']:.2f}"]]
    if h["model_bytes"]:
        rows.append(["model copies crossing the WAN per step", f"{h['bytes_per_step'] / h['model_bytes']:.2f}",
                     f"{f['bytes_per_step'] / f['model_bytes']:.2f}", f"{q['bytes_per_step']:.2f}"])
    rows += [["wall time per step (s)", f"{h['step_s']:.2f}", f"{f['step_s']:.2f}", f"{q['step_s']:.2f}"],
             ["communication wait per step, step 1 included (s)", f"{h['comm_wait_per_step_s']:.2f}",
              f"{f['comm_wait_per_step_s']:.2f}", f"{q['comm_wait_per_step_s']:.2f}"],
             [f"loss / test accuracy after step {r['steps']}", f"{h['final_loss']:.4f} / {h['final_test_acc']:.4f}",
              f"{f['final_loss']:.4f} / {f['final_test_acc']:.4f}", ""],
             ["whole run incl. start-up and teardown (s)", f"{h['deployment_s']:.0f}", f"{f['deployment_s']:.0f}",
              ""]]
    table = markdown_table(["per training step", "HiPS", "flat", "HiPS / flat"], rows)
    model = f"`--model {r['model']}`" + (f" ({h['parameters']:,} parameters, {h['model_bytes'] / MB:.1f} MB)"
                                         if h["parameters"] else "")
    return "\n".join([
        f"{r['dcs']} DCs x {r['workers_per_dc']} workers, WAN `{h['profile']}` ({h['profile_description']}), "
        f"dist_sync, examples/train_cnn.py {model}, {r['steps']} steps, seed {r['seed']}.", "", table, "",
        f"WAN bytes = the emulator's link counters (header + tensor frames), summed over all DC <-> central links, "
        f"divided by {r['steps']} steps; they include the one-time setup (initial values sent and pulled) and "
        f"heartbeats. MB = 10^6 bytes. Wall time per step = (time of step {r['steps']} - time of step 1) / "
        f"{r['steps'] - 1} from every worker's result file, averaged over the workers (each step includes a test "
        f"evaluation, identical in both runs). Communication wait = time `opt.step()` waited for the network, "
        f"averaged over all {r['steps']} steps."])


def cmd_wan(args) -> int:
    result = bench_wan(profile=args.profile, wan_rate=args.wan_rate, wan_rtt=args.wan_rtt, steps=args.steps,
                       dcs=args.dcs, workers_per_dc=args.workers_per_dc, model=args.model, seed=args.seed,
                       run_dir=args.run_dir, timeout=args.timeout)
    emit_report(args, "geomx bench wan: HiPS vs flat over an emulated WAN", format_wan_report(result), result)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser("wan", help="HiPS vs flat topology over an emulated WAN: WAN bytes and time per step")
    p.add_argument("--profile", default="transpacific",
                   choices=sorted(n for n, pr in PROFILES.items() if pr.emulated),
                   help="WAN profile (default transpacific)")
    p.add_argument("--wan-rate", help="custom WAN rate instead of --profile, e.g. 1gbit (with --wan-rtt)")
    p.add_argument("--wan-rtt", help="custom WAN round-trip time, e.g. 2ms (with --wan-rate)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (default 6, >= 2)")
    p.add_argument("--dcs", type=int, default=2, help="data centers (default 2)")
    p.add_argument("--workers-per-dc", type=int, default=2, help="workers per DC (default 2)")
    p.add_argument("--model", choices=["wide", "cnn"], default="wide",
                   help="examples/train_cnn.py model: wide (~6.7M-parameter MLP, default) or cnn")
    p.add_argument("--seed", type=int, default=0, help="training seed, the same for both runs (default 0)")
    p.set_defaults(fn=cmd_wan)
    return p
