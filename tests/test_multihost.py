"""A deployment across separate hosts, started by hand from the documented variables alone.

Each DC and the central party is its own Linux network namespace with its own address (tests/scripts/netns.py),
the links between them shaped to 100 Mbit/s by the kernel. Every role is started the way docs/environment.md
tells a user to start it on real machines: `python -m geomx.node` or the training script, with the `DMLC_*`
variables and `DMLC_NODE_HOST`; nothing is launched by `geomx launch` and nothing assumes 127.0.0.1.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import netns
from harness import Processes, check_ok, launch, logs, node_env, wait_until

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_cnn.py"
TRAIN_ARGS = ["--epochs", "1", "--seed", "3"]
DCS, PER_DC = ("a", "b"), 2
SECRET = "multi-host test secret, not for production"

why_not = netns.unavailable()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no separate hosts here: {why_not}")


def role_environments(hosts: netns.Hosts, run_dir: Path) -> list[tuple[str, str, list[str], dict]]:
    """(name, host, argv, variables) of every role, as a user writes them for real machines."""
    node = [sys.executable, "-m", "geomx.node"]
    train = [sys.executable, str(EXAMPLE), *TRAIN_ARGS]
    central_host, n_all = hosts.address["central"], len(DCS) * PER_DC
    # the links cross a (pretend) public network: every role holds the deployment's secret (AES-GCM)
    common = {"GEOMX_RUN_DIR": str(run_dir), "GEOMX_CONNECT_TIMEOUT": "60", "GEOMX_TIMEOUT": "60",
              "GEOMX_SECRET": SECRET}
    glob = {"DMLC_PS_GLOBAL_ROOT_URI": central_host, "DMLC_PS_GLOBAL_ROOT_PORT": "9000",
            "DMLC_NUM_GLOBAL_SERVER": "1", "DMLC_NUM_GLOBAL_WORKER": str(len(DCS))}
    central = {"DMLC_PS_ROOT_URI": central_host, "DMLC_PS_ROOT_PORT": "9001", "DMLC_NUM_SERVER": "1",
               "DMLC_NUM_WORKER": "1", "GEOMX_DC": "central", "DMLC_NODE_HOST": central_host}
    roles = [("global-scheduler", "central", node, {**common, **glob, "DMLC_ROLE_GLOBAL": "global_scheduler",
                                                    "DMLC_NODE_HOST": central_host}),
             ("central-scheduler", "central", node, {**common, **central, "DMLC_ROLE": "scheduler"}),
             ("global-server", "central", node, {**common, **glob, **central, "DMLC_ROLE_GLOBAL": "global_server",
                                                 "DMLC_ROLE": "server", "DMLC_NUM_ALL_WORKER": str(n_all)}),
             ("master", "central", train, {**common, **central, "DMLC_ROLE": "worker",
                                           "DMLC_ROLE_MASTER_WORKER": "1", "DMLC_NUM_ALL_WORKER": str(n_all)})]
    for d, dc in enumerate(DCS):
        host = hosts.address[dc]
        # each scheduler a port of its own: a sealed message names its receiver's port, not its host
        local = {"DMLC_PS_ROOT_URI": host, "DMLC_PS_ROOT_PORT": str(9002 + d), "DMLC_NUM_SERVER": "1",
                 "DMLC_NUM_WORKER": str(PER_DC), "GEOMX_DC": dc, "DMLC_NODE_HOST": host}
        if d == 1:        # as behind NAT: listen on every interface, advertise the address others reach
            local["GEOMX_BIND_HOST"] = "0.0.0.0"
        roles.append((f"{dc}-scheduler", dc, node, {**common, **local, "DMLC_ROLE": "scheduler"}))
        roles.append((f"{dc}-server", dc, node, {**common, **local, **glob, "DMLC_ROLE": "server"}))
        for r in range(PER_DC):
            roles.append((f"{dc}-worker-{r}", dc, train, {
                **common, **local, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(r),
                "DMLC_NUM_ALL_WORKER": str(n_all), "GEOMX_WORKER_INDEX": str(d * PER_DC + r)}))
    return roles


def first_step_after(run_dir: Path, started_at: float) -> float:
    """Seconds from the first role's start to the first training step any worker recorded (issue 17's "first
    step within 30 s by hand"; printed, not asserted: a timing on a shared machine is a benchmark's)."""
    from geomx.metrics import METRICS_DIR, read_records

    steps = [r["t"] for f in (run_dir / METRICS_DIR).glob("*.jsonl") for r in read_records(f)
             if r["kind"] == "step"]
    return min(steps) - started_at


