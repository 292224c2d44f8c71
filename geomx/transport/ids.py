"""Node ids, and what of them may be shown.

A node's id carries 96 random bits (:func:`new_node_id`): the sender checks of every receiver rest on nobody
outside the deployment knowing it. Logs, error messages, thread names and metrics files are read by more users
than the processes are, so they show :func:`public_name` of an id, never the id.
"""
from __future__ import annotations

import secrets

_ID_HEX = 24
_SHOWN_CHARS = 64       # a stranger's claimed id or identity is shown at most this long


def new_node_id(prefix: str) -> str:
    """An id nobody can guess (96 random bits): the sender checks of every receiver rest on it."""
    return f"{prefix}-{secrets.token_hex(_ID_HEX // 2)}"


def public_name(node_id) -> str:
    """What logs, error messages, thread names and metrics files may show of an id: without the random part of
    a :func:`new_node_id`, which must stay unknown outside the deployment. Also takes a peer's ZeroMQ identity
    (bytes; a DEALER's is its node's id) and whatever a stranger claims as an id (any type or length)."""
    if isinstance(node_id, bytes | bytearray | memoryview):
        raw = bytes(node_id)
        node_id = raw.decode("utf-8", "replace")
        if not node_id.isprintable():       # ZeroMQ's own identity for a peer that set none: 0x00 + 4 bytes
            node_id = repr(raw)[2:-1]
    elif not isinstance(node_id, str):
        node_id = repr(node_id)
    head, _, tail = node_id.rpartition("-")
    name = head if head and len(tail) == _ID_HEX and all(c in "0123456789abcdef" for c in tail) else node_id
    return name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "..."
