"""Large tensors travel as several parts, each its own key on the servers (BytePS's partitioning).

Why: a part is sent, summed, and answered while the next part is still on the wire, so the request and
the reply of one big tensor overlap instead of following each other; the parts of one tensor can live on
different global servers; and no single buffer grows past what glibc serves from its heap (32 MiB, see
``geomx.transport.van.keep_freed_buffers``), so the receiving side reuses warm memory.

A tensor of more than ``partition_bytes`` bytes is cut into parts of at most that many bytes: along its first
dimension when one row fits (a part of a matrix is a block of rows, still a matrix, so that low-rank codecs
such as PowerSGD see matrices), else flattened.
Part ``i`` of ``n`` of key ``k`` is the key ``"k#i/n"``; user keys of that form are refused. Every process of
a deployment must use the same ``partition_bytes`` (``GEOMX_PARTITION_BYTES``; the launcher sets one value
for all). Partitioning is exact for the element-wise server optimizers (SGD, Adam, ...): each element is
updated from its own gradient and state, wherever the cut falls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from geomx.config import MAX_PART_BYTES
from geomx.errors import KVError
from geomx.part_keys import is_part_key, part_key


@dataclass(frozen=True)
class Part:
    key: str          # the part's key on the servers
    start: int        # element range of the flattened tensor
    stop: int
    shape: tuple      # the part's own shape (rows of the tensor, or a flat range)


def check_user_key(key) -> None:
    if is_part_key(key):
        raise KVError(f"key {key!r} ends like a partition key ('#i/n'), which geomx reserves for the parts of "
                      f"large tensors; rename it")


PART_SECONDS_ON_WAN = 0.010       # a part should cross the slowest WAN link in about this long
MIN_WAN_PART_BYTES = 256 << 10
# parts of keys only DC-only rounds use (``KVStore.init(lan_only=True)``): the WAN's part size is for the WAN.
# A waited DC average of the small LM (26 MB in 4 MiB buckets, 2 DCs x 2 workers, a sleep for compute,
# tests/scripts/averaging_phases.py) took 132-166 ms in transpacific's 256 KiB parts, 105-116 in 1 MiB, 85-90 in
# 4 MiB and 72 ms whole (docs/benchmarks.md, "DC rounds in LAN-sized parts")
LAN_PART_BYTES = MAX_PART_BYTES


def wan_partition_bytes(link_bps: float) -> int:
    """Part size for a deployment whose slowest WAN link carries ``link_bps`` bits/s: the largest power of two
    from 256 KiB to 16 MiB that crosses it in about 10 ms. A round of a big tensor costs about its transfer plus
    one part (the global server answers part i while part i+1 is still coming up), so the smaller the part,
    the less of the round is spent with one link direction idle, until each part's own cost (a message each
    way at every hop) takes over. Measured on the wide MLP (one 26 MB tensor), 2 DCs x 2 workers, FSA, 30 steps
    (docs/benchmarks.md, "Parts sized by wire time"): at 1 Gbit/s 1 MiB parts (8 ms each) took 0.36-0.38 s a
    step, 256 KiB 0.39, 4 MiB 0.41, 16 MiB 0.55-0.56; at 100 Mbit/s 256 KiB (21 ms) 2.48 s, 1 MiB 2.54,
    4 MiB 2.81. A tensor is cut into parts of this size (so a 26 MB one into 25 at 1 Gbit/s): more than the
    8 a round needs to keep both directions busy."""
    fits = link_bps / 8 * PART_SECONDS_ON_WAN
    size = MIN_WAN_PART_BYTES
    while size * 2 <= min(fits, MAX_PART_BYTES):
        size *= 2
    return size


def wire_part_bytes(partition_bytes: int, wire_ratio: float) -> int:
    """The raw size of a part whose codec puts ``wire_ratio`` times fewer bytes on the wire than float32: about
    ``partition_bytes`` of wire bytes, so that a compressed part crosses the slowest link in about as long as a
    dense one, up to ``MAX_PART_BYTES``. Sized by raw bytes, a 256 KiB part of 8-bit QSGD was 66 KB on the wire,
    and PowerSGD compressed each 25-row block of a 2560 x 2560 matrix apart: 15 MB a step instead of 1.5
    (docs/benchmarks.md, "Parts sized by their wire bytes")."""
    if partition_bytes <= 0 or wire_ratio <= 1:
        return partition_bytes
    return max(partition_bytes, min(int(partition_bytes * wire_ratio), MAX_PART_BYTES))


def plan_parts(key, shape: tuple, itemsize: int, partition_bytes: int) -> list[Part] | None:
    """The parts of a tensor, or None when it travels whole (small enough, or partitioning is off)."""
    nelements = math.prod(shape)
    if partition_bytes <= 0 or nelements * itemsize <= partition_bytes:
        return None
    row = math.prod(shape[1:]) if len(shape) >= 2 else 1
    if len(shape) < 2 or row * itemsize > partition_bytes:
        row = 1                                  # no whole row fits: cut the flattened tensor
    per_part = max(1, partition_bytes // (row * itemsize)) * row
    n = -(-nelements // per_part)
    parts = []
    for i in range(n):
        start, stop = i * per_part, min(nelements, (i + 1) * per_part)
        part_shape = ((stop - start) // row, *shape[1:]) if row > 1 else (stop - start,)
        parts.append(Part(part_key(key, i, n), start, stop, part_shape))
    return parts


def part_views(array: np.ndarray, parts: list[Part]) -> list[np.ndarray]:
    """Views of each part, in its own shape, of a C-contiguous ``array`` (no copy)."""
    flat = array.reshape(-1)
    return [flat[p.start:p.stop].reshape(p.shape) for p in parts]
