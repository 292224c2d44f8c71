"""The codec family. Pick by where the bandwidth is scarce and what the tensor is (docs/compression.md has
the measured throughput and compression ratio of each):

========== ============================== ================================= ======== ===========================
name       parameters (default)           wire bytes for N elements         biased   use with
========== ============================== ================================= ======== ===========================
none       -                              4N                                no       -
fp16       - (per-tensor 2^e scale)        2N                                rounding -
bf16       -                              2N                                rounding -  (fp32 range, 8-bit mantissa)
topk       ratio (0.01)                   8k, k = max(1, round(ratio N))    yes      ErrorFeedback
bsc        threshold (0.01), sample_ratio 8k', k' in [k/2, 2k] (sampled)    yes      ErrorFeedback
randomk    ratio (0.01), unbiased (False) 4k (indices come from a seed)     unless   ErrorFeedback unless
                                                                            unbiased unbiased
dgc        ratio (0.001), momentum (0.9), 8k' (warm-up: larger k)           yes      its own memory
           nesterov, clip_norm,
           warmup_steps_per_stage (0)
powersgd   rank (1), warm_start (True)    4 rank (n + m); dense 4N if 1-D   yes      its own memory
                                          or rank (n + m) >= n m
qsgd       levels (127), bucket_size      N + 4B (levels <= 7: ceil(N/2)    no       - (ErrorFeedback only if
           (512)                          + 4B), B = ceil(N / bucket_size)           levels^2 >= bucket_size)
terngrad   -                              ceil(N/4) + 4                     no       - (not with ErrorFeedback)
onebit     -                              ceil(N/8) + 4                     yes      ErrorFeedback
========== ============================== ================================= ======== ===========================

Indices are int32 (int64 from 2**31 elements on); values and scales float32. Tuning, roughly in the order to
try: 16-bit dense first (it is the honest baseline, Han et al. 2024); on a slow WAN a sparsifier with error
feedback (``bsc``/``topk`` at 1% -> 0.1%, ``dgc`` for momentum SGD with a warm-up of a few epochs);
``powersgd`` rank 1, 2, 4 for large 2-D/conv weights; the quantizers where every entry must move.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from geomx.compression.codec import Codec, Payload, index_dtype
from geomx.compression.registry import check_bool, check_fraction, check_int, check_number, register

F32 = np.float32


def _scalar(value: float) -> np.ndarray:
    """A scale travels as one float32 (4 bytes) so that the decoder uses exactly what the encoder used."""
    return np.array([value], dtype=F32)


def _count(ratio: float, n: int) -> int:
    """Entries a sparsifier keeps: round(ratio n), at least 1, at most n."""
    return min(n, max(1, round(ratio * n)))


# == dense: none, fp16, bf16 =====================================================================================

@register("none")
@dataclass(frozen=True, kw_only=True)
class NoCompression(Codec):
    """Identity: float32 as is (the payload shares memory with the input). Wire: 4N bytes."""

    elementwise = True

    def _encode(self, flat, shape, state):
        return Payload([flat])

    def _decode(self, payload, shape):
        return payload.arrays[0]


@register("fp16")
@dataclass(frozen=True, kw_only=True)
class FP16(Codec):
    """IEEE half precision with a per-tensor power-of-two scale (the loss-scaling idea of mixed-precision
    training, applied per tensor): the largest magnitude is mapped to [2**14, 2**15), so every value keeps
    fp16's relative error <= 2**-11 down to 2**-28 of the largest one (and degrades gracefully below it),
    nothing overflows, and tiny gradients (1e-6 is a subnormal in plain fp16) keep their precision. A power of
    two multiplies exactly, so scaling costs no accuracy; the scale's exponent travels in the header. A tensor
    with inf or NaN is sent unscaled (they stay inf and NaN). Wire: 2N bytes.

    Element-wise for fusion although the scale is per tensor: with values down to 2**-28 of the peak kept to
    fp16's precision, the tensors of a fused bucket lose nothing by sharing one scale."""

    elementwise = True

    def wire_ratio(self, shape):
        return 2.0

    def _encode(self, flat, shape, state):
        peak = float(np.max(np.abs(flat))) if flat.size else 0.0
        exponent = 14 - math.frexp(peak)[1] + 1 if peak > 0 and math.isfinite(peak) else 0
        scaled = np.ldexp(flat, exponent) if exponent else flat
        return Payload([scaled.astype(np.float16)], {"e": exponent})

    def _decode(self, payload, shape):
        exponent = payload.meta.get("e", 0)
        if isinstance(exponent, bool) or not isinstance(exponent, int) or abs(exponent) > 300:
            raise ValueError(f"fp16 payload has a bad scale exponent {exponent!r}")
        out = payload.arrays[0].astype(F32)
        return np.ldexp(out, -exponent).astype(F32, copy=False) if exponent else out


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even like ``torch.bfloat16``; NaN
    stays a (quiet) NaN."""
    x = np.ascontiguousarray(x, dtype=F32)
    bits = x.view(np.uint32)
    rounded = bits >> np.uint32(16)     # in place from here on: one temporary instead of five (5x faster)
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFF)
    rounded += bits                     # bits + 0x7FFF + lsb; wraps only for NaN, fixed below
    rounded >>= np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(F32)


@register("bf16")
@dataclass(frozen=True, kw_only=True)
class BF16(Codec):
    """bfloat16 (upper 16 bits of float32, round to nearest even) sent as uint16: float32's range, relative
    error <= 2**-8. Safer than fp16 for gradients of unknown scale, 8x coarser. Wire: 2N bytes."""

    elementwise = True

    def wire_ratio(self, shape):
        return 2.0

    def _encode(self, flat, shape, state):
        return Payload([float32_to_bf16_bits(flat)])

    def _decode(self, payload, shape):
        return bf16_bits_to_float32(payload.arrays[0])


# == sparsifiers: topk, bsc, randomk (and dgc below) ==============================================================

def exact_top(flat: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest |flat| (introselect, O(N))."""
    n = flat.size
    idx = np.argpartition(np.abs(flat), n - k)[n - k:]
    idx.sort()
    return idx


