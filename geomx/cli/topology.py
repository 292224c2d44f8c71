"""A deployment to start on one machine: DCs, workers, global servers, WAN profile, mode.

Read from a TOML file and/or command-line flags (flags win). Example topo.toml:

    dcs = 2
    workers_per_dc = [2, 3]      # or one number for every DC
    global_servers = 1
    mode = "dist_sync"           # or "dist_async"
    mixedsync = "overlap"        # dist_async: local servers answer without waiting for the WAN (default "wait")
    topology = "hips"            # or "flat"
    wan = "transpacific"         # a profile name, or a table: wan = { rate = "100mbit", rtt = "180ms" }
    slowdown = ["b=3", "a:1=2"]  # DC[:RANK]=FACTOR: those workers compute FACTOR times slower
    sync = "hfa"                 # or a table: sync = { algorithm = "hfa", k1 = 20, k2 = 10 } (geomx.sync)
    global_server_link = "1gbit" # each global server on a line of its own (geomx.netem.node_links)
    global_server_dcs = ["a", "b"]  # where each global server sits: "central" (default) or inside a DC
    wan_dc_lines = true          # each DC's cross-DC traffic shares one line (geomx.netem.dc_lines)
"""
from __future__ import annotations

import os
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field

from geomx.compat import check as check_combination
from geomx.config import MIXEDSYNC, MODES, TOPOLOGIES, env_checkpoint_seconds
from geomx.errors import ConfigError
from geomx.netem.link_matrix import assignments, parse_link_overrides
from geomx.netem.tcp_model import TcpPath, tcp_path
from geomx.profiles import CENTRAL_DC, WanProfile, custom_profile, get_profile, parse_duration, parse_rate
from geomx.sync.settings import (ALGORITHM_OPTIONS, ALGORITHMS, GEOMX_HFA_ENV, GEOMX_P3_ENV, OPTIONS, SYNC_ENV,
                                 algorithms_taking, launch_env, settings_from_env)
from geomx.sync.slowdown import parse_factor

# sync option -> the geomx launch flag that sets it (load_topology's sync_<option>); errors name the flag
SYNC_FLAGS = {"k1": "--hfa-k1", "k2": "--hfa-k2", "overlap": "--hfa-overlap", "overlap_keep": "--hfa-overlap-keep",
              "dc_sync": "--hfa-dc-sync", "dc_overlap": "--hfa-dc-overlap", "delay": "--dga-delay",
              "steps": "--esync-steps", "slice": "--p3-slice"}


# What the launcher writes itself for the WAN emulator and every role, and where it takes each from. One inherited
# from the launcher's environment, or set in a topology file's [env] table, had reached the emulator behind the
# launcher's back: it announced one WAN and the emulator ran another (GEOMX_WAN_PROFILE over --wan-rate)
_STARTS_THE_EMULATOR = "--wan decides it: the launcher starts the WAN emulator and points every role at it"
LAUNCHER_VARIABLES = {
    "GEOMX_WAN_PROFILE": "give --wan or the TOML key wan instead",
    "GEOMX_WAN_RATE": "give --wan-rate or the TOML key wan = { rate = ... } instead",
    "GEOMX_WAN_RTT": "give --wan-rtt or the TOML key wan = { rtt = ... } instead",
    "GEOMX_WAN_JITTER": "give the TOML key wan = { jitter = ... } instead",
    "GEOMX_WAN_LINKS": "give --wan-link or the TOML key wan_links instead",
    "GEOMX_WAN_LOSS": "give --wan-loss or the TOML key wan_loss instead",
    "GEOMX_WAN_STREAMS": "give --wan-streams or the TOML key wan_streams instead",
    "GEOMX_WAN_WINDOW": "give --wan-window or the TOML key wan_window instead",
    "GEOMX_WAN_SLOW_START": "give --wan-slow-start or the TOML key wan_slow_start instead",
    "GEOMX_WAN_NODE_LINKS": "give --global-server-link or the TOML key global_server_link instead",
    "GEOMX_WAN_DC_LINES": "give --wan-dc-lines or the TOML key wan_dc_lines instead",
    "GEOMX_WAN_OUTAGES": "give --inject partition:DC@T+D or slow:DC@T+D=RATE instead",
    "GEOMX_WAN_EMULATOR": _STARTS_THE_EMULATOR,
    "GEOMX_WAN_BYPASS": _STARTS_THE_EMULATOR,
    "GEOMX_EMULATOR_HOST": _STARTS_THE_EMULATOR,
    "GEOMX_EMULATOR_PORT": _STARTS_THE_EMULATOR,
    "GEOMX_EMULATOR_DCS": _STARTS_THE_EMULATOR,
    "GEOMX_EMULATOR_HOSTS": _STARTS_THE_EMULATOR,
    "GEOMX_ROLE": "the launcher gives each role its own",
}
# a topology file's [env] table also overrides what the launcher writes for every role from these
ENV_TABLE_VARIABLES = {**LAUNCHER_VARIABLES, "GEOMX_MODE": "give --mode or the TOML key mode instead",
                       "GEOMX_MIXEDSYNC": "give --mixedsync or the TOML key mixedsync instead",
                       "GEOMX_TOPOLOGY": "give --topology or the TOML key topology instead"}


