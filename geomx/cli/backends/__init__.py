"""Where ``geomx launch`` runs a deployment's roles: the engine behind the launcher.

A backend places each planned role (geomx.cli.launch.RoleSpec) somewhere, starts it with its environment, streams
its output into the run directory and lets the launcher poll, signal and stop it through a ``RoleHandle``. The
launcher's policies (fault domains, injected faults, teardown) are the same on every backend.

- ``local``: every role a child process of the launcher on this machine (the default).
- ``ray``: every role a process started by a Ray actor on a node that carries its DC's label
  (geomx.cli.backends.ray_engine; ``pip install "geomx[ray]"``).
"""
from __future__ import annotations

from collections.abc import Callable

from geomx.cli.backends.base import Backend, RoleHandle, Sites
from geomx.cli.backends.local import LocalBackend
from geomx.errors import ConfigError


def _ray(**options) -> Backend:
    from geomx.cli.backends.ray_engine import RayBackend
    return RayBackend(**options)


def _local(**options) -> Backend:
    given = [k for k, v in options.items() if v is not None]
    if given:
        raise ConfigError(f"--backend local takes no engine options (got {', '.join(given)})")
    return LocalBackend()


BACKENDS: dict[str, Callable[..., Backend]] = {"local": _local, "ray": _ray}


def make_backend(name: str, **options) -> Backend:
    """The backend registered as ``name``, built with ``options`` (e.g. ray's ``address``)."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown --backend {name!r}; backends: {', '.join(BACKENDS)}") from None
    return factory(**options)


__all__ = ["BACKENDS", "Backend", "LocalBackend", "RoleHandle", "Sites", "make_backend"]
