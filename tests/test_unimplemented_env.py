"""GeoMX variables geomx does not implement, and GEOMX_*/DMLC_* names geomx does not know (misspellings), are
reported once per process at start-up, never ignored in silence; the known ones are documented."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

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


REPO = Path(__file__).resolve().parent.parent
NAME = r"(?:GEOMX|DMLC)_[A-Z0-9_]*[A-Z0-9]"


def test_every_geomx_or_dmlc_variable_the_code_examples_and_test_scripts_use_is_known():
    """The known names are one list (geomx.env_names): a variable read anywhere but missing there would be
    reported as a misspelling, so each quoted name in the package, the examples and the test scripts is in it."""
    from geomx.env_names import KNOWN

    used: dict[str, str] = {}
    for path in [*(REPO / "geomx").rglob("*.py"), *(REPO / "examples").rglob("*.py"),
                 *(REPO / "tests" / "scripts").rglob("*")]:
        if path.suffix not in (".py", ".sh") or not path.is_file():
            continue
        pattern = rf"[\"']({NAME})[\"']" if path.suffix == ".py" else rf"\b({NAME})\b"
        for name in re.findall(pattern, path.read_text(errors="replace")):
            used.setdefault(name, str(path.relative_to(REPO)))
    assert len(used) > 80, "the scan found too few names to be reading the code"
    unknown = {name: where for name, where in used.items() if name not in KNOWN}
    assert not unknown, f"add these to geomx/env_names.py (and docs/environment.md): {unknown}"


def test_the_documented_variables_are_exactly_those_of_docs_environment_md():
    from geomx.env_names import DOCUMENTED, PREFIXES
    from geomx.unimplemented import UNIMPLEMENTED

    doc = (REPO / "docs" / "environment.md").read_text()
    in_doc = set(re.findall(rf"\b{NAME}\b(?!_\*)", doc))
    unimplemented = {u.variable for u in UNIMPLEMENTED if u.variable.startswith(PREFIXES)}
    assert in_doc - unimplemented == set(DOCUMENTED), (sorted(in_doc - unimplemented - DOCUMENTED),
                                                       sorted(DOCUMENTED - in_doc))


@pytest.mark.parametrize("name, close", [("GEOMX_CONECT_TIMEOUT", "GEOMX_CONNECT_TIMEOUT"),
                                         ("GEOMX_WAN_STREAM", "GEOMX_WAN_STREAMS"),
                                         ("DMLC_NUM_WORKERS", "DMLC_NUM_WORKER"), ("GEOMX_XYZZY", None)])
def test_a_misspelled_variable_is_warned_about_once_at_start_naming_the_closest_known_one(monkeypatch, caplog, name,
                                                                                          close):
    """It had been ignored in silence: the role ran on the default of the variable meant."""
    from geomx import env_names
    from geomx.config import config_from_env

    monkeypatch.setattr(env_names, "_reported", set())
    env = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
           "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "GEOMX_DC": "a", "GEOMX_LAUNCHER_PID": "1", name: "5"}
    with caplog.at_level(logging.WARNING, logger="geomx.env"):
        config_from_env(env)
        config_from_env(env)                   # a second read in the same process says nothing new
    warned = [r.getMessage() for r in caplog.records if r.name == "geomx.env"]
    assert len(warned) == 1 and warned[0].startswith(f"{name} is not a variable geomx knows"), warned
    assert (f"did you mean {close}?" in warned[0]) if close else "did you mean" not in warned[0], warned
