"""``geomx bench ...`` sub-commands.

    geomx bench transport [--sizes 1,4,16,64,256] [--repeats 10]
    geomx bench intra [--mb 64] [--workers 4] [--repeats 10]
    geomx bench wan [--profile transpacific] [--steps 6] [--dcs 2] [--workers-per-dc 2] [--model wide]
    geomx bench link [--profile transpacific | --wan-rate 100mbit --wan-rtt 180ms]
    geomx bench codec [--elements 25000000] [--repeats 3] [--threads N]
    geomx bench incast [--dcs 8] [--global-servers 1,2,4] [--global-server-link 1gbit] [--mb 32]
    geomx bench fusion [--model tiny] [--buckets 0,1m,4m,16m] [--workers 2] [--repeats 40]

Each prints a markdown report; ``--output FILE`` also appends it, with the command line, the date and the
machine, to FILE (e.g. docs/benchmarks.md). Every figure is measured in the run that prints it.
"""
from __future__ import annotations

import argparse


def _report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", metavar="FILE", help="also append the report (with command and date) to FILE")
    p.add_argument("--json", metavar="FILE", help="write the raw measurements as JSON to FILE")


def _common(p: argparse.ArgumentParser, default_timeout: float) -> None:
    _report_options(p)
    p.add_argument("--run-dir", help="keep the deployments' logs and results here (default: a temporary "
                                     "directory, removed afterwards)")
    p.add_argument("--timeout", type=float, default=default_timeout,
                   help=f"stop a deployment that runs longer than this many seconds (default {default_timeout:g})")


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: transport, intra, wan, link, codec, incast, fusion",
                       description="Benchmarks that print markdown reports (transport, intra and wan start real "
                                   "deployments on this machine). Every figure is measured in the run.")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="{transport,intra,wan,link,codec,incast,fusion}")

    from geomx.bench import codec, fusion, incast, intra, transport, wan

    for module, timeout in ((transport, 600.0), (intra, 600.0), (wan, 900.0), (incast, 900.0), (fusion, 600.0)):
        sp = module.add_parser(bsub)
        _common(sp, timeout)
        sp.set_defaults(bench_parser=sp)
    _add_link_parser(bsub)
    sp = codec.add_parser(bsub)     # in-process, no deployment: no --run-dir or --timeout
    _report_options(sp)
    sp.set_defaults(bench_parser=sp)


# -- geomx bench link (geomx/bench/link.py) ----------------------------------------------------------------------

def _add_link_parser(bsub) -> None:
    from geomx.profiles import PROFILES

    p = bsub.add_parser("link", help="one emulated WAN link: configured vs measured rate and delay")
    p.add_argument("--profile", choices=sorted(n for n, pr in PROFILES.items() if pr.emulated),
                   help="take rate, RTT and jitter from a WAN profile")
    p.add_argument("--wan-rate", help="link rate, e.g. 100mbit (default 100mbit)")
    p.add_argument("--wan-rtt", help="round-trip time, e.g. 40ms (default 40ms)")
    p.add_argument("--jitter", help="jitter (std of the one-way delay), e.g. 2ms (default 0)")
    p.add_argument("--sizes", default="64k,1m,4m", help="message sizes, e.g. 64k,1m,4m (default)")
    p.add_argument("--seconds", type=float, default=1.5, help="about how long each size transfers (default 1.5)")
    p.add_argument("--pings", type=int, default=40, help="ping-pongs per path for the delay (default 40)")
    p.add_argument("--loss", help="packet loss, a fraction or percentage (0.01%%), or 'profile' (with --profile): "
                                  "the link's TCP ceiling")
    p.add_argument("--streams", default="1", help="TCP streams per link, one run each, e.g. 1,8 (default 1)")
    p.add_argument("--window", type=int, help="per-stream TCP window in bytes")
    p.add_argument("--slow-start", action="store_true",
                   help="TCP slow start after idle on the link (each transfer starts from the initial windows)")
    p.add_argument("--capacity", action="store_true",
                   help="also measure the emulator process itself: the rate it forwards 64 KiB and 1 MiB messages "
                        "at over a link too fast to matter, and its CPU per MB")
    p.add_argument("--capacity-mb", type=float, default=2000, help="MB forwarded per message size (default 2000)")
    _report_options(p)
    p.set_defaults(fn=_cmd_link, bench_parser=p)


def _parse_bytes(text: str) -> tuple[int, ...]:
    from geomx.errors import ConfigError

    out = []
    for part in text.split(","):
        t = part.strip().lower().removesuffix("ib").removesuffix("b")
        mult = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}.get(t[-1:], 1)
        try:
            n = int(float(t[:-1] if mult > 1 else t) * mult)
        except ValueError:
            raise ConfigError(f"cannot read a size from {part!r}; write e.g. 64k or 1m") from None
        if n <= 0:
            raise ConfigError(f"sizes must be > 0 bytes, got {part!r}")
        out.append(n)
    return tuple(out)


def _cmd_link(args) -> int:
    from geomx.bench.common import emit_report
    from geomx.errors import ConfigError
    from geomx.profiles import get_profile, parse_duration, parse_rate

    from geomx.bench.link import bench_link, format_link_report
    if args.profile and (args.wan_rate or args.wan_rtt):
        raise ConfigError("give --profile or --wan-rate/--wan-rtt, not both")
    if args.profile:
        pr = get_profile(args.profile)
        rate, rtt, jitter = pr.uplink_bps, pr.rtt_s, pr.jitter_s
    else:
        rate = parse_rate(args.wan_rate) if args.wan_rate else 100e6
        rtt = parse_duration(args.wan_rtt) if args.wan_rtt else 0.040
        jitter = 0.0
    if args.jitter:
        jitter = parse_duration(args.jitter)
    from geomx.netem.tcp_model import tcp_path

    from geomx.bench.link import bench_capacity, format_capacity_report

    loss = args.loss
    if loss is not None and loss.strip().lower() == "profile":
        if not args.profile:
            raise ConfigError("--loss profile takes the loss of --profile: name one")
        loss = get_profile(args.profile).loss
    paths = [tcp_path(loss=loss, streams=n.strip(), window=args.window, slow_start=args.slow_start or None)
             for n in args.streams.split(",")]
    results = [bench_link(rate_bps=rate, rtt_s=rtt, jitter_s=jitter, sizes=_parse_bytes(args.sizes),
                          seconds=args.seconds, pings=args.pings, tcp=path) for path in paths]
    reports = [format_link_report(r) for r in results]
    raw = {"links": results}
    if args.capacity:
        raw["capacity"] = bench_capacity(megabytes=args.capacity_mb)
        reports.append(format_capacity_report(raw["capacity"]))
    emit_report(args, "geomx bench link: one emulated WAN link", "\n\n".join(reports), raw)
    return 0
