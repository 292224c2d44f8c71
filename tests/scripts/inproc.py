"""Whole geomx deployments inside the test process: the real schedulers, servers and clients, each node on
its own van and threads (no processes), torn down by ``close``.

The van is the in-memory one (geomx.transport.inproc, one Hub per deployment, optionally with emulated WAN
links) or ZeroMQ over loopback (``van="zmq"``). Node ids of servers and flat workers are fixed
(``worker-0``...), so a server's saved state names the same clients in a second deployment built the same way.

* ``FlatCluster``: one global server serving the training workers directly (GeoMX's flat topology), and the
  master worker; clients are raw KVClients.
* ``HipsCluster``: the global server, a local server per DC, the master worker and the DCs' workers as
  ``geomx.kvstore`` KVStores; ``drop`` has a scheduler go on without a member (fault domains).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from geomx.cluster.client import KVClient
from geomx.cluster.global_server import start_global_server
from geomx.cluster.local_server import start_local_server
from geomx.cluster.postoffice import Postoffice
from geomx.cluster.scheduler import Scheduler, dc_rule, worker_rule
from geomx.config import NodeConfig
from geomx.kvstore.kvstore import KVStore
from geomx.profiles import CENTRAL_DC
from geomx.transport.inproc import Hub

DEADLINE_S = 60.0     # deadlines only: a loaded 2-core machine may be slow, never wrong


class Deployment:
    def __init__(self, van: str = "inproc", link: Callable | None = None, heartbeat_interval: float = 1.0,
                 measured_liveness: bool = False) -> None:
        """``heartbeat_interval``: every member's; ``measured_liveness``: the schedulers' deadlines measured from
        the heartbeats (geomx.cluster.liveness), else 60 s."""
        self.van = van
        self.heartbeat_interval, self.measured_liveness = heartbeat_interval, measured_liveness
        self.hub = Hub(link=link) if van == "inproc" else None
        self._stops: list[Callable[[], None]] = [self.hub.close] if self.hub else []
        self.schedulers: dict[str, Scheduler] = {}

    def config(self, **fields) -> NodeConfig:
        return NodeConfig(van=self.van, van_options={"hub": self.hub} if self.hub else {}, heartbeat_timeout=60.0,
                          heartbeat_interval=self.heartbeat_interval, op_timeout=DEADLINE_S,
                          connect_timeout=DEADLINE_S, **fields)

    def scheduler(self, tier: str, dc: str, expected: dict, drop_rule=None, topology: str = "hips") -> tuple[str, int]:
        """Start a tier's scheduler; its (host, port) for the members' configurations."""
        sched = Scheduler(tier=tier, dc=dc, expected=expected, port=0, heartbeat_timeout=60.0,
                          connect_timeout=DEADLINE_S, van=self.van, drop_rule=drop_rule, topology=topology,
                          measured_liveness=self.measured_liveness,
                          van_options={"hub": self.hub} if self.hub else None)
        self.schedulers[tier] = sched
        threading.Thread(target=sched.serve, name=f"scheduler-{tier}", daemon=True).start()
        self._stops.insert(0, sched.stop)
        end = time.monotonic() + DEADLINE_S
        while not sched.van.port:
            if time.monotonic() > end:
                raise TimeoutError(f"the {tier} scheduler did not start within {DEADLINE_S:g} s")
            time.sleep(0.005)
        return (self.hub.name if self.hub else "127.0.0.1"), sched.van.port

    def start_nodes(self, makers: list[Callable[[], object]], close: Callable[[object], None]) -> list:
        """Start nodes concurrently (each blocks until its tiers are complete); all or nothing."""
        with ThreadPoolExecutor(len(makers)) as pool:
            futures = [pool.submit(make) for make in makers]
        nodes = []
        for f in futures:
            if f.exception() is None:
                node = f.result()
                nodes.append(node)
                self._stops.insert(0, lambda n=node: close(n))
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            self.close()
            raise failed[0]
        return nodes

    def drop(self, tier: str, node_id: str) -> None:
        """The tier's scheduler goes on without member ``node_id``, as when its heartbeats stop (fault domains)."""
        sched = self.schedulers[tier]
        with sched._lock:
            sched._drop(sched._members[node_id], f"{node_id} dropped by the test")

    def close(self) -> None:
        stops, self._stops = self._stops, []
        for stop in stops:
            stop()


