"""Synchronization algorithms, each a policy object chosen by name (``geomx launch --sync``, the TOML ``sync``
table, ``GEOMX_SYNC`` / GeoMX's ``MXNET_KVSTORE_USE_HFA``), never a branch spread through the servers:

* ``fsa`` (default) and MixedSync (``--mode dist_async``): gradients, the servers' update policies
  (geomx.cluster.global_update); ``geomx.optim.DCASGD`` compensates MixedSync's delays there;
* ``hfa``, ``diloco``: model averaging run by each worker (:mod:`geomx.sync.averaging`);
* ``dga``: delayed gradient averaging, run by each worker (:mod:`geomx.sync.dga`);
* ``esync``: per-worker local steps from measured step times (:mod:`geomx.sync.esync`);
* ``--slowdown``: emulated slow workers (:mod:`geomx.sync.slowdown`).

Importing this package does not import torch (the launcher validates configurations with it).
"""
from __future__ import annotations

from geomx.errors import ConfigError
from geomx.sync.settings import ALGORITHMS, SyncSettings, launch_env, settings_from_env

__all__ = ["ALGORITHMS", "DGA", "ESync", "HFA", "DiLoCo", "SyncSettings", "create", "launch_env", "settings_from_env"]


def create(spec=None):
    """The worker-side algorithm for ``DistributedOptimizer``: ``spec`` is None (read the environment), a name
    (options from the environment), or an object with ``setup(kv, params, num_samples=)`` and
    ``step(optimizer, compute_s=) -> seconds waited`` (used as is). Returns None for FSA/MixedSync, where workers push
    gradients from backward hooks."""
    if spec is not None and not isinstance(spec, str):
        if not (callable(getattr(spec, "setup", None)) and callable(getattr(spec, "step", None))):
            raise ConfigError(f"sync must be an algorithm name or an object with setup() and step(), not "
                              f"{type(spec).__name__}")
        return spec
    settings = settings_from_env()
    if spec is not None:
        if spec not in ALGORITHMS:
            raise ConfigError(f"unknown synchronization algorithm {spec!r}; algorithms: {', '.join(ALGORITHMS)}")
        if spec != settings.algorithm:
            settings = SyncSettings(algorithm=spec)
    if settings.algorithm == "fsa":
        return None
    return getattr(_module(settings.algorithm), _CLASSES[settings.algorithm])(**settings.options())


_CLASSES = {"hfa": "HFA", "diloco": "DiLoCo", "dga": "DGA", "esync": "ESync"}


def _module(algorithm: str):
    import importlib
    return importlib.import_module({"dga": "geomx.sync.dga", "esync": "geomx.sync.esync"}.get(
        algorithm, "geomx.sync.averaging"))


def __getattr__(name):
    for algorithm, cls in _CLASSES.items():
        if cls == name:
            return getattr(_module(algorithm), name)
    raise AttributeError(f"module 'geomx.sync' has no attribute {name!r}")
