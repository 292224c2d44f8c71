"""Which codec each tensor uses on each tier: the user's compression setting, parsed once on the master
worker and sent to every server as a plain dict (``to_wire`` / ``from_wire``).

Accepted forms (``kv.set_gradient_compression(...)``):

* GeoMX's dict forms:

  - ``{"type": "bsc", "threshold": 0.01}``: LAN dense fp32, WAN ``bsc`` (GeoMX compresses only between local
    and global servers). ``"momentum": 0.9`` adds GeoMX's DGC-style momentum correction (``dgc`` with that
    momentum at ratio ``threshold``); then train the workers without momentum of their own. Any other
    sparsifier or quantizer given this way (``{"type": "dgc", ...}``, ``{"type": "onebit"}``, ...) is likewise
    applied on the WAN only.
  - ``{"type": "fp16"}`` (or ``"bf16"``): 16-bit dense on both tiers.
  - ``{"type": "mpq", "threshold": r, "size_lower_bound": n}``: mixed precision. Tensors with fewer than n
    elements travel fp16 dense on both tiers; larger ones fp32 dense on the LAN and ``bsc`` (ratio r) on
    the WAN.
  - ``{"type": "none"}``, ``"none"`` or ``None``: no compression.

* per tier: ``{"lan": "fp16", "wan": {"type": "dgc", "ratio": 0.001}, "small": "fp16",
  "size_lower_bound": n}``; a missing tier is ``none``; ``small`` (optional) is the codec for tensors below
  the bound on both tiers.

The size bound: tensors with fewer than ``size_lower_bound`` elements use the ``small`` codec if there is
one, else travel uncompressed where the tier's codec is a sparsifier (``topk``, ``bsc``, ``randomk``,
``dgc``: dropping entries of a bias vector saves nothing and hurts). The bound comes from the dict, else from
``MXNET_KVSTORE_SIZE_LOWER_BOUND``, else 200,000 elements (GeoMX's server default and its MPQ script's
default; its docs' 1000 is what its scripts set, not the default). Unlike GeoMX, one rule serves both tiers
(large means ``nelements >= bound``; GeoMX's workers used ``>`` and its servers ``>=``, so a tensor of exactly
``bound`` elements was sent fp16 and decoded as BSC), and the resolved bound travels in ``to_wire``, so
servers need not share the environment variable.

Which codecs need :class:`~geomx.compression.error_feedback.ErrorFeedback` is the codec's
``needs_error_feedback``; the policy only chooses codecs.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Hashable, Mapping

from geomx.compression.codec import Codec
from geomx.compression.registry import make_codec
from geomx.errors import ConfigError
from geomx.part_keys import part_count

SIZE_BOUND_ENV = "MXNET_KVSTORE_SIZE_LOWER_BOUND"
DEFAULT_SIZE_LOWER_BOUND = 200_000
TIERS = ("lan", "wan")
_DENSE_16 = ("fp16", "bf16")
_PER_TIER_KEYS = {"lan", "wan", "small", "size_lower_bound"}


def _canonical(spec) -> dict[str, Any]:
    """A codec spec with every parameter spelled out (validated by building the codec)."""
    return make_codec(spec).spec()


@dataclass(kw_only=True)
class CompressionPolicy:
    """Canonical codec specs per tier, the size bound, and memoized codec instances."""

    lan: dict[str, Any]
    wan: dict[str, Any]
    size_lower_bound: int = DEFAULT_SIZE_LOWER_BOUND
    small: dict[str, Any] | None = None
    _codecs: dict[str, Codec] = field(default_factory=dict, compare=False, repr=False)

    def codec_for(self, tier: str, key: Hashable, nelements: int) -> Codec:
        """The codec for a key of ``nelements`` on ``tier`` ("lan" or "wan"). The rules depend on the tier and
        the size of the key's tensor only. The instance is shared by every key with the same spec (per-key
        memory lives in CodecState).

        The size bound is about tensors, not about the parts a large one travels in: a part of ``n``
        (``"k#i/n"``, geomx.kvstore.partition) counts as a tensor of ``n`` times its own elements. Every process
        reads that from the key and the part's shape alone, so a worker and the servers choose the same codec
        for it. Every part but the last holds the same number of elements, so for them it is the tensor's size
        to within one part; the last part may hold fewer and may then count as a small tensor (only where the
        whole tensor is within a few parts of the bound). Judged by the part alone, a 256 KiB part (65,536
        elements) fell below the default bound of 200,000, so over links of 300 Mbit/s or less, where the
        launcher cuts parts that small, sparsifiers sent every large tensor dense."""
        if tier not in TIERS:
            raise ConfigError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        codec = self._codec(getattr(self, tier))
        if nelements * part_count(key) < self.size_lower_bound:
            if self.small is not None:
                return self._codec(self.small)
            if codec.sparsifying:
                return self._codec({"type": "none"})
        return codec

    def to_wire(self) -> dict[str, Any]:
        """A plain (msgpack-able) dict; :meth:`from_wire` rebuilds an equal policy."""
        return {"lan": self.lan, "wan": self.wan, "small": self.small, "size_lower_bound": self.size_lower_bound}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> CompressionPolicy:
        if not isinstance(wire, Mapping) or set(wire) != _PER_TIER_KEYS:
            raise ConfigError(f"a compression policy on the wire has exactly the keys "
                              f"{sorted(_PER_TIER_KEYS)}, got {wire!r}")
        return cls(lan=_canonical(wire["lan"]), wan=_canonical(wire["wan"]),
                   small=None if wire["small"] is None else _canonical(wire["small"]),
                   size_lower_bound=_check_bound(wire["size_lower_bound"], "size_lower_bound"))

    def _codec(self, spec: dict[str, Any]) -> Codec:
        memo = json.dumps(spec, sort_keys=True)
        if memo not in self._codecs:
            self._codecs[memo] = make_codec(spec)
        return self._codecs[memo]


def parse_policy(spec: dict | str | None, *, env: Mapping[str, str] | None = None) -> CompressionPolicy:
    """The policy for a user's compression setting (forms in the module docstring). ``env`` defaults to
    ``os.environ`` (read for ``MXNET_KVSTORE_SIZE_LOWER_BOUND`` only)."""
    if isinstance(spec, CompressionPolicy):
        return spec
    if spec is None or isinstance(spec, str):
        spec = {"type": spec or "none"}
    if not isinstance(spec, dict):
        raise ConfigError(f"gradient compression must be a dict, a codec name or None, got {spec!r}")
    params = dict(spec)
    bound = _check_bound(params.pop("size_lower_bound"), "size_lower_bound") if "size_lower_bound" in params \
        else env_size_bound(os.environ if env is None else env)
    if "type" not in params:
        return _per_tier(params, bound)
    kind = str(params.pop("type")).lower()
    if kind == "mpq":
        return CompressionPolicy(lan=_canonical("none"), wan=_bsc(params), small=_canonical("fp16"),
                                 size_lower_bound=bound)
    codec = _bsc(params) if kind == "bsc" else _canonical({"type": kind, **params})
    lan = codec if kind in _DENSE_16 else _canonical("none")
    return CompressionPolicy(lan=lan, wan=codec, size_lower_bound=bound)


def _bsc(params: dict[str, Any]) -> dict[str, Any]:
    """GeoMX's Bi-Sparse. With ``momentum`` (GeoMX uses 0.9) it is DGC's momentum correction plus the sampled
    selection, i.e. ``dgc`` without clipping or warm-up; without, the selection with error feedback."""
    params = dict(params)
    momentum = params.pop("momentum", 0.0)
    if not momentum:
        return _canonical({"type": "bsc", **params})
    unknown = sorted(set(params) - {"threshold", "sample_ratio"})
    if unknown:
        raise ConfigError(f"bsc codec: unknown parameter(s) {', '.join(map(repr, unknown))} with momentum; "
                          f"accepted: momentum, sample_ratio, threshold")
    return _canonical({"type": "dgc", "ratio": params.get("threshold", 0.01), "momentum": momentum,
                       **({"sample_ratio": params["sample_ratio"]} if "sample_ratio" in params else {})})


def _per_tier(params: dict[str, Any], bound: int) -> CompressionPolicy:
    unknown = sorted(set(params) - _PER_TIER_KEYS)
    if unknown or not params.keys() & {"lan", "wan"}:
        raise ConfigError(f"gradient compression: give {{'type': ...}} or per-tier codecs with keys "
                          f"{sorted(_PER_TIER_KEYS)}; got {params!r}")
    small = params.get("small")
    return CompressionPolicy(lan=_canonical(params.get("lan", "none")), wan=_canonical(params.get("wan", "none")),
                             small=None if small is None else _canonical(small), size_lower_bound=bound)


def _check_bound(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{what} must be an integer >= 0 (elements), got {value!r}")
    return value


def env_size_bound(env: Mapping[str, str]) -> int:
    text = env.get(SIZE_BOUND_ENV)
    if text is None or not text.strip():
        return DEFAULT_SIZE_LOWER_BOUND
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{SIZE_BOUND_ENV} must be an integer number of elements, got {text!r}") from None
    return _check_bound(value, SIZE_BOUND_ENV)
