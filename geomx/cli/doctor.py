"""``geomx doctor``: find what would make a hand-started deployment hang or fail, before it is started.

It reads the environment of one role (this process's) or of every role (``--env-file NAME=PATH``, one file of
``KEY=VALUE`` lines per role), and reports each problem as one line naming the role, the variable (or host and
port) and the fix:

* each role's own variables, as the role would read them at start-up (missing, malformed, impossible counts), and
  any ``GEOMX_*`` / ``DMLC_*`` name geomx does not know (a misspelling, which nothing would read);
* across roles: the counts every member of a tier declares against its scheduler's, the DC names of a tier,
  the global tier's counts against the DCs given, two schedulers on one address, the secret held on every side;
* on the network (unless ``--no-network``): every scheduler named is reached over TCP (and the time of that
  connect is printed as a round-trip estimate), and a role meant for this machine can listen on its address.

``--probe-listen`` and ``--probe`` measure the path between two hosts instead (link_probe.py): RTT and the rate of
one TCP stream, e.g. from a DC's host to the central party's.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import errno
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from geomx.config import NodeConfig, config_from_env, is_loopback
from geomx.env_names import describe_unknown, unknown_variables
from geomx.errors import ConfigError, GeomxError
from geomx.transport.security import encryption_of, read_secret, seal_max_age

CONNECT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Problem:
    role: str
    what: str        # what is wrong, naming the variable, host or port
    fix: str

    def __str__(self) -> str:
        return f"{self.role}: {self.what} -> {self.fix}"


@dataclass
class Role:
    name: str
    env: Mapping[str, str]
    cfg: NodeConfig | None = None
    emulator: dict | None = None     # a WAN emulator's (GEOMX_ROLE=emulator) arguments, as it reads them


def is_emulator(env: Mapping[str, str]) -> bool:
    """The WAN emulator's environment: ``python -m geomx.node`` runs it instead of a role (geomx.node.main)."""
    return env.get("GEOMX_ROLE") == "emulator"


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (an ``export`` prefix, quotes and ``#`` comments allowed)."""
    env: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the environment file {path}: {exc.strerror}") from None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"{path}:{n}: {raw!r} is not KEY=VALUE")
        env[key.strip()] = value.strip().strip("'\"")
    return env


# -- one role -------------------------------------------------------------------------------------------------

def check_role(role: Role, *, resolve: bool = True) -> list[Problem]:
    """The role's variables as it reads them at start-up (the first problem: the rest follow from fixing it), and
    those a training worker reads only later (the synchronization algorithm) or only with a secret (the
    encryption). ``resolve``: host names must resolve (not under --no-network)."""
    from geomx.sync.settings import settings_from_env
    from geomx.transport.security import ENCRYPTIONS

    fix = "set the variable as docs/environment.md describes"
    # a misspelled variable is read by nothing: the role would run on the default without a word
    problems = [Problem(role.name, describe_unknown(name, close), f"rename it to {close}" if close else
                        "remove it, or name a variable docs/environment.md lists")
                for name, close in unknown_variables(role.env)]
    try:
        if is_emulator(role.env):
            from geomx.netem.emulator import emulator_options
            role.emulator = emulator_options(role.env, resolve=resolve)
            return problems
        role.cfg = config_from_env(role.env, resolve=resolve, warn_unknown=False)
    except ConfigError as exc:
        return [*problems, Problem(role.name, str(exc), fix)]
    if role.cfg.role in ("worker", "master"):
        try:
            settings_from_env(role.env)
        except ConfigError as exc:
            problems.append(Problem(role.name, str(exc), fix))
    chosen = role.env.get("GEOMX_ENCRYPTION")
    if chosen and chosen not in ENCRYPTIONS:
        problems.append(Problem(role.name, f"GEOMX_ENCRYPTION={chosen!r} is not one of {sorted(ENCRYPTIONS)}", fix))
    return problems


# -- across roles ---------------------------------------------------------------------------------------------

def _declared(cfg: NodeConfig) -> dict[str, int]:
    return {"DMLC_NUM_WORKER": cfg.num_workers, "DMLC_NUM_SERVER": cfg.num_servers}


def check_local_tiers(roles: list[Role]) -> list[Problem]:
    """Every member of a local tier counts it as its scheduler does and uses the scheduler's tier name."""
    problems: list[Problem] = []
    by_address: dict[tuple[str, int], list[Role]] = {}
    for r in roles:
        if r.cfg is not None and r.cfg.scheduler is not None:
            by_address.setdefault(r.cfg.scheduler, []).append(r)
    any_scheduler = any(r.cfg is not None and r.cfg.role == "scheduler" for r in roles)
    for (host, port), members in by_address.items():
        schedulers = [r for r in members if r.cfg.role == "scheduler"]
        if any_scheduler and not schedulers:
            # the schedulers were given, and none of them is at this address
            for r in members:
                problems.append(Problem(r.name, f"no scheduler among the roles given listens on {host}:{port} "
                                                f"(DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT)",
                                        "point DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT at its DC's scheduler"))
            continue
        reference = schedulers[0] if schedulers else members[0]
        for r in members:
            if r is reference:
                continue
            for name, value in _declared(r.cfg).items():
                want = _declared(reference.cfg)[name]
                if value != want:
                    problems.append(Problem(r.name, f"{name}={value} but {reference.name} (same scheduler "
                                                    f"{host}:{port}) has {want}",
                                            f"give every role of that tier the same {name}"))
            if r.cfg.local_tier != reference.cfg.local_tier:
                problems.append(Problem(r.name, f"GEOMX_DC makes its tier {r.cfg.local_tier} but {reference.name} "
                                                f"(same scheduler {host}:{port}) is in {reference.cfg.local_tier}",
                                        "set GEOMX_DC to the same name on every role of a DC, or on none"))
        workers = [r for r in members if r.cfg.role in ("worker", "master")]
        if len(workers) > reference.cfg.num_workers:
            problems.append(Problem(reference.name, f"DMLC_NUM_WORKER={reference.cfg.num_workers} but "
                                                    f"{len(workers)} workers use the scheduler {host}:{port}",
                                    "count every worker of the DC in DMLC_NUM_WORKER"))
        problems += _worker_ranks(workers, reference.cfg.num_workers, f"{host}:{port}")
    return problems


def _worker_ranks(workers: list[Role], count: int, scheduler: str) -> list[Problem]:
    """The ranks the workers of one tier ask for (DMLC_WORKER_ID, GEOMX_RANK): each in range, none twice (the
    scheduler refuses the second at start-up, after the others waited for it)."""
    problems, holder = [], {}
    for r in workers:
        rank = r.cfg.rank
        if rank is None:
            continue
        variable = "GEOMX_RANK" if r.env.get("GEOMX_RANK") else "DMLC_WORKER_ID"    # as config_from_env reads it
        if not 0 <= rank < count:
            problems.append(Problem(r.name, f"{variable}={rank} but its tier (scheduler {scheduler}) has "
                                            f"{count} workers: 0..{count - 1}", "give each worker of the DC its own "
                                                                              "rank in 0..DMLC_NUM_WORKER-1"))
        elif rank in holder:
            problems.append(Problem(r.name, f"{variable}={rank} is also {holder[rank]}'s (scheduler "
                                            f"{scheduler})", "give each worker of the DC its own rank"))
        else:
            holder[rank] = r.name
    return problems


def check_worker_indexes(roles: list[Role]) -> list[Problem]:
    """GEOMX_WORKER_INDEX picks a worker's slice of the data (geomx.torch.loop): two workers with one index
    train on the same slice, and the job sees part of its data twice and part never."""
    problems, holder = [], {}
    for r in roles:
        index = r.env.get("GEOMX_WORKER_INDEX")
        if r.cfg is None or r.cfg.role != "worker" or index is None:
            continue
        if index in holder:
            problems.append(Problem(r.name, f"GEOMX_WORKER_INDEX={index} is also {holder[index]}'s",
                                    "give every worker of the job its own index, 0..DMLC_NUM_ALL_WORKER-1"))
        else:
            holder[index] = r.name
    return problems


def check_global_tier(roles: list[Role]) -> list[Problem]:
    problems: list[Problem] = []
    cfgs = [r for r in roles if r.cfg is not None]
    in_global = [r for r in cfgs if r.cfg.global_scheduler is not None]
    for name, get in (("DMLC_PS_GLOBAL_ROOT_URI/PORT", lambda c: c.global_scheduler),
                      ("DMLC_NUM_GLOBAL_SERVER", lambda c: c.num_global_servers),
                      ("DMLC_NUM_GLOBAL_WORKER", lambda c: c.num_global_workers)):
        values = {}
        for r in in_global:
            values.setdefault(get(r.cfg), []).append(r.name)
        if len(values) > 1:
            seen = "; ".join(f"{v} on {', '.join(names)}" for v, names in values.items())
            problems.append(Problem("global tier", f"{name} differs between roles: {seen}",
                                    f"give every role of the global tier the same {name}"))
    if len(cfgs) < 2:       # one role (checked in its own shell): the other DCs are not known here
        return problems
    # the DCs given: every local tier but the central party's (the one its global servers and master are in),
    # with the worker count its scheduler (or else its first role) declares
    central = {r.cfg.local_tier for r in cfgs if r.cfg.role in ("global_server", "master")}
    dcs: dict[str, int] = {}
    for r in sorted(cfgs, key=lambda r: r.cfg.role != "scheduler"):
        if r.cfg.role in ("worker", "server", "scheduler") and r.cfg.local_tier not in central:
            dcs.setdefault(r.cfg.local_tier, r.cfg.num_workers)
    declared = {r.cfg.num_global_workers for r in cfgs if r.cfg.role == "server" and r.cfg.topology == "hips"}
    if len(declared) == 1 and (n := next(iter(declared))) != len(dcs):
        problems.append(Problem("global tier", f"DMLC_NUM_GLOBAL_WORKER={n} but the roles given form {len(dcs)} DCs",
                                "set DMLC_NUM_GLOBAL_WORKER to the number of DCs"))
    elif len(declared) == 1:
        # every DC is among the roles given: the world's worker count is known
        total = sum(dcs.values())
        for r in cfgs:
            if r.cfg.role in ("worker", "master", "global_server") and r.cfg.num_all_workers != total:
                problems.append(Problem(r.name, f"DMLC_NUM_ALL_WORKER={r.cfg.num_all_workers} but the DCs given "
                                                f"have {total} workers in all",
                                        "set DMLC_NUM_ALL_WORKER to the sum of every DC's DMLC_NUM_WORKER"))
    return problems


def check_emulator(roles: list[Role]) -> list[Problem]:
    """With the WAN emulator's environment among the roles: every role sends to it (GEOMX_WAN_EMULATOR names its
    address), and it carries their traffic (each role's DC in GEOMX_EMULATOR_DCS, its host in
    GEOMX_EMULATOR_HOSTS). Otherwise the emulator drops their messages and a registration waits out
    GEOMX_CONNECT_TIMEOUT, or their traffic bypasses the emulated WAN."""
    from geomx.netem.emulator import default_hosts

    problems: list[Problem] = []
    emulators = [r for r in roles if r.emulator is not None]
    if len(emulators) != 1:
        return problems
    em = emulators[0]
    address = f"tcp://{em.emulator['host']}:{em.emulator['port']}"
    members = [r for r in roles if r.cfg is not None]
    for r in members:
        if r.cfg.emulator is None:
            problems.append(Problem(r.name, f"GEOMX_WAN_EMULATOR is unset while {em.name} emulates the WAN at "
                                            f"{address}: its messages to other DCs would not cross it",
                                    f"set GEOMX_WAN_EMULATOR={address}"))
        elif r.cfg.emulator != address:
            problems.append(Problem(r.name, f"GEOMX_WAN_EMULATOR={r.cfg.emulator} but {em.name} listens on {address} "
                                            f"(GEOMX_EMULATOR_HOST/GEOMX_EMULATOR_PORT)",
                                    f"set GEOMX_WAN_EMULATOR={address}"))
    for variable, allowed, of in (("GEOMX_EMULATOR_DCS", em.emulator["dcs"], lambda c: c.network_dc),
                                  ("GEOMX_EMULATOR_HOSTS", em.emulator["hosts"] or default_hosts(em.emulator["host"]),
                                   lambda c: c.host)):
        if allowed is None:         # no list of DCs: every DC is routed
            continue
        outside: dict[str, list[str]] = {}
        for r in members:
            if r.cfg.emulator is not None and of(r.cfg) not in allowed:
                outside.setdefault(of(r.cfg), []).append(r.name)
        for value, names in outside.items():
            what = "DC" if variable == "GEOMX_EMULATOR_DCS" else "host"
            problems.append(Problem(em.name, f"{variable} ({', '.join(sorted(allowed))}) lacks {what} {value} of "
                                             f"{', '.join(names)}: the emulator would drop every message "
                                             f"{'to or from that DC' if what == 'DC' else 'to that host'}",
                                    f"add {value} to {variable}" + (" (or correct GEOMX_DC on those roles)"
                                                                    if what == "DC" else "")))
    return problems


_OWN_PORT = "give each scheduler its own port (DMLC_PS_ROOT_PORT / DMLC_PS_GLOBAL_ROOT_PORT)"


def check_addresses(roles: list[Role]) -> list[Problem]:
    """No two schedulers on one address; under AES-GCM not on one port either (a sealed message names its
    receiver's port, not its host: one recorded on its way to a scheduler would open at another on that port)."""
    problems: list[Problem] = []
    owners: dict[tuple[str, int], str] = {}
    port_owners: dict[int, tuple[str, str]] = {}
    sealed = any(_secret_digest(r.env) for r in roles) and all(encryption_of(r.env) == "aes-gcm" for r in roles)
    for r in roles:
        if r.cfg is None or r.cfg.role not in ("scheduler", "global_scheduler"):
            continue
        addr = r.cfg.global_scheduler if r.cfg.role == "global_scheduler" else r.cfg.scheduler
        if addr in owners:
            problems.append(Problem(r.name, f"its scheduler address {addr[0]}:{addr[1]} is also {owners[addr]}'s",
                                    _OWN_PORT))
        elif sealed and addr[1] in port_owners:
            other, host = port_owners[addr[1]]
            problems.append(Problem(r.name, f"its scheduler port {addr[1]} is also {other}'s (on {host}): a message "
                                            f"sealed with AES-GCM names its receiver's port, not its host, so one "
                                            f"recorded on its way to either could be played to the other", _OWN_PORT))
        owners[addr] = r.name
        port_owners.setdefault(addr[1], (r.name, addr[0]))
    return problems


def _secret_digest(env: Mapping[str, str]) -> str | None:
    secret = None
    with contextlib.suppress(ConfigError):     # an unreadable file is already reported by check_role
        secret = read_secret(env)
    return hashlib.sha256(secret.encode()).hexdigest()[:12] if secret else None


def check_secrets(roles: list[Role]) -> list[Problem]:
    """Every role holds the same secret, or (on loopback only) none does."""
    digests = {r.name: _secret_digest(r.env) for r in roles}
    held = {d for d in digests.values() if d is not None}
    problems: list[Problem] = []
    if len(held) > 1:
        groups: dict[str | None, list[str]] = {}
        for name, d in digests.items():
            groups.setdefault(d, []).append(name)
        problems.append(Problem("deployment", "roles hold different secrets: " + "; ".join(
            f"{', '.join(names)} (secret #{i + 1})" for i, names in enumerate(groups.values())),
            "give every role the same GEOMX_SECRET or GEOMX_SECRET_FILE content"))
    encryptions: dict[str, list[str]] = {}
    for r in roles:
        if digests[r.name] is not None:
            encryptions.setdefault(encryption_of(r.env), []).append(r.name)
    if len(encryptions) > 1:      # each side would drop every message of the other
        problems.append(Problem("deployment", "roles use different GEOMX_ENCRYPTION: " + "; ".join(
            f"{', '.join(names)} ({name})" for name, names in encryptions.items()),
            "set the same GEOMX_ENCRYPTION (or none: aes-gcm) on every role"))
    for r in roles:
        exposed = _exposed_address(r.env)
        if digests[r.name] is None and (held or exposed):
            problems.append(Problem(r.name, "no GEOMX_SECRET or GEOMX_SECRET_FILE" + (
                " while other roles have one" if held else f" on {exposed}, off loopback"),
                "set the deployment's secret on this role (its links would be refused or unauthenticated)"))
    return problems


def _exposed_address(env: Mapping[str, str]) -> str | None:
    """What the role listens on off loopback, naming its variable: the address peers dial or the one it binds."""
    for variable, default in (("DMLC_NODE_HOST", "127.0.0.1"), ("GEOMX_BIND_HOST", ""),
                              ("GEOMX_EMULATOR_HOST", "")):
        host = env.get(variable) or default
        if host and not is_loopback(host):
            return f"{host} ({variable})"
    return None


# -- the network ----------------------------------------------------------------------------------------------

def _connect_s(host: str, port: int, timeout: float) -> float | str:
    """Seconds a TCP connect took, or why it failed."""
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return time.monotonic() - start
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def check_reachable(roles: list[Role], timeout: float, notes: list[str]) -> list[Problem]:
    problems: list[Problem] = []
    targets: dict[tuple[str, int], tuple[str, str, str]] = {}
    for r in roles:
        if r.cfg is None:
            continue
        if r.cfg.scheduler is not None and r.cfg.role != "scheduler":
            targets.setdefault(r.cfg.scheduler, (r.name, "scheduler", "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT"))
        if r.cfg.global_scheduler is not None and r.cfg.role != "global_scheduler":
            targets.setdefault(r.cfg.global_scheduler, (r.name, "scheduler",
                                                        "DMLC_PS_GLOBAL_ROOT_URI/DMLC_PS_GLOBAL_ROOT_PORT"))
        if r.cfg.emulator is not None:      # a role's messages to other DCs, its registration included, go there
            host, _, port = r.cfg.emulator.removeprefix("tcp://").rpartition(":")
            targets.setdefault((host, int(port)), (r.name, "WAN emulator", "GEOMX_WAN_EMULATOR"))
    for (host, port), (name, what, variables) in targets.items():
        took = _connect_s(host, port, timeout)
        if isinstance(took, str):
            problems.append(Problem(name, f"the {what} at {host}:{port} ({variables}) cannot be reached: {took}",
                                    f"start that {what} first, or correct the address, or open the port"))
        else:
            notes.append(f"{what} {host}:{port} reached; TCP connect {took * 1e3:.1f} ms (about one round trip)")
    return problems


def check_listen(role: Role) -> list[Problem]:
    """The role can listen where it says it will (run on the machine the role is meant for)."""
    cfg = role.cfg
    if cfg is None:
        return []
    host = cfg.bind_host or cfg.host
    if cfg.role == "global_scheduler":
        port, port_variable = cfg.global_scheduler[1], "DMLC_PS_GLOBAL_ROOT_PORT"
    elif cfg.role == "scheduler":
        port, port_variable = cfg.scheduler[1], "DMLC_PS_ROOT_PORT"
    else:
        port, port_variable = cfg.port, "PORT"
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                fix = f"another process listens there: give {port_variable} a free port"
            else:       # not an address of this machine: peers dial DMLC_NODE_HOST, the socket binds the other
                fix = ("set GEOMX_BIND_HOST to an address of this machine (0.0.0.0 for all)" if cfg.bind_host else
                       "set DMLC_NODE_HOST to an address of this machine, or keep it (what peers dial) and set "
                       "GEOMX_BIND_HOST=0.0.0.0 to listen on every address")
            return [Problem(role.name, f"cannot listen on {host}:{port}: {exc.strerror}", fix)]
    return []


def diagnose(envs: Mapping[str, Mapping[str, str]], *, network: bool = True, local: bool = False,
             timeout: float = CONNECT_TIMEOUT_S) -> tuple[list[Problem], list[str]]:
    """Problems of a deployment given as {role name: environment}, and notes on what was measured. ``local``:
    the roles are meant for this machine (their listening addresses are checked)."""
    roles = [Role(name, env) for name, env in envs.items()]
    problems: list[Problem] = []
    notes: list[str] = []
    for r in roles:
        problems += check_role(r, resolve=network)
    for across in (check_local_tiers, check_worker_indexes, check_global_tier, check_addresses, check_secrets,
                   check_emulator):
        problems += across(roles)
    if network:
        problems += check_reachable(roles, timeout, notes)
        if local:
            for r in roles:
                problems += check_listen(r)
    return problems, notes


def add_doctor_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="check a hand-started deployment's variables and network before starting it")
    p.add_argument("--env-file", action="append", metavar="NAME=PATH", default=[],
                   help="a role's environment as KEY=VALUE lines (repeatable: give every role to check them "
                        "against each other); default: this process's environment, as one role")
    p.add_argument("--no-network", action="store_true", help="check the variables only")
    p.add_argument("--local", action="store_true",
                   help="the roles run on this machine: check that each can listen on its address and port")
    p.add_argument("--timeout", type=float, default=CONNECT_TIMEOUT_S, help="seconds per connection attempt")
    p.add_argument("--probe-listen", metavar="[HOST:]PORT",
                   help="answer --probe measurements on this address (default host 0.0.0.0) for --probe-for seconds")
    p.add_argument("--probe-for", type=float, default=120.0, metavar="S",
                   help="how long --probe-listen answers (each connection at most 60 s)")
    p.add_argument("--probe", metavar="HOST:PORT",
                   help="measure RTT and one TCP stream's rate to a --probe-listen on another host (a DC's, the "
                        "central party's)")
    p.add_argument("--probe-mb", type=float, default=12.0, metavar="MB",
                   help="megabytes --probe sends (at least 1 s of the link's rate gives a steady figure)")
    p.set_defaults(fn=cmd_doctor)
    return p


