"""The example CNN trains to real accuracy through a whole deployment (real processes, emulated WAN)."""
import io
import json
import sys
from pathlib import Path

import pytest

from geomx.cli.launch import Launcher
from geomx.errors import ConfigError
from geomx.cli.topology import load_topology

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_cnn.py"


def example_module():
    """examples/train_cnn.py imported as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cnn", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_example(run_dir: Path, args: list[str], **topology) -> list[dict]:
    out = io.StringIO()
    topo = load_topology(**topology)
    code = Launcher(topo, [sys.executable, str(EXAMPLE), *args], run_dir=run_dir, out=out).run(timeout=240)
    assert code == 0, out.getvalue()[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("result-*.json"))]
    assert len(results) == topo.num_all_workers
    return results


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("default-run")
    return run_dir, run_example(run_dir, [])   # defaults: 2 DCs x 2 workers, regional WAN, dist_sync, Adam


# Accuracy bars below come from measured spread: the example's final test accuracy (360 images: one image is 0.28
# points) over seeds 0-2 (0-4 where noted), with the pinned dependencies (constraints.txt); each bar sits a stated
# margin below the worst run seen, so that a change of seed or library version, which moves results about as much,
# does not cross it, while a real defect (a DC's gradients lost, a wrong average) costs far more than the margin.


def test_example_reaches_93_percent_on_digits_in_the_default_topology_over_an_emulated_wan(default_run):
    """Seeds 0-2: 0.972, 0.953, 0.981 (a lone DC's quarter of the data reaches about 0.90): bar 0.93, 2.3 points
    below the worst."""
    run_dir, results = default_run
    finals = [r["final_test_acc"] for r in results]
    assert min(finals) >= 0.93, finals
    # FSA keeps every worker's model identical, so their test accuracies match exactly
    assert len(set(finals)) == 1, finals
    assert (run_dir / "wan_links.json").exists()


def test_report_of_the_run_agrees_with_what_the_workers_and_the_emulator_measured(default_run, capsys):
    from geomx.cli.main import main
    from geomx.report.run import load_run
    from geomx.report.summary import summarize

    run_dir, results = default_run
    run = load_run(run_dir)
    s = summarize(run, 0.9)
    assert s["steps"] == results[0]["steps"] and s["workers"] == 4
    assert s["final_acc"] == pytest.approx(results[0]["final_test_acc"], abs=1e-6)
    assert s["best_acc"] >= s["final_acc"] and s["time_to_target_s"] is not None
    assert 0 < s["time_to_target_s"] <= s["train_s"] and s["steps_to_target"] <= s["steps"]
    roles, links = s["bytes_roles_vs_links"]
    assert roles == links, "the roles' byte counters and the emulated links disagree"
    # dense HiPS: each DC sends one model copy up and receives one down per step (plus headers)
    assert 0.9 < s["compression_ratio"] < 1.05, s["compression_ratio"]
    assert 0 < s["compute_utilization"] < 1 and s["efficiency"] > 0
    assert s["lower_bound_s"] == pytest.approx(s["compute_s"] + s["wire_s"] + s["round_trips_s"])
    # servers report their queue depths
    assert run.server_queues and all("held_requests" in q for q in run.server_queues)
    assert main(["report", str(run_dir), "--target-acc", "0.9"]) == 0
    text = capsys.readouterr().out
    assert "time to test accuracy 0.900" in text and "efficiency" in text and f"{roles:,} / {links:,}" in text


def test_report_of_a_directory_that_is_no_run_names_it(tmp_path, capsys):
    from geomx.cli.main import main

    assert main(["report", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


# overlap only: "wait" differs in when a local server answers, which test_kvstore_async and
# test_kvstore_compression check exactly (every gradient delivered once); each example run is ~30 s of the suite
@pytest.mark.parametrize("mixedsync", ["overlap"])
def test_dist_async_mixedsync_trains_the_dc_that_finishes_last_to_dense_accuracy(tmp_path, mixedsync):
    """DC b computes 2x slower, so the order in which the DCs finish is fixed rather than left to the OS
    scheduler of a shared 2-core host (which once favoured one DC enough for it to stop at 0.87). With worker-side
    updates each DC ends on its own model: b, finishing last, has applied every gradient of a; a stopped having
    applied only the part of b's that had arrived. overlap: local servers answer without waiting for the WAN."""
    results = run_example(tmp_path, ["--epochs", "20"], mode="dist_async", mixedsync=mixedsync, wan="lan",
                          slowdown=["b=2"])
    finals = {r["dc"]: r["final_test_acc"] for r in results}
    assert len({(r["dc"], r["final_test_acc"]) for r in results}) == 2, "a DC's workers ended on different models"
    # measured in 17 runs with b=2 or 3 (some beside a busy-loop process): b 0.958-0.978, a 0.900-0.981; and a
    # 0.778 once in the full suite on a busy host (2026-11-28), where a stops with more of b's gradients still on
    # the way. What the test is about is b's bar; a's only says that the DC that stopped first learned too
    assert finals["b"] >= 0.93 and finals["a"] >= 0.6, finals


@pytest.mark.parametrize("topology", ["flat"])
def test_server_side_optimizer_trains_the_example_in_the_flat_topology(tmp_path, topology):
    """Seeds 0-2: 0.958, 0.961, 0.961: bar 0.93, 2.8 points below the worst."""
    results = run_example(tmp_path, ["--epochs", "15", "--update-on", "server"], topology=topology, wan="lan")
    finals = [r["final_test_acc"] for r in results]
    assert min(finals) >= 0.93, finals


# GeoMX's scripts set the size bound to 1000 elements: every weight of the CNN is then compressed (with the
# default 200,000 the digits CNN would travel dense and the test would prove nothing)
COMPRESSIONS = {      # name: (setting, least and most WAN compression against dense fp32, headers included)
    "bsc-1%": ({"type": "bsc", "threshold": 0.01, "size_lower_bound": 1000}, 10, 60),
}
# MPQ (fp16 for small tensors, Bi-Sparse for large ones) measured -0.3/+0.6/+0.3/-0.3/-0.8 points against dense
# over seeds 0-4; not run here to keep the suite under 12 minutes: its routing is checked in test_compression and
# its Bi-Sparse half is the run above
# Momentum SGD, as DGC and GeoMX train with sparse gradients: a sparsifier delivers a coordinate rarely but
# with everything accumulated since, which SGD applies in full and Adam would shrink to one normal-sized step.
# 40 epochs: at 1% a weight of this 80k-parameter CNN is sent about once every 100 steps, so both runs are
# compared once converged rather than 220 steps in.
SGD_ARGS = ["--optimizer", "sgd", "--lr", "0.05", "--epochs", "40"]


@pytest.fixture(scope="module")
def dense_sgd_accuracy(tmp_path_factory):
    results = run_example(tmp_path_factory.mktemp("dense-sgd"), SGD_ARGS, wan="lan")
    return results[0]["final_test_acc"]


@pytest.mark.parametrize("name", list(COMPRESSIONS))
def test_compressed_training_reaches_within_three_points_of_dense_accuracy_at_the_same_seed(name, dense_sgd_accuracy,
                                                                                           tmp_path):
    """Synchronous training is deterministic, so the two runs differ only in the compression. Compressed minus dense
    over seeds 0-4: Bi-Sparse -0.6/+0.6/+0.6/0/+0.3 points, MPQ -0.3/+0.6/+0.3/-0.3/-0.8 (fp16: 0/0/-0.3/-0.6/0,
    not run here to keep the suite short; its sums are checked exactly in test_kvstore_compression); with other
    library versions Bi-Sparse once -1.7 at seed 0. Bar: 3 points below dense, 1.3 below the worst."""
    from geomx.report.run import load_run
    from geomx.report.summary import summarize

    spec, least, most = COMPRESSIONS[name]
    results = run_example(tmp_path, [*SGD_ARGS, "--compression", json.dumps(spec)], wan="lan")
    finals = [r["final_test_acc"] for r in results]
    assert len(set(finals)) == 1, f"compressed FSA must keep the workers identical: {finals}"
    assert finals[0] >= dense_sgd_accuracy - 0.03, (name, finals[0], dense_sgd_accuracy)
    ratio = summarize(load_run(tmp_path), None)["compression_ratio"]
    assert least <= ratio <= most, f"{name}: WAN bytes are 1/{ratio:.1f} of dense fp32"


def _write_idx(path: Path, array, gz: bool) -> None:
    import gzip
    import struct

    import numpy as np

    data = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data += np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    (gzip.open if gz else open)(path.with_name(path.name + (".gz" if gz else "")), "wb").write(data)


def test_example_reads_mnist_idx_files_plain_or_gzipped(tmp_path):
    import numpy as np

    mod = example_module()
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


def test_the_deep_model_has_eight_alike_layers_and_classifies_any_side():
    """``--model deep`` is P3's case: the bytes sit in many layers of one size, not in one big tensor."""
    import torch

    mod = example_module()
    model = mod.MODELS["deep"](8)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 8 and {c.weight.numel() for c in convs[1:]} == {96 * 96 * 9}
    total = sum(p.numel() for p in model.parameters())
    assert 550_000 < total < 700_000 and max(p.numel() for p in model.parameters()) < 0.15 * total
    for side in (8, 28):
        assert model(torch.zeros(3, 1, side, side)).shape == (3, 10)


def test_width_is_refused_for_a_model_that_has_none_with_the_flag_named():
    with pytest.raises(SystemExit, match="--width applies to --model wide, deep and vgg, not cnn"):
        example_module().main(["--model", "cnn", "--width", "8"])


@pytest.mark.parametrize("argv, flag", [(["--steps", "-3"], "--steps"), (["--eval-every", "-1"], "--eval-every"),
                                        (["--batch-size", "0"], "--batch-size"), (["--lr", "-1"], "--lr"),
                                        (["--checkpoint-every", "-2"], "--checkpoint-every")])
def test_a_bad_count_or_rate_is_refused_by_the_parser_naming_the_flag(capsys, argv, flag):
    """--steps -3 had trained one step and exited 0, --eval-every -1 evaluated every step, and --batch-size 0
    or --lr -1 ended in a traceback after the whole deployment set up (found by a review)."""
    with pytest.raises(SystemExit) as refused:
        example_module().main(argv)
    assert refused.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["deep", "vgg"])
