"""The codec interface: what every gradient compressor provides, and what it puts on the wire.

A codec turns one float32 tensor into a :class:`Payload` (``compress``) and back into a dense float32 tensor
of the original shape (``decompress``). It never sends anything itself: the servers carry a payload's
``arrays`` as tensor frames and its ``meta`` inside the message header (msgpack), so a codec works the same
on the LAN tier (worker <-> local server) and on the WAN tier (local server <-> global server).

Codecs are immutable value objects (frozen dataclasses, keyword-only parameters): one instance serves every
key of a tier. What a codec must remember between steps of one key (PowerSGD's Q, DGC's velocity, a step
counter, a random generator) lives in that key's :class:`CodecState`, which the caller creates per key and
per tier. ``decompress`` needs no state: a receiver decodes a payload from the payload alone.

Class attributes that tell the caller how to use a codec:

* ``has_own_memory``: the codec keeps its own residual (DGC's velocity, PowerSGD's error); never wrap it in
  :class:`~geomx.compression.error_feedback.ErrorFeedback`.
* ``biased``: E[decompress(compress(x))] != x. Biased codecs without own memory need error feedback to
  converge (Karimireddy et al. 2019); ``needs_error_feedback`` says so.
* ``sparsifying``: the codec drops entries; tensors below the policy's size bound travel dense instead.
* ``elementwise``: the codec reads a tensor as a flat run of values, each on its own or in blocks of a fixed
  length (QSGD's buckets), never its shape or its size: several tensors packed into one flat buffer compress as
  they would apart (geomx.sync.fusion lets such rounds travel fused).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import numpy as np

# dtypes a payload may carry as tensor frames (geomx.transport.message accepts them all)
PAYLOAD_DTYPES = frozenset(np.dtype(d) for d in ("float32", "float16", "uint8", "int8", "int32", "int64", "uint16"))


@dataclass
class Payload:
    """What one compressed tensor puts on the wire.

    ``arrays`` travel as raw tensor frames; ``meta`` (plain msgpack-able values: shape, counts, scales, seeds)
    travels in the message header. ``payload_nbytes`` is what :meth:`Codec.wire_bytes` reports and what every
    compression ratio in geomx divides by; ``header_nbytes`` is the meta's msgpack size, reported next to it
    (a few dozen bytes, but it dominates for tiny tensors).
    """

    arrays: list[np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for a in self.arrays:
            if a.dtype not in PAYLOAD_DTYPES:
                raise TypeError(f"payload array of dtype {a.dtype} cannot travel; allowed: "
                                f"{sorted(d.name for d in PAYLOAD_DTYPES)}")

    @property
    def payload_nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def header_nbytes(self) -> int:
        return len(msgpack.packb(self.meta))


class CodecState:
    """Per-key, per-tier memory of the codecs: one slot (a dict) per codec name, plus a random generator.

    Create one per key and tier (the sender's and the receiver's are different objects). ``seed`` makes the
    random choices of a key reproducible; give every sender of a key the same seed where a codec relies on
    shared randomness (``randomk``'s indices are regenerated from a seed that travels in the payload, so
    receivers need no seed at all).
    """

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed
        self._slots: dict[str, dict[str, Any]] = {}

    def slot(self, codec: Codec) -> dict[str, Any]:
        """The codec's own dict in this state (created empty on first use)."""
        return self._slots.setdefault(codec.name, {})

    def rng(self, codec: Codec) -> np.random.Generator:
        """The codec's random generator, seeded from (seed, codec name) so codecs do not share a stream."""
        slot = self.slot(codec)
        if "rng" not in slot:
            slot["rng"] = np.random.default_rng([self.seed, *codec.name.encode()])
        return slot["rng"]

    def next_step(self, codec: Codec) -> int:
        """0 on the first call for ``codec``, then 1, 2, ...: the codec's step counter (warm-up schedules)."""
        slot = self.slot(codec)
        slot["step"] = slot.get("step", -1) + 1
        return slot["step"]

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def state_dict(self) -> dict[str, Any]:
        """The seed and every codec's slot (arrays kept as arrays; a random generator as its bit generator's
        state), so that a restored state continues the same random stream."""
        slots = {name: {k: ({"bit_generator_state": v.bit_generator.state} if isinstance(v, np.random.Generator)
                            else v) for k, v in slot.items()}
                 for name, slot in self._slots.items()}
        return {"seed": self.seed, "slots": slots}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = state.get("seed", self.seed)       # a stream re-cut to another part keeps its own (part_state)
        self._slots = {}
        for name, saved in state.get("slots", {}).items():
            slot = self._slots[name] = {}
            for k, v in saved.items():
                if isinstance(v, dict) and "bit_generator_state" in v:
                    rng = np.random.default_rng()
                    rng.bit_generator.state = v["bit_generator_state"]
                    v = rng
                slot[k] = v.copy() if isinstance(v, np.ndarray) else v   # never share buffers with the source

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self._slots[name]


