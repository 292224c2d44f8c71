"""``geomx launch``: start a whole geomx deployment and tear it down afterwards.

Every role is a real process with its own log file in the run directory, on this machine or, with
``--backend ray``, on the nodes of a Ray cluster that carry its DC's label (geomx.cli.backends). Workers and the
master worker run the user's command; their output is also echoed with a ``[dc/rank]`` prefix. If any process
fails, every process is stopped and the launcher exits non-zero, naming the failed role and printing the tail of
its log.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from geomx.cli.backends import Backend, LocalBackend, RoleHandle, Sites
from geomx.cli.checkpoint_owner import claim as claim_checkpoint_dir
from geomx.cli.inject import Injector, parse_faults
from geomx.cli.rejoins import Rejoins
from geomx.cli.topology import ENV_TABLE_VARIABLES, LAUNCHER_VARIABLES, Topology, refuse_launcher_variables
from geomx.config import checkpoint_path, env_heartbeat_timeout, env_int, is_loopback
from geomx.dropped import ABORTED_FILE, DropLog
from geomx.dropped import FILE as DROPPED_FILE
from geomx.errors import ConfigError
from geomx.metrics import METRICS_DIR, RESULT_PREFIX
from geomx.netem import dc_lines, link_matrix, node_links
from geomx.netem import outages as outage_plan
from geomx.netem.emulator import STATS_FILE
from geomx.cli.fault_domains import MIN_DCS_ENV, MIN_WORKERS_ENV, DcRole, Losses
from geomx.profiles import CENTRAL_DC
from geomx.sync.settings import OPTIONS as SYNC_OPTIONS
from geomx.sync.slowdown import ENV as SLOWDOWN_ENV
from geomx.transport.park_channel import wait_for_channel
from geomx.transport.security import ENCRYPTION_LABELS, encryption_of

P3_SLICE_ENV = SYNC_OPTIONS["slice"][0]     # GEOMX_P3_SLICE
INFRA_EXIT_GRACE_S = 30.0


@dataclass
class RoleSpec:
    name: str
    kind: str               # emulator, scheduler, server, worker, master
    argv: list[str]
    env: dict[str, str]
    echo: bool = False      # echo its output on the console
    dc: str | None = None   # a DC's roles: its name
    pinned: bool = False    # binds a fixed port others dial: runs at its site's host (geomx.cli.backends.Sites)


@dataclass
class Running:
    spec: RoleSpec
    proc: RoleHandle
    log_path: Path
    returncode: int | None = None
    ended_at: float | None = None       # when the launcher saw it end (time.monotonic)
    rejoined: bool = False              # started again to rejoin the running job (geomx.cli.rejoins)


# Fixed ports (schedulers, emulator) come from below the kernel's ephemeral range (32768-60999 by default):
# the outgoing connections of the deployment itself take ephemeral ports, and one of them could otherwise
# grab a port between the moment it is chosen here and the moment its role binds it.
_FIXED_PORT_RANGE = (20000, 32000)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(*_FIXED_PORT_RANGE)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
    return ports


def one_host_sites(topo: Topology, ports: list[int] | None = None) -> Sites:
    """Every site at ``topo.host``, on ``ports`` or free ones there (the local backend's placement)."""
    return Sites({site: topo.host for site in (CENTRAL_DC, *topo.dc_names)},
                 ports or free_ports(topo.fixed_ports, topo.host))


def plan(topo: Topology, command: list[str], run_dir: Path, ports: list[int] | None = None,
         secret: str | None = None, auth_token: str | None = None, sites: Sites | None = None) -> list[RoleSpec]:
    """The processes of ``topo``, in start order, with the environment each one reads. ``sites``: where each
    site's listening roles run (default: one_host_sites)."""
    sites = sites or one_host_sites(topo, ports)
    h = sites.hosts[CENTRAL_DC]
    # on one host every role advertises that host (TOML `host`), as its schedulers bind it: peers and the
    # emulator dial it (the emulator relays only to its hosts)
    one_host = {"DMLC_NODE_HOST": h} if set(sites.hosts.values()) == {h} and h != "127.0.0.1" else {}
    # -P: a role imports the geomx installed (or on PYTHONPATH), never a geomx/ folder in the working directory,
    # which `python -m` would otherwise put first (another checkout's, another version's)
    node = [sys.executable, "-P", "-m", "geomx.node"]
    n_dcs, G, N = topo.dcs, topo.global_servers, topo.num_all_workers
    flat = topo.topology == "flat"
    ports = sites.ports
    if len(ports) < topo.fixed_ports:
        raise ConfigError(f"the deployment binds {topo.fixed_ports} fixed ports (Topology.fixed_ports), {len(ports)} "
                          f"were given")
    p_global, p_central, p_emu, dc_ports = ports[0], ports[1], ports[2], ports[3:3 + n_dcs]
    # global servers on lines of their own bind fixed ports: the emulator knows their lines by address
    gs_ports = ports[3 + n_dcs:3 + n_dcs + G] if topo.global_server_link_bps else []
    node_lines = {f"tcp://{h}:{port}": topo.global_server_link_bps for port in gs_ports}
    global_workers = N if flat else n_dcs
    security = {"GEOMX_SECRET": secret} if secret else {"GEOMX_AUTH_TOKEN": auth_token} if auth_token else {}
    base = {**security, "PYTHONUNBUFFERED": "1", "GEOMX_RUN_DIR": str(run_dir),
            "GEOMX_TOPOLOGY": topo.topology, "GEOMX_MODE": topo.mode, "GEOMX_MIXEDSYNC": topo.mixedsync,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **one_host, **topo.env,
            # every WAN and emulator variable written, empty where unused (every reader takes that as unset):
            # none from the launcher's environment can reach a role in place of what its flags say
            **dict.fromkeys(LAUNCHER_VARIABLES, "")}
    specs: list[RoleSpec] = []
    if topo.profile.emulated:
        base["GEOMX_WAN_EMULATOR"] = f"tcp://{h}:{p_emu}"
        if len(set(sites.hosts.values())) == 1:
            # every role on one host: large messages skip the emulator's process (geomx.transport.parking)
            base["GEOMX_WAN_BYPASS"] = "1"
        p = topo.profile
        if "GEOMX_PARTITION_BYTES" not in base and "GEOMX_PARTITION_BYTES" not in os.environ:
            # parts sized for the WAN (geomx.kvstore.partition.wan_partition_bytes), one value for every role
            from geomx.kvstore.partition import wan_partition_bytes
            base["GEOMX_PARTITION_BYTES"] = str(wan_partition_bytes(topo.slowest_link_bps))
            # those parts are P3's slices too: its default slices (50k elements), finer, only cost messages (up to
            # 7% of a step on 2 cores, never faster: docs/benchmarks.md, "P3's slices and the WAN's parts"). Not
            # where --p3-slice, the sync table or the [env] table gave one (sync_given), nor over one the
            # launcher's environment passes on; only P3 reads the variable
            inherited = P3_SLICE_ENV not in base and os.environ.get(P3_SLICE_ENV)
            if "slice" not in topo.sync_given and not inherited:
                base[P3_SLICE_ENV] = "0"
        specs.append(RoleSpec("wan-emulator", "emulator", node, {
            **base, "GEOMX_ROLE": "emulator", "GEOMX_EMULATOR_HOST": h, "GEOMX_EMULATOR_PORT": str(p_emu),
            "GEOMX_EMULATOR_DCS": ",".join([CENTRAL_DC, *topo.dc_names]),
            "GEOMX_EMULATOR_HOSTS": ",".join(sorted(set(sites.hosts.values()))),
            **({link_matrix.ENV: link_matrix.to_env(topo.wan_links)} if topo.wan_links else {}),
            **topo.tcp.to_env(),
            **({node_links.ENV: node_links.to_env(node_lines)} if node_lines else {}),
            **({dc_lines.ENV: dc_lines.to_env(topo.dc_line_rates())} if topo.dc_lines else {}),
            **({"GEOMX_WAN_PROFILE": p.name} if p.name != "custom" else
               {"GEOMX_WAN_RATE": f"{p.uplink_bps!r}bit", "GEOMX_WAN_RTT": f"{p.rtt_s!r}s",     # units written out
                "GEOMX_WAN_JITTER": f"{p.jitter_s!r}s"})}, pinned=True))
    glob = {"DMLC_PS_GLOBAL_ROOT_URI": h, "DMLC_PS_GLOBAL_ROOT_PORT": str(p_global),
            "DMLC_NUM_GLOBAL_SERVER": str(G), "DMLC_NUM_GLOBAL_WORKER": str(global_workers)}
    central = {"DMLC_PS_ROOT_URI": h, "DMLC_PS_ROOT_PORT": str(p_central), "DMLC_NUM_SERVER": str(G),
               "DMLC_NUM_WORKER": "1", "GEOMX_DC": CENTRAL_DC}
    specs.append(RoleSpec("global-scheduler", "scheduler", node,
                          {**base, **glob, "DMLC_ROLE_GLOBAL": "global_scheduler", "GEOMX_DC": CENTRAL_DC},
                          pinned=True))
    specs.append(RoleSpec("central-scheduler", "scheduler", node, {**base, **central, "DMLC_ROLE": "scheduler"},
                          pinned=True))
    for i in range(G):
        specs.append(RoleSpec(f"global-server-{i}", "server", node, {
            **base, **glob, **central, "DMLC_ROLE_GLOBAL": "global_server", "DMLC_ROLE": "server",
            "DMLC_NUM_ALL_WORKER": str(N), "GEOMX_RANK": str(i), **({"PORT": str(gs_ports[i])} if gs_ports else {}),
            **_site(topo, i)},
            pinned=bool(gs_ports)))
    specs.append(RoleSpec("master", "master", list(command), {
        **base, **central, "DMLC_ROLE": "worker", "DMLC_ROLE_MASTER_WORKER": "1", "DMLC_NUM_ALL_WORKER": str(N)},
        echo=True))
    index = 0
    for d, (dc, n) in enumerate(zip(topo.dc_names, topo.workers_per_dc, strict=False)):
        local = {"DMLC_PS_ROOT_URI": sites.hosts[dc], "DMLC_PS_ROOT_PORT": str(dc_ports[d]), "DMLC_NUM_WORKER": str(n),
                 "DMLC_NUM_SERVER": "0" if flat else "1", "GEOMX_DC": dc}
        specs.append(RoleSpec(f"{dc}-scheduler", "scheduler", node, {**base, **local, "DMLC_ROLE": "scheduler"},
                              dc=dc, pinned=True))
        if not flat:
            specs.append(RoleSpec(f"{dc}-server", "server", node, {**base, **local, **glob, "DMLC_ROLE": "server"},
                                  dc=dc))
        for r in range(n):
            env = {**base, **local, "DMLC_ROLE": "worker", "DMLC_NUM_ALL_WORKER": str(N), "GEOMX_RANK": str(r),
                   "GEOMX_WORKER_INDEX": str(index), "GEOMX_DC_INDEX": str(d), "GEOMX_NUM_DCS": str(n_dcs)}
            if flat:
                env.update(glob)
            if (dc, r) in topo.slowdown:
                env[SLOWDOWN_ENV] = str(topo.slowdown[(dc, r)])
            specs.append(RoleSpec(f"{dc}-worker-{r}", "worker", list(command), env, echo=True, dc=dc))
            index += 1
    return specs


def _site(topo: Topology, server: int) -> dict[str, str]:
    """Global server ``server``'s placement inside a DC's network (--global-server-dcs), if not central."""
    dcs = topo.global_server_dcs
    return {"GEOMX_SITE": dcs[server]} if dcs and dcs[server] != CENTRAL_DC else {}


def run_files(run_dir: Path, roles: list[str]) -> list[Path]:
    """What geomx writes into a run directory for one run of ``roles``: their logs, the metrics, the workers'
    results (geomx.torch.loop.write_result), the WAN link counters, the drop and abort logs and the manifest (not the
    checkpoints, nor what the training script writes itself)."""
    return [*(run_dir / f"{name}.log" for name in roles), *(run_dir / METRICS_DIR).glob("*.jsonl"),
            *run_dir.glob(f"{RESULT_PREFIX}*-*.json"), run_dir / STATS_FILE, run_dir / DROPPED_FILE,
            run_dir / ABORTED_FILE, run_dir / "launch.json"]


def clear_previous_run(run_dir: Path) -> None:
    """A run directory holds one run. Metrics files are named by process id, so a second launch into the same
    directory would otherwise add its processes to the first run's (a report would count both), and an old drop
    log would name its pids as dropped. Removes what geomx wrote for an earlier run (run_files); files the
    training script wrote there stay."""
    manifest = run_dir / "launch.json"
    if not manifest.exists():
        return
    try:
        roles = json.loads(manifest.read_text()).get("roles", [])
    except (ValueError, AttributeError):
        roles = []
    for path in run_files(run_dir, [name for name in roles if isinstance(name, str) and "/" not in name]):
        path.unlink(missing_ok=True)


def checkpoints_of(run_dir: Path) -> Path:
    """Where the run in ``run_dir`` wrote its checkpoints: what its manifest says (``--checkpoint-dir``), else
    the run directory's ``checkpoints``."""
    try:
        recorded = json.loads((run_dir / "launch.json").read_text()).get("checkpoint_dir")
    except (OSError, ValueError, AttributeError):
        recorded = None
    return Path(recorded) if isinstance(recorded, str) and recorded else run_dir / "checkpoints"


def resume_directory(previous_run: Path, run_dir: Path, workers: int, step: int | None = None) -> tuple[Path, int]:
    """The checkpoint directory of ``previous_run`` that ``--resume`` reads and the step to resume at (``step``,
    else the latest), checked before anything starts: every worker of the saved run must have a checkpoint of
    that step (geomx.torch.checkpoint)."""
    from geomx.torch.checkpoint import common_step

    if previous_run.resolve() == run_dir.resolve():
        raise ConfigError(f"--resume {previous_run}: give the resumed run its own --run-dir (its checkpoints would "
                          f"replace the ones it resumes from)")
    directory = checkpoints_of(previous_run).resolve()
    if not directory.is_dir():
        raise ConfigError(f"--resume {previous_run}: it has no checkpoints directory ({directory}; was it run with "
                          f"--checkpoint-every or --checkpoint-seconds?)")
    return directory, common_step(directory, workers, step)


class Launcher:
    def __init__(self, topo: Topology, command: list[str], *, run_dir: Path, quiet: bool = False,
                 out: TextIO | None = None, secure: bool = False, insecure: bool = False,
                 resume: Path | str | None = None, resume_step: int | None = None,
                 inject: list[str] | None = None, inject_seed: int = 0, backend: Backend | None = None,
                 restart_failed: int = 0, rejoin_after: float | None = None) -> None:
        if secure and insecure:
            raise ConfigError("--secure and --insecure contradict each other")
        # before anything starts (the roles' environment is written over them too, plan)
        refuse_launcher_variables(os.environ, "the environment geomx launch inherits")
        refuse_launcher_variables(topo.env, "the topology's env", ENV_TABLE_VARIABLES)
        backend = backend or LocalBackend()
        # across hosts, or on an address others can reach (TOML `host`), the links need the shared secret
        secure = secure or ((backend.across_hosts or not is_loopback(topo.host)) and not insecure)
        if resume is not None:
            directory, step = resume_directory(Path(resume), Path(run_dir), topo.num_all_workers, resume_step)
            # every role resumes at the same step: the workers' checkpoints and the global servers' (a server
            # optimizer's), whose rounds are the steps under FSA
            topo.env.update({"GEOMX_RESUME_FROM": str(directory), "GEOMX_RESUME_STEP": str(step)})
        elif resume_step is not None:
            raise ConfigError("--resume-step goes with --resume RUN_DIR")
        # --secure: a fresh shared secret per run; every message is then sealed (geomx.transport.security).
        # By default a fresh token per run that every connection presents (PLAIN: authenticated, not
        # encrypted, free per message); --insecure: neither, and every process says so in its log
        self.secret = secrets.token_urlsafe(32) if secure else None
        self.auth_token = secrets.token_urlsafe(32) if not secure and not insecure else None
        self.insecure = insecure
        self.topo, self.command, self.run_dir, self.quiet = topo, command, Path(run_dir), quiet
        # every role writes its checkpoints here (GEOMX_CHECKPOINT_DIR: --checkpoint-dir, else the run directory's)
        given = topo.env.get("GEOMX_CHECKPOINT_DIR")
        self.checkpoint_dir = (checkpoint_path(given, "GEOMX_CHECKPOINT_DIR") if given
                               else self.run_dir / "checkpoints").resolve()
        topo.env["GEOMX_CHECKPOINT_DIR"] = str(self.checkpoint_dir)
        # whether this run writes checkpoints (--checkpoint-every, --checkpoint-seconds)
        self.checkpoints = any((topo.env.get(v) or "0").strip() not in ("", "0")
                               for v in ("GEOMX_CHECKPOINT_EVERY", "GEOMX_CHECKPOINT_SECONDS"))
        self.out = out or sys.stdout
        self.running: list[Running] = []
        self._print_lock = threading.Lock()
        self.progress = None        # geomx.cli.progress.Progress while the deployment runs (not with quiet)
        self.injector = Injector(parse_faults(inject), seed=inject_seed) if inject else None   # --inject
        self.losses: Losses | None = None      # the workers and DCs the run may lose (set at start)
        self.backend = backend      # where the roles run
        if restart_failed < 0:
            raise ConfigError(f"--restart-failed must be >= 0, got {restart_failed}")
        self.restart_failed = restart_failed    # geomx.cli.restarts
        if rejoin_after is not None and not (math.isfinite(rejoin_after) and rejoin_after >= 0):   # NaN too
            raise ConfigError(f"--rejoin-after must be a finite number of seconds >= 0, got {rejoin_after:g}")
        self.rejoin_after = rejoin_after        # geomx.cli.rejoins
        self._failed: Running | None = None      # the role whose failure stopped the last attempt

    def say(self, text: str) -> None:
        with self._print_lock:
            if self.progress is None or not self.progress.print(text):
                print(text, file=self.out, flush=True)

    def run(self, timeout: float | None = None) -> int:
        """Start everything, wait, tear down. Returns the exit code for the launcher."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.checkpoints:
            claim_checkpoint_dir(self.checkpoint_dir, self.run_dir)
        clear_previous_run(self.run_dir)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        self._interrupted = None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            code = self._run(timeout)
            for attempt in range(1, self.restart_failed + 1):
                if code != 1 or self._failed is None or self._interrupted is not None:
                    break
                self._restart(attempt)
                code = self._run(None if deadline is None else max(1.0, deadline - time.monotonic()))
            return code
        finally:
            self.backend.close()
            for s, h in old.items():
                signal.signal(s, h)

    def _on_signal(self, signum, _frame) -> None:
        self._interrupted = signum

    def _restart(self, attempt: int) -> None:
        """Archive the failed attempt and point every role at the latest checkpoint (geomx.cli.restarts)."""
        from geomx.cli.restarts import archive_attempt, restart_step

        archived = archive_attempt(self.run_dir, attempt, [r.spec.name for r in self.running])
        directory = self.checkpoint_dir
        step = restart_step(directory, self.topo.num_all_workers, self.topo.global_servers)
        if step is not None:
            self.topo.env.update({"GEOMX_RESUME_FROM": str(directory.resolve()), "GEOMX_RESUME_STEP": str(step)})
        start = (f"from step {step}" if step is not None else
                 f"from step {self.topo.env['GEOMX_RESUME_STEP']} of --resume" if "GEOMX_RESUME_STEP" in self.topo.env
                 else "afresh (no step every worker checkpointed yet)")
        self.say(f"geomx: restarting the job {start} (restart {attempt} of {self.restart_failed}); the failed "
                 f"attempt's logs are in {archived}")
        self.running = []

    def _run(self, timeout: float | None) -> int:
        self._started, self._failed = time.time(), None
        sites = self.backend.sites(self.topo)
        specs = plan(self.topo, self.command, self.run_dir, secret=self.secret, auth_token=self.auth_token,
                     sites=sites)
        if self.insecure:
            for spec in specs:
                spec.env["GEOMX_INSECURE"] = "1"
        if self.injector is not None:
            emulators = [s for s in specs if s.kind == "emulator"]
            self.injector.bind([s.name for s in specs], [s.name for s in specs if s.kind == "worker"],
                               dcs=[*self.topo.dc_names, CENTRAL_DC] if emulators else [])
            for spec in emulators:
                spec.env[outage_plan.ENV] = outage_plan.to_env(self.injector.wan_outages())
        self._write_manifest(specs)
        flat = self.topo.topology == "flat"
        self.drops = DropLog(self.run_dir)
        self.aborts = DropLog(self.run_dir, file=ABORTED_FILE)     # members whose own abort stopped a tier
        # a role that exits with an error is a fault its deployment absorbs only if its scheduler drops it within
        # the heartbeat deadline (and a little): until then it is undecided
        env = self._role_env()
        self._drop_grace_s = env_heartbeat_timeout(env)[0] + 3.0
        self._undecided: list[Running] = []
        self.rejoins = Rejoins(self.rejoin_after) if self.rejoin_after is not None and not flat else None
        self.losses = Losses({s.name: DcRole(s.kind, s.dc) for s in specs if s.dc is not None},
                             min_workers=None if flat else env_int(env, MIN_WORKERS_ENV, "launcher", 1),
                             min_dcs=None if flat else env_int(env, MIN_DCS_ENV, "launcher", 1))
        try:
            self.backend.prepare(specs)
            for spec in specs:
                running = self._start(spec)
                if spec.kind == "emulator":
                    self._wait_for_channel(running)
            self._write_manifest(specs)         # again, with where each role runs
            if not self.quiet:
                p = self.topo.profile
                self.say(f"geomx: {len(specs)} processes up ({self.topo.topology}, {self.topo.mode}, "
                         f"{self.topo.dcs} DCs x {self.topo.workers_per_dc} workers, {self.topo.global_servers} "
                         f"global server(s), WAN {p.name}: {p.description}"
                         + (f"; own settings for {link_matrix.describe(self.topo.wan_links)}" if self.topo.wan_links
                            else "") + self._tcp_description() + f"); {self._security_description()}; logs in "
                         f"{self.run_dir}")
                from geomx.cli.progress import Progress
                self.progress = Progress(self.run_dir, self.out)
                self.progress.start()
            return self._monitor(timeout)
        finally:
            if self.progress is not None:
                self.progress.stop()
                self.progress = None
            self._stop_all()

    def _wait_for_channel(self, emulator: Running) -> None:
        """Where roles park their messages (one host) and run on this machine, start them once the emulator listens
        on its same-host channel: a van looks for it once, when it starts (geomx.transport.park_channel)."""
        env = emulator.spec.env
        if env.get("GEOMX_WAN_BYPASS") == "1" and not self.backend.across_hosts:
            wait_for_channel(env["GEOMX_WAN_EMULATOR"], timeout_s=30.0, alive=lambda: emulator.proc.poll() is None)

    # -----------------------------------------------------------------------------------------------------
    def _write_manifest(self, specs: list[RoleSpec]) -> None:
        p = self.topo.profile
        manifest = {"topology": self.topo.topology, "mode": self.topo.mode, "dcs": self.topo.dc_names,
                    "workers_per_dc": self.topo.workers_per_dc, "global_servers": self.topo.global_servers,
                    "wan": {"profile": p.name, "uplink_bps": p.uplink_bps, "downlink_bps": p.downlink_bps,
                            "rtt_s": p.rtt_s, "jitter_s": p.jitter_s,
                            # what else the emulator was told: every link's TCP, per-link overrides, lines
                            "tcp": dataclasses.asdict(self.topo.tcp),
                            "links": link_matrix.to_env(self.topo.wan_links) if self.topo.wan_links else None,
                            "dc_lines": dc_lines.to_env(self.topo.dc_line_rates()) if self.topo.dc_lines else None,
                            "global_server_link_bps": self.topo.global_server_link_bps,
                            "global_server_dcs": self.topo.global_server_dcs or None},
                    "command": self.command, "roles": [s.name for s in specs], "started": self._started,
                    "slowdown": {f"{dc}:{r}": f for (dc, r), f in sorted(self.topo.slowdown.items())},
                    "backend": self.backend.name, "placement": self.backend.placement(),
                    "checkpoint_dir": str(self.checkpoint_dir)}
        (self.run_dir / "launch.json").write_text(json.dumps(manifest, indent=2))

    def _start(self, spec: RoleSpec, *, env: dict[str, str] | None = None, log_name: str | None = None) -> Running:
        log_path = self.run_dir / (log_name or f"{spec.name}.log")
        on_line = None
        if spec.echo and not self.quiet:
            prefix = spec.name.replace("-worker-", "/")

            def on_line(line: str) -> None:
                self.say(f"[{prefix}] {line}")
        running = Running(spec, self.backend.start(spec, spec.env if env is None else env, log_path, on_line),
                          log_path)
        self.running.append(running)
        return running

    def _security_description(self) -> str:
        if self.secret:
            name = encryption_of(self._role_env())
            return f"every message encrypted and authenticated ({ENCRYPTION_LABELS.get(name, name)})"
        if self.auth_token:
            return "connections authenticated with this run's token, messages not encrypted (--secure encrypts)"
        return "no authentication (--insecure)"

    def _tcp_description(self) -> str:
        tcp = self.topo.tcp
        if not tcp.limits:
            return ""
        window = f", window {tcp.window_bytes:,} B" if tcp.window_bytes is not None else ""
        return (f"; TCP: loss {tcp.loss:.4%}, {tcp.streams} stream(s) per link{window}, slowest link "
                f"{self.topo.slowest_link_bps / 1e6:.3g} Mbit/s")

    def _monitor(self, timeout: float | None) -> int:
        start = time.monotonic()
        trainers_done_at: float | None = None
        while True:
            trainers = [r for r in self.running if r.spec.kind in ("worker", "master")]
            if self._interrupted is not None:
                self.say("geomx: interrupted; stopping every process")
                return 130
            ended, undecided = [], self._undecided
            for r in self.running:
                if r.returncode is None:
                    r.returncode = r.proc.poll()
                    if r.returncode not in (None, 0) and not (r.spec.kind == "emulator" and trainers_done_at):
                        r.ended_at = time.monotonic()
                        ended.append(r)
            failed, self._undecided = [], []
            self._lose_dcs_dropped_while_running(time.monotonic() - start)
            # a DC's scheduler or server first: when one of them ended, the DC drops out whole, its workers with it
            for r in sorted(undecided + ended, key=lambda r: r.spec.kind == "worker"):
                line = self._verdict(r, time.monotonic() - start)
                if line is None:
                    failed.append(r)
                elif line is _WAIT:
                    self._undecided.append(r)
                elif line:
                    self.say(line)
                if line is not None and line is not _WAIT and self.rejoins is not None:
                    self.rejoins.note_loss(r, self.losses, self.drops.restartable())
            if failed:
                self._report_failure(min(failed, key=_blame_order), time.monotonic() - start)
                return 1
            if trainers_done_at is None and self._trainers_done(trainers, time.monotonic() - start):
                trainers_done_at = time.monotonic()
            if trainers_done_at is not None:
                infra = [r for r in self.running if r.spec.kind in ("scheduler", "server")
                         and not self.losses.absorbed(r.spec.name)]
                if all(r.returncode == 0 for r in infra):
                    if not self.quiet:
                        took = f"{time.monotonic() - start:.1f} s; logs in {self.run_dir}"
                        self.say(f"geomx: training finished without {self.losses.summary()}; the other processes "
                                 f"exited in {took}" if self.losses else
                                 f"geomx: all {len(self.running)} processes finished in {took}")
                    return 0
                if self._no_trainer_joined():
                    self.say("geomx: the training command exited without joining the deployment: no worker created "
                             "a geomx kvstore (geomx.kvstore.create, or DistributedOptimizer), so the servers and "
                             "schedulers would wait for workers that never come; stopping them")
                    return 1
                if time.monotonic() - trainers_done_at > INFRA_EXIT_GRACE_S:
                    stuck = ", ".join(r.spec.name for r in infra if r.returncode is None)
                    self.say(f"geomx: training finished but {stuck} did not exit within {INFRA_EXIT_GRACE_S:g} s")
                    return 1
            if timeout is not None and time.monotonic() - start > timeout:
                self.say(f"geomx: the run exceeded --timeout {timeout:g} s; stopping every process")
                return 124
            if self.injector is not None:
                self.injector.tick(time.monotonic() - start, self._alive(), self.say)
            if self.rejoins is not None and trainers_done_at is None:
                self.rejoins.tend(self.running, self.losses, self.drops.restartable(), self._restart_role, self.say,
                                  time.monotonic() - start)
            time.sleep(0.1)

    def _verdict(self, r: Running, elapsed_s: float) -> str | None:
        """Whether the run goes on without ``r``, which ended with an error: the line to print ("" to print
        nothing), None to stop the run, or _WAIT. A role its scheduler dropped, or one killed by a signal (its
        scheduler drops it once its connection closes), is a fault the run may absorb (Losses). One that exited
        with an error is its own failure, unless its scheduler drops it (or its DC) within the grace window: a
        role that gave up on a lost peer, or that ran again after it was dropped, exits with an error too."""
        if self.losses.absorbed(r.spec.name):
            return ""
        if not self.losses.may_absorb(r.spec.name):     # a central role, or the flat topology: no fault domain
            return None
        if r.rejoined:      # a restarted worker that failed (say, refused its place) leaves its DC as it was
            return self.losses.judge(r.spec.name, f"{_how_it_ended(r.returncode)} at {elapsed_s:.1f} s after it "
                                                  f"was restarted (see {r.log_path.name})")
        if r.proc.pid in self.drops.refresh() or r.returncode < 0:
            return self.losses.judge(r.spec.name, f"{_how_it_ended(r.returncode)} at {elapsed_s:.1f} s")
        return _WAIT if time.monotonic() - r.ended_at < self._drop_grace_s else None

    def _lose_dcs_dropped_while_running(self, elapsed_s: float) -> None:
        """A DC's local server its tier dropped while its process still runs (frozen, or cut off behind the WAN)
        loses its DC as an ended one would: what the DC's other roles do next is then absorbed, and
        --rejoin-after restarts the DC (killing what is left of it first)."""
        dropped = self.drops.refresh()
        for r in self.running:
            if r.returncode is not None or r.spec.kind == "worker" or r.proc.pid not in dropped \
                    or not self.losses.may_absorb(r.spec.name) or self.losses.absorbed(r.spec.name):
                continue
            line = self.losses.judge(r.spec.name, f"was dropped by its tier at {elapsed_s:.1f} s and is still running "
                                                  "(frozen or cut off)")
            if line:
                self.say(line)
            if line is not None and self.rejoins is not None:
                self.rejoins.note_loss(r, self.losses, self.drops.restartable())

    def _restart_role(self, old: Running, log_name: str) -> None:
        """Start ``old``'s role again to rejoin the running job (geomx.cli.rejoins), in its place in the list."""
        self.running.remove(old)
        self._start(old.spec, env=Rejoins.env(old.spec.env), log_name=log_name).rejoined = True

    def _no_trainer_joined(self) -> bool:
        """No worker or master ever started a geomx node: each writes its metrics file (geomx.metrics) when its
        node starts, before it joins, so after the trainers exited, none here means none joined. Only where every
        role writes into this host's run directory."""
        if self.backend.across_hosts:
            return False
        metrics = self.run_dir / "metrics"
        return not any(next(metrics.glob(f"{role}-*.jsonl"), None) for role in ("worker", "master"))

    def _trainers_done(self, trainers: list[Running], elapsed_s: float) -> bool:
        """Every trainer exited 0 or was lost. A worker still frozen (SIGSTOP) when all the others are done was
        dropped by its DC (they could not have finished otherwise): it is lost too."""
        pending = [r for r in trainers if r.returncode != 0 and r.spec.name not in self.losses.lost
                   and not self.losses.absorbed(r.spec.name)]
        if any(r.returncode is not None for r in pending):       # ended with an error, not yet judged
            return False
        if not pending or any(r.returncode is None and not r.proc.is_stopped() for r in pending):
            return not pending
        for r in pending:
            line = self.losses.judge(r.spec.name, f"is frozen (stopped) at {elapsed_s:.1f} s")
            if line is None:
                return False
            if line:
                self.say(line)
        return True

    def _role_env(self) -> dict[str, str]:
        """The variables every role reads its settings from: the topology's over the launcher's own (as
        LocalBackend.start gives them; a Ray role gets the launcher's GEOMX_/DMLC_ ones)."""
        return {**os.environ, **self.topo.env}

    def _report_failure(self, r: Running, elapsed_s: float) -> None:
        self._failed = r
        how = _how_it_ended(r.returncode)
        # a role that gave up on a peer across an injected WAN fault: the fault is the cause to read first
        wan_faults = self.injector.wan_faults_in_effect(elapsed_s) if self.injector is not None else []
        if wan_faults:
            how += f" during the injected {', '.join(wan_faults)}"
        r.proc.finish_output(2.0)
        tail = _tail(r.log_path, 30)
        # a role stopped by a signal (SIGSTOP, a debugger, a frozen VM) never exits: whoever gave up waiting for it
        # (a scheduler's heartbeat check, a peer's deadline) fails instead; the headline names the frozen one
        frozen = [x.spec.name for x in self.running if x.returncode is None and x.proc.is_stopped()]
        if frozen:
            self.say(f"geomx: role {', '.join(frozen)} is frozen (stopped, not running); {r.spec.name} gave up "
                     f"waiting for it ({how}); stopping every process. Last lines of {r.log_path}:\n{tail}")
            return
        origin = self._abort_origin() if r.returncode >= 0 else None     # a signal is a cause of its own
        if origin is not None and origin is not r:
            # where a scheduler saw the failure begin (a worker that died of an error aborted, a role that
            # registered a wrong count): the schedulers it reached stopped sooner than it did
            origin.proc.finish_output(2.0)
            state = _how_it_ended(origin.returncode) if origin.returncode is not None else "still running"
            self._failed = origin
            self.say(f"geomx: role {origin.spec.name} failed the run: {self.aborts.reasons[origin.proc.pid]} "
                     f"({state}; {r.spec.name} {how}); stopping every process. Last lines of {origin.log_path}:\n"
                     f"{_tail(origin.log_path, 30)}")
            return
        self.say(f"geomx: role {r.spec.name} {how}; stopping every process. Last lines of {r.log_path}:\n{tail}")

    def _abort_origin(self) -> Running | None:
        """The role whose own abort a scheduler recorded first (geomx.dropped), if it is one of ours."""
        by_pid = {r.proc.pid: r for r in self.running}
        self.aborts.refresh()
        return next((by_pid[pid] for pid in self.aborts.order if pid in by_pid), None)

    def _alive(self) -> dict[str, RoleHandle]:
        """Role name -> handle of every role still running."""
        return {r.spec.name: r.proc for r in self.running if r.returncode is None}

    def _stop_all(self) -> None:
        if self.injector is not None:
            self.injector.release(self._alive())
        alive = [r for r in self.running if r.proc.poll() is None]
        for r in alive:
            r.proc.signal(signal.SIGTERM)
            r.proc.signal(signal.SIGCONT)      # a frozen role handles SIGTERM once it runs
        deadline = time.monotonic() + 5.0
        for r in alive:
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.signal(signal.SIGKILL)
                r.proc.wait(timeout=5)
        for r in self.running:
            r.proc.finish_output(2.0)


_WAIT = object()      # Launcher._verdict: not decided yet


def _how_it_ended(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _blame_order(r: Running) -> tuple[int, int]:
    """Which of the roles found failed in one poll to name: one killed by a signal (the cause) before one that
    exited with an error (often a peer giving up on it), a trainer or server before a scheduler."""
    return (0 if r.returncode < 0 else 1, 1 if r.spec.kind == "scheduler" else 0)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:]) or "    (empty log)"