def refuse_launcher_variables(env: Mapping[str, str], source: str,
                              variables: Mapping[str, str] = LAUNCHER_VARIABLES) -> None:
    """Refuse ``env`` (described by ``source``) setting a variable the launcher sets itself, naming each one and the
    flag or topology key to use instead."""
    stray = [var for var in variables if env.get(var)]
    if stray:
        raise ConfigError(f"{source} sets variables geomx launch sets itself: "
                          + "; ".join(f"{var}={env[var]!r} ({variables[var]})" for var in stray))


# what Topology.validate's combination check reads besides the topology itself, named when inherited
ALGORITHM_VARIABLES = (SYNC_ENV, GEOMX_HFA_ENV, GEOMX_P3_ENV, *(var for var, _, _ in OPTIONS.values()),
                       "GEOMX_CHECKPOINT_SECONDS")


@dataclass
class Topology:
    dcs: int = 2
    workers_per_dc: list[int] = field(default_factory=lambda: [2, 2])
    global_servers: int = 1
    mode: str = "dist_sync"
    mixedsync: str = "wait"          # dist_async only (geomx.config.MIXEDSYNC)
    topology: str = "hips"
    profile: WanProfile = field(default_factory=lambda: get_profile("regional"))
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)   # extra variables for every role
    # the sync options the flags or the file gave (env holds every option of the algorithm, defaults written out)
    sync_given: frozenset[str] = frozenset()
    slowdown: dict[tuple[str, int], float] = field(default_factory=dict)   # (dc, rank) -> factor
    wan_links: dict = field(default_factory=dict)   # (src, dst) -> link_matrix.LinkSpec: per-link overrides
    tcp: TcpPath = field(default_factory=TcpPath)   # loss, streams, window, slow start: every link's TCP
    global_server_link_bps: float | None = None     # each global server's own line (node link), if any
    # the DC each global server's network is (MultiGPS placement): CENTRAL_DC, or a DC's name; its traffic with
    # that DC's nodes then crosses no WAN link
    global_server_dcs: list[str] = field(default_factory=list)
    dc_lines: bool = False          # each DC's traffic to every other shares one line, at its link's rate

    def dc_line_rates(self) -> dict[str, tuple[float, float]]:
        """Each DC's line (``dc_lines``): up at the rate of its link to the central party, down at the central
        party's link to it (overrides included), so an asymmetric profile keeps its downlink."""
        if not self.dc_lines:
            return {}
        return {dc: (self._link_rate(dc, CENTRAL_DC), self._link_rate(CENTRAL_DC, dc)) for dc in self.dc_names}

    def _link_rate(self, src: str, dst: str) -> float:
        spec = self.wan_links.get((src, dst))
        return spec.rate_bps if spec is not None else self.profile.rate_for(src, dst)

    @property
    def fixed_ports(self) -> int:
        """How many ports the deployment's listening roles bind at fixed numbers (geomx.cli.backends.Sites): the
        global and central schedulers, the WAN emulator, each DC's scheduler, and each global server whose node
        link the emulator knows by its address."""
        return 3 + self.dcs + (self.global_servers if self.global_server_link_bps else 0)

    @property
    def slowest_link_bps(self) -> float:
        """The slowest emulated link's goodput, overrides, the TCP ceiling and the global servers' own lines
        included (what WAN-sized parts are cut for)."""
        p = self.profile
        return min([self.tcp.goodput_bps(rate, p.rtt_s) for rate in (p.uplink_bps, p.downlink_bps)]
                   + [s.tcp(self.tcp).goodput_bps(s.rate_bps, s.rtt_s) for s in self.wan_links.values()]
                   + ([self.global_server_link_bps] if self.global_server_link_bps else []))

    @property
    def dc_names(self) -> list[str]:
        return [dc_name(i) for i in range(self.dcs)]

    @property
    def num_all_workers(self) -> int:
        return sum(self.workers_per_dc)

    def validate(self) -> Topology:
        if self.dcs < 1:
            raise ConfigError(f"--dcs must be >= 1, got {self.dcs}")
        if len(self.workers_per_dc) != self.dcs:
            raise ConfigError(f"workers_per_dc lists {len(self.workers_per_dc)} DCs but dcs = {self.dcs}")
        if any(n < 1 for n in self.workers_per_dc):
            raise ConfigError(f"every DC needs >= 1 worker, got workers_per_dc = {self.workers_per_dc}")
        if self.global_servers < 1:
            raise ConfigError(f"--global-servers must be >= 1, got {self.global_servers}")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; modes are {', '.join(MODES)}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"unknown topology {self.topology!r}; topologies are {', '.join(TOPOLOGIES)}")
        if self.mixedsync not in MIXEDSYNC:
            raise ConfigError(f"unknown MixedSync variant {self.mixedsync!r}; variants are {', '.join(MIXEDSYNC)}")
        # what the roles read: the launcher's environment with the topology's over it (LocalBackend), so an
        # algorithm exported in the shell (ENABLE_P3=1, GEOMX_SYNC) is checked too, not first refused by the master
        env = {**os.environ, **self.env}
        try:
            sync = settings_from_env(env)
            check_combination(mode=self.mode, mixedsync=self.mixedsync, topology=self.topology, sync=sync.algorithm,
                              k2=sync.k2, weights=sync.weights, checkpoint_seconds=env_checkpoint_seconds(env) or None)
        except ConfigError as exc:
            inherited = [f"{var}={os.environ[var]}" for var in ALGORITHM_VARIABLES
                         if os.environ.get(var) and var not in self.env]
            if inherited:
                raise ConfigError(f"{exc} ({', '.join(inherited)} in the environment geomx launch inherits)") from None
            raise
        return self


