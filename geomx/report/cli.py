"""``geomx report RUN_DIR...`` (the summary table of each run, definitions in geomx.report.summary) and
``geomx plot RUN_DIR... -o FILE.png`` (geomx.report.plot)."""
from __future__ import annotations

import argparse
from pathlib import Path

from geomx import json_text


def cmd_report(args) -> int:
    from geomx.report.run import load_run
    from geomx.report.summary import format_report, summarize

    target = args.target_loss if args.target_loss is not None else args.target_acc
    summaries = [summarize(load_run(path), target) for path in args.runs]
    if args.json:
        print(json_text.dumps(summaries if len(summaries) > 1 else summaries[0], indent=2))
    else:
        print("\n\n".join(format_report(s) for s in summaries))
    return 0


def add_report_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="summarize run directories: time, accuracy, WAN bytes, efficiency")
    p.add_argument("runs", nargs="+", help="run directories written by geomx launch")
    p.add_argument("--target-acc", type=float, help="report the time to reach this test accuracy")
    p.add_argument("--target-loss", type=float,
                   help="report the time to reach this validation loss (runs that log val_loss: train_lm.py)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(fn=cmd_report)
    return p


def cmd_plot(args: argparse.Namespace) -> int:
    from geomx.report.plot import check_labels, plot_runs
    from geomx.report.run import load_run

    labels = [x.strip() for x in args.labels.split(",")] if args.labels is not None else None
    check_labels(labels, len(args.runs))       # before loading: the mistake is in the command line
    print(plot_runs([load_run(path) for path in args.runs], Path(args.output), labels=labels))
    return 0


def add_plot_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="plot runs: accuracy vs time and vs WAN bytes, WAN link throughput")
    p.add_argument("runs", nargs="+", help="run directories written by geomx launch")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--labels", help="comma-separated legend labels, one per run (default: directory name, "
                                    "topology, mode, WAN profile)")
    p.set_defaults(fn=cmd_plot)
    return p
