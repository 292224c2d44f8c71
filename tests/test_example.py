"""The example CNN trains to real accuracy through a whole deployment (real processes, emulated WAN)."""
import io
import json
import sys
from pathlib import Path

import pytest

from geomx.cli.launch import Launcher
from geomx.cli.topology import load_topology

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_cnn.py"


def run_example(run_dir: Path, args: list[str], **topology) -> list[dict]:
    out = io.StringIO()
    topo = load_topology(**topology)
    code = Launcher(topo, [sys.executable, str(EXAMPLE), *args], run_dir=run_dir, out=out).run(timeout=240)
    assert code == 0, out.getvalue()[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("result-*.json"))]
    assert len(results) == topo.num_all_workers
    return results


def test_example_reaches_95_percent_on_digits_in_the_default_topology_over_an_emulated_wan(tmp_path):
    results = run_example(tmp_path, [])   # defaults: 2 DCs x 2 workers, regional WAN, dist_sync, Adam
    finals = [r["final_test_acc"] for r in results]
    assert min(finals) >= 0.95, finals
    # FSA keeps every worker's model identical, so their test accuracies match exactly
    assert len(set(finals)) == 1, finals
    assert (tmp_path / "wan_links.json").exists()


def test_dist_async_mixedsync_converges_on_the_example(tmp_path):
    results = run_example(tmp_path, ["--epochs", "15"], mode="dist_async", wan="lan")
    finals = [r["final_test_acc"] for r in results]
    assert min(finals) >= 0.93, finals


@pytest.mark.parametrize("topology", ["flat"])
def test_server_side_optimizer_trains_the_example_in_the_flat_topology(tmp_path, topology):
    results = run_example(tmp_path, ["--epochs", "15", "--update-on", "server"], topology=topology, wan="lan")
    finals = [r["final_test_acc"] for r in results]
    assert min(finals) >= 0.93, finals


def _write_idx(path: Path, array, gz: bool) -> None:
    import gzip
    import struct

    import numpy as np

    data = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data += np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    (gzip.open if gz else open)(path.with_name(path.name + (".gz" if gz else "")), "wb").write(data)


def test_example_reads_mnist_idx_files_plain_or_gzipped(tmp_path):
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("train_cnn", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = np.random.default_rng(0)
    train_x, test_x = rng.integers(0, 256, (12, 28, 28)), rng.integers(0, 256, (5, 28, 28))
    train_y, test_y = rng.integers(0, 10, 12), rng.integers(0, 10, 5)
    _write_idx(tmp_path / "train-images-idx3-ubyte", train_x, gz=True)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", test_x, gz=False)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", train_y, gz=True)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", test_y, gz=False)
    x_train, x_test, y_train, y_test = mod.load_idx(str(tmp_path))
    assert x_train.shape == (12, 1, 28, 28) and x_test.shape == (5, 1, 28, 28)
    np.testing.assert_allclose(x_train[:, 0] * 255.0, train_x, atol=1e-3)
    np.testing.assert_array_equal(y_test, test_y)
    # the CNN adapts to 28x28 inputs
    import torch

    assert mod.CNN(28)(torch.from_numpy(x_test)).shape == (5, 10)
