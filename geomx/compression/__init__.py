"""Gradient compression codecs for geomx's two tiers (docs/compression.md says which to pick).

    from geomx.compression import make_codec, ErrorFeedback, CodecState
    codec = make_codec({"type": "topk", "ratio": 0.001})
    ef, state = ErrorFeedback(codec=codec), CodecState(seed=0)
    payload = ef.compress("fc1.weight", grad, state)       # arrays -> tensor frames, meta -> header
    dense = codec.decompress(payload)                       # on the receiver

Modules: ``codec`` (the interface, Payload, CodecState), ``registry`` (names -> codecs, parameter checks),
``codecs`` (the family), ``error_feedback`` (residual memory, apart from the codecs), ``policy`` (the user's
setting -> a codec per tier and tensor size).
"""
from geomx.compression.codec import Codec, CodecState, Payload
from geomx.compression.error_feedback import ErrorFeedback
from geomx.compression.policy import CompressionPolicy, parse_policy
from geomx.compression.registry import CODECS, make_codec, register
from geomx.compression import codecs as _codecs  # noqa: F401,E402  (registers the family in CODECS)

__all__ = ["CODECS", "Codec", "CodecState", "CompressionPolicy", "ErrorFeedback", "Payload", "make_codec",
           "parse_policy", "register"]
