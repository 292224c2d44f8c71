"""Train a GPT-style byte-level language model across DCs with geomx, on the Python standard library's source.

    geomx launch -- python examples/train_lm.py --model-size tiny            # 2 DCs x 2 workers
    geomx launch --wan transpacific --sync hfa --hfa-k1 20 --hfa-k2 10 -- python examples/train_lm.py \
        --split-by-package
    geomx launch -- python examples/train_lm.py --data-dir ~/texts --model-size small

The model: a decoder of pre-norm blocks (causal self-attention, GELU MLP), learned positions, the byte
embedding tied to the output layer (vocabulary 256: no tokenizer, nothing to download). Sizes (exact
parameter counts, printed at start): tiny 1,040,768 (width 128, 5 layers, context 128), small 6,449,664
(256, 8, 256), base 25,482,240 (512, 8, 256). AdamW with linear warm-up and cosine decay over ``--steps``, or over
``--schedule-steps N`` (a run that is the first steps of an N-step training).

The corpus exists wherever Python does: every ``.py`` file of the standard library
(``sysconfig.get_paths()["stdlib"]``, sorted, site-packages excluded), or every text file under ``--data-dir``.
A file belongs to the validation set when a stable hash of its relative path says so (5%), so the split is
the same on every machine with the same files. The corpus is read once and cached as bytes (uint8) under
``$GEOMX_CACHE_DIR`` (default ``~/.cache/geomx``); its size and content hash are printed at start, so two
runs can be compared. Training data is split across all workers: iid (16 KiB blocks dealt out in a shuffled
order) by default; ``--split-by-package`` gives each DC whole top-level packages (non-iid), dealt out to its
workers in blocks. Every worker logs the validation loss (nats per byte) and bits per byte on the same fixed
validation windows with ``geomx.metrics.log``.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import os
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import geomx
from geomx.torch import DistributedOptimizer, loop

VOCAB = 256
VALIDATION_PER_MILLE = 50          # 5% of the files
BLOCK = 16 * 1024                  # bytes: the unit in which training data is dealt out to workers
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
CACHE_VERSION = 1


@dataclass(frozen=True)
class Size:
    width: int
    layers: int
    heads: int
    context: int


SIZES = {"tiny": Size(128, 5, 4, 128), "small": Size(256, 8, 4, 256), "base": Size(512, 8, 8, 256)}


# -- the model -------------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ByteGPT(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, size.width)
        self.pos = nn.Parameter(torch.zeros(size.context, size.width))
        self.blocks = nn.ModuleList(Block(size.width, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.apply(_init)
        nn.init.normal_(self.pos, std=0.02)
        for block in self.blocks:          # GPT-2: residual projections scaled by depth
            for layer in (block.proj, block.down):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * size.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()        # tied: the embedding is the output layer


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)


def next_byte_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of predicting every byte of each window from the bytes before it."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1))


# -- the corpus ------------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    tokens: np.ndarray          # uint8: every file's bytes, in sorted path order
    offsets: np.ndarray         # int64, len(names) + 1: file i is tokens[offsets[i]:offsets[i + 1]]
    names: list[str]            # relative paths, sorted
    digest: str                 # sha256 of names and contents
    # validation = the last ``tail`` bytes of the corpus, cut from training (hold_out_tail); 0: the files
    # is_validation picks by path hash
    tail: int = 0

    def is_validation(self) -> np.ndarray:
        if self.tail:
            return np.zeros(len(self.names), dtype=bool)
        return np.array([is_validation(n) for n in self.names], dtype=bool)

    def file_size(self, i: int) -> int:
        """File i's training bytes (the held-out tail cut off)."""
        cut = len(self.tokens) - self.tail
        return max(0, int(min(self.offsets[i + 1], cut) - self.offsets[i]))

    def validation(self) -> np.ndarray:
        if self.tail:
            return self.tokens[len(self.tokens) - self.tail:]
        return self.stream(np.flatnonzero(self.is_validation()))

    def hold_out_tail(self, need: int) -> str:
        """Keep the file split when its validation files hold ``need`` bytes; else validate on the corpus's last
        max(need, 5%) bytes (a single-file --data-dir: input.txt's path hash always picked training). The same on
        every process: it depends on the corpus alone. Says which split it used."""
        held = int(np.diff(self.offsets)[self.is_validation()].sum())     # its size, without joining its files
        if held >= need:
            return f"validation {held:,} bytes: {VALIDATION_PER_MILLE / 10:g}% of the files by path hash"
        tail = max(need, -(-len(self.tokens) * VALIDATION_PER_MILLE // 1000))
        if 2 * tail > len(self.tokens):
            raise SystemExit(f"train_lm: the corpus holds {len(self.tokens):,} bytes, too few to hold out "
                             f"{tail:,} for validation ({need:,} needed) and train on the rest; use a larger "
                             f"--data-dir or fewer --eval-windows")
        self.tail = tail
        return (f"validation {tail:,} bytes: the corpus's last bytes (the files picked by path hash held {held:,}, "
                f"fewer than {need:,})")

    def packages(self) -> list[str]:
        return [package_of(n) for n in self.names]

    def stream(self, files: np.ndarray) -> np.ndarray:
        """The bytes of the files whose indices are given, concatenated in order."""
        if len(files) == 0:
            return np.zeros(0, np.uint8)
        return np.concatenate([self.tokens[self.offsets[i]:self.offsets[i] + self.file_size(i)] for i in files])


def is_validation(relative_path: str) -> bool:
    """A stable hash of the relative path (the same on every machine and Python version) picks 5% of files."""
    h = int.from_bytes(hashlib.sha1(relative_path.encode()).digest()[:4], "big")
    return h % 1000 < VALIDATION_PER_MILLE


def package_of(relative_path: str) -> str:
    """The top-level package (first directory) of a file, or the module itself at the top level."""
    parts = Path(relative_path).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, *, python_only: bool) -> list[tuple[str, Path]]:
    """(relative path, path) of the corpus's files, sorted by relative path; site-packages, caches and hidden
    directories left out."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith(".")]
        for name in files:
            if name.startswith(".") or (python_only and not name.endswith(".py")):
                continue
            path = Path(folder, name)
            found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def load_corpus(data_dir: str | None = None, cache_dir: str | None = None) -> Corpus:
    """The corpus (the standard library's .py files, or ``data_dir``'s text files), from the cache when the
    files' names, sizes and modification times match the cached copy's."""
    root = Path(data_dir).expanduser().resolve() if data_dir else stdlib_root()
    if not root.is_dir():
        raise SystemExit(f"train_lm: --data-dir {root} is not a directory")
    files = list_files(root, python_only=data_dir is None)
    if not files:
        raise SystemExit(f"train_lm: {root} holds no {'.py ' if data_dir is None else ''}files to train on")
    key = hashlib.sha256(f"{CACHE_VERSION}\n{root}".encode())
    for rel, path in files:
        st = path.stat()
        key.update(f"\n{rel}\t{st.st_size}\t{st.st_mtime_ns}".encode())
    cache = Path(cache_dir or os.environ.get("GEOMX_CACHE_DIR") or Path.home() / ".cache" / "geomx")
    cached = cache / f"lm-corpus-{key.hexdigest()[:20]}.npz"
    if cached.exists():
        with np.load(cached) as z:
            return Corpus(z["tokens"], z["offsets"], [str(n) for n in z["names"]], str(z["digest"]))
    corpus = read_corpus(files)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".npz")      # workers start together: write, then rename
    with os.fdopen(fd, "wb") as f:
        np.savez(f, tokens=corpus.tokens, offsets=corpus.offsets, names=np.array(corpus.names),
                 digest=np.array(corpus.digest))
    os.replace(tmp, cached)
    return corpus


def read_corpus(files: list[tuple[str, Path]]) -> Corpus:
    digest = hashlib.sha256()
    chunks, offsets, names = [], [0], []
    for rel, path in files:
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue                  # a binary file (--data-dir): not text
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
        chunks.append(data)
        offsets.append(offsets[-1] + len(data))
        names.append(rel)
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    return Corpus(tokens, np.array(offsets, np.int64), names, digest.hexdigest())


def assign_packages(sizes: dict[str, int], dcs: int) -> dict[str, int]:
    """Whole packages to DCs, largest first to the DC with the fewest bytes so far (ties: lower DC index)."""
    load = [0] * dcs
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        dc = min(range(dcs), key=lambda d: (load[d], d))
        out[name] = dc
        load[dc] += sizes[name]
    return out


def deal_blocks(stream: np.ndarray, share: int, shares: int, seed: int) -> np.ndarray:
    """Share ``share`` of ``shares``: the stream cut into BLOCK-byte blocks in a shuffled order (the same on
    every worker), every ``shares``-th one."""
    n = len(stream) // BLOCK
    order = np.random.default_rng(seed).permutation(n)[share::shares]
    return stream[:n * BLOCK].reshape(n, BLOCK)[np.sort(order)].reshape(-1)


def worker_data(corpus: Corpus, *, worker: int, workers: int, dc: int, dcs: int, rank: int, dc_workers: int,
                by_package: bool, seed: int) -> np.ndarray:
    """This worker's training bytes: iid (a share of all training blocks), or its DC's packages' blocks."""
    train = np.flatnonzero(~corpus.is_validation())
    if not by_package:
        return deal_blocks(corpus.stream(train), worker, workers, seed)
    packages = corpus.packages()
    sizes: dict[str, int] = {}
    for i in train:
        sizes[packages[i]] = sizes.get(packages[i], 0) + corpus.file_size(i)
    owner = assign_packages(sizes, dcs)
    mine = np.array([i for i in train if owner[packages[i]] == dc], np.int64)
    return deal_blocks(corpus.stream(mine), rank, dc_workers, seed)


def validation_windows(corpus: Corpus, count: int, context: int) -> torch.Tensor:
    """``count`` windows of context + 1 bytes, evenly spaced over the validation bytes (the same everywhere)."""
    val = corpus.validation()
    if len(val) < context + 1:
        raise SystemExit(f"train_lm: the validation files hold {len(val)} bytes, fewer than one window of "
                         f"{context + 1}; use a larger --data-dir")
    starts = np.linspace(0, len(val) - context - 1, count).astype(np.int64)
    return torch.from_numpy(np.stack([val[s:s + context + 1] for s in starts]).astype(np.int64))


# -- training --------------------------------------------------------------------------------------------------

def lr_schedule(step: int, *, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``: the schedule
    the global servers run with --update-on server (geomx.WarmupCosine)."""
    return geomx.WarmupCosine(warmup=warmup, total=total, min_ratio=min_ratio).factor(step)


def adamw(model: nn.Module, *, lr: float, weight_decay: float, one_group: bool = False) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms, biases or the positions), fused into one
    kernel where this torch has one for the model's device (on the CPU from torch 2.4): on one core the tiny
    model's step took 4.5 ms in torch's default per-tensor loop and 1.6 ms fused, of about 23 ms in all.
    ``one_group``: decay on every tensor, as the servers' AdamW runs it with --update-on server (they take the
    defaults, one set for all: DistributedOptimizer warns where groups differ)."""
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and n != "pos"]
    rest = [q for n, q in model.named_parameters() if q.dim() < 2 or n == "pos"]
    settings = {"lr": lr, "betas": (0.9, 0.95), "weight_decay": weight_decay}

    def groups() -> list[dict]:     # new dicts each time: a constructor that refuses has already filled them in
        if one_group:
            return [{"params": decay + rest}]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]

    try:
        return torch.optim.AdamW(groups(), fused=True, **settings)
    except RuntimeError:            # no fused kernel for this device in this torch: the per-tensor loop
        return torch.optim.AdamW(groups(), **settings)


