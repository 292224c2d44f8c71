"""Wire format of one message: a msgpack header frame followed by raw tensor frames.

Tensors never go through pickle: the header lists each tensor's dtype and shape, and each tensor's bytes
travel as one frame (sent zero-copy by the van). A message is what every higher layer exchanges:

    Message(op="push", src=<node id>, fields={"key": 3, ...}, tensors=[np.ndarray, ...], priority=0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import msgpack
import numpy as np
import zmq

from geomx.errors import ProtocolError
from geomx.transport.ids import public_name

# dtypes allowed on the wire; anything else is refused by name
WIRE_DTYPES = {"float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int32", "int64", "bool"}
_NAMES = {np.dtype(name): name for name in WIRE_DTYPES}     # dtype.name is computed in Python on every call


@dataclass
class Message:
    op: str
    src: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: list[np.ndarray] = field(default_factory=list)
    priority: int = 0
    # set by a receiving van when the tensors are buffers of this message alone (received off a socket, not the
    # sender's arrays, nor a caller's output): a handler may then accumulate into them instead of copying
    private: bool = False

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            raise ProtocolError(f"message {self.op!r} from {public_name(self.src)!r} lacks field {name!r}") from None


def encode(msg: Message) -> list:
    """Message -> list of frames (bytes header, then the tensors' buffers, not copied)."""
    specs = []
    frames: list = [b""]
    for t in msg.tensors:
        arr = np.ascontiguousarray(t)
        if not arr.dtype.isnative:          # the header names the dtype without a byte order: send native
            arr = arr.astype(arr.dtype.newbyteorder("="))
        specs.append((_NAMES.get(arr.dtype) or arr.dtype.name, list(arr.shape)))
        frames.append(_wire_frame(arr) if arr.size else b"")
    header = {"op": msg.op, "src": msg.src, "p": msg.priority, "f": msg.fields, "t": specs}
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def _wire_frame(arr: np.ndarray):
    """What to send for a contiguous array: the received ZeroMQ frame itself when the array is all of one
    (a server answering with a push it kept as received), which libzmq shares by reference count, instead
    of a view of its memory, which pyzmq's zero-copy bookkeeping releases through its collector thread."""
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    # a C-contiguous view as large as the frame it lies in is all of that frame
    if isinstance(base, memoryview) and isinstance(base.obj, zmq.Frame) and base.nbytes == arr.nbytes:
        return base.obj
    return memoryview(arr.reshape(-1).view(np.uint8))


def frame_buffer(frame) -> memoryview:
    """The bytes of a frame as received or about to be sent (zmq.Frame, bytes, memoryview, array)."""
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode_header(frame) -> dict:
    """The header frame -> its map, checked: an ``op`` string, ``t`` a list of valid (dtype, shape) specs,
    ``f`` a map. Raises ProtocolError on anything malformed."""
    try:
        header = msgpack.unpackb(frame_buffer(frame), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack ({exc.__class__.__name__})") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("header is not a geomx message header")
    specs = header.get("t") or []
    if not isinstance(specs, list):
        raise ProtocolError("header tensor list is not a list")
    header["t"] = [_spec(s) for s in specs]
    fields = header.get("f") or {}
    if not isinstance(fields, dict):
        raise ProtocolError("header fields are not a map")
    header["f"] = fields
    return header


MAX_DIMENSIONS = 32


def _spec(spec) -> tuple[np.dtype, tuple[int, ...]]:
    try:
        dtype_name, shape = spec
        if dtype_name not in WIRE_DTYPES:
            raise ProtocolError(f"dtype {dtype_name!r} is not allowed on the wire")
        shape = tuple(int(s) for s in shape)
        if len(shape) > MAX_DIMENSIONS:     # numpy refuses more, with an error no receive loop expects
            raise ProtocolError(f"a tensor of {len(shape)} dimensions (at most {MAX_DIMENSIONS})")
        if any(s < 0 for s in shape):
            raise ProtocolError(f"negative dimension in shape {shape}")
        return np.dtype(dtype_name), shape
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"bad tensor spec {spec!r}: {exc}") from None


def build_message(header: dict, frames: Sequence) -> Message:
    """A checked header (:func:`decode_header`) and its tensor frames -> Message. A frame may already be the
    numpy array the tensor was received into (see ``Van.receive_into``); it is used as it is."""
    specs = header["t"]
    if len(specs) != len(frames):
        raise ProtocolError(f"header announces {len(specs)} tensors but {len(frames)} frames followed")
    tensors = []
    for (dtype, shape), frame in zip(specs, frames, strict=False):
        count = math.prod(shape)
        if isinstance(frame, np.ndarray):
            if frame.dtype != dtype or frame.shape != shape:
                raise ProtocolError(f"tensor received into a {frame.dtype} {frame.shape} buffer, header says "
                                    f"{dtype} {shape}")
            tensors.append(frame)
            continue
        buf = frame_buffer(frame)
        if count * dtype.itemsize != buf.nbytes:
            raise ProtocolError(f"tensor of shape {shape} {dtype.name} needs {count * dtype.itemsize} bytes, "
                                f"frame has {buf.nbytes}")
        try:
            tensors.append(np.frombuffer(buf, dtype=dtype, count=count).reshape(shape) if count
                           else np.zeros(shape, dtype=dtype))
        except (ValueError, OverflowError) as exc:     # an empty shape numpy cannot hold ((0, 2**70))
            raise ProtocolError(f"tensor of shape {shape} {dtype.name}: {exc}") from None
    prio = header.get("p", 0)
    return Message(op=header["op"], src=str(header.get("src", "")), fields=header["f"], tensors=tensors,
                   priority=int(prio) if isinstance(prio, int) else 0)


def decode(frames: Sequence) -> Message:
    """Frames (bytes or zmq.Frame) -> Message. Raises ProtocolError on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    return build_message(decode_header(frames[0]), frames[1:])


def payload_nbytes(frames: Sequence) -> int:
    """Bytes a message occupies on the wire (header + tensor frames)."""
    return sum(f.nbytes if isinstance(f, np.ndarray) else frame_buffer(f).nbytes for f in frames)
