"""Every ``GEOMX_*`` and ``DMLC_*`` variable geomx knows: any other name with those prefixes is a typo (or a
ps-lite variable geomx does not read), reported instead of ignored in silence.

One list for the whole package: tests/test_unimplemented_env.py checks it against every such name the code, the
examples and the test scripts read, and against docs/environment.md (both ways), so it cannot drift. A role warns
once at start-up (``config_from_env``, the WAN emulator's ``run_from_env``); ``geomx doctor`` reports each as a
problem, naming the closest known variable.
"""
from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping

from geomx.unimplemented import UNIMPLEMENTED

log = logging.getLogger("geomx.env")

PREFIXES = ("GEOMX_", "DMLC_")

# docs/environment.md's variables
DOCUMENTED = frozenset({
    # GeoMX's (ps-lite's) names, read as GeoMX reads them
    "DMLC_ROLE", "DMLC_ROLE_GLOBAL", "DMLC_ROLE_MASTER_WORKER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
    "DMLC_PS_GLOBAL_ROOT_URI", "DMLC_PS_GLOBAL_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER",
    "DMLC_NUM_GLOBAL_SERVER", "DMLC_NUM_GLOBAL_WORKER", "DMLC_NUM_ALL_WORKER", "DMLC_NODE_HOST", "DMLC_WORKER_ID",
    # roles and topology
    "GEOMX_ROLE", "GEOMX_DC", "GEOMX_SITE", "GEOMX_RANK", "GEOMX_HOST", "GEOMX_BIND_HOST", "GEOMX_TOPOLOGY",
    "GEOMX_MODE", "GEOMX_MIXEDSYNC", "GEOMX_WORKER_INDEX", "GEOMX_DC_INDEX", "GEOMX_NUM_DCS",
    # security
    "GEOMX_SECRET", "GEOMX_SECRET_FILE", "GEOMX_ENCRYPTION", "GEOMX_SEAL_MAX_AGE_S", "GEOMX_AUTH_TOKEN",
    "GEOMX_INSECURE",
    # synchronization algorithms
    "GEOMX_SYNC", "GEOMX_HFA_WEIGHTS", "GEOMX_HFA_OVERLAP", "GEOMX_HFA_OVERLAP_KEEP", "GEOMX_HFA_DC_OVERLAP",
    "GEOMX_HFA_DC_SYNC", "GEOMX_DILOCO_LR", "GEOMX_DILOCO_MOMENTUM", "GEOMX_ESYNC_STEPS", "GEOMX_P3_SLICE",
    "GEOMX_DGA_DELAY", "GEOMX_SLOWDOWN",
    # the WAN and its emulator
    "GEOMX_WAN_EMULATOR", "GEOMX_WAN_BYPASS", "GEOMX_PARK_MB", "GEOMX_WAN_PROFILE", "GEOMX_WAN_RATE",
    "GEOMX_WAN_RTT", "GEOMX_WAN_JITTER", "GEOMX_WAN_LINKS", "GEOMX_WAN_LOSS", "GEOMX_WAN_STREAMS",
    "GEOMX_WAN_WINDOW", "GEOMX_WAN_SLOW_START", "GEOMX_WAN_NODE_LINKS", "GEOMX_WAN_DC_LINES", "GEOMX_WAN_OUTAGES",
    "GEOMX_EMULATOR_HOST", "GEOMX_EMULATOR_PORT", "GEOMX_EMULATOR_DCS", "GEOMX_EMULATOR_HOSTS",
    # runs, checkpoints, liveness, deadlines, sizes
    "GEOMX_RUN_DIR", "GEOMX_CACHE_DIR", "GEOMX_LOG_LEVEL", "GEOMX_OPTIMIZER_MODULES", "GEOMX_CHECKPOINT_EVERY",
    "GEOMX_CHECKPOINT_SECONDS", "GEOMX_CHECKPOINT_DIR", "GEOMX_RESUME_FROM", "GEOMX_RESUME_STEP",
    "GEOMX_HEARTBEAT_INTERVAL", "GEOMX_HEARTBEAT_TIMEOUT", "GEOMX_MIN_WORKERS_PER_DC", "GEOMX_MIN_DCS",
    "GEOMX_CONNECT_TIMEOUT", "GEOMX_TIMEOUT", "GEOMX_PARTITION_BYTES", "GEOMX_FUSION_BYTES", "GEOMX_MAX_FRAME_MB",
    "GEOMX_SEND_QUEUE_MB",
})

# set by geomx itself or its test scripts, never by a user: known, so never reported
INTERNAL = frozenset({
    "GEOMX_LAUNCHER_PID",           # geomx launch tells its roles its pid (geomx/lifeline.py)
    "GEOMX_BENCH_PROFILE_DIR",      # geomx bench --profile's processes (geomx/bench/transport.py)
    "GEOMX_DEVICE_ENV_READY",       # tests/scripts/device_env.sh, sourced once
})

# GeoMX's variables geomx does not implement carry these prefixes too: report_unimplemented names them
KNOWN = DOCUMENTED | INTERNAL | {u.variable for u in UNIMPLEMENTED if u.variable.startswith(PREFIXES)}

_reported: set[str] = set()


def unknown_variables(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Each ``GEOMX_*`` / ``DMLC_*`` name in ``env`` that geomx does not know, with the closest known one (None
    where none is close), in name order."""
    names = sorted(KNOWN)
    # 0.8, not difflib's 0.6: the shared prefix alone makes unrelated names (GEOMX_FOO, GEOMX_ROLE) that alike
    return [(name, next(iter(difflib.get_close_matches(name, names, n=1, cutoff=0.8)), None))
            for name in sorted(env) if name.startswith(PREFIXES) and name not in KNOWN]


def describe_unknown(name: str, close: str | None) -> str:
    guess = f" (did you mean {close}?)" if close else ""
    return f"{name} is not a variable geomx knows{guess}: it is ignored"


def report_unknown(env: Mapping[str, str] | None = None, role: str = "") -> list[str]:
    """Warn, once per process, about every unknown ``GEOMX_*`` / ``DMLC_*`` variable in ``env``; the names warned
    about now."""
    env = os.environ if env is None else env
    warned = []
    for name, close in unknown_variables(env):
        if name in _reported:
            continue
        _reported.add(name)
        warned.append(name)
        log.warning("%s (%s; docs/environment.md lists the variables)", describe_unknown(name, close),
                    role or "this process")
    return warned
