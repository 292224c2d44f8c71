"""``geomx launch --backend ray``: every role of a deployment placed on a Ray cluster, by DC.

Each DC's nodes (and the central party's) carry a custom resource naming it, e.g. for DC ``a``::

    ray start --address HEAD:6379 --resources '{"geomx_dc_a": 1}'

and every role is a process started by a small Ray actor (``RoleHost``) that asks for a sliver of its DC's
resource, so a DC's roles land on that DC's nodes. The roles that others dial (the schedulers, the WAN emulator)
are pinned to one node per site, chosen first, whose address and free ports the plan then advertises; workers and
servers may land on any node of their DC. Each actor streams its role's output back: logs land in the launcher's
run directory. The actor stands in for the launcher on its node (geomx.lifeline): when the launcher's Ray driver
goes away, Ray ends the actors and every role stops.

Metrics and the drop log (geomx.dropped) are written by the roles under ``GEOMX_RUN_DIR`` on their own node: on a
real cluster that path should be a shared filesystem for live progress and for the launcher to absorb a dropped
role that exited with an error (without it, such an exit stops the run, as every failure does).
"""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from geomx.cli.backends.base import Backend, Sites
from geomx.cli.backends.local import is_stopped, signal_group
from geomx.errors import ConfigError, GeomxError
from geomx.lifeline import ENV as LAUNCHER_PID_ENV
from geomx.profiles import CENTRAL_DC

if TYPE_CHECKING:
    from geomx.cli.launch import RoleSpec
    from geomx.cli.topology import Topology

RESOURCE_PREFIX = "geomx_dc_"
DEMAND = 0.001            # of a site's resource per role: a node labelled with 1 hosts up to 1000 roles
CALL_TIMEOUT_S = 60.0     # an actor that does not answer this long is treated as lost with its node
REFRESH_S = 0.2           # how often the launcher collects every role's status and output
log = logging.getLogger("geomx.launch.ray")


def site_resource(site: str) -> str:
    """The custom resource that marks the nodes of ``site`` (a DC name, or ``central``)."""
    return f"{RESOURCE_PREFIX}{site}"


