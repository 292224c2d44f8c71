"""Tensor fusion: a model's many small tensors travel packed into a few flat buffers ("buckets").

Why: every key costs a message each way at every hop, about 0.2 ms of Python and ZeroMQ per key and round
trip on this machine, whatever its size. The tiny language model has 64 tensors (42 of them LayerNorm
weights and biases of 128-512 elements); a DC average of its 4.2 MB took 15-18 ms as 64 keys and 4.2 ms as one
(1 DC x 2 workers, ``lan``; docs/benchmarks.md, "Tensor fusion"). Horovod's tensor fusion and DDP's gradient
buckets exist for the same reason. ``geomx bench fusion`` measures it.

A :class:`Fusion` is planned from the tensors' names, shapes and dtypes alone, so every worker plans the same
buckets: tensors in order, each bucket holding consecutive tensors of one dtype up to ``bucket_bytes``, those of
half a bucket or more skipped; such a tensor travels alone under its own name (the kvstore cuts a large one into
parts). Bucket keys are ``"__geomx.fused/<prefix>/<first member's name>+<members>"``; :meth:`Fusion.init`
creates them on the servers (every process, the master worker too, as for any key).

Only exact for the servers' element-wise sum, which is what a model average asks of them: a codec that looks at
a tensor's shape (PowerSGD's matrices) or size (Bi-Sparse's bound) would see a bucket instead, so the policies
fuse only rounds whose codecs are all element-wise (``Codec.elementwise``: none, fp16, bf16, QSGD) and set no
codec of their own for small tensors. ``GEOMX_FUSION_BYTES`` sets the bucket size (0: every tensor travels
alone); every process of a deployment must read the same value, which the launcher's environment gives them.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from geomx.compression import CODECS
from geomx.errors import ConfigError

FUSION_ENV = "GEOMX_FUSION_BYTES"
DEFAULT_BUCKET_BYTES = 4 << 20
KEY_PREFIX = "__geomx.fused/"


@dataclass(frozen=True)
class Bucket:
    key: str
    dtype: torch.dtype
    members: tuple[int, ...]      # indices of the fused tensors, in order
    offsets: tuple[int, ...]      # each member's first element in the flat buffer
    numel: int

    def slices(self, tensors: list[torch.Tensor]):
        """(member tensor, its flat range in the buffer) pairs."""
        for i, start in zip(self.members, self.offsets, strict=True):
            yield tensors[i], start, start + tensors[i].numel()


ALL_TIERS, DC_TIERS = ("lan", "wan", "small"), ("lan", "small")


def compressed(kv, tiers: tuple[str, ...] = ALL_TIERS) -> bool:
    """Whether the deployment compresses gradients on one of ``tiers`` (the master worker's setting); a DC-only
    round crosses the LAN alone (``DC_TIERS``)."""
    return any(kind != "none" for kind in _codec_types(kv, tiers))


def elementwise(kv, tiers: tuple[str, ...] = ALL_TIERS) -> bool:
    """Whether every codec of ``kv``'s deployment on ``tiers`` reads values element-wise (``Codec.elementwise``),
    so that packed tensors compress as they would apart. A codec for small tensors (``small``) is not: a bucket
    is no small tensor, so its members would take the tier's codec instead."""
    if "small" in tiers and (kv.compression or {}).get("small") is not None:
        return False
    return all(CODECS[kind].elementwise for kind in _codec_types(kv, tiers))


def _codec_types(kv, tiers: tuple[str, ...]) -> list[str]:
    """The codec type on each of ``tiers`` of ``kv``'s deployment ("none" where it sets none)."""
    policy = kv.compression or {}
    return [(policy.get(tier) or {}).get("type", "none") for tier in tiers]


def bucket_bytes_from_env(env: Mapping[str, str] | None = None) -> int:
    raw = (os.environ if env is None else env).get(FUSION_ENV, "").strip()
    if not raw:
        return DEFAULT_BUCKET_BYTES
    if not raw.isdigit():
        raise ConfigError(f"{FUSION_ENV}={raw!r}: bytes per fused bucket must be a whole number >= 0 (0: no fusion)")
    return int(raw)


def bucket_bytes_for(kv, *, crosses_wan: bool) -> int:
    """The bucket size for rounds of ``kv``'s deployment. A round that crosses the WAN gets buckets of at most
    one part (``GEOMX_PARTITION_BYTES``, sized for the slowest link), so that each bucket is one message with
    its own priority: where several workers share a link (the flat topology), the same bucket of every worker
    then arrives together and the server answers it while the next ones are still on the wire. One 4 MiB
    bucket cut into 16 parts of one priority crossed as worker 0's parts, then worker 1's, and the flat PS's
    step took 1.35 s instead of 1.09 (tiny LM, ``transpacific``, docs/benchmarks.md "Tensor fusion"). DC-only
    rounds cross no emulated link and take the whole size. A part is sized by its wire bytes
    (``kv.wire_part_bytes``): under 8-bit QSGD a bucket of about 1 MiB is a quarter of that on the wire."""
    size = bucket_bytes_from_env()
    if not crosses_wan or kv.cfg.partition_bytes <= 0:
        return size
    return min(size, kv.wire_part_bytes(f"{KEY_PREFIX}bucket", (max(1, size // 4),)))


class Fusion:
    """The buckets of one list of tensors, and packing them to and from the kvstore."""

    def __init__(self, prefix: str, names: list[str], tensors: list[torch.Tensor], *,
                 bucket_bytes: int | None = None) -> None:
        if bucket_bytes is None:
            bucket_bytes = bucket_bytes_from_env()
        if bucket_bytes < 0:
            raise ConfigError(f"bucket_bytes must be >= 0 (0: no fusion), got {bucket_bytes}")
        self.names, self.bucket_bytes = list(names), bucket_bytes
        self.buckets: list[Bucket] = []
        self.alone: list[int] = []              # tensors that travel under their own name
        open_: dict[torch.dtype, tuple[list[int], int]] = {}      # dtype -> (members, bytes) of its open bucket

        def close(dtype: torch.dtype) -> None:
            members, _ = open_.pop(dtype, ([], 0))
            if len(members) == 1:               # a bucket of one would only add a copy
                self.alone.append(members[0])
            elif members:
                offsets, total = [], 0
                for i in members:
                    offsets.append(total)
                    total += tensors[i].numel()
                # named by its first tensor: unique wherever the tensors' own keys are (several optimizers on
                # one kvstore), the same on every worker
                key = f"{KEY_PREFIX}{prefix}/{self.names[members[0]]}+{len(members)}"
                self.buckets.append(Bucket(key, dtype, tuple(members), tuple(offsets), total))

        for i, t in enumerate(tensors):
            size = t.numel() * t.element_size()
            # a tensor of half a bucket or more travels alone and leaves the open bucket open: a bucket would
            # save it at most one message, and closing the bucket for it stranded the small tensors on either
            # side (the tiny LM's MLP biases between its 256 KiB weights: 27 keys a round instead of 18)
            if 2 * size >= bucket_bytes or not t.is_floating_point():
                self.alone.append(i)
                continue
            members, used = open_.get(t.dtype, ([], 0))
            if used + size > bucket_bytes:
                close(t.dtype)
                members, used = [], 0
            open_[t.dtype] = (members + [i], used + size)
        for dtype in list(open_):
            close(dtype)
        self.alone.sort()

    @classmethod
    def of(cls, kv, use: str, named: list[tuple[str, torch.Tensor]], *, crosses_wan: bool = True) -> Fusion:
        """The buckets of ``named`` tensors for ``kv``'s rounds (sized by :func:`bucket_bytes_for`), created on
        the servers."""
        tensors = [t.detach() for _, t in named]
        fusion = cls(use, [n for n, _ in named], tensors, bucket_bytes=bucket_bytes_for(kv, crosses_wan=crosses_wan))
        fusion.init(kv, tensors, lan_only=not crosses_wan)
        return fusion

    @staticmethod
    def fuses(kv, scope: str | None = None) -> bool:
        """Whether a round of ``scope`` travels fused: only where every codec on the tiers it crosses is
        element-wise (other codecs must see each tensor as it is: its shape, its size against the codec's
        bound)."""
        return elementwise(kv, DC_TIERS if scope == "dc" else ALL_TIERS)

    @property
    def keys(self) -> int:
        """Keys one round of these tensors sends."""
        return len(self.buckets) + len(self.alone)

    def init(self, kv, tensors: list[torch.Tensor], *, lan_only: bool = False) -> None:
        """Create the bucket keys on the servers, valued ``tensors`` packed (every process of the deployment
        calls it; the master worker's values count, as for any key). ``lan_only``: only DC-only rounds use the
        buckets, which then travel in LAN-sized parts (the tensors alone keep their own keys, which global
        rounds may use too)."""
        if self.buckets:
            kv.init([b.key for b in self.buckets], [self.pack(b, tensors) for b in self.buckets], packed=True,
                    lan_only=lan_only)

    def pack(self, bucket: Bucket, tensors: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """A new flat CPU buffer holding the bucket's members of ``tensors`` (times ``scale``)."""
        buf = torch.empty(bucket.numel, dtype=bucket.dtype)
        _scaled_into([(t, buf[start:stop].view_as(t)) for t, start, stop in bucket.slices(tensors)], scale)
        return buf

    def pushpull(self, kv, values: list[torch.Tensor], into: list[torch.Tensor], *, scale: float = 1.0,
                 scope: str | None = None, first_tensors_first: bool = False) -> list:
        """``kv.pushpull`` of every tensor times ``scale``, the results landing in ``into``; returns the
        handles (a bucket's results are unpacked into ``into`` before its handle finishes). Under a codec that
        is not element-wise (:meth:`fuses`) every tensor travels alone. ``first_tensors_first``: priority -index
        (a bucket's: its first tensor's), for rounds whose tensors are all sent at once."""
        def priority(i: int) -> int:
            return -i if first_tensors_first else 0

        fused = self.fuses(kv, scope)
        alone = self.alone if fused else range(len(self.names))
        handles = []
        for b in self.buckets if fused else []:
            buf = self.pack(b, values, scale)
            handles.append(kv.pushpull(b.key, buf, out=buf, priority=priority(b.members[0]), scope=scope)
                           .then(_unpacker(b, buf, into)))
        for i in alone:
            with torch.no_grad():
                value = values[i] if scale == 1.0 else values[i] * scale
            handles.append(kv.pushpull(self.names[i], value, out=into[i], priority=priority(i), scope=scope))
        return handles


class PackedRound:
    """One list of tensors' rounds through buffers allocated once and kept for a whole flight: each round packs
    the tensors times ``scale`` into ``sent`` (one pass), and its result lands in ``result``, both read in place
    through per-tensor views (``sent_views``, ``result_views``). What was sent is then the sender's record of it:
    a round that travels while training goes on (HFA's overlapped DC averages) needs no copy of the model besides
    the packed one, and no unpacking of the result. One round at a time: the next overwrites the buffers."""

    def __init__(self, fusion: Fusion, kv, tensors: list[torch.Tensor], *, scope: str | None = None) -> None:
        self.scope = scope
        self.keys: list[str] = []
        self.sent: list[torch.Tensor] = []
        self.result: list[torch.Tensor] = []
        self.sent_views: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        self.result_views: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        # a flat buffer per bucket where the round travels fused, else a tensor alone in its own shape (its key
        # was initialized so, and a codec may read the shape)
        buckets = fusion.buckets if fusion.fuses(kv, scope) else []
        for b in buckets:
            self._message(b.key, (b.numel,), b.dtype, zip(b.members, b.offsets, strict=True), tensors)
        fused = {i for b in buckets for i in b.members}
        for i, t in enumerate(tensors):
            if i not in fused:
                self._message(fusion.names[i], tuple(t.shape), t.dtype, [(i, 0)], tensors)

    def _message(self, key: str, shape: tuple, dtype: torch.dtype, placed, tensors: list[torch.Tensor]) -> None:
        """One message's buffers; ``placed``: (tensor index, its first element in them) pairs."""
        sent, result = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        self.keys.append(key)
        self.sent.append(sent)
        self.result.append(result)
        for i, start in placed:
            stop = start + tensors[i].numel()
            self.sent_views[i] = sent.view(-1)[start:stop].view_as(tensors[i])
            self.result_views[i] = result.view(-1)[start:stop].view_as(tensors[i])

    def pushpull(self, kv, tensors: list[torch.Tensor], *, scale: float = 1.0,
                 minus: list[torch.Tensor] | None = None) -> list:
        """Pack ``tensors`` (less ``minus``, where given: a model's change since then) times ``scale`` and start
        the round; returns the handles."""
        _scaled_into(list(zip(tensors, self.sent_views, strict=True)), scale, minus)
        return [kv.pushpull(key, sent, out=result, scope=self.scope)
                for key, sent, result in zip(self.keys, self.sent, self.result, strict=True)]


def _scaled_into(pairs: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                 minus: list[torch.Tensor] | None = None) -> None:
    """Each (source, destination): destination = source x scale (or (source - minus) x scale), in one pass over
    the memory where the scale is 1 or nothing is subtracted."""
    with torch.no_grad():
        for i, (t, out) in enumerate(pairs):
            if minus is not None:
                torch.sub(t, minus[i], out=out)
                if scale != 1.0:
                    out.mul_(scale)
            elif scale == 1.0:
                out.copy_(t)
            else:
                torch.mul(t, scale, out=out)


def _unpacker(bucket: Bucket, buf: torch.Tensor, into: list[torch.Tensor]):
    def unpack(result):
        with torch.no_grad():
            for t, start, stop in bucket.slices(into):
                t.copy_(buf[start:stop].view_as(t))
        return result
    return unpack


class GradientBuckets:
    """FSA's gradients through a :class:`Fusion`: a bucket is pushed once backward has produced every member's
    gradient (DDP's buckets; the last layers' bucket fills first), at the priority of the member backward makes
    last (its lowest: a bucket may wrap around tensors that travel alone, and goes when it is full), and
    each member's reply is a view of the bucket's buffer, where the bucket's reply lands."""

    def __init__(self, fusion: Fusion, indices: list[int], priorities: list[int]) -> None:
        """``indices``: the parameter index of each tensor the fusion was planned over; ``priorities``: each
        parameter's, by parameter index."""
        self.fusion = fusion
        self.priorities = priorities
        self.bucket_of = {indices[m]: b for b in fusion.buckets for m in b.members}
        self._members = {id(b): [indices[m] for m in b.members] for b in fusion.buckets}
        self._filled: dict[int, dict[int, torch.Tensor]] = {}     # id(bucket) -> parameter index -> gradient

    @property
    def pending(self) -> bool:
        """Some bucket has some, not all, of its gradients."""
        return bool(self._filled)

    def add(self, kv, i: int, grad: torch.Tensor, handles: dict[int, tuple]) -> None:
        """Parameter ``i``'s gradient is ready; when its bucket is full, push it and record each member's
        (handle, reply view) in ``handles``."""
        b = self.bucket_of[i]
        filled = self._filled.setdefault(id(b), {})
        filled[i] = grad
        members = self._members[id(b)]
        if len(filled) < len(members):
            return
        del self._filled[id(b)]
        # the bucket's members by their index in the fusion's plan, as pack and slices read them
        grads = {fused: filled[param] for fused, param in zip(b.members, members, strict=True)}
        buf = self.fusion.pack(b, grads)
        h = kv.pushpull(b.key, buf, out=buf, priority=min(self.priorities[m] for m in members))
        for param, (g, start, stop) in zip(members, b.slices(grads), strict=True):
            handles[param] = (h, buf[start:stop].view_as(g))
