"""The ``geomx`` command."""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

from geomx.errors import GeomxError
from geomx.profiles import PROFILES
from geomx.sync.settings import ALGORITHMS


def _add_topology_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="topology TOML file (flags override it)")
    p.add_argument("--dcs", type=int, help="number of data centers (default 2)")
    p.add_argument("--workers-per-dc", type=int, help="workers in every DC (default 2)")
    p.add_argument("--global-servers", type=int, help="global servers in the central party (default 1)")
    p.add_argument("--wan", choices=sorted(PROFILES), help="WAN profile between DCs (default regional)")
    p.add_argument("--wan-rate", help="custom WAN rate, e.g. 100mbit (with --wan-rtt)")
    p.add_argument("--wan-rtt", help="custom WAN round-trip time, e.g. 180ms (with --wan-rate)")
    p.add_argument("--mode", choices=["dist_sync", "dist_async"], help="FSA (dist_sync, default) or MixedSync")
    p.add_argument("--mixedsync", choices=["wait", "overlap"],
                   help="dist_async: local servers answer their DC after the WAN round (wait, GeoMX, default) or "
                        "at once, trading gradients with the global servers behind (overlap)")
    p.add_argument("--topology", choices=["hips", "flat"], help="hierarchical (default) or flat parameter server")
    algorithm = p.add_mutually_exclusive_group()
    algorithm.add_argument("--sync", choices=list(ALGORITHMS),
                           help="synchronization algorithm (default fsa; see geomx.sync)")
    # an exact flag, so that --p3 is not read as an abbreviation of --p3-slice (argparse takes unique prefixes)
    algorithm.add_argument("--p3", dest="sync", action="store_const", const="p3",
                           help="the same as --sync p3 (GeoMX's ENABLE_P3=1): the next forward pass overlaps the "
                                "rest of each round, layer by layer")
    p.add_argument("--hfa-k1", type=int, help="hfa/diloco: local steps between DC averages (default 1)")
    p.add_argument("--hfa-k2", type=int, help="hfa/diloco: DC averages between global averages (default 1)")
    p.add_argument("--hfa-overlap", type=int, metavar="D",
                   help="hfa/diloco: let the global average travel while training goes on, applying it D DC "
                        "periods (D x K1 steps) after it was sent, 1 <= D <= 4 x K2; above K2 several travel at "
                        "once (default 0: wait for it)")
    p.add_argument("--hfa-overlap-keep", type=float, metavar="SHARE",
                   help="hfa/diloco with --hfa-overlap: the share of the local steps taken while a global average "
                        "travelled that is kept on top of it, in [0, 1] (default 1; 0.5 trained better in every run "
                        "measured, docs/benchmarks.md)")
    p.add_argument("--hfa-dc-sync", choices=["models", "gradients"],
                   help="hfa/diloco: within a DC average the workers' models every K1 steps (default), or their "
                        "gradients before every step (K1 = 1; one model and optimizer state per DC)")
    p.add_argument("--hfa-dc-overlap", type=int, metavar="STEPS",
                   help="hfa/diloco (K2 >= 2): each DC-only average of the models travels STEPS local steps "
                        "(1..K1; K1: to the next DC boundary) behind training and is adopted with the steps taken "
                        "meanwhile kept, so no worker waits for its DC's slowest (default 0: wait for it)")
    p.add_argument("--dga-delay", type=int, help="dga: steps between pushing a gradient and applying its average "
                                                  "(default 1)")
    p.add_argument("--esync-steps", type=int, help="esync: local steps of the slowest worker per round (default 1)")
    p.add_argument("--p3-slice", type=int, metavar="ELEMENTS",
                   help="p3: each parameter travels in slices of at most this many elements, each its own key, so "
                        "a layer's first slices are answered while its last still travel (0: only the deployment's "
                        "parts; default 0 where geomx launch sizes the parts for an emulated WAN, which are P3's "
                        "slices then, else 50000, P3's)")
    p.add_argument("--wan-loss", metavar="P", help="packet loss on every emulated link, a fraction or percentage "
                                                   "(0.0001, 0.01%%), or 'profile' for the WAN profile's own: caps "
                                                   "each TCP stream at the Mathis rate")
    p.add_argument("--wan-streams", type=int, metavar="N",
                   help="parallel TCP streams per emulated link (default 1; with --wan-loss/--wan-window)")
    p.add_argument("--wan-window", type=int, metavar="BYTES", help="per-stream TCP window: caps a stream at "
                                                                  "window / RTT (default: no cap)")
    p.add_argument("--wan-slow-start", action="store_true", default=None,
                   help="a link idle for longer than its retransmission timeout (RTT + 200 ms) starts again from the "
                        "streams' initial windows (10 segments) and doubles its rate every RTT, as Linux does by "
                        "default (tcp_slow_start_after_idle)")
    p.add_argument("--global-server-link", metavar="RATE",
                   help="put each global server on a line of its own of this rate (e.g. 1gbit), both directions, "
                        "which every DC's traffic to it shares: the in-cast that several global servers relieve")
    p.add_argument("--global-server-dcs", metavar="DC,...",
                   help="where each global server sits, one name per global server: central (the default) or a DC "
                        "(e.g. a,b): its traffic with that DC's nodes then crosses no WAN link (MultiGPS placement)")
    p.add_argument("--wan-dc-lines", action="store_true", default=None,
                   help="each DC's traffic to every other DC shares one line (its link's rate, each direction), as "
                        "a real DC's uplink does; without it every DC pair has a link of its own")
    p.add_argument("--wan-link", action="append", metavar="LINK=RATE/RTT[/LOSS][/JITTER]",
                   help="one link's own rate and RTT, and loss and jitter (repeatable, each link once): "
                        "b=50mbit/250ms (both directions between DC b and the central party), a->central=1gbit/20ms "
                        "(one direction), b=50mbit/250ms/0.1%%/5ms (a jitter carries its unit)")
    p.add_argument("--slowdown", action="append", metavar="DC[:RANK]=FACTOR",
                   help="make these workers compute FACTOR times slower (repeatable), e.g. b=3 or a:1=2")


