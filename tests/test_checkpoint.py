"""Worker checkpoints (geomx.torch.checkpoint) and `geomx launch --resume`: a job stopped after a checkpoint and
resumed ends on exactly the model of the job that never stopped."""
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from geomx.cli.launch import Launcher, resume_directory
from geomx.cli.topology import load_topology
from geomx.errors import ConfigError
from geomx.torch.checkpoint import Checkpointer, common_step, steps_saved

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_cnn.py"


def _training_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        schedule.step()
    return model, opt, schedule


def test_a_restored_checkpoint_continues_exactly_like_the_saved_state_with_rng_and_schedule(tmp_path):
    model, opt, schedule = _training_state(0)
    saver = Checkpointer(tmp_path, worker=0, workers=1, every=3, model=model, optimizer=opt, schedule=schedule)
    saver.save(3, local_steps=3)
    expected = [model(torch.randn(2, 4)).detach(), opt.param_groups[0]["lr"]]    # draws from torch's RNG

    model2, opt2, schedule2 = _training_state(1)                                  # another state entirely
    loader = Checkpointer(tmp_path / "new", worker=0, workers=1, every=3, resume_from=tmp_path, model=model2,
                          optimizer=opt2, schedule=schedule2)
    assert loader.restore() == 3
    assert torch.equal(model2(torch.randn(2, 4)).detach(), expected[0])          # same weights, same RNG draw
    assert opt2.param_groups[0]["lr"] == expected[1]
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and torch.equal(a["step"], b["step"])


def test_each_worker_keeps_its_last_two_files_and_resume_takes_the_latest_step_all_workers_have(tmp_path):
    model, opt, _ = _training_state(0)
    for worker, steps in ((0, [2, 4, 6, 8]), (1, [2, 4, 6])):       # worker 1 died before its step-8 save
        saver = Checkpointer(tmp_path, worker=worker, workers=2, every=2, model=model, optimizer=opt)
        for step in steps:
            saver.save(step, local_steps=step)
    assert {w: sorted(s) for w, s in steps_saved(tmp_path).items()} == {0: [6, 8], 1: [4, 6]}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]        # no temporary file left
    assert common_step(tmp_path, 2) == 6
    # another topology is named as such (it read as a missing worker, or asked whether checkpoints were on)
    with pytest.raises(ConfigError, match=r"a run of 2 workers, this run has 3: resume with the topology"):
        common_step(tmp_path, 3)
    # a worker of the saved run that never saved is named
    three = tmp_path / "three"
    for worker in (0, 1):
        Checkpointer(three, worker=worker, workers=3, every=2, model=model, optimizer=opt).save(2, local_steps=2)
    with pytest.raises(ConfigError, match=r"no checkpoint of worker\(s\) \[2\]"):
        common_step(three, 3)


def test_resume_is_checked_before_anything_starts_naming_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="has no checkpoints directory"):
        resume_directory(tmp_path / "old", tmp_path / "new", 2)
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="its own --run-dir"):
        resume_directory(tmp_path / "old", tmp_path / "old", 2)
    with pytest.raises(ConfigError, match=r"no checkpoint of worker\(s\) \[0, 1\]"):
        resume_directory(tmp_path / "old", tmp_path / "new", 2)
    model, opt, _ = _training_state(0)
    for worker in (0, 1):
        Checkpointer(tmp_path / "old" / "checkpoints", worker=worker, workers=2, every=3, model=model,
                     optimizer=opt).save(3, local_steps=3)
    with pytest.raises(ConfigError, match=r"at step 2: every worker has only steps \[3\]"):
        resume_directory(tmp_path / "old", tmp_path / "new", 2, step=2)
    assert resume_directory(tmp_path / "old", tmp_path / "new", 2)[0].name == "checkpoints"


