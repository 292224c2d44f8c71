"""Summarise tests/scripts/rejoin_bench.sh's two runs (issue 16, docs/benchmarks.md): python rejoin_bench.py OUT.

Per run: the time to the last step (from the launcher's start to the last worker's last step record), the final
validation loss, the worker-steps (every worker process's step records); for the faulted run, each injected kill
or freeze, how long its tier took to drop it, and each restarted worker's rejoin (its model's arrival, and from its
process' start to its first step's readiness). Useful work = the failure-free run's time / the faulted run's time (both
train the same steps, every one of which ends up in the final model).
"""
from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

LINK_BPS = 100e6            # transpacific


def records(run: Path):
    for path in sorted((run / "metrics").glob("worker-*.jsonl")):
        yield path, [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(run: Path) -> dict:
    started = json.loads((run / "launch.json").read_text())["started"]
    steps = [r for _, recs in records(run) for r in recs if r["kind"] == "step"]
    losses = {round(json.loads(p.read_text())["final_val_loss"], 6) for p in run.glob("result-*.json")}
    model = next(r["dense_bytes"] for _, recs in records(run) for r in recs if r["kind"] == "model")
    return {"train_s": max(r["t"] for r in steps) - started, "worker_steps": len(steps),
            "steps": max(r["step"] for r in steps), "final_val_loss": sorted(losses), "model_bytes": model,
            "started": started}


def stalls(run: Path) -> tuple[float, float]:
    """(the median time between global steps, the time beyond 2 x that median the job spent between steps): when
    any worker first logged each step; a step that waited for a failure's detection or a rejoin stands out."""
    first: dict[int, float] = {}
    for _, recs in records(run):
        for r in recs:
            if r["kind"] == "step":
                first[r["step"]] = min(first.get(r["step"], r["t"]), r["t"])
    times = [first[s] for s in sorted(first)]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    median = gaps[len(gaps) // 2]
    return median, sum(g - 2 * median for g in gaps if g > 2 * median)


def role_of(member: str) -> str:
    m = re.search(r"worker (\d+) of DC (\w+)", member)
    if m:
        return f"{m[2]}-worker-{m[1]}"
    dc = re.search(r"local server of DC (\w+)", member)[1]
    return f"{dc}-server"


def faults(run: Path, output: str, started: float) -> list[dict]:
    drops = [json.loads(line) for line in (run / "dropped.jsonl").read_text().splitlines()]
    out = []
    for action, role, at in re.findall(r"geomx: injected (kill|stop) of (\S+) at ([\d.]+) s", output):
        at = float(at)
        dropped = [d["time"] - started - at for d in drops if role_of(d["member"]) == role and
                   d["time"] - started >= at]
        out.append({"action": action, "role": role, "at_s": at,
                    "dropped_after_s": min(dropped) if dropped else None})
    return out


def rejoins(run: Path) -> list[dict]:
    out = []
    for log in sorted(run.glob("*rejoin-*.log")):
        m = re.search(r"rejoined at step (\d+) .*?its model arrived in ([\d.]+) s", log.read_text())
        if m:
            out.append({"log": log.name, "step": int(m[1]), "model_s": float(m[2])})
    return out


def main(out: Path) -> None:
    free, faulted = summary(out / "rj-free"), summary(out / "rj-faults")
    bar = 1.2 * free["model_bytes"] * 8 / LINK_BPS + 2
    print(f"failure-free: {free['steps']} steps in {free['train_s']:.1f} s, final validation loss "
          f"{free['final_val_loss']}, worker-steps {free['worker_steps']}")
    print(f"faults: {faulted['steps']} steps in {faulted['train_s']:.1f} s, final validation loss "
          f"{faulted['final_val_loss']}, worker-steps {faulted['worker_steps']}")
    gap = faulted["final_val_loss"][0] / free["final_val_loss"][0] - 1
    print(f"useful work {free['train_s'] / faulted['train_s']:.3f}; worker-steps "
          f"{faulted['worker_steps'] / (free['worker_steps'] * faulted['train_s'] / free['train_s']):.3f} of the "
          f"failure-free run's in the same time; final loss {gap:+.2%}")
    for name in ("rj-free", "rj-faults"):
        median, lost = stalls(out / name)
        print(f"{name}: median {median:.2f} s between steps; {lost:.1f} s spent beyond 2 x that between steps")
    output = (out / "rj-faults.out").read_text()
    for f in faults(out / "rj-faults", output, faulted["started"]):
        print(f"{f['action']} of {f['role']} at {f['at_s']:.1f} s: dropped after "
              + (f"{f['dropped_after_s']:.2f} s" if f["dropped_after_s"] is not None else "(never)"))
    for r in rejoins(out / "rj-faults"):
        print(f"{r['log']}: rejoined at step {r['step']}, model arrived in {r['model_s']:.2f} s "
              f"(bar {bar:.2f} s: 1.2 x {free['model_bytes']:,} B / 100 Mbit/s + 2 s)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp"))
