"""Synchronization algorithms, each a policy object chosen by name (``geomx launch --sync``, the TOML ``sync``
table, ``GEOMX_SYNC`` / GeoMX's ``MXNET_KVSTORE_USE_HFA``), registered in one table
(:data:`geomx.sync.settings.REGISTRY`), never a branch spread through the servers:

* ``fsa`` (default) and MixedSync (``--mode dist_async``): gradients pushed from backward hooks
  (:mod:`geomx.sync.fsa`), the servers' update policies (geomx.cluster.global_update); ``geomx.optim.DCASGD``
  compensates MixedSync's delays there;
* ``hfa``, ``diloco``: model averaging run by each worker (:mod:`geomx.sync.averaging`);
* ``dga``: delayed gradient averaging, run by each worker (:mod:`geomx.sync.dga`);
* ``esync``: per-worker local steps from measured step times (:mod:`geomx.sync.esync`);
* ``p3`` (GeoMX's ``ENABLE_P3=1``): FSA with the servers' optimizer whose next forward pass waits layer by layer
  (:mod:`geomx.sync.p3`);
* ``--slowdown``: emulated slow workers (:mod:`geomx.sync.slowdown`).

A policy has ``setup(kv, params, num_samples=)``, ``step(optimizer, compute_s=) -> seconds waited``,
``state_dict()`` / ``load_state_dict()``, and optionally ``finish()`` and ``progress``. Which algorithms
combine with which mode, topology and server optimizer is geomx.compat's table.

Importing this package does not import torch (the launcher validates configurations with it).
"""
from __future__ import annotations

import importlib
import os

from geomx.errors import ConfigError
from geomx.sync.settings import (ALGORITHMS, REGISTRY, SYNC_ENV, SyncSettings, check_backward_passes, chosen_by,
                                 launch_env, settings_from_env)

__all__ = ["ALGORITHMS", "DGA", "FSA", "P3", "ESync", "HFA", "DiLoCo", "SyncSettings", "create", "launch_env",
           "settings_from_env"]


def create(spec=None, *, backward_passes_per_step: int | None = None):
    """The worker-side policy for ``DistributedOptimizer``: ``spec`` is None (read the environment), a name
    (options from the environment, which must name that algorithm or none), or an object with
    ``setup(kv, params, num_samples=)`` and ``step(optimizer, compute_s=) -> seconds waited`` (used as is, its
    options its own; a registered algorithm's object must be the one the environment names, if it names one).
    ``backward_passes_per_step``: FSA's gradient
    accumulation (the other algorithms step on every step() call); None: the policy object's own, or 1. An object
    keeps its own: a different value given here is refused, naming both."""
    if backward_passes_per_step is not None:
        check_backward_passes(backward_passes_per_step)
    if spec is not None and not isinstance(spec, str):
        if not (callable(getattr(spec, "setup", None)) and callable(getattr(spec, "step", None))):
            raise ConfigError(f"sync must be an algorithm name or an object with setup() and step(), not "
                              f"{type(spec).__name__}")
        _check_own_passes(spec, backward_passes_per_step)
        _check_object_matches_launch(spec)
        return spec
    passes = 1 if backward_passes_per_step is None else backward_passes_per_step
    settings = settings_from_env()
    if spec is not None:
        if spec not in ALGORITHMS:
            raise ConfigError(f"unknown synchronization algorithm {spec!r}; algorithms: {', '.join(ALGORITHMS)}")
        if spec != settings.algorithm:
            var = chosen_by()
            if var is not None:
                # the launcher checked, and reports, the algorithm it was given with its options, which another
                # algorithm's defaults would silently drop
                raise ConfigError(f"sync={spec!r} (DistributedOptimizer, geomx.sync.create) differs from the "
                                  f"deployment's {settings.algorithm} ({_chosen(var)}), whose options it would drop: "
                                  f"launch with --sync {spec} (and its options) instead, or leave sync= out to run "
                                  f"{settings.algorithm}")
            settings = SyncSettings(algorithm=spec)
    from geomx.compat import check
    check(sync=settings.algorithm, backward_passes_per_step=passes)
    options = settings.options()
    if REGISTRY[settings.algorithm].accumulates:
        options["backward_passes_per_step"] = passes
    return policy_class(settings.algorithm)(**options)


def _check_object_matches_launch(policy) -> None:
    """A registered algorithm's object under a deployment that names another: the launcher checked, configured
    the servers for, and reports the algorithm it was given (its options the object's own are, as documented)."""
    name, var = getattr(policy, "name", None), chosen_by()
    if name not in ALGORITHMS or var is None:
        return
    deployment = settings_from_env().algorithm
    if name != deployment:
        raise ConfigError(f"sync={policy!r} runs {name}, but the deployment runs {deployment} ({_chosen(var)}): "
                          f"launch with --sync {name}, or leave sync= out")


def _chosen(var: str) -> str:
    """The variable that chose the deployment's algorithm, as a refusal names it."""
    by_launch = ", which geomx launch --sync sets" if var == SYNC_ENV else ""
    return f"{var}={os.environ[var]!r}{by_launch}"


def _check_own_passes(policy, passes: int | None) -> None:
    """A policy object built with its own backward_passes_per_step (FSA, P3) sums that many passes: one given to
    DistributedOptimizer beside it had been recorded there and silently not used."""
    if passes is None:
        return
    own = getattr(policy, "backward_passes_per_step", None)
    if own is None:
        if passes != 1:
            from geomx.compat import check
            name = getattr(policy, "name", None)
            check(sync=name, backward_passes_per_step=passes)       # a registered algorithm's own words
            raise ConfigError(f"backward_passes_per_step={passes}, but sync={policy!r} takes no "
                              f"backward_passes_per_step: it steps on every step() call")
    elif own != passes:
        raise ConfigError(f"backward_passes_per_step={passes} was given to DistributedOptimizer, but its "
                          f"sync={policy!r} sums backward_passes_per_step={own}: give it in one place, the policy's "
                          f"({type(policy).__name__}(backward_passes_per_step={passes})), and leave "
                          f"DistributedOptimizer's out")


def policy_class(algorithm: str) -> type:
    entry = REGISTRY[algorithm]
    return getattr(importlib.import_module(entry.module), entry.cls)


def __getattr__(name):
    for algorithm, entry in REGISTRY.items():
        if entry.cls == name:
            return policy_class(algorithm)
    raise AttributeError(f"module 'geomx.sync' has no attribute {name!r}")
