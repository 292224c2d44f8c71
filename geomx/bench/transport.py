"""``geomx bench transport``: one worker's push+pull throughput to its server, against raw pyzmq.

geomx side: a real deployment started with the launcher (flat topology, 1 DC, 1 worker, ``lan``: the worker
talks straight to the global server over loopback, no emulator). The worker (this module, run as
``python -m geomx.bench.transport kv-worker``) times, per tensor size, ``repeats`` rounds of

* ``pushpull``: ``kv.pushpull(key, x, out=y).wait()`` (one request, one reply), and
* ``push+pull``: ``kv.push(key, x); kv.pull(key, out=y).wait()`` (two requests issued back to back),

with float32 torch tensors, after three untimed warm-up rounds of each, and writes the times into the run
directory. The master worker only initializes the keys.

raw side: a pyzmq DEALER sends the same bytes to a ROUTER in another process, which echoes them back;
``copy=False`` both ways. It sends them as geomx does: cut into the same parts (``GEOMX_PARTITION_BYTES``,
:func:`geomx.kvstore.partition.plan_parts`), every part sent before the first echo is awaited, so each part
comes back while later ones still go out, as geomx's replies do (a single frame that must arrive whole before
it returns made raw ZeroMQ look slower than geomx at 64 MiB).

The DEALER lives in the geomx worker process and its round trips are interleaved with geomx's (raw, pushpull,
push+pull, raw, ...), so both sides see the same machine load at the same moments: on a shared machine, load
that changes between two separate passes moves the ratio either way.

Throughput, the same definition for both: ``2 x payload bytes / round-trip time`` (payload bytes cross the
loopback once in each direction), with the round-trip time the median over the repeats.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from geomx.bench.common import (MIB, bench_env, dispatch_helper, emit_report, fmt_mib, launch, markdown_table,
                                median, parse_sizes, ratio, read_json, run_directory)
from geomx.errors import GeomxError

WARMUP_ROUNDS = 3       # untimed rounds per size and variant: the first size otherwise pays the process's warm-up
TARGET = 0.80           # geomx / raw at sizes >= TARGET_FROM_MIB (the target)
TARGET_FROM_MIB = 16


def _key(mib: float) -> str:
    return f"bench-transport-{mib:g}MiB"


def _elements(mib: float) -> int:
    return max(1, int(mib * MIB) // 4)


# -- the geomx worker (run inside the deployment) --------------------------------------------------------------

def kv_worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m geomx.bench.transport kv-worker")
    p.add_argument("--sizes", required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--echo-port", type=int, default=0, help="the raw echo server's port (0: no raw side)")
    args = p.parse_args(argv)
    sizes = parse_sizes(args.sizes)

    import torch

    import geomx.kvstore

    torch.set_num_threads(1)
    kv = geomx.kvstore.create(reduction="mean")
    values = [torch.rand(_elements(m), dtype=torch.float32) for m in sizes]
    keys = [_key(m) for m in sizes]
    kv.init(keys, values)
    if kv.is_master_worker:
        kv.close()
        return 0
    echo = EchoClient(args.echo_port, kv.cfg.partition_bytes) if args.echo_port else None
    results = []
    for mib, key, x in zip(sizes, keys, values, strict=False):
        y = torch.empty_like(x)
        payload = np.random.default_rng(0).integers(0, 255, x.numel() * 4, dtype=np.uint8) if echo else None
        for _ in range(WARMUP_ROUNDS):              # warm-up (connections, allocator, page faults), both sides
            kv.pushpull(key, x, out=y).wait()
            kv.push(key, x)
            kv.pull(key, out=y).wait()
            if echo:
                echo.roundtrip(payload)
        pushpull, push_pull, raw = [], [], []
        for _ in range(args.repeats):               # interleaved: every variant sees the same load
            if echo:
                raw.append(echo.roundtrip(payload))
            t0 = time.perf_counter()
            kv.pushpull(key, x, out=y).wait()
            t1 = time.perf_counter()
            kv.push(key, x)
            kv.pull(key, out=y).wait()
            t2 = time.perf_counter()
            pushpull.append(t1 - t0)
            push_pull.append(t2 - t1)
        if not torch.allclose(y, x):                 # 1 worker: the mean gradient is the pushed tensor
            raise GeomxError(f"transport bench: the value pulled for {key} differs from the value pushed")
        results.append({"mib": mib, "bytes": x.numel() * 4, "pushpull_s": pushpull, "push_pull_s": push_pull,
                        "raw_s": raw})
        del payload
    if echo:
        echo.close()
    import resource

    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # Linux reports KiB
    run_dir = Path(os.environ["GEOMX_RUN_DIR"])
    (run_dir / f"transport-{kv.dc}-{kv.rank}.json").write_text(json.dumps({"sizes": results,
                                                                           "peak_rss_bytes": peak_rss}))
    kv.close()
    return 0


# -- the raw pyzmq echo ------------------------------------------------------------------------------------------

def echo_server_main(argv: list[str]) -> int:
    """ROUTER that sends every message straight back (copy=False); a 3-frame message stops it."""
    import zmq

    p = argparse.ArgumentParser(prog="python -m geomx.bench.transport echo-server")
    p.add_argument("--port-file", required=True)
    p.add_argument("--idle-s", type=float, default=60.0, help="exit after this long without a message")
    args = p.parse_args(argv)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    Path(args.port_file + ".tmp").write_text(str(port))
    os.replace(args.port_file + ".tmp", args.port_file)
    while True:
        if not sock.poll(int(args.idle_s * 1000)):
            return 1                        # nobody talked to us for that long: the bench is gone
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 3:
            sock.send_multipart([frames[0], b"bye"])
            break
        sock.send_multipart(frames, copy=False)
    sock.close(linger=1000)
    ctx.term()
    return 0


class EchoServer:
    """The echo server process; ``port`` is where it listens. ``close`` stops it (through a client)."""

    def __init__(self, run_dir: Path, idle_s: float) -> None:
        port_file = run_dir / "echo-port"
        self.log = open(run_dir / "echo-server.log", "wb")  # noqa: SIM115 - lives as long as the server process
        self.proc = subprocess.Popen([sys.executable, "-m", "geomx.bench.transport", "echo-server", "--port-file",
                                      str(port_file), "--idle-s", str(idle_s)],
                                     env=bench_env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise GeomxError(f"transport bench: the raw echo server did not start (see {run_dir}/echo-server.log)")
            time.sleep(0.02)
        self.port = int(port_file.read_text())

    def close(self) -> None:
        if self.proc.poll() is None and hasattr(self, "port"):
            EchoClient(self.port).close(stop_server=True)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class EchoClient:
    """A DEALER that times DEALER -> ROUTER -> DEALER echoes of a payload (its own context and I/O thread), cut
    into the parts geomx would send for a float32 tensor of the same bytes (``partition_bytes``: 0, whole)."""

    def __init__(self, port: int, partition_bytes: int = 0) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.partition_bytes = partition_bytes

    def parts(self, payload: np.ndarray) -> list[np.ndarray]:
        from geomx.kvstore.partition import plan_parts

        plan = plan_parts("echo", (payload.nbytes // 4,), 4, self.partition_bytes)
        return [payload] if plan is None else [payload[p.start * 4:p.stop * 4] for p in plan]

    def roundtrip(self, payload: np.ndarray) -> float:
        parts = self.parts(payload)
        t0 = time.perf_counter()
        for part in parts:                    # pipelined: every part leaves before the first echo is awaited
            self.sock.send(part, copy=False)
        received = 0
        for _ in parts:
            if not self.sock.poll(120_000):
                raise GeomxError(f"transport bench: the raw echo of {payload.nbytes} bytes in {len(parts)} part(s) "
                                 f"did not come back in 120 s")
            received += len(self.sock.recv(copy=False))
        elapsed = time.perf_counter() - t0
        if received != payload.nbytes:
            raise GeomxError(f"transport bench: the raw echo returned {received} bytes, not {payload.nbytes}")
        return elapsed

    def close(self, *, stop_server: bool = False) -> None:
        try:
            if stop_server:
                self.sock.send_multipart([b"", b"stop"])
                self.sock.poll(2000)
        finally:
            self.sock.close()
            self.ctx.term()


# -- the benchmark -----------------------------------------------------------------------------------------------

# --secure: the links' protection in each deployment compared; "token" is the launcher's default (an
# authenticated connection, plaintext messages), the baseline the encrypted ones are measured against
SECURITY_MODES = {"token": ({}, False), "aes-gcm": ({"GEOMX_ENCRYPTION": "aes-gcm"}, True),
                  "curve": ({"GEOMX_ENCRYPTION": "curve"}, True)}
# issue 18: encrypted / plaintext throughput >= 50% at 64 MiB on loopback, >= 90% over emulated 1 Gbit/s links
SECURE_TARGETS = {"lan": (0.50, 64), "wan": (0.90, TARGET_FROM_MIB)}    # (ratio, from this many MiB)


def _deploy(rd: Path, sizes_arg: str, repeats: int, timeout: float, *, wan: str = "lan", security: str = "token",
            echo_port: int = 0, env: dict | None = None) -> tuple[dict, float]:
    """One deployment (flat, 1 DC, 1 worker; over ``wan``, with ``security``): the worker's samples, the wall."""
    from geomx.cli.topology import load_topology

    topo = load_topology(None, dcs=1, workers_per_dc=1, wan=wan, topology="flat")
    mode_env, secure = SECURITY_MODES[security]
    topo.env.update({**mode_env, **(env or {})})
    wall = launch(topo, [sys.executable, "-m", "geomx.bench.transport", "kv-worker", "--sizes", sizes_arg,
                         "--repeats", str(repeats), "--echo-port", str(echo_port)],
                  rd, timeout, f"transport bench ({security})", secure=secure)
    return read_json(rd / "transport-a-0.json", "transport bench"), wall