def test_the_deep_models_learn_the_digits_in_a_hundred_and_twenty_steps(name):
    """deep: eight plain ReLU layers at PyTorch's default initialization predicted one class (accuracy 0.10) for
    200 steps; with He initialization, at its own learning rate, three seeds reached 0.79-0.89 at step 120 (batch
    8, one process). vgg (its convolutions He-initialized too): 0.74-0.89 on seeds 0-3. The bar is below the
    lowest of them."""
    import torch
    import torch.nn.functional as F

    mod = example_module()
    x_train, x_test, y_train, y_test = (torch.as_tensor(a) for a in mod.load_digits())
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = mod.MODELS[name](8)
    opt = torch.optim.Adam(model.parameters(), lr=model.lr)
    for _ in range(120):
        idx = torch.randint(0, len(x_train), (8,), generator=generator)
        loss = F.cross_entropy(model(x_train[idx].float().reshape(8, 1, 8, 8)), y_train[idx].long())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(x_test.float().reshape(-1, 1, 8, 8)).argmax(1) == y_test).float().mean().item()
    assert accuracy > 0.6, accuracy


def test_the_cached_digits_split_is_scikit_learns_split_and_a_damaged_cache_is_rewritten(tmp_path, monkeypatch):
    """Workers read the split from a cache (importing scikit-learn costs each one ~2 s of CPU): it must be the
    very arrays scikit-learn's split returns, or every accuracy bar above would rest on other data."""
    import numpy as np

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    mod = example_module()
    fresh = mod._split_digits()
    for attempt in ("absent", "cached", "damaged"):
        if attempt == "damaged":
            (cache,) = (tmp_path / "geomx").glob("digits-split-sklearn-*.npz")
            cache.write_bytes(b"not a zip file")
        got = mod.load_digits()
        assert [a.shape for a in got] == [(1437, 1, 8, 8), (360, 1, 8, 8), (1437,), (360,)], attempt
        for a, b in zip(got, fresh, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), attempt
    assert len(list((tmp_path / "geomx").iterdir())) == 1          # no partial file left behind