# the sample for a threshold holds at least this many entries expected above it, so that the kept count is
# within about +-1/sqrt(64) = 12.5% of the target (one standard deviation) whatever the distribution
MIN_SAMPLE_TOP = 64


def sampled_top(flat: np.ndarray, k: int, rng: np.random.Generator, *, sample_ratio: float) -> np.ndarray:
    """Sorted indices of about the k largest |flat|: the count lies in [k/2, 2k] (fewer only where fewer
    entries are non-zero), and every kept entry is among the 2k largest.

    The threshold is the matching order statistic of |x| on a fresh uniform sample of
    max(sample_ratio N, 64 N / k) entries (DGC's estimate; GeoMX samples the same fixed positions every step,
    this draws new ones). An order statistic of a sample does not depend on the distribution, so heavy tails
    do not hurt. If more than 2k entries pass (ties, bad luck), an exact top-k among them keeps k; if fewer
    than k/2 pass, an exact top-k over everything does (zeros are never sent).
    """
    n = flat.size
    if k >= n:
        return np.flatnonzero(flat)
    size = max(math.ceil(sample_ratio * n), math.ceil(MIN_SAMPLE_TOP * n / k))
    if size >= n // 2:          # a sample that large saves nothing over the exact selection
        idx = exact_top(flat, k)
        return idx[flat[idx] != 0]
    sample = np.abs(flat[rng.integers(0, n, size)])
    above = max(1, round(k * size / n))
    thr = np.partition(sample, size - above)[size - above]
    # two comparisons instead of np.abs(flat): no N-sized float temporary
    idx = np.flatnonzero((flat >= thr) | (flat <= -thr)) if thr > 0 else np.flatnonzero(flat)
    if len(idx) > 2 * k:
        idx = idx[np.argpartition(np.abs(flat[idx]), len(idx) - k)[len(idx) - k:]]
        idx.sort()
    elif 2 * len(idx) < k:
        idx = exact_top(flat, k)
        idx = idx[flat[idx] != 0]
    return idx