def dc_name(i: int) -> str:
    letters = string.ascii_lowercase
    return letters[i] if i < 26 else f"dc{i}"


def _wan_from(value, where: str = "") -> WanProfile:
    if isinstance(value, str):
        return get_profile(value)
    if isinstance(value, dict):
        unknown = set(value) - {"rate", "rtt", "jitter"}
        if unknown or "rate" not in value or "rtt" not in value:
            raise ConfigError(f"wan table needs 'rate' and 'rtt' (and optionally 'jitter'), got {sorted(value)}")
        return custom_profile(_read(parse_rate, value["rate"], f"wan.rate{where}"),
                              _read(parse_duration, value["rtt"], f"wan.rtt{where}"),
                              _read(parse_duration, value.get("jitter", "0ms"), f"wan.jitter{where}"))
    raise ConfigError(f"wan must be a profile name or a table, got {value!r}")


def _read(parse, value, what: str):
    """``parse(str(value))``, its error naming the flag or key ``what`` the value came from."""
    try:
        return parse(str(value))
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def load_topology(path: str | None = None, **flags) -> Topology:
    """Build a Topology from a TOML file (optional) overridden by non-None ``flags``."""
    data: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"topology file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"topology file {path} is not valid TOML: {exc}") from None
        known = {"dcs", "workers_per_dc", "global_servers", "mode", "mixedsync", "topology", "wan", "env", "host",
                 "slowdown", "wan_links", "wan_loss", "wan_streams", "wan_window", "wan_slow_start",
                 "global_server_link", "global_server_dcs", "wan_dc_lines", "sync"}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"topology file {path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    file_sync = data.get("sync")
    data.update({k: v for k, v in flags.items() if v is not None})
    if isinstance(file_sync, dict) and isinstance(flags.get("sync"), str):
        # --sync names the algorithm; the file's options that algorithm takes still apply (k1 = 20 under --sync
        # diloco: replaced whole, the table fell back to K1 = 1 without a word), the others' do not
        data["sync"] = {"algorithm": flags["sync"], **{k: v for k, v in file_sync.items()
                                                       if k != "algorithm" and flags["sync"] in algorithms_taking(k)}}
    where = f" in {path}" if path else ""
    topo = Topology()
    topo.dcs = _whole(data.get("dcs", topo.dcs), "dcs", where)
    wpd = data.get("workers_per_dc", 2)
    topo.workers_per_dc = ([_whole(x, "workers_per_dc", where) for x in wpd] if isinstance(wpd, list)
                           else [_whole(wpd, "workers_per_dc", where)] * topo.dcs)
    topo.global_servers = _whole(data.get("global_servers", topo.global_servers), "global_servers", where)
    topo.mode = _text(data.get("mode", topo.mode), "mode", where)
    topo.mixedsync = _text(data.get("mixedsync", topo.mixedsync), "mixedsync", where)
    topo.topology = _text(data.get("topology", topo.topology), "topology", where)
    custom = [f"--{k.replace('_', '-')} {flags[k]}" for k in ("wan_rate", "wan_rtt") if flags.get(k) is not None]
    if flags.get("wan") is not None and custom:
        # alternatives (README's synopsis): one of them had been dropped without a word (a file's wan is another
        # matter: flags override the file)
        raise ConfigError(f"--wan {flags['wan']} and {' '.join(custom)} contradict each other: --wan names a WAN "
                          f"profile, --wan-rate with --wan-rtt a custom WAN; give one of them")
    if "wan_rate" in data or "wan_rtt" in data:
        if "wan_rate" not in data or "wan_rtt" not in data:
            raise ConfigError("--wan-rate and --wan-rtt go together")
        topo.profile = custom_profile(_read(parse_rate, data["wan_rate"], "--wan-rate"),
                                      _read(parse_duration, data["wan_rtt"], "--wan-rtt"))
    elif "wan" in data:
        topo.profile = _wan_from(data["wan"], where)
    topo.host = _text(data.get("host", topo.host), "host", where)
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise ConfigError(f"env{where} must be a table of variables, got {env!r}")
    topo.env = {str(k): str(v) for k, v in env.items()}
    refuse_launcher_variables(topo.env, f"the [env] table{where}", ENV_TABLE_VARIABLES)
    sync = _sync_table(data, where)
    in_env = {name: topo.env[var] for name, (var, *_) in OPTIONS.items() if var in topo.env}   # [env]'s options
    if sync:        # before validate: --sync's GEOMX_SYNC is what the roles read, not one the launcher inherits
        # an option of the algorithm that only the [env] table sets is the table's, not the default written out
        # over it (checked as the flags' are)
        taken = ALGORITHM_OPTIONS.get(sync.get("algorithm"), ())
        sync = {**{name: value for name, value in in_env.items() if name in taken}, **sync}
        topo.env.update(launch_env(sync, where))
        topo.sync_given = frozenset(sync) - {"algorithm"}
    else:
        topo.sync_given = frozenset(in_env)
    topo.validate()
    topo.slowdown = parse_slowdown(data.get("slowdown"), topo.dc_names, topo.workers_per_dc, where)
    if data.get("wan_links"):
        if not topo.profile.emulated:
            raise ConfigError(f"wan_links{where} need an emulated WAN (--wan {topo.profile.name} has none)")
        topo.wan_links = parse_link_overrides(data["wan_links"], topo.dc_names, where,
                                              "--wan-link" if flags.get("wan_links") is not None else "wan_links")
    if any(data.get(k) is not None for k in ("wan_loss", "wan_streams", "wan_window", "wan_slow_start")):
        if not topo.profile.emulated:
            raise ConfigError(f"wan_loss/wan_streams/wan_window/wan_slow_start{where} need an emulated WAN (--wan "
                              f"{topo.profile.name} has none)")
        loss = data.get("wan_loss")
        if isinstance(loss, str) and loss.strip().lower() == "profile":
            if topo.profile.name == "custom":       # it has no loss figure: 0 would be taken without a word
                by = "--wan-loss" if flags.get("wan_loss") is not None else f"wan_loss{where}"
                custom_by = "--wan-rate/--wan-rtt make" if "wan_rate" in data else f"the wan table{where} makes"
                raise ConfigError(f"{by} profile takes a WAN profile's own loss, but {custom_by} a custom WAN, "
                                  f"which has none: give the loss as a number, e.g. 0.01%")
            loss = topo.profile.loss        # the loss such a path typically sees (geomx.profiles)
        topo.tcp = tcp_path(loss=loss, streams=data.get("wan_streams"),
                            window=data.get("wan_window"), slow_start=data.get("wan_slow_start"), where=where,
                            names={"streams": "wan_streams (--wan-streams)", "window": "wan_window (--wan-window)",
                                   "slow_start": "wan_slow_start (--wan-slow-start)"})
    if data.get("global_server_link") is not None:
        if not topo.profile.emulated:
            raise ConfigError(f"global_server_link{where} (--global-server-link) needs an emulated WAN (--wan "
                              f"{topo.profile.name} has none)")
        topo.global_server_link_bps = _read(parse_rate, data["global_server_link"],
                                            f"global_server_link{where} (--global-server-link)")
    if data.get("wan_dc_lines"):
        if not topo.profile.emulated:
            raise ConfigError(f"wan_dc_lines{where} (--wan-dc-lines) needs an emulated WAN (--wan {topo.profile.name} "
                              f"has none)")
        if not isinstance(data["wan_dc_lines"], bool):
            raise ConfigError(f"wan_dc_lines{where} must be true or false, got {data['wan_dc_lines']!r}")
        topo.dc_lines = True
    if data.get("global_server_dcs") is not None:
        topo.global_server_dcs = parse_global_server_dcs(data["global_server_dcs"], topo, where)
    return topo


