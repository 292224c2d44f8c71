"""GeoMX variables geomx does not implement are reported once per process at start-up, and documented."""
from __future__ import annotations

import logging
from pathlib import Path

from harness import check_ok, launch, load_json

RAW_DGA_SCRIPT = """
import numpy as np
import geomx, kvhelp as h

kv = geomx.kvstore.create()
kv.init("w", np.zeros(3, np.float32))
if not kv.is_master_worker:
    try:
        kv.pushpull("w", np.ones(3, np.float32)).wait()
        h.dump("refusal", None)
    except geomx.GeomxError as exc:
        h.dump("refusal", str(exc))
"""


def test_a_geomx_script_hears_about_every_variable_geomx_would_otherwise_ignore(tmp_path):
    """One real deployment (1 DC, 1 worker) run as a GeoMX script would be, with DGT's variable, and an algorithm
    that runs only inside DistributedOptimizer: a raw push under it is refused, not silently run as FSA."""
    run_dir = check_ok(launch(tmp_path, RAW_DGA_SCRIPT, dcs=1, workers_per_dc=1,
                              env={"GEOMX_SYNC": "dga", "ENABLE_DGT": "2"}))
    refusal = load_json(run_dir, "refusal")
    assert refusal is not None and "GEOMX_SYNC='dga'" in refusal and "DistributedOptimizer" in refusal
    # every process saw ENABLE_DGT and said so once: schedulers, servers, the worker and the master worker
    said = "ENABLE_DGT=2 is a GeoMX variable geomx does not implement"
    counts = {p.name: p.read_text(errors="replace").count(said) for p in run_dir.glob("*.log")}
    assert len(counts) >= 6 and set(counts.values()) == {1}, counts


def test_unimplemented_geomx_variables_are_reported_once_per_process(monkeypatch, caplog):
    from geomx import unimplemented
    from geomx.config import config_from_env

    monkeypatch.setattr(unimplemented, "_reported", set())
    env = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_WORKER": "2",
           "DMLC_NUM_SERVER": "1", "DMLC_PS_GLOBAL_ROOT_URI": "127.0.0.1", "DMLC_PS_GLOBAL_ROOT_PORT": "9001",
           "DMLC_NUM_GLOBAL_SERVER": "1", "DMLC_NUM_GLOBAL_WORKER": "2", "GEOMX_DC": "a",
           "ENABLE_DGT": "2", "DMLC_K": "0.8", "ENABLE_P3": "0", "ENABLE_INTER_TS": "1",
           "MXNET_KVSTORE_BIGARRAY_BOUND": "1000", "MXNET_KVSTORE_SIZE_LOWER_BOUND": "1000"}
    with caplog.at_level(logging.WARNING, logger="geomx.env"):
        config_from_env(env)
        config_from_env(env)                   # a second read in the same process says nothing new
    warned = [r.getMessage() for r in caplog.records if r.name == "geomx.env"]
    named = sorted(m.split("=")[0] for m in warned)
    # ENABLE_P3 is implemented (geomx.sync.p3): nothing to report
    assert named == ["DMLC_K", "ENABLE_DGT", "ENABLE_INTER_TS", "MXNET_KVSTORE_BIGARRAY_BOUND",
                     "MXNET_KVSTORE_SIZE_LOWER_BOUND"], warned
    dgt = next(m for m in warned if m.startswith("ENABLE_DGT=2"))
    assert "server" in dgt and "one reliable ZeroMQ connection" in dgt
    assert "GEOMX_PARTITION_BYTES" in next(m for m in warned if m.startswith("MXNET_KVSTORE_BIGARRAY_BOUND"))
    # the master worker reads the size bound itself: nothing to report there
    monkeypatch.setattr(unimplemented, "_reported", set())
    assert unimplemented.report_unimplemented({"MXNET_KVSTORE_SIZE_LOWER_BOUND": "1000"}, "master") == []


def test_every_unimplemented_variable_is_documented():
    from geomx.unimplemented import UNIMPLEMENTED

    doc = (Path(__file__).resolve().parent.parent / "docs" / "environment.md").read_text()
    section = doc[doc.index("## GeoMX variables geomx does not implement"):]
    missing = [u.variable for u in UNIMPLEMENTED if f"`{u.variable}`" not in section]
    assert not missing, missing