class _Sparse(Codec):
    """A sparsifier's payload: [indices (int32/int64), values (float32)]; decoding scatters into zeros."""

    biased = True
    sparsifying = True

    def wire_ratio(self, shape):
        return 1.0 / (2.0 * self.kept_share)        # an int32 index and a float32 value per kept entry

    @property
    def kept_share(self) -> float:
        """The share of entries sent."""
        return self.ratio

    def _indices_values(self, payload: Payload, n: int) -> tuple[np.ndarray, np.ndarray]:
        return payload.arrays[0], payload.arrays[1]

    def _decode(self, payload, shape):
        return self._decode_scaled(payload, shape, 1.0)

    def _decode_scaled(self, payload, shape, scale):
        # scale the k sent values, not the N decoded ones: np.zeros leaves untouched pages unmapped, so a
        # pass over the dense result would cost ~30x the scatter (2.3 ms against 0.08 for 1M entries at 1%)
        n = math.prod(shape)
        idx, values = self._indices_values(payload, n)
        # payloads come off the network: an index outside [0, n) must not wrap around or crash a server
        if idx.dtype.kind not in "iu" or idx.shape != values.shape or (idx.size and (idx.min() < 0 or idx.max() >= n)):
            raise ValueError(f"{self.name} payload has {idx.size} {idx.dtype} indices for {values.size} values, "
                             f"not all in [0, {n})")
        out = np.zeros(n, dtype=F32)
        out[idx] = values if scale == 1 else values * np.float32(scale)
        return out

    def subtract_decoded(self, payload, flat):
        idx, values = self._indices_values(payload, flat.size)
        flat[idx] -= values          # indices are unique: plain fancy indexing is exact


def _sparse_payload(flat: np.ndarray, idx: np.ndarray, **meta) -> Payload:
    return Payload([idx.astype(index_dtype(flat.size), copy=False), flat[idx]], meta)


@register("topk")
@dataclass(frozen=True, kw_only=True)
class TopK(_Sparse):
    """Exactly the k = max(1, round(ratio N)) largest magnitudes (``np.argpartition``, O(N)) with their exact
    values. Wire: 8k bytes (int32 index + float32 value). Biased: use ErrorFeedback. ``bsc`` picks about the
    same entries several times faster on large tensors."""

    ratio: float = 0.01

    def __post_init__(self):
        check_fraction(self, "ratio")

    def _encode(self, flat, shape, state):
        return _sparse_payload(flat, exact_top(flat, _count(self.ratio, flat.size)))


@register("bsc")
@dataclass(frozen=True, kw_only=True)
class BSC(_Sparse):
    """GeoMX's Bi-Sparse selection: about ``threshold`` x N entries of largest magnitude, chosen with a
    threshold estimated on a random sample (see :func:`sampled_top`: kept count in [k/2, 2k], typically
    within 15% of k). ``threshold`` is GeoMX's name for the kept ratio (0.01 in its examples).

    GeoMX folds DGC momentum correction (m = 0.9) into BSC; here selection and memory are separate: use
    ``bsc`` with ErrorFeedback (residual accumulation), or ``dgc`` with ``momentum=0.9`` for GeoMX's exact
    push-side behaviour. Wire: 8k' bytes."""

    threshold: float = 0.01
    sample_ratio: float = 0.01

    @property
    def kept_share(self) -> float:
        return self.threshold

    def __post_init__(self):
        check_fraction(self, "threshold")
        check_fraction(self, "sample_ratio")

    def _encode(self, flat, shape, state):
        k = _count(self.threshold, flat.size)
        return _sparse_payload(flat, sampled_top(flat, k, state.rng(self), sample_ratio=self.sample_ratio))


