"""State saved per part of a tensor, re-cut for another cut of the same tensor.

How a tensor is cut into parts depends on the deployment: ``GEOMX_PARTITION_BYTES``, which the launcher sizes by
the slowest WAN link's rate, the codec's wire ratio (geomx.kvstore.partition.wire_part_bytes) and P3's slices. A
job resumed over another WAN, or with another codec, therefore cuts its tensors otherwise than the job that saved
the checkpoint, and the saved part keys (``"k#i/n"``) do not name its keys. What geomx keeps per part is
element-wise almost everywhere: a server optimizer's weights and moments, an error-feedback residual, DGC's
accumulators. Laid end to end in element order the saved parts' states are the whole tensor's, and any other cut
of it is a slice of that. What is not element-wise (a step counter, a random generator's state, a codec's seed)
is kept where every saved part agrees; where they differ the caller decides: an optimizer's state cannot go on
(:class:`NotRecuttable`), a compression stream starts that entry afresh.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from geomx.errors import ConfigError
from geomx.part_keys import is_part_key, split_part_key


class NotRecuttable(ValueError):
    """Saved parts disagree on something that is not element-wise."""


@dataclass(frozen=True)
class Piece:
    """One saved part: its key, its element range in the flattened tensor and what was saved of it."""
    key: Hashable
    start: int
    stop: int
    state: Any

    @property
    def size(self) -> int:
        return self.stop - self.start


def base_key(key: Hashable) -> Hashable:
    """The tensor's key of a part key (``"k#i/n"`` -> ``"k"``), or the key itself."""
    split = split_part_key(key)
    return split[0] if split else key


def saved_pieces(base: Hashable, shapes: Mapping[Hashable, tuple], states: Mapping[Hashable, Any]) -> list[Piece]:
    """The saved pieces of tensor ``base`` in element order: its whole key, or every part ``"base#j/m"``.
    ``shapes`` and ``states``: every saved key's shape and state. [] when nothing of ``base`` was saved; a
    ConfigError when its parts are incomplete or of two cuts."""
    whole = _saved_whole_key(base, shapes)
    if whole is not None:
        return [Piece(whole, 0, math.prod(shapes[whole]), states[whole])]
    parts: dict[int, dict[int, Hashable]] = {}
    for key in shapes:
        split = split_part_key(key)
        if split and split[0] == str(base):
            parts.setdefault(split[2], {})[split[1]] = key
    if not parts:
        return []
    if len(parts) > 1:
        raise ConfigError(f"the saved state holds tensor {base!r} cut in {sorted(parts)} parts at once")
    (n, found), = parts.items()
    missing = sorted(set(range(n)) - set(found))
    if missing:
        raise ConfigError(f"the saved state of tensor {base!r} lacks part(s) {missing} of {n}")
    pieces, start = [], 0
    for i in range(n):
        size = math.prod(shapes[found[i]])
        pieces.append(Piece(found[i], start, start + size, states[found[i]]))
        start += size
    return pieces


def _saved_whole_key(base: Hashable, shapes: Mapping[Hashable, tuple]) -> Hashable | None:
    """The key under which tensor ``base`` was saved whole. A part key names its tensor as text (``7`` travels as
    ``"7#0/2"``), so the tensor of an integer key, saved whole, is looked up under both spellings."""
    spellings = [base, str(base)]
    if isinstance(base, str) and base.lstrip("-").isdigit():
        spellings.append(int(base))
    return next((key for key in spellings if key in shapes and not is_part_key(key)), None)


