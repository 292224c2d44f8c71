"""The step loop of a training script on geomx (examples/train_cnn.py, examples/train_lm.py share it).

    kv = start(args)                                   # threads, seed, kvstore, --compression
    opt = DistributedOptimizer(inner, model, kvstore=kv, update_on_server=args.update_on == "server")
    step, history = run_steps(opt, batches, total_steps=..., eval_every=..., evaluate=..., describe=...)
    write_result(kv, opt, step, history, final_test_acc=...)
    leave(kv)                                          # close the kvstore; exit without a slow shutdown

What it does for every script, so every ``--sync`` algorithm, codec, ``--update-on server`` and ``--mode
dist_async`` work the same way in all of them: the run's length is :attr:`DistributedOptimizer.progress` (an
ESync worker's extra local steps inside a round do not count), the last step lands what the algorithm still
has on the way (``opt.finish()``) before the final evaluation, and every step goes to
:func:`geomx.metrics.log` (with the evaluation's figures and the seconds it took, which reports leave out).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

import geomx.kvstore
from geomx import metrics
from geomx.config import checkpoint_directory, env_checkpoint_seconds
from geomx.errors import ConfigError
from geomx.sync.settings import SERVER_OPTIMIZER_ALGORITHMS, settings_from_env
from geomx.torch.checkpoint import Checkpointer

# one batch: (epoch, last batch of its epoch?, a callable computing the batch's loss)
Batch = tuple[int, bool, Callable[[], torch.Tensor]]


def parse_compression(text: str):
    """``fp16`` or a JSON object such as ``{"type": "bsc", "threshold": 0.01}``, checked here: an unknown codec or
    parameter is one line at parsing, not a traceback from every worker once the deployment runs."""
    from geomx.compression import parse_policy

    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--compression is not valid JSON: {exc}") from None
    else:
        spec = text
    try:
        parse_policy(spec)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"--compression {text}: {exc}") from None
    return spec


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"--checkpoint-seconds takes a number of seconds > 0 (0: never), not {text!r}")
    return seconds


def count(minimum: int):
    """An argparse type: a whole number >= ``minimum`` (a step count, a batch size), refused by argparse naming
    the flag otherwise (a negative --steps had trained one step and exited 0)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def positive(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _default_update_on(env) -> str:
    """"server" where the algorithm the launcher set lands the servers' weights (p3), which runs no other way."""
    try:
        algorithm = settings_from_env(env).algorithm
    except ConfigError:
        return "worker"     # a malformed setting is named where the kvstore and the optimizer read it
    return "server" if algorithm in SERVER_OPTIMIZER_ALGORITHMS else "worker"


def add_arguments(p: argparse.ArgumentParser, *, steps: int, steps_help: str,
                  eval_default: str = "every epoch") -> None:
    """The flags every geomx training script takes (the benchmarks set --steps, --eval-every and --seed).
    ``eval_default``: what --eval-every 0 means in this script."""
    p.add_argument("--steps", type=count(0), default=steps, help=steps_help)
    p.add_argument("--eval-every", type=count(0), default=0, help=f"evaluate every N steps (0: {eval_default})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--update-on", choices=["worker", "server"], default=_default_update_on(os.environ),
                   help="where the optimizer runs: on every worker, or on the global servers (default: server "
                        "where the deployment's algorithm needs it, p3 (geomx launch --p3); else worker)")
    p.add_argument("--data-slice-idx", type=int, default=None,
                   help="this worker's slice (default: GEOMX_WORKER_INDEX set by geomx launch)")
    p.add_argument("--checkpoint-every", type=count(0), default=int(os.environ.get("GEOMX_CHECKPOINT_EVERY") or 0),
                   help="every N steps each worker saves its model and optimizer to <run dir>/checkpoints "
                        "(default GEOMX_CHECKPOINT_EVERY, else 0: never); geomx launch --resume RUN_DIR resumes")
    p.add_argument("--checkpoint-seconds", type=_seconds, default=env_checkpoint_seconds(os.environ),
                   help="also save about every S seconds, at the steps the global servers declare (default "
                        "GEOMX_CHECKPOINT_SECONDS, else 0: never; set by geomx launch --checkpoint-seconds)")
    p.add_argument("--device", default="cpu",
                   help="where the worker computes: cpu (default), cuda, cuda:N, or auto (a GPU where torch sees one, "
                        "worker i on GPU i mod their number, else cpu)")
    p.add_argument("--compression", default=None, type=parse_compression,
                   help='gradient compression: a codec name (fp16) or a JSON dict, e.g. \'{"type": "bsc", '
                        '"threshold": 0.01}\' (docs/compression.md)')


def start(args: argparse.Namespace):
    """One thread per worker (2 cores are shared by a whole deployment), the seed, the kvstore with the
    deployment's gradient compression."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    kv = geomx.kvstore.create()
    if args.compression is not None:
        kv.set_gradient_compression(args.compression)
    return kv


def device(args: argparse.Namespace, kv) -> torch.device:
    """Where this process computes (``--device``). The master worker only initializes the model: the CPU. A GPU
    asked for that torch cannot see is an error naming the flag; geomx moves values between the device and the
    CPU where they cross the network (geomx.kvstore)."""
    if kv.is_master_worker:
        return torch.device("cpu")
    text = str(getattr(args, "device", "cpu") or "cpu").strip()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "auto":
        return torch.device(f"cuda:{worker_index(args) % gpus}") if gpus else torch.device("cpu")
    try:
        chosen = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {text!r} is not a device: use cpu, cuda, cuda:N or auto") from None
    if chosen.type == "cuda" and (chosen.index or 0) >= gpus:
        raise ConfigError(f"--device {text}: torch sees {gpus} GPU(s) here (torch.cuda.device_count()); use "
                          f"--device cpu or auto")
    if chosen.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {text}: geomx's examples run on cpu or cuda")
    return chosen


def worker_index(args: argparse.Namespace, workers: int | None = None) -> int:
    """This worker's index among all training workers: --data-slice-idx, else what geomx launch set
    (``GEOMX_WORKER_INDEX``, which a hand-started worker sets itself). With ``workers`` (how many train), an
    index outside 0..workers-1 is refused: its data slice would be empty, and the worker would spin on it."""
    given = "--data-slice-idx" if args.data_slice_idx is not None else "GEOMX_WORKER_INDEX"
    raw = args.data_slice_idx if args.data_slice_idx is not None else os.environ.get("GEOMX_WORKER_INDEX") or 0
    try:
        index = int(raw)
    except ValueError:
        raise ConfigError(f"{given}={raw!r} is not a worker index") from None
    if workers is not None and not 0 <= index < workers:
        raise ConfigError(f"{given}={index} is not a worker index of this job: its {workers} training workers are "
                          f"0 to {workers - 1} (each worker of each DC its own)")
    return index


def _refuse_earlier_checkpoints(directory: Path, worker: int) -> None:
    """A fresh run (not resumed, not rejoined) finds none of its own worker index's checkpoints there: those
    are an earlier run's (a --checkpoint-every the launcher did not see, so it claimed nothing), which this run
    would delete as older and a --resume would then load (geomx.cli.checkpoint_owner)."""
    from geomx.torch.checkpoint import steps_saved

    earlier = sorted(steps_saved(directory).get(worker, [])) if directory.is_dir() else []
    if earlier:
        raise ConfigError(f"checkpoint directory {directory} already holds worker {worker}'s checkpoints of an "
                          f"earlier run (steps {earlier}): resume them with geomx launch --resume, or give this run "
                          f"another directory (--run-dir, --checkpoint-dir), or remove them to start over")


def checkpointer(args: argparse.Namespace, kv, opt, model: torch.nn.Module, **stateful) -> Checkpointer | None:
    """The worker's :class:`Checkpointer` when ``--checkpoint-every`` or ``--checkpoint-seconds`` is set or the run
    resumes (``GEOMX_RESUME_FROM``, set by ``geomx launch --resume``): the model, ``opt`` and ``stateful`` (a
    schedule).
    With ``--update-on server`` the global servers checkpoint and resume the weights and the optimizer
    (geomx.cluster.server_checkpoint); the worker's file keeps its step and data position. Where checkpoints go
    and what to resume are the deployment's configuration (``kv.cfg``, read from the environment once:
    geomx.config.checkpoint_directory)."""
    cfg = kv.cfg
    if not args.checkpoint_every and not args.checkpoint_seconds and not cfg.resume_from:
        return None
    if args.update_on == "server" and args.checkpoint_every != cfg.checkpoint_every:
        raise ConfigError(f"--checkpoint-every {args.checkpoint_every} with --update-on server: the model lives on the "
                          f"global servers, which checkpoint it too; give the interval to every role with geomx "
                          f"launch --checkpoint-every {args.checkpoint_every} (GEOMX_CHECKPOINT_EVERY)")
    if args.checkpoint_seconds != cfg.checkpoint_seconds:
        raise ConfigError(f"--checkpoint-seconds {args.checkpoint_seconds:g}: the global servers decide at which steps "
                          f"every role saves, so they need the interval too; give it to every role with geomx launch "
                          f"--checkpoint-seconds {args.checkpoint_seconds:g} (GEOMX_CHECKPOINT_SECONDS)")
    directory = checkpoint_directory(cfg) or Path("checkpoints")
    index = worker_index(args)
    if not cfg.resume_from and not getattr(kv, "joined_at", 0):
        _refuse_earlier_checkpoints(directory, index)
    return Checkpointer(directory, worker=index,
                        workers=kv.num_all_workers, every=args.checkpoint_every,
                        declared=kv.checkpoint_declared if args.checkpoint_seconds else None,
                        resume_from=cfg.resume_from, resume_step=cfg.resume_step, model=model, optimizer=opt,
                        **stateful)


def run_steps(opt, batches: Iterable[Batch], *, total_steps: int, eval_every: int,
              evaluate: Callable[[], dict[str, float]], describe: Callable[[dict[str, float]], str],
              after_step: Callable[[], None] | None = None,
              checkpoint: Checkpointer | None = None) -> tuple[int, list[dict]]:
    """Train until ``opt.progress`` reaches ``total_steps``; evaluate every ``eval_every`` steps (0: at the end
    of every epoch) and after the last. ``after_step`` runs after every local step (a learning-rate
    schedule). With ``checkpoint``: resume from it first (the batches already consumed are drawn again, not
    computed, so the data order goes on where it stopped), and save at the steps it is due (``Checkpointer.due``).
    A worker resumed or rejoined at or past ``total_steps`` trains nothing: it evaluates the model it has once.
    Returns (steps, evaluation history)."""
    batches = iter(batches)
    joined_at = getattr(opt.kv, "joined_at", 0)
    # a worker restarted into the running job skips the batches of the steps it missed, as a resumed one those
    # its checkpoint took
    skipped = opt.steps_taken if joined_at else checkpoint.restore() if checkpoint is not None else 0
    for _ in range(skipped):
        next(batches)
    step, started, history = opt.progress, time.perf_counter(), []
    source = (f"the running job (restarted; its model arrived in {opt.rejoin_s:.2f} s)" if joined_at else
              checkpoint.resume_from if checkpoint else None)
    if step and source is not None:
        how = "rejoined" if joined_at else "resumed"
        opt.record_resumed(step)
        if step > total_steps and not joined_at:
            raise ConfigError(f"resumed at step {step} from {source}, but this job trains {total_steps} steps: "
                              f"those checkpoints are another job's (resume with the --steps that saved them)")
        if step >= total_steps:
            # a job restarted after its last checkpoint (--restart-failed), or resumed at its last step: nothing
            # is left to train, and the model it has is the one to report
            print(f"{how} at step {step} from {source}: the job trained its {total_steps} steps already; its "
                  f"model is evaluated", flush=True)
            opt.finish()    # the averages its checkpoint holds in flight land, as they did in the job that saved it
            history.append({"step": step, **evaluate(), "wall_s": time.perf_counter() - started})
            return step, history
        print(f"{how} at step {step} from {source}", flush=True)
    for epoch, epoch_end, compute_loss in batches:
        opt.zero_grad()
        loss = compute_loss()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        if opt.progress == step:
            continue        # ESync: a faster worker's extra local step inside a round
        step = opt.progress
        if checkpoint is not None and checkpoint.due(step):
            checkpoint.save(step, local_steps=opt.steps_taken)
        last = step >= total_steps
        if last:
            opt.finish()        # HFA/DiLoCo with overlap: the last global average lands first
        if (eval_every and step % eval_every == 0) or (not eval_every and epoch_end) or last:
            eval_started = time.perf_counter()
            figures = evaluate()
            eval_s = time.perf_counter() - eval_started    # the report can leave the probe's cost out
            history.append({"step": step, "epoch": epoch, "loss": loss.item(), **figures,
                            "wall_s": time.perf_counter() - started})
            metrics.log(step=step, loss=loss.item(), eval_s=eval_s, **figures)
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} {describe(figures)}", flush=True)
        else:
            metrics.log(step=step, loss=loss.item())
        if last:
            break
    return step, history


def write_result(kv, opt, step: int, history: list[dict], **final) -> None:
    """``result-<dc>-<rank>.json`` in the run directory (what tests and recipes read back)."""
    run_dir = os.environ.get("GEOMX_RUN_DIR")
    if run_dir:
        Path(run_dir, metrics.result_name(kv.dc, kv.rank)).write_text(json.dumps(
            {"dc": kv.dc, "rank": kv.rank, **final, "steps": step, "history": history,
             "comm_wait_s": opt.comm_wait_s}))


def leave(kv) -> None:
    """The script's last word: close the kvstore, then freeze the heap. Interpreter shutdown runs full garbage
    collections over every object (torch alone makes ~170,000), about 0.5 s of CPU per process idle and seconds on
    a host running a whole deployment; frozen objects are skipped, and the process exits when its work is done."""
    kv.close()
    gc.freeze()
