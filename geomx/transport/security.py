"""Who may connect and who may read: with one shared secret, AES-GCM on every message (the default) or
CurveZMQ; without one, ZeroMQ PLAIN (authenticated, not encrypted, keyed by a per-run token).

WAN links cross the public internet: with ``GEOMX_SECRET`` set (``geomx launch --secure`` makes one per run),
every message is encrypted and authenticated.

* ``GEOMX_ENCRYPTION=aes-gcm`` (default): :class:`Sealed`, see :mod:`geomx.transport.sealing`. Each message
  is sealed under its sender's key derived from the secret; a message that does not open, or that was seen
  before, is dropped.
* ``GEOMX_ENCRYPTION=curve``: :class:`Curve`, every socket runs CurveZMQ. Both key pairs are derived from the
  secret, so a peer that does not know it can neither complete a handshake (it does not know the servers'
  public key, and the ZAP handler admits only the derived client key) nor read the traffic. Several times
  slower on large tensors (libzmq's cipher, and a copy per message).

Without a secret, ``geomx launch`` still authenticates every connection on its host: it makes a token per run
(``GEOMX_AUTH_TOKEN``) that every socket presents through ZeroMQ's PLAIN mechanism. PLAIN sends the token in
clear once per connection, which on one host's loopback only root can read; it costs a handshake per
connection and nothing per message. Across hosts, use ``GEOMX_SECRET``.

Either way, a refused connection is logged, rate-limited. The listening side's ZAP handler logs a wrong PLAIN
token (under AES-GCM: another secret) with the peer's address, once per address, and the connecting side logs
that its credentials were refused. A handshake that fails before the ZAP handler is asked is seen only by
ZeroMQ's socket monitors (:class:`HandshakeLog`): a CurveZMQ hello under another secret by the listening side,
which names its own address, not the peer's; another mechanism (GEOMX_ENCRYPTION, or a secret or token on one
side only) by whichever side reads the other's greeting first, at the latest by the connecting side, which
retries until it does. ZeroMQ tells the application nothing, so a member that waits for its scheduler also
names a mismatch among the likely causes when it gives up (:func:`mismatch_hint`).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
import time

import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from geomx.errors import ConfigError

log = logging.getLogger("geomx.security")

_MIN_SECRET_CHARS = 16
_auth_lock = threading.Lock()
_authenticators: dict[int, list] = {}   # id(context) -> [its ZAP handler, server sockets still using it]
_ZAP_BIND_S = 2.0


def read_secret(env) -> str | None:
    """The deployment's secret: GEOMX_SECRET, else the content of GEOMX_SECRET_FILE, else None."""
    secret = env.get("GEOMX_SECRET")
    if not secret and env.get("GEOMX_SECRET_FILE"):
        try:
            with open(env["GEOMX_SECRET_FILE"]) as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read GEOMX_SECRET_FILE {env['GEOMX_SECRET_FILE']}: {exc}") from None
    return secret or None


def _check_secret(secret: str) -> None:
    if len(secret) < _MIN_SECRET_CHARS:
        raise ConfigError(f"GEOMX_SECRET must have at least {_MIN_SECRET_CHARS} characters (got {len(secret)})")


def _keypair(secret: str, purpose: str) -> tuple[bytes, bytes]:
    raw = hashlib.sha256(f"geomx-curve-{purpose}\0{secret}".encode()).digest()
    secret_key = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


class Curve:
    """The key pairs of one deployment; apply them to sockets with :meth:`server` and :meth:`client`."""

    label = "CurveZMQ with GEOMX_SECRET (GEOMX_ENCRYPTION=curve)"

    def __init__(self, secret: str, *, max_age_s: float | None = None) -> None:
        # max_age_s (Sealed's replay limit across restarts) has nothing to bound here: every CurveZMQ connection
        # agrees fresh session keys, so a recorded stream opens in no later one
        _check_secret(secret)
        if not zmq.has("curve"):
            raise ConfigError("GEOMX_SECRET is set but this libzmq was built without CURVE support")
        self.server_public, self.server_secret = _keypair(secret, "server")
        self.client_public, self.client_secret = _keypair(secret, "client")

    @classmethod
    def from_env(cls, env=None) -> Curve | None:
        secret = read_secret(os.environ if env is None else env)
        return cls(secret) if secret else None

    def server(self, sock: zmq.Socket) -> None:
        """Make a listening socket a CURVE server that admits only holders of the secret."""
        _ensure_authenticator(sock.context, lambda auth: auth.configure_curve_callback(
            domain="*", credentials_provider=_OnlyKey(self.client_public)))
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def release(self, ctx: zmq.Context) -> None:
        """The socket given to :meth:`server` has closed."""
        _release_authenticator(ctx)

    def sealing(self, node_id: str) -> None:
        """Curve encrypts inside libzmq: messages need no sealing of their own."""
        return None

    def client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