# how each variant is deployed: FSA with the optimizer on the global server (flat), and DiLoCo over two DCs
# (HiPS), whose workers carry the inner optimizer, the outer momentum and a round's base model
DEPLOYMENTS = {"server": dict(dcs=1, workers_per_dc=1, topology="flat"),
               "worker": dict(dcs=2, workers_per_dc=1, topology="hips", sync={"algorithm": "diloco", "k1": 2})}


def _train(run_dir: Path, steps: int, update_on: str, checkpoint_dir: Path | None = None, *,
           deployment: dict | None = None, env: dict | None = None, **resume) -> str:
    """``env``: what geomx launch sets for every role (default: --checkpoint-every 3)."""
    topo = load_topology(wan="lan", **(deployment or DEPLOYMENTS[update_on]))
    topo.env.update(env or {"GEOMX_CHECKPOINT_EVERY": "3"})
    if checkpoint_dir is not None:
        topo.env["GEOMX_CHECKPOINT_DIR"] = str(checkpoint_dir)     # geomx launch --checkpoint-dir
    out = io.StringIO()
    launcher = Launcher(topo, [sys.executable, str(EXAMPLE), "--steps", str(steps), "--update-on", update_on],
                        run_dir=run_dir, out=out, **resume)
    assert launcher.run(timeout=120) == 0, out.getvalue()[-3000:]
    return out.getvalue()


def test_a_job_resumed_from_a_checkpoint_ends_on_the_uninterrupted_jobs_model_bit_for_bit(tmp_path):
    """Adam's moments, DiLoCo's outer momentum and round base (all on the workers), the step counts and the data
    order carry over: new processes resumed from the step-3 checkpoint (mid-round for DiLoCo, k1=2) and trained
    to step 6 give the very model that the job that went on from step 3 gave. (The resumed processes share
    nothing with the first run but its checkpoint files, so whether that run stopped at step 3 or went on makes
    no difference.) The first run writes them where --checkpoint-dir says, outside its run directory, and
    --resume finds them there through its manifest. The global server's checkpoints (--update-on server) are
    resumed by --restart-failed below."""
    straight_out = _train(tmp_path / "straight", 6, "worker", checkpoint_dir=tmp_path / "shared")
    assert not (tmp_path / "straight" / "checkpoints").exists()
    resumed_out = _train(tmp_path / "resumed", 6, "worker", resume=tmp_path / "straight", resume_step=3)
    assert "resumed at step 3" in resumed_out
    checkpoints = {"straight": tmp_path / "shared", "resumed": tmp_path / "resumed" / "checkpoints"}
    assert sorted(steps_saved(checkpoints["resumed"])[0]) == [6]               # it trained steps 4-6 only
    _same_final_models(checkpoints, 6, 2)
    for worker in range(2):
        straight, resumed = (torch.load(checkpoints[run] / f"worker-{worker}-step-6.pt", weights_only=True)
                             for run in ("straight", "resumed"))
        adam = [s["exp_avg"] for s in straight["parts"]["optimizer"]["state"].values()]
        assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(
            adam, resumed["parts"]["optimizer"]["state"].values(), strict=True))
        assert resumed["local_steps"] == 6
    at_3 = torch.load(checkpoints["straight"] / "worker-0-step-3.pt", weights_only=True)["parts"]["model"]
    final = torch.load(checkpoints["straight"] / "worker-0-step-6.pt", weights_only=True)["parts"]["model"]
    assert not all(torch.equal(t, final[n]) for n, t in at_3.items())        # the control: steps 4-6 changed it

    # resumed at its last step (as --restart-failed does after a failure past the last checkpoint): nothing to
    # train, the job ends and reports the saved model (before, every worker exited 1 and the job failed)
    done_out = _train(tmp_path / "done", 6, "worker", resume=tmp_path / "straight", resume_step=6)
    assert done_out.count("the job trained its 6 steps already") == 2

    def accuracies(out: str) -> list[str]:
        return sorted(line.split("final test accuracy ")[1].split()[0] for line in out.splitlines()
                      if "final test accuracy" in line)
    assert len(accuracies(done_out)) == 2 and accuracies(done_out) == accuracies(straight_out)

    # a directory holds one run's checkpoints: another run writing there deleted them (each worker keeps the two
    # highest steps it finds) and a resume of either then read the other's model; nor may a second launch of
    # the same run directory write over its own earlier checkpoints. Both are refused before anything starts
    for again, named in ((tmp_path / "other", str(tmp_path / "straight")), (tmp_path / "straight", "--resume")):
        with pytest.raises(ConfigError, match="already holds checkpoints|holds the checkpoints") as refused:
            _train(again, 6, "worker", checkpoint_dir=tmp_path / "shared")
        assert named in str(refused.value)
    assert {w: sorted(s) for w, s in steps_saved(tmp_path / "shared").items()} == {0: [3, 6], 1: [3, 6]}