def topology_from_args(args: argparse.Namespace):
    from geomx.cli.topology import load_topology

    return load_topology(args.config, dcs=args.dcs, workers_per_dc=args.workers_per_dc,
                         global_servers=args.global_servers, wan=args.wan, wan_rate=args.wan_rate,
                         wan_rtt=args.wan_rtt, mode=args.mode, mixedsync=args.mixedsync, topology=args.topology,
                         sync=args.sync,
                         sync_k1=args.hfa_k1, sync_k2=args.hfa_k2, sync_overlap=args.hfa_overlap,
                         sync_dc_sync=args.hfa_dc_sync, sync_overlap_keep=args.hfa_overlap_keep,
                         sync_dc_overlap=args.hfa_dc_overlap,
                         sync_delay=args.dga_delay,
                         sync_steps=args.esync_steps, sync_slice=args.p3_slice,
                         slowdown=args.slowdown, wan_links=args.wan_link, wan_loss=args.wan_loss,
                         wan_streams=args.wan_streams, wan_window=args.wan_window,
                         wan_slow_start=args.wan_slow_start, global_server_link=args.global_server_link,
                         global_server_dcs=args.global_server_dcs, wan_dc_lines=args.wan_dc_lines)


def cmd_launch(args: argparse.Namespace) -> int:
    from geomx.cli.fault_domains import MIN_DCS_ENV, MIN_WORKERS_ENV
    from geomx.cli.launch import Launcher
    from geomx.config import checkpoint_path

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise GeomxError("geomx launch needs the training command after --, e.g. "
                         "geomx launch -- python examples/train_cnn.py")
    # `not x > 0` and isfinite: NaN passes `x <= 0`; --timeout nan had meant none, --timeout 0 a run stopped at once
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise GeomxError(f"--timeout must be a finite number of seconds > 0, got {args.timeout:g}")
    topo = topology_from_args(args)
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if args.checkpoint_every is not None:
        if args.checkpoint_every < 1:
            raise GeomxError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
        topo.env["GEOMX_CHECKPOINT_EVERY"] = str(args.checkpoint_every)
    if args.checkpoint_seconds is not None:
        if not (math.isfinite(args.checkpoint_seconds) and args.checkpoint_seconds > 0):
            raise GeomxError(f"--checkpoint-seconds must be a finite number > 0, got {args.checkpoint_seconds:g}")
        topo.env["GEOMX_CHECKPOINT_SECONDS"] = repr(args.checkpoint_seconds)
        topo.validate()         # again: time-based checkpoints need a step to be one round of every key
    if args.checkpoint_dir is not None:
        directory = checkpoint_path(args.checkpoint_dir, "--checkpoint-dir").expanduser().resolve()
        if directory.exists() and not directory.is_dir():
            raise GeomxError(f"--checkpoint-dir {args.checkpoint_dir}: {directory} exists and is not a directory")
        topo.env["GEOMX_CHECKPOINT_DIR"] = str(directory)
    if args.min_workers_per_dc is not None:
        smallest = min(topo.workers_per_dc)
        if not 1 <= args.min_workers_per_dc <= smallest:
            raise GeomxError(f"--min-workers-per-dc must be between 1 and the smallest DC's workers ({smallest}), "
                             f"got {args.min_workers_per_dc}")
        topo.env[MIN_WORKERS_ENV] = str(args.min_workers_per_dc)
    if args.min_dcs is not None:
        if not 1 <= args.min_dcs <= topo.dcs:
            raise GeomxError(f"--min-dcs must be between 1 and the number of DCs ({topo.dcs}), got {args.min_dcs}")
        topo.env[MIN_DCS_ENV] = str(args.min_dcs)
    from geomx.cli.backends import make_backend

    backend = make_backend(args.backend, address=args.address)
    return Launcher(topo, command, run_dir=run_dir, quiet=args.quiet, secure=args.secure, insecure=args.insecure,
                    resume=args.resume, resume_step=args.resume_step, inject=args.inject,
                    inject_seed=args.inject_seed, backend=backend,
                    restart_failed=args.restart_failed, rejoin_after=args.rejoin_after).run(timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="geomx", description="geo-distributed training with a hierarchical "
                                                                "parameter server")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("launch", help="start a whole deployment on this machine and run a training command")
    _add_topology_flags(p)
    p.add_argument("--run-dir", help="directory for logs and metrics (default runs/<timestamp>)")
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="where the roles run: child processes here (local, default) or a Ray cluster whose nodes "
                        "carry each DC's resource geomx_dc_<DC> (and geomx_dc_central), e.g. ray start "
                        "--resources '{\"geomx_dc_a\": 1}'; needs pip install \"geomx[ray]\"")
    p.add_argument("--address", help="--backend ray: the Ray cluster (default RAY_ADDRESS, else a cluster started "
                                     "on this machine, else a new one-node cluster that is every DC)")
    p.add_argument("--quiet", action="store_true", help="no live progress, no echo of the workers' output")
    p.add_argument("--timeout", type=float, help="stop everything after this many seconds")
    p.add_argument("--secure", action="store_true",
                   help="encrypt and authenticate every message (AES-GCM, or CurveZMQ with GEOMX_ENCRYPTION=curve; a "
                        "fresh secret for this run); by default "
                        "every connection is authenticated with a fresh token (not encrypted)")
    p.add_argument("--insecure", action="store_true",
                   help="no authentication at all (every process logs it); message senders are still checked")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="every N steps each worker checkpoints its model and optimizer into <run dir>/checkpoints "
                        "(GEOMX_CHECKPOINT_EVERY; read by scripts built on geomx.torch.loop), and global servers "
                        "that run the optimizer their state every N rounds")
    p.add_argument("--checkpoint-seconds", type=float, metavar="S",
                   help="also checkpoint about every S seconds: global server 0 declares the step every worker and "
                        "global server saves (GEOMX_CHECKPOINT_SECONDS; synchronous fsa or p3 only)")
    p.add_argument("--checkpoint-dir", metavar="PATH",
                   help="write checkpoints here instead of <run dir>/checkpoints, e.g. storage every host mounts: a "
                        "path or a file:///abs/path URL (GEOMX_CHECKPOINT_DIR; --resume and --restart-failed find it "
                        "in the run's launch.json)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="resume the job whose run directory this was, from the latest step every worker "
                        "checkpointed (run it with its own --run-dir)")
    p.add_argument("--inject", action="append", metavar="ACTION:TARGET@T[+D][=RATE]",
                   help="inject a fault T seconds after every role started: kill or stop (SIGSTOP, undone after D "
                        "seconds) a role, e.g. kill:a-worker-1@10, stop:b-server@5+3, kill:random@10; or cut every "
                        "emulated WAN link of a DC for D seconds, e.g. partition:b@6+2, or slow them, e.g. "
                        "slow:b@6+10=10mbit; repeatable")
    p.add_argument("--min-workers-per-dc", type=int, metavar="N",
                   help="a DC goes on without a worker that died or froze while N of its workers remain (default 1; "
                        "the DC's workers count to stop at the first lost worker); GEOMX_MIN_WORKERS_PER_DC")
    p.add_argument("--min-dcs", type=int, metavar="N",
                   help="the other DCs go on without a DC whose local server died or whose WAN link stayed down past "
                        "the heartbeat deadline, while N DCs remain (default 1; the number of DCs to stop at the "
                        "first lost DC); GEOMX_MIN_DCS")
    p.add_argument("--restart-failed", type=int, default=0, metavar="N",
                   help="when a role fails in a way no fault domain absorbs, start the whole job again from its last "
                        "checkpoint (--checkpoint-every, --checkpoint-seconds; afresh without one), at most N times; "
                        "each failed attempt's logs go to <run dir>/attempt-<k>")
    p.add_argument("--rejoin-after", type=float, metavar="S",
                   help="start a worker its DC went on without (killed, or dropped when it froze) again S seconds "
                        "later: it rejoins the running job in its old place, from the current model (needs the "
                        "servers' optimizer, --update-on server)")
    p.add_argument("--inject-seed", type=int, default=0, help="the seed that picks --inject's random role")
    p.add_argument("--resume-step", type=int, metavar="N",
                   help="with --resume: go back to step N (every worker must have kept its checkpoint)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    p.set_defaults(fn=cmd_launch)

    from geomx.bench.cli import add_bench_parser
    add_bench_parser(sub)
    from geomx.cli.doctor import add_doctor_parser
    add_doctor_parser(sub)
    from geomx.report.cli import add_plot_parser, add_report_parser
    add_report_parser(sub)
    add_plot_parser(sub)

    args = parser.parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()      # a reader that closed the pipe early shows here, not at interpreter exit
        return code
    except GeomxError as exc:
        print(f"geomx: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _discard_stdout()
        return 128 + signal.SIGPIPE   # what `cat | head` reports: the reader left, nothing went wrong here


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that Python's final flush of what is still buffered fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
