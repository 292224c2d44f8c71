"""geomx report reads a run directory: what it takes from the metrics records."""
import json

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