def test_time_based_checkpoints_name_the_same_steps_on_every_role_and_a_job_resumed_from_one_ends_bit_for_bit(
        tmp_path):
    """--checkpoint-seconds under geomx launch, with two global servers running the optimizer (Adam) and the
    worker's script on geomx.torch.loop: an interval so small that global server 0 declares a round whenever its
    keys completed the last one (rounds 3 and 5, then 7, which --checkpoint-every 7 asks for too), and the worker
    and both global servers keep the same two. Resumed at step 5 (--resume, --resume-step 5) in new processes,
    the job ends on the very model and optimizer state of the job that went on. (Two workers of two DCs, through
    their local servers: tests/test_checkpoint_seconds.py, in one process.)"""
    from geomx import statefile
    from geomx.cluster.server_checkpoint import rounds_saved

    deployment = dict(dcs=1, workers_per_dc=1, global_servers=2, topology="flat")
    env = {"GEOMX_CHECKPOINT_SECONDS": "1e-06", "GEOMX_CHECKPOINT_EVERY": "7"}
    _train(tmp_path / "straight", 7, "server", deployment=deployment, env=env)
    checkpoints = {run: tmp_path / run / "checkpoints" for run in ("straight", "resumed")}
    saved = {**{f"worker-{w}": sorted(s) for w, s in steps_saved(checkpoints["straight"]).items()},
             **{f"server-{r}": sorted(s) for r, s in rounds_saved(checkpoints["straight"]).items()}}
    assert saved == {name: [5, 7] for name in ("worker-0", "server-0", "server-1")}, saved

    out = _train(tmp_path / "resumed", 7, "server", deployment=deployment, env=env, resume=tmp_path / "straight",
                 resume_step=5)
    assert "resumed at step 5" in out
    _same_final_models(checkpoints, 7, 1)
    for rank in (0, 1):
        straight, resumed = (statefile.load(checkpoints[run] / f"global-server-{rank}-round-7.state")["keys"]
                             for run in checkpoints)
        for a, b in zip(straight, resumed, strict=True):
            assert a["key"] == b["key"] and (a["value"] == b["value"]).all()
            assert (a["update"]["optimizer"]["state"][0]["exp_avg_sq"]
                    == b["update"]["optimizer"]["state"][0]["exp_avg_sq"]).all()


