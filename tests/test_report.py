"""geomx report reads a run directory: what it takes from the metrics records."""
import contextlib
import json
import math

import pytest

from geomx.metrics import METRICS_DIR
from geomx.report.run import load_run


def test_report_counts_every_key_a_worker_initialized_over_several_init_calls(tmp_path):
    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a"]}))
    (tmp_path / METRICS_DIR).mkdir()
    lines = [{"t": 0, "kind": "start", "role": "worker", "dc": "a", "pid": 1},
             {"t": 1, "kind": "model", "keys": 1, "dense_bytes": 400},       # after kv.init("w", ...)
             {"t": 2, "kind": "model", "keys": 2, "dense_bytes": 440},       # after kv.init("b", ...)
             {"t": 3, "kind": "step", "step": 1, "loss": 1.0, "elapsed_s": 3, "comm_wait_s": 0}]
    (tmp_path / METRICS_DIR / "worker-a-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert load_run(tmp_path).dense_bytes == 440


def test_time_to_accuracy_is_time_aligned_so_an_asynchronous_fast_dc_counts_when_its_models_exist():
    from pathlib import Path

    from geomx.report.run import Run, WorkerSeries
    from geomx.report.summary import time_to_accuracy

    def worker(dc, evals):
        return WorkerSeries(dc=dc, pid=0, evals=evals)

    def run(workers):
        return Run(path=Path("."), name="x", manifest={}, workers=workers, sent={}, sent_messages={},
                   dense_bytes=None, links=None, start_t=0.0, server_queues=[])

    # synchronous: both evaluate step 10 (0.91 and 0.93) at about the same time; reached when the last did
    sync = run([worker("a", [(5, 1.0, 0.80), (10, 2.0, 0.91)]), worker("b", [(5, 1.1, 0.82), (10, 2.1, 0.93)])])
    assert time_to_accuracy(sync, 0.90) == (10, 2.1)
    assert time_to_accuracy(sync, 0.95) is None
    # asynchronous: DC a evaluates step 10 at 1.0 s and step 20 at 2.0 s, DC b (3x slower) step 10 at 3.0 s.
    # At 2.0 s the latest accuracies are a: 0.95 (step 20) and b: 0.86 (step 10 not yet; its step 5 at 1.5 s)
    fast = worker("a", [(10, 1.0, 0.88), (20, 2.0, 0.95)])
    slow = worker("b", [(5, 1.5, 0.86), (10, 3.0, 0.90)])
    assert time_to_accuracy(run([fast, slow]), 0.90) == (5, 2.0)
    # nothing counts before every worker has evaluated once
    assert time_to_accuracy(run([worker("a", [(10, 1.0, 0.99)]), worker("b", [(10, 4.0, 0.5)])]), 0.7) == (10, 4.0)


def test_per_step_wan_bytes_start_at_a_whole_second_so_a_set_up_download_never_leaks_in():
    from pathlib import Path

    from geomx.report.run import Run, WorkerSeries
    from geomx.report.summary import steady_start, training_link_bytes

    # the emulator's clock starts 0.3 s before the run's; the last worker is ready at 1.5 s (emulator 1.8 s),
    # inside the second (1-2 s) that also carried 1 MB of its initial model
    links = {"t0_unix": 100.0, "links": {"a->central": {"src_dc": "a", "dst_dc": "central",
                                                        "series": [0, 1_000_000, 100, 100, 100]}}}
    run = Run(path=Path("."), name="x", manifest={}, sent={}, sent_messages={}, dense_bytes=None, links=links,
              start_t=100.3, server_queues=[],
              workers=[WorkerSeries(dc="a", pid=0, ready_t=1.5, times=[1.6, 1.9, 2.5, 3.5])])
    start = steady_start(run)
    assert abs(start - 1.7) < 1e-9                        # emulator second 2
    assert training_link_bytes(run, start)[("a", "central")] == 300
    assert training_link_bytes(run, 1.5)[("a", "central")] > 200_000   # what prorating from 1.5 s counted


def _one_worker_run(series_up, series_down, ready_t, times, dense_bytes=None):
    from pathlib import Path

    from geomx.report.run import Run, WorkerSeries

    links = {"t0_unix": 100.0, "links": {"a->central": {"src_dc": "a", "dst_dc": "central", "series": series_up,
                                                        "bytes": sum(series_up)},
                                         "central->a": {"src_dc": "central", "dst_dc": "a", "series": series_down,
                                                        "bytes": sum(series_down)}}}
    return Run(path=Path("."), name="x", manifest={"topology": "flat"}, sent={}, sent_messages={},
               dense_bytes=dense_bytes, links=links, start_t=100.0, server_queues=[],
               workers=[WorkerSeries(dc="a", pid=0, ready_t=ready_t, steps=list(range(1, len(times) + 1)),
                                     times=times)])


def test_a_step_that_began_before_the_steady_window_is_not_charged_its_bytes_so_a_dense_run_reads_1x():
    from geomx.report.summary import summarize

    # dense: one 1000-byte copy up and one down per step. Ready at 0.5 s, the window opens at 1.0 s; step 1 ran
    # 0.5-1.05 s and moved its bytes in second 0. Counted as a step of the window (it ended after 1.0 s), the run
    # read 750 bytes per step and 1.33x
    run = _one_worker_run([1000] * 4, [1000] * 4, 0.5, [1.05, 2.0, 3.0, 4.0], dense_bytes=1000)
    s = summarize(run)
    assert s["wan_steady_steps"] == 3
    assert abs(s["wan_bytes_up_per_step"] - 1000) < 20 and abs(s["wan_bytes_down_per_step"] - 1000) < 20
    assert abs(s["compression_ratio"] - 1.0) < 0.02


def test_a_run_with_too_few_steps_after_set_up_says_its_wan_bytes_per_step_are_too_short_to_measure():
    from geomx.report.summary import format_report, summarize

    # ready at 0.2 s, the window opens at 1.0 s: step 1 began at 0.2 s, step 2 at 0.5 s (it ended at 1.3 s, after
    # the cut, with its bytes sent before): no step began in the window. Before, step 2 was divided into the
    # bytes after 1.0 s (142 bytes against a dense step: "2024x")
    run = _one_worker_run([1000, 142], [1000, 0], 0.2, [0.5, 1.3], dense_bytes=1_000_000)
    s = summarize(run)
    assert s["wan_steady_steps"] == 0
    assert math.isnan(s["wan_bytes_per_step"]) and math.isnan(s["compression_ratio"])
    report = format_report(s)
    assert _report_line(report, "up / down / between DCs").startswith("too short to measure")
    assert _report_line(report, "dense fp32 every step / this run").startswith("too short to measure")


def _write_two_worker_run(run_dir):
    """A run of one DC whose two workers reach 0.95 at step 4, having evaluated for 0.5 s and 0.25 s."""
    (run_dir / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a"]}))
    (run_dir / METRICS_DIR).mkdir()
    for pid, spent in ((1, 0.5), (2, 0.25)):
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": "a", "pid": pid},
                 {"t": 1, "kind": "step", "step": 1, "loss": 1.0},
                 {"t": 3, "kind": "step", "step": 2, "loss": 0.5, "test_acc": 0.8, "eval_s": spent},
                 {"t": 4, "kind": "step", "step": 3, "loss": 0.4},
                 {"t": 6, "kind": "step", "step": 4, "loss": 0.3, "test_acc": 0.95, "eval_s": spent}]
        (run_dir / METRICS_DIR / f"worker-a-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_time_to_accuracy_without_evaluations_takes_each_workers_evaluation_time_off_its_clock(tmp_path):
    from geomx.report.run import load_run
    from geomx.report.summary import summarize, time_to_accuracy

    _write_two_worker_run(tmp_path)
    run = load_run(tmp_path)
    assert time_to_accuracy(run, 0.9) == (4, 6.0)
    # the worker that evaluated for 2 x 0.5 s reached step 4 at 5.0 s of training, the other at 5.5 s
    assert time_to_accuracy(run, 0.9, without_evals=True) == (4, 5.5)
    s = summarize(run, 0.9)
    assert s["time_to_target_no_eval_s"] == 5.5 and s["eval_s"] == 0.75


def test_report_into_a_pipe_closed_early_exits_quietly(tmp_path):
    """`geomx report RUN | head` closes the pipe before the report is written: no BrokenPipe traceback."""
    import subprocess
    import sys

    _write_two_worker_run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "geomx.cli.main", "report", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                       # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == "", err


RUN_TWICE_SCRIPT = """
import geomx
import numpy as np
kv = geomx.kvstore.create(reduction="mean")
kv.init("w", np.zeros(4, np.float32))
if kv.is_master_worker:
    raise SystemExit(0)
kv.pushpull("w", np.ones(4, np.float32)).wait()
geomx.metrics.log(step=1, loss=1.0)
kv.close()
"""


def test_a_second_launch_into_the_same_run_directory_reports_only_its_own_processes(tmp_path):
    """Metrics files are named by process id: without clearing, the second run would count 4 + 1 workers."""
    from harness import check_ok, launch

    run_dir = check_ok(launch(tmp_path, RUN_TWICE_SCRIPT, dcs=2, workers_per_dc=2, name="run"))
    assert len(load_run(run_dir).workers) == 4 and (run_dir / "b-worker-1.log").exists()
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "result-b-1.json").write_text("{}")     # a worker's final figures (geomx.torch.loop.write_result)
    assert check_ok(launch(tmp_path, RUN_TWICE_SCRIPT, dcs=2, workers_per_dc=1, name="run")) == run_dir
    assert len(load_run(run_dir).workers) == 2
    assert not (run_dir / "b-worker-1.log").exists(), "a role of the first run left its log behind"
    assert not (run_dir / "result-b-1.json").exists(), "a worker of the first run left its result behind"
    assert (run_dir / "notes.txt").read_text() == "mine", "a file the user wrote was removed"


def test_a_model_averaging_run_is_charged_one_round_trip_per_cross_dc_round_and_efficiency_stays_at_most_1(
        tmp_path):
    """A synthetic HFA run: 200 steps of 50 ms compute per worker, a global average every 50 steps that waits
    250 ms (a 200 ms RTT and the bytes). Charging a round trip per step (the old bound: 10 s + 200 x 0.2 s)
    made the "lower bound" 4.6x the measured 11 s."""
    from geomx.report.summary import format_report, summarize

    wan = {"profile": "transpacific", "uplink_bps": 100e6, "downlink_bps": 100e6, "rtt_s": 0.2}
    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a", "b"],
                                                      "wan": wan}))
    (tmp_path / METRICS_DIR).mkdir()
    for pid, dc in ((1, "a"), (2, "b")):
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": dc, "pid": pid},
                 {"t": 0, "kind": "ready", "elapsed_s": 0.0, "comm_wait_s": 0.0}]
        for k in range(1, 201):
            wait = 0.25 * (k // 50)
            lines.append({"t": 0.05 * k + wait, "kind": "step", "step": k, "loss": 1.0, "elapsed_s": 0.05 * k + wait,
                          "comm_wait_s": wait, "wan_rounds": k // 50, "wan_rounds_waited": k // 50})
        # 4 global averages: one 1 MB model up per DC each time
        lines.append({"t": 11, "kind": "traffic", "sent": {"central": 4_000_000}, "sent_messages": {"central": 4}})
        (tmp_path / METRICS_DIR / f"worker-{dc}-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(load_run(tmp_path))
    assert s["train_s"] == 11.0 and s["compute_s"] == 10.0
    assert (s["wan_rounds"], s["wan_rounds_waited"], s["first_wan_step"]) == (4, 4, 50)
    assert abs(s["round_trips_s"] - 0.8) < 1e-9 and abs(s["wire_s"] - 0.32) < 1e-9
    assert abs(s["lower_bound_s"] - 11.12) < 1e-9           # serial: compute + wire + round trips
    assert abs(s["overlapped_bound_s"] - 10.8) < 1e-9        # max(compute, wire) + round trips
    assert abs(s["efficiency"] - 10.8 / 11.0) < 1e-9 and s["efficiency"] <= 1
    assert "first at" in format_report(s) and "4 (4) / step 50" in format_report(s)


def test_a_target_counts_as_reached_within_float_summation_noise_but_not_one_test_image_short():
    """Flat PS and HiPS FSA train the same model but sum gradients in a different order: measured validation losses
    3.1093297 and 3.1093185 at one step. The first reaches the second's target; a loss 0.01% higher (a falling
    curve moves that in a few steps), or an accuracy one image in 360 lower, does not."""
    from geomx.report.run import EVAL_METRICS

    loss, acc = EVAL_METRICS["val_loss"], EVAL_METRICS["test_acc"]
    assert loss.reached(3.1093297, 3.1093185) and loss.reached(3.0, 3.1093185)
    assert not loss.reached(3.1096, 3.1093185)
    assert acc.reached(0.9, 0.9) and acc.reached(0.95, 0.9)
    assert not acc.reached(0.9 - 1 / 360, 0.9)


def test_compute_utilization_leaves_the_workers_evaluations_out_of_both_compute_and_training_time():
    """10 s of training after set-up: 4 s waiting for the network, 3 s evaluating, 3 s computing. Counted as
    compute, the evaluations made it 6 / 10 = 0.6; left out, the worker computed 3 of its 7 training seconds."""
    from pathlib import Path

    from geomx.report.run import Run, WorkerSeries
    from geomx.report.summary import summarize

    w = WorkerSeries(dc="a", pid=1, steps=[10], times=[11.0], evals=[(5, 6.0, 0.5), (10, 11.0, 0.6)],
                     eval_spent=[1.0, 3.0], elapsed_s=11.0, comm_wait_s=4.5, ready_elapsed_s=1.0,
                     ready_comm_wait_s=0.5)
    assert w.compute_s == 6.0 and w.eval_s == 3.0
    assert abs(w.utilization - 3 / 7) < 1e-12
    run = Run(path=Path("."), name="x", manifest={"topology": "hips", "dcs": ["a"]}, workers=[w], sent={},
              sent_messages={}, dense_bytes=None, links=None, start_t=0.0, server_queues=[])
    assert abs(summarize(run)["compute_utilization"] - 3 / 7) < 1e-12
    # a worker that never evaluated: as before, compute over training time
    assert WorkerSeries(dc="a", pid=2, elapsed_s=10.0, comm_wait_s=2.5).utilization == 0.75


def test_the_report_shows_how_many_overlapped_averages_landed_late_and_the_mean_wait(tmp_path):
    """Two workers of an overlapped HFA run: 4 averages landed each, worker a waited for 3 of them (1.2 s), worker
    b for 1 (0.4 s): 3 of 4 late, 0.8 s waited per worker. A run without overlap records none and shows "-"."""
    from geomx.report.summary import format_report, summarize

    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a", "b"]}))
    (tmp_path / METRICS_DIR).mkdir()
    for pid, dc, late, waited in ((1, "a", 3, 1.2), (2, "b", 1, 0.4)):
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": dc, "pid": pid},
                 {"t": 0, "kind": "ready", "elapsed_s": 0.0, "comm_wait_s": 0.0},
                 {"t": 1, "kind": "step", "step": 1, "elapsed_s": 1.0, "comm_wait_s": 0.0, "wan_rounds": 0,
                  "wan_rounds_waited": 0, "landings": 0, "late_landings": 0, "landing_wait_s": 0.0},
                 {"t": 9, "kind": "step", "step": 20, "elapsed_s": 9.0, "comm_wait_s": waited, "wan_rounds": 5,
                  "wan_rounds_waited": 0, "landings": 4, "late_landings": late, "landing_wait_s": waited}]
        (tmp_path / METRICS_DIR / f"worker-{dc}-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(load_run(tmp_path))
    assert (s["landings"], s["late_landings"]) == (4, 3) and abs(s["landing_wait_s"] - 0.8) < 1e-9
    # worker a waited 0.4 s per late landing, b 0.4 s: 400 ms, in steps of 9 s / 20 = 0.45 s: 0.9 steps
    assert s["wait_per_late_landing_s"] == pytest.approx(0.4)
    assert _report_line(format_report(s), "late at landing") == \
        "3 of 4, 0.8 s waited per worker; 400 ms each, about 0.9 steps"
    for path in (tmp_path / METRICS_DIR).iterdir():
        path.write_text("".join(line.split(', "landings"')[0] + ("}\n" if '"landings"' in line else "\n")
                                for line in path.read_text().splitlines()))
    s = summarize(load_run(tmp_path))
    assert s["landings"] is None and _report_line(format_report(s), "late at landing") == "-"


def test_the_report_breaks_the_network_wait_down_by_the_phases_the_policy_recorded(tmp_path):
    """Two workers of an HFA run: the mean over workers of each phase, those under 0.05 s left out, beside the
    whole wait per worker (after set-up); a run whose policy records no phases shows the whole wait alone."""
    from geomx.report.summary import format_report, summarize

    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a", "b"]}))
    (tmp_path / METRICS_DIR).mkdir()
    for pid, dc, dc_average, global_send in ((1, "a", 3.0, 1.0), (2, "b", 5.0, 2.0)):
        phases = {"dc_average": dc_average, "dc_send": 0.0, "global_send": global_send, "global_landing": 0.01}
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": dc, "pid": pid},
                 {"t": 0, "kind": "ready", "elapsed_s": 0.0, "comm_wait_s": 0.5},
                 {"t": 9, "kind": "step", "step": 20, "elapsed_s": 20.0, "comm_wait_s": 0.5 + dc_average + global_send
                  + 0.01, "wait_phases": phases}]
        (tmp_path / METRICS_DIR / f"worker-{dc}-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(load_run(tmp_path))
    assert s["wait_by_phase"] == pytest.approx({"dc_average": 4.0, "dc_send": 0.0, "global_send": 1.5,
                                                "global_landing": 0.01})
    assert _report_line(format_report(s), "(by phase)") == "5.5 s: dc_average 4.0 s, global_send 1.5 s"
    for path in (tmp_path / METRICS_DIR).iterdir():
        path.write_text(path.read_text().replace(', "wait_phases"', ', "other"'))
    s = summarize(load_run(tmp_path))
    assert s["wait_by_phase"] is None and _report_line(format_report(s), "(by phase)") == "5.5 s"


def _report_line(report: str, label_ends: str) -> str:
    """The value on the report's line whose label ends with ``label_ends``."""
    for line in report.splitlines():
        label, _, value = line.partition("  ")
        if label.endswith(label_ends):
            return value.strip()
    raise AssertionError(f"no line {label_ends!r} in:\n{report}")


def test_report_json_writes_a_figure_that_does_not_exist_as_null_so_strict_parsers_read_it(tmp_path, capsys):
    """A language-model run has no accuracy: its final accuracy is NaN, which Python's json wrote as NaN, not
    JSON (jq and JavaScript refuse it). It is null now, in `geomx report --json` and every `--json FILE`."""
    from geomx import json_text
    from geomx.cli.main import main

    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a"]}))
    (tmp_path / METRICS_DIR).mkdir()
    lines = [{"t": 0, "kind": "start", "role": "worker", "dc": "a", "pid": 1},
             {"t": 3, "kind": "step", "step": 1, "loss": 1.0, "elapsed_s": 3, "comm_wait_s": 0}]
    (tmp_path / METRICS_DIR / "worker-a-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["report", str(tmp_path), "--json"]) == 0

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    summary = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert summary["final_acc"] is None, summary
    assert json_text.finite({"a": [float("inf"), 1.5, (float("nan"),)], "b": "NaN"}) == {"a": [None, 1.5, [None]],
                                                                                         "b": "NaN"}


REGIONAL = {"profile": "regional", "uplink_bps": 1e9, "downlink_bps": 1e9, "rtt_s": 0.02}


def _write_worker_records(run_dir, per_worker: dict[str, list[dict]], wan: dict | None = None):
    """A run directory with one metrics file per worker (named ``<dc>-<pid>``), each beginning with its start."""
    run_dir.mkdir(exist_ok=True)
    (run_dir / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a", "b"],
                                                    "wan": wan or {}}))
    (run_dir / METRICS_DIR).mkdir()
    for pid, (dc, lines) in enumerate(per_worker.items(), start=1):
        head = {"t": 0, "kind": "start", "role": "worker", "dc": dc, "pid": pid}
        (run_dir / METRICS_DIR / f"worker-{dc}-{pid}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in [head, *lines]))


def _resumed_fsa_worker(resumed_record: bool) -> list[dict]:
    """A worker resumed at step 40 of an FSA job (one waited round per step, 40 restored from the checkpoint) that
    trains steps 41..60 at 0.05 s each, 0.03 s of which it waits for the network."""
    lines = [{"t": 0, "kind": "ready", "elapsed_s": 0.0, "comm_wait_s": 0.0}]
    if resumed_record:
        lines.append({"t": 0, "kind": "resumed", "step": 40, "wan_rounds": 40, "wan_rounds_waited": 40})
    for k in range(1, 21):
        lines.append({"t": 0.05 * k, "kind": "step", "step": 40 + k, "loss": 1.0, "elapsed_s": 0.05 * k,
                      "comm_wait_s": 0.03 * k, "wan_rounds": 40 + k, "wan_rounds_waited": 40 + k})
    return lines


@pytest.mark.parametrize("resumed_record", [True, False], ids=["resumed-record", "recorded-before-it"])
def test_a_resumed_run_counts_only_the_steps_and_rounds_it_trained_not_those_its_checkpoint_restored(
        tmp_path, resumed_record):
    """Resumed at step 40 and trained 41..60: 20 steps and 20 rounds, not 60, so its round trips are 20 RTTs and its
    efficiency stays at most 1 (charged 60 round trips it read 1.39 on such a run). Runs recorded before workers
    wrote a ``resumed`` record: the start is the step before the first of their step-by-step records."""
    from geomx.report.summary import format_report, summarize

    _write_worker_records(tmp_path, {dc: _resumed_fsa_worker(resumed_record) for dc in ("a", "b")}, REGIONAL)
    s = summarize(load_run(tmp_path))
    assert (s["steps"], s["resumed_at"]) == (20, 40)
    assert s["step_s"] == pytest.approx(0.05)
    assert (s["wan_rounds"], s["wan_rounds_waited"], s["first_wan_step"]) == (20, 20, 41)
    assert s["round_trips_s"] == pytest.approx(20 * 0.02)
    assert s["efficiency"] <= 1
    assert _report_line(format_report(s), "training wall time").startswith("1.0 s for 20 steps (0.050 s per step; ")
    assert _report_line(format_report(s), "training wall time").endswith("; resumed at step 40)")
    assert _report_line(format_report(s), "first at") == "20 (20) / step 41"


def test_a_fresh_run_that_logs_every_tenth_step_is_not_taken_for_a_resumed_one(tmp_path):
    """Step records 10, 20, 30 with no ``resumed`` record: trained from step 0, 30 steps and 3 rounds."""
    from geomx.report.summary import summarize

    lines = [{"t": k / 10, "kind": "step", "step": k, "elapsed_s": k / 10, "comm_wait_s": 0.0, "wan_rounds": k // 10,
              "wan_rounds_waited": k // 10} for k in (10, 20, 30)]
    _write_worker_records(tmp_path, {"a": lines})
    s = summarize(load_run(tmp_path))
    assert (s["steps"], s["resumed_at"], s["wan_rounds"], s["first_wan_step"]) == (30, None, 3, 10)


def test_the_resumed_record_counts_a_global_average_that_the_first_step_trained_completed(tmp_path, monkeypatch):
    """An HFA worker resumed at step 149 with 2 global averages (K = 50) completes the third at step 150. Its
    ``resumed`` record holds the restored counters, so the run counts 1 round from step 150; prorated from the first
    step record (what runs recorded before it get) the start would be round(3 x 149 / 150) = 3, and 0 rounds."""
    from geomx import metrics
    from geomx.report.summary import summarize

    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a"]}))
    monkeypatch.setattr(metrics, "_writer", metrics.MetricsWriter(tmp_path, "worker", "a"))
    for name, value in (("_wan_rounds", None), ("_landings", {}), ("_wait_phases", {})):
        monkeypatch.setattr(metrics, name, value)
    metrics.set_wan_rounds(2, 2)
    metrics.resumed(149)
    metrics.set_wan_rounds(3, 3)
    for step in range(150, 161):
        metrics.log(step=step, loss=1.0)
    metrics._writer.close()
    s = summarize(load_run(tmp_path))
    assert (s["steps"], s["resumed_at"], s["wan_rounds"], s["first_wan_step"]) == (11, 149, 1, 150)


def test_a_worker_resumed_at_its_last_step_writes_a_resumed_record_and_the_report_says_it_trained_nothing(
        tmp_path, monkeypatch):
    """geomx.torch.loop.run_steps on a worker whose checkpoint is at the job's last step only evaluates: it logs no
    step, so the report read "0 workers ... 0 steps"; its ``resumed`` record now says where it started."""
    from types import SimpleNamespace

    from geomx import metrics
    from geomx.report.summary import format_report, summarize
    from geomx.torch import loop

    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a"]}))
    monkeypatch.setattr(metrics, "_writer", metrics.MetricsWriter(tmp_path, "worker", "a"))
    metrics.ready()
    opt = SimpleNamespace(kv=SimpleNamespace(), progress=60, finish=lambda: None, record_resumed=metrics.resumed)
    checkpoint = SimpleNamespace(restore=lambda: 0, resume_from=tmp_path / "old-checkpoints")
    step, _ = loop.run_steps(opt, [], total_steps=60, eval_every=10, evaluate=lambda: {"test_acc": 0.9},
                             describe=str, checkpoint=checkpoint)
    metrics._writer.close()
    assert step == 60
    s = summarize(load_run(tmp_path))
    assert (s["steps"], s["workers"], s["resumed_at"]) == (0, 1, 60)
    assert _report_line(format_report(s), "training wall time") == (
        "no steps trained: 1 workers resumed at step 60 and recorded no step (a job resumed at its last step "
        "trains none)")


def test_a_loss_target_is_timed_as_a_validation_loss_at_or_below_it_never_as_an_accuracy(tmp_path, capsys):
    """``--target-loss 2.5`` on an accuracy run printed "time to test accuracy 2.500  not reached"; on a run that
    logs val_loss it is reached when the loss gets to 2.5 or below."""
    from geomx.cli.main import main

    (tmp_path / "acc").mkdir()
    _write_two_worker_run(tmp_path / "acc")
    assert main(["report", str(tmp_path / "acc"), "--target-loss", "2.5"]) == 0
    assert _report_line(capsys.readouterr().out, "time to validation loss 2.500") == \
        "- (the run evaluated test accuracy, not validation loss)"
    lines = [{"t": 1, "kind": "step", "step": 1, "loss": 3.0, "val_loss": 3.0},
             {"t": 2, "kind": "step", "step": 2, "loss": 2.4, "val_loss": 2.4}]
    _write_worker_records(tmp_path / "lm", {"a": lines})
    assert main(["report", str(tmp_path / "lm"), "--target-loss", "2.5"]) == 0
    assert _report_line(capsys.readouterr().out, "time to validation loss 2.500").startswith("2.0 s (step 2)")


@pytest.mark.parametrize("argv, complaint", [
    (["--target-acc", "0.9", "--target-loss", "1"], "argument --target-loss: not allowed with argument --target-acc"),
    (["--target-acc", "90"], "argument --target-acc: 90: test accuracy is a fraction in [0, 1] (e.g. 0.9)"),
    (["--target-acc", "-0.1"], "argument --target-acc: -0.1: test accuracy is a fraction in [0, 1]"),
], ids=["both-targets", "a-percentage", "negative"])
def test_report_refuses_a_target_it_would_drop_or_never_reach_naming_the_flag(tmp_path, capsys, argv, complaint):
    from geomx.cli.main import main

    _write_two_worker_run(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert complaint in capsys.readouterr().err


def test_the_dense_baseline_counts_a_dc_dropped_part_way_only_for_the_steps_it_took(tmp_path):
    """A run whose DC a was dropped after 5 of 20 steps: one dense copy up and down per DC and step is 1.25 DCs a
    step, not 2 (counted whole, the report read 2.00x less WAN than dense with no compression at all)."""
    from geomx.report.run import load_run
    from geomx.report.summary import _senders_per_step

    def steps(n: int) -> list[dict]:
        return [{"t": float(k), "kind": "step", "step": k, "loss": 1.0} for k in range(1, n + 1)]

    _write_worker_records(tmp_path / "run", {"a": steps(5), "b": steps(20)})
    run = load_run(tmp_path / "run")
    assert run.steps == 20
    assert _senders_per_step(run, True, run.steps) == 1.25
    assert _senders_per_step(run, False, run.steps) == 1.25     # flat: per worker, the same here


def test_time_to_target_of_a_synchronous_run_names_the_step_whose_evaluations_reached_it(tmp_path):
    """Four workers evaluate steps 20 (0.6472) and 40 (0.83); three had evaluated step 40 when the fourth still
    had only step 20: that mean (0.78) is no step's, and it had been reported as step 20 reaching 0.7. The step
    is 40, at the time its last evaluation came."""
    from geomx.report.run import load_run
    from geomx.report.summary import time_to_accuracy

    _write_worker_records(tmp_path / "run", {dc: [
        {"t": 1.0 + k / 10, "kind": "step", "step": 20, "loss": 1.0, "test_acc": 0.6472},
        {"t": (2.0 if k < 3 else 3.0) + k / 10, "kind": "step", "step": 40, "loss": 0.5, "test_acc": 0.83}]
        for k, dc in enumerate("abcd")})
    run = load_run(tmp_path / "run")
    assert time_to_accuracy(run, 0.7) == (40, pytest.approx(3.3))
    assert time_to_accuracy(run, 0.6) == (20, pytest.approx(1.3))
    assert time_to_accuracy(run, 0.9) is None


def test_a_report_without_target_names_the_runs_own_metric_and_a_run_that_never_trained_says_it_failed(tmp_path):
    """An LM run's row read "time to test accuracy -" with no target given; a run whose workers all failed at
    start read like a job resumed at its last step."""
    from geomx.cli.main import main

    _write_worker_records(tmp_path / "lm", {dc: [
        {"t": 1.0, "kind": "step", "step": 10, "loss": 3.0, "val_loss": 3.1}] for dc in "ab"})
    _write_worker_records(tmp_path / "failed", {"a": [], "b": []})      # started, never set up
    for run, said in (("lm", "time to validation loss -"),
                      ("failed", "no worker finished set-up (the run failed before training")):
        out = tmp_path / f"{run}.txt"
        with open(out, "w") as f, contextlib.redirect_stdout(f):
            assert main(["report", str(tmp_path / run)]) == 0
        assert said in out.read_text(), out.read_text()


def _write_fsa_run(run_dir, *, last_step: int, steps_flag: int, results: int):
    """Two workers of DC a that recorded steps 1..last_step of a ``--steps steps_flag`` job; ``results`` of them
    wrote their result file."""
    (run_dir / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a"],
                                                     "command": ["python", "train_cnn.py", "--steps",
                                                                 str(steps_flag)]}))
    (run_dir / METRICS_DIR).mkdir()
    for pid in (1, 2):
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": "a", "pid": pid},
                 {"t": 0.5, "kind": "ready", "elapsed_s": 0.5, "comm_wait_s": 0.0}]
        lines += [{"t": 1 + k * 0.1, "kind": "step", "step": k, "loss": 1.0, "test_acc": 0.9}
                  for k in range(1, last_step + 1)]
        (run_dir / METRICS_DIR / f"worker-a-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for rank in range(results):
        (run_dir / f"result-a-{rank}.json").write_text("{}")


def test_a_run_stopped_short_of_its_steps_without_result_files_is_reported_incomplete(tmp_path):
    from geomx.report.summary import format_report, summarize

    _write_fsa_run(tmp_path, last_step=126, steps_flag=3000, results=0)     # killed at step 126 of 3000
    s = summarize(load_run(tmp_path))
    assert s["status"] == "incomplete" and "stopped at step 126 of 3000" in s["status_detail"]
    assert _report_line(format_report(s), "outcome").startswith("INCOMPLETE: stopped at step 126 of 3000")


def test_a_run_that_trained_its_steps_and_wrote_every_result_has_no_outcome_line(tmp_path):
    from geomx.report.summary import format_report, summarize

    _write_fsa_run(tmp_path, last_step=20, steps_flag=20, results=2)
    s = summarize(load_run(tmp_path))
    assert (s["status"], s["status_detail"]) == ("complete", None)
    assert "outcome" not in format_report(s)


def test_a_run_with_an_abort_on_record_and_missing_results_is_reported_failed_naming_the_origin(tmp_path):
    from geomx.report.summary import format_report, summarize

    _write_fsa_run(tmp_path, last_step=20, steps_flag=20, results=1)
    (tmp_path / "aborted.jsonl").write_text(json.dumps({"time": 1.0, "tier": "global", "pid": 7,
                                                        "member": "worker a/0", "reason": "ValueError: bad"}) + "\n")
    s = summarize(load_run(tmp_path))
    assert s["status"] == "failed"
    assert _report_line(format_report(s), "outcome").startswith(
        "FAILED: worker a/0 aborted (ValueError: bad); 1 of 2 workers wrote a result file")


def test_a_hung_run_whose_workers_set_up_and_trained_nothing_is_incomplete_and_not_explained_as_resumed(tmp_path):
    from geomx.report.summary import format_report, summarize

    (tmp_path / "launch.json").write_text(json.dumps({"topology": "hips", "mode": "dist_sync", "dcs": ["a"]}))
    (tmp_path / METRICS_DIR).mkdir()
    for pid in (1, 2):
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": "a", "pid": pid},
                 {"t": 0.5, "kind": "ready", "elapsed_s": 0.5, "comm_wait_s": 0.0}]
        (tmp_path / METRICS_DIR / f"worker-a-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(load_run(tmp_path))
    report = format_report(s)
    assert s["status"] == "incomplete"
    assert _report_line(report, "outcome").startswith("INCOMPLETE: 0 of 2 workers wrote a result file")
    assert _report_line(report, "training wall time") == "no steps trained: 2 workers set up and recorded no step"