def random_indices(seed: int, n: int, k: int) -> np.ndarray:
    """k distinct indices in [0, n) drawn from ``seed``, sorted: sender and receiver compute the same."""
    idx = np.random.default_rng(seed).choice(n, size=k, replace=False, shuffle=False)
    idx.sort()
    return idx


@register("randomk")
@dataclass(frozen=True, kw_only=True)
class RandomK(_Sparse):
    """k = max(1, round(ratio N)) entries chosen uniformly at random. Only the values travel (4k bytes): the
    indices are regenerated from a seed in the header, drawn from the key's CodecState. Senders whose states
    share a seed and step pick the same indices, so their payloads can be summed without decoding.

    ``unbiased=False`` (default) sends the values as they are: biased, use ErrorFeedback. ``unbiased=True``
    scales them by N/k so that E[decoded] = x, at a variance of x^2 (N/k - 1) per entry: only for small
    compression or when error feedback is impossible."""

    ratio: float = 0.01
    unbiased: bool = False

    def wire_ratio(self, shape):
        return 1.0 / self.kept_share                # values only: the indices come from the seed

    def __post_init__(self):
        check_fraction(self, "ratio")
        check_bool(self, "unbiased")

    @property
    def biased(self) -> bool:
        return not self.unbiased

    def _encode(self, flat, shape, state):
        n = flat.size
        k = _count(self.ratio, n)
        seed = int(state.rng(self).integers(2 ** 63))
        values = flat[random_indices(seed, n, k)]
        if self.unbiased:
            values = values * F32(n / k)
        return Payload([values], {"seed": seed})

    def _indices_values(self, payload, n):
        values = payload.arrays[0]
        return random_indices(payload.meta["seed"], n, values.size), values


# == DGC =======================================================================================================

# DGC's warm-up: density per stage (sparsity 75%, 93.75%, 98.4375%, 99.6%), then the codec's ratio (99.9%)
DGC_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)


@register("dgc")
@dataclass(frozen=True, kw_only=True)
class DGC(_Sparse):
    """Deep Gradient Compression (Lin et al. 2018), complete: per step and key

    1. local gradient clipping: g *= min(1, clip_norm / ||g||) when ``clip_norm`` is set (the paper scales the
       global clip norm by N^-1/2 for N senders; give the already scaled value);
    2. momentum correction: u = m u + g; v = v + u (``nesterov``: u = m (u + g); v = v + u + g);
    3. send about k entries of largest |v| (sampled threshold as in ``bsc``);
    4. momentum factor masking: u and v are zeroed where sent.

    Warm-up: the density is 25%, 6.25%, 1.5625%, 0.4% (max with ``ratio``) for ``warmup_steps_per_stage``
    steps each, then ``ratio``; the paper spends one epoch per stage, so set it to your steps per epoch
    (0, the default, starts at ``ratio``). Workers then apply no momentum of their own (it is in v).

    DGC keeps its residual (v) and momentum (u) itself: two float32 buffers of N entries per key
    (``has_own_memory``; never combine with ErrorFeedback). Wire: 8k' bytes."""

    ratio: float = 0.001
    momentum: float = 0.9
    nesterov: bool = False
    clip_norm: float | None = None
    warmup_steps_per_stage: int = 0
    sample_ratio: float = 0.01

    has_own_memory = True

    def __post_init__(self):
        check_fraction(self, "ratio")
        check_number(self, "momentum", low=0.0, high=1.0)
        check_bool(self, "nesterov")
        if self.clip_norm is not None:
            check_number(self, "clip_norm", low=0.0, open_low=True)
        check_int(self, "warmup_steps_per_stage", low=0)
        check_fraction(self, "sample_ratio")

    def downlink(self) -> Codec:
        # momentum correction and masking act on each worker's own gradient stream; what a server sends back
        # is an aggregate, sparsified at the same ratio with plain residual accumulation
        return BSC(threshold=self.ratio, sample_ratio=self.sample_ratio)

    def density(self, step: int) -> float:
        """The fraction of entries sent at ``step`` (0-based), warm-up included."""
        stage = step // self.warmup_steps_per_stage if self.warmup_steps_per_stage else len(DGC_WARMUP_DENSITIES)
        return max(DGC_WARMUP_DENSITIES[stage], self.ratio) if stage < len(DGC_WARMUP_DENSITIES) else self.ratio

    def _encode(self, flat, shape, state):
        slot = state.slot(self)
        step = state.next_step(self)
        if slot.get("u") is None or slot["u"].size != flat.size:
            slot["u"], slot["v"] = np.zeros_like(flat), np.zeros_like(flat)
        u, v = slot["u"], slot["v"]
        g = flat
        if self.clip_norm is not None:
            norm = float(np.linalg.norm(g))
            if norm > self.clip_norm:
                g = g * F32(self.clip_norm / norm)
        m = F32(self.momentum)
        if self.nesterov:
            u += g
            u *= m
            v += u
            v += g
        else:
            u *= m
            u += g
            v += u
        idx = sampled_top(v, _count(self.density(step), flat.size), state.rng(self), sample_ratio=self.sample_ratio)
        payload = _sparse_payload(v, idx)
        u[idx] = 0
        v[idx] = 0
        return payload


