"""Gradient compression on the wire: a client encodes its pushes and decodes replies, a server decodes
pushes and encodes replies. The codecs themselves are ``geomx.compression`` (numpy only, imports nothing from
this layer); this module decides which stream of values each codec instance and its memory serve.

What travels where (docs/compression.md has the user's view):

* **Push** (client -> server): the client's gradient, ``compress``-ed with the tier's codec for the key
  (error feedback on the client for biased codecs; DGC and PowerSGD keep their own memory). A sender that
  pushes the sum of ``count`` workers (a local server) sends the mean and the receiver multiplies back, so
  16-bit codecs never overflow on a sum (PyTorch's ``fp16_compress_hook`` divides first for the same
  reason). The server decodes to dense float32 and sums in fp32.
* **Reply** (server -> client), the bidirectional half, with the tier's codec's ``downlink`` form (DGC's
  momentum belongs to the workers, so its downlink is the sparsifier alone). Every stream is an *increment*
  stream with memory, so nothing the server holds is dropped for good, only delayed:

  - the mean gradient of a synchronous round (no server optimizer): one stream per key, encoded once per
    round and sent to every client (they must all apply the same gradient);
  - gradients in ``dist_async`` (each client reads what was applied since its last read): one stream per
    key and client;
  - weights (server optimizer): one stream per key and client carrying the weight *change* since that
    client's last reply; the client adds it to its replica. Without compression the weights travel whole. In
    synchronous rounds these streams share the key's seed, so the clients of a round, served the same
    changes, hold the same weights.

  A value the client already holds (the init value, a pull before any push) travels dense.

Compressed messages carry ``cm = {"c": codec name, "m": codec meta, "n": count}`` in their fields and the
payload's arrays as tensors; uncompressed ones are unchanged (zero-copy). Only float32 and float16 keys are
compressed.
"""
from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from geomx.cluster.protocol import Field
from geomx.compression import Codec, CodecState, CompressionPolicy, ErrorFeedback, Payload
from geomx.part_state import recut_stream, saved_pieces

CODEC_FIELD = Field.CODEC


class WireError(ValueError):
    """A compressed payload that cannot be decoded (wrong codec, shape, indices)."""


def compressible(dtype: np.dtype) -> bool:
    """float32 and float16 keys; float64 is a user's request for precision (and carries the bookkeeping of
    geomx.sync), integers are counts: both travel as they are."""
    return np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float16))


def _seed(key: Hashable, salt: str) -> int:
    # from names, not addresses: a synchronous run with sampled codecs repeats exactly
    return zlib.crc32(f"{salt}/{key!r}".encode())


def dense_push(value: np.ndarray, count: int, dtype: np.dtype) -> tuple[list[np.ndarray], dict]:
    """An uncompressed push in the key's dtype. A sum (fp32) of ``count`` workers for a 16-bit key travels as
    their mean with ``n = count`` (the receiver multiplies back in fp32): 2 x 40000 overflows fp16, the mean
    does not."""
    if value.dtype == dtype:
        return [value], {}
    if count == 1 or not (np.issubdtype(dtype, np.floating) and np.dtype(dtype).itemsize < 4):
        return [value.astype(dtype)], {}         # integer sums stay exact sums
    return [np.divide(value, count, dtype=np.float32).astype(dtype)], {Field.COUNT: count}