def _sync_table(data: dict, where: str) -> dict:
    """The ``sync`` table (or algorithm name) with the ``--sync`` sub-option flags (``sync_<option>``) merged in."""
    sync = data.get("sync")
    if sync is not None and not isinstance(sync, (str, dict)):
        raise ConfigError(f"sync{where} must be an algorithm name or a table, got {sync!r}")
    table = dict(sync) if isinstance(sync, dict) else ({"algorithm": sync} if sync is not None else {})
    flagged = {k: data[f"sync_{k}"] for k in SYNC_FLAGS if data.get(f"sync_{k}") is not None}
    _check_sync_flags(flagged, table.get("algorithm"), where)
    table.update(flagged)
    return table


def _check_sync_flags(options: dict, algorithm, where: str) -> None:
    """Each sub-option flag goes with the algorithms that take it, named by --sync (or the topology file): one
    without them once switched the run to HFA, silently, or was refused as not HFA's."""
    misplaced = [(SYNC_FLAGS[option], algorithms_taking(option)) for option in options
                 if algorithm is None or (algorithm in ALGORITHMS and algorithm not in algorithms_taking(option))]
    if not misplaced:
        return
    goes_with = "; ".join(f"{flag} goes with --sync {' or '.join(takers)}" for flag, takers in misplaced)
    if algorithm is None:
        nor_the_file = f" (nor the sync algorithm{where})" if where else ""
        raise ConfigError(f"{goes_with}, and no --sync was given{nor_the_file}")
    raise ConfigError(f"{goes_with}, not {algorithm}")


