"""Helpers shared by the training scripts that the kvstore tests launch and by the tests themselves.

A script finds this module through ``sys.path`` (the conftest prepends this folder to every script it
writes). Gradients are a pure function of (seed, worker index, step, key), so a test can recompute every
worker's gradient and know the exact expected result.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import numpy as np


def run_dir() -> Path:
    return Path(os.environ["GEOMX_RUN_DIR"])


def worker_index() -> int:
    """Global index 0..N-1 of a training worker (-1 on the master worker)."""
    return int(os.environ.get("GEOMX_WORKER_INDEX", "-1"))


def _key_id(key) -> int:
    return zlib.crc32(repr(key).encode())


def grad(seed: int, index: int, step: int, key, shape, dtype="float32", integer: bool = False) -> np.ndarray:
    """The gradient worker ``index`` pushes for ``key`` at ``step``."""
    rng = np.random.default_rng([seed, index + 1, step, _key_id(key)])
    if integer:
        return rng.integers(-50, 51, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def value(tag: int, key, shape, dtype="float32") -> np.ndarray:
    """An init value; ``tag`` tells the master's (0) from each worker's (index + 1)."""
    rng = np.random.default_rng([7777, tag, _key_id(key)])
    return rng.standard_normal(shape).astype(dtype)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def dump(name: str, obj) -> None:
    """Write ``obj`` as JSON to <run dir>/<name>.json."""
    _atomic_write(run_dir() / f"{name}.json", lambda p: p.write_text(json.dumps(obj)))


def save(name: str, arrays: dict) -> None:
    """Write arrays to <run dir>/<name>.npz (names are strings)."""
    def write(p: Path) -> None:
        with open(p, "wb") as f:
            np.savez(f, **arrays)
    _atomic_write(run_dir() / f"{name}.npz", write)


def wait_for_file(path: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.05)