def bench_transport(sizes: list[float], repeats: int, *, run_dir: str | None = None, timeout: float = 600.0,
                    profile: bool = False) -> dict:
    if repeats < 1:
        raise GeomxError(f"--repeats must be >= 1, got {repeats}")
    sizes_arg = ",".join(f"{m:g}" for m in sizes)
    with run_directory(run_dir, "transport") as rd:
        env = profile_env(rd) if profile else {}
        echo = EchoServer(rd, timeout + 60) if not profile else None
        try:
            worker, wall = _deploy(rd, sizes_arg, repeats, timeout, echo_port=echo.port if echo else 0, env=env)
        finally:
            if echo:
                echo.close()
        rows = []
        for entry in worker["sizes"]:
            m, nbytes = entry["mib"], entry["bytes"]
            raw = entry.get("raw_s") or []
            rt = {"pushpull": median(entry["pushpull_s"]), "push+pull": median(entry["push_pull_s"]),
                  "raw": median(raw)}
            mbps = {k: 2 * nbytes / v / MIB for k, v in rt.items()}
            rows.append({"mib": m, "bytes": nbytes, "rtt_s": rt, "mib_per_s": mbps,
                         "ratio_pushpull": ratio(mbps["pushpull"], mbps["raw"]),
                         "ratio_push_pull": ratio(mbps["push+pull"], mbps["raw"]),
                         "samples": {"pushpull": entry["pushpull_s"], "push+pull": entry["push_pull_s"],
                                     "raw": raw}})
        result = {"repeats": repeats, "rows": rows, "deployment_s": wall, "profiled": profile,
                  "worker_peak_rss_bytes": worker.get("peak_rss_bytes")}
        if profile:
            result["profile"] = summarize_profiles(rd)
        return result


