"""Error feedback (residual memory), kept apart from the codecs so that any biased codec can use it.

Per key: send ``compress(x + residual)`` and keep ``residual = (x + residual) - decompress(payload)``. Nothing
is lost, only delayed: after T steps, the sum of what was transmitted plus the final residual equals the sum
of the inputs (up to float32 rounding). With it, top-k, random-k and sign compression converge at SGD's rate
(Stich et al. 2018, Karimireddy et al. 2019).

Use it on every sender of a biased codec (``codec.needs_error_feedback``): workers, and servers that
re-compress what they send back (bidirectional compression). Cost: one float32 buffer of N entries per key.
The codec must be contractive, ||x - decompress(compress(x))|| < ||x|| on average: every sparsifier and
``onebit`` are; ``qsgd`` only with levels^2 >= bucket_size, ``terngrad`` not (their residual would grow
without bound).
Codecs that keep their own memory (``dgc``, ``powersgd``) are refused: their residual would be counted twice.
"""
from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from geomx.compression.codec import Codec, CodecState, Payload
from geomx.errors import ConfigError


class ErrorFeedback:
    """Residuals of one codec, per key. ``compress(key, x, state)`` replaces ``codec.compress(x, state)``;
    the receiver decodes with ``codec.decompress`` as usual."""

    def __init__(self, *, codec: Codec, expanding: bool = False) -> None:
        """``expanding``: accept a codec that is not contractive. Only for the servers' weight-change streams,
        whose residual keeps each replica on the servers' weights: there a sampled codec's error stays bounded
        by what the next changes carry (tests/test_inproc.py), where a gradient residual would compound."""
        if codec.has_own_memory:
            raise ConfigError(f"{codec.name} keeps its own residual (has_own_memory); do not wrap it in "
                              f"ErrorFeedback")
        if not (codec.contractive or expanding):
            raise ConfigError(f"{codec.spec()} is not contractive: its error can exceed the signal, and a residual "
                              f"fed back would grow without bound; do not wrap it in ErrorFeedback (qsgd: levels**2 "
                              f">= bucket_size)")
        self.codec = codec
        self._residual: dict[Hashable, np.ndarray] = {}

    def compress(self, key: Hashable, x: np.ndarray, state: CodecState) -> Payload:
        x = np.asarray(x, dtype=np.float32)
        residual = self._residual.get(key)
        if residual is not None and residual.size != x.size:
            raise ConfigError(f"error feedback for key {key!r}: the tensor has {x.size} elements, its residual "
                              f"{residual.size}; a key keeps its shape")
        # a fresh array either way: it becomes the new residual below
        corrected = x + residual.reshape(x.shape) if residual is not None else x.copy()
        payload = self.codec.compress(corrected, state)
        flat = corrected.reshape(-1)
        if any(np.may_share_memory(a, flat) for a in payload.arrays):
            flat = flat.copy()          # the payload is a view of corrected (e.g. "none"): keep it intact
        self.codec.subtract_decoded(payload, flat)
        self._residual[key] = flat
        return payload

    def residual(self, key: Hashable) -> np.ndarray | None:
        """The key's current residual (flat float32), or None before its first step."""
        return self._residual.get(key)

    def state_dict(self) -> dict:
        """The residuals, per key (flat float32 arrays)."""
        return {"residuals": dict(self._residual)}

    def load_state_dict(self, state: dict) -> None:
        self._residual = {key: np.array(r, dtype=np.float32) for key, r in state["residuals"].items()}   # copies