class Plain:
    """A per-run token that every connection presents (ZeroMQ PLAIN): authentication without encryption."""

    USER = "geomx"
    label = "the PLAIN token of GEOMX_AUTH_TOKEN"

    def __init__(self, token: str) -> None:
        if len(token) < _MIN_SECRET_CHARS:
            raise ConfigError(f"GEOMX_AUTH_TOKEN must have at least {_MIN_SECRET_CHARS} characters (got {len(token)})")
        self.token = token

    def server(self, sock: zmq.Socket) -> None:
        _ensure_authenticator(sock.context, lambda auth: auth.configure_plain(domain="*",
                                                                             passwords={self.USER: self.token}))
        sock.plain_server = True

    def release(self, ctx: zmq.Context) -> None:
        """The socket given to :meth:`server` has closed."""
        _release_authenticator(ctx)

    def sealing(self, node_id: str) -> None:
        return None

    def client(self, sock: zmq.Socket) -> None:
        sock.plain_username = self.USER.encode()
        sock.plain_password = self.token.encode()


class Sealed:
    """AES-256-GCM on every frame of every message, keyed by the secret (geomx.transport.sealing); connections
    admitted by a PLAIN token derived from the secret."""

    label = "AES-GCM with GEOMX_SECRET (GEOMX_ENCRYPTION=aes-gcm)"

    def __init__(self, secret: str, *, max_age_s: float | None = None) -> None:
        _check_secret(secret)
        from geomx.transport.sealing import MAX_AGE_S, derive

        self._master = derive(secret.encode(), "geomx-aead-master")
        self._plain = Plain(derive(secret.encode(), "geomx-plain-token").hex())
        self._max_age_s = MAX_AGE_S if max_age_s is None else max_age_s

    def server(self, sock: zmq.Socket) -> None:
        self._plain.server(sock)

    def release(self, ctx: zmq.Context) -> None:
        self._plain.release(ctx)

    def client(self, sock: zmq.Socket) -> None:
        self._plain.client(sock)

    def sealing(self, node_id: str):
        from geomx.transport.sealing import MessageSeal

        return MessageSeal(self._master, node_id, max_age_s=self._max_age_s)


# GEOMX_ENCRYPTION: how links that hold a secret are encrypted
ENCRYPTIONS = {"aes-gcm": Sealed, "curve": Curve}
DEFAULT_ENCRYPTION = "aes-gcm"


ENCRYPTION_LABELS = {"aes-gcm": "AES-GCM", "curve": "CurveZMQ"}


def encryption_of(env) -> str:
    """How a role holding a secret encrypts its links: GEOMX_ENCRYPTION, AES-GCM by default (checked where the
    role's security is built, secret_security)."""
    return env.get("GEOMX_ENCRYPTION") or DEFAULT_ENCRYPTION


def secret_security(secret: str, encryption: str | None = None, *, max_age_s: float | None = None) -> Sealed | Curve:
    """The protection a deployment with ``secret`` runs: GEOMX_ENCRYPTION's choice, AES-GCM by default
    (``max_age_s``: its GEOMX_SEAL_MAX_AGE_S; CurveZMQ's fresh keys per connection need none)."""
    name = encryption or DEFAULT_ENCRYPTION
    if name not in ENCRYPTIONS:
        raise ConfigError(f"GEOMX_ENCRYPTION={name!r} is not one of {sorted(ENCRYPTIONS)}")
    return ENCRYPTIONS[name](secret, max_age_s=max_age_s)


