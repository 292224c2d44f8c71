"""examples/train_lm.py: the corpus split is deterministic and disjoint, and the byte-level GPT learns through a
whole deployment (real processes, emulated WAN)."""
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from geomx.cli.launch import Launcher
from geomx.cli.topology import load_topology
from geomx.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"


@pytest.fixture(scope="module")
def lm():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module          # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("train_lm", None)


def _write_tree(root: Path, packages: int = 6, files: int = 40) -> None:
    """Files of ~3 KB whose every line names its package and file, so any byte range tells where it came from."""
    for p in range(packages):
        for f in range(files):
            path = root / f"pkg{p}" / f"mod{f}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"#P{p}F{f:03d} line {i:03d}\n" for i in range(150)))
    (root / "top.py").write_text("#Ptop\n" * 10)
    (root / "blob.bin").write_bytes(b"\0\1\2" * 100)        # binary: not part of a text corpus


def _origins(data: np.ndarray) -> set[tuple[str, str]]:
    """(package, file) of every line marker in a byte range."""
    import re
    return set(re.findall(rb"#P(\d+)F(\d{3})", data.tobytes()))


def test_corpus_split_is_deterministic_and_disjoint(lm, tmp_path):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    _write_tree(root)
    first = lm.load_corpus(str(root), str(cache))
    again = lm.load_corpus(str(root), str(cache))          # from the cache this time
    assert len(list(cache.glob("*.npz"))) == 1
    assert again.names == first.names == sorted(first.names) and again.digest == first.digest
    assert "blob.bin" not in first.names and len(first.names) == 241
    assert np.array_equal(again.tokens, first.tokens)
    val = first.is_validation()
    # the split is by a hash of the relative path: fixed, about 5% of 241 files, never empty here
    assert 1 <= val.sum() <= 30 and np.array_equal(val, again.is_validation())
    assert lm.is_validation("pkg0/mod000.py") == lm.is_validation("pkg0/mod000.py")
    val_files = {(n.split("/")[0][3:].encode(), n.split("mod")[1][:3].encode())
                 for n, v in zip(first.names, val, strict=True) if v and "/" in n}
    for by_package in (False, True):
        shares = [lm.worker_data(first, worker=w, workers=4, dc=w // 2, dcs=2, rank=w % 2, dc_workers=2,
                                 by_package=by_package, seed=3) for w in range(4)]
        blocks = [{bytes(b) for b in s.reshape(-1, lm.BLOCK)} for s in shares]
        assert all(blocks), by_package
        for i in range(4):
            assert not _origins(shares[i]) & val_files        # no validation byte in any worker's data
            for j in range(i + 1, 4):
                assert not blocks[i] & blocks[j], (by_package, i, j)      # no block dealt twice
        again_share = lm.worker_data(again, worker=1, workers=4, dc=0, dcs=2, rank=1, dc_workers=2,
                                     by_package=by_package, seed=3)
        assert np.array_equal(again_share, shares[1])
        if by_package:       # whole packages per DC: no package in both DCs
            dc_packages = [{p for p, _ in _origins(np.concatenate(shares[2 * d:2 * d + 2]))} for d in range(2)]
            assert dc_packages[0] and dc_packages[1] and not dc_packages[0] & dc_packages[1]
    # a changed file is a new corpus (new cache entry, new digest)
    (root / "pkg0" / "mod000.py").write_text("changed\n")
    assert lm.load_corpus(str(root), str(cache)).digest != first.digest


