"""geomx: train one PyTorch model across geographically distant data centers.

A hierarchical parameter server (HiPS): workers push to their DC's local server, local servers exchange DC
aggregates with the global servers over a slow WAN. See README.md and docs/architecture.md.
"""
from geomx import metrics
from geomx.errors import (ConfigError, DeadlineError, GeomxError, KVError, PeerLostError, ProtocolError)
from geomx.profiles import PROFILES, WanProfile, get_profile
from geomx.uncaught import run_main

__version__ = "0.1.0"

__all__ = ["ConfigError", "DCASGD", "DGA", "DeadlineError", "DiLoCo", "ESync", "FSA", "GeomxError", "HFA", "KVError",
           "PeerLostError", "ProtocolError", "PROFILES", "StepDecay", "WanProfile", "WarmupCosine", "check_combination",
           "compat", "get_profile", "kvstore", "metrics", "optim", "run_main", "statefile", "sync", "__version__"]

# public classes of submodules that import torch, loaded on first use
_LAZY = {"DCASGD": "geomx.optim", "HFA": "geomx.sync", "DiLoCo": "geomx.sync", "FSA": "geomx.sync", "DGA": "geomx.sync",
         "ESync": "geomx.sync", "StepDecay": "geomx.optim", "WarmupCosine": "geomx.optim"}


def __getattr__(name):
    # submodules that import torch or zmq load on first use, so `import geomx` stays cheap
    import importlib
    if name in ("kvstore", "torch", "optim", "statefile", "sync", "compat"):
        return importlib.import_module(f"geomx.{name}")
    if name == "check_combination":
        return importlib.import_module("geomx.compat").check
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'geomx' has no attribute {name!r}")