def bench_transport_secure(sizes: list[float], repeats: int, *, wan: str = "lan", passes: int = 2,
                           modes: tuple[str, ...] = tuple(SECURITY_MODES), run_dir: str | None = None,
                           timeout: float = 600.0) -> dict:
    """``pushpull`` round trips under each of ``modes``, one deployment per mode and pass, the modes taking
    turns (token, aes-gcm, curve, token, ...) so that load drifting over the run reaches every mode alike;
    each mode's samples pooled over its passes."""
    if repeats < 1 or passes < 1:
        raise GeomxError(f"--repeats and --passes must be >= 1, got {repeats} and {passes}")
    unknown = [m for m in modes if m not in SECURITY_MODES]
    if unknown or "token" not in modes:
        raise GeomxError(f"--modes {','.join(modes)}: each one of {', '.join(SECURITY_MODES)}, 'token' included "
                         f"(the plaintext baseline)")
    sizes_arg = ",".join(f"{m:g}" for m in sizes)
    samples: dict[str, dict[float, list[float]]] = {m: {} for m in modes}
    nbytes: dict[float, int] = {}
    with run_directory(run_dir, "transport-secure") as rd:
        for p in range(passes):
            for mode in modes:
                sub = rd / f"{mode}-{p}"
                sub.mkdir()
                worker, _ = _deploy(sub, sizes_arg, repeats, timeout, wan=wan, security=mode)
                for entry in worker["sizes"]:
                    samples[mode].setdefault(entry["mib"], []).extend(entry["pushpull_s"])
                    nbytes[entry["mib"]] = entry["bytes"]
    rows = []
    for mib in sorted(nbytes):
        rtt = {m: median(samples[m][mib]) for m in modes}
        mbps = {m: 2 * nbytes[mib] / rtt[m] / MIB for m in modes}
        rows.append({"mib": mib, "bytes": nbytes[mib], "rtt_s": rtt, "mib_per_s": mbps,
                     "vs_token": {m: ratio(mbps[m], mbps["token"]) for m in modes if m != "token"},
                     "samples": {m: samples[m][mib] for m in modes}})
    return {"repeats": repeats, "passes": passes, "wan": wan, "modes": list(modes), "rows": rows}


