"""``geomx bench incast``: the global servers' in-cast, and how several global servers relieve it (MultiGPS).

Every DC's local server pushes its DC's dense gradient to the global servers and pulls the result back each
step. With one global server at the central party, all DCs' pushes arrive at that one machine, whose network
interface is the bottleneck; GeoMX's MultiGPS spreads the keys over several global servers, each on a machine
(a line) of its own. The emulator models that interface as a node link (geomx.netem.node_links): each global
server sits on a line of ``--global-server-link`` in each direction, in tandem with the DCs' WAN links.

For each row, one real deployment (``--dcs`` DCs x 1 worker, HiPS, FSA) runs this module as its training
script (``python -m geomx.bench.incast kv-worker``): each worker initializes a model of ``--mb`` MiB in
``--keys`` float32 tensors (the master worker places each key on the global server with the fewest bytes so
far, so G servers share the bytes evenly), takes a checked warm-up step, then ``--steps`` timed dense steps
(``pushpull`` of every key, then wait for all). Seconds per step = the slowest worker's timed loop / steps.

Rows: G = each of ``--global-servers`` with node links, and the control: one global server with no node link
(every DC's WAN link alone, nothing shared: what the in-cast costs is the gap between this row and G = 1).
Each row also shows the model's lower bound: the busiest line's bytes per step at its rate (a node link carries
every DC's share of its keys; a DC's WAN link its own model), plus one round trip; the pushes of one key and
the replies of another travel at once, in opposite directions, so one direction's time counts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from geomx.bench.common import (MIB, dispatch_helper, emit_report, launch, markdown_table, ratio, read_json,
                                run_directory)
from geomx.errors import ConfigError, GeomxError


def _key_elements(mib: float, keys: int) -> list[int]:
    total = max(keys, int(mib * MIB) // 4)
    return [total // keys + (1 if i < total % keys else 0) for i in range(keys)]


# -- the worker (inside a deployment) ------------------------------------------------------------------------

def kv_worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m geomx.bench.incast kv-worker")
    p.add_argument("--mb", type=float, required=True)
    p.add_argument("--keys", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args(argv)
    import numpy as np

    import geomx.kvstore

    kv = geomx.kvstore.create(reduction="mean")
    sizes = _key_elements(args.mb, args.keys)
    for i, n in enumerate(sizes):
        kv.init(f"layer{i}", np.zeros(n, dtype=np.float32))
    if kv.is_master_worker:
        kv.close()
        return 0
    grads = [np.full(n, float(kv.rank + 1 + 10 * int(os.environ.get("GEOMX_DC_INDEX", 0))), dtype=np.float32)
             for n in sizes]
    outs = [np.empty(n, dtype=np.float32) for n in sizes]

    def step() -> None:
        handles = [kv.pushpull(f"layer{i}", g, out=o) for i, (g, o) in enumerate(zip(grads, outs, strict=True))]
        for h in handles:
            h.wait()

    step()      # warm-up, checked: every key holds the mean over all workers
    dcs = int(os.environ.get("GEOMX_NUM_DCS", 1))
    expected = 1 + 10 * (dcs - 1) / 2           # one worker per DC: the mean of 1, 11, 21, ...
    if any(abs(float(o[0]) - expected) > 1e-3 or abs(float(o[-1]) - expected) > 1e-3 for o in outs):
        raise GeomxError(f"incast bench: a step returned {float(outs[0][0])}, expected the mean {expected}")
    kv.barrier()
    times = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        a = time.perf_counter()
        step()
        times.append(time.perf_counter() - a)
    loop = time.perf_counter() - t0
    Path(os.environ["GEOMX_RUN_DIR"], f"incast-{kv.dc}.json").write_text(json.dumps({"loop_s": loop,
                                                                                      "step_s": times}))
    kv.close()
    return 0


# -- the benchmark ---------------------------------------------------------------------------------------------

def _bound(topo, model_bytes: int, servers: int, node_bps: float | None) -> float:
    """The model's lower bound of one step: the busiest line's bytes in one direction at its rate (pushes and
    replies of different keys cross at once, in opposite directions), plus one round trip. Each directed link
    x -> y carries the pushes of DC x to the global servers in y and the replies of the servers in x to DC y: a
    share of the keys each (the master worker balances them by bytes), nothing of what stays inside a DC."""
    from geomx.profiles import CENTRAL_DC

    wan_bps = min(topo.profile.uplink_bps, topo.profile.downlink_bps)
    places = topo.global_server_dcs or [CENTRAL_DC] * servers
    share = {p: places.count(p) / servers for p in [CENTRAL_DC, *topo.dc_names]}
    pair = {(x, y): (share[y] if x != CENTRAL_DC else 0.0) + (share[x] if y != CENTRAL_DC else 0.0)
            for x in share for y in share if x != y}
    loads = list(pair.values())
    if topo.dc_lines:          # a DC's line carries all of its links' bytes, in each direction
        for dc in topo.dc_names:
            loads += [sum(v for (x, _), v in pair.items() if x == dc), sum(v for (_, y), v in pair.items() if y == dc)]
    busiest = max(loads) * model_bytes * 8 / wan_bps
    if node_bps:
        busiest = max(busiest, topo.dcs * model_bytes / servers * 8 / node_bps)
    return busiest + topo.profile.rtt_s


def bench_incast(*, dcs: int, servers: list[int], link: str, mb: float, keys: int, steps: int, profile: str,
                 run_dir: str | None = None, timeout: float = 900.0, placement: str = "lines",
                 dc_lines: bool = False) -> dict:
    """``placement``: "lines", each global server at the central party on a line of its own; "dcs", global server
    i inside DC i (no line of its own), MultiGPS's other deployment. ``dc_lines``: each DC's traffic to all
    others shares one line (geomx.netem.dc_lines) in every row."""
    from geomx.cli.topology import dc_name, load_topology
    from geomx.profiles import parse_rate

    if dcs < 2 or steps < 1 or mb <= 0 or keys < 1 or not servers or min(servers) < 1:
        raise ConfigError(f"incast bench: --dcs >= 2, --steps >= 1, --mb > 0, --keys >= 1 and --global-servers "
                          f">= 1 each, got {dcs}, {steps}, {mb}, {keys}, {servers}")
    node_bps = parse_rate(link)
    model_bytes = sum(_key_elements(mb, keys)) * 4
    if placement not in ("lines", "dcs"):
        raise ConfigError(f"incast bench: --placement is lines or dcs, got {placement!r}")
    if placement == "dcs" and max(servers) > dcs:
        raise ConfigError(f"incast bench: --placement dcs puts global server i inside DC i, so --global-servers "
                          f"must be <= --dcs ({dcs}), got {max(servers)}")
    dc_names = [dc_name(i) for i in range(dcs)]
    rows = [("control: 1 global server, no node link", 1, None, None)]
    for g in servers:
        if placement == "lines":
            rows.append((f"{g} global server{'s' if g > 1 else ''}, each on its own {node_bps / 1e9:g} Gbit/s line",
                         g, link, None))
        else:
            rows.append((f"{g} global server{'s' if g > 1 else ''} inside DC{'s' if g > 1 else ''} "
                         f"{', '.join(dc_names[:g])}", g, None, ",".join(dc_names[:g])))
    results = []
    with run_directory(run_dir, "incast") as rd:
        for name, g, line, places in rows:
            topo = load_topology(None, dcs=dcs, workers_per_dc=1, global_servers=g, wan=profile,
                                 global_server_link=line, global_server_dcs=places, wan_dc_lines=dc_lines or None)
            row_dir = rd / (f"g{g}" + ("-node" if line else "-dcs" if places else "-control"))
            command = [sys.executable, "-m", "geomx.bench.incast", "kv-worker", "--mb", str(mb), "--keys", str(keys),
                       "--steps", str(steps)]
            wall = launch(topo, command, row_dir, timeout, f"incast bench ({name})")
            per_dc = [read_json(row_dir / f"incast-{dc}.json", "incast bench") for dc in topo.dc_names]
            links = read_json(row_dir / "wan_links.json", "incast bench")
            step_s = max(r["loop_s"] for r in per_dc) / steps
            wan_bytes = sum(v["bytes"] for v in links.get("links", {}).values())
            bound = _bound(topo, model_bytes, g, node_bps if line else None)
            results.append({"row": name, "global_servers": g, "node_link_bps": node_bps if line else None,
                            "global_server_dcs": topo.global_server_dcs, "wan_bytes": wan_bytes,
                            "link_bytes": {k: v["bytes"] for k, v in links.get("links", {}).items()},
                            "step_s": step_s, "bound_s": bound, "efficiency": bound / step_s, "deployment_s": wall,
                            "node_bytes": {k: v["bytes"] for k, v in links.get("node_links", {}).items()},
                            "steps": [r["step_s"] for r in per_dc]})
    # the baseline: the fewest global servers placed as this run places them
    one = next(r for r in results[1:] if r["global_servers"] == min(servers))
    for r in results:
        r["speedup_vs_one"] = ratio(one["step_s"], r["step_s"])
    return {"dcs": dcs, "profile": profile, "mb": mb, "model_bytes": model_bytes, "keys": keys, "steps": steps,
            "node_link_bps": node_bps, "placement": placement, "dc_lines": dc_lines, "rows": results}


def format_incast_report(res: dict) -> str:
    from geomx.profiles import get_profile

    p = get_profile(res["profile"])
    rows = [[r["row"], f"{r['step_s']:.3f}", f"{r['bound_s']:.3f}", f"{r['efficiency']:.2f}",
             f"{r['speedup_vs_one']:.2f}x", f"{r['wan_bytes'] / 1e6:.0f}"] for r in res["rows"]]
    placed = "on node links" if res.get("placement", "lines") == "lines" else "inside DCs"
    table = markdown_table(["configuration", "s / step", "model's bound, s", "bound / measured",
                            f"speedup vs {min(r['global_servers'] for r in res['rows'][1:])} "
                            f"global server(s) {placed}", "WAN MB, whole run"], rows)
    return "\n".join([
        f"{res['dcs']} DCs x 1 worker, HiPS FSA, WAN `{res['profile']}` ({p.description}) from every DC, a dense "
        f"model of {res['model_bytes'] / 1e6:.1f} MB in {res['keys']} float32 keys; {res['steps']} timed steps per "
        f"row after a checked warm-up step"
        f"{'; each DC on one line of its own to the WAN (--wan-dc-lines)' if res.get('dc_lines') else ''}.",
        "", table, "",
        "Seconds per step = the slowest worker's timed loop / steps. The model's bound: the busiest line's bytes "
        "in one direction at its rate (a global server's node link carries every DC's share of its keys, a DC's "
        "WAN link its own model; pushes and replies cross at once), plus one round trip. WAN MB: every emulated "
        "DC link's bytes over the whole run (keys' initialization, the warm-up step and the timed steps). The "
        "control row has no "
        "node link: each DC's traffic crosses only its own WAN link, so the gap between it and the single global "
        "server on its line is the in-cast. A global server inside a DC: that DC's share of its keys crosses no "
        "WAN link, the other DCs' cross their link to that DC and back (the emulator's link per directed DC pair, "
        "full duplex: a link x -> y carries x's pushes to the servers in y and the replies of the servers in x)."])


def cmd_incast(args) -> int:
    servers = [int(x) for x in str(args.global_servers).split(",") if x.strip()]
    result = bench_incast(dcs=args.dcs, servers=servers, link=args.global_server_link, mb=args.mb, keys=args.keys,
                          steps=args.steps, profile=args.profile, run_dir=args.run_dir, timeout=args.timeout,
                          placement=args.placement, dc_lines=args.dc_lines)
    emit_report(args, "geomx bench incast: global servers on lines of their own (MultiGPS)",
                format_incast_report(result), result)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    from geomx.profiles import PROFILES

    p = bsub.add_parser("incast", help="the global servers' in-cast: 1, 2, 4 global servers, each on its own line")
    p.add_argument("--dcs", type=int, default=8, help="DCs, one worker each (default 8)")
    p.add_argument("--global-servers", default="1,2,4", help="global server counts, one row each (default 1,2,4)")
    p.add_argument("--global-server-link", default="1gbit", help="each global server's line (default 1gbit)")
    p.add_argument("--profile", default="regional", choices=sorted(n for n, pr in PROFILES.items() if pr.emulated),
                   help="every DC's WAN link (default regional: 1 Gbit/s, 20 ms)")
    p.add_argument("--mb", type=float, default=32, help="model size in MiB (default 32)")
    p.add_argument("--keys", type=int, default=32, help="tensors the model is made of (default 32: 1 MiB each)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (default 5)")
    p.add_argument("--placement", choices=["lines", "dcs"], default="lines",
                   help="lines: each global server at the central party on a line of its own (default); dcs: global "
                        "server i inside DC i, with no line of its own")
    p.add_argument("--dc-lines", action="store_true",
                   help="each DC's traffic to all others shares one line at its link's rate (geomx launch "
                        "--wan-dc-lines), as a real DC's uplink does")
    p.set_defaults(fn=cmd_incast)
    return p


def main(argv: list[str] | None = None) -> int:
    return dispatch_helper("incast", {"kv-worker": kv_worker_main}, argv)


if __name__ == "__main__":
    sys.exit(main())
