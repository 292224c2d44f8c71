"""Issue 17's language-model figure, by hand (not part of the suite: about 2 minutes).

The byte-level LM (examples/train_lm.py, tiny, 40 steps) trained twice: by hand across network namespaces (each DC
and the central party its own host, 100 Mbit/s tbf links, every role started from the documented variables,
tests/test_multihost.py's recipe), and with ``geomx launch --secure`` on loopback over the emulator at 100
Mbit/s. Prints both final validation losses, the bytes geomx counted to other DCs, the kernel's count on the
namespace links and the emulator's count on its links, and when the first step came.

Run as root from the repository: ``.venv/bin/python tests/scripts/lm_netns.py [OUT_DIR]``.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "scripts")]

import netns  # noqa: E402
import test_multihost as mh  # noqa: E402
from harness import Processes, node_env, wait_until  # noqa: E402

LM_ARGS = ["--model-size", "tiny", "--steps", "40", "--eval-every", "40"]


def final_loss(log: Path) -> str:
    return next(line for line in log.read_text().splitlines() if "final validation loss" in line)


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    by_hand, launched = out / "netns", out / "loopback"
    by_hand.mkdir(parents=True)
    mh.EXAMPLE, mh.TRAIN_ARGS = REPO / "examples" / "train_lm.py", LM_ARGS
    with netns.Hosts(["central", *mh.DCS], rate="100mbit") as hosts:
        procs = Processes()
        try:
            started, t0 = {}, time.time()
            for name, host, argv, variables in mh.role_environments(hosts, by_hand):
                started[name] = procs.start(hosts.command(host, argv), node_env(**variables), by_hand / f"{name}.log")
            wait_until(lambda: all(p.poll() is not None for p in started.values()), 600, "every role exiting")
            codes = {name: p.returncode for name, p in started.items()}
            kernel = {dc: hosts.sent_bytes(dc) for dc in mh.DCS}
        finally:
            procs.close()
    assert set(codes.values()) == {0}, codes
    subprocess.run([sys.executable, "-m", "geomx.cli.main", "launch", "--secure", "--wan-rate", "100mbit", "--wan-rtt",
                    "1ms", "--quiet", "--run-dir", str(launched), "--", sys.executable,
                    str(REPO / "examples" / "train_lm.py"), *LM_ARGS], check=True, cwd=REPO)
    links = json.loads((launched / "wan_links.json").read_text())["links"]
    counted = mh.wan_bytes_counted_by_geomx(by_hand)
    print(f"by hand across namespaces: {final_loss(by_hand / 'a-worker-0.log')}; first step "
          f"{mh.first_step_after(by_hand, t0):.1f} s after the first role started")
    print(f"geomx launch on loopback:  {final_loss(launched / 'a-worker-0.log')}")
    for dc in mh.DCS:
        emulated = links[f"{dc}->central"]["bytes"]
        print(f"DC {dc} to other DCs: geomx counted {counted[dc]:,} B across namespaces (the kernel sent "
              f"{kernel[dc]:,}, +{kernel[dc] / counted[dc] - 1:.2%}); the emulator carried {emulated:,} B on "
              f"loopback ({counted[dc] / emulated - 1:+.4%})")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/geomx-lm-netns"))