def format_transport_secure_report(result: dict) -> str:
    modes, encrypted = result["modes"], [m for m in result["modes"] if m != "token"]
    rows = [[fmt_mib(r["mib"]), *(_num(r["rtt_s"][m] * 1000, ".2f") for m in modes),
             *(_num(r["mib_per_s"][m], ".0f") for m in modes), *(_num(r["vs_token"][m], ".0%") for m in encrypted)]
            for r in result["rows"]]
    table = markdown_table([*("tensor",), *(f"{m} RTT (ms)" for m in modes), *(f"{m} MiB/s" for m in modes),
                            *(f"{m} / token" for m in encrypted)], rows)
    where = "wan" if result["wan"] != "lan" else "lan"
    target, from_mib = SECURE_TARGETS[where]
    verdicts = []
    for m in encrypted:
        big = [r["vs_token"][m] for r in result["rows"] if r["mib"] >= from_mib and math.isfinite(r["vs_token"][m])]
        if big:
            verdicts.append(f"{m}: {'met' if min(big) >= target else 'NOT met'} (lowest {min(big):.0%})")
    verdict = (f"Target ({'encrypted' if where == 'wan' else 'encrypted LAN'} throughput >= {target:.0%} of "
               f"plaintext at >= {from_mib} MiB): " + "; ".join(verdicts) + "."
               if verdicts else f"(no size >= {from_mib} MiB: the target was not checked)")
    return "\n".join([table, "",
                      f"`pushpull` round trips of one worker to its global server (flat, 1 DC, `{result['wan']}`), "
                      f"median of {result['repeats']} x {result['passes']} per size and mode; one deployment per "
                      f"mode and pass, the modes taking turns. token: the launcher's default (PLAIN-authenticated "
                      f"connections, plaintext); aes-gcm: `--secure` (every frame sealed with AES-256-GCM); curve: "
                      f"`--secure` with GEOMX_ENCRYPTION=curve (CurveZMQ). MiB/s = 2 x tensor bytes / round trip. "
                      f"{verdict}"])


