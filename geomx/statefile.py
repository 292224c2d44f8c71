"""Saved state as bytes and files: msgpack with numpy arrays kept as arrays, never pickle.

What ``state_dict()`` methods return (plain dicts, lists, tuples, strings, numbers, None, numpy arrays; dict
keys may be ints or strings, as geomx keys are) round-trips exactly through :func:`dumps` / :func:`loads`:
an array comes back with its dtype, shape and bits, a tuple as a tuple, an integer beyond 64 bits (a numpy
generator's PCG64 state) as the same integer. Loading builds nothing but those values, so a file from
someone else cannot run code (unlike pickle or ``torch.load(weights_only=False)``).

:func:`save` writes atomically (a temporary file in the same directory, fsync, rename): a reader, or a
restart after a crash in the middle, sees the old file or the new one, never half of one.
"""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np

from geomx.errors import ConfigError

_ARRAY, _BIG_INT, _TUPLE = 1, 2, 3
_FORMAT = "geomx-state/1"


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("arrays of Python objects cannot be saved")
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_ARRAY, msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()],
                                                     use_bin_type=True))
    if isinstance(obj, np.generic):
        return _default(np.asarray(obj)) if not isinstance(obj, np.bool_) else bool(obj)
    if isinstance(obj, int):        # beyond 64 bits (msgpack's own ints stop there)
        return msgpack.ExtType(_BIG_INT, str(obj).encode())
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    raise TypeError(f"a {type(obj).__name__} cannot be saved in a state file (plain values and numpy arrays only)")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _ARRAY:
        dtype, shape, raw = msgpack.unpackb(data, raw=False)
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise ConfigError("state file holds an array of Python objects")
        # a writable copy: restored values are updated in place later (optimizer buffers, residuals)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if code == _BIG_INT:
        return int(data.decode())
    if code == _TUPLE:
        return tuple(_unpack(data))
    raise ConfigError(f"state file holds an unknown value type (msgpack ext {code})")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def dumps(state: Any) -> bytes:
    return _pack({"format": _FORMAT, "state": state})


def loads(data: bytes) -> Any:
    try:
        doc = _unpack(data)
    except (ValueError, msgpack.exceptions.ExtraData) as exc:
        raise ConfigError(f"not a geomx state file: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ConfigError(f"not a geomx state file (format {doc.get('format') if isinstance(doc, dict) else None!r},"
                          f" expected {_FORMAT!r})")
    return doc["state"]


def save(path: str | os.PathLike, state: Any) -> None:
    """Write ``state`` to ``path`` atomically (temporary file + rename)."""
    data = dumps(state)
    write_atomically(path, lambda f: f.write(data))


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, and rename it over ``path``: a reader
    sees the old file or the whole new one, never part of one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike) -> Any:
    with open(path, "rb") as f:
        return loads(f.read())


def numbered_files(directory: Path, pattern: re.Pattern) -> dict[int, list[int]]:
    """Checkpoint files in ``directory`` whose names ``pattern`` matches with two numbers, (owner, number):
    owner -> its numbers (a worker's steps, a global server's rounds)."""
    found: dict[int, list[int]] = {}
    for entry in directory.iterdir() if directory.is_dir() else ():
        m = pattern.match(entry.name)
        if m:
            found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return found