def test_hfa_reaches_the_accuracy_of_fsa_within_three_points(default_run, tmp_path):
    """Same example, same defaults (2 DCs x 2 workers, regional WAN, Adam): K1 = 5 local steps per DC average,
    K2 = 2 DC averages per global one; 220 steps end on a global average, so every worker holds the same model.
    HFA minus FSA over seeds 0-2: +0.6, +0.8, -0.3 points: bar 3 points below FSA, 2.7 below the worst."""
    _, fsa = default_run
    results = run_example(tmp_path, [], sync="hfa", sync_k1=5, sync_k2=2)
    finals = [r["final_test_acc"] for r in results]
    assert len(set(finals)) == 1, finals
    assert finals[0] >= fsa[0]["final_test_acc"] - 0.03, (finals, fsa[0]["final_test_acc"])
    # one WAN round per 10 steps instead of one per step
    assert all(r["steps"] == fsa[0]["steps"] for r in results)


def test_dcasgd_on_the_global_server_trains_the_example_in_dist_async(tmp_path):
    # SGD-family optimizers leave this CNN on a bumpy plateau (accuracy 0.1-0.6) for the first 10-20 epochs, how
    # long depends on the asynchronous interleaving (0.65 after 25 epochs once in CI); from epoch ~22 every run
    # measured sat at 0.95-0.97, so 40 epochs test where training ends, not how long the plateau lasted
    results = run_example(tmp_path, ["--optimizer", "dcasgd", "--update-on", "server", "--lr", "0.05", "--epochs",
                                     "40"], mode="dist_async", wan="lan")
    finals = [r["final_test_acc"] for r in results]
    assert min(finals) >= 0.93, finals


def test_a_worker_index_outside_the_job_is_refused_naming_where_it_came_from(monkeypatch):
    """A hand-started worker sets GEOMX_WORKER_INDEX itself: one past the job's workers got an empty data slice,
    and the example spun at full CPU, saying nothing (found by a review). It is refused naming the variable."""
    import argparse

    from geomx.torch import loop

    args = argparse.Namespace(data_slice_idx=None)
    monkeypatch.setenv("GEOMX_WORKER_INDEX", "7")
    with pytest.raises(ConfigError, match="GEOMX_WORKER_INDEX=7 is not a worker index of this job: its 2 training "
                                         "workers are 0 to 1"):
        loop.worker_index(args, 2)
    monkeypatch.setenv("GEOMX_WORKER_INDEX", "1")
    assert loop.worker_index(args, 2) == 1
    with pytest.raises(ConfigError, match="--data-slice-idx=-1"):
        loop.worker_index(argparse.Namespace(data_slice_idx=-1), 2)
    monkeypatch.setenv("GEOMX_WORKER_INDEX", "one")
    with pytest.raises(ConfigError, match="GEOMX_WORKER_INDEX='one' is not a worker index"):
        loop.worker_index(args)