def parse_global_server_dcs(value, topo: Topology, where: str = "") -> list[str]:
    """``"central,a"`` or ``["central", "a"]`` -> one network DC per global server, checked against the
    deployment (hips, an emulated WAN, as many names as global servers, each the central party or a DC)."""
    what = f"global_server_dcs{where} (--global-server-dcs)"
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{what} must list DC names, got {value!r}")
    if topo.topology != "hips":
        raise ConfigError(f"{what} places the global servers of the hips topology; the {topo.topology!r} topology "
                          f"has its workers talk to them directly")
    if not topo.profile.emulated:
        raise ConfigError(f"{what} places global servers in the emulated WAN's DCs: it needs one (--wan "
                          f"{topo.profile.name} has none)")
    if len(names) != topo.global_servers:
        raise ConfigError(f"{what} names {len(names)} place(s) but there are {topo.global_servers} global "
                          f"server(s) (--global-servers): one place each")
    known = [CENTRAL_DC, *topo.dc_names]
    for i, name in enumerate(names):
        if name not in known:
            raise ConfigError(f"{what}: global server {i} is placed in {name!r}, which is no DC of this deployment "
                              f"({', '.join(known)})")
    return names


def parse_slowdown(entries, dc_names: list[str], workers_per_dc: list[int],
                   where: str = "") -> dict[tuple[str, int], float]:
    """``["b=3", "a:1=2"]`` (or a table ``{b = 3, "a:1" = 2}``) -> {(dc, rank): factor} for every chosen worker;
    a DC without a rank slows all of its workers. A later entry for the same worker wins."""
    entries = assignments(entries, "slowdown", "DC[:RANK]=FACTOR", where)
    out: dict[tuple[str, int], float] = {}
    for entry in entries:
        text = str(entry)
        who, sep, factor_text = text.partition("=")
        if not sep or not who:
            raise ConfigError(f"slowdown {text!r}{where}: expected DC[:RANK]=FACTOR, e.g. b=3 or a:1=2")
        dc, colon, rank_text = who.partition(":")
        if dc not in dc_names:
            raise ConfigError(f"slowdown {text!r}{where}: there is no DC {dc!r} (DCs: {', '.join(dc_names)})")
        n = workers_per_dc[dc_names.index(dc)]
        factor = parse_factor(factor_text, f"slowdown {text!r}{where}")
        if colon:
            if not rank_text.isdigit() or int(rank_text) >= n:
                raise ConfigError(f"slowdown {text!r}{where}: DC {dc} has no worker of rank {rank_text!r} "
                                  f"(ranks 0-{n - 1})")
            ranks = [int(rank_text)]
        else:
            ranks = list(range(n))
        out.update({(dc, r): factor for r in ranks})
    return out


def _whole(value, name: str, where: str) -> int:
    """A count: an int (or a string of digits from a flag), never a float silently truncated."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (
            isinstance(value, str) and not value.strip().isdigit()):
        raise ConfigError(f"{name}{where} must be a whole number, got {value!r}")
    return int(value)


def _text(value, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name}{where} must be a string, got {value!r}")
    return value