class Client:
    """A raw client: a postoffice joined to one tier, and the KVClient on it."""

    def __init__(self, cfg: NodeConfig, node_id: str, tier: str, scheduler: tuple, declared: dict) -> None:
        self.po = Postoffice(cfg, node_id=node_id)
        self.kv: KVClient | None = None
        self.po.on_data = lambda msg: self.kv.handle_reply(msg) if msg.op == "reply" and self.kv else None
        self.po.start()
        try:
            joined = self.po.join(tier, scheduler, CENTRAL_DC, "worker", declared)
            self.kv = KVClient(self.po, joined, master=cfg.role == "master")
        except BaseException:
            self.po.close()
            raise


class FlatCluster(Deployment):
    """``global_server_fields``: NodeConfig fields of the global server alone (what its environment would set)."""

    def __init__(self, num_workers: int = 2, van: str = "inproc", global_server_fields: dict | None = None) -> None:
        super().__init__(van)
        gs = self.scheduler("global", CENTRAL_DC, {"server": 1, "worker": num_workers}, topology="flat")
        cs = self.scheduler("dc:central", CENTRAL_DC, {"server": 1, "worker": 1})
        counts = {"num_global_servers": 1, "num_global_workers": num_workers, "num_all_workers": num_workers}
        server_cfg = self.config(role="global_server", dc=CENTRAL_DC, scheduler=cs, global_scheduler=gs,
                                 num_workers=1, num_servers=1, **counts, **(global_server_fields or {}))
        master_cfg = self.config(role="master", dc=CENTRAL_DC, scheduler=cs, num_workers=1, num_servers=1, **counts)
        self.done = threading.Event()
        makers = [lambda: start_global_server(server_cfg, self.done, node_id="global_server-0"),
                  lambda: Client(master_cfg, "master", "dc:central", cs, {"num_workers": 1, "num_servers": 1})]
        for i in range(num_workers):
            cfg = self.config(role="worker", dc="a", global_scheduler=gs, **counts)
            makers.append(lambda cfg=cfg, i=i: Client(cfg, f"worker-{i}", "global", gs, counts))
        self.server, self.master, *self.workers = self.start_nodes(makers, lambda node: node.po.close())


