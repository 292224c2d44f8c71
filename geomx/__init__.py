"""geomx: train one PyTorch model across geographically distant data centers.

A hierarchical parameter server (HiPS): workers push to their DC's local server, local servers exchange DC
aggregates with the global servers over a slow WAN. See README.md and docs/architecture.md.
"""
from geomx import metrics
from geomx.errors import (ConfigError, DeadlineError, GeomxError, KVError, PeerLostError, ProtocolError)
from geomx.profiles import PROFILES, WanProfile, get_profile

__version__ = "0.1.0"

__all__ = ["ConfigError", "DeadlineError", "GeomxError", "KVError", "PeerLostError", "ProtocolError", "PROFILES",
           "WanProfile", "get_profile", "kvstore", "metrics", "__version__"]


def __getattr__(name):
    # submodules that import torch or zmq load on first use, so `import geomx` stays cheap
    if name in ("kvstore", "torch", "optim"):
        import importlib
        return importlib.import_module(f"geomx.{name}")
    raise AttributeError(f"module 'geomx' has no attribute {name!r}")
