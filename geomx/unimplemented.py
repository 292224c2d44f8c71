"""GeoMX's (and ps-lite's, MXNet's) environment variables that geomx does not implement: never ignored in silence.

A GeoMX launch script ported to geomx keeps its variables; the ones below would change what GeoMX does, and
geomx does something else. Every process reports each one it sees, once, at start-up (``config_from_env``,
which every role runs): a logging warning naming the variable and what geomx does instead.
docs/environment.md lists this table; a variable geomx comes to implement leaves it.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("geomx.env")

_DGT = ("DGT (prioritized gradient blocks over unreliable channels) is not implemented: every message travels "
        "whole over one reliable ZeroMQ connection; to cut WAN bytes use kv.set_gradient_compression "
        "(docs/compression.md)")
_TSENGINE = ("TSEngine (the adaptive communication overlay) is not implemented: messages follow the fixed HiPS "
             "tree (workers -> local server -> global servers)")
_MULTI_DEVICE = "MXNet's multi-device reduction inside a node does not exist here: a geomx worker is one process"


@dataclass(frozen=True)
class Unimplemented:
    variable: str
    instead: str               # what geomx does instead
    switch: bool = True        # a switch: unset, empty or "0" asks for what geomx does anyway (nothing reported)
    roles: tuple[str, ...] = ()    # only these roles (default: every role) ignore it


UNIMPLEMENTED: tuple[Unimplemented, ...] = (
    Unimplemented("ENABLE_DGT", _DGT),
    Unimplemented("DMLC_UDP_CHANNEL_NUM", _DGT, switch=False),
    Unimplemented("DMLC_K", _DGT, switch=False),
    Unimplemented("DMLC_K_MIN", _DGT, switch=False),
    Unimplemented("ADAPTIVE_K_FLAG", _DGT),
    Unimplemented("DGT_INFO", _DGT),
    Unimplemented("DGT_BLOCK_SIZE", _DGT, switch=False),
    Unimplemented("DGT_CONTRIBUTION_ALPHA", _DGT, switch=False),
    Unimplemented("ENABLE_INTER_TS", _TSENGINE),
    Unimplemented("ENABLE_INTRA_TS", _TSENGINE),
    Unimplemented("MAX_GREED_RATE_TS", _TSENGINE, switch=False),
    Unimplemented("MXNET_KVSTORE_BIGARRAY_BOUND", "tensors are split by bytes, not elements: GEOMX_PARTITION_BYTES "
                  "(default 16 MiB), each part its own key on one global server", switch=False),
    Unimplemented("DMLC_ENABLE_CENTRAL_WORKER", "the central party runs only the master worker, which trains "
                  "nothing: run training workers in a DC"),
    Unimplemented("DMLC_INTERFACE", "the address comes from DMLC_NODE_HOST (default 127.0.0.1), not from a "
                  "network interface", switch=False),
    Unimplemented("DMLC_LOCAL", "every link is TCP (ZeroMQ), never ipc://"),
    Unimplemented("DMLC_USE_KUBERNETES", "schedulers bind GEOMX_BIND_HOST (set it to 0.0.0.0)"),
    Unimplemented("PS_VERBOSE", "logging is set with GEOMX_LOG_LEVEL (DEBUG for every connection)"),
    Unimplemented("PS_HEARTBEAT_INTERVAL", "heartbeats are always on: GEOMX_HEARTBEAT_INTERVAL (default 1 s)",
                  switch=False),
    Unimplemented("PS_HEARTBEAT_TIMEOUT", "a silent node is declared dead after GEOMX_HEARTBEAT_TIMEOUT "
                  "(default 10 s)", switch=False),
    Unimplemented("PS_RESEND", "no resending: every request has the deadline GEOMX_TIMEOUT and a lost node stops "
                  "the deployment, naming it"),
    Unimplemented("PS_RESEND_TIMEOUT", "no resending: every request has the deadline GEOMX_TIMEOUT", switch=False),
    Unimplemented("PS_DROP_MSG", "no message is dropped on purpose; the WAN emulator (GEOMX_WAN_EMULATOR) models "
                  "rate, latency and jitter"),
    Unimplemented("MXNET_KVSTORE_DIST_ROW_SPARSE_VERBOSE", "there are no row-sparse keys: every key is dense"),
    Unimplemented("MXNET_KVSTORE_REDUCTION_NTHREADS", _MULTI_DEVICE, switch=False),
    Unimplemented("MXNET_KVSTORE_SERIAL_PUSH", _MULTI_DEVICE),
    Unimplemented("MXNET_ENABLE_GPU_P2P", _MULTI_DEVICE),
    Unimplemented("MXNET_KVSTORE_USETREE", _MULTI_DEVICE),
    Unimplemented("MXNET_KVSTORE_LOGTREE", _MULTI_DEVICE),
    # the global servers and the master worker read it; a DC's local server takes the global servers' bound
    Unimplemented("MXNET_KVSTORE_SIZE_LOWER_BOUND", "geomx reads it on the global servers (whose bound every "
                  "process then uses) and on the master worker: set it there, or give size_lower_bound in the "
                  "setting", switch=False, roles=("global_scheduler", "scheduler", "server")),
)

_reported: set[str] = set()


def report_unimplemented(env: Mapping[str, str] | None = None, role: str = "") -> list[str]:
    """Warn, once per process, about every variable of :data:`UNIMPLEMENTED` set in ``env`` (for ``role``).
    Returns the variables warned about now."""
    env = os.environ if env is None else env
    warned = []
    for entry in UNIMPLEMENTED:
        value = (env.get(entry.variable) or "").strip()
        if entry.variable in _reported or not value or (entry.switch and value == "0"):
            continue
        if entry.roles and role not in entry.roles:
            continue
        _reported.add(entry.variable)
        warned.append(entry.variable)
        log.warning("%s=%s is a GeoMX variable geomx does not implement (%s): %s", entry.variable, value,
                    role or "this process", entry.instead)
    return warned
