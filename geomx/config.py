"""A node's configuration, read from the environment.

geomx reads the variables GeoMX uses (``DMLC_*``), so a GeoMX launch script ports by changing only the
process bodies, plus a few ``GEOMX_*`` ones of its own (docs/environment.md has the full table).
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

from geomx.errors import ConfigError
from geomx.profiles import CENTRAL_DC
from geomx.compression.policy import SIZE_BOUND_ENV, env_size_bound
from geomx.transport.base import is_node_address
from geomx.transport.security import Curve, Sealed, link_security
from geomx.env_names import report_unknown
from geomx.unimplemented import report_unimplemented

log = logging.getLogger("geomx.config")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) reaches this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def refuse_exposed_without_secret(what: str, hosts, security, env: Mapping[str, str]) -> None:
    """A listener on any of ``hosts`` off loopback needs the shared secret (sealed or CurveZMQ links): a token
    alone travels in clear. Refused naming the address, unless GEOMX_INSECURE=1 (then a warning)."""
    exposed = next((h for h in hosts if h and not is_loopback(h)), None)
    if isinstance(security, Sealed | Curve):
        return
    if exposed is not None:
        if env.get("GEOMX_INSECURE") != "1":
            raise ConfigError(f"{what} would listen on {exposed} without GEOMX_SECRET (or GEOMX_SECRET_FILE): "
                              f"across hosts every link needs the shared secret; set GEOMX_INSECURE=1 to run "
                              f"unauthenticated and unencrypted anyway")
        log.warning("%s listens on %s without GEOMX_SECRET (GEOMX_INSECURE=1): its links are neither "
                    "authenticated nor encrypted", what, exposed)
    elif security is None:
        (log.warning if env.get("GEOMX_INSECURE") == "1" else log.info)(
            "%s runs unauthenticated (no GEOMX_SECRET or GEOMX_AUTH_TOKEN): it accepts every connection and "
            "checks only who sent each message", what)

ROLES = ("global_scheduler", "global_server", "scheduler", "server", "worker", "master")
MODES = ("dist_sync", "dist_async")
# dist_async (MixedSync): does a local server wait for the WAN round before answering its DC ("wait", GeoMX)
# or answer at once and let the exchange with the global servers run behind ("overlap")
MIXEDSYNC = ("wait", "overlap")
# what a synchronous round returns without a server optimizer (and what one steps on): MXNet's and GeoMX's
# servers sum the pushes; DistributedOptimizer asks for the mean over all training workers
REDUCTIONS = ("sum", "mean")


def round_divisor(reduction: str, num_all_workers: int) -> int:
    """What a round's sum is divided by under ``reduction``: the training workers world-wide for the mean."""
    return num_all_workers if reduction == "mean" else 1
TOPOLOGIES = ("hips", "flat")


# a part costs a message each way (about half a millisecond of CPU on a small host), so parts are large:
# 16 MiB tensors travel whole, bigger ones still pipeline (4 parts at 64 MiB)
DEFAULT_PARTITION_BYTES = 16 * 1024 * 1024
MAX_PART_BYTES = 16 << 20   # the largest part geomx.kvstore.partition cuts (by wire bytes, or a DC round's)
FIXED_DEADLINE_INTERVAL_S = 1.0       # members' heartbeat interval under a fixed GEOMX_HEARTBEAT_TIMEOUT