def _sender_count(fields: dict) -> int:
    """How many workers' gradients a pushed mean stands for (1 without ``n``)."""
    count = fields.get(Field.COUNT, 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise WireError(f"bad sender count {count!r}")
    return count


def scale_dense(value: np.ndarray, fields: dict) -> np.ndarray:
    """The fp32 sum a :func:`dense_push` of a mean stands for (``value`` itself without ``n``)."""
    count = _sender_count(fields)
    return value if count == 1 else np.multiply(value, np.float32(count), dtype=np.float32)


class Stream:
    """Successive values of one key towards one receiver (or a group that applies the same values)."""

    def __init__(self, codec: Codec, seed: int, *, always_feedback: bool = False) -> None:
        self.codec = codec
        self.state = CodecState(seed=seed)
        # weight changes keep a residual even for unbiased codecs: a replica must not random-walk away
        feedback = codec.needs_error_feedback or (always_feedback and not codec.has_own_memory)
        self.feedback = ErrorFeedback(codec=codec, expanding=always_feedback) if feedback else None

    def encode(self, x: np.ndarray, count: int = 1) -> tuple[list[np.ndarray], dict[str, Any]]:
        if count != 1:
            x = np.multiply(x, np.float32(1.0 / count), dtype=np.float32)
        payload = (self.feedback.compress(0, x, self.state) if self.feedback is not None
                   else self.codec.compress(x, self.state))
        return payload.arrays, {CODEC_FIELD: {"c": self.codec.name, "m": payload.meta, "n": count}}

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.name, "codec_state": self.state.state_dict(),
                "feedback": self.feedback.state_dict() if self.feedback is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["codec"] != self.codec.name:
            raise ValueError(f"saved stream of codec {state['codec']!r} cannot continue as {self.codec.name!r}")
        self.state.load_state_dict(state.get("codec_state", {}))
        if self.feedback is not None and state.get("feedback") is not None:
            self.feedback.load_state_dict(state["feedback"])


@dataclass
class WireKeyState:
    """What a :class:`ServerWire` remembers of one key: the reply streams (codec memory, residuals) and what
    went to each client. Created by :meth:`ServerWire.key_state`, which supplies the stream factories."""
    new_down: Callable[[], Stream]                   # the round's stream (one for every client)
    new_client_stream: Callable[[str], Stream]       # a client's own stream (dist_async, weights)
    down: Stream | None = None
    down_sent: tuple | None = None                   # (value, arrays, fields): the round's reply, encoded once
    seen: dict[str, np.ndarray] = field(default_factory=dict)          # weights each client holds
    down_streams: dict[str, Stream] = field(default_factory=dict)      # per client

    def state_dict(self, value: np.ndarray | None) -> dict[str, Any]:
        """``value``: the key's current value; the encoded round reply is kept only if it is that value's."""
        sent = self.down_sent if self.down_sent is not None and self.down_sent[0] is value else None
        return {"down": self.down.state_dict() if self.down is not None else None,
                "down_sent": None if sent is None else {"arrays": list(sent[1]), "fields": sent[2]},
                "seen": {src: v for src, v in self.seen.items()},
                "down_streams": {src: s.state_dict() for src, s in self.down_streams.items()}}

    def shared_state_dict(self) -> dict[str, Any]:
        """What serves every client alike, copied (a checkpoint keeps it while the streams go on): the round's
        reply stream, its codec memory and residual. Not the per-client streams (geomx.cluster.server_checkpoint
        says why)."""
        return {"down": copy.deepcopy(self.down.state_dict()) if self.down is not None else None}

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        self.down = None
        if state["down"] is not None:
            self.down = self.new_down()
            self.down.load_state_dict(state["down"])

    def load_state_dict(self, state: dict[str, Any], value: np.ndarray | None) -> None:
        self.load_shared_state_dict(state)
        sent = state["down_sent"]
        self.down_sent = None if sent is None else (value, sent["arrays"], sent["fields"])
        # a client whose weights are the current value holds that very array (replies compare by identity)
        self.seen = {src: value if value is not None and np.array_equal(v, value) else v
                     for src, v in state["seen"].items()}
        self.down_streams = {}
        for src, saved in state["down_streams"].items():
            stream = self.down_streams[src] = self.new_client_stream(src)
            stream.load_state_dict(saved)


def decode(codec: Codec, cm: Any, tensors: list[np.ndarray], shape: tuple) -> np.ndarray:
    """A compressed payload -> dense float32 of ``shape``; WireError names what is wrong."""
    if not isinstance(cm, dict) or not isinstance(cm.get("m"), dict):
        raise WireError("malformed compression field")
    if cm.get("c") != codec.name:
        raise WireError(f"compressed with {cm.get('c')!r}, but the compression policy gives {codec.name!r}")
    meta, count = cm["m"], _sender_count(cm)
    sent_shape = meta.get("shape")
    if not isinstance(sent_shape, list) or tuple(sent_shape) != tuple(shape):
        raise WireError(f"compressed tensor has shape {sent_shape!r}, the key {tuple(shape)}")
    try:
        return codec.decompress(Payload(list(tensors), dict(meta)), scale=count)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise WireError(f"undecodable {codec.name} payload: {exc}") from None


class _Side:
    def __init__(self, policy: CompressionPolicy, tier: str, salt: str) -> None:
        self.policy, self.tier, self.salt = policy, tier, salt
        self._codecs: dict[Hashable, Codec | None] = {}

    def codec(self, key, shape, dtype) -> Codec | None:
        """The key's push codec on this tier, or None where it travels as it is."""
        try:
            return self._codecs[key]
        except KeyError:
            pass
        codec = None
        if compressible(np.dtype(dtype)):
            codec = self.policy.codec_for(self.tier, key, int(np.prod(shape, dtype=np.int64)))
        self._codecs[key] = codec = None if codec is None or codec.name == "none" else codec
        return codec


class ClientWire(_Side):
    """A client's half: encodes pushes, decodes replies (and keeps weight replicas where replies are
    weight changes). ``weights``: the servers answer with weights (a server optimizer runs)."""

    def __init__(self, policy: CompressionPolicy, tier: str, *, weights: bool, salt: str) -> None:
        super().__init__(policy, tier, salt)
        self.weights = weights
        self._push: dict[Hashable, Stream] = {}
        self._shapes: dict[Hashable, tuple[tuple, np.dtype]] = {}     # of each pushed key (to rebuild its codec)
        self._replica: dict[Hashable, np.ndarray] = {}

    def encode_push(self, key, value: np.ndarray, dtype: np.dtype, count: int = 1) -> tuple[list, dict]:
        """``value``: a gradient of the key (or an fp32 sum of ``count`` workers' gradients)."""
        codec = self.codec(key, value.shape, dtype)
        if codec is None:
            return dense_push(value, count, dtype)
        stream = self._push.get(key)
        if stream is None:
            stream = self._push[key] = Stream(codec, _seed(key, self.salt))
            self._shapes[key] = (tuple(value.shape), np.dtype(dtype))
        return stream.encode(value, count)

    def state_dict(self, *, replicas: bool = True) -> dict[str, Any]:
        """The push streams (codec memory, error-feedback residuals) and, with ``replicas``, the weight replicas,
        per key. A replica is the other half of its server's stream for this client: it restores only with
        that server's state (a worker's checkpoint leaves it out, geomx.cluster.server_checkpoint)."""
        state: dict[str, Any] = {"push": [[key, list(self._shapes[key][0]), self._shapes[key][1].str,
                                           stream.state_dict()] for key, stream in self._push.items()]}
        if replicas:
            state["replica"] = [[key, value] for key, value in self._replica.items()]
        return state

    def load_state_dict(self, state: dict[str, Any], *, cuts: Mapping | None = None) -> None:
        """``cuts``: tensor key -> its parts here, ``(key, start, stop, shape)`` each; a tensor whose saved
        streams name other parts (a checkpoint of a job that cut it otherwise) has them re-cut."""
        self._push = {}
        push = state["push"] if cuts is None else self._recut_push(state["push"], cuts)
        for key, shape, dtype, saved in push:
            codec = self.codec(key, tuple(shape), np.dtype(dtype))
            if codec is None:
                raise ValueError(f"saved push stream of key {key!r}, which travels uncompressed here")
            stream = self._push[key] = Stream(codec, _seed(key, self.salt))
            stream.load_state_dict(saved)
            self._shapes[key] = (tuple(shape), np.dtype(dtype))
        if "replica" in state:      # else the replicas stay those of the servers' init replies
            self._replica = {key: np.array(value) for key, value in state["replica"]}

    def _recut_push(self, push: list, cuts: Mapping) -> list:
        """The saved push streams for this process's cut of each tensor (geomx.part_state): the error-feedback
        residual a stream still owes the servers is carried into the parts that now hold its elements."""
        shapes = {key: tuple(shape) for key, shape, _, _ in push}
        states = {key: saved for key, _, _, saved in push}
        entries = {entry[0]: entry for entry in push}
        for base, parts in cuts.items():
            pieces = [] if all(key in shapes for key, *_ in parts) else saved_pieces(base, shapes, states)
            if not pieces:
                continue
            dtype = entries[pieces[0].key][2]
            for piece in pieces:
                del entries[piece.key]
            for key, start, stop, shape in parts:
                stream = recut_stream(pieces, start, stop)
                if stream is not None and self.codec(key, shape, np.dtype(dtype)) is not None:
                    entries[key] = [key, list(shape), dtype, stream]
        return list(entries.values())

    def note_dense(self, key, value: np.ndarray) -> None:
        """A dense value from the server (init): the replica that weight changes apply to."""
        if self.weights and self.codec(key, value.shape, value.dtype) is not None:
            self._replica[key] = value

    def decode_reply(self, key, fields: dict, tensors: list[np.ndarray], shape, dtype) -> np.ndarray:
        cm = fields.get(CODEC_FIELD)
        if cm is None:
            value = tensors[0]
            self.note_dense(key, value)
            return value
        codec = self.codec(key, shape, dtype)
        if codec is None:
            raise WireError(f"a compressed reply for key {key!r}, which travels uncompressed here")
        dense = decode(codec.downlink(), cm, tensors, shape)
        if self.weights:
            replica = self._replica.get(key)
            if replica is None:
                raise WireError(f"a weight change for key {key!r} before its weights")
            dense = np.add(replica, dense, dtype=np.float32)    # a new array: earlier results stay intact
            self._replica[key] = dense
        return dense.astype(dtype, copy=False)


class ServerWire(_Side):
    """A server's half: decodes pushes, encodes replies (see the module docstring for the streams).
    ``weights``: replies are weights; ``per_client``: each client reads its own values (dist_async).
    ``place_of``: a client's id -> its place in the tier, the same in every run (``NodeInfo.place``).

    Seeds, so that runs repeat and a synchronous job's workers hold one model: in ``dist_async`` a client's stream
    is seeded from its place (clients read values of their own); under a server optimizer in synchronous rounds
    every client's stream of a key has the key's seed, so clients served the same weights draw the same numbers and
    hold the same weights, and a synchronous round's mean is encoded on a stream of the key's and tier's seed, the
    same on every DC's local server, so every worker applies the same gradient (a seed per client had left workers
    of one synchronous job on models apart by what each one's codec had not yet delivered). Never from a process's
    id, which is random: no two runs were alike."""

    def __init__(self, policy: CompressionPolicy, tier: str, *, weights: bool, per_client: bool,
                 salt: str, place_of: Callable[[str], str]) -> None:
        super().__init__(policy, tier, salt)
        self.weights, self.per_client = weights, per_client or weights
        self.own_values = per_client
        self.place_of = place_of

    def decode_push(self, st, fields: dict, tensors: list[np.ndarray]) -> np.ndarray | None:
        """The dense float32 push, or None when it came uncompressed. Raises WireError."""
        cm = fields.get(CODEC_FIELD)
        if cm is None:
            return None
        codec = self.codec(st.key, st.shape, st.dtype)
        if codec is None:
            raise WireError(f"key {st.key!r} travels uncompressed ({st.describe()}), but the push is compressed")
        return decode(codec, cm, tensors, st.shape)

    def key_state(self, st) -> WireKeyState:
        """The key's (empty) wire state; its streams are made on first use."""
        codec = self.codec(st.key, st.shape, st.dtype)

        def new_down() -> Stream:
            # a synchronous round's mean: the key's and tier's seed alone, the same on every server of a tier, so
            # that every DC's local server encodes the global mean alike and all workers apply one gradient
            return Stream(codec.downlink(), _seed(st.key, f"mean/{self.tier}"))

        def new_client_stream(src: str) -> Stream:
            # synchronous weights: the key's and tier's seed alone, the same on every server of a tier (each DC's
            # local server relays the global server's weights to its workers: all DCs' workers draw alike)
            salt = f"{self.salt}/{self.place_of(src)}" if self.own_values else f"weights/{self.tier}"
            return Stream(codec.downlink(), _seed(st.key, salt), always_feedback=self.weights)

        return WireKeyState(new_down, new_client_stream)

    def _of(self, st) -> WireKeyState:
        if st.wire is None:
            st.wire = self.key_state(st)
        return st.wire

    def on_new_value(self, st, value: np.ndarray) -> None:
        """A synchronous round's mean gradient: encode it once for every client."""
        codec = self.codec(st.key, st.shape, st.dtype)
        if codec is None or self.per_client:
            return
        ws = self._of(st)
        if ws.down is None:
            ws.down = ws.new_down()
        ws.down_sent = (value, *ws.down.encode(value))

    def note_dense(self, st, src: str, value: np.ndarray) -> None:
        """``value`` went to ``src`` whole (init): weight changes for ``src`` start from it."""
        if self.weights:
            self._of(st).seen[src] = value

    def encode_reply(self, st, src: str, value: np.ndarray) -> tuple[list[np.ndarray], dict]:
        codec = self.codec(st.key, st.shape, st.dtype)
        if codec is None:
            return [value], {}
        ws = self._of(st)
        if not self.per_client or (not self.weights and value is st.value):
            # a round's mean gradient, encoded once by on_new_value; or the value the client already holds
            sent = ws.down_sent
            if sent is not None and sent[0] is value:
                return sent[1], sent[2]
            return [value], {}
        stream = ws.down_streams.get(src)
        if stream is None:
            stream = ws.down_streams[src] = ws.new_client_stream(src)
        if self.weights:
            seen = ws.seen
            last = seen.get(src)
            if last is None:                # no weights went to src yet: send them whole
                seen[src] = value
                return [value], {}
            seen[src] = value               # values are never mutated once set: a reference suffices
            value = np.subtract(value, last, dtype=np.float32)
        return stream.encode(value)
