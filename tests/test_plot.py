"""geomx plot: the numbers it draws (from fake run directories written with MetricsWriter), the PNG, the CLI."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import geomx.metrics
from geomx.cli.main import main
from geomx.errors import GeomxError
from geomx.metrics import MetricsWriter
from geomx.report.plot import (DPI, FIGSIZE_IN, NO_EMULATOR, SHARED_LEGEND_RUNS, build_figure, plot_runs,
                               series_for)
from geomx.report.run import load_run

T0 = 1_000.0          # Unix time of the first worker record = training start
REPO = Path(__file__).resolve().parent.parent


class Clock:
    """Stands in for the ``time`` module inside geomx.metrics, so records carry chosen times."""

    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now


def write_worker(run_dir: Path, clock: Clock, *, dc: str, steps: dict[int, tuple[float, float | None]],
                 sent: dict[str, int] | None = None) -> None:
    """One worker's metrics file: ``steps`` maps step -> (time since T0, test_acc or None)."""
    clock.now = T0
    writer = MetricsWriter(run_dir, "worker", dc)
    for step, (t, acc) in sorted(steps.items()):
        clock.now = T0 + t
        numbers = {"loss": 1.0 / step} if acc is None else {"loss": 1.0 / step, "test_acc": acc}
        writer.write("step", step=step, elapsed_s=t, comm_wait_s=0.0, **numbers)
    if sent is not None:
        writer.write("traffic", sent=sent, sent_messages={k: 1 for k in sent}, received=0, send_queue=0)
    writer.close()


def write_manifest(run_dir: Path, *, topology: str = "hips", mode: str = "dist_sync",
                   profile: str = "transpacific") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.json").write_text(json.dumps({
        "topology": topology, "mode": mode, "dcs": ["a", "b"], "workers_per_dc": [1, 1], "global_servers": 1,
        "wan": {"profile": profile, "uplink_bps": 1e8, "downlink_bps": 1e8, "rtt_s": 0.18, "jitter_s": 0.0}}))


def write_links(run_dir: Path, *, t0_unix: float, series: dict[tuple[str, str], list[int]]) -> None:
    links = {f"{s}->{d}": {"src_dc": s, "dst_dc": d, "rate_bps": 1e8, "bytes": sum(v), "series": v}
             for (s, d), v in series.items()}
    (run_dir / "wan_links.json").write_text(json.dumps({"profile": "transpacific", "t0_unix": t0_unix,
                                                        "links": links}))


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(geomx.metrics, "time", c)
    return c


@pytest.fixture
def emulated_run(tmp_path, clock) -> Path:
    """Two workers (DCs a, b) evaluated at steps 2 and 4; an emulator that started 1 s before training."""
    run = tmp_path / "emulated"
    write_manifest(run)
    write_worker(run, clock, dc="a", steps={1: (1.0, None), 2: (2.0, 0.5), 3: (3.0, None), 4: (4.0, 0.7)})
    write_worker(run, clock, dc="b", steps={1: (1.5, None), 2: (3.0, 0.6), 3: (3.5, None), 4: (5.0, 0.9)})
    write_links(run, t0_unix=T0 - 1.0, series={("a", "central"): [100, 200, 300, 400, 500, 600, 700],
                                                ("central", "a"): [0, 1_000, 1_000, 1_000, 0, 0, 0]})
    return run


@pytest.fixture
def plain_run(tmp_path, clock) -> Path:
    """No emulator: the roles' WAN totals only (8 MB over a 4 s run)."""
    run = tmp_path / "plain"
    write_manifest(run, topology="flat", mode="dist_async", profile="lan")
    write_worker(run, clock, dc="a", steps={1: (1.0, 0.2), 2: (2.0, None), 3: (3.0, None), 4: (4.0, 0.4)},
                 sent={"central": 6_000_000, "a": 99})
    write_worker(run, clock, dc="b", steps={1: (1.0, 0.2), 4: (4.0, 0.4)}, sent={"central": 2_000_000})
    return run


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])      # IHDR: width, height


def test_accuracy_is_the_mean_over_workers_at_their_mean_time(emulated_run):
    s = series_for(load_run(emulated_run))
    assert s.steps == [2, 4]
    assert s.times == pytest.approx([2.5, 4.5])
    assert s.accs == pytest.approx([0.55, 0.8])
    assert s.label == "emulated (hips, dist_sync, transpacific)"
    assert series_for(load_run(emulated_run), label="mine").label == "mine"