@dataclass
class NodeConfig:
    role: str
    dc: str
    host: str = "127.0.0.1"                # the address other nodes reach this one by (advertised)
    bind_host: str | None = None           # the address to listen on, if not ``host`` (0.0.0.0 behind NAT)
    port: int = 0                          # 0 = any free port (schedulers use their root port)
    scheduler: tuple[str, int] | None = None         # this DC's (or the central party's) scheduler
    global_scheduler: tuple[str, int] | None = None
    num_workers: int = 0                   # workers of this DC (central party: 1, the master)
    num_servers: int = 0                   # servers of this DC (central party: the global servers)
    num_global_servers: int = 0
    num_global_workers: int = 0            # DCs (hips) or all training workers (flat)
    num_all_workers: int = 0               # training workers world-wide
    rank: int | None = None                # requested rank; None = assigned by the scheduler
    topology: str = "hips"
    mode: str | None = None                # kvstore type the launcher asked for (checked against create())
    mixedsync: str = "wait"                # dist_async: MIXEDSYNC, what the master worker tells the servers
    emulator: str | None = None            # tcp:// address of the WAN emulator, if any
    run_dir: str | None = None
    checkpoint_every: int = 0              # global servers with an optimizer: checkpoint every N rounds
    checkpoint_seconds: float = 0.0        # ... and about every S seconds (0: never; checkpoint_clock.py)
    checkpoint_dir: str | None = None      # GEOMX_CHECKPOINT_DIR, else <run dir>/checkpoints (checkpoint_directory)
    resume_from: str | None = None         # a previous run's checkpoint directory (geomx launch --resume)
    resume_step: int | None = None         # the step (= round) to resume at
    size_lower_bound: int | None = None    # MXNET_KVSTORE_SIZE_LOWER_BOUND here (global servers: theirs wins)
    optimizer_modules: tuple[str, ...] = ()   # GEOMX_OPTIMIZER_MODULES: user optimizer modules servers may import
    min_workers_per_dc: int = 1            # a DC scheduler drops silent workers while this many remain
    min_dcs: int = 1                       # the global scheduler drops a silent DC while this many remain
    heartbeat_interval: float = 0.25       # 1 s under a fixed GEOMX_HEARTBEAT_TIMEOUT
    heartbeat_timeout: float = 10.0        # the members' own limit, and the cap of measured deadlines
    heartbeat_measured: bool = True        # schedulers measure each member's deadline (unless given seconds)
    connect_timeout: float = 120.0
    op_timeout: float = 300.0
    partition_bytes: int = DEFAULT_PARTITION_BYTES   # tensors above this travel in parts (0: never)
    security: object = None                # geomx.transport.security: Sealed/Curve (GEOMX_SECRET), Plain (token)
    scheduler_tier: str | None = None      # the tier of this DC's (or the central party's) scheduler, if not dc:DC
    van: str = "zmq"                       # the transport (geomx.transport.base.Van.create); "inproc": in one process
    van_options: dict = field(default_factory=dict)   # extra arguments of that van (inproc: its Hub)
    # the DC whose network this node sits in, if not ``dc`` (GEOMX_SITE): a global server placed inside a DC
    # (MultiGPS) belongs to the central party's tier but reaches that DC's nodes without crossing the WAN
    site: str | None = None

    @property
    def network_dc(self) -> str:
        """The DC messages to and from this node are routed by (the WAN emulator's links)."""
        return self.site or self.dc

    @property
    def local_tier(self) -> str:
        """Name of the tier of this node's local scheduler; the same for the scheduler and all its members."""
        return self.scheduler_tier or f"dc:{self.dc}"

    @property
    def label(self) -> str:
        """Human name used in logs and errors, e.g. 'worker 1 of DC a'."""
        who = self.role.replace("_", " ")
        rank = "" if self.rank is None else f" {self.rank}"
        return f"{who}{rank} of DC {self.dc}" if self.role in ("scheduler", "server", "worker") else who + rank


MAX_FRAME_ENV = "GEOMX_MAX_FRAME_MB"


def max_frame_bytes(env: Mapping[str, str]) -> int:
    """The largest frame a listening socket takes (ZeroMQ's MAXMSGSIZE), -1 for no limit. A peer that sends a
    larger one is disconnected before its bytes are held, so a stranger who got past a connection's admission
    (the PLAIN token crosses the WAN in clear even with GEOMX_SECRET) cannot make a role allocate frames of any
    size. Every tensor frame geomx sends is one part of at most ``max(GEOMX_PARTITION_BYTES, MAX_PART_BYTES)``
    (the largest part by wire bytes and the DC rounds' parts, geomx.kvstore.partition), and a
    part's encoded form never doubles it (a sparse payload's indices and values): twice that and 1 MiB. With
    GEOMX_PARTITION_BYTES=0 tensors travel whole, so there is no limit unless GEOMX_MAX_FRAME_MB sets one."""
    text = (env.get(MAX_FRAME_ENV) or "").strip()
    if text:
        try:
            limit = float(text)
        except ValueError:
            raise ConfigError(f"{MAX_FRAME_ENV}={text!r} is not a number of MiB") from None
        if not limit >= 1:
            raise ConfigError(f"{MAX_FRAME_ENV}={text!r}: use >= 1 (MiB)")
        return int(limit * (1 << 20))
    partition = _partition_bytes(env.get("GEOMX_PARTITION_BYTES"))
    return -1 if partition == 0 else 2 * max(partition, MAX_PART_BYTES) + (1 << 20)


