"""Which synchronization algorithm a deployment runs, and its options: from the environment (what workers
read), from ``geomx launch`` flags or the TOML ``sync`` table (turned into that environment). No torch here,
so the launcher can validate a configuration before it starts anything.

==========  ==================================================================================================
algorithm   what a worker does
==========  ==================================================================================================
``fsa``     push every gradient, step on the mean over all workers (default; MixedSync is ``--mode dist_async``)
``hfa``     K1 local steps, then a DC-wide model average; every K2 DC averages a global model average
            (``overlap`` D > 0: the global average travels while D x K1 more local steps run; D > K2: several
            travel at once; ``dc_overlap`` S: each DC average travels S <= K1 local steps behind training)
``diloco``  as hfa, but the global average feeds an outer optimizer (Nesterov SGD) instead of replacing the model
``dga``     push every gradient but step on the average from D steps ago, corrected (communication overlaps D steps)
``esync``   faster workers take more local steps per round, so all reach the global average together
``p3``      as fsa with the servers' optimizer, but each layer waits for its new weights in the next forward pass
            instead of step() waiting for all (GeoMX's ``ENABLE_P3=1``)
==========  ==================================================================================================
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from collections.abc import Mapping

from geomx.errors import ConfigError



@dataclass(frozen=True)
class Algorithm:
    """A registered synchronization algorithm: where its policy class lives (imported when a worker creates
    it, so this module needs no torch), and what geomx.compat needs to know of it."""
    module: str
    cls: str
    worker_side: bool        # runs on the workers: synchronous rounds, no server optimizer, no accumulation
    dc_rounds: bool = False  # K2 > 1 / equal weights use DC-only rounds (local servers)
    accumulates: bool = False            # takes backward_passes_per_step (FSA's gradient accumulation)
    needs_server_optimizer: bool = False  # receives weights, never gradients
    # one synchronous round of every key per step, pushed only once the previous round's replies are in: a
    # step and a round name the same point everywhere (--checkpoint-seconds, geomx.cluster.checkpoint_clock)
    round_per_step: bool = False


# the one registry of synchronization algorithms: a new one is a policy class and a line here
REGISTRY: dict[str, Algorithm] = {
    "fsa": Algorithm("geomx.sync.fsa", "FSA", worker_side=False, accumulates=True, round_per_step=True),
    "p3": Algorithm("geomx.sync.p3", "P3", worker_side=False, accumulates=True, needs_server_optimizer=True,
                    round_per_step=True),
    "hfa": Algorithm("geomx.sync.averaging", "HFA", worker_side=True, dc_rounds=True),
    "diloco": Algorithm("geomx.sync.averaging", "DiLoCo", worker_side=True, dc_rounds=True),
    "dga": Algorithm("geomx.sync.dga", "DGA", worker_side=True),
    "esync": Algorithm("geomx.sync.esync", "ESync", worker_side=True),
}
ALGORITHMS = tuple(REGISTRY)
WORKER_SIDE_ALGORITHMS = tuple(name for name, a in REGISTRY.items() if a.worker_side)
DC_ROUND_ALGORITHMS = tuple(name for name, a in REGISTRY.items() if a.dc_rounds)
SERVER_OPTIMIZER_ALGORITHMS = tuple(name for name, a in REGISTRY.items() if a.needs_server_optimizer)
ROUND_PER_STEP_ALGORITHMS = tuple(name for name, a in REGISTRY.items() if a.round_per_step)
WEIGHTINGS = ("samples", "equal")
# what a DC's workers average within the DC: their models every K1 steps, or (K1 = 1) their gradients before every
# local step, as data-parallel training does, so one optimizer state and one model per DC
DC_SYNCS = ("models", "gradients")
# overlap beyond K2 keeps several global averages travelling, each with copies of the model (sent, result)
MAX_AVERAGES_IN_FLIGHT = 4

# option -> (environment variable, type, default); GeoMX's names where GeoMX has the option
OPTIONS = {
    "k1": ("MXNET_KVSTORE_HFA_K1", int, 1),
    "k2": ("MXNET_KVSTORE_HFA_K2", int, 1),
    "weights": ("GEOMX_HFA_WEIGHTS", str, "samples"),
    "overlap": ("GEOMX_HFA_OVERLAP", int, 0),
    "dc_sync": ("GEOMX_HFA_DC_SYNC", str, "models"),
    "overlap_keep": ("GEOMX_HFA_OVERLAP_KEEP", float, 1.0),
    "dc_overlap": ("GEOMX_HFA_DC_OVERLAP", int, 0),
    "outer_lr": ("GEOMX_DILOCO_LR", float, 0.7),
    "outer_momentum": ("GEOMX_DILOCO_MOMENTUM", float, 0.9),
    "delay": ("GEOMX_DGA_DELAY", int, 1),
    "steps": ("GEOMX_ESYNC_STEPS", int, 1),
    "slice": ("GEOMX_P3_SLICE", int, 50_000),
}
ALGORITHM_OPTIONS = {"fsa": (), "p3": ("slice",),
                     "hfa": ("k1", "k2", "weights", "overlap", "overlap_keep", "dc_sync", "dc_overlap"),
                     "diloco": ("k1", "k2", "weights", "overlap", "overlap_keep", "dc_sync", "dc_overlap", "outer_lr",
                                "outer_momentum"),
                     "dga": ("delay",),
                     "esync": ("steps",)}
SYNC_ENV = "GEOMX_SYNC"
GEOMX_HFA_ENV = "MXNET_KVSTORE_USE_HFA"
GEOMX_P3_ENV = "ENABLE_P3"


@dataclass(frozen=True)
class SyncSettings:
    algorithm: str = "fsa"
    k1: int = 1
    k2: int = 1
    weights: str = "samples"
    overlap: int = 0
    dc_sync: str = "models"
    overlap_keep: float = 1.0    # hfa/diloco overlap: the share of the steps taken meanwhile kept on the average
    dc_overlap: int = 0          # hfa/diloco: S = a DC average lands S local steps after it left (0: waited for)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    delay: int = 1
    steps: int = 1
    slice: int = 50_000     # p3: elements per slice, each its own key (0: only the deployment's partitioning)

    def options(self) -> dict:
        return {k: getattr(self, k) for k in ALGORITHM_OPTIONS[self.algorithm]}


def check(algorithm: str, options: Mapping, where: str = "") -> SyncSettings:
    """Validate ``options`` of ``algorithm`` (errors name the option and its variable)."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown synchronization algorithm {algorithm!r}{where}; algorithms: "
                          f"{', '.join(ALGORITHMS)}")
    unknown = set(options) - set(ALGORITHM_OPTIONS[algorithm])
    if unknown:
        raise ConfigError(f"synchronization {algorithm!r}{where} takes no option(s) {sorted(unknown)}; it takes "
                          f"{list(ALGORITHM_OPTIONS[algorithm]) or 'none'}")
    values = {}
    for name, raw in options.items():
        var, kind, _ = OPTIONS[name]
        values[name] = _convert(raw, kind, f"{algorithm} option {name} ({var}){where}")
    s = SyncSettings(algorithm=algorithm, **values)
    for name in ("k1", "k2"):
        if getattr(s, name) < 1:
            raise ConfigError(f"{algorithm} {name.upper()} ({OPTIONS[name][0]}){where} must be >= 1 (local steps "
                              f"per DC average / DC averages per global average), got {getattr(s, name)}")
    if not 0 <= s.overlap <= MAX_AVERAGES_IN_FLIGHT * s.k2:
        raise ConfigError(f"{algorithm} overlap ({OPTIONS['overlap'][0]}){where}: DC periods a global average may "
                          f"travel while training goes on must be in [0, {MAX_AVERAGES_IN_FLIGHT} x K2 = "
                          f"{MAX_AVERAGES_IN_FLIGHT * s.k2}] (above K2 several averages travel at once, each holding "
                          f"copies of the model; at most {MAX_AVERAGES_IN_FLIGHT}), got {s.overlap}")
    if s.steps < 1:
        raise ConfigError(f"esync steps ({OPTIONS['steps'][0]}){where}: local steps of the slowest worker per round "
                          f"must be >= 1, got {s.steps}")
    if s.slice < 0:
        raise ConfigError(f"p3 slice ({OPTIONS['slice'][0]}){where}: elements per slice must be >= 0 (0: no slicing "
                          f"beyond GEOMX_PARTITION_BYTES), got {s.slice}")
    if s.delay < 0:
        raise ConfigError(f"dga delay D ({OPTIONS['delay'][0]}){where} must be >= 0 steps, got {s.delay}")
    if s.weights not in WEIGHTINGS:
        raise ConfigError(f"{algorithm} weights ({OPTIONS['weights'][0]}){where} must be one of "
                          f"{', '.join(WEIGHTINGS)}, got {s.weights!r}")
    if not 0.0 <= s.overlap_keep <= 1.0:
        raise ConfigError(f"{algorithm} overlap_keep ({OPTIONS['overlap_keep'][0]}){where}: the share of the local "
                          f"progress made while a global average travelled that is kept on top of it must be in "
                          f"[0, 1], got {s.overlap_keep}")
    if s.dc_sync not in DC_SYNCS:
        raise ConfigError(f"{algorithm} dc_sync ({OPTIONS['dc_sync'][0]}){where} must be one of "
                          f"{', '.join(DC_SYNCS)}, got {s.dc_sync!r}")
    if not 0 <= s.dc_overlap <= s.k1:
        raise ConfigError(f"{algorithm} dc_overlap ({OPTIONS['dc_overlap'][0]}){where}: local steps a DC average "
                          f"travels behind training must be in [0, K1 = {s.k1}] (0: wait for it; K1: adopt it at "
                          f"the next DC boundary), got {s.dc_overlap}")
    if s.dc_overlap and s.dc_sync != "models":
        raise ConfigError(f"{algorithm} dc_overlap ({OPTIONS['dc_overlap'][0]}){where} lets a DC average of the "
                          f"models travel behind training; with dc_sync={s.dc_sync!r} ({OPTIONS['dc_sync'][0]}) "
                          f"the DC averages gradients before each step, which cannot wait: use dc_sync=models")
    if s.dc_overlap and s.k2 == 1:
        raise ConfigError(f"{algorithm} dc_overlap ({OPTIONS['dc_overlap'][0]}){where} overlaps the DC-only "
                          f"averages, and with K2 ({OPTIONS['k2'][0]}) = 1 every average is global: set K2 >= 2")
    if s.dc_sync == "gradients" and s.k1 != 1:
        raise ConfigError(f"{algorithm} dc_sync=gradients ({OPTIONS['dc_sync'][0]}){where} averages gradients "
                          f"within the DC before every local step, so K1 ({OPTIONS['k1'][0]}) must be 1, got "
                          f"{s.k1}")
    if not (s.outer_lr > 0 and math.isfinite(s.outer_lr)):
        raise ConfigError(f"diloco outer_lr ({OPTIONS['outer_lr'][0]}){where} must be a finite number > 0, got "
                          f"{s.outer_lr}")
    if not 0 <= s.outer_momentum < 1:
        raise ConfigError(f"diloco outer_momentum ({OPTIONS['outer_momentum'][0]}){where} must be in [0, 1), got "
                          f"{s.outer_momentum}")
    return s