def test_a_job_resumed_with_another_part_size_recuts_the_servers_state_and_ends_bit_for_bit(tmp_path):
    """The part size follows the WAN (the launcher sizes it by the slowest link) and the codec, so a job may be
    resumed with another one: saved with parts of 16 KiB (the example's two 128 KB tensors in 8 parts each, its
    51 KB one in 4) on two global servers, resumed at step 3 with parts of 64 KiB (2 parts each, and whole) on
    three, which place the new parts otherwise (the third saved nothing). Each new part starts from the saved
    parts' weights and Adam moments re-cut (geomx.part_state), and the job ends on the model of the job that went
    on, bit for bit."""
    from geomx import statefile

    servers = {"straight": 2, "resumed": 3}
    cut = {run: {"GEOMX_CHECKPOINT_EVERY": "3", "GEOMX_PARTITION_BYTES": size}
           for run, size in (("straight", "16384"), ("resumed", "65536"))}
    deployment = {run: dict(dcs=1, workers_per_dc=1, global_servers=servers[run], topology="flat") for run in cut}
    _train(tmp_path / "straight", 6, "server", deployment=deployment["straight"], env=cut["straight"])
    out = _train(tmp_path / "resumed", 6, "server", deployment=deployment["resumed"], env=cut["resumed"],
                 resume=tmp_path / "straight", resume_step=3)
    assert "resumed at step 3" in out
    checkpoints = {run: tmp_path / run / "checkpoints" for run in ("straight", "resumed")}
    keys = {run: {e["key"] for rank in range(servers[run])
                  for e in statefile.load(checkpoints[run] / f"global-server-{rank}-round-6.state")["keys"]}
            for run in checkpoints}
    parts = {run: {k for k in keys[run] if "#" in k} for run in keys}
    assert {k[-2:] for k in parts["straight"]} == {"/8", "/4"} and {k[-2:] for k in parts["resumed"]} == {"/2"}
    assert "conv2.weight" in keys["resumed"] - keys["straight"]
    _same_final_models(checkpoints, 6, 1)


def test_an_hfa_job_with_compressed_global_averages_resumes_its_reply_streams_afresh(tmp_path):
    """Under HFA a global server's round N is no step N (a global average every K2 steps), so its reply residuals
    name no step the workers saved: it writes no checkpoint, and a resumed job's streams start afresh (before,
    the resumed global server refused every key, asking for a checkpoint of round 10 that never existed). The
    workers' checkpoints carry the models and their push streams: the resumed job ends within 1% of the one
    that went on (not bit for bit: the 8-bit levels round at random, from the new streams' seeds)."""
    import json

    from geomx.sync.settings import launch_env

    def train(run: str, **resume) -> str:
        topo = load_topology(wan="lan", dcs=2, workers_per_dc=1, topology="hips")
        topo.env.update({"GEOMX_CHECKPOINT_EVERY": "10",
                         **launch_env({"algorithm": "hfa", "k1": 1, "k2": 5, "overlap": 5, "overlap_keep": 0.5})})
        out = io.StringIO()
        command = [sys.executable, str(EXAMPLE.parent / "train_lm.py"), "--model-size", "tiny", "--steps", "20",
                   "--eval-every", "20", "--batch-size", "2", "--context", "64", "--compression",
                   json.dumps({"wan": {"type": "qsgd", "levels": 127, "bucket_size": 512}})]
        launcher = Launcher(topo, command, run_dir=tmp_path / run, out=out, **resume)
        assert launcher.run(timeout=180) == 0, out.getvalue()[-3000:]
        return out.getvalue()

    straight = train("straight")
    assert not list((tmp_path / "straight" / "checkpoints").glob("global-server-*"))
    resumed = train("resumed", resume=tmp_path / "straight", resume_step=10)
    assert "resumed at step 10" in resumed
    losses = [float(text.split("final validation loss ")[1].split()[0]) for text in (straight, resumed)]
    assert abs(losses[1] - losses[0]) < 0.01 * losses[0], losses
    # resumed at its last step: the average its checkpoint holds in flight (sent at step 20, landing in finish())
    # lands before the evaluation, so both workers report the very loss of the job that saved it
    done = train("done", resume=tmp_path / "straight", resume_step=20)

    def finals(text: str) -> list[str]:
        return sorted(line.split("final validation loss ")[1].split()[0] for line in text.splitlines()
                      if "final validation loss" in line)
    assert "trained its 20 steps already" in done and len(finals(done)) == 2 and finals(done) == finals(straight)


def _same_final_models(checkpoints: dict, step: int, workers: int) -> None:
    for worker in range(workers):
        a, b = (torch.load(checkpoints[run] / f"worker-{worker}-step-{step}.pt", weights_only=True)["parts"]["model"]
                for run in checkpoints)
        for name, tensor in a.items():
            assert torch.equal(tensor, b[name]), (worker, name)