def _partition_bytes(text: str | None) -> int:
    if text is None or text.strip() == "":
        return DEFAULT_PARTITION_BYTES
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"GEOMX_PARTITION_BYTES={text!r} is not a whole number of bytes") from None
    if value != 0 and value < 1024:
        raise ConfigError(f"GEOMX_PARTITION_BYTES={value} is too small: use >= 1024 bytes, or 0 to never "
                          f"partition")
    return value


def _need(env: Mapping[str, str], name: str, role: str) -> str:
    value = env.get(name)
    if value is None or value == "":
        raise ConfigError(f"role {role!r} needs the environment variable {name} (see docs/environment.md)")
    return value


def env_int(env: Mapping[str, str], name: str, role: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            _need(env, name, role)
        return default  # type: ignore[return-value]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (role {role!r})") from None


def env_float(env: Mapping[str, str], name: str, default: float, *, positive: bool = False) -> float:
    """``positive``: a duration, refused unless > 0 (a negative deadline read as an outage, not as a typo)."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if positive and not value > 0:
        raise ConfigError(f"{name}={raw!r} must be a number of seconds > 0")
    return value


def env_port(env: Mapping[str, str], name: str, role: str, default: int | None = None) -> int:
    """A TCP port, 0..65535 (0: any free one where a default allows it); a larger number was wrapped by the
    socket layer to another port."""
    port = env_int(env, name, role, default)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}={port} is not a port: ports are 0 to 65535 (role {role!r})")
    return port


def checkpoint_directory(cfg: NodeConfig) -> Path | None:
    """Where this node writes its checkpoints: ``GEOMX_CHECKPOINT_DIR`` (``geomx launch --checkpoint-dir``, e.g.
    storage every host mounts), else the run directory's ``checkpoints``; None with neither."""
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir)
    return Path(cfg.run_dir) / "checkpoints" if cfg.run_dir else None


def env_checkpoint_seconds(env: Mapping[str, str]) -> float:
    """``GEOMX_CHECKPOINT_SECONDS`` (``geomx launch --checkpoint-seconds``): 0 when unset."""
    seconds = env_float(env, "GEOMX_CHECKPOINT_SECONDS", 0.0)
    if (env.get("GEOMX_CHECKPOINT_SECONDS") or "").strip() and not seconds > 0:
        raise ConfigError(f"GEOMX_CHECKPOINT_SECONDS={env['GEOMX_CHECKPOINT_SECONDS']!r} must be a number of seconds "
                          f"> 0 (geomx launch --checkpoint-seconds)")
    return seconds


def checkpoint_path(text: str, name: str) -> Path:
    """A checkpoint directory given as a path or a ``file://`` URL (``file:///abs/path``); ``name``, the flag or
    variable it came from, names it in the error for any other scheme (checkpoints go to a directory every role
    can write: a local disk, or storage every host mounts)."""
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if scheme is None:
        return Path(text)
    if scheme.group(1).lower() != "file":
        raise ConfigError(f"{name} {text}: scheme {scheme.group(1)!r} is not supported; give a directory path or a "
                          f"file:// URL (e.g. storage every host mounts)")
    url = urlsplit(text)
    if url.netloc not in ("", "localhost") or not url.path.startswith("/"):
        raise ConfigError(f"{name} {text}: a file URL names an absolute path on this host, file:///abs/path")
    return Path(unquote(url.path))


def env_heartbeat_timeout(env: Mapping[str, str]) -> tuple[float, bool]:
    """(the heartbeat timeout, whether schedulers measure each member's deadline): unset or ``auto`` (the default,
    geomx.cluster.liveness) measures, the default timeout staying the members' own limit and the measured
    deadlines' cap; seconds fix every deadline at that many."""
    if (env.get("GEOMX_HEARTBEAT_TIMEOUT") or "auto").strip() == "auto":
        return NodeConfig.heartbeat_timeout, True
    return env_float(env, "GEOMX_HEARTBEAT_TIMEOUT", NodeConfig.heartbeat_timeout, positive=True), False


# how long a role waits at start for its resolver to say whether a host name exists: a name that does not is
# refused at once, naming the variable; a resolver slower than this only gets a warning (the deadline names the rest)
RESOLVE_S = 2.0
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_resolved: dict[str, bool] = {}      # names looked up in this process (doctor checks many roles on one host)


