"""``geomx bench ...`` sub-commands (filled in by the benchmark modules)."""
from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: transport, intra, link, wan")
    bsub = p.add_subparsers(dest="bench", required=True)
    del bsub