def wan_bytes_counted_by_geomx(run_dir: Path) -> dict[str, int]:
    """Bytes each DC's processes handed to the network for another DC (their final traffic records)."""
    from geomx.metrics import METRICS_DIR, read_records

    sent: dict[str, int] = {}
    for f in (run_dir / METRICS_DIR).glob("*.jsonl"):
        records = read_records(f)
        dc = records[0]["dc"]
        traffic = [r for r in records if r["kind"] == "traffic"]
        if traffic:
            for dst, n in traffic[-1].get("sent", {}).items():
                if dst != dc:
                    sent[dc] = sent.get(dc, 0) + int(n)
    return sent


@pytest.fixture(scope="module")
def loopback_accuracy(tmp_path_factory):
    """The same training on one machine over loopback (`geomx launch`), for comparison."""
    run_dir = check_ok(launch(tmp_path_factory.mktemp("loopback"), EXAMPLE, script_args=TRAIN_ARGS,
                              dcs=len(DCS), workers_per_dc=PER_DC, timeout=120))
    return {json.loads(p.read_text())["final_test_acc"] for p in run_dir.glob("result-*.json")}


def test_hand_started_roles_on_separate_hosts_train_as_on_loopback_and_count_the_wan_bytes_the_kernel_sent(
        tmp_path, loopback_accuracy):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with netns.Hosts(["central", *DCS], rate="100mbit") as hosts:
        procs = Processes()
        try:
            started, started_at = {}, time.time()
            for name, host, argv, variables in role_environments(hosts, run_dir):
                started[name] = procs.start(hosts.command(host, argv), node_env(**variables),
                                            run_dir / f"{name}.log")
            began = time.monotonic()
            wait_until(lambda: all(p.poll() is not None for p in started.values()), 150, "every role exiting")
            codes = {name: p.returncode for name, p in started.items()}
            assert set(codes.values()) == {0}, f"{codes}\n{logs(run_dir)[-12000:]}"
            kernel = {dc: hosts.sent_bytes(dc) for dc in DCS}
        finally:
            procs.close()
    finals = {json.loads(p.read_text())["final_test_acc"] for p in run_dir.glob("result-*.json")}
    assert len(list(run_dir.glob("result-*.json"))) == len(DCS) * PER_DC
    # FSA is deterministic: the same model on every worker, and the same as over loopback
    assert finals == loopback_accuracy, (finals, loopback_accuracy)
    print(f"first training step {first_step_after(run_dir, started_at):.1f} s after the first role started")
    counted = wan_bytes_counted_by_geomx(run_dir)
    for dc in DCS:
        # the kernel adds TCP/IP headers, acknowledgements of the downlink and CurveZMQ's box overhead
        print(f"DC {dc}: geomx counted {counted[dc]:,} bytes to other DCs, the kernel sent {kernel[dc]:,}")
        assert counted[dc] <= kernel[dc] <= 1.02 * counted[dc], (dc, counted[dc], kernel[dc])
    assert time.monotonic() - began < 150


def test_doctor_probe_measures_the_rate_the_kernel_shapes_between_two_hosts_and_their_rtt():
    """`geomx doctor --probe-listen` on one host, `--probe` from the other, across a 100 Mbit/s tbf link: one TCP
    stream's steady goodput is the shaped rate less the headers (99.3 Mbit/s in 3 of 3 runs), the RTT a veth's."""
    import re
    import subprocess

    with netns.Hosts(["a", "b"], rate="100mbit") as hosts:
        geomx_cli = [sys.executable, "-m", "geomx.cli.main", "doctor"]
        listener = subprocess.Popen(hosts.command("b", [*geomx_cli, "--probe-listen", f"{hosts.address['b']}:7999",
                                                        "--probe-for", "30"]), env=node_env(),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline().startswith("answering probes on"), "the listener did not start"
            done = subprocess.run(hosts.command("a", [*geomx_cli, "--probe", f"{hosts.address['b']}:7999",
                                                      "--probe-mb", "12"]),
                                  env=node_env(), capture_output=True, text=True, timeout=60)
        finally:
            listener.kill()
            listener.wait(10)
    assert done.returncode == 0, done.stderr
    print(done.stdout.strip())
    rate = float(re.search(r"([\d.]+) Mbit/s received", done.stdout).group(1))
    rtt = float(re.search(r"RTT ([\d.]+) ms", done.stdout).group(1))
    assert 90 <= rate <= 101, done.stdout
    assert 0 < rtt < 5, done.stdout