def check_host(variable: str, host: str, port_variable: str, *, resolve: bool = True) -> str:
    """``host`` as a role dials or advertises it, refused naming ``variable`` where it could never be reached:
    a host with a port in it (the port belongs in ``port_variable``; it had been dialled as HOST:PORT:PORT), a
    scheme or path, a dotted address that is no IPv4 address (999.1.1.1), and, with ``resolve``, a name the
    resolver says does not exist (within RESOLVE_S; each had waited GEOMX_CONNECT_TIMEOUT, then blamed a scheduler
    "not running")."""
    text = host.strip()
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(text)
        return text
    if "://" in text or "/" in text:
        raise ConfigError(f"{variable}={host!r} is not a host: give the address alone (e.g. 10.0.0.5), without a "
                          f"scheme or path")
    if ":" in text:
        raise ConfigError(f"{variable}={host!r} contains a port: give the host alone in {variable} and the port in "
                          f"{port_variable}")
    if re.fullmatch(r"[0-9.]+", text):
        raise ConfigError(f"{variable}={host!r} is not an IPv4 address (four numbers 0-255, e.g. 10.0.0.5)")
    if not _HOST_NAME.fullmatch(text):
        raise ConfigError(f"{variable}={host!r} is not a host name or IP address")
    if resolve and not _resolves(text):
        raise ConfigError(f"{variable}={host!r} does not resolve to an address on this host (a typo? `getent hosts "
                          f"{text}` checks it)")
    return text


def _resolves(name: str) -> bool:
    """False only where the resolver says the name does not exist; True where it resolves, and where the resolver
    fails otherwise or gives no answer within RESOLVE_S (logged: it may resolve later)."""
    if name in _resolved:
        return _resolved[name]
    answer: dict[str, bool] = {}

    def look_up() -> None:
        try:
            socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            answer["found"] = True
        except socket.gaierror as exc:
            answer["found"] = exc.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME))
            if answer["found"]:
                log.warning("cannot resolve %r now (%s): going on, it may resolve later", name, exc)

    # getaddrinfo has no timeout of its own: a daemon thread bounds it
    looking = threading.Thread(target=look_up, name="resolve", daemon=True)
    looking.start()
    looking.join(RESOLVE_S)
    if "found" not in answer:
        log.warning("the resolver gave no answer for %r within %g s: going on, it may resolve later", name, RESOLVE_S)
        return True
    _resolved[name] = answer["found"]
    return answer["found"]


def _addr(env: Mapping[str, str], uri: str, port: str, role: str, *, resolve: bool = True) -> tuple[str, int]:
    return check_host(uri, _need(env, uri, role), port, resolve=resolve), env_port(env, port, role)


def role_from_env(env: Mapping[str, str]) -> str:
    """The role, decided as GeoMX does from DMLC_ROLE, DMLC_ROLE_GLOBAL and DMLC_ROLE_MASTER_WORKER."""
    if env.get("GEOMX_ROLE"):
        role = env["GEOMX_ROLE"]
        if role not in ROLES:
            raise ConfigError(f"GEOMX_ROLE={role!r} is not a role; roles are {', '.join(ROLES)}")
        return role
    glob, local = env.get("DMLC_ROLE_GLOBAL", ""), env.get("DMLC_ROLE", "")
    if glob == "global_scheduler":
        return "global_scheduler"
    if glob == "global_server":
        if local != "server":
            raise ConfigError("DMLC_ROLE_GLOBAL=global_server needs DMLC_ROLE=server as well")
        return "global_server"
    if glob:
        raise ConfigError(f"DMLC_ROLE_GLOBAL={glob!r} is not global_scheduler or global_server")
    if local in ("scheduler", "server"):
        return local
    if local == "worker":
        return "master" if env.get("DMLC_ROLE_MASTER_WORKER", "0") not in ("", "0") else "worker"
    if not local:
        raise ConfigError("no geomx role in the environment: set DMLC_ROLE (scheduler, server, worker) or "
                          "DMLC_ROLE_GLOBAL, or start the script with `geomx launch`")
    raise ConfigError(f"DMLC_ROLE={local!r} is not scheduler, server or worker")