def test_a_job_whose_global_server_dies_restarts_from_its_last_checkpoint_and_ends_on_the_unfailed_jobs_model(
        tmp_path):
    """--restart-failed 1 with --update-on server: the model and Adam's state live on the global server, which
    checkpoints them every 3 rounds with the worker. The global server is killed (SIGKILL) once both wrote step
    3: the launcher names it, moves the failed attempt's logs into attempt-1/, starts every role again from the
    latest step both saved, and the job ends on the model of the job that never failed, bit for bit: the steps
    after the checkpoint are trained again, on the same batches (no acknowledged update lost). Slowed 30x (a
    sleep: no number changes) so that the kill lands while it trains."""
    import os
    import signal
    import threading
    import time

    _train(tmp_path / "straight", 9, "server")
    run_dir = tmp_path / "restarted"
    topo = load_topology(wan="lan", **DEPLOYMENTS["server"])
    topo.env.update({"GEOMX_CHECKPOINT_EVERY": "3", "GEOMX_SLOWDOWN": "30"})
    out = io.StringIO()
    launcher = Launcher(topo, [sys.executable, str(EXAMPLE), "--steps", "9", "--update-on", "server"],
                        run_dir=run_dir, out=out, restart_failed=1)
    killed: list[int] = []

    def kill_the_global_server_after_the_first_checkpoint() -> None:
        saved = run_dir / "checkpoints"
        deadline = time.monotonic() + 100
        while not killed and time.monotonic() < deadline:
            if (saved / "worker-0-step-3.pt").exists() and (saved / "global-server-0-round-3.state").exists():
                server = next(r for r in launcher.running if r.spec.name == "global-server-0")
                os.kill(server.proc.pid, signal.SIGKILL)
                killed.append(server.proc.pid)
            time.sleep(0.01)

    watcher = threading.Thread(target=kill_the_global_server_after_the_first_checkpoint, daemon=True)
    watcher.start()
    assert launcher.run(timeout=150) == 0, out.getvalue()[-3000:]
    watcher.join(5)
    text = out.getvalue()
    assert killed and "role global-server-0 was killed by signal 9" in text, text[-3000:]
    restarted_at = int(text.split("restarting the job from step ")[1].split()[0])
    assert restarted_at in (3, 6) and f"resumed at step {restarted_at}" in text
    assert (run_dir / "attempt-1" / "global-server-0.log").exists()
    assert (run_dir / "global-server-0.log").exists() and (run_dir / "launch.json").exists()   # the last attempt
    checkpoints = {run: tmp_path / run / "checkpoints" for run in ("straight", "restarted")}
    _same_final_models(checkpoints, 9, 1)
    from geomx import statefile

    server = {run: statefile.load(checkpoints[run] / "global-server-0-round-9.state") for run in checkpoints}
    for a, b in zip(server["straight"]["keys"], server["restarted"]["keys"], strict=True):
        assert a["key"] == b["key"] and (a["value"] == b["value"]).all()
        assert (a["update"]["optimizer"]["state"][0]["exp_avg_sq"]
                == b["update"]["optimizer"]["state"][0]["exp_avg_sq"]).all()


def test_restart_step_is_the_latest_every_worker_and_every_checkpointing_global_server_saved(tmp_path):
    from geomx.cli.restarts import restart_step

    model, opt, _ = _training_state(0)
    assert restart_step(tmp_path, 2, 1) is None                           # nothing saved: start afresh
    for worker, steps in ((0, [3, 6]), (1, [3, 6])):
        saver = Checkpointer(tmp_path, worker=worker, workers=2, every=3, model=model, optimizer=opt)
        for step in steps:
            saver.save(step, local_steps=step)
    assert restart_step(tmp_path, 2, 1) == 6                              # worker-side optimizer: workers decide
    (tmp_path / "global-server-0-round-3.state").write_bytes(b"")       # a server optimizer that saved round 3
    assert restart_step(tmp_path, 2, 1) == 3
    assert restart_step(tmp_path, 2, 2) is None                           # global server 1 saved nothing
    assert restart_step(tmp_path, 3, 1) is None                           # worker 2 saved nothing