def settings_from_env(env: Mapping[str, str] | None = None) -> SyncSettings:
    """``GEOMX_SYNC`` (or GeoMX's ``MXNET_KVSTORE_USE_HFA=1`` / ``ENABLE_P3=1``) and the chosen algorithm's option
    variables."""
    env = os.environ if env is None else env
    algorithm = (env.get(SYNC_ENV) or "").strip()
    if not algorithm:
        algorithm = "hfa" if _on(env, GEOMX_HFA_ENV) else "p3" if _on(env, GEOMX_P3_ENV) else "fsa"
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"{SYNC_ENV}={algorithm!r} is not a synchronization algorithm; algorithms: "
                          f"{', '.join(ALGORITHMS)}")
    options = {name: env[OPTIONS[name][0]] for name in ALGORITHM_OPTIONS[algorithm]
               if env.get(OPTIONS[name][0], "").strip()}
    return check(algorithm, options)


def chosen_by(env: Mapping[str, str] | None = None) -> str | None:
    """The variable that names the environment's algorithm (``GEOMX_SYNC``, which geomx launch --sync sets, or
    GeoMX's ``MXNET_KVSTORE_USE_HFA`` / ``ENABLE_P3``); None where none does (FSA by default)."""
    env = os.environ if env is None else env
    if (env.get(SYNC_ENV) or "").strip():
        return SYNC_ENV
    return next((var for var in (GEOMX_HFA_ENV, GEOMX_P3_ENV) if _on(env, var)), None)


