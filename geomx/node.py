"""Run one geomx role in this process, configured by the environment (``python -m geomx.node``).

Schedulers, local servers and global servers run here; workers and the master worker run the user's
training script, which creates a kvstore. ``GEOMX_ROLE=emulator`` runs the WAN emulator. See
docs/environment.md for the variables (the GeoMX ``DMLC_*`` names are honoured).
"""
from __future__ import annotations

import logging
import os
import sys

from geomx.config import NodeConfig, config_from_env
from geomx.errors import GeomxError
from geomx.lifeline import watch_launcher
from geomx.profiles import CENTRAL_DC


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup_logging() -> None:
    level = (os.environ.get("GEOMX_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=getattr(logging, level) if level in LOG_LEVELS else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    if level not in LOG_LEVELS:     # said, not silently INFO
        logging.getLogger("geomx.node").warning("GEOMX_LOG_LEVEL=%r is not a level (%s): logging at INFO",
                                                os.environ.get("GEOMX_LOG_LEVEL"), ", ".join(LOG_LEVELS))


def run_scheduler(cfg: NodeConfig) -> int:
    return make_scheduler(cfg).serve()


def make_scheduler(cfg: NodeConfig):
    """The scheduler ``cfg`` describes (its van made, not started)."""
    from geomx import metrics
    from geomx.cluster.scheduler import Scheduler, dc_rule, worker_rule

    # fault domains, in the hips topology only (servers there complete rounds without a dropped member); the
    # flat topology's workers and the central party's tier need every member
    drop_rule = None
    if cfg.role == "global_scheduler":
        tier, expected, (host, port) = "global", {"server": cfg.num_global_servers,
                                                  "worker": cfg.num_global_workers}, cfg.global_scheduler
        if cfg.topology == "hips":
            drop_rule = dc_rule(cfg.min_dcs)
    else:
        tier, expected, (host, port) = cfg.local_tier, {"server": cfg.num_servers,
                                                        "worker": cfg.num_workers}, cfg.scheduler
        if cfg.topology == "hips" and cfg.dc != CENTRAL_DC:
            drop_rule = worker_rule(cfg.min_workers_per_dc)
    return Scheduler(tier=tier, dc=cfg.dc, expected=expected, host=host, port=port, emulator=cfg.emulator,
                     heartbeat_timeout=cfg.heartbeat_timeout, connect_timeout=cfg.connect_timeout,
                     measured_liveness=cfg.heartbeat_measured,
                     bind_host=cfg.bind_host, security=cfg.security, drop_rule=drop_rule, run_dir=cfg.run_dir,
                     topology=cfg.topology,
                     van_options=_scheduler_van_options(cfg),
                     metrics=metrics.open_process_writer(cfg.run_dir, cfg.role, cfg.dc))


def _scheduler_van_options(cfg: NodeConfig) -> dict | None:
    """The role's van options (its frame limit) for the zmq van a scheduler always runs, without parking: a
    scheduler's messages are small, and relayed through the emulator its view of another DC's members is what a
    WAN gives it, their heartbeats, not a direct connection on this host that shows a killed process at once."""
    if cfg.van != "zmq":
        return None
    options = dict(cfg.van_options)
    options.pop("emulator_bypass", None)
    return options


def run_role(cfg: NodeConfig) -> int:
    if cfg.role in ("global_scheduler", "scheduler"):
        return run_scheduler(cfg)
    if cfg.role == "server":
        from geomx.cluster.local_server import run_local_server
        return run_local_server(cfg)
    if cfg.role == "global_server":
        from geomx.cluster.global_server import run_global_server
        return run_global_server(cfg)
    raise GeomxError(f"role {cfg.role!r} runs the training script (which calls geomx.kvstore.create()), "
                     f"not python -m geomx.node")


def main() -> int:
    setup_logging()
    watch_launcher()
    try:
        if os.environ.get("GEOMX_ROLE") == "emulator":
            from geomx.netem.emulator import run_from_env
            return run_from_env() or 0
        cfg = config_from_env()
        if cfg.role == "global_scheduler" and not os.environ.get("GEOMX_DC"):
            cfg.dc = CENTRAL_DC
        return run_role(cfg)
    except GeomxError as exc:
        logging.getLogger("geomx.node").error("%s", exc)
        print(f"geomx: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