class _OptimizerState:
    """A key's server optimizer state, as ServerCheckpoints keeps it."""

    def state_dict(self) -> dict:
        return {"momentum": np.zeros(2, np.float32)}


def _server_keys() -> list:
    """Two keys of a global server that runs the optimizer."""
    from geomx.cluster.kvserver import KeyState

    return [KeyState(k, (2,), np.dtype(np.float32), value=np.full(2, float(i), np.float32), update=_OptimizerState())
            for i, k in enumerate(("w", 7))]


def test_a_global_server_resumes_from_the_checkpoints_of_that_round_and_names_what_is_missing(tmp_path):
    """Workers' checkpoints alone cannot resume a job whose model lives on the global server; a checkpoint is
    written once every key reached the round, and only the last two are kept. A key is looked up in every
    global server's file of the round (a server that saved none finds its keys in the others')."""

    from geomx.cluster.server_checkpoint import ServerCheckpoints

    keys = _server_keys()
    writer = ServerCheckpoints(rank=0, every=2, directory=tmp_path)
    for round_ in range(1, 7):      # in step: a worker pushes round m + 1 only with every reply of round m
        writer.round_done(keys[0], keys=2)
        assert (tmp_path / f"global-server-0-round-{round_}.state").exists() is False   # key 7 is not there yet
        writer.round_done(keys[1], keys=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global-server-0-round-4.state",
                                                          "global-server-0-round-6.state"]
    # listed in key order, not in the order the keys finished the round: equal states write equal files
    from geomx import statefile
    assert [e["key"] for e in statefile.load(tmp_path / "global-server-0-round-6.state")["keys"]] == ["w", 7]
    flipped = tmp_path / "flipped"
    other_order = ServerCheckpoints(rank=0, every=2, directory=flipped)
    for st in reversed(keys):
        for _ in range(2):
            other_order.round_done(st, keys=2)
    assert [e["key"] for e in statefile.load(flipped / "global-server-0-round-2.state")["keys"]] == ["w", 7]
    reader = ServerCheckpoints(rank=0, every=2, directory=None, resume_from=tmp_path, resume_round=4)
    assert reader.resumed_state(7, (2,))["value"].tolist() == [1.0, 1.0] and reader.rounds[7] == 4
    with pytest.raises(ConfigError, match="key 'b' is not in the global servers' checkpoint of round 4"):
        reader.resumed_state("b", (2,))
    other = ServerCheckpoints(rank=1, every=2, directory=None, resume_from=tmp_path, resume_round=4)
    assert other.resumed_state("w", (2,))["value"].tolist() == [0.0, 0.0]      # in global server 0's file
    with pytest.raises(ConfigError, match="global-server-1-round-5.state does not exist"):
        ServerCheckpoints(rank=1, every=2, directory=None, resume_from=tmp_path,
                          resume_round=5).resumed_state("w", (2,))
    # without a server optimizer a checkpoint holds only reply residuals: none saved, the streams start afresh
    residuals_only = ServerCheckpoints(rank=1, every=2, directory=None, resume_from=tmp_path, resume_round=5,
                                       holds_model=False)
    assert residuals_only.resumed_state("w", (2,)) is None and residuals_only.rounds["w"] == 5