def cmd_doctor(args: argparse.Namespace) -> int:
    import os

    if args.probe_listen or args.probe:
        return _cmd_probe(args)

    envs: dict[str, Mapping[str, str]] = {}
    for item in args.env_file:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise GeomxError(f"--env-file {item!r} is not NAME=PATH")
        envs[name] = read_env_file(Path(path))
    if not envs:
        envs = {"this role": dict(os.environ)}
    problems, notes = diagnose(envs, network=not args.no_network, local=args.local or not args.env_file,
                               timeout=args.timeout)
    for note in notes:
        print(note)
    for p in problems:
        print(p, file=sys.stdout)
    print(f"{len(problems)} problem{'s' * (len(problems) != 1)} found in {len(envs)} role"
          f"{'s' * (len(envs) != 1)}")
    return 1 if problems else 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from geomx.cli import link_probe

    if args.probe_listen:
        host, port = link_probe.parse_endpoint(args.probe_listen, what="--probe-listen", default_host="0.0.0.0")
        def ready(addr) -> None:
            print(f"answering probes on {addr[0]}:{addr[1]} for {args.probe_for:g} s", flush=True)

        try:
            answered = link_probe.serve(host, port, seconds=args.probe_for, on_ready=ready)
        except OSError as exc:
            raise GeomxError(f"--probe-listen {args.probe_listen}: cannot listen: {exc.strerror or exc}") from None
        print(f"answered {answered} probe(s)")
        return 0
    host, port = link_probe.parse_endpoint(args.probe, what="--probe")
    if not args.probe_mb > 0:
        raise GeomxError(f"--probe-mb must be positive, got {args.probe_mb:g}")
    result = link_probe.probe(host, port, nbytes=int(args.probe_mb * 1e6), timeout=max(args.timeout, 5.0))
    print(f"probe {host}:{port}: {result}")
    limit = seal_max_age(os.environ)
    if result.clock_offset_s is not None and abs(result.clock_offset_s) > limit / 2:
        print(Problem(f"{host}:{port}", f"the two hosts' clocks are {abs(result.clock_offset_s):.1f} s apart, more "
                                        f"than half of GEOMX_SEAL_MAX_AGE_S ({limit:g} s): a receiver refuses AES-GCM "
                                        f"messages sealed that long before it started, by the sender's clock",
                      "synchronize the clocks (NTP), or raise GEOMX_SEAL_MAX_AGE_S on every role"))
        return 1
    return 0