# == PowerSGD ===================================================================================================

def orthonormal_columns(p: np.ndarray) -> np.ndarray:
    """An orthonormal basis of p's column space (reduced QR; Householder stays finite on rank-deficient p)."""
    return np.linalg.qr(p)[0]


@register("powersgd")
@dataclass(frozen=True, kw_only=True)
class PowerSGD(Codec):
    """PowerSGD (Vogels et al. 2019): rank-``rank`` approximation M ~ P Q^T by one power iteration per step,
    with error feedback and warm start built in (as in the paper and PyTorch's ``powerSGD_hook``).

    The tensor is viewed as a matrix: 2-D as is, n-D as (shape[0], -1). 1-D tensors, and matrices where
    rank (n + m) >= n m (no saving), travel dense float32 (4N bytes). Otherwise, per step:
    M = grad + error; P = orth(M Q); Q = M^T P; send P (n x rank) and Q (m x rank) float32, 4 rank (n + m)
    bytes; error = M - P Q^T; keep Q for the next step (``warm_start``; otherwise a fresh random Q).

    Tune ``rank`` on 1, 2, 4, ... (1-4 is typical; higher costs O(rank^2) more orthogonalization and is rarely
    more accurate). Memory: one float32 error buffer of N entries and Q per key (``has_own_memory``: never
    combine with ErrorFeedback). The payload is linear in M for a fixed Q, so senders sharing Q could sum P;
    geomx's servers decode each sender's payload instead."""

    rank: int = 1
    warm_start: bool = True

    def wire_ratio(self, shape):
        nm = self.matrix_shape(tuple(shape))
        return 1.0 if nm is None else nm[0] * nm[1] / (self.rank * (nm[0] + nm[1]))

    has_own_memory = True
    biased = True

    def __post_init__(self):
        check_int(self, "rank", low=1)
        check_bool(self, "warm_start")

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(n, m) the tensor is compressed as, or None where it travels dense."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = math.prod(shape[1:])
        return None if self.rank * (n + m) >= n * m else (n, m)

    def _encode(self, flat, shape, state):
        nm = self.matrix_shape(shape)
        if nm is None:
            return Payload([flat], {"dense": True})
        n, m = nm
        slot = state.slot(self)
        error = slot.get("error")
        mat = flat.reshape(n, m) + (error if error is not None and error.shape == (n, m) else 0)
        q = slot.get("q") if self.warm_start else None
        if q is None or q.shape != (m, self.rank) or not np.all(np.linalg.norm(q, axis=0) > 0):
            # first step, no warm start, or a zero column (a zero gradient left Q = 0, which would stay 0)
            q = state.rng(self).standard_normal((m, self.rank), dtype=F32)
        p = orthonormal_columns(mat @ q)
        q = mat.T @ p
        mat -= p @ q.T                  # what P Q^T misses is the next step's error
        slot["error"], slot["q"] = mat, q
        return Payload([p.astype(F32, copy=False), q.astype(F32, copy=False)])

    def _decode(self, payload, shape):
        if payload.meta.get("dense"):
            return payload.arrays[0]
        p, q = payload.arrays
        return (p @ q.T).reshape(-1)


