"""Wire format of one message: a msgpack header frame followed by raw tensor frames.

Tensors never go through pickle: the header lists each tensor's dtype and shape, and each tensor's bytes
travel as one frame (sent zero-copy by the van). A message is what every higher layer exchanges:

    Message(op="push", src=<node id>, fields={"key": 3, ...}, tensors=[np.ndarray, ...], priority=0)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

from geomx.errors import ProtocolError

# dtypes allowed on the wire; anything else is refused by name
WIRE_DTYPES = {"float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int32", "int64", "bool"}


@dataclass
class Message:
    op: str
    src: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: list[np.ndarray] = field(default_factory=list)
    priority: int = 0

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            raise ProtocolError(f"message {self.op!r} from {self.src!r} lacks field {name!r}") from None


def encode(msg: Message) -> list:
    """Message -> list of frames (bytes header, then the tensors' buffers, not copied)."""
    specs = []
    frames: list = [b""]
    for t in msg.tensors:
        arr = np.ascontiguousarray(t)
        specs.append((arr.dtype.name, list(arr.shape)))
        frames.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else b"")
    header = {"op": msg.op, "src": msg.src, "p": msg.priority, "f": msg.fields, "t": specs}
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def _buffer(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode(frames: Sequence) -> Message:
    """Frames (bytes or zmq.Frame) -> Message. Raises ProtocolError on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgpack.unpackb(_buffer(frames[0]), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack ({exc.__class__.__name__})") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("header is not a geomx message header")
    specs = header.get("t") or []
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError(f"header announces {len(specs) if isinstance(specs, list) else '?'} tensors "
                            f"but {len(frames) - 1} frames followed")
    tensors = []
    for spec, frame in zip(specs, frames[1:]):
        try:
            dtype_name, shape = spec
            if dtype_name not in WIRE_DTYPES:
                raise ProtocolError(f"dtype {dtype_name!r} is not allowed on the wire")
            dtype = np.dtype(dtype_name)
            shape = tuple(int(s) for s in shape)
            buf = _buffer(frame)
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if count * dtype.itemsize != buf.nbytes:
                raise ProtocolError(f"tensor of shape {shape} {dtype_name} needs {count * dtype.itemsize} bytes, "
                                    f"frame has {buf.nbytes}")
            tensors.append(np.frombuffer(buf, dtype=dtype, count=count).reshape(shape) if count
                           else np.zeros(shape, dtype=dtype))
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"bad tensor spec {spec!r}: {exc}") from None
    fields = header.get("f") or {}
    if not isinstance(fields, dict):
        raise ProtocolError("header fields are not a map")
    prio = header.get("p", 0)
    return Message(op=header["op"], src=str(header.get("src", "")), fields=fields, tensors=tensors,
                   priority=int(prio) if isinstance(prio, int) else 0)


def payload_nbytes(frames: Sequence) -> int:
    """Bytes a message occupies on the wire (header + tensor frames)."""
    return sum(_buffer(f).nbytes for f in frames)
