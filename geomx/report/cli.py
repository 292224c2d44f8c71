"""``geomx report RUN_DIR...`` (the summary table of each run, definitions in geomx.report.summary) and
``geomx plot RUN_DIR... -o FILE.png`` (geomx.report.plot)."""
from __future__ import annotations

import argparse
from pathlib import Path

from geomx import json_text


def cmd_report(args) -> int:
    from geomx.report.run import EVAL_METRICS, load_run
    from geomx.report.summary import format_report, summarize

    # the parser lets at most one through: each is timed against the metric it names
    # without a target: the metric each run evaluated (an LM's row read "time to test accuracy -")
    target, metric = ((args.target_loss, EVAL_METRICS["val_loss"]) if args.target_loss is not None
                      else (args.target_acc, EVAL_METRICS["test_acc"]) if args.target_acc is not None
                      else (None, None))
    summaries = [summarize(load_run(path), target, metric) for path in args.runs]
    if args.json:
        print(json_text.dumps(summaries if len(summaries) > 1 else summaries[0], indent=2))
    else:
        print("\n\n".join(format_report(s) for s in summaries))
    return 0


def accuracy_fraction(text: str) -> float:
    """An accuracy target as argparse reads it: a fraction in [0, 1] (90 for 90% would never be reached)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: test accuracy is a fraction in [0, 1] (e.g. 0.9), not a percentage")
    return value


def add_report_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="summarize run directories: time, accuracy, WAN bytes, efficiency")
    p.add_argument("runs", nargs="+", help="run directories written by geomx launch")
    # one target: a run evaluates test accuracy or validation loss, never both
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-acc", type=accuracy_fraction,
                        help="report the time to reach this test accuracy, a fraction in [0, 1] (e.g. 0.9)")
    target.add_argument("--target-loss", type=float,
                        help="report the time to reach this validation loss or lower (runs that log val_loss: "
                             "train_lm.py)")
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
