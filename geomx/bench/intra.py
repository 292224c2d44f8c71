"""``geomx bench intra``: synchronize one gradient among the workers of one DC, geomx vs gloo all_reduce.

geomx side: a real deployment started with the launcher (HiPS topology, 1 DC, ``--workers`` workers, ``lan``).
Each worker (this module, run as ``python -m geomx.bench.intra kv-worker``) pushes a float32 tensor of
``--mb`` MiB with ``kv.pushpull(key, x, out=y).wait()``: the DC's local server sums the workers' tensors,
forwards the DC sum to the global server (over loopback: no emulator with ``lan``) and answers every worker
with the global result. That forward is part of what a geomx round costs.

gloo side: ``--workers`` processes (``python -m geomx.bench.intra gloo-worker``) joined by
``torch.distributed`` (backend gloo, ``init_method=tcp://127.0.0.1:PORT``) run ``all_reduce`` on a tensor of
the same size. It runs before and after the geomx deployment; the two passes are averaged.

Both sides: one untimed warm-up sync (whose result is checked), a barrier, then ``--repeats`` syncs back to
back. Seconds per sync = wall time of the timed loop / repeats, on the slowest process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from geomx.bench.common import (MIB, bench_env, dispatch_helper, emit_report, free_port, launch, markdown_table,
                                ratio, read_json, run_directory)
from geomx.errors import GeomxError

KEY = "bench-intra-gradient"


def _elements(mib: float) -> int:
    return max(1, int(mib * MIB) // 4)


def _worker_args(argv: list[str], prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--mb", type=float, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--out")
    return p.parse_args(argv)


def _timed_loop(sync, repeats: int) -> dict:
    iters = []
    t0 = time.perf_counter()
    for _ in range(repeats):
        a = time.perf_counter()
        sync()
        iters.append(time.perf_counter() - a)
    return {"loop_s": time.perf_counter() - t0, "iter_s": iters}


# -- geomx worker (inside the deployment) ----------------------------------------------------------------------

def kv_worker_main(argv: list[str]) -> int:
    args = _worker_args(argv, "python -m geomx.bench.intra kv-worker")
    import torch

    import geomx.kvstore

    torch.set_num_threads(1)
    kv = geomx.kvstore.create(reduction="mean")
    n = _elements(args.mb)
    kv.init(KEY, torch.zeros(n))
    if kv.is_master_worker:
        kv.close()
        return 0
    x = torch.full((n,), float(kv.rank + 1))
    y = torch.empty(n)
    kv.pushpull(KEY, x, out=y).wait()       # warm-up, checked: the servers return the mean over all workers
    w = kv.num_all_workers
    expected = (w + 1) / 2
    if abs(float(y[0]) - expected) > 1e-4 or abs(float(y[-1]) - expected) > 1e-4:
        raise GeomxError(f"intra bench: pushpull returned {float(y[0])}, expected the mean {expected}")
    kv.barrier()
    result = _timed_loop(lambda: kv.pushpull(KEY, x, out=y).wait(), args.repeats)
    Path(os.environ["GEOMX_RUN_DIR"], f"intra-{kv.dc}-{kv.rank}.json").write_text(json.dumps(result))
    kv.close()
    return 0


# -- gloo worker ----------------------------------------------------------------------------------------------

def gloo_worker_main(argv: list[str]) -> int:
    args = _worker_args(argv, "python -m geomx.bench.intra gloo-worker")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    try:
        n = _elements(args.mb)
        x = torch.full((n,), float(args.rank + 1))
        dist.all_reduce(x)                  # warm-up, checked
        expected = args.world * (args.world + 1) / 2
        if abs(float(x[0]) - expected) > 1e-4 or abs(float(x[-1]) - expected) > 1e-4:
            raise GeomxError(f"intra bench: gloo all_reduce returned {float(x[0])}, expected {expected}")
        dist.barrier()
        result = _timed_loop(lambda: dist.all_reduce(x), args.repeats)
    finally:
        dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(result))
    return 0


def run_gloo(mb: float, workers: int, repeats: int, run_dir: Path, tag: str, timeout: float) -> list[dict]:
    port = free_port()
    procs, outs = [], []
    for r in range(workers):
        out = run_dir / f"gloo-{tag}-{r}.json"
        log = open(run_dir / f"gloo-{tag}-{r}.log", "wb")  # noqa: SIM115 - the child writes it; closed after wait
        procs.append((subprocess.Popen([sys.executable, "-m", "geomx.bench.intra", "gloo-worker", "--mb", str(mb),
                                        "--repeats", str(repeats), "--rank", str(r), "--world", str(workers),
                                        "--port", str(port), "--out", str(out)],
                                       env=bench_env(), stdout=log, stderr=subprocess.STDOUT), log))
        outs.append(out)
    deadline = time.monotonic() + timeout
    try:
        for r, (proc, _) in enumerate(procs):
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                tail = (run_dir / f"gloo-{tag}-{r}.log").read_text(errors="replace")[-2000:]
                raise GeomxError(f"intra bench: gloo rank {r} exited with status {rc}:\n{tail}")
    except subprocess.TimeoutExpired:
        raise GeomxError(f"intra bench: the gloo processes did not finish within {timeout:g} s") from None
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return [read_json(o, "intra bench (gloo)") for o in outs]


def _per_sync(results: list[dict], repeats: int) -> float:
    return max(r["loop_s"] for r in results) / repeats


# -- the benchmark -----------------------------------------------------------------------------------------------

def bench_intra(mb: float, workers: int, repeats: int, *, run_dir: str | None = None, timeout: float = 600.0) -> dict:
    from geomx.cli.topology import load_topology

    if workers < 2:
        raise GeomxError(f"--workers must be >= 2, got {workers}")
    if repeats < 1 or mb <= 0:
        raise GeomxError(f"--repeats must be >= 1 and --mb > 0, got {repeats} and {mb}")
    with run_directory(run_dir, "intra") as rd:
        gloo_before = run_gloo(mb, workers, repeats, rd, "before", timeout)
        topo = load_topology(None, dcs=1, workers_per_dc=workers, wan="lan", topology="hips")
        wall = launch(topo, [sys.executable, "-m", "geomx.bench.intra", "kv-worker", "--mb", str(mb),
                             "--repeats", str(repeats)], rd, timeout, "intra bench")
        geomx_results = [read_json(rd / f"intra-a-{r}.json", "intra bench") for r in range(workers)]
        gloo_after = run_gloo(mb, workers, repeats, rd, "after", timeout)
    g_before, g_after = _per_sync(gloo_before, repeats), _per_sync(gloo_after, repeats)
    gloo = (g_before + g_after) / 2
    geo = _per_sync(geomx_results, repeats)
    nbytes = _elements(mb) * 4
    return {"mib": mb, "bytes": nbytes, "workers": workers, "repeats": repeats,
            "geomx_s": geo, "gloo_s": gloo, "gloo_before_s": g_before, "gloo_after_s": g_after,
            "ratio": ratio(geo, gloo), "deployment_s": wall,
            "geomx_iters": [r["iter_s"] for r in geomx_results],
            "gloo_iters": [r["iter_s"] for r in gloo_before + gloo_after]}


def format_intra_report(r: dict) -> str:
    mib = r["bytes"] / MIB
    rows = [["geomx (HiPS: workers -> local server -> global server)", f"{r['geomx_s']:.3f}",
             f"{mib / r['geomx_s']:.0f}", f"{r['ratio']:.2f}x"],
            [f"torch.distributed gloo all_reduce (before {r['gloo_before_s']:.3f} s, after "
             f"{r['gloo_after_s']:.3f} s)", f"{r['gloo_s']:.3f}", f"{mib / r['gloo_s']:.0f}", "1.00x"]]
    table = markdown_table(["method", "seconds per sync", "MiB synchronized / s", "time vs gloo"], rows)
    return "\n".join([
        f"{r['workers']} processes synchronize one float32 tensor of {mib:g} MiB, {r['repeats']} times back to back.",
        "", table, "",
        f"Seconds per sync = wall time of the {r['repeats']} timed syncs / {r['repeats']} on the slowest process, "
        f"after a checked warm-up sync and a barrier. geomx: 1 DC, {r['workers']} workers, `lan`, "
        f"`kv.pushpull(out=...)`; its round includes the local server's forward of the DC sum to the global "
        f"server. gloo: `init_method=tcp://127.0.0.1`, measured before and after the geomx deployment "
        f"(averaged). geomx takes {r['ratio']:.2f}x the time of gloo."])


def cmd_intra(args) -> int:
    result = bench_intra(args.mb, args.workers, args.repeats, run_dir=args.run_dir, timeout=args.timeout)
    emit_report(args, "geomx bench intra: one DC's gradient sync vs gloo all_reduce", format_intra_report(result),
                result)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser("intra", help="intra-DC sync of one gradient: geomx (HiPS, lan) vs gloo all_reduce")
    p.add_argument("--mb", type=float, default=64, help="gradient size in MiB (default 64)")
    p.add_argument("--workers", type=int, default=4, help="workers / gloo processes (default 4)")
    p.add_argument("--repeats", type=int, default=10, help="timed syncs (default 10)")
    p.set_defaults(fn=cmd_intra)
    return p


def main(argv: list[str] | None = None) -> int:
    return dispatch_helper("intra", {"kv-worker": kv_worker_main, "gloo-worker": gloo_worker_main}, argv)


if __name__ == "__main__":
    sys.exit(main())