class HipsCluster(Deployment):
    """``dcs`` DCs of ``per_dc`` workers each (a number, or one per DC); ``self.workers[dc]`` are their KVStores,
    ``self.local[dc]`` their local servers; ``restart_worker`` starts a worker again after its DC dropped it.
    ``global_server_fields``: NodeConfig fields of the global server
    alone (what its environment would set). ``master_mode``: the master worker's kvstore type, if not ``mode``.
    ``reduction``: every kvstore's (the tests here were written for the mean; None: not asked, the sum).
    ``mixedsync``: the MixedSync variant the master worker asks for (dist_async). ``global_servers``: how many
    (``self.global_servers``, by rank; ``self.global_server`` is rank 0). ``liveness``: see Deployment."""

    def __init__(self, dcs=("a", "b"), per_dc: int | list[int] = 2, mode: str = "dist_sync", van: str = "inproc",
                 link: Callable | None = None, global_server_fields: dict | None = None,
                 master_mode: str | None = None, reduction: str | None = "mean", mixedsync: str = "wait",
                 global_servers: int = 1, workers_ask_ranks: bool = True, **liveness) -> None:
        super().__init__(van, link, **liveness)
        self._workers_ask_ranks = workers_ask_ranks     # False: as hand-started GeoMX workers, the scheduler ranks
        sizes = dict(zip(dcs, per_dc if isinstance(per_dc, list | tuple) else [per_dc] * len(dcs), strict=True))
        total = sum(sizes.values())
        self.worker_configs: dict[tuple[str, int], NodeConfig] = {}
        self._worker_args = (mode, reduction)
        # fault domains as geomx.node sets them up: a DC goes on without a worker, the global tier without a DC
        gs = self.scheduler("global", CENTRAL_DC, {"server": global_servers, "worker": len(dcs)},
                            drop_rule=dc_rule(1))
        cs = self.scheduler("dc:central", CENTRAL_DC, {"server": global_servers, "worker": 1})
        counts = {"num_global_servers": global_servers, "num_global_workers": len(dcs), "num_all_workers": total}
        makers: list = [lambda rank=rank: start_global_server(
            self.config(role="global_server", dc=CENTRAL_DC, scheduler=cs, global_scheduler=gs, num_workers=1,
                        num_servers=global_servers, rank=rank, **counts, **(global_server_fields or {})),
            threading.Event(), node_id=f"global_server-{rank}") for rank in range(global_servers)]
        self._global = (gs, counts)
        for dc, size in sizes.items():
            makers += self._dc_makers(dc, size, f"server-{dc}")
        makers.append(lambda: KVStore(self.config(role="master", dc=CENTRAL_DC, scheduler=cs, num_workers=1,
                                                  num_servers=global_servers, mixedsync=mixedsync, **counts),
                                      master_mode or mode, reduction=reduction))
        nodes = self.start_nodes(makers, _close)
        self.global_servers, self.master = nodes[:global_servers], nodes[-1]
        self.global_server = self.global_servers[0]
        self.local, self.workers = {}, {}
        it = iter(nodes[global_servers:-1])
        for dc, size in sizes.items():
            self.local[dc] = next(it)
            self.workers[dc] = [next(it) for _ in range(size)]

    def _dc_makers(self, dc: str, size: int, server_id: str) -> list[Callable[[], object]]:
        """Start DC ``dc``'s scheduler; the makers of its local server and its ``size`` workers."""
        gs, counts = self._global
        mode, reduction = self._worker_args
        ds = self.scheduler(f"dc:{dc}", dc, {"server": 1, "worker": size}, drop_rule=worker_rule(1))
        makers: list = [lambda: start_local_server(
            self.config(role="server", dc=dc, scheduler=ds, global_scheduler=gs, num_workers=size, num_servers=1,
                        **counts), threading.Event(), node_id=server_id)]
        for rank in range(size):
            cfg = self.worker_configs[(dc, rank)] = self.config(role="worker", dc=dc, scheduler=ds, num_workers=size,
                                                                num_servers=1, **counts,
                                                                rank=rank if self._workers_ask_ranks else None)
            makers.append(lambda cfg=cfg: KVStore(cfg, mode, reduction=reduction))
        return makers

    def restart_dc(self, dc: str, server_id: str) -> None:
        """DC ``dc`` started afresh after the global tier dropped it (a new scheduler, local server ``server_id``
        and workers), as ``geomx launch --rejoin-after`` restarts a lost DC; ``self.local``/``self.workers`` name
        the new ones."""
        size = len(self.workers[dc])
        nodes = self.start_nodes(self._dc_makers(dc, size, server_id), _close)
        self.local[dc], self.workers[dc] = nodes[0], nodes[1:]

    def init_everywhere(self, key, value) -> list[KVStore]:
        """The master worker's init of ``key`` with ``value``, then every worker's (whose value only gives the
        layout); returns the workers' kvstores."""
        self.master.init(key, value)
        kvs = [kv for workers in self.workers.values() for kv in workers]
        for kv in kvs:
            kv.init(key, np.zeros_like(value))
        return kvs

    def restart_worker(self, dc: str, rank: int) -> KVStore:
        """A fresh worker process's kvstore for (dc, rank), as one restarted after its DC dropped it: it registers
        with the running DC tier (rejoin)."""
        mode, reduction = self._worker_args
        return self.start_nodes([lambda: KVStore(self.worker_configs[(dc, rank)], mode, reduction=reduction)],
                                _close)[0]


def _close(node) -> None:
    """Stop a node of a HipsCluster: a kvstore leaves its tiers, a server closes its postoffice."""
    if isinstance(node, KVStore):
        node.close()
    else:
        node.po.close()
