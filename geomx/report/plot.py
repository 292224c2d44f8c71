"""``geomx plot RUN_DIR... -o FILE.png``: one figure that overlays runs, three panels side by side.

1. test accuracy vs wall time since the workers started (first worker record; set-up marked);
2. test accuracy vs cumulative WAN bytes (MB): the emulator's per-second series summed over its links and
   interpolated at each evaluation; without an emulator, a straight line from 0 to the bytes the roles sent
   over the run's wall time (the legend says so);
3. throughput of every emulated WAN link over time, on the same clock as panel 1.

Accuracy at a step is the mean over the workers that evaluated it, at their mean time
(:func:`geomx.report.summary.accuracy_curve`). Everything is read through :func:`geomx.report.run.load_run`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from geomx.errors import GeomxError
from geomx.report.run import Run
from geomx.report.summary import MB, accuracy_curve

MBIT = 1e6
FIGSIZE_IN = (15.0, 4.5)
SHARED_LEGEND_RUNS = 4      # from this many runs on, one legend below the panels (per-panel ones cover the data)
DPI = 120
SMOOTH_S = 5             # seconds averaged in the throughput panel when several runs share it
NO_EMULATOR = "no emulator: bytes interpolated"


@dataclass
class LinkSeries:
    """One emulated link's throughput: ``times`` (s since training start) of each second's start, ``mbps``."""
    name: str                      # "src->dst"
    times: list[float]
    mbps: list[float]


@dataclass
class RunSeries:
    """What the figure draws for one run."""
    label: str                     # legend of panels 1 and 2
    short: str                     # prefix of the link lines in panel 3
    steps: list[int]
    times: list[float]             # mean time of each evaluated step, s since training start
    accs: list[float]              # mean test accuracy (or validation loss: the run's metric) at that step
    wan_mb: list[float]            # cumulative WAN MB at that time
    emulated: bool                 # False: wan_mb is the straight-line estimate
    ready_s: float = 0.0           # set-up done (last worker ready), s since training start
    metric: str = "test accuracy"  # what accs are
    links: list[LinkSeries] = field(default_factory=list)


def default_label(run: Run) -> str:
    m = run.manifest
    profile = m.get("wan", {}).get("profile", "?")
    return f"{run.name} ({m.get('topology', '?')}, {m.get('mode', '?')}, {profile})"


def series_for(run: Run, *, label: str | None = None) -> RunSeries:
    """The plotted numbers of one run; ``label`` replaces the default legend (directory name + manifest)."""
    curve = accuracy_curve(run)
    if not curve:
        raise GeomxError(f"run {run.path} has no evaluation (no step record with test_acc or val_loss): "
                         f"nothing to plot; did the training script log test_acc or val_loss?")
    steps, times, accs = (list(col) for col in zip(*curve, strict=False))
    emulated = bool(run.links and run.links.get("links"))
    wan = cumulative_link_bytes(run, times) if emulated else straight_line_bytes(run, times)
    return RunSeries(label=label or default_label(run), short=label or run.name, steps=steps, times=times,
                     accs=accs, wan_mb=[b / MB for b in wan], emulated=emulated, metric=run.metric.label,
                     ready_s=max((w.ready_t for w in run.workers), default=0.0),
                     links=link_throughput(run) if emulated else [])


def cumulative_link_bytes(run: Run, times: list[float]) -> list[float]:
    """Bytes all emulated links delivered up to each time (s since training start). Knots at whole seconds
    of the emulator's clock, linear in between: a second's bytes are spread evenly over it."""
    per_second = _summed_series(run.links["links"].values())
    knots_x = np.arange(len(per_second) + 1, dtype=float)
    knots_y = np.concatenate(([0.0], np.cumsum(per_second)))
    emulator_t = np.asarray(times) + run.start_t - run.links["t0_unix"]
    return np.interp(emulator_t, knots_x, knots_y).tolist()


def straight_line_bytes(run: Run, times: list[float]) -> list[float]:
    """Without an emulator there is no time series: spread the roles' WAN total evenly over the wall time."""
    total, wall = run.wan_bytes("all"), run.wall_s
    return [total * min(1.0, t / wall) if wall > 0 else float(total) for t in times]


def _summed_series(links) -> np.ndarray:
    longest = max((len(lk.get("series", [])) for lk in links), default=0)
    total = np.zeros(longest)
    for lk in links:
        s = lk.get("series", [])
        total[:len(s)] += s
    return total


def link_throughput(run: Run) -> list[LinkSeries]:
    """Each link's Mbit/s per second of the emulator, shifted onto the training clock."""
    offset = run.links["t0_unix"] - run.start_t
    out = []
    for _name, lk in sorted(run.links["links"].items()):
        series = lk.get("series", [])
        out.append(LinkSeries(name=f"{lk['src_dc']}->{lk['dst_dc']}",
                              times=[second + offset for second in range(len(series))],
                              mbps=[b * 8 / MBIT for b in series]))
    return out


def check_labels(labels: list[str] | None, n_runs: int) -> None:
    if labels is not None and len(labels) != n_runs:
        raise GeomxError(f"{len(labels)} label(s) given for {n_runs} run(s): --labels needs one label per run "
                         f"directory, comma-separated")