class Codec(ABC):
    """Base class of the codecs. Subclasses are ``@dataclass(frozen=True, kw_only=True)`` whose fields are the
    parameters, registered with :func:`geomx.compression.registry.register`, and implement ``_encode`` /
    ``_decode`` on flat float32 vectors; this class handles shapes and dtypes."""

    name: ClassVar[str] = "?"            # set by @register
    has_own_memory: ClassVar[bool] = False
    biased: ClassVar[bool] = False
    sparsifying: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False

    # -- the interface ---------------------------------------------------------------------------------------

    def compress(self, x: np.ndarray, state: CodecState) -> Payload:
        """``x`` (any shape; converted to float32) -> payload. ``meta["shape"]`` records the shape."""
        x = np.asarray(x, dtype=np.float32)
        payload = self._encode(x.reshape(-1), x.shape, state)
        payload.meta["shape"] = list(x.shape)
        return payload

    def decompress(self, payload: Payload, *, scale: float = 1.0) -> np.ndarray:
        """payload -> dense float32 tensor of the original shape, times ``scale`` (a receiver multiplying back
        the count of workers whose mean was sent). A new array when ``scale`` != 1."""
        shape = tuple(payload.meta["shape"])
        return self._decode_scaled(payload, shape, scale).reshape(shape)

    def wire_bytes(self, payload: Payload) -> int:
        """Exact bytes of the payload's tensor frames (the header's meta is ``payload.header_nbytes``)."""
        return payload.payload_nbytes

    def wire_ratio(self, shape: tuple[int, ...]) -> float:
        """About how many times fewer bytes than float32 a tensor of ``shape`` crosses the wire in, for a
        large tensor (headers left out): what parts are sized by, so that a compressed part takes as long on
        a link as a dense one (geomx.kvstore.partition). 1 where a codec does not say."""
        return 1.0

    def subtract_decoded(self, payload: Payload, flat: np.ndarray) -> None:
        """``flat -= decompress(payload).reshape(-1)``, in place; sparse codecs override it to touch only the
        sent entries (error feedback calls it on every step)."""
        flat -= self._decode(payload, tuple(payload.meta["shape"]))

    def downlink(self) -> Codec:
        """The codec a server uses for what it sends back (bidirectional compression): the codec itself,
        unless part of it belongs to the senders of gradients only (DGC's momentum)."""
        return self

    @property
    def contractive(self) -> bool:
        """||x - decompress(compress(x))|| < ||x|| on average, what error feedback needs: fed back, the error of a
        codec that is not can grow without bound. True unless a codec says otherwise."""
        return True

    @property
    def needs_error_feedback(self) -> bool:
        """Wrap this codec in ErrorFeedback: it is biased and keeps no residual itself."""
        return self.biased and not self.has_own_memory

    def spec(self) -> dict[str, Any]:
        """The plain dict that :func:`~geomx.compression.registry.make_codec` turns back into this codec."""
        return {"type": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}

    # -- what subclasses implement -----------------------------------------------------------------------------

    @abstractmethod
    def _encode(self, flat: np.ndarray, shape: tuple[int, ...], state: CodecState) -> Payload:
        """Flat float32 vector (and the original shape, for codecs that need it) -> payload."""

    @abstractmethod
    def _decode(self, payload: Payload, shape: tuple[int, ...]) -> np.ndarray:
        """Payload -> flat float32 vector of ``prod(shape)`` elements."""

    def _decode_scaled(self, payload: Payload, shape: tuple[int, ...], scale: float) -> np.ndarray:
        """``_decode`` times ``scale``; a codec that can scale fewer values than it decodes overrides it."""
        flat = self._decode(payload, shape)
        return flat * np.float32(scale) if scale != 1 else flat


def index_dtype(n: int) -> np.dtype:
    """int32 indices while they fit (n < 2**31), else int64."""
    return np.dtype(np.int32) if n < 2 ** 31 else np.dtype(np.int64)
