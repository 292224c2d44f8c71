"""GeoMX's ``examples/cnn.py`` and ``examples/cnn_hfa.py`` (``--hfa``), ported line for line to torch and geomx's
raw KVStore (GeoMX/MXNet semantics), at GeoMX's own hyperparameters: LeNet-5 with Xavier initialization,
learning rate 0.01, batch 32.

* cnn.py: the optimizer on the global servers (Adam for FSA and MixedSync, DCASGD with ``--dcasgd``), every
  worker pushing each gradient divided by its batch size and pulling the weights after every batch;
* cnn_hfa.py (``MXNET_KVSTORE_USE_HFA=1``, K1 and K2 from ``MXNET_KVSTORE_HFA_K1/K2``): a local Adam on each
  worker, every K1 batches each worker pushes its weights divided by the
  DC's workers and pulls the result (the local servers' HFA logic makes it a DC average, every K2-th time the
  average over the DCs). GeoMX's script never advances its local step counter, so it synchronizes only when
  K1 = 1; the port counts the steps. GeoMX's cnn_hfa.py builds LeNet with sigmoid activations, which on the
  digits stay at chance for the first 240 batches (measured on one worker, Adam lr 0.01); the port uses
  cnn.py's ReLU.

What differs: the data are scikit-learn's digits upsampled to LeNet's 28 x 28 (GeoMX reads MNIST from
/root/data, which cannot be downloaded here), each worker trains on its slice for ``--iterations`` batches rather
than for epochs, and evaluates once at the end. Run under ``geomx launch``; writes ``geomx-cnn-<index>.json``
(test accuracy) into the run directory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_cnn import load_digits  # noqa: E402

import geomx  # noqa: E402
from geomx.optim import DCASGD  # noqa: E402


def lenet() -> nn.Sequential:
    net = nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2, 2),
                        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Flatten(),
                        nn.Linear(16 * 4 * 4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)       # mx.init.Xavier(): uniform, magnitude 3, "avg"
            nn.init.zeros_(m.bias)
    return net


def images(x: np.ndarray) -> torch.Tensor:
    """8 x 8 digits (0..16) as 1 x 28 x 28 images in [0, 1] (GeoMX's load_data resizes to the net's input)."""
    t = torch.from_numpy(x.reshape(-1, 1, 8, 8).astype(np.float32) / 16.0)
    return nn.functional.interpolate(t, size=(28, 28), mode="bilinear", align_corners=False)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-lr", "--learning-rate", type=float, default=0.01)
    parser.add_argument("-bs", "--batch-size", type=int, default=32)
    parser.add_argument("-ms", "--mixed-sync", action="store_true")
    parser.add_argument("-dc", "--dcasgd", action="store_true")
    parser.add_argument("--hfa", action="store_true", help="GeoMX's cnn_hfa.py")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reduction", default=None, help="ask the kvstore for 'mean' (geomx's old semantics)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    net = lenet()
    loss = nn.CrossEntropyLoss(reduction="none")    # per sample, as gluon's SoftmaxCrossEntropyLoss
    if args.hfa:
        k1 = int(os.environ["MXNET_KVSTORE_HFA_K1"])
        assert os.environ.get("MXNET_KVSTORE_USE_HFA") == "1" and k1 >= 1, "MXNET_KVSTORE_USE_HFA / _K1 not set"
        trainer = torch.optim.Adam(net.parameters(), lr=args.learning_rate)     # local, never shared

    if args.mixed_sync or args.dcasgd:
        kv = geomx.kvstore.create("dist_async", reduction=args.reduction)
    else:
        kv = geomx.kvstore.create("dist_sync", reduction=args.reduction)
    if kv.is_master_worker and not args.hfa:
        kv.set_optimizer(DCASGD(net.parameters(), lr=args.learning_rate) if args.dcasgd
                         else torch.optim.Adam(net.parameters(), lr=args.learning_rate))
    num_all_workers = kv.num_all_workers

    params = list(net.parameters())
    for idx, param in enumerate(params):
        kv.init(idx, param.data)
        if kv.is_master_worker:
            continue
        kv.pull(idx, out=param.data, priority=-idx)
    kv.waitall()
    if kv.is_master_worker:
        kv.close()
        return 0

    index = int(os.environ["GEOMX_WORKER_INDEX"])
    x_train, x_test, y_train, y_test = load_digits()
    mine = np.arange(index, len(y_train), num_all_workers)         # GeoMX's data slice per worker
    x, y = images(x_train[mine]), torch.from_numpy(y_train[mine]).long()
    rng = np.random.default_rng([args.seed, index])
    begin = time.time()
    for local_iters in range(1, args.iterations + 1):
        batch = rng.choice(len(y), size=args.batch_size, replace=False)
        net.zero_grad()
        loss(net(x[batch]), y[batch]).sum().backward()               # l.backward() on a vector: the sum
        if args.hfa:
            for param in params:
                param.grad /= args.batch_size                        # trainer.step(num_samples)
            trainer.step()
            if local_iters % k1 == 0:
                for idx, param in enumerate(params):
                    kv.push(idx, param.data / kv.num_workers, priority=-idx)
                    kv.pull(idx, out=param.data, priority=-idx)
        else:
            for idx, param in enumerate(params):
                kv.push(idx, param.grad / args.batch_size, priority=-idx)
                kv.pull(idx, out=param.data, priority=-idx)
        kv.waitall()
    with torch.no_grad():
        accuracy = (net(images(x_test)).argmax(1).numpy() == y_test).mean()
    out = Path(os.environ["GEOMX_RUN_DIR"]) / f"geomx-cnn-{index}.json"
    out.write_text(json.dumps({"test_acc": float(accuracy), "iterations": args.iterations,
                               "seconds": time.time() - begin, "reduction": kv.reduction,
                               "round_policy": kv._client.info.get("round_policy")}))
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