def config_from_env(env: Mapping[str, str] | None = None, *, resolve: bool = True,
                    warn_unknown: bool = True) -> NodeConfig:
    """``resolve``: host names are looked up (check_host); ``geomx doctor --no-network`` leaves them.
    ``warn_unknown``: log unknown GEOMX_*/DMLC_* names (geomx doctor reports them as problems instead)."""
    env = os.environ if env is None else env
    role = role_from_env(env)
    report_unimplemented(env, role)      # GeoMX variables geomx does not implement: said once, never ignored
    if warn_unknown:
        report_unknown(env, role)        # and misspelled ones (GEOMX_CONECT_TIMEOUT), which nothing reads
    topology = env.get("GEOMX_TOPOLOGY", "hips")
    if topology not in TOPOLOGIES:
        raise ConfigError(f"GEOMX_TOPOLOGY={topology!r} is not one of {', '.join(TOPOLOGIES)}")
    mode = env.get("GEOMX_MODE") or None
    if mode is not None and mode not in MODES:
        raise ConfigError(f"GEOMX_MODE={mode!r} is not one of {', '.join(MODES)}")
    mixedsync = (env.get("GEOMX_MIXEDSYNC") or "wait").strip()
    if mixedsync not in MIXEDSYNC:
        raise ConfigError(f"GEOMX_MIXEDSYNC={mixedsync!r} is not one of {', '.join(MIXEDSYNC)}")
    cfg = NodeConfig(role=role, dc="", topology=topology, mode=mode, mixedsync=mixedsync)
    host_variable = "DMLC_NODE_HOST" if env.get("DMLC_NODE_HOST") else "GEOMX_HOST"
    cfg.host = check_host(host_variable, env.get(host_variable) or "127.0.0.1", "PORT", resolve=resolve)
    cfg.bind_host = env.get("GEOMX_BIND_HOST") or None
    if cfg.bind_host is not None:
        cfg.bind_host = check_host("GEOMX_BIND_HOST", cfg.bind_host, "PORT", resolve=resolve)
    cfg.port = env_port(env, "PORT", role, 0)
    cfg.emulator = env.get("GEOMX_WAN_EMULATOR") or None
    if cfg.emulator is not None and not is_node_address(cfg.emulator):
        raise ConfigError(f"GEOMX_WAN_EMULATOR={cfg.emulator!r} is not the emulator's address (tcp://HOST:PORT, "
                          f"as geomx launch --wan sets it)")
    if cfg.emulator and env.get("GEOMX_WAN_BYPASS") == "1":
        # large messages to nodes of other DCs on this host are parked at their receiver; the emulator is
        # handed their route and size only (geomx.transport.parking)
        cfg.van_options["emulator_bypass"] = True
    cfg.security = link_security(env)
    if cfg.van == "zmq":
        cfg.van_options["max_frame_bytes"] = max_frame_bytes(env)
    # the address peers dial and the one the socket binds (GEOMX_BIND_HOST=0.0.0.0 behind NAT) both expose it
    refuse_exposed_without_secret(role, (cfg.host, cfg.bind_host), cfg.security, env)
    cfg.run_dir = env.get("GEOMX_RUN_DIR") or None
    cfg.checkpoint_every = env_int(env, "GEOMX_CHECKPOINT_EVERY", role, 0)
    cfg.checkpoint_seconds = env_checkpoint_seconds(env)
    directory = env.get("GEOMX_CHECKPOINT_DIR")
    cfg.checkpoint_dir = str(checkpoint_path(directory, "GEOMX_CHECKPOINT_DIR")) if directory else None
    cfg.resume_from = env.get("GEOMX_RESUME_FROM") or None
    cfg.resume_step = env_int(env, "GEOMX_RESUME_STEP", role) if env.get("GEOMX_RESUME_STEP") else None
    cfg.optimizer_modules = tuple(m.strip() for m in (env.get("GEOMX_OPTIMIZER_MODULES") or "").split(",")
                                  if m.strip())
    if (env.get(SIZE_BOUND_ENV) or "").strip():
        cfg.size_lower_bound = env_size_bound(env)
    cfg.min_workers_per_dc = env_int(env, "GEOMX_MIN_WORKERS_PER_DC", role, 1)
    cfg.min_dcs = env_int(env, "GEOMX_MIN_DCS", role, 1)
    cfg.heartbeat_timeout, cfg.heartbeat_measured = env_heartbeat_timeout(env)
    # measured deadlines need frequent heartbeats; a fixed deadline of seconds does with one a second
    default_interval = NodeConfig.heartbeat_interval if cfg.heartbeat_measured else FIXED_DEADLINE_INTERVAL_S
    cfg.heartbeat_interval = env_float(env, "GEOMX_HEARTBEAT_INTERVAL", default_interval, positive=True)
    cfg.connect_timeout = env_float(env, "GEOMX_CONNECT_TIMEOUT", cfg.connect_timeout, positive=True)
    cfg.op_timeout = env_float(env, "GEOMX_TIMEOUT", cfg.op_timeout, positive=True)
    cfg.partition_bytes = _partition_bytes(env.get("GEOMX_PARTITION_BYTES"))
    requested = env.get("GEOMX_RANK") or env.get("DMLC_WORKER_ID")
    cfg.rank = env_int(env, "GEOMX_RANK" if env.get("GEOMX_RANK") else "DMLC_WORKER_ID", role) if requested else None

    in_global_tier = role in ("global_scheduler", "global_server", "server") or (
        role == "worker" and topology == "flat")
    if role != "global_scheduler":
        cfg.scheduler = _addr(env, "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", role, resolve=resolve)
        cfg.num_workers = env_int(env, "DMLC_NUM_WORKER", role)
        cfg.num_servers = env_int(env, "DMLC_NUM_SERVER", role)
    if in_global_tier:
        cfg.global_scheduler = _addr(env, "DMLC_PS_GLOBAL_ROOT_URI", "DMLC_PS_GLOBAL_ROOT_PORT", role,
                                     resolve=resolve)
        cfg.num_global_servers = env_int(env, "DMLC_NUM_GLOBAL_SERVER", role)
        cfg.num_global_workers = env_int(env, "DMLC_NUM_GLOBAL_WORKER", role)
    if role in ("worker", "master", "global_server"):
        cfg.num_all_workers = env_int(env, "DMLC_NUM_ALL_WORKER", role)
    if role == "master":
        cfg.num_global_servers = cfg.num_servers   # the central party's servers are the global servers

    # GeoMX has no DC names: without GEOMX_DC a DC is named after its scheduler's address. The central party's
    # roles are "central" then, but its scheduler (a plain DMLC_ROLE=scheduler, as in GeoMX's scripts) cannot
    # tell that it is the central one: its tier is therefore named after its address for every member too
    scheduler_name = "{}:{}".format(*cfg.scheduler) if cfg.scheduler else None
    if role in ("global_scheduler", "global_server", "master"):
        cfg.dc = env.get("GEOMX_DC") or CENTRAL_DC
    else:
        cfg.dc = env.get("GEOMX_DC") or scheduler_name  # type: ignore[assignment]
    if scheduler_name is not None:
        cfg.scheduler_tier = f"dc:{env.get('GEOMX_DC') or scheduler_name}"
    cfg.site = (env.get("GEOMX_SITE") or "").strip() or None
    if cfg.site is not None and role != "global_server":
        raise ConfigError(f"GEOMX_SITE={cfg.site!r} places a node inside a DC's network, which only a global server "
                          f"may be (MultiGPS); this process is a {role}")
    _check_counts(cfg)
    return cfg