def test_a_single_file_data_dir_validates_on_the_corpus_tail_the_same_on_every_process(lm, tmp_path):
    """input.txt alone: its path hash picks training, so the file split held 0 validation bytes and every worker
    failed after the deployment set up; now the corpus's last bytes are held out, and training never sees them."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "input.txt").write_text("".join(f"line {i:06d} of the only file\n" for i in range(8000)))
    assert not lm.is_validation("input.txt")
    corpus = lm.load_corpus(str(root), str(tmp_path / "cache"))
    need = 64 * 129
    split = corpus.hold_out_tail(need)
    assert "the corpus's last bytes" in split and "held 0" in split
    total = len(corpus.tokens)
    assert corpus.tail == max(need, math.ceil(total * lm.VALIDATION_PER_MILLE / 1000))
    assert np.array_equal(corpus.validation(), corpus.tokens[total - corpus.tail:])
    assert np.array_equal(corpus.stream(np.arange(len(corpus.names))), corpus.tokens[:total - corpus.tail])
    assert lm.validation_windows(corpus, 64, 128).shape == (64, 129)
    for by_package in (False, True):
        share = lm.worker_data(corpus, worker=0, workers=2, dc=0, dcs=1, rank=0, dc_workers=2,
                               by_package=by_package, seed=3)
        assert len(share) and not set(share.reshape(-1, lm.BLOCK).tobytes().split(b"\n")[1:-1]) & \
            set(corpus.validation().tobytes().split(b"\n")[1:-1])
    # another process (another worker) loads the same corpus and holds out the same bytes
    other = lm.load_corpus(str(root), str(tmp_path / "cache"))
    assert other.hold_out_tail(need) == split and other.tail == corpus.tail


def test_a_corpus_whose_files_hold_enough_validation_keeps_the_file_split(lm, tmp_path):
    root = tmp_path / "corpus"
    _write_tree(root)
    corpus = lm.load_corpus(str(root), str(tmp_path / "cache"))
    assert "path hash" in corpus.hold_out_tail(64 * 129) and corpus.tail == 0
    assert np.array_equal(corpus.validation(), corpus.stream(np.flatnonzero(corpus.is_validation())))


def test_a_corpus_too_small_to_hold_out_validation_is_refused_naming_its_size(lm, tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "input.txt").write_text("x" * 10_000)
    corpus = lm.load_corpus(str(root), str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match="the corpus holds 10,000 bytes, too few to hold out 8,256"):
        corpus.hold_out_tail(64 * 129)


def test_model_sizes_and_schedule(lm):
    counts = {name: sum(p.numel() for p in lm.ByteGPT(size).parameters()) for name, size in lm.SIZES.items()}
    assert counts == {"tiny": 1_040_768, "small": 6_449_664, "base": 25_482_240}      # as the docstring says
    warm = [lm.lr_schedule(s, warmup=10, total=100) for s in range(100)]
    assert warm[0] == pytest.approx(0.1) and warm[9] == pytest.approx(1.0)
    assert warm[10] == pytest.approx(1.0) and all(a >= b for a, b in zip(warm[10:], warm[11:], strict=False))
    assert lm.lr_schedule(100, warmup=10, total=100) == pytest.approx(0.1)


def test_adamw_is_fused_where_torch_has_the_kernel_and_the_per_tensor_loop_elsewhere(lm, monkeypatch):
    """Both forms step alike: the fused kernel only saves time (on one core 1.6 ms of the tiny model's step
    against 4.5 ms)."""
    import torch

    torch.manual_seed(0)
    model = lm.ByteGPT(lm.SIZES["tiny"])
    fused = lm.adamw(model, lr=0.01, weight_decay=0.1)
    if torch.__version__ >= (2, 4):                 # a TorchVersion: torch has a fused CPU AdamW from 2.4
        assert fused.defaults["fused"] is True
    assert [g["weight_decay"] for g in fused.param_groups] == [0.1, 0.0]

    real = torch.optim.AdamW

    def without_fused(params, **kwargs):
        if kwargs.get("fused"):     # as torch does: the groups get the defaults filled in, then it refuses
            for group in params:
                group.setdefault("fused", True)
            raise RuntimeError("fused=True requires all the params to be on supported devices")
        return real(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", without_fused)
    twin = lm.ByteGPT(lm.SIZES["tiny"])
    twin.load_state_dict(model.state_dict())
    looped = lm.adamw(twin, lr=0.01, weight_decay=0.1)
    assert not looped.defaults["fused"] and not any(g["fused"] for g in looped.param_groups)
    batch = torch.randint(0, 256, (2, 33))
    for m, opt in ((model, fused), (twin, looped)):
        opt.zero_grad()
        lm.next_byte_loss(m, batch).backward()
        opt.step()
    # one step apart by float32 rounding only (6e-8 measured; a step moves weights by up to lr = 0.01)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_a_negative_schedule_length_is_refused_with_the_flag_named(lm):
    with pytest.raises(SystemExit, match="--schedule-steps must be >= 0"):
        lm.main(["--schedule-steps", "-1"])


def test_the_language_model_learns_under_geomx_launch(tmp_path):
    """2 DCs x 1 worker over the default (regional) emulated WAN, dense FSA, 16 steps of 8 windows of 32 bytes.
    The validation loss starts at ln 256 = 5.55 nats per byte; measured at the end (step 16) over seeds 0, 1,
    2: 3.425, 3.341, 3.382 (3.67, 3.52, 3.60 at step 8). The bar, 4.0, leaves a margin of more than 0.5 nats."""
    out = io.StringIO()
    topo = load_topology(dcs=2, workers_per_dc=1)
    command = [sys.executable, str(EXAMPLE), "--steps", "16", "--eval-every", "8", "--context", "32",
               "--batch-size", "8", "--eval-windows", "16"]
    code = Launcher(topo, command, run_dir=tmp_path, out=out).run(timeout=120)
    assert code == 0, out.getvalue()[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result-*.json"))]
    assert len(results) == 2
    finals = [r["final_val_loss"] for r in results]
    assert finals[0] == pytest.approx(finals[1], abs=1e-6)       # FSA: every worker holds the same model
    assert finals[0] < 4.0, finals
    first = results[0]["history"][0]
    assert first["step"] == 8 and first["val_bpb"] == pytest.approx(first["val_loss"] / math.log(2))
    assert "sha256" in out.getvalue()          # the corpus hash, printed so two runs can be compared


def test_device_is_the_cpu_by_default_auto_picks_a_gpu_only_where_torch_sees_one_and_bad_ones_name_the_flag():
    """Every example takes --device (geomx.torch.loop.device); the master worker only initializes: the CPU."""
    import argparse
    from types import SimpleNamespace

    import torch

    from geomx.torch import loop

    worker, master = SimpleNamespace(is_master_worker=False), SimpleNamespace(is_master_worker=True)
    p = argparse.ArgumentParser()
    loop.add_arguments(p, steps=1, steps_help="")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert loop.device(p.parse_args([]), worker) == torch.device("cpu")       # the default: unchanged runs
    auto = loop.device(p.parse_args(["--device", "auto"]), worker)
    assert auto == (torch.device("cuda:0") if gpus else torch.device("cpu"))
    assert loop.device(p.parse_args(["--device", "cuda"]), master) == torch.device("cpu")
    assert loop.device(p.parse_args(["--device", "cpu"]), worker) == torch.device("cpu")
    for text, words in [(f"cuda:{gpus}", f"torch sees {gpus} GPU(s)"), ("warp-drive", "is not a device"),
                        ("meta", "run on cpu or cuda")]:
        with pytest.raises(ConfigError) as exc:
            loop.device(p.parse_args(["--device", text]), worker)
        assert f"--device {text}" in str(exc.value) or f"--device {text!r}" in str(exc.value)
        assert words in str(exc.value), str(exc.value)
