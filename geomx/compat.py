"""Which deployment settings combine, in one table: mode x MixedSync variant x topology x synchronization
algorithm x server optimizer x gradient compression x gradient accumulation x time-based checkpoints.

Every place that learns a setting asks :func:`check` (or :func:`conflict`, for a server that answers with a
refusal) with what it knows, and a conflict is reported the same way wherever it is found: the launcher before
it starts anything, ``geomx.kvstore.create``, the global servers at ``set_mode`` / ``set_optimizer``,
``DistributedOptimizer`` and the synchronization policies at set-up. A setting a caller does not know is left
out (None) and takes part in no rule. The message names the two settings that conflict and why.

Gradient compression combines with everything today (HFA/DiLoCo send model changes through it, MixedSync and
server optimizers have their own reply streams, geomx.cluster.compressed); a rule for it goes here.

No torch here: the launcher validates configurations with it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from geomx.errors import ConfigError
from geomx.sync.settings import (DC_ROUND_ALGORITHMS, ROUND_PER_STEP_ALGORITHMS, SERVER_OPTIMIZER_ALGORITHMS,
                                 WORKER_SIDE_ALGORITHMS)


@dataclass(frozen=True)
class Combination:
    """What a caller knows of the deployment; None: unknown here."""
    mode: str | None = None                  # dist_sync / dist_async
    mixedsync: str | None = None             # wait / overlap (dist_async)
    topology: str | None = None              # hips / flat
    sync: str | None = None                  # geomx.sync algorithm name
    k2: int = 1                              # hfa/diloco: DC averages per global average
    weights: str = "samples"                 # hfa/diloco weighting
    server_optimizer: bool | None = None     # the global servers run an optimizer
    compression: bool | None = None          # some tier compresses gradients
    backward_passes_per_step: int = 1        # DistributedOptimizer's gradient accumulation
    checkpoint_seconds: float | None = None  # time-based checkpoints (geomx.cluster.checkpoint_clock)


# how each setting is named in a message: its value, and where a user sets it
LABELS: dict[str, Callable[[Combination], str]] = {
    "mode": lambda c: f"mode {c.mode!r} (GEOMX_MODE, --mode, geomx.kvstore.create)",
    "mixedsync": lambda c: f"--mixedsync {c.mixedsync} (GEOMX_MIXEDSYNC={c.mixedsync!r})",
    "topology": lambda c: f"topology {c.topology!r} (GEOMX_TOPOLOGY, --topology)",
    "sync": lambda c: f"sync {c.sync!r} (GEOMX_SYNC, --sync, DistributedOptimizer(sync=))",
    "server_optimizer": lambda c: "a server optimizer (kv.set_optimizer, DistributedOptimizer(update_on_server=True))"
    if c.server_optimizer else "no server optimizer (the workers update: DistributedOptimizer's default)",
    "compression": lambda c: "gradient compression (kv.set_gradient_compression)",
    "backward_passes_per_step": lambda c: f"backward_passes_per_step={c.backward_passes_per_step}",
    "checkpoint_seconds": lambda c: f"--checkpoint-seconds {c.checkpoint_seconds:g} (GEOMX_CHECKPOINT_SECONDS)",
}


@dataclass(frozen=True)
class Rule:
    pair: tuple[str, str]                       # the two settings (LABELS keys)
    conflicts: Callable[[Combination], bool]    # True when this combination cannot run
    reason: Callable[[Combination], str]


def _variant(c: Combination) -> bool:
    return c.mixedsync not in (None, "wait")


def _worker_side(c: Combination) -> bool:
    return c.sync in WORKER_SIDE_ALGORITHMS


RULES: tuple[Rule, ...] = (
    Rule(("mixedsync", "mode"), lambda c: _variant(c) and c.mode not in (None, "dist_async"),
         lambda c: "MixedSync's variants are options of the dist_async mode"),
    Rule(("mixedsync", "topology"), lambda c: _variant(c) and c.topology == "flat",
         lambda c: "a variant decides when the local servers answer their DC, and the flat topology has no local "
                   "servers (use hips)"),
    Rule(("mixedsync", "server_optimizer"), lambda c: c.mixedsync == "overlap" and bool(c.server_optimizer),
         lambda c: "MixedSync 'overlap' updates on the workers: a local server answers its DC before the global "
                   "servers' weights exist, so it cannot run with a server optimizer (GEOMX_MIXEDSYNC=wait can)"),
    Rule(("sync", "mode"), lambda c: _worker_side(c) and c.mode not in (None, "dist_sync"),
         lambda c: f"{c.sync} synchronizes on the workers in synchronous rounds: it needs a dist_sync kvstore"),
    Rule(("sync", "server_optimizer"), lambda c: _worker_side(c) and bool(c.server_optimizer),
         lambda c: f"{c.sync} updates on the workers and needs gradients or models back, not the servers' "
                   f"weights"),
    Rule(("sync", "server_optimizer"), lambda c: c.sync in SERVER_OPTIMIZER_ALGORITHMS and c.server_optimizer is False,
         lambda c: f"{c.sync} lands each layer's new weights from the servers in the next forward pass: it needs the "
                   f"servers' optimizer (DistributedOptimizer(update_on_server=True); --update-on server in the "
                   f"examples)"),
    # known at launch, before any worker says whether it updates on the servers: p3 always needs them to
    Rule(("sync", "mixedsync"), lambda c: c.sync in SERVER_OPTIMIZER_ALGORITHMS and c.mixedsync == "overlap",
         lambda c: f"{c.sync} needs the servers' optimizer, and MixedSync 'overlap' cannot run one (a local server "
                   f"answers its DC before the global servers' weights exist); use --mixedsync wait"),
    Rule(("sync", "topology"),
         lambda c: c.sync in DC_ROUND_ALGORITHMS and c.topology == "flat" and (c.k2 > 1 or c.weights == "equal"),
         lambda c: f"{c.sync} with K2 = {c.k2} and {c.weights!r} weights needs DC rounds, i.e. the hips topology "
                   f"(the flat topology has no local servers); use K2 = 1 and samples"),
    Rule(("sync", "backward_passes_per_step"), lambda c: _worker_side(c) and c.backward_passes_per_step != 1,
         lambda c: f"{c.sync} steps on every step() call; accumulate gradients yourself (several backward() calls "
                   f"before step() add up in .grad) instead"),
    # the global servers declare a checkpoint round that every worker saves as the same step: a step must be one
    # round of every key, taken by all workers together
    Rule(("checkpoint_seconds", "mode"), lambda c: bool(c.checkpoint_seconds) and c.mode == "dist_async",
         lambda c: "dist_async applies each DC's push on its own, so no round is the same step for every worker "
                   "and key; use --checkpoint-every"),
    Rule(("checkpoint_seconds", "sync"),
         lambda c: bool(c.checkpoint_seconds) and c.sync is not None and c.sync not in ROUND_PER_STEP_ALGORITHMS,
         lambda c: f"{c.sync} does not take one synchronous round of every key per step, so the servers' rounds "
                   f"cannot name the workers' steps; time-based checkpoints need "
                   f"{' or '.join(ROUND_PER_STEP_ALGORITHMS)} (use --checkpoint-every)"),
)


def conflict(combination: Combination | None = None, **settings) -> str | None:
    """The message naming the first conflicting pair of settings, or None when they combine."""
    c = combination if combination is not None else Combination(**settings)
    for rule in RULES:
        if rule.conflicts(c):
            a, b = rule.pair
            return f"{LABELS[a](c)} conflicts with {LABELS[b](c)}: {rule.reason(c)}"
    return None


def check(combination: Combination | None = None, **settings) -> None:
    """Raise ConfigError naming the conflicting pair, if the settings do not combine."""
    message = conflict(combination, **settings)
    if message is not None:
        raise ConfigError(message)


def check_kvstore(kv, sync: str, *, k2: int = 1, weights: str = "samples") -> None:
    """A synchronization policy's check at set-up, against what the kvstore learned from the deployment."""
    check(mode=kv.type, topology=kv.cfg.topology, server_optimizer=kv.server_updates, sync=sync, k2=k2,
          weights=weights)
