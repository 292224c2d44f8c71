"""``geomx bench fusion``: one DC average of a real model's tensors, a key per tensor against fused buckets.

A real deployment (HiPS, 1 DC, ``--workers`` workers, ``lan``) whose workers (this module, run as
``python -m geomx.bench.fusion worker``) build examples/train_lm.py's model and average it over the DC
(``pushpull(scope="dc")``, as HFA and DiLoCo do every K1 steps) through :class:`geomx.sync.fusion.Fusion` with
each bucket size of ``--buckets`` (0: a key per tensor, what geomx did before fusion). Each size: one checked
warm-up average, then ``--repeats`` back to back; the sizes take turns twice, so machine drift hits them alike.
Seconds per average = the slowest worker's loop time / repeats, the better of the two turns. Packing the
buckets and unpacking the replies is inside the timed loop.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from geomx.bench.common import (MIB, dispatch_helper, emit_report, launch, markdown_table, read_json, run_directory,
                                train_script_path)
from geomx.errors import GeomxError

TURNS = 2


def _lm_module():
    path = train_script_path("train_lm.py")
    spec = importlib.util.spec_from_file_location("geomx_bench_train_lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m geomx.bench.fusion worker")
    p.add_argument("--model", required=True)
    p.add_argument("--buckets", required=True, help="comma-separated bucket sizes in bytes")
    p.add_argument("--repeats", type=int, required=True)
    args = p.parse_args(argv)
    import torch

    import geomx.kvstore
    from geomx.sync.fusion import Fusion

    torch.set_num_threads(1)
    lm = _lm_module()
    torch.manual_seed(0)
    params = [(n, p.detach().clone()) for n, p in lm.ByteGPT(lm.SIZES[args.model]).named_parameters()]
    names, tensors = [n for n, _ in params], [t for _, t in params]
    kv = geomx.kvstore.create("dist_sync")
    kv.init(names, tensors)
    sizes = [int(b) for b in args.buckets.split(",")]
    fusions = {b: Fusion(f"bench{b}", names, tensors, bucket_bytes=b) for b in sizes}
    for f in fusions.values():
        f.init(kv, tensors)
    kv.waitall()
    if kv.is_master_worker:
        kv.close()
        return 0
    n = kv.num_workers
    mine = [torch.full_like(t, float(kv.rank + 1)) for t in tensors]
    result = {"bytes": sum(t.numel() * t.element_size() for t in tensors), "tensors": len(tensors),
              "keys": {str(b): f.keys for b, f in fusions.items()}, "loop_s": {str(b): [] for b in sizes}}
    for b, f in fusions.items():         # warm-up, checked: the DC's sum of each worker's 1 / n share
        out = [torch.empty_like(t) for t in tensors]
        for h in f.pushpull(kv, mine, out, scale=1.0 / n, scope="dc"):
            h.wait()
        expected = (n + 1) / 2
        worst = max(float((o - expected).abs().max()) for o in out)
        if worst > 1e-4:
            raise GeomxError(f"fusion bench: buckets of {b} bytes averaged to {expected} +- {worst}")
    kv.barrier()
    for _ in range(TURNS):
        for b, f in fusions.items():
            kv.barrier()
            started = time.perf_counter()
            for _ in range(args.repeats):
                for h in f.pushpull(kv, mine, mine, scale=1.0 / n, scope="dc"):
                    h.wait()
            result["loop_s"][str(b)].append(time.perf_counter() - started)
    Path(os.environ["GEOMX_RUN_DIR"], f"fusion-{kv.rank}.json").write_text(json.dumps(result))
    kv.close()
    return 0


def bench_fusion(model: str, buckets: list[int], workers: int, repeats: int, *, run_dir: str | None = None,
                 timeout: float = 600.0) -> dict:
    from geomx.cli.topology import load_topology

    if workers < 2 or repeats < 1:
        raise GeomxError(f"--workers must be >= 2 and --repeats >= 1, got {workers} and {repeats}")
    if not buckets or any(b < 0 for b in buckets):
        raise GeomxError(f"--buckets needs bucket sizes >= 0 (0: a key per tensor), got {buckets}")
    with run_directory(run_dir, "fusion") as rd:
        topo = load_topology(None, dcs=1, workers_per_dc=workers, wan="lan", topology="hips")
        launch(topo, [sys.executable, "-m", "geomx.bench.fusion", "worker", "--model", model, "--buckets",
                      ",".join(map(str, buckets)), "--repeats", str(repeats)], rd, timeout, "fusion bench")
        results = [read_json(rd / f"fusion-{r}.json", "fusion bench") for r in range(workers)]
    per_average = {b: min(max(r["loop_s"][str(b)][t] for r in results) for t in range(TURNS)) / repeats
                   for b in buckets}
    first = results[0]
    return {"model": model, "bytes": first["bytes"], "tensors": first["tensors"], "workers": workers,
            "repeats": repeats, "rows": [{"bucket_bytes": b, "keys": first["keys"][str(b)],
                                          "seconds": per_average[b]} for b in buckets]}


def format_fusion_report(r: dict) -> str:
    base = next((row["seconds"] for row in r["rows"] if row["bucket_bytes"] == 0), None)
    rows = []
    for row in r["rows"]:
        b = row["bucket_bytes"]
        label = "0 (a key per tensor)" if b == 0 else f"{b / MIB:g} MiB"
        versus = "-" if base is None else f"{base / row['seconds']:.2f}x"
        rows.append([label, str(row["keys"]), f"{row['seconds'] * 1e3:.2f}",
                     f"{r['bytes'] / row['seconds'] / 1e9:.2f}", versus])
    table = markdown_table(["bucket size", "keys per average", "ms per DC average", "GB/s of model",
                            "vs a key per tensor"], rows)
    return "\n".join([
        f"{r['workers']} workers of one DC average examples/train_lm.py's `{r['model']}` model ({r['tensors']} "
        f"tensors, {r['bytes'] / 1e6:.1f} MB), {r['repeats']} times back to back per bucket size.", "", table, "",
        "ms per DC average = the slowest worker's loop / repeats, the better of two turns (the sizes take turns); "
        "packing and unpacking the buckets are inside the loop. 1 DC, `lan`, `pushpull(scope=\"dc\")`, as HFA's "
        "DC rounds."])


def _sizes(text: str) -> list[int]:
    """``0,1m,4m`` -> bytes (0: a key per tensor)."""
    from geomx.bench.cli import _parse_bytes

    return [0 if part.strip() == "0" else _parse_bytes(part)[0] for part in text.split(",")]


def cmd_fusion(args) -> int:
    result = bench_fusion(args.model, _sizes(args.buckets), args.workers, args.repeats, run_dir=args.run_dir,
                          timeout=args.timeout)
    emit_report(args, f"geomx bench fusion: a DC average of the {args.model} LM, a key per tensor vs buckets",
                format_fusion_report(result), result)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser("fusion", help="a DC average of the LM's tensors: a key per tensor vs fused buckets")
    p.add_argument("--model", choices=("tiny", "small", "base"), default="tiny", help="LM size (default tiny)")
    p.add_argument("--buckets", default="0,1m,4m,16m", help="bucket sizes, 0 = a key per tensor (default 0,1m,4m,16m)")
    p.add_argument("--workers", type=int, default=2, help="workers of the DC (default 2)")
    p.add_argument("--repeats", type=int, default=40, help="timed averages per bucket size and turn (default 40)")
    p.set_defaults(fn=cmd_fusion)
    return p


def main(argv: list[str] | None = None) -> int:
    return dispatch_helper("fusion", {"worker": worker_main}, argv)


if __name__ == "__main__":
    sys.exit(main())