def evaluate(model: nn.Module, windows: torch.Tensor, batch: int = 32) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        losses = [next_byte_loss(model, windows[i:i + batch]).item() * len(windows[i:i + batch])
                  for i in range(0, len(windows), batch)]
    model.train()
    val_loss = sum(losses) / len(windows)
    return {"val_loss": val_loss, "val_bpb": val_loss / math.log(2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", choices=list(SIZES), default="tiny")
    p.add_argument("--context", type=int, default=0, help="bytes per training window (default: the size's)")
    p.add_argument("--data-dir", help="train on this directory's text files instead of the standard library")
    loop.add_arguments(p, steps=300, steps_help="training steps (default 300)", eval_default="every steps / 10")
    p.add_argument("--batch-size", type=loop.count(1), default=16, help="windows per step and worker (default 16)")
    p.add_argument("--lr", type=loop.positive, default=0.002, help="peak learning rate of AdamW (default 0.002)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=0, help="warm-up steps (default: schedule steps / 20)")
    p.add_argument("--schedule-steps", type=int, default=0, metavar="N",
                   help="the learning-rate schedule's length (default: --steps): with N > --steps the run is the "
                        "first steps of an N-step training, at the rates that training would use")
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows per evaluation (default 64)")
    p.add_argument("--split-by-package", action="store_true",
                   help="non-iid: each DC trains on whole top-level packages")
    args = p.parse_args(argv)
    size = SIZES[args.model_size]
    context = args.context or size.context
    if not 2 <= context <= size.context:
        raise SystemExit(f"train_lm: --context must be in [2, {size.context}] for --model-size {args.model_size}")
    if args.schedule_steps < 0:
        raise SystemExit(f"train_lm: --schedule-steps must be >= 0 (0: --steps), got {args.schedule_steps}")

    started = time.perf_counter()
    corpus = load_corpus(args.data_dir)
    split = corpus.hold_out_tail(args.eval_windows * (context + 1))      # before set-up: a refusal costs nothing
    kv = loop.start(args)
    device = loop.device(args, kv)
    model = ByteGPT(size).to(device)
    inner = adamw(model, lr=args.lr, weight_decay=args.weight_decay, one_group=args.update_on == "server")
    index = loop.worker_index(args, kv.num_all_workers)
    data = np.zeros(0, np.uint8) if kv.is_master_worker else worker_data(
        corpus, worker=index, workers=kv.num_all_workers, dc=int(os.environ.get("GEOMX_DC_INDEX", 0)),
        dcs=int(os.environ.get("GEOMX_NUM_DCS", 1)), rank=kv.rank, dc_workers=kv.num_workers,
        by_package=args.split_by_package, seed=args.seed)
    horizon = args.schedule_steps or args.steps
    warmup = args.warmup or max(1, horizon // 20)
    # the synchronization algorithm comes from geomx launch --sync (GEOMX_SYNC); HFA weighs models by bytes.
    # With --update-on server the servers' AdamW runs the schedule (a scheduler here would reach nothing)
    on_server = args.update_on == "server"
    opt = DistributedOptimizer(inner, model, kvstore=kv, update_on_server=on_server, num_samples=max(1, len(data)),
                               server_lr_schedule=geomx.WarmupCosine(warmup=warmup, total=horizon, min_ratio=0.1)
                               if on_server else None)
    if kv.is_master_worker:
        print(f"master worker: corpus {len(corpus.tokens):,} bytes in {len(corpus.names)} files, sha256 "
              f"{corpus.digest[:16]}; {split}; initialized {sum(q.numel() for q in model.parameters()):,} parameters "
              f"({args.model_size}); training runs on {kv.num_all_workers} workers", flush=True)
        loop.leave(kv)
        return 0
    if len(data) < context + 1:
        raise SystemExit(f"train_lm: worker {index} got {len(data)} training bytes, fewer than one window; use "
                         f"fewer workers or a larger corpus")
    print(f"worker {index} ({kv.dc}): {len(data):,} training bytes, corpus sha256 {corpus.digest[:16]}, on "
          f"{device}, ready in {time.perf_counter() - started:.1f} s", flush=True)
    windows = validation_windows(corpus, args.eval_windows, context).to(device)
    source = torch.from_numpy(data)
    rng = np.random.default_rng(args.seed + 1000 + index)
    schedule = None if on_server else torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: lr_schedule(s, warmup=warmup, total=horizon))
    offsets = torch.arange(context + 1)

    def batches():
        for _ in itertools.count():
            starts = torch.from_numpy(rng.integers(0, len(data) - context, args.batch_size))
            batch = source[starts[:, None] + offsets].long().to(device)
            yield 0, False, lambda batch=batch: next_byte_loss(model, batch)

    step, history = loop.run_steps(opt, batches(), total_steps=args.steps, eval_every=args.eval_every or
                                   max(1, args.steps // 10), evaluate=lambda: evaluate(model, windows),
                                   describe=lambda f: f"validation loss {f['val_loss']:.4f} "
                                                      f"({f['val_bpb']:.3f} bits per byte)",
                                   after_step=schedule.step if schedule is not None else None,
                                   checkpoint=loop.checkpointer(args, kv, opt, model,
                                                                **({"schedule": schedule} if schedule else {})))
    final = history[-1]
    print(f"final validation loss {final['val_loss']:.4f} ({final['val_bpb']:.3f} bits per byte) after {step} steps "
          f"in {time.perf_counter() - started:.1f} s (communication wait {opt.comm_wait_s:.1f} s)", flush=True)
    loop.write_result(kv, opt, step, history, final_val_loss=final["val_loss"], final_val_bpb=final["val_bpb"])
    loop.leave(kv)
    return 0


if __name__ == "__main__":
    sys.exit(geomx.run_main(main))      # a geomx error is one line, not a traceback