def seal_max_age(env) -> float:
    """GEOMX_SEAL_MAX_AGE_S: how long before a node started a sealed message may have been sealed. By default
    geomx.transport.sealing.MAX_AGE_S, or GEOMX_CONNECT_TIMEOUT where that is longer: a member's registration,
    sent once, may wait that long for a scheduler that starts late, and must then still open."""
    from geomx.transport.sealing import MAX_AGE_S

    raw = env.get("GEOMX_SEAL_MAX_AGE_S")
    if not raw:
        try:
            connect = float(env.get("GEOMX_CONNECT_TIMEOUT") or 0)
        except ValueError:      # named where the node's configuration is read (geomx.config)
            connect = 0.0
        return max(connect, MAX_AGE_S)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"GEOMX_SEAL_MAX_AGE_S={raw!r} is not a number of seconds > 0")
    return value


def link_security(env=None) -> Sealed | Curve | Plain | None:
    """What protects a node's links: with GEOMX_SECRET/GEOMX_SECRET_FILE, AES-GCM on every message (or CurveZMQ
    with GEOMX_ENCRYPTION=curve); else PLAIN with GEOMX_AUTH_TOKEN (geomx launch sets it); else nothing."""
    env = os.environ if env is None else env
    secret = read_secret(env)
    if secret:
        return secret_security(secret, env.get("GEOMX_ENCRYPTION"), max_age_s=seal_max_age(env))
    token = env.get("GEOMX_AUTH_TOKEN")
    return Plain(token) if token else None


NO_SECURITY = "no security (neither GEOMX_SECRET nor GEOMX_AUTH_TOKEN)"


def label_of(security) -> str:
    """What protects links, as messages name it: the protection and the variables that chose it."""
    return NO_SECURITY if security is None else security.label


def mismatch_hint(security, peer: str) -> str:
    """Why ``peer`` may never answer beyond not running, for a message that says so: a handshake under another
    secret, mechanism or token fails, and ZeroMQ retries it without a word to the application."""
    if security is None:
        return (f"Or does it run with GEOMX_SECRET or GEOMX_AUTH_TOKEN? This side has neither, so {peer} refuses "
                f"its connections (its log, or a warning above, says so).")
    return (f"Or does it hold another secret or encryption? This side used {security.label}; a handshake under "
            f"another GEOMX_SECRET, GEOMX_ENCRYPTION or GEOMX_AUTH_TOKEN fails without an answer, and {peer}'s "
            f"log (or a warning above) names it.")


_HANDSHAKE_ERRORS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        "the peer uses another security mechanism (GEOMX_ENCRYPTION differs, or only one side has GEOMX_SECRET "
        "or GEOMX_AUTH_TOKEN)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "its CurveZMQ handshake does not decrypt (the peer holds another "
                                           "GEOMX_SECRET)",
}
# what a socket monitor reports of a failed handshake; a connection closed mid-handshake (a port scan, the doctor's
# reachability check, or the peer that saw the mismatch first) says nothing and is left out
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def handshake_failure(event: dict) -> str | None:
    """Why a handshake failed, from a socket monitor's event (see ``HANDSHAKE_FAILED``); None for another event."""
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _HANDSHAKE_ERRORS.get(event["value"], f"ZMTP protocol error {event['value']:#x}")
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the peer refused this side's credentials (status {event['value']}: another GEOMX_SECRET, or "
                f"another GEOMX_AUTH_TOKEN)")
    return None


