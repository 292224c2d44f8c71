"""Train GeoMX's example CNN across DCs with geomx.

    geomx launch -- python examples/train_cnn.py              # 2 DCs x 2 workers, digits data
    geomx launch --wan transpacific --mode dist_async -- python examples/train_cnn.py --epochs 5
    geomx launch -- python examples/train_cnn.py --data mnist --data-dir ~/data/mnist

The model is GeoMX's: conv 16@5x5, pool, conv 32@5x5, pool, fc 256, fc 128, fc 10 (padding keeps small
inputs such as the 8x8 digits usable). ``--model wide`` is a >= 5M-parameter MLP for WAN benchmarks, ``--model
deep`` a plain 8-layer CNN whose layers are alike in size (P3's case). Every
worker trains on its own slice of the training set (iid, or ``--split-by-class`` for non-iid as in GeoMX) and
reports test accuracy. The master worker initializes the model and leaves.
"""
from __future__ import annotations

import argparse
import gzip
import inspect
import itertools
import os
import struct
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import geomx.optim
from geomx.statefile import write_atomically
from geomx.torch import DistributedOptimizer, loop


class CNN(nn.Module):
    def __init__(self, side: int, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        flat = 32 * (side // 4) ** 2
        self.fc1, self.fc2, self.fc3 = nn.Linear(flat, 256), nn.Linear(256, 128), nn.Linear(128, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class WideMLP(nn.Module):
    """About 6.7M parameters on 8x8 inputs: the WAN, not the CPU, dominates a step."""

    def __init__(self, side: int, classes: int = 10, width: int = 2560) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(side * side, width), nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


def convolutions(width: int, depth: int) -> tuple[nn.Conv2d, nn.ModuleList]:
    """``depth`` 3x3 convolutions of ``width`` channels that keep the resolution: the first, and the rest."""
    return (nn.Conv2d(1, width, 3, padding=1),
            nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(depth - 1)))


def he_initialize(stem: nn.Conv2d, body: nn.ModuleList) -> None:
    """Plain ReLU stacks at PyTorch's default initialization shrink the signal (see DeepCNN). Called once the
    whole model is built, so that the other layers draw the same random numbers as before it existed."""
    for conv in (stem, *body):
        nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
        nn.init.zeros_(conv.bias)


def run_convolutions(stem: nn.Conv2d, body: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    x = F.relu(stem(x))
    for conv in body:
        x = F.relu(conv(x))
    return x


class DeepCNN(nn.Module):
    """A plain deep CNN (no pooling between layers, so every layer costs the same compute and bytes): ``depth``
    3x3 convolutions of ``width`` channels, then a 4x4 average pooling and one linear layer. About 0.6M
    parameters in 8 layers of 83k: many layers of similar size, where a wire that lands the first layers first
    (P3) has something to overlap with the next forward pass.

    Without normalization, eight ReLU layers at PyTorch's default initialization shrink the signal until the
    network predicts one class for hundreds of steps, hence He initialization; and the 4x4 pooling keeps where a
    stroke lies, which a global average throws away. It learns at a smaller rate than the default (``lr``)."""

    lr = 0.001

    def __init__(self, side: int, classes: int = 10, width: int = 96, depth: int = 8) -> None:
        super().__init__()
        self.stem, self.body = convolutions(width, depth)
        self.head = nn.Linear(width * 16, classes)
        he_initialize(self.stem, self.body)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(run_convolutions(self.stem, self.body, x), 4).flatten(1))


class VGGLike(nn.Module):
    """VGG's shape on 8x8 digits: the convolutions carry the compute, the fully connected layers at the end the
    bytes. Six 3x3 convolutions of ``width`` channels at full resolution (about 90% of the multiply-adds, 14% of
    the bytes at the default width), then two hidden layers of ``hidden`` units (the first 81% of the bytes).
    It is P3's case: the first layers' few bytes land at once after backward and their forward pass, most of
    the step's, runs while the last layers' bytes still travel; FSA waits for them all first."""

    lr = 0.001

    def __init__(self, side: int, classes: int = 10, width: int = 64, depth: int = 6, hidden: int = 256) -> None:
        super().__init__()
        self.stem, self.body = convolutions(width, depth)
        self.fc1, self.fc2 = nn.Linear(width * side * side, hidden), nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        he_initialize(self.stem, self.body)

    def forward(self, x):
        x = F.relu(self.fc1(run_convolutions(self.stem, self.body, x).flatten(1)))
        return self.head(F.relu(self.fc2(x)))


MODELS = {"cnn": CNN, "wide": WideMLP, "deep": DeepCNN, "vgg": VGGLike}


def load_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits (1,797 8x8 images, shipped with the package): 80/20 split.

    The split is cached on disk, keyed by scikit-learn's version: importing scikit-learn costs each worker about
    2 s of CPU, which on a small host running a whole deployment is longer than the training itself."""
    from importlib.metadata import version

    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = cache_root / "geomx" / f"digits-split-sklearn-{version('scikit-learn')}.npz"
    names = ("x_train", "x_test", "y_train", "y_test")
    try:
        with np.load(cache) as saved:
            return tuple(saved[n] for n in names)  # type: ignore[return-value]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        pass                                        # absent or unreadable: split again and rewrite it
    split = _split_digits()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        # atomic: workers starting together never read half a file
        write_atomically(cache, lambda f: np.savez(f, **dict(zip(names, split, strict=True))))
    except OSError:
        pass                                        # a read-only home only costs the next run the import
    return split


def _split_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    return tuple(train_test_split(x, d.target.astype(np.int64), test_size=0.2, stratify=d.target,
                                  random_state=0))  # type: ignore[return-value]


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_idx(data_dir: str):
    """MNIST or Fashion-MNIST IDX files (optionally gzipped) from ``data_dir``."""
    root = Path(data_dir).expanduser()

    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
            if (root / name).exists():
                return root / name
        raise SystemExit(f"train_cnn: {root} has no {stem}[.gz] (MNIST/Fashion-MNIST IDX files)")

    def images(stem):
        return (_read_idx(find(stem)).astype(np.float32) / 255.0)[:, None]

    def labels(stem):
        return _read_idx(find(stem)).astype(np.int64)

    return (images("train-images-idx3-ubyte"), images("t10k-images-idx3-ubyte"),
            labels("train-labels-idx1-ubyte"), labels("t10k-labels-idx1-ubyte"))


def worker_slice(y: np.ndarray, index: int, workers: int, by_class: bool, seed: int) -> np.ndarray:
    """GeoMX's SplitSampler: worker i gets the contiguous range [i*floor(N/W), (i+1)*floor(N/W)) of a
    shuffled (iid) or label-sorted (non-iid) order. Every slice has the same size, so every worker runs the
    same number of steps (a synchronous round needs every worker)."""
    order = np.argsort(y, kind="stable") if by_class else np.random.default_rng(seed).permutation(len(y))
    size = len(y) // workers
    return order[index * size:(index + 1) * size]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def adam(params: list, lr: float) -> torch.optim.Optimizer:
    """Adam with the fused kernel where this torch has it on CPU (2.4+): on the wide model's 6.7M parameters a
    step takes 5 ms instead of 45 ms, which matters once the WAN no longer dominates (HFA, DiLoCo)."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", choices=["digits", "mnist", "fashion-mnist"], default="digits")
    p.add_argument("--data-dir", help="directory with the IDX files for --data mnist/fashion-mnist")
    p.add_argument("--model", choices=list(MODELS), default="cnn")
    p.add_argument("--width", type=int,
                   help="--model deep: channels of every layer (default 96: 0.6M parameters; 384: 10M); --model "
                        "vgg: channels of its convolutions (default 64: 1.3M parameters); --model wide: units of the "
                        "hidden layers (default 2560)")
    p.add_argument("--epochs", type=int, default=20)
    loop.add_arguments(p, steps=0, steps_help="stop after this many steps (0: run every epoch)")
    p.add_argument("--batch-size", type=loop.count(1), default=32)
    p.add_argument("--optimizer", choices=["adam", "sgd", "dcasgd"], default="adam",
                   help="dcasgd: geomx.optim.DCASGD, for --update-on server in dist_async (MixedSync)")
    p.add_argument("--lr", type=loop.positive, help="learning rate (default 0.003; --model deep: 0.001)")
    p.add_argument("--momentum", type=float, default=0.9, help="for --optimizer sgd and dcasgd")
    p.add_argument("--split-by-class", action="store_true", help="non-iid slices (sorted by label)")
    args = p.parse_args(argv)
    shape = {} if args.width is None else {"width": args.width}
    if shape and "width" not in inspect.signature(MODELS[args.model]).parameters:
        raise SystemExit(f"train_cnn: --width applies to --model wide, deep and vgg, not {args.model}")

    kv = loop.start(args)
    if args.data == "digits":
        x_train, x_test, y_train, y_test = load_digits()
    else:
        if not args.data_dir:
            raise SystemExit("train_cnn: --data mnist/fashion-mnist needs --data-dir")
        x_train, x_test, y_train, y_test = load_idx(args.data_dir)
    side = x_train.shape[-1]
    device = loop.device(args, kv)
    model = MODELS[args.model](side, **shape).to(device)
    lr = args.lr if args.lr is not None else getattr(model, "lr", 0.003)
    if args.optimizer == "adam":
        inner = adam(list(model.parameters()), lr)
    elif args.optimizer == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    else:
        inner = geomx.optim.DCASGD(model.parameters(), lr=lr, momentum=args.momentum)
    index = loop.worker_index(args, kv.num_all_workers)
    idx = worker_slice(y_train, index, kv.num_all_workers, args.split_by_class, args.seed)
    # the synchronization algorithm comes from geomx launch --sync (GEOMX_SYNC); HFA weighs models by samples
    opt = DistributedOptimizer(inner, model, kvstore=kv, update_on_server=args.update_on == "server",
                               num_samples=len(idx))
    if kv.is_master_worker:
        print(f"master worker: initialized {sum(p.numel() for p in model.parameters()):,} parameters "
              f"({args.model}); training runs on {kv.num_all_workers} workers", flush=True)
        loop.leave(kv)
        return 0

    xs, ys = torch.from_numpy(x_train[idx]).to(device), torch.from_numpy(y_train[idx]).to(device)
    xt, yt = torch.from_numpy(x_test).to(device), torch.from_numpy(y_test).to(device)
    steps_per_epoch = len(idx) // args.batch_size
    if steps_per_epoch == 0:    # no batch would ever be drawn: the worker would spin forever
        raise geomx.ConfigError(f"--batch-size {args.batch_size} is larger than worker {index}'s slice of "
                                f"{len(idx)} samples: use --batch-size {len(idx)} or less, or fewer workers")
    rng = np.random.default_rng(args.seed + 1000 + index)

    def batches():          # until the loop stops (ESync: fast workers run through more epochs)
        for epoch in itertools.count():
            order = torch.from_numpy(rng.permutation(len(idx)))
            for b in range(steps_per_epoch):
                batch = order[b * args.batch_size:(b + 1) * args.batch_size]
                yield epoch, b == steps_per_epoch - 1, lambda batch=batch: F.cross_entropy(model(xs[batch]), ys[batch])

    start = time.perf_counter()
    step, history = loop.run_steps(opt, batches(), total_steps=args.steps or args.epochs * steps_per_epoch,
                                   eval_every=args.eval_every,
                                   evaluate=lambda: {"test_acc": evaluate(model, xt, yt)},
                                   describe=lambda f: f"test accuracy {f['test_acc']:.4f}",
                                   checkpoint=loop.checkpointer(args, kv, opt, model))
    final = history[-1]["test_acc"]
    print(f"final test accuracy {final:.4f} after {step} steps in {time.perf_counter() - start:.1f} s "
          f"(communication wait {opt.comm_wait_s:.1f} s)", flush=True)
    loop.write_result(kv, opt, step, history, final_test_acc=final)
    loop.leave(kv)
    return 0


if __name__ == "__main__":
    sys.exit(geomx.run_main(main))      # a geomx error is one line, not a traceback