def test_wan_bytes_interpolate_the_summed_emulator_series(emulated_run):
    # emulator clock = training time + 1 s; summed bytes per second: 100, 1200, 1300, 1400, 500, 600, 700
    s = series_for(load_run(emulated_run))
    assert s.emulated
    at_3_5 = 100 + 1200 + 1300 + 0.5 * 1400                 # t = 2.5 s
    at_5_5 = 100 + 1200 + 1300 + 1400 + 500 + 0.5 * 600     # t = 4.5 s
    assert s.wan_mb == pytest.approx([at_3_5 / 1e6, at_5_5 / 1e6])


def test_link_throughput_is_on_the_training_clock(emulated_run):
    links = {lk.name: lk for lk in series_for(load_run(emulated_run)).links}
    assert sorted(links) == ["a->central", "central->a"]
    assert links["a->central"].times == pytest.approx([-1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert links["central->a"].mbps == pytest.approx([0.0, 0.008, 0.008, 0.008, 0.0, 0.0, 0.0])


def test_without_emulator_bytes_are_a_straight_line_and_the_legend_says_so(plain_run):
    s = series_for(load_run(plain_run))
    assert not s.emulated and s.links == []
    assert s.wan_mb == pytest.approx([2.0, 8.0])            # 8 MB across DCs (a -> a is LAN), t = 1 s and 4 s of 4
    fig = build_figure([s])
    acc_vs_bytes, links = fig.axes[1], fig.axes[2]
    assert NO_EMULATOR in acc_vs_bytes.get_legend().get_texts()[0].get_text()
    assert links.get_legend() is None and "no WAN emulator" in links.texts[0].get_text()


def test_plot_two_runs_writes_a_png_of_the_figure_size(emulated_run, plain_run, tmp_path):
    out = plot_runs([load_run(emulated_run), load_run(plain_run)], tmp_path / "out" / "fig.png")
    assert out == tmp_path / "out" / "fig.png" and out.stat().st_size > 10_000
    assert png_size(out) == (round(FIGSIZE_IN[0] * DPI), round(FIGSIZE_IN[1] * DPI))


def test_figure_overlays_runs_with_their_labels(emulated_run, plain_run):
    runs = [series_for(load_run(emulated_run), label="A"), series_for(load_run(plain_run), label="B")]
    acc_vs_time, _, links = build_figure(runs).axes
    assert [t.get_text() for t in acc_vs_time.get_legend().get_texts()][:2] == ["A", "B"]
    assert [t.get_text() for t in links.get_legend().get_texts()] == ["A: a->central", "A: central->a"]
    assert acc_vs_time.get_xlabel().endswith("(s)") and links.get_ylabel() == "throughput (Mbit/s)"


def test_a_benchmark_matrix_gets_one_legend_below_the_panels_and_a_line_style_key_on_the_links(emulated_run):
    # per-panel legends of 4+ long row labels covered the curves: the runs are named once, below
    runs = [series_for(load_run(emulated_run), label=f"row {i}") for i in range(SHARED_LEGEND_RUNS)]
    fig = build_figure(runs)
    acc_vs_time, acc_vs_bytes, links = fig.axes
    assert acc_vs_time.get_legend() is None and acc_vs_bytes.get_legend() is None
    [shared] = fig.legends
    assert [t.get_text() for t in shared.get_texts()][:SHARED_LEGEND_RUNS] == [r.label for r in runs]
    assert [t.get_text() for t in links.get_legend().get_texts()] == ["up (mean link)", "down (mean link)"]
    assert fig.get_figheight() > FIGSIZE_IN[1]


def test_run_without_evaluations_names_the_directory(tmp_path, clock):
    run = tmp_path / "noeval"
    write_manifest(run)
    write_worker(run, clock, dc="a", steps={1: (1.0, None), 2: (2.0, None)})
    with pytest.raises(GeomxError, match=f"{run}.*no evaluation .no step record with test_acc or val_loss"):
        plot_runs([load_run(run)], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_labels_must_match_the_runs(emulated_run, plain_run, tmp_path, capsys):
    with pytest.raises(GeomxError, match=r"1 label\(s\) given for 2 run\(s\)"):
        plot_runs([load_run(emulated_run), load_run(plain_run)], tmp_path / "x.png", labels=["one"])
    rc = main(["plot", str(emulated_run), str(plain_run), "-o", str(tmp_path / "x.png"), "--labels", "a,b,c"])
    assert rc == 2
    assert "3 label(s) given for 2 run(s)" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_end_to_end(emulated_run, plain_run, tmp_path):
    out = tmp_path / "cli.png"
    proc = subprocess.run([sys.executable, "-m", "geomx.cli.main", "plot", str(emulated_run), str(plain_run),
                           "-o", str(out), "--labels", "hier, flat"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert png_size(out) == (round(FIGSIZE_IN[0] * DPI), round(FIGSIZE_IN[1] * DPI))