def plot_runs(runs: list[Run], output: Path, *, labels: list[str] | None = None) -> Path:
    """Draw ``runs`` into one PNG at ``output`` and return its path."""
    if not runs:
        raise GeomxError("geomx plot needs at least one run directory")
    check_labels(labels, len(runs))
    series = [series_for(run, label=labels[i] if labels else None) for i, run in enumerate(runs)]
    fig = build_figure(series)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)                   # Agg, no display: never touches pyplot's global state
    fig.savefig(output, dpi=DPI)
    return output


def build_figure(series: list[RunSeries]) -> Figure:
    shared = len(series) >= SHARED_LEGEND_RUNS
    columns = 2
    legend_rows = (len(series) + 1 + columns - 1) // columns if shared else 0    # + the set-up marker
    legend_in = 0.22 * legend_rows + 0.1 if shared else 0.0
    fig = Figure(figsize=(FIGSIZE_IN[0], FIGSIZE_IN[1] + legend_in), dpi=DPI)
    ax_time, ax_bytes, ax_links = fig.subplots(1, 3)
    colors = [f"C{i % 10}" for i in range(len(series))]
    for s, color in zip(series, colors, strict=False):
        ax_time.plot(s.times, s.accs, marker="o", markersize=3, color=color, label=s.label)
        _mark_ready(ax_time, s, color)
        bytes_label = s.label if s.emulated else f"{s.label}\n[{NO_EMULATOR}]"
        ax_bytes.plot(s.wan_mb, s.accs, marker="o", markersize=3, color=color, label=bytes_label,
                      linestyle="-" if s.emulated else "--")
    # the clock starts at the first worker record, so the set-up (join, init, first pull) comes first
    ax_time.plot([], [], color="grey", linestyle=":", label="set-up done (workers ready)")
    metric = " / ".join(dict.fromkeys(s.metric for s in series))
    title = metric[0].upper() + metric[1:]
    _decorate(ax_time, f"{title} vs wall time", "wall time since workers started (s)", metric, legend=not shared)
    _decorate(ax_bytes, f"{title} vs WAN traffic", "cumulative WAN traffic (MB)", metric, legend=not shared)
    _draw_links(ax_links, series, colors, labelled=not shared)
    if shared:
        handles, labels = ax_time.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize="small", frameon=False)
        fig.tight_layout(rect=(0, legend_in / (FIGSIZE_IN[1] + legend_in), 1, 1))
    else:
        fig.tight_layout()
    return fig


def _draw_links(ax: Axes, series: list[RunSeries], colors: list[str], *, labelled: bool = True) -> None:
    """One run: one line per link. Several runs: per run the mean link of each direction, smoothed over
    SMOOTH_S seconds (a dozen raw 1-second lines are unreadable). A run keeps its colour from the other
    panels; up is solid, down dashed. ``labelled=False`` (the runs are named in a shared legend): the legend
    only says which line style is which direction."""
    styles = ["-", "--", "-.", ":"]
    several = sum(1 for s in series if s.links) > 1
    styled: dict[int, str] = {}       # line style index -> the link (or direction) it stands for
    for s, color in zip(series, colors, strict=False):
        if s.links:
            _mark_ready(ax, s, color)
        lines = _direction_means(s.links) if several else s.links
        for i, link in enumerate(lines):
            if not link.times:
                continue
            # steps-post: the value at t is what the link delivered during [t, t + 1); the repeated last
            # value closes the last second's step
            ax.plot(link.times + [link.times[-1] + 1.0], link.mbps + link.mbps[-1:], drawstyle="steps-post",
                    color=color, linestyle=styles[i % len(styles)], alpha=0.85,
                    label=f"{s.short}: {link.name}" if labelled else None)
            styled.setdefault(i, link.name)
    drawn = bool(styled)
    if not labelled:
        for i, name in sorted(styled.items()):
            ax.plot([], [], color="grey", linestyle=styles[i % len(styles)], label=name)
    if not drawn:
        ax.text(0.5, 0.5, "no WAN emulator in these runs:\nno per-link throughput", transform=ax.transAxes,
                ha="center", va="center", color="grey")
    _decorate(ax, "WAN link throughput" + (f" ({SMOOTH_S} s mean)" if several else ""),
              "time since workers started (s)", "throughput (Mbit/s)", legend=drawn)


def _direction_means(links: list[LinkSeries]) -> list[LinkSeries]:
    """The mean of the DC -> central links and of the central -> DC links, each smoothed over SMOOTH_S s."""
    out = []
    for name, pick in (("up (mean link)", lambda n: n.endswith("->central")),
                       ("down (mean link)", lambda n: n.startswith("central->"))):
        chosen = [lk for lk in links if pick(lk.name) and lk.times]
        if not chosen:
            continue
        start = min(lk.times[0] for lk in chosen)
        length = max(len(lk.mbps) for lk in chosen)
        total = np.zeros(length + int(max(lk.times[0] for lk in chosen) - start))
        for lk in chosen:
            first = int(round(lk.times[0] - start))
            total[first:first + len(lk.mbps)] += lk.mbps
        smooth = np.convolve(total / len(chosen), np.ones(SMOOTH_S) / SMOOTH_S, mode="same")
        out.append(LinkSeries(name=name, times=[start + i for i in range(len(smooth))], mbps=smooth.tolist()))
    return out


def _mark_ready(ax: Axes, s: RunSeries, color: str) -> None:
    """Dotted line where training proper starts: everything before it is set-up."""
    ax.axvline(s.ready_s, color=color, linewidth=1.0, linestyle=":")


def _decorate(ax: Axes, title: str, xlabel: str, ylabel: str, *, legend: bool = True) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize="small")
