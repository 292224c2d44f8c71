"""The WAN emulator's own CPU per forwarded MB, this checkout against another (docs/benchmarks.md).

    git worktree add /tmp/before <commit>
    python tests/scripts/emulator_cpu.py --before /tmp/before [--rate 1gbit] [--mb 600] [--repeats 3] [--sizes 64k,1m]

Each version's emulator process forwards ``--mb`` MB of messages of each of ``--sizes`` (64 KiB, then 1 MiB by
default) over one link of
``--rate`` with no delay (geomx.bench.link.bench_capacity: 64 messages in flight, the emulator in its own
process as deployments run it), ``--repeats`` times, the versions taking turns so that both see the same machine
load; prints the median CPU ms per MB and forwarded rate of each. This checkout runs twice: relaying every byte
(as across hosts) and parking the payloads at the receiver (geomx.transport.parking, as on one host).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from geomx.bench.link import bench_capacity
from geomx.profiles import parse_rate


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True, help="the other checkout's root (its geomx package is imported)")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--mb", type=float, default=600)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="64k,1m", help="message sizes, k or m suffixed (default 64k,1m)")
    p.add_argument("--before-parks", action="store_true",
                   help="the other checkout parks too (from commit 337dc97 on): run it parked as well")
    args = p.parse_args()
    sizes = tuple(int(float(x[:-1]) * (1 << (10 if x[-1] == "k" else 20))) for x in args.sizes.lower().split(","))
    rate = parse_rate(args.rate)
    samples: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.repeats):
        for version, path in (("before", args.before), ("this checkout", None)):
            # the other checkout may not park
            modes = ("relayed",) if path and not args.before_parks else ("relayed", "parked")
            for row in bench_capacity(sizes=sizes, megabytes=args.mb, rate_bps=rate, emulator_path=path,
                                      modes=modes):
                samples.setdefault((f"{version}, {row['mode']}", row["message_bytes"]), []).append(row)
    print(f"| emulator | message size | CPU ms per MB (median of {args.repeats}) | runs | forwarded (Gbit/s) |")
    print("|---|---:|---:|---|---:|")
    for (version, size), rows in samples.items():
        cpu = [r["cpu_ms_per_mb"] for r in rows]
        print(f"| {version} | {size >> 10} KiB | {statistics.median(cpu):.3f} | {', '.join(f'{c:.3f}' for c in cpu)} "
              f"| {statistics.median(r['rate_bps'] for r in rows) / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