# == quantizers: qsgd, terngrad, onebit ===========================================================================

def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes < 2**bits (bits = 1, 2 or 4) -> bytes, 8 // bits codes per byte, first code lowest."""
    if bits == 1:
        return np.packbits(codes, bitorder="little")
    per = 8 // bits
    pad = (-codes.size) % per
    grid = (np.concatenate([codes, np.zeros(pad, np.uint8)]) if pad else codes).reshape(-1, per)
    packed = grid[:, 0].copy()
    for j in range(1, per):             # over the codes of one byte, not over elements
        packed |= grid[:, j] << np.uint8(bits * j)
    return packed


def unpack_codes(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: the first n codes as uint8."""
    if bits == 1:
        return np.unpackbits(packed, count=n, bitorder="little")
    per = 8 // bits
    grid = np.empty((packed.size, per), dtype=np.uint8)
    for j in range(per):
        grid[:, j] = (packed >> np.uint8(bits * j)) & np.uint8((1 << bits) - 1)
    return grid.reshape(-1)[:n]


def stochastic_round(r: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """floor(r) + Bernoulli(r - floor(r)) for r >= 0: an unbiased integer rounding, as float32. Overwrites r
    (with its fractional part): callers pass a temporary."""
    low = np.floor(r)
    r -= low
    low += rng.random(r.shape, dtype=F32) < r
    return low


@register("qsgd")
@dataclass(frozen=True, kw_only=True)
class QSGD(Codec):
    """QSGD (Alistarh et al. 2017): the tensor is cut into buckets of ``bucket_size`` entries; in a bucket b
    each entry becomes sign(x) l ||b||_2 / s with an integer level l in [0, s] from stochastic rounding of
    s |x| / ||b||_2. Unbiased, variance <= min(d / s^2, sqrt(d) / s) ||b||^2 for buckets of d entries: small
    buckets (128-512, the usual setting) keep it low; one bucket for a whole large tensor makes it exceed
    the signal. Levels travel as int8 (s <= 127) or, for s <= 7, as 4-bit codes, plus one float32 norm per
    bucket: N + 4B bytes, or ceil(N/2) + 4B, with B = ceil(N / bucket_size).

    With ErrorFeedback only where levels^2 >= bucket_size: below that the quantization error can exceed the
    signal, and a residual fed back grows without bound (4 levels, buckets of 512: x1000 in 30 steps).

    Element-wise in blocks: fused tensors share a bucket's norm only where one bucket of ``bucket_size`` values
    holds parts of several."""

    elementwise = True
    levels: int = 127
    bucket_size: int = 512

    def wire_ratio(self, shape):
        return 32.0 / (self._bits + 32.0 / self.bucket_size)

    def __post_init__(self):
        check_int(self, "levels", low=1, high=127)
        check_int(self, "bucket_size", low=1)

    @property
    def contractive(self) -> bool:
        return self.levels ** 2 >= self.bucket_size

    @property
    def _bits(self) -> int:
        return 4 if self.levels <= 7 else 8

    def _encode(self, flat, shape, state):
        buckets = _buckets(flat, self.bucket_size)
        norms = np.linalg.norm(buckets, axis=1).astype(F32)
        s = F32(self.levels)
        scale = np.divide(s, norms, out=np.zeros_like(norms), where=norms > 0)
        scaled = np.abs(buckets)
        scaled *= scale[:, None]
        level = stochastic_round(scaled, state.rng(self))
        np.minimum(level, s, out=level)         # s |x| / ||b|| can round to just above s
        signed = np.copysign(level, buckets, out=level).astype(np.int8).reshape(-1)[:flat.size]
        codes = pack_codes((signed + np.int8(8)).view(np.uint8), 4) if self._bits == 4 else signed
        return Payload([codes, norms])

    def _decode(self, payload, shape):
        codes, norms = payload.arrays
        n = math.prod(shape)
        signed = unpack_codes(codes, 4, n).view(np.int8) - np.int8(8) if self._bits == 4 else codes
        levels = _buckets(signed.astype(F32), self.bucket_size)
        return (levels * (norms / F32(self.levels))[:, None]).reshape(-1)[:n]


def _buckets(flat: np.ndarray, size: int) -> np.ndarray:
    """flat as rows of ``size`` entries, the last row padded with zeros."""
    pad = (-flat.size) % size
    return (np.concatenate([flat, np.zeros(pad, flat.dtype)]) if pad else flat).reshape(-1, size)


@register("terngrad")
@dataclass(frozen=True, kw_only=True)
class TernGrad(Codec):
    """TernGrad (Wen et al. 2017): each entry becomes s t with s = max|x| and t in {-1, 0, 1}, t = sign(x)
    with probability |x| / s: unbiased. 2 bits per entry (4 per byte) + the float32 scale: ceil(N/4) + 4
    bytes. The paper's 2.5-sigma clipping (which trades bias for variance) is left to the caller. Its error
    can exceed the signal (variance max|x| |x| - x^2 per entry), so do not feed it back (ErrorFeedback)."""

    contractive = False     # overrides the property: never

    def wire_ratio(self, shape):
        return 16.0

    def _encode(self, flat, shape, state):
        magnitude = np.abs(flat)
        scale = F32(magnitude.max()) if flat.size else F32(0)
        threshold = state.rng(self).random(flat.shape, dtype=F32)
        threshold *= scale
        kept = threshold < magnitude            # P = |x| / scale; never for x = 0, always for |x| = scale
        negative = flat < 0
        codes = (kept & ~negative).view(np.uint8) << np.uint8(1)    # 2 = +1
        codes |= (~kept).view(np.uint8)                              # 1 = 0; 0 = -1
        return Payload([pack_codes(codes, 2), _scalar(scale)])

    def _decode(self, payload, shape):
        codes, scale = payload.arrays
        out = unpack_codes(codes, 2, math.prod(shape)).astype(F32)     # in place: 4x faster than a lookup table
        out -= F32(1)
        out *= scale[0]
        return out


@register("onebit")
@dataclass(frozen=True, kw_only=True)
class OneBit(Codec):
    """1-bit SGD / EF-signSGD (Seide et al. 2014, Karimireddy et al. 2019): sign bits plus one scale,
    mean |x| (the scaled sign). Biased and useless without error feedback: use ErrorFeedback, which makes it
    converge like SGD. Wire: ceil(N/8) + 4 bytes."""

    biased = True

    def wire_ratio(self, shape):
        return 32.0

    def _encode(self, flat, shape, state):
        scale = F32(np.abs(flat).sum() / flat.size) if flat.size else F32(0)     # numpy sums pairwise
        return Payload([pack_codes((flat < 0).view(np.uint8), 1), _scalar(scale)])

    def _decode(self, payload, shape):
        bits, scale = payload.arrays
        out = unpack_codes(bits, 1, math.prod(shape)).astype(F32)    # 1 where negative
        out *= F32(-2) * scale[0]
        out += scale[0]
        return out

