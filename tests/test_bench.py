"""Smoke tests of ``geomx bench``: every benchmark runs end to end with tiny parameters and reports
consistent, measured numbers."""
import json
import math

import pytest

from geomx.bench import common
from geomx.cli.main import main
from geomx.errors import ConfigError


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_transport_smoke_appends_report(tmp_path, capsys):
    out, js = tmp_path / "bench.md", tmp_path / "t.json"
    out.write_text("# benchmarks\n")
    assert main(["bench", "transport", "--sizes", "1", "--repeats", "2", "--output", str(out), "--json", str(js)]) == 0
    result = json.loads(js.read_text())
    (row,) = result["rows"]
    assert row["bytes"] == 1024 * 1024
    for key in ("pushpull", "push+pull", "raw"):
        assert _finite_positive(row["mib_per_s"][key])
        assert len(row["samples"][key]) == (4 if key == "raw" else 2)   # raw: before and after the deployment
    assert _finite_positive(row["ratio_pushpull"]) and _finite_positive(row["ratio_push_pull"])
    text = out.read_text()
    assert text.startswith("# benchmarks\n")                             # appended, not overwritten
    assert "`geomx bench transport --sizes 1 --repeats 2" in text
    assert "| 1 MiB |" in text and "* date: " in text and "* machine: " in text
    assert "| 1 MiB |" in capsys.readouterr().out


def test_intra_smoke(tmp_path):
    js = tmp_path / "i.json"
    assert main(["bench", "intra", "--mb", "1", "--workers", "2", "--repeats", "2", "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    assert r["workers"] == 2 and r["bytes"] == 1024 * 1024
    for key in ("geomx_s", "gloo_s", "gloo_before_s", "gloo_after_s", "ratio"):
        assert _finite_positive(r[key]), key
    assert len(r["geomx_iters"]) == 2 and all(len(w) == 2 for w in r["geomx_iters"])
    assert len(r["gloo_iters"]) == 4                                      # 2 ranks x (before, after)


def test_wan_smoke_flat_moves_more_bytes_than_hips(tmp_path):
    js = tmp_path / "w.json"
    assert main(["bench", "wan", "--wan-rate", "1gbit", "--wan-rtt", "2ms", "--steps", "2", "--model", "cnn",
                 "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    hips, flat = r["runs"]["hips"], r["runs"]["flat"]
    for run in (hips, flat):
        assert run["wan_bytes_up"] > 0 and run["wan_bytes_down"] > 0 and run["wan_bytes_other"] == 0
        assert run["bytes_per_step"] == pytest.approx(run["wan_bytes"] / 2)
        assert _finite_positive(run["step_s"])
        assert run["parameters"] and run["model_bytes"] == 4 * run["parameters"]
        # every step moves at least one model copy per DC each way
        assert run["bytes_up_per_step"] >= 2 * run["model_bytes"]
    # 2 workers per DC: flat sends every worker's gradient, HiPS one aggregate per DC
    assert flat["bytes_up_per_step"] > 1.5 * hips["bytes_up_per_step"]
    assert flat["bytes_down_per_step"] > 1.5 * hips["bytes_down_per_step"]
    assert 0.3 < r["ratios"]["bytes_per_step"] < 0.6
    for value in r["ratios"].values():
        assert _finite_positive(value)
    # same seed, same synchronous algorithm: both topologies train the same model
    assert hips["final_loss"] == pytest.approx(flat["final_loss"], abs=1e-3)


def test_wan_rejects_unemulated_profile_and_single_step():
    with pytest.raises(SystemExit):                                       # argparse: lan is not a choice
        main(["bench", "wan", "--profile", "lan"])
    assert main(["bench", "wan", "--steps", "1"]) == 2                    # ConfigError -> exit status 2


def test_helpers():
    assert common.train_script_path().name == "train_cnn.py"
    assert common.parse_sizes("1,4,16") == [1.0, 4.0, 16.0]
    with pytest.raises(ConfigError):
        common.parse_sizes("1,x")
    with pytest.raises(ConfigError):
        common.parse_sizes("0")
    table = common.markdown_table(["a", "b"], [["x", "1"]])
    assert table.splitlines() == ["| a | b |", "|---|---:|", "| x | 1 |"]


def test_every_bench_is_registered():
    for name in ("transport", "intra", "wan", "link"):
        with pytest.raises(SystemExit) as exc:
            main(["bench", name, "--help"])
        assert exc.value.code == 0
