"""Exceptions raised by geomx. Every message names the thing that is wrong (key, shape, role, DC, address)."""


class GeomxError(RuntimeError):
    """Base class of every error geomx raises on purpose."""


class ConfigError(GeomxError, ValueError):
    """Bad configuration: unknown mode or profile, missing environment variable, inconsistent topology."""


class KVError(GeomxError, KeyError):
    """A key-value request was refused (key not initialized, shape or dtype mismatch, ...)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class PeerLostError(GeomxError):
    """A peer stopped responding or the cluster was aborted; names the lost role, DC, rank and address."""


class DeadlineError(GeomxError, TimeoutError):
    """A wait reached its deadline without an answer."""


class ProtocolError(GeomxError):
    """A message that does not follow the wire protocol (logged and dropped by receivers)."""