def test_a_server_that_hears_of_a_checkpoint_round_after_completing_it_skips_it_and_writes_the_next(
        tmp_path, caplog):
    """--checkpoint-seconds: global server 0 declares round 3 (geomx.cluster.checkpoint_clock), but this server
    has completed round 3 of key "w" already, whose state then is gone: it writes no partial checkpoint, says so,
    and the next declared round is written whole."""
    import logging

    from geomx.cluster.server_checkpoint import ServerCheckpoints, rounds_saved

    keys = _server_keys()
    server = ServerCheckpoints(rank=1, every=0, directory=tmp_path)
    for st, rounds in zip(keys, (3, 2), strict=True):
        for _ in range(rounds):
            server.round_done(st, keys=2)
    with caplog.at_level(logging.WARNING, logger="geomx.server_checkpoint"):
        assert not server.declare(3)
    assert "checkpoint of round 3 skipped" in caplog.text
    assert server.declare(5) and server.latest_declared == 5
    for st in keys:
        while server.rounds[st.key] < 6:
            server.round_done(st, keys=2)
    assert rounds_saved(tmp_path) == {1: [5]}


def test_keys_that_are_only_read_do_not_hold_back_a_servers_checkpoints_or_its_declarations(tmp_path):
    """Under tensor fusion (FSA with the workers' optimizer, the examples' default) the workers push buckets,
    and the parameters' own keys are only read. A global server that waited for every key it owns to take a
    round wrote no checkpoint, and its timekeeper never declared one: --checkpoint-seconds saved nothing and
    said nothing. Keys that take rounds are known once one of them completed round 2 (FSA's step() waits for
    every reply of a round before the next). With a server optimizer nothing is fused: every key counts."""
    from geomx.cluster.checkpoint_clock import CheckpointClock
    from geomx.cluster.server_checkpoint import ServerCheckpoints, rounds_saved

    now = [0.0]
    clock = CheckpointClock(1.0, now=lambda: now[0])
    buckets = _server_keys()                     # the two keys the workers push; a third, read only, is owned too
    server = ServerCheckpoints(rank=0, every=2, directory=tmp_path, clock=clock, holds_model=False)
    declared = []
    for step in range(1, 7):
        now[0] = float(step)
        for st in buckets:
            round_ = server.round_done(st, keys=3)
            if round_ is not None:
                declared.append(round_)
    assert declared == [4, 6, 8], declared      # due from round 2 on: the most rounds + 2, each once the last landed
    assert sorted(rounds_saved(tmp_path)[0]) == [4, 6], rounds_saved(tmp_path)    # 2, 4, 6 written, 2 kept
    # resumed at round 6: every key counts on from 6, the one only read too; it still holds nothing back
    resumed = ServerCheckpoints(rank=0, every=2, directory=tmp_path / "resumed", resume_from=tmp_path, resume_round=6,
                                clock=CheckpointClock(1.0, now=lambda: now[0]), holds_model=False)
    assert resumed.resumed_state("w", (2,))["value"].tolist() == [0.0, 0.0]
    assert resumed.resumed_state(7, (2,)) is not None
    assert resumed.resumed_state("read-only", (2,)) is None     # it took no rounds: nothing saved, nothing missing
    declared.clear()
    for step in range(7, 11):
        now[0] = float(step)
        for st in buckets:
            declared += [r for r in [resumed.round_done(st, keys=3)] if r is not None]
    assert declared == [10, 12], declared
    assert sorted(rounds_saved(tmp_path / "resumed")[0]) == [8, 10]


def test_a_server_optimizer_job_asks_for_the_interval_on_every_role_not_only_the_script():
    """With --update-on server the global servers checkpoint the model: an interval only the script knows would
    leave them without one, and the job could not be resumed. Refused at start, with the fix."""
    import argparse
    from types import SimpleNamespace

    from geomx.torch import loop

    kv = SimpleNamespace(cfg=SimpleNamespace(checkpoint_every=0, resume_from=None, resume_step=None, run_dir=None))
    args = argparse.Namespace(checkpoint_every=3, checkpoint_seconds=0.0, update_on="server", data_slice_idx=None)
    with pytest.raises(ConfigError, match="geomx launch --checkpoint-every 3"):
        loop.checkpointer(args, kv, None, None)


