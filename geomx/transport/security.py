"""Authentication and encryption of every link (CurveZMQ), keyed by one shared secret.

WAN links cross the public internet: with ``GEOMX_SECRET`` set (``geomx launch --secure`` makes one per run),
every socket runs CurveZMQ. Both key pairs are derived from the secret, so a peer that does not know it can
neither complete a handshake (it does not know the servers' public key, and the ZAP handler admits only the
derived client key) nor read the traffic (every message is encrypted and authenticated).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading

import zmq
import zmq.utils.z85

from geomx.errors import ConfigError

log = logging.getLogger("geomx.security")

_MIN_SECRET_CHARS = 16
_auth_lock = threading.Lock()
_authenticators: dict[int, object] = {}


def _keypair(secret: str, purpose: str) -> tuple[bytes, bytes]:
    raw = hashlib.sha256(f"geomx-curve-{purpose}\0{secret}".encode()).digest()
    secret_key = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


class Curve:
    """The key pairs of one deployment; apply them to sockets with :meth:`server` and :meth:`client`."""

    def __init__(self, secret: str) -> None:
        if len(secret) < _MIN_SECRET_CHARS:
            raise ConfigError(f"GEOMX_SECRET must have at least {_MIN_SECRET_CHARS} characters (got {len(secret)})")
        if not zmq.has("curve"):
            raise ConfigError("GEOMX_SECRET is set but this libzmq was built without CURVE support")
        self.server_public, self.server_secret = _keypair(secret, "server")
        self.client_public, self.client_secret = _keypair(secret, "client")

    @classmethod
    def from_env(cls, env=None) -> Curve | None:
        env = os.environ if env is None else env
        secret = env.get("GEOMX_SECRET")
        if not secret and env.get("GEOMX_SECRET_FILE"):
            try:
                with open(env["GEOMX_SECRET_FILE"]) as f:
                    secret = f.read().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read GEOMX_SECRET_FILE {env['GEOMX_SECRET_FILE']}: {exc}") from None
        return cls(secret) if secret else None

    def server(self, sock: zmq.Socket) -> None:
        """Make a listening socket a CURVE server that admits only holders of the secret."""
        self._ensure_authenticator(sock.context)
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret

    def _ensure_authenticator(self, ctx: zmq.Context) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        with _auth_lock:
            if id(ctx) in _authenticators:
                return
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("geomx.security.zap"))
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(self.client_public))
            _authenticators[id(ctx)] = auth


class _OnlyKey:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.key
        if not ok:
            log.warning("refused a connection whose CURVE key is not derived from this deployment's secret")
        return ok