class HandshakeLog:
    """Logs the handshakes that fail where ZeroMQ tells no one else, rate-limited per address.

    Another mechanism (GEOMX_ENCRYPTION, or a secret or token on one side only) is found by whichever side reads
    the other's greeting first; the other side sees only a closed connection, and the connecting side retries
    until it is the one that finds it. A CurveZMQ hello under another secret is found by the listening side
    only, at every retry. So both sides log: :meth:`listen` watches a listening socket (its ZAP handler logs its
    own refusals, with the peer's address; ZeroMQ's monitor names only the listening address) and
    :meth:`connecting` takes the events of a connection this side made (geomx.transport.connection_watch)."""

    def __init__(self, security) -> None:
        self._label = label_of(security)
        self._refusals = _refusal_log()
        self.socket: zmq.Socket | None = None

    def listen(self, sock: zmq.Socket) -> None:
        """Watch ``sock``, before it binds (a peer of another mechanism may not try twice). Poll :attr:`socket`
        on the thread that reads ``sock``, call :meth:`read` when it is readable, and :meth:`close` before
        closing ``sock``."""
        try:
            # a name of our own, as in connection_watch: pyzmq's default reuses a closed socket's descriptor
            self.socket = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                                  addr=f"inproc://geomx-handshakes-{secrets.token_hex(8)}")
        except zmq.ZMQError as exc:     # logging is a courtesy: the socket works the same without it
            log.debug("handshake failures will not be logged: %s", exc)

    def read(self) -> None:
        while self.socket is not None:
            try:
                event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return
            reason = handshake_failure(event)
            if reason is not None:
                endpoint = event["endpoint"].decode("utf-8", "replace")
                self._refusals.note(f"connections to {endpoint}", "refused a connection on %s: %s; this side runs %s",
                                    endpoint, reason, self._label)

    def connecting(self, addr: str, event: dict) -> None:
        """A monitor event of this side's connection to ``addr``."""
        reason = handshake_failure(event)
        if reason is not None:
            self._refusals.note(addr, "the handshake with %s failed: %s; this side runs %s", addr, reason,
                                self._label)

    def close(self, sock: zmq.Socket) -> None:
        """Stop watching ``sock`` (the listening socket, still open)."""
        if self.socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self.socket.close(linger=0)
            self.socket = None


def _ensure_authenticator(ctx: zmq.Context, configure) -> None:
    """One ZAP handler per context (ZeroMQ asks it about every new connection to a server socket), told what
    this socket admits (PLAIN passwords and CURVE keys are kept apart, so one handler serves both)."""
    with _auth_lock:
        entry = _authenticators.get(id(ctx))
        if entry is None:
            entry = _authenticators[id(ctx)] = [_start_authenticator(ctx), 0]
        entry[1] += 1
        configure(entry[0])


def _start_authenticator(ctx: zmq.Context) -> _LoggingAuthenticator:
    """A started ZAP handler. Its endpoint (one per context) may still be held for a moment by the handler just
    stopped (ZeroMQ closes sockets in the background): the bind is tried again for up to ``_ZAP_BIND_S``."""
    deadline = time.monotonic() + _ZAP_BIND_S
    while True:
        auth = _LoggingAuthenticator(ctx, log=logging.getLogger("geomx.security.zap"))
        try:
            auth.start()
            return auth
        except zmq.ZMQError as exc:
            if auth.zap_socket is not None:     # created, not bound: it would keep the context from terminating
                auth.zap_socket.close(linger=0)
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _release_authenticator(ctx: zmq.Context) -> None:
    """A server socket of ``ctx`` has closed; stop the ZAP handler once none is left. The handler holds sockets of
    its own, and a context with open sockets never terminates: left running, it kept every process alive for
    seconds after its work was done (and the WAN emulator until the launcher killed it)."""
    with _auth_lock:        # held while it stops, so that a new server socket waits for a fresh handler
        entry = _authenticators.get(id(ctx))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _authenticators[id(ctx)]
        entry[0].stop()


def _refusal_log():
    from geomx.transport.refusals import RefusalLog

    return RefusalLog(log, burst=1)


class _LoggingAuthenticator(ThreadAuthenticator):
    """Logs each refused connection with the peer's address: once per address, then rate-limited."""

    refusals = None

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        self._mechanism = msg[5].decode("utf-8", "replace") if len(msg) > 5 else "?"
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous") -> None:
        if status_code != b"200":
            if self.refusals is None:
                self.refusals = _refusal_log()
            address = getattr(self, "_address", "?")
            self.refusals.note(address, "refused a %s connection from %s: %s (it lacks this deployment's secret)",
                               getattr(self, "_mechanism", "?"), address, status_text.decode("utf-8", "replace"))
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


class _OnlyKey:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key
