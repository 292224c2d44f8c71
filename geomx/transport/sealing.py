"""Sealed messages: every frame encrypted and authenticated with AES-256-GCM under keys derived from the
deployment's secret (``GEOMX_SECRET``; the default encryption, ``GEOMX_ENCRYPTION=aes-gcm``).

Why not CurveZMQ for the data: libzmq encrypts with a portable (non-AES-NI) cipher and copies every message,
so a 64 MiB round trip took 4.8x its plaintext time; AES-GCM with AES-NI runs at several GB/s per core
(``geomx bench transport --secure`` measures both). Connections are still admitted by a ZeroMQ PLAIN token,
derived from the secret so that it tells nothing about it, which keeps casual strangers off the sockets; the
real gate is per message:

* a message is ``[envelope, sealed header, sealed tensor frames...]``; the envelope names the sender's node id,
  a random salt of its process and a counter. The sender's key is derived from (secret, node id, salt), so a
  message opens only under the id it claims, and the header's ``src`` must equal that id;
* each frame's nonce is (counter, frame index): unique for the key, since the salt is fresh per process;
* the associated data binds the envelope, the frame index and the receiver's port: a frame cannot be moved
  to another message, another position or another node on another port;
* a counter seen before from the same sender process, or older than the last ``REPLAY_WINDOW`` of its
  counters, is refused: a recorded message cannot be played again. The window is not a strict order because
  the WAN emulator may overtake a low-priority message with a high-priority one;
* that window lives in the receiving process, so a process that starts afresh (a later run with the same secret
  and ports, or a role restarted within a run) has seen nothing. The envelope therefore carries when the message
  was sealed (the sender's clock), and a receiver refuses one sealed more than ``max_age_s`` before it started
  (``GEOMX_SEAL_MAX_AGE_S``, default ``MAX_AGE_S``; also how far two hosts' clocks may differ): a recording
  older than that cannot be played to a new process. What was sealed within ``max_age_s`` before a restart
  remains open to replay into the new process.

Anything that fails is a :class:`ProtocolError`; the van drops the message and logs it, rate-limited.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from geomx.errors import ProtocolError
from geomx.transport.ids import public_name
from geomx.transport.message import frame_buffer

TAG_BYTES = 16
REPLAY_WINDOW = 4096                 # counters per sender process accepted out of order
_SENDERS_KEPT = 1024                 # sender processes whose keys and windows are cached (LRU)
_SMALL = 64 * 1024                   # frames below this are sealed into fresh bytes, larger ones into arrays
MAX_AGE_S = 120.0                    # a message sealed longer than this before its receiver started is refused
_VERSION = 2
# version, the sender process's salt, counter, when it was sealed (ms of the sender's clock); then the sender id
_ENVELOPE = struct.Struct("!B8sQQ")
_MAX_ID = 256
_IN_PLACE = hasattr(AESGCM, "encrypt_into")   # cryptography >= 45: no ciphertext/plaintext copy of its own


def derive(secret: bytes, label: str) -> bytes:
    """A 32-byte key for ``label`` from the secret (HMAC-SHA256 as the PRF, one block of HKDF-Expand)."""
    return hmac.new(secret, label.encode(), hashlib.sha256).digest()


def _nonce(counter: int, index: int) -> bytes:
    return counter.to_bytes(8, "big") + index.to_bytes(4, "big")


def _aad(envelope: bytes, port: int, index: int) -> bytes:
    return envelope + port.to_bytes(2, "big") + index.to_bytes(4, "big")


def _port_of(addr: str) -> int:
    tail = addr.rpartition(":")[2]
    return int(tail) if tail.isdigit() and int(tail) < 65536 else 0


@dataclass
class _ReplayWindow:
    """Counters already accepted from one sender process: the highest, and those within the window below it."""
    highest: int = 0
    seen: set[int] = field(default_factory=set)

    def fresh(self, counter: int) -> bool:
        return counter > self.highest - REPLAY_WINDOW and counter not in self.seen

    def record(self, counter: int) -> None:
        self.seen.add(counter)
        if counter > self.highest:
            self.highest = counter
        if len(self.seen) > 2 * REPLAY_WINDOW:
            floor = self.highest - REPLAY_WINDOW
            self.seen = {c for c in self.seen if c > floor}


class Letter:
    """One received sealed message: open its frames in order, then :meth:`accept` it (records its counter)."""

    def __init__(self, aead: AESGCM, window: _ReplayWindow, envelope: bytes, counter: int, sender: str,
                 port: int, *, remember: Callable[[], None]) -> None:
        self._aead, self._window, self._envelope = aead, window, envelope
        self.counter, self.sender, self._port = counter, sender, port
        self._remember = remember

    def open(self, index: int, frame, *, into: np.ndarray | None = None):
        """The plaintext of frame ``index`` (0 = the header): bytes; for a tensor frame, ``into`` (an array of
        the plaintext's size, see ``Van.receive_into``) filled in place, or a fresh writable buffer."""
        data = frame_buffer(frame)
        if data.nbytes < TAG_BYTES:
            raise ProtocolError(f"sealed frame {index} from {public_name(self.sender)!r} is shorter than its tag")
        nonce, aad = _nonce(self.counter, index), _aad(self._envelope, self._port, index)
        try:
            if index == 0:
                return self._aead.decrypt(nonce, data, aad)
            size = data.nbytes - TAG_BYTES
            out = np.empty(size, np.uint8) if into is None else into.reshape(-1).view(np.uint8)
            if out.nbytes != size:
                raise ProtocolError(f"sealed tensor frame of {size} bytes, but the header announced {out.nbytes}")
            if size and _IN_PLACE:
                self._aead.decrypt_into(nonce, data, aad, out)
            else:
                out[:] = np.frombuffer(self._aead.decrypt(nonce, data, aad), np.uint8)
            return out.data if into is None else into     # a writable buffer, or the array received into
        except InvalidTag:
            raise ProtocolError(f"frame {index} of a message claiming to be from {public_name(self.sender)!r} does not "
                                f"authenticate (wrong secret, tampered, or meant for another node)") from None

    def accept(self) -> None:
        """The whole message opened: remember its counter so that it is never accepted again."""
        if not self._window.fresh(self.counter):
            raise ProtocolError(f"a replayed message from {public_name(self.sender)!r} (counter {self.counter})")
        self._window.record(self.counter)
        self._remember()


class MessageSeal:
    """One node's sealing: :meth:`seal` for what it sends, :meth:`letter` for what it receives. ``max_age_s``:
    a received message sealed longer than this before this object was made is refused; ``clock``: wall time in
    seconds (the sender's and the receiver's are compared, so not a monotonic one)."""

    def __init__(self, master: bytes, node_id: str, *, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not max_age_s > 0:
            raise ProtocolError(f"the age limit of sealed messages must be > 0 s, got {max_age_s}")
        self._master = master
        self._clock = clock
        self._max_age_s = max_age_s
        self._born = clock()
        self._salt = secrets.token_bytes(8)
        sender = node_id.encode()
        if len(sender) > _MAX_ID:
            raise ProtocolError(f"the node id of {public_name(node_id)!r} has {len(sender)} bytes, more than {_MAX_ID}")
        self._sender = sender
        self._aead = self._key(sender, self._salt)
        self._counter = itertools.count(1)
        self._peers: OrderedDict[tuple[bytes, bytes], tuple[AESGCM, _ReplayWindow]] = OrderedDict()

    def _key(self, sender: bytes, salt: bytes) -> AESGCM:
        return AESGCM(derive(self._master, "geomx-aead-sender\0" + sender.hex() + "\0" + salt.hex()))

    def seal(self, frames: list, addr: str) -> list:
        """The frames of one encoded message, sealed for the node listening at ``addr``. Call in send order
        (the counters then go out in order on each connection)."""
        counter = next(self._counter)
        envelope = _ENVELOPE.pack(_VERSION, self._salt, counter, int(self._clock() * 1000)) + self._sender
        port = _port_of(addr)
        out: list = [envelope]
        for index, frame in enumerate(frames):
            data = frame_buffer(frame)
            nonce, aad = _nonce(counter, index), _aad(envelope, port, index)
            if data.nbytes < _SMALL or not _IN_PLACE:
                out.append(self._aead.encrypt(nonce, data, aad))
            else:
                sealed = np.empty(data.nbytes + TAG_BYTES, np.uint8)
                self._aead.encrypt_into(nonce, data, aad, sealed)
                out.append(sealed)
        return out

    def letter(self, envelope_frame, port: int) -> Letter:
        """Read the envelope of a received message (the frame before its header) sent to this node's ``port``."""
        envelope = bytes(frame_buffer(envelope_frame))
        if len(envelope) <= _ENVELOPE.size or len(envelope) > _ENVELOPE.size + _MAX_ID:
            raise ProtocolError("a message without a valid sealed envelope (is the sender using this "
                                "deployment's GEOMX_SECRET and GEOMX_ENCRYPTION?)")
        version, salt, counter, sealed_ms = _ENVELOPE.unpack_from(envelope)
        if version != _VERSION:
            raise ProtocolError(f"sealed envelope version {version}, this node speaks {_VERSION}")
        sender = envelope[_ENVELOPE.size:]
        before_start = self._born - sealed_ms / 1000
        if before_start > self._max_age_s:      # a later time than the sender wrote would not open
            raise ProtocolError(
                f"a message from {public_name(sender)!r} sealed {before_start:.0f} s before this node "
                f"started: a recording of an earlier process played again, or the two hosts' clocks differ by more "
                f"than GEOMX_SEAL_MAX_AGE_S={self._max_age_s:g} s")
        # a sender process is cached only once one of its messages authenticated (Letter.accept): envelopes
        # from strangers cost a key derivation each but never push a real sender's window out of the cache
        peer = self._peers.get((sender, salt)) or (self._key(sender, salt), _ReplayWindow())
        name = sender.decode("utf-8", "replace")
        if not peer[1].fresh(counter):
            raise ProtocolError(f"a replayed message from {public_name(name)!r} (counter {counter})")
        return Letter(peer[0], peer[1], envelope, counter, name, port,
                      remember=lambda: self._remember((sender, salt), peer))

    def _remember(self, sender: tuple[bytes, bytes], peer: tuple[AESGCM, _ReplayWindow]) -> None:
        self._peers[sender] = peer
        self._peers.move_to_end(sender)
        if len(self._peers) > _SENDERS_KEPT:
            self._peers.popitem(last=False)