def _check_counts(cfg: NodeConfig) -> None:
    def positive(name: str, value: int) -> None:
        if value < 1:
            raise ConfigError(f"{name} must be >= 1 for role {cfg.role!r} (got {value})")

    if cfg.role in ("scheduler", "server", "worker", "master", "global_server"):
        positive("DMLC_NUM_WORKER", cfg.num_workers)
    if cfg.role == "scheduler" and cfg.dc != CENTRAL_DC and not 1 <= cfg.min_workers_per_dc <= cfg.num_workers:
        raise ConfigError(f"GEOMX_MIN_WORKERS_PER_DC={cfg.min_workers_per_dc} must be between 1 and the DC's "
                          f"DMLC_NUM_WORKER={cfg.num_workers} (the workers that must remain for the DC to go on)")
    if cfg.role == "server" and cfg.num_servers != 1:
        raise ConfigError(f"a local server needs DMLC_NUM_SERVER=1 (one local server per DC), got "
                          f"{cfg.num_servers}")
    if cfg.role in ("global_scheduler", "global_server", "server") or cfg.global_scheduler:
        positive("DMLC_NUM_GLOBAL_SERVER", cfg.num_global_servers)
        positive("DMLC_NUM_GLOBAL_WORKER", cfg.num_global_workers)
    if cfg.role == "global_scheduler" and cfg.topology == "hips" and not 1 <= cfg.min_dcs <= cfg.num_global_workers:
        raise ConfigError(f"GEOMX_MIN_DCS={cfg.min_dcs} must be between 1 and DMLC_NUM_GLOBAL_WORKER="
                          f"{cfg.num_global_workers} (the DCs that must remain for the job to go on)")
    if cfg.role in ("worker", "master", "global_server"):
        positive("DMLC_NUM_ALL_WORKER", cfg.num_all_workers)
    if cfg.role == "master":
        positive("DMLC_NUM_SERVER", cfg.num_servers)