class RoleHost:
    """Runs on a node of the cluster (a Ray actor): starts one role there and reports on it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._output = bytearray()
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def where(self) -> tuple[str, str]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_ports(self, n: int, host: str) -> list[int]:
        from geomx.cli.launch import free_ports
        return free_ports(n, host)

    def start(self, argv: list[str], env: dict[str, str], cwd: str, launcher_python: str) -> int:
        import ray
        # the roles are this node's Python processes: `python` in a command and the launcher's own interpreter
        # both mean the interpreter Ray runs here
        argv = [sys.executable if a == launcher_python else a for a in argv]
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        env = {**os.environ, "PATH": path, "DMLC_NODE_HOST": ray.util.get_node_ip_address(), **env,
               LAUNCHER_PID_ENV: str(os.getpid())}
        if env.get("GEOMX_RUN_DIR"):
            Path(env["GEOMX_RUN_DIR"]).mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(argv, env=env, cwd=cwd if os.path.isdir(cwd) else None,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self._proc.pid

    def _read(self) -> None:
        fd = self._proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            with self._lock:
                self._output += chunk

    def status(self) -> tuple[int | None, bytes, bool, bool]:
        """(exit status or None, output since the last call, frozen, all output read)."""
        code = self._proc.poll()
        if code is not None:
            self._reader.join(timeout=1.0)
        with self._lock:
            out, self._output = bytes(self._output), bytearray()
        stopped = code is None and is_stopped(self._proc.pid)
        return code, out, stopped, code is not None and not self._reader.is_alive()

    def signal(self, sig: int) -> None:
        signal_group(self._proc.pid, sig)


class RayRole:
    """A role on the cluster, as the launcher sees it: the status the backend last collected."""

    def __init__(self, name: str, actor, pid: int, log_path: Path, on_line: Callable[[str], None] | None) -> None:
        self.name, self.actor, self.pid = name, actor, pid
        self.code: int | None = None
        self.stopped = False
        self.output_done = threading.Event()
        self._log = open(log_path, "wb")  # noqa: SIM115 - written by the backend's collector until the role ends
        self._on_line, self._partial = on_line, b""

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.code is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(REFRESH_S / 2)
        return self.code

    def signal(self, sig: int) -> None:
        import ray
        with contextlib.suppress(Exception):      # the actor (its node) is gone: so is the role
            ray.get(self.actor.signal.remote(sig), timeout=CALL_TIMEOUT_S)

    def is_stopped(self) -> bool:
        return self.stopped

    def finish_output(self, timeout: float) -> None:
        self.output_done.wait(timeout)

    def take(self, code: int | None, output: bytes, stopped: bool, done: bool) -> None:
        if output:
            self._log.write(output)
            self._log.flush()
            if self._on_line is not None:
                *lines, self._partial = (self._partial + output).split(b"\n")
                for line in lines:
                    self._on_line(line.decode(errors="replace").rstrip())
        self.stopped = stopped
        if done:
            if self._partial and self._on_line is not None:
                self._on_line(self._partial.decode(errors="replace").rstrip())
            self._partial = b""
            self._log.close()
            self.output_done.set()
        self.code = code          # last: whoever sees the end finds the output in the log


class RayBackend(Backend):
    name = "ray"
    across_hosts = True

    def __init__(self, *, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise GeomxError('--backend ray needs Ray: pip install "geomx[ray]"') from None
        self._ray = ray
        self.address = address
        self._anchors: dict[str, tuple[object, str, str]] = {}   # site -> (actor, node id, host)
        self._actors: dict[str, object] = {}         # role name -> its RoleHost actor (prepare)
        self._created: list = []                      # every actor made, for close (every attempt's)
        self._roles: dict[str, RayRole] = {}
        self._placed: dict[str, str] = {}
        self._collector: threading.Thread | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._connected = False

    # ---------------------------------------------------------------------------------------------- placement
    def sites(self, topo: Topology) -> Sites:
        sites = [CENTRAL_DC, *topo.dc_names]
        self._connect(sites)
        self._check_labels(sites)
        actor_class = self._ray.remote(RoleHost)
        # one actor per site first (all asked for at once): its node is where the site's listening roles will run
        first = {site: actor_class.options(num_cpus=0, resources={site_resource(site): DEMAND},
                                           max_concurrency=4).remote() for site in sites}
        self._created += first.values()
        for site, actor in first.items():
            node_id, host = self._get(actor.where.remote(), f"placing an actor on a node of site {site}")
            self._anchors[site] = (actor, node_id, host)
        hosts = {site: self._anchors[site][2] for site in sites}
        ports = self._get(self._anchors[CENTRAL_DC][0].free_ports.remote(3, hosts[CENTRAL_DC]), "choosing ports")
        for dc in topo.dc_names:
            ports += self._get(self._anchors[dc][0].free_ports.remote(1, hosts[dc]), f"choosing a port in DC {dc}")
        if topo.fixed_ports > len(ports):      # global servers on lines of their own (--global-server-link)
            ports += self._get(self._anchors[CENTRAL_DC][0].free_ports.remote(topo.fixed_ports - len(ports),
                                                                              hosts[CENTRAL_DC]), "choosing ports")
        return Sites(hosts, ports)

    def _connect(self, sites: list[str]) -> None:
        if self._connected:         # a restarted job (--restart-failed) places its roles on the same cluster
            return
        ray = self._ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
        address = self.address or os.environ.get("RAY_ADDRESS")
        if address:
            try:
                ray.init(address=address, **quiet)
            except ConnectionError as exc:
                raise ConfigError(f"--address {address}: no Ray cluster answers there ({exc})") from None
        else:
            try:
                ray.init(address="auto", **quiet)
            except ConnectionError:
                # no cluster on this machine: start one whose single node is every site
                ray.init(resources={site_resource(s): 1.0 for s in sites}, include_dashboard=False, **quiet)
        self._connected = True

    def _check_labels(self, sites: list[str]) -> None:
        """Every site needs a live node carrying its resource: say which are missing instead of waiting forever
        for an actor Ray cannot place."""
        have = [n.get("Resources", {}) for n in self._ray.nodes() if n.get("Alive")]
        missing = [s for s in sites if not any(r.get(site_resource(s), 0) >= DEMAND for r in have)]
        if missing:
            example = site_resource(missing[0])
            raise ConfigError(
                "no live Ray node carries the resource of " + ", ".join(
                    f"{'the central party' if s == CENTRAL_DC else 'DC ' + s} ({site_resource(s)})"
                    for s in missing)
                + f"; start each such node with: ray start --address HEAD --resources '{{\"{example}\": 1}}'")

    # ------------------------------------------------------------------------------------------------- roles
    def prepare(self, specs: list[RoleSpec]) -> None:
        """An actor for every role, all asked for at once: Ray starts their processes side by side (one by one,
        a deployment of 10 roles took 10 s to start). A site's first listening role takes the actor that chose
        its node and ports; the others are pinned to that node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spare = {site: actor for site, (actor, _node, _host) in self._anchors.items()}
        for spec in specs:
            site = spec.dc or CENTRAL_DC
            if spec.pinned and site in spare:
                self._actors[spec.name] = spare.pop(site)
                continue
            options = {"num_cpus": 0, "resources": {site_resource(site): DEMAND}, "max_concurrency": 4}
            if spec.pinned:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self._anchors[site][1], soft=False)
            self._actors[spec.name] = self._ray.remote(RoleHost).options(**options).remote()
            self._created.append(self._actors[spec.name])
        for actor in spare.values():        # a site with no listening role (none so far): not needed
            self._ray.kill(actor)

    def start(self, spec: RoleSpec, env: dict[str, str], log_path: Path,
              on_line: Callable[[str], None] | None) -> RayRole:
        actor = self._actors[spec.name]
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(("GEOMX_", "DMLC_"))}
        pid = self._get(actor.start.remote(spec.argv, {**forwarded, **env}, os.getcwd(), sys.executable),
                        f"starting role {spec.name}")
        node, host = self._get(actor.where.remote(), f"locating role {spec.name}")
        role = RayRole(spec.name, actor, pid, log_path, on_line)
        with self._lock:
            self._roles[spec.name] = role
            self._placed[spec.name] = f"{host} (node {node[:12]}, pid {pid})"
        if self._collector is None:
            self._collector = threading.Thread(target=self._collect, name="geomx-ray-collector", daemon=True)
            self._collector.start()
        return role

    def _collect(self) -> None:
        """Fetch every unfinished role's status and output, every REFRESH_S."""
        ray = self._ray
        while not self._closing.is_set():
            with self._lock:
                pending = [r for r in self._roles.values() if not r.output_done.is_set()]
            calls = {r: r.actor.status.remote() for r in pending}
            for role, ref in calls.items():
                try:
                    role.take(*ray.get(ref, timeout=CALL_TIMEOUT_S))
                except Exception as exc:  # noqa: BLE001 - an actor lost with its node: the role is gone too
                    log.warning("lost contact with role %s on the Ray cluster: %s", role.name, exc)
                    role.take(-9, f"geomx: lost contact with this role's Ray actor: {exc}\n".encode(), False, True)
            self._closing.wait(REFRESH_S)

    def placement(self) -> dict[str, str]:
        with self._lock:
            return dict(self._placed)

    def close(self) -> None:
        self._closing.set()
        if self._collector is not None:
            self._collector.join(timeout=CALL_TIMEOUT_S)
        ray = self._ray
        for role in self._roles.values():
            if not role.output_done.is_set():      # its last output, if the collector stopped before it came
                with contextlib.suppress(Exception):
                    role.take(*ray.get(role.actor.status.remote(), timeout=5.0))
        for actor in self._created:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self._connected:
            ray.shutdown()

    def _get(self, ref, doing: str):
        try:
            return self._ray.get(ref, timeout=CALL_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            raise GeomxError(f"Ray did not answer within {CALL_TIMEOUT_S:g} s while {doing} (is a node of that "
                             f"site out of its resource, or busy?)") from None