def format_transport_report(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        rt, mbps = r["rtt_s"], r["mib_per_s"]
        rows.append([fmt_mib(r["mib"]),
                     _num(rt["raw"] * 1000, ".2f"), _num(rt["pushpull"] * 1000, ".2f"),
                     _num(rt["push+pull"] * 1000, ".2f"), _num(mbps["raw"], ".0f"), _num(mbps["pushpull"], ".0f"),
                     _num(mbps["push+pull"], ".0f"), _num(r["ratio_pushpull"], ".0%"),
                     _num(r["ratio_push_pull"], ".0%")])
    table = markdown_table(["tensor", "raw RTT (ms)", "pushpull RTT (ms)", "push+pull RTT (ms)", "raw MiB/s",
                            "pushpull MiB/s", "push+pull MiB/s", "pushpull / raw", "push+pull / raw"], rows)
    big = [r for r in result["rows"] if r["mib"] >= TARGET_FROM_MIB and math.isfinite(r["ratio_pushpull"])]
    if big:
        worst = min(r["ratio_pushpull"] for r in big)
        verdict = (f"Target (pushpull >= {TARGET:.0%} of raw at >= {TARGET_FROM_MIB} MiB): "
                   f"{'met' if worst >= TARGET else 'NOT met'} (lowest {worst:.0%}).")
    else:
        verdict = f"(no raw figure at >= {TARGET_FROM_MIB} MiB: the target was not checked)"
    text = [table, "",
            f"Median of {result['repeats']} round trips per size and variant, interleaved in the worker process "
            f"(raw, pushpull, push+pull, raw, ...). MiB/s = 2 x tensor bytes / round-trip time. "
            f"geomx: 1 worker -> global server "
            f"(flat topology, `lan`, float32 torch tensors, `out=` given); raw: pyzmq DEALER -> ROUTER echo in "
            f"another process, copy=False both ways, of the parts geomx sends (GEOMX_PARTITION_BYTES), pipelined. "
            f"{verdict}"
            + (f" Peak RSS of the geomx worker process: {result['worker_peak_rss_bytes'] / MIB:,.0f} MiB."
               if result.get("worker_peak_rss_bytes") else "")]
    if result.get("profiled"):
        text += ["", "Profiled run (cProfile in every thread: timings above are inflated by the profiler):", "",
                 format_profile(result["profile"])]
    return "\n".join(text)


def _num(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else "-"


def cmd_transport(args) -> int:
    if args.secure:
        result = bench_transport_secure(parse_sizes(args.sizes), args.repeats, wan=args.wan, passes=args.passes,
                                        modes=tuple(args.modes.split(",")), run_dir=args.run_dir,
                                        timeout=args.timeout)
        emit_report(args, f"geomx bench transport --secure: the cost of encryption (`{args.wan}`)",
                    format_transport_secure_report(result), result)
        return 0
    if args.wan != "lan":
        raise GeomxError("--wan applies to --secure only (the raw pyzmq side has no WAN)")
    result = bench_transport(parse_sizes(args.sizes), args.repeats, run_dir=args.run_dir, timeout=args.timeout,
                             profile=args.profile)
    emit_report(args, "geomx bench transport: push+pull vs raw pyzmq", format_transport_report(result), result)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser("transport", help="1 worker <-> its server over loopback: geomx push+pull vs raw pyzmq")
    p.add_argument("--sizes", default="1,4,16,64,256", help="tensor sizes in MiB, comma-separated "
                                                             "(default 1,4,16,64,256)")
    p.add_argument("--repeats", type=int, default=10, help="timed round trips per size and variant (default 10)")
    p.add_argument("--profile", action="store_true",
                   help="run every geomx process under cProfile (all threads) and print where the time goes; "
                        "skips the raw side")
    p.add_argument("--secure", action="store_true",
                   help="compare the links' protection instead: plaintext (token) against AES-GCM and CurveZMQ")
    p.add_argument("--wan", default="lan", help="with --secure: the WAN profile between worker and server "
                                                 "(default lan: loopback, no emulator; e.g. regional: 1 Gbit/s)")
    p.add_argument("--passes", type=int, default=2, help="with --secure: deployments per mode (default 2)")
    p.add_argument("--modes", default=",".join(SECURITY_MODES),
                   help=f"with --secure: the modes compared (default {','.join(SECURITY_MODES)})")
    p.set_defaults(fn=cmd_transport)
    return p


# -- profiling (diagnosis only) -----------------------------------------------------------------------------------

# Installed through PYTHONPATH as sitecustomize in every process of the deployment: each thread runs under
# its own cProfile.Profile, and each process writes its stats to GEOMX_BENCH_PROFILE_DIR when it exits.
_SITECUSTOMIZE = r'''
import atexit, cProfile, os, sys, threading
_dir = os.environ.get("GEOMX_BENCH_PROFILE_DIR")
if _dir:
    _profiles = []
    _lock = threading.Lock()
    _orig_run = threading.Thread.run
    def _run(self, *a, **k):
        prof = cProfile.Profile()
        with _lock:
            _profiles.append((self.name, prof))
        prof.enable()
        try:
            return _orig_run(self, *a, **k)
        finally:
            prof.disable()
    threading.Thread.run = _run
    _main = cProfile.Profile()
    _profiles.append(("main", _main))
    def _dump():
        _main.disable()
        role = os.environ.get("DMLC_ROLE_GLOBAL") or os.environ.get("DMLC_ROLE") or "proc"
        if os.environ.get("DMLC_ROLE_MASTER_WORKER") not in (None, "", "0"):
            role = "master"
        with _lock:
            items = list(_profiles)
        for i, (name, prof) in enumerate(items):
            try:
                prof.dump_stats(os.path.join(_dir, f"prof-{role}-{os.getpid()}-{i}-{name}.pstats"))
            except Exception:
                pass
    atexit.register(_dump)
    _main.enable()
'''


def profile_env(run_dir: Path) -> dict[str, str]:
    hook = run_dir / "profhook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    pp = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(hook) + (os.pathsep + pp if pp else ""), "GEOMX_BENCH_PROFILE_DIR": str(run_dir)}


_BLOCKING = ("acquire' of '_thread.lock", "(poll)", "poll", "select", "sleep", "(wait)")


def summarize_profiles(run_dir: Path, top: int = 12) -> dict:
    """Per role (worker, global_server): the functions with the most own time, over all its threads, leaving
    out blocking waits (lock acquire, poll, sleep: idle time, not work)."""
    import pstats

    by_role: dict[str, list[str]] = {}
    for f in sorted(run_dir.glob("prof-*.pstats")):
        role = f.name.split("-")[1]
        by_role.setdefault(role, []).append(str(f))
    out = {}
    for role, files in by_role.items():
        if role not in ("worker", "global_server"):
            continue
        st = pstats.Stats(*files)
        entries = []
        for (fn_file, line, name), (_cc, nc, tt, ct, _) in st.stats.items():
            if any(w in name for w in _BLOCKING):
                continue
            entries.append({"function": f"{_short(fn_file)}:{line}({name})", "calls": nc, "own_s": tt, "cum_s": ct})
        entries.sort(key=lambda e: -e["own_s"])
        out[role] = {"threads": len(files), "top": entries[:top]}
    return out


def _short(path: str) -> str:
    for marker in ("site-packages/", "geomx/", "lib/python"):
        i = path.find(marker)
        if i >= 0:
            return path[i + (len(marker) if marker != "geomx/" else 0):]
    return path


def format_profile(summary: dict) -> str:
    parts = []
    for role, info in summary.items():
        rows = [[e["function"], str(e["calls"]), f"{e['own_s']:.3f}", f"{e['cum_s']:.3f}"] for e in info["top"]]
        parts += [f"{role} ({info['threads']} profiled threads), by own time:", "",
                  markdown_table(["function", "calls", "own s", "cumulative s"], rows, [False, True, True, True]), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    return dispatch_helper("transport", {"kv-worker": kv_worker_main, "echo-server": echo_server_main}, argv)


if __name__ == "__main__":
    sys.exit(main())
