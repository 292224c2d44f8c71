"""The names of a large tensor's parts on the servers (geomx.kvstore.partition cuts it): part ``i`` of ``n`` of
key ``k`` is the key ``"k#i/n"``. Kept apart from the kvstore so that the compression policy, which every
server runs too, can read a part's count without importing the kvstore."""
from __future__ import annotations

import re
from collections.abc import Hashable

_PART_KEY = re.compile(r"^(.*)#(\d+)/(\d+)$", re.DOTALL)


def part_key(key, i: int, n: int) -> str:
    return f"{key}#{i}/{n}"


def split_part_key(key: Hashable) -> tuple[str, int, int] | None:
    """``(k, i, n)`` for the part key ``"k#i/n"``; None for any other key."""
    match = _PART_KEY.match(key) if isinstance(key, str) else None
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else None


def is_part_key(key: Hashable) -> bool:
    return split_part_key(key) is not None


def part_count(key: Hashable) -> int:
    """How many parts the tensor of ``key`` travels in: ``n`` for a part key, else 1."""
    split = split_part_key(key)
    return split[2] if split else 1
