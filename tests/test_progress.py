"""The launcher's live progress reads what the workers log, while they write it."""
import json

from geomx.cli.progress import RunWatcher, status_line
from geomx.metrics import METRICS_DIR


def test_watcher_reports_steps_loss_and_accuracy_per_dc_and_link_throughput(tmp_path):
    (tmp_path / METRICS_DIR).mkdir()
    files = []
    for dc in ("a", "b"):
        for rank in range(2):
            path = tmp_path / METRICS_DIR / f"worker-{dc}-{rank}.jsonl"
            lines = [{"t": 0, "kind": "start", "role": "worker", "dc": dc, "pid": rank}]
            lines += [{"t": s, "kind": "step", "step": s, "loss": 1.0 / s} for s in range(1, 4 + rank)]
            lines.append({"t": 9, "kind": "step", "step": 4 + rank, "loss": 0.1, "test_acc": 0.5 + rank / 10})
            path.write_text("".join(json.dumps(x) + "\n" for x in lines))
            files.append(path)
    (tmp_path / "wan_links.json").write_text(json.dumps(
        {"links": {"a->central": {"series": [1_000_000, 12_500_000, 7]}}}))
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    dcs = watcher.by_dc()
    assert sorted(dcs) == ["a", "b"]
    assert sorted(dcs["a"]["steps"]) == [4, 5] and dcs["a"]["loss"] == 0.1
    assert watcher.link_rates() == {"a->central": 100.0}          # the last complete second: 12.5 MB = 100 Mbit
    line = status_line(watcher)
    assert "DC a: step 4-5" in line and "WAN a->central 100 Mbit/s" in line

    # a half-written line is left for the next poll, then read exactly once
    with open(files[0], "a") as f:
        f.write('{"t": 10, "kind": "step", "step": 6, "lo')
    watcher.poll()
    assert sorted(watcher.by_dc()["a"]["steps"]) == [4, 5]
    with open(files[0], "a") as f:
        f.write('ss": 0.05}\n')
    watcher.poll()
    assert sorted(watcher.by_dc()["a"]["steps"]) == [5, 6] and watcher.by_dc()["a"]["loss"] in (0.05, 0.1)



def test_a_worker_that_stopped_stepping_long_before_its_dcs_others_no_longer_counts_in_the_dcs_steps(tmp_path):
    (tmp_path / METRICS_DIR).mkdir()
    # worker pid 1 was killed at step 40; pid 3 took its place and steps with pid 2
    for pid, records in ((1, [(10.0, 40)]), (2, [(10.0, 40), (60.0, 90)]), (3, [(58.0, 88)])):
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": "a", "pid": pid}]
        lines += [{"t": t, "kind": "step", "step": step, "loss": 1.0} for t, step in records]
        (tmp_path / METRICS_DIR / f"worker-a-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    assert sorted(watcher.by_dc()["a"]["steps"]) == [88, 90]
    assert "DC a: step 88-90" in status_line(watcher)


def test_a_dc_that_stopped_stepping_long_before_the_others_is_shown_as_stopped_not_as_training(tmp_path):
    """A dropped DC's last step stayed in the live status line, as if it still trained, until the run ended."""
    (tmp_path / METRICS_DIR).mkdir()
    for dc, records in (("a", [(5.0, 6)]), ("b", [(5.0, 6), (60.0, 80)])):
        lines = [{"t": 0, "kind": "start", "role": "worker", "dc": dc, "pid": 1}]
        lines += [{"t": t, "kind": "step", "step": step, "loss": 2.3} for t, step in records]
        (tmp_path / METRICS_DIR / f"worker-{dc}-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    line = status_line(watcher)
    assert "DC a: stopped at step 6" in line and "DC b: step 80 loss 2.300" in line, line