def rounds_are_steps(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment's algorithm runs one round of every key per step (FSA, P3), so that a server's
    round names the workers' step (server checkpoints); an algorithm the environment does not name is FSA."""
    try:
        return REGISTRY[settings_from_env(env).algorithm].round_per_step
    except ConfigError:
        return True


def algorithm_rounds_are_steps(name: str | None) -> bool:
    """Whether the algorithm ``name`` (a policy object's ``name``) runs one round of every key per step (FSA, P3).
    A policy of the user's own, registered under no algorithm, counts as not: a server checkpoint that named its
    rounds as steps could name a step the workers never saved."""
    algorithm = REGISTRY.get(name)
    return algorithm.round_per_step if algorithm is not None else False


def _on(env: Mapping[str, str], var: str) -> bool:
    return env.get(var, "").strip().lower() in ("1", "true", "yes")


def algorithms_taking(option: str) -> tuple[str, ...]:
    """The algorithms that take ``option`` (``"k1"`` -> hfa, diloco): what an error about a misplaced option names."""
    return tuple(name for name, options in ALGORITHM_OPTIONS.items() if option in options)


def launch_env(table: Mapping, where: str = "") -> dict[str, str]:
    """The launcher's ``sync`` table (``{"algorithm": "hfa", "k1": 20, "k2": 10}``) -> every role's environment.
    HFA also sets GeoMX's own variables, so a GeoMX script reading them sees the same configuration."""
    table = dict(table)
    _require_algorithm(table, where)
    algorithm = str(table.pop("algorithm", "fsa"))
    s = check(algorithm, table, where)
    env = {SYNC_ENV: s.algorithm}
    env.update({OPTIONS[k][0]: str(v) for k, v in s.options().items()})
    if s.algorithm in ("hfa", "diloco"):
        env[GEOMX_HFA_ENV] = "1"
    if s.algorithm == "p3":
        env[GEOMX_P3_ENV] = "1"
    return env


def _require_algorithm(table: Mapping, where: str) -> None:
    """Options need the algorithm they belong to named: options alone once ran HFA, silently, and refused the
    options of dga, esync and p3 as not HFA's."""
    if not table or "algorithm" in table:
        return
    option = next(iter(table))
    takers = algorithms_taking(option)
    if not takers:
        raise ConfigError(f"sync{where} has no option {option!r}; options: {', '.join(OPTIONS)}")
    as_toml = " or ".join(f'"{a}"' for a in takers)
    raise ConfigError(f"sync option {option!r}{where} goes with algorithm = {as_toml}, and the sync table names no "
                      f"algorithm")


def _convert(raw, kind, what: str):
    if kind is int:
        if isinstance(raw, bool) or not (isinstance(raw, int) or (isinstance(raw, str) and raw.strip().lstrip("-")
                                                                   .isdigit())):
            raise ConfigError(f"{what} must be a whole number, got {raw!r}")
        return int(raw)
    if kind is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{what} must be a number, got {raw!r}") from None
    return str(raw)



def check_backward_passes(value) -> int:
    """``backward_passes_per_step`` (FSA's gradient accumulation), a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"backward_passes_per_step must be a whole number >= 1, got {value!r}")
    return value


def check_saved_algorithm(name: str, state: Mapping) -> None:
    """A policy's saved state loads only into a policy of the same algorithm."""
    saved = state.get("algorithm") if isinstance(state, Mapping) else None
    if saved is None:
        raise ConfigError(f"the synchronization state to load names no algorithm (not a geomx policy's "
                          f"state_dict?); this optimizer runs {name!r}")
    if saved != name:
        raise ConfigError(f"the checkpoint holds the state of synchronization {saved!r}, but this optimizer runs "
                          f"{name!r}: resume with the same --sync")


def check_saved_options(name: str, saved: Mapping | None, current: Mapping) -> None:
    """A policy's saved state loads only into a policy whose options it depends on (``current``) are those it was
    saved with. A state saved before it recorded them (``saved`` None) loads as it is."""
    if saved is None:
        return
    changed = [k for k, v in current.items() if k in saved and saved[k] != v]
    if changed:
        names = {k: f"{k.upper() if k in ('k1', 'k2') else k} ({OPTIONS[k][0]})" for k in changed}
        raise ConfigError(f"the saved {name} state does not fit this optimizer's options: "
                          + "; ".join(f"{names[k]} {saved[k]!r} when saved, {current[k]!r} here" for k in changed)
                          + ": resume with the options of the run that saved it (its counters, shares and averages "
                            "in flight hold to them)")


def sync_requested(env: Mapping[str, str] | None = None) -> str | None:
    """Where the environment asks for a synchronization algorithm other than FSA (which runs inside
    ``DistributedOptimizer``): the message a raw-kvstore push is refused with; None for FSA."""
    env = os.environ if env is None else env
    algorithm = settings_from_env(env).algorithm
    if algorithm == "fsa":
        return None
    var = chosen_by(env)
    return (f"{var}={env[var]!r} asks for {algorithm}, which geomx runs inside geomx.torch.DistributedOptimizer "
            f"(sync={algorithm!r}); this script pushes through the raw kvstore, where it would silently run FSA: "
            f"wrap the optimizer in DistributedOptimizer, or unset {var} to push plain gradients")
