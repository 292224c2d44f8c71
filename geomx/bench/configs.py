"""The configurations ``geomx bench wan`` compares: one row each, registered by name.

A later feature (a compressor, a synchronization algorithm) adds its row with one ``register`` call, not by
editing the runner. Every row trains the same model on the same data with the same hyperparameters, seed
and number of steps; a row differs only in topology, mode, environment and extra training arguments.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from geomx.errors import ConfigError


@dataclass(frozen=True)
class BenchConfig:
    name: str                        # --configs picks rows by this
    label: str                       # the row's title in tables and legends
    topology: str = "hips"
    mode: str = "dist_sync"
    mixedsync: str = "wait"                          # dist_async: geomx launch --mixedsync
    env: dict = field(default_factory=dict)          # extra environment of every process
    train_args: tuple[str, ...] = ()                 # extra arguments of examples/train_cnn.py
    slowdown: tuple[str, ...] = ()                   # geomx launch --slowdown entries (DC[:RANK]=FACTOR)
    # the row's sync table, as geomx launch's [sync] table takes it: the launcher writes its variables (every
    # option of the algorithm, defaults too) and knows which options the row set (Topology.sync_given)
    sync: dict = field(default_factory=dict)


CONFIGS: dict[str, BenchConfig] = {}
BASELINE = "flat"          # speedups and byte reductions are against this row


def register(config: BenchConfig) -> BenchConfig:
    if config.name in CONFIGS:
        raise ConfigError(f"benchmark configuration {config.name!r} is registered twice")
    CONFIGS[config.name] = config
    return config


def select(names: str | None) -> list[BenchConfig]:
    """The rows named in ``--configs`` (comma-separated; default: all), the baseline always first."""
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else list(CONFIGS)
    unknown = [n for n in wanted if n not in CONFIGS]
    if unknown:
        raise ConfigError(f"unknown benchmark configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if BASELINE not in wanted:
        wanted.insert(0, BASELINE)
    return [CONFIGS[BASELINE]] + [CONFIGS[n] for n in wanted if n != BASELINE]


register(BenchConfig("flat", "flat PS (dense, dist_sync)", topology="flat"))
register(BenchConfig("hips-fsa", "HiPS FSA (dense, dist_sync)"))
# the control of tensor fusion (geomx.sync.fusion): the same FSA with every tensor its own key
register(BenchConfig("hips-fsa-unfused", "HiPS FSA, a key per tensor (dense, dist_sync, GEOMX_FUSION_BYTES=0)",
                     env={"GEOMX_FUSION_BYTES": "0"}))
register(BenchConfig("hips-mixedsync", "HiPS MixedSync (dense, dist_async)", mode="dist_async"))
register(BenchConfig("hips-mixedsync-overlap", "HiPS MixedSync, WAN overlapped (dense, dist_async)",
                     mode="dist_async", mixedsync="overlap"))
# synchronization algorithms (geomx.sync): GeoMX's HFA setting, DiLoCo on the same schedule, DGA hiding one step
register(BenchConfig("hips-hfa", "HiPS HFA (K1=20, K2=10)", sync={"algorithm": "hfa", "k1": 20, "k2": 10}))
register(BenchConfig("hips-hfa-short", "HiPS HFA (K1=5, K2=2)", sync={"algorithm": "hfa", "k1": 5, "k2": 2}))
register(BenchConfig("hips-diloco", "HiPS DiLoCo (K1=20, K2=10, outer Nesterov 0.7/0.9)",
                     sync={"algorithm": "diloco", "k1": 20, "k2": 10}))
register(BenchConfig("hips-dga", "HiPS DGA (D=1)", sync={"algorithm": "dga", "delay": 1}))
# the same schedules with the global average travelling while 5 DC periods (100 local steps) run
register(BenchConfig("hips-hfa-overlap", "HiPS HFA (K1=20, K2=10, global average overlapped, D=5)",
                     sync={"algorithm": "hfa", "k1": 20, "k2": 10, "overlap": 5}))
register(BenchConfig("hips-diloco-overlap", "HiPS DiLoCo (K1=20, K2=10, outer step overlapped, D=5)",
                     sync={"algorithm": "diloco", "k1": 20, "k2": 10, "overlap": 5}))
# short schedules for runs of tens of steps (the language model's WAN-bound recipe): a global round every 10 steps,
# and the same with that round travelling while the next DC period (5 local steps) runs
SHORT_OVERLAP = {"algorithm": "hfa", "k1": 5, "k2": 2, "overlap": 1}
register(BenchConfig("hips-hfa-short-overlap", "HiPS HFA (K1=5, K2=2, global average overlapped, D=1)",
                     sync=SHORT_OVERLAP))
# the same with each DC average travelling one DC period (5 steps) behind training too: no worker waits for its DC
register(BenchConfig("hips-hfa-short-overlap-dcoverlap", "HiPS HFA (K1=5, K2=2, global average overlapped, D=1, "
                     "each DC average one DC period late)", sync={**SHORT_OVERLAP, "dc_overlap": 5}))
register(BenchConfig("hips-diloco-short", "HiPS DiLoCo (K1=5, K2=2, outer Nesterov 0.7/0.9)",
                     sync={"algorithm": "diloco", "k1": 5, "k2": 2}))
register(BenchConfig("hips-diloco-short-overlap", "HiPS DiLoCo (K1=5, K2=2, outer step overlapped, D=1)",
                     sync={"algorithm": "diloco", "k1": 5, "k2": 2, "overlap": 1}))
# every step a DC average (the DC trains as one data-parallel job), a global average every 10 steps travelling
# while the next 5 run
HFA_DC = {"algorithm": "hfa", "k1": 1, "k2": 10, "overlap": 5}
HFA_DC5 = {"algorithm": "hfa", "k1": 1, "k2": 5, "overlap": 4}   # a global average every 5 steps, behind the next 4
WAN_FP16 = ("--compression", json.dumps({"wan": "fp16"}))        # model changes in fp16 on the WAN: half the bytes
# model changes as 8-bit QSGD levels on the WAN (buckets of 512, error feedback): a quarter of fp32's bytes
WAN_INT8 = ("--compression", json.dumps({"wan": {"type": "qsgd", "levels": 127, "bucket_size": 512}}))
KEEP_HALF = {"overlap_keep": 0.5}   # half of the local progress made while a global average travelled is kept
register(BenchConfig("hips-hfa-dc-overlap", "HiPS HFA (K1=1, K2=10, global average overlapped, D=5)",
                     sync=HFA_DC))
register(BenchConfig("hips-hfa-dc5-overlap", "HiPS HFA (K1=1, K2=5, global average overlapped, D=4)",
                     sync=HFA_DC5))
register(BenchConfig("hips-hfa-dc5-overlap-fp16", "HiPS HFA (K1=1, K2=5, D=4), global averages in fp16 on the WAN",
                     sync=HFA_DC5, train_args=WAN_FP16))
register(BenchConfig("hips-hfa-dc-overlap-fp16", "HiPS HFA (K1=1, K2=10, D=5), global averages in fp16 on the WAN",
                     sync=HFA_DC, train_args=WAN_FP16))
register(BenchConfig("hips-hfa-dc-overlap-keep", "HiPS HFA (K1=1, K2=10, D=5, half the steps taken meanwhile kept)",
                     sync={**HFA_DC, **KEEP_HALF}))
register(BenchConfig("hips-hfa-dc-overlap-fp16-keep", "HiPS HFA (K1=1, K2=10, D=5, half the steps taken meanwhile "
                     "kept), global averages in fp16 on the WAN", sync={**HFA_DC, **KEEP_HALF},
                     train_args=WAN_FP16))
register(BenchConfig("hips-hfa-dc5-overlap-fp16-keep", "HiPS HFA (K1=1, K2=5, D=4, half the steps taken meanwhile "
                     "kept), global averages in fp16 on the WAN", sync={**HFA_DC5, **KEEP_HALF},
                     train_args=WAN_FP16))
register(BenchConfig("hips-hfa-dc5-overlap-int8-keep", "HiPS HFA (K1=1, K2=5, D=4, half the steps taken "
                     "meanwhile kept), global averages as 8-bit QSGD on the WAN",
                     sync={**HFA_DC5, **KEEP_HALF}, train_args=WAN_INT8))
# the same, each global average landing only as the next leaves (D = K2 = 5): the round has 5 steps to hide in
HFA_DC5_LAND = {**HFA_DC5, "overlap": 5, **KEEP_HALF}
register(BenchConfig("hips-hfa-dc5-land-int8-keep", "HiPS HFA (K1=1, K2=5, D=5, half the steps taken meanwhile "
                     "kept), global averages as 8-bit QSGD on the WAN", sync=HFA_DC5_LAND, train_args=WAN_INT8))
register(BenchConfig("hips-hfa-dc5-land-int8-keep-unfused", "HiPS HFA (K1=1, K2=5, D=5, half the steps taken "
                     "meanwhile kept), global averages as 8-bit QSGD on the WAN, a key per tensor "
                     "(GEOMX_FUSION_BYTES=0)",
                     sync=HFA_DC5_LAND, env={"GEOMX_FUSION_BYTES": "0"}, train_args=WAN_INT8))
# a global average every 10 steps landing only 2 steps later: less delay (which costs loss per step) for some
# waiting where the WAN round outlasts 2 steps
register(BenchConfig("hips-hfa-dc10-d2-int8-keep", "HiPS HFA (K1=1, K2=10, D=2, half the steps taken meanwhile "
                     "kept), global averages as 8-bit QSGD on the WAN",
                     sync={**HFA_DC, "overlap": 2, **KEEP_HALF},
                     train_args=WAN_INT8))
# the headline row's K2=5 and 8-bit averages with less delay: each average landing 2 steps after it left (some
# waiting where the WAN round outlasts 2 steps), and on time (D=0: every 5th step waits out the whole round), the
# two other points of the trade between the loss a late average costs and the time an early one waits
register(BenchConfig("hips-hfa-dc5-d2-int8-keep", "HiPS HFA (K1=1, K2=5, D=2, half the steps taken meanwhile "
                     "kept), global averages as 8-bit QSGD on the WAN",
                     sync={**HFA_DC5, "overlap": 2, **KEEP_HALF}, train_args=WAN_INT8))
register(BenchConfig("hips-hfa-dc5-int8", "HiPS HFA (K1=1, K2=5, each global average on time), global averages "
                     "as 8-bit QSGD on the WAN",
                     sync={**HFA_DC5, "overlap": 0}, train_args=WAN_INT8))
# FSA's per-step gradients instead of model averages, as 8-bit QSGD on the WAN, each step's global mean applied 3
# steps late with DGA's correction (the WAN round hides behind 3 steps): FSA's per-sample quality at a quarter of
# its bytes, for iid data, where model averaging trails FSA even on time
register(BenchConfig("hips-dga3-int8", "HiPS DGA (D=3), gradients as 8-bit QSGD on the WAN",
                     sync={"algorithm": "dga", "delay": 3}, train_args=WAN_INT8))
# the same with each DC average travelling one step behind training too (dc_overlap): no worker waits for its DC
register(BenchConfig("hips-hfa-dc5-land-int8-keep-dcoverlap", "HiPS HFA (K1=1, K2=5, D=5, half the steps taken "
                     "meanwhile kept, each DC average one step late), global averages as 8-bit QSGD on the WAN",
                     sync={**HFA_DC5_LAND, "dc_overlap": 1}, train_args=WAN_INT8))
# the small LM's K1=5/K2=2 row with its global averages as 8-bit levels (a round of ~1 s, about the 5 steps it
# travels behind), with and without its DC averages one DC period (dc_overlap = K1 = 5 steps) late
register(BenchConfig("hips-hfa-short-overlap-int8", "HiPS HFA (K1=5, K2=2, global average overlapped, D=1), global "
                     "averages as 8-bit QSGD on the WAN", sync=SHORT_OVERLAP, train_args=WAN_INT8))
register(BenchConfig("hips-hfa-short-overlap-int8-dcoverlap", "HiPS HFA (K1=5, K2=2, global average overlapped, "
                     "D=1, each DC average one DC period late), global averages as 8-bit QSGD on the WAN",
                     sync={**SHORT_OVERLAP, "dc_overlap": 5}, train_args=WAN_INT8))
# its global average allowed two DC periods (10 steps): where compute is fast (16 cores: 0.087 s a step) the 8-bit
# average (~1 s over transpacific) missed its landing 5 steps on, every time
register(BenchConfig("hips-hfa-short-overlap2-int8", "HiPS HFA (K1=5, K2=2, global average overlapped, D=2), global "
                     "averages as 8-bit QSGD on the WAN", sync={**SHORT_OVERLAP, "overlap": 2},
                     train_args=WAN_INT8))
register(BenchConfig("hips-hfa-short-overlap2-int8-keep", "HiPS HFA (K1=5, K2=2, global average overlapped, D=2, "
                     "half the progress meanwhile kept), global averages as 8-bit QSGD on the WAN",
                     sync={**SHORT_OVERLAP, "overlap": 2, **KEEP_HALF}, train_args=WAN_INT8))
# and with each DC average one step late: the LAN round and most of a sibling's lag hide behind that step, and the
# average is 1 step old when adopted rather than 5
register(BenchConfig("hips-hfa-short-overlap-int8-dcstep", "HiPS HFA (K1=5, K2=2, global average overlapped, "
                     "D=1, each DC average one step late), global averages as 8-bit QSGD on the WAN",
                     sync={**SHORT_OVERLAP, "dc_overlap": 1}, train_args=WAN_INT8))
# 4-bit levels (7 a sign), buckets of 48 so that error feedback stays on (levels^2 >= bucket): 4.7 bits an element
WAN_INT4 = ("--compression", json.dumps({"wan": {"type": "qsgd", "levels": 7, "bucket_size": 48}}))
register(BenchConfig("hips-hfa-short-overlap-int4", "HiPS HFA (K1=5, K2=2, global average overlapped, D=1), global "
                     "averages as 4-bit QSGD on the WAN", sync=SHORT_OVERLAP, train_args=WAN_INT4))
register(BenchConfig("hips-hfa-short-d2-int8", "HiPS HFA (K1=5, K2=2, global average overlapped, D=2), global "
                     "averages as 8-bit QSGD on the WAN", sync={**SHORT_OVERLAP, "overlap": 2},
                     train_args=WAN_INT8))
# a global average every 20 steps (K1=5, K2=4) landing 15 steps later, as 8-bit levels, every DC average one DC
# period late: a round of the small LM (~1 s as 8-bit levels over transpacific) hides behind 15 steps
register(BenchConfig("hips-hfa-k5-d3-int8-keep-dcoverlap", "HiPS HFA (K1=5, K2=4, D=3, half the steps taken "
                     "meanwhile kept, each DC average one DC period late), global averages as 8-bit QSGD on the WAN",
                     sync={"algorithm": "hfa", "k1": 5, "k2": 4, "overlap": 3, **KEEP_HALF, "dc_overlap": 5},
                     train_args=WAN_INT8))
# a DC's workers step on their mean gradient (one optimizer state per DC) instead of averaging models
HFA_DC_GRADIENTS = {**HFA_DC, "dc_sync": "gradients"}
register(BenchConfig("hips-hfa-dcgrad-overlap", "HiPS HFA (DC gradient average every step, K2=10, global average "
                     "overlapped, D=5)", sync=HFA_DC_GRADIENTS))
register(BenchConfig("hips-hfa-dcgrad-overlap-fp16", "HiPS HFA (DC gradient average every step, K2=10, D=5), "
                     "global averages in fp16 on the WAN", sync=HFA_DC_GRADIENTS, train_args=WAN_FP16))
register(BenchConfig("hips-hfa-dc5-land-int8-keep-dcgrad", "HiPS HFA (DC gradient average every step, K2=5, D=5, "
                     "half the steps taken meanwhile kept), global averages as 8-bit QSGD on the WAN",
                     sync={**HFA_DC5_LAND, "dc_sync": "gradients"}, train_args=WAN_INT8))
register(BenchConfig("hips-hfa-dc-overlap-unfused",
                     "HiPS HFA (K1=1, K2=10, global average overlapped, D=5), a key per tensor (GEOMX_FUSION_BYTES=0)",
                     sync=HFA_DC, env={"GEOMX_FUSION_BYTES": "0"}))
# P3 against its fair baseline: both with the servers' optimizer (P3 lands the servers' new weights layer by layer)
SERVER_OPTIMIZER = ("--update-on", "server")
register(BenchConfig("hips-fsa-server", "HiPS FSA, servers' optimizer (dist_sync)", train_args=SERVER_OPTIMIZER))
register(BenchConfig("hips-p3", "HiPS P3, servers' optimizer (dist_sync)", sync={"algorithm": "p3"},
                     train_args=SERVER_OPTIMIZER))
register(BenchConfig("hips-p3-unsliced", "HiPS P3 without slices (each parameter one key), servers' optimizer",
                     sync={"algorithm": "p3", "slice": 0}, train_args=SERVER_OPTIMIZER))
# hips-p3 travels in the parts sized for the WAN (geomx launch sets GEOMX_P3_SLICE=0 over an emulated WAN)
register(BenchConfig("hips-p3-sliced", "HiPS P3 in slices of 50,000 elements, servers' optimizer",
                     sync={"algorithm": "p3", "slice": 50_000}, train_args=SERVER_OPTIMIZER))
# heterogeneous DCs: DC b computes 3x slower
SLOW = ("b=3",)
register(BenchConfig("hips-fsa-slow", "HiPS FSA, DC b 3x slower", slowdown=SLOW))
register(BenchConfig("hips-mixedsync-slow", "HiPS MixedSync, DC b 3x slower", mode="dist_async", slowdown=SLOW))
register(BenchConfig("hips-mixedsync-overlap-slow", "HiPS MixedSync, WAN overlapped, DC b 3x slower",
                     mode="dist_async", mixedsync="overlap", slowdown=SLOW))
register(BenchConfig("hips-esync-slow", "HiPS ESync, DC b 3x slower", sync={"algorithm": "esync"},
                     slowdown=SLOW))
register(BenchConfig("hips-esync2-slow", "HiPS ESync (slowest worker: 2 local steps per round), DC b 3x slower",
                     sync={"algorithm": "esync", "steps": 2}, slowdown=SLOW))


def _compressed(name: str, label: str, spec: dict) -> BenchConfig:
    return register(BenchConfig(name, label, train_args=("--compression", json.dumps(spec))))


# Bi-Sparse as GeoMX ships it (tensors below 200,000 elements travel dense), and with GeoMX's scripts' bound
# of 1000 elements, where every weight matrix is sparsified (the byte-reduction row)
_compressed("hips-bsc", "HiPS + Bi-Sparse 1% (dist_sync)", {"type": "bsc", "threshold": 0.01})
_compressed("hips-bsc-0.1", "HiPS + Bi-Sparse 0.1%, bound 1000 (dist_sync)",
            {"type": "bsc", "threshold": 0.001, "size_lower_bound": 1000})
_compressed("hips-fp16", "HiPS + FP16 (dist_sync)", {"type": "fp16"})
_compressed("hips-mpq", "HiPS + MPQ 1% (dist_sync)", {"type": "mpq", "threshold": 0.01})
_compressed("hips-powersgd", "HiPS + PowerSGD rank 4 on the WAN (dist_sync)",
            {"wan": {"type": "powersgd", "rank": 4}, "size_lower_bound": 1000})
# the control: each DC trains alone on its own data (its workers average their models every step), nothing
# crosses the WAN after set-up; a target it reaches too needs no cooperation between DCs
NEVER = 10 ** 9
register(BenchConfig("no-wan", "no WAN: each DC alone (DC average every step, no global average)",
                     sync={"algorithm": "hfa", "k1": 1, "k2": NEVER}))
register(BenchConfig("no-wan-dcoverlap", "no WAN: each DC alone (DC average every step, one step late)",
                     sync={"algorithm": "hfa", "k1": 1, "k2": NEVER, "dc_overlap": 1}))