def test_a_fresh_run_finding_its_workers_checkpoints_of_an_earlier_run_is_refused(tmp_path):
    """--checkpoint-every given to the script (not to geomx launch) left the launcher claiming nothing: a second
    launch into the same run directory deleted its own new checkpoints as older than the first run's, and a
    --resume loaded the first run's model (found by a review). The worker refuses such a directory; a resume
    (GEOMX_RESUME_FROM) or a restarted worker rejoining its job still uses it."""
    import argparse
    from types import SimpleNamespace

    from geomx.torch import loop

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "worker-1-step-20.pt").write_bytes(b"")
    cfg = SimpleNamespace(checkpoint_every=0, checkpoint_seconds=0.0, resume_from=None, resume_step=None,
                          run_dir=str(tmp_path), checkpoint_dir=None)
    args = argparse.Namespace(checkpoint_every=5, checkpoint_seconds=0.0, update_on="worker", data_slice_idx=1)
    kv = SimpleNamespace(cfg=cfg, num_all_workers=2, joined_at=0, checkpoint_declared=None)
    model = torch.nn.Linear(1, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"already holds worker 1's checkpoints of an earlier run \(steps \[20\]\)"):
        loop.checkpointer(args, kv, sgd, model)
    assert loop.checkpointer(argparse.Namespace(**{**vars(args), "data_slice_idx": 0}), kv, sgd,
                             model) is not None        # worker 0 has none there
    kv.joined_at = 7        # restarted into its running job: its earlier checkpoints are its own
    assert loop.checkpointer(args, kv, sgd, model) is not None


def test_a_resume_past_the_jobs_own_steps_is_refused_as_another_jobs_checkpoints():
    """A checkpoint of step 20 resumed into a job of 10 steps had been taken for a job that trained its steps
    already, and the other job's model was reported as this one's (found by a review)."""
    from types import SimpleNamespace

    from geomx.torch import loop

    def run(total):
        opt = SimpleNamespace(kv=SimpleNamespace(joined_at=0), progress=20, steps_taken=20,
                              record_resumed=lambda step: None, finish=lambda: None)
        checkpoint = SimpleNamespace(restore=lambda: 20, resume_from="/runs/first/checkpoints")
        return loop.run_steps(opt, iter([(0, False, None)] * 30), total_steps=total, eval_every=0,
                              evaluate=lambda: {"acc": 1.0}, describe=str, checkpoint=checkpoint)

    with pytest.raises(ConfigError, match=r"resumed at step 20 from /runs/first/checkpoints, but this job trains "
                                          r"10 steps: those checkpoints are another job's"):
        run(10)
    assert run(20)[0] == 20         # its own last step: nothing left to train, its model evaluated


class _Residuals:
    """A part whose state holds numpy arrays, as a worker's compression streams do."""

    def __init__(self, arrays: dict) -> None:
        self.arrays = arrays

    def state_dict(self) -> dict:
        return {"push": [["w", [3], "<f4", {"residuals": [self.arrays["r"]], "indices": self.arrays["i"]}]]}

    def load_state_dict(self, state: dict) -> None:
        (_, _, _, saved), = state["push"]
        self.arrays = {"r": saved["residuals"][0], "i": saved["indices"]}


def test_numpy_arrays_in_a_checkpoint_come_back_as_arrays_of_their_dtype_under_weights_only_loading(tmp_path):
    saved = _Residuals({"r": np.array([0.25, -1.5, 3.0], np.float32), "i": np.array([2, 0], np.int64)})
    Checkpointer(tmp_path, worker=0, workers=1, every=1, wire=saved).save(1, local_steps=1)
    loaded = _Residuals({})
    loader = Checkpointer(tmp_path / "new", worker=0, workers=1, every=1, resume_from=tmp_path, wire=loaded)
    assert loader.restore() == 1
    for name, array in saved.arrays.items():
        assert isinstance(loaded.arrays[name], np.ndarray) and loaded.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded.arrays[name], array)