def part_range(key: Hashable, shape: tuple, total: int) -> tuple[int, int]:
    """Where part ``key`` (of ``shape``) lies in the flattened tensor of ``total`` elements that
    geomx.kvstore.partition.plan_parts cut: every part but the last holds the same number of elements. A whole
    key spans the tensor."""
    size = math.prod(shape)
    _, i, n = split_part_key(key) or (key, 0, 1)
    start = total - size if i == n - 1 else i * size
    if start < 0 or (n == 1 and start) or start + size > total or (i < n - 1 and -(-total // size) != n):
        raise ConfigError(f"key {key!r} of shape {tuple(shape)} is no part of the saved tensor of {total} "
                          f"elements")
    return start, start + size


def _element_wise(leaves: list, pieces: list[Piece]) -> bool:
    return all(isinstance(leaf, np.ndarray) and leaf.size == p.size for leaf, p in zip(leaves, pieces, strict=True))


def _same(leaves: list) -> bool:
    first = leaves[0]
    if isinstance(first, np.ndarray):
        return all(isinstance(x, np.ndarray) and x.shape == first.shape and np.array_equal(x, first)
                   for x in leaves[1:])
    return all(type(x) is type(first) and x == first for x in leaves[1:])


OMIT = object()      # what a conflict handler returns to leave an entry out


def recut(pieces: list[Piece], start: int, stop: int, shape: tuple, *, shaped: bool,
          conflict: Callable[[str], Any] | None = None, states: list | None = None) -> Any:
    """The state of elements ``start:stop`` of the tensor, from its saved ``pieces`` (their ``state`` trees, or
    ``states`` in their place): every array that holds one value per element of its piece is laid end to end and
    sliced (in ``shape`` when ``shaped``, else flat); every other leaf must be the same in every piece. Where it
    is not, ``conflict(path)`` gives the value (:data:`OMIT`: leave the entry out); without ``conflict``,
    NotRecuttable names the path."""
    return _recut([p.state for p in pieces] if states is None else states, pieces, start, stop, shape, shaped,
                  conflict, "")


def _recut(nodes: list, pieces, start, stop, shape, shaped, conflict, path: str) -> Any:
    first = nodes[0]
    if isinstance(first, dict) and all(isinstance(n, dict) and n.keys() == first.keys() for n in nodes):
        out = {}
        for k in first:
            value = _recut([n[k] for n in nodes], pieces, start, stop, shape, shaped, conflict, f"{path}/{k}")
            if value is not OMIT:
                out[k] = value
        return out
    if isinstance(first, (list, tuple)) and all(type(n) is type(first) and len(n) == len(first) for n in nodes):
        items = [_recut([n[i] for n in nodes], pieces, start, stop, shape, shaped, conflict, f"{path}/{i}")
                 for i in range(len(first))]
        return type(first)(x for x in items if x is not OMIT)
    if _element_wise(nodes, pieces):
        whole = np.concatenate([np.asarray(n).reshape(-1) for n in nodes])
        piece = whole[start - pieces[0].start:stop - pieces[0].start].copy()
        return piece.reshape(shape) if shaped else piece
    if _same(nodes):
        return first
    if conflict is None:
        raise NotRecuttable(f"the saved parts differ at {path or '/'}, which is not one value per element")
    return conflict(path)


def recut_stream(pieces: list[Piece], start: int, stop: int) -> dict | None:
    """A compression stream's state (geomx.cluster.compressed.Stream.state_dict) for elements ``start:stop``:
    its error-feedback residual and element-wise codec memory re-cut, counters kept where the pieces agree, and
    its seed and random generators left to the new stream's own (a piece's generator continued in every new
    part would repeat its draws there). None when a piece kept no stream or the pieces used different codecs:
    the stream starts afresh."""
    if any(p.state is None for p in pieces) or len({p.state.get("codec") for p in pieces}) != 1:
        return None
    states = [_without_randomness(p.state) for p in pieces]
    return recut(pieces, start, stop, (stop - start,), shaped=False, conflict=lambda _path: OMIT, states=states)


def _without_randomness(stream: dict) -> dict:
    codec_state = stream["codec_state"]
    slots = {name: {k: v for k, v in slot.items() if not (isinstance(v, dict) and "bit_generator_state" in v)}
             for name, slot in codec_state["slots"].items()}
    return {**stream, "codec_state": {"slots": slots}}
