"""Steps to a target accuracy, dense against Bi-Sparse, for several SGD recipes and seeds, in one process.

Picking a training recipe for a sparsifier by launching deployments costs minutes per point; this replays the
synchronous HiPS arithmetic of examples/train_cnn.py in one process instead: the same data slices, batches,
model and initial weights per seed, 2 DCs x 2 workers; each DC's sum goes up through geomx's own codec and
error feedback (as its mean, the way a local server pushes it), the global mean comes back through the
downlink codec with the global server's residual, and every worker applies the same momentum SGD step.
Tensors below the size bound stay dense, as in a deployment. It does not partition tensors into parts (a
deployment selects top-k per 4 MiB part) and draws other threshold samples, so a curve can differ in the
last digits from a real run's. Step counts are what it compares; time per step is `geomx bench wan`'s job.

    python examples/recipe_grid.py --lr 0.2 0.4 --momentum 0.9 0.7 --seeds 0 1 2 3 4 5
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cnn import WideMLP, load_digits, worker_slice

from geomx.compression import CodecState, ErrorFeedback
from geomx.compression.registry import make_codec

WORKERS_PER_DC, DCS = 2, 2


class SparseHiPS:
    """The synchronous round of HiPS with one codec on the WAN, both directions, for every large tensor."""

    def __init__(self, spec: dict, size_lower_bound: int) -> None:
        self.codec, self.bound = make_codec(spec), size_lower_bound
        self.up = [ErrorFeedback(codec=self.codec) for _ in range(DCS)]
        self.down = ErrorFeedback(codec=self.codec.downlink())
        self.states = [CodecState(seed=i) for i in range(DCS + 1)]

    def mean(self, key: int, dc_sums: list[np.ndarray]) -> np.ndarray:
        if dc_sums[0].size < self.bound:
            return sum(dc_sums) / (DCS * WORKERS_PER_DC)
        # a local server pushes its DC's mean, the global server multiplies it back (compressed.dense_push)
        total = sum(self.codec.decompress(self.up[d].compress(key, s / WORKERS_PER_DC, self.states[d]))
                    * WORKERS_PER_DC for d, s in enumerate(dc_sums))
        mean = total / (DCS * WORKERS_PER_DC)
        return self.down.codec.decompress(self.down.compress(key, mean, self.states[DCS]))


def dense_mean(key: int, dc_sums: list[np.ndarray]) -> np.ndarray:
    return sum(dc_sums) / (DCS * WORKERS_PER_DC)


def frozen_large(size_lower_bound: int):
    """Dense for small tensors, no update at all for large ones: what a sparsifier must beat to be worth it."""
    def mean(key: int, dc_sums: list[np.ndarray]) -> np.ndarray:
        return dense_mean(key, dc_sums) if dc_sums[0].size < size_lower_bound else np.zeros_like(dc_sums[0])
    return mean


def steps_to_target(*, seed: int, lr: float, momentum: float, aggregate, steps: int, target: float,
                    batch_size: int = 32, eval_every: int = 2) -> int | None:
    """The first evaluated step at which test accuracy reaches ``target`` (None: not within ``steps``)."""
    torch.manual_seed(seed)          # the master worker's initial weights, as in train_cnn.py
    x_train, x_test, y_train, y_test = load_digits()
    model = WideMLP(x_train.shape[-1])
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    workers = DCS * WORKERS_PER_DC
    slices = [worker_slice(y_train, i, workers, False, seed) for i in range(workers)]
    rngs = [np.random.default_rng(seed + 1000 + i) for i in range(workers)]
    per_epoch = len(slices[0]) // batch_size
    orders: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * workers
    xt, yt = torch.from_numpy(x_test), torch.from_numpy(y_test)
    for step in range(1, steps + 1):
        b = (step - 1) % per_epoch
        grads = []
        for w in range(workers):
            if b == 0:
                orders[w] = rngs[w].permutation(len(slices[w]))
            batch = slices[w][orders[w][b * batch_size:(b + 1) * batch_size]]
            model.zero_grad()
            F.cross_entropy(model(torch.from_numpy(x_train[batch])), torch.from_numpy(y_train[batch])).backward()
            grads.append([p.grad.numpy().copy() for p in params])
        for key, p in enumerate(params):
            dc_sums = [sum(grads[d * WORKERS_PER_DC + r][key] for r in range(WORKERS_PER_DC)) for d in range(DCS)]
            p.grad = torch.from_numpy(np.ascontiguousarray(aggregate(key, dc_sums), dtype=np.float32)
                                      .reshape(p.shape))
        opt.step()
        if step % eval_every == 0:
            with torch.no_grad():
                if (model(xt).argmax(1) == yt).float().mean().item() >= target:
                    return step
    return None


def wan_codec(p: argparse.ArgumentParser, text: str) -> dict:
    """--compression: one codec's JSON dict. This replays the WAN hop alone, so a per-tier form ({"lan": ...,
    "wan": ...}) or GeoMX's string forms are refused by name, not met with a KeyError."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        p.error(f"--compression {text!r} is not JSON ({exc.msg})")
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        p.error(f"--compression {text!r}: give one codec's dict with its type, e.g. "
                f"'{{\"type\": \"bsc\", \"threshold\": 0.01}}' (this replays the WAN hop only: no per-tier form)")
    try:
        SparseHiPS(spec, 0)         # the registry names an unknown type or option, ErrorFeedback a codec it refuses
    except Exception as exc:
        p.error(f"--compression {text!r}: {exc}")
    return spec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lr", type=float, nargs="+", default=[0.2, 0.4])
    p.add_argument("--momentum", type=float, nargs="+", default=[0.9, 0.7])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--target-acc", type=float, default=0.9)
    p.add_argument("--compression", default='{"type": "bsc", "threshold": 0.01}',
                   help="the WAN codec, as a JSON dict (geomx.compression)")
    p.add_argument("--size-lower-bound", type=int, default=200_000, help="smaller tensors stay dense")
    p.add_argument("--frozen", action="store_true",
                   help="also a row that never updates the tensors at or above the bound")
    args = p.parse_args(argv)
    spec = wan_codec(p, args.compression)
    torch.set_num_threads(1)
    print(f"steps to {args.target_acc} (evaluated every 2 steps; '-' = not within {args.steps}); "
          f"mean counts '-' as {args.steps + 2}")
    for lr, momentum in itertools.product(args.lr, args.momentum):
        for name in ("dense", spec["type"]) + (("frozen",) if args.frozen else ()):
            hits = []
            for seed in args.seeds:
                aggregate = {"dense": dense_mean, "frozen": frozen_large(args.size_lower_bound)}.get(name) \
                    or SparseHiPS(spec, args.size_lower_bound).mean
                hits.append(steps_to_target(seed=seed, lr=lr, momentum=momentum, aggregate=aggregate,
                                            steps=args.steps, target=args.target_acc))
            mean = statistics.mean(h if h is not None else args.steps + 2 for h in hits)
            shown = " ".join(str(h) if h is not None else "-" for h in hits)
            print(f"lr {lr:<5} momentum {momentum:<4} {name:6s} mean {mean:5.1f}   seeds: {shown}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
