"""Issue 13's iid question without a network: does averaging the workers' models lose to FSA per step?

    python tests/scripts/lm_sync_sim.py fsa|hfa|avg-all SEED [K2 [D KEEP]] [--split-by-package] [--dc-late] [--dc-grad]
                                        [--outer=LR,MOMENTUM] [--steps=N]

One process trains examples/train_lm.py's tiny model (context 64, batch 2 per worker, AdamW, its warm-up and
cosine schedule over 400 steps, or ``--steps``) as 4 workers in 2 DCs would, with each worker's data as
`geomx launch` deals it:
``fsa`` steps one model on the mean of the 4 workers' gradients; ``hfa`` steps each worker's own model, averages
each DC's pair every step and all 4 every K2 steps (default 5), each global average landing D steps after
it left (default 0: at once) as avg + KEEP x (the steps taken meanwhile), as ``--hfa-overlap`` and
``--hfa-overlap-keep`` do with K1 = 1 (KEEP ``pull:A``: w = (1 - A) w + A avg instead); ``--dc-late``: each
DC average lands a step after it left, keeping that step, as ``--hfa-dc-overlap 1`` does; ``--dc-grad``: each DC
keeps one model and steps it on its workers' mean gradient, as ``--hfa-dc-sync gradients`` does; ``--outer=LR,M``: a
late global average feeds DiLoCo's outer Nesterov step first; ``avg-all`` averages all 4 every step. Prints the
mean validation loss over the workers at steps 200 and 400, or half-way and at the end of ``--steps``
(docs/benchmarks.md).
"""
from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_lm as lm  # noqa: E402

STEPS, CONTEXT, BATCH, WORKERS, LR = 400, 64, 2, 4, 0.002


def optimizer(model: torch.nn.Module, steps: int):
    opt = lm.adamw(model, lr=LR, weight_decay=0.1)      # the example's optimizer at its default settings
    warmup = steps // 20
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lm.lr_schedule(k, warmup=warmup, total=steps))


def average(models: list[torch.nn.Module], groups: list[list[int]]) -> None:
    with torch.no_grad():
        for group in groups:
            for params in zip(*(models[i].parameters() for i in group), strict=True):
                mean = sum(p.data for p in params) / len(params)
                for p in params:
                    p.data.copy_(mean)


def main() -> int:
    mode, seed = sys.argv[1], int(sys.argv[2])
    numbers = [a for a in sys.argv[3:] if not a.startswith("--")]
    k2 = int(numbers[0]) if numbers else 5
    late, keep = (int(numbers[1]), numbers[2]) if len(numbers) > 2 else (0, "1")
    pull = keep.startswith("pull:")         # "pull:A": w = (1 - A) w + A avg (Overlap Local-SGD's anchor pull)
    share = float(keep.removeprefix("pull:"))
    by_package = "--split-by-package" in sys.argv
    dc_late = "--dc-late" in sys.argv      # each DC average lands a step later, the step taken meanwhile kept
    dc_grad = "--dc-grad" in sys.argv      # one model per DC stepping on its workers' mean gradient
    outer = next((a.removeprefix("--outer=") for a in sys.argv if a.startswith("--outer=")), "")
    outer_lr, outer_momentum = (float(x) for x in outer.split(",")) if outer else (1.0, 0.0)
    steps = int(next((a.removeprefix("--steps=") for a in sys.argv if a.startswith("--steps=")), STEPS))
    torch.set_num_threads(1)
    corpus = lm.load_corpus()
    data = [torch.from_numpy(lm.worker_data(corpus, worker=i, workers=WORKERS, dc=i // 2, dcs=2, rank=i % 2,
                                            dc_workers=2, by_package=by_package, seed=seed)) for i in range(WORKERS)]
    windows = lm.validation_windows(corpus, 64, CONTEXT)
    rngs = [np.random.default_rng(seed + 1000 + i) for i in range(WORKERS)]
    offsets = torch.arange(CONTEXT + 1)

    def batch(i: int) -> torch.Tensor:
        starts = torch.from_numpy(rngs[i].integers(0, len(data[i]) - CONTEXT, BATCH))
        return data[i][starts[:, None] + offsets].long()

    torch.manual_seed(seed)
    start = lm.ByteGPT(replace(lm.SIZES["tiny"], context=CONTEXT))
    replicas = 1 if mode == "fsa" else 2 if dc_grad else WORKERS
    models = [start] if mode == "fsa" else [copy.deepcopy(start) for _ in range(replicas)]
    opts = [optimizer(m, steps) for m in models]
    flights: list[tuple[int, list, list]] = []      # (landing step, each worker's sent model, their mean)
    anchor = [p.detach().clone() for p in start.parameters()]
    dc_flight: list = []            # (each worker's sent model, its DC's mean) of the DC average travelling
    velocity = [torch.zeros_like(p) for p in anchor]
    for step in range(1, steps + 1):
        for opt, _ in opts:
            opt.zero_grad()
        for i in range(WORKERS):
            model = models[i * replicas // WORKERS]
            (lm.next_byte_loss(model, batch(i)) / (WORKERS // replicas)).backward()
        for opt, schedule in opts:
            opt.step()
            schedule.step()
        if mode == "avg-all" or (mode == "hfa" and not late and step % k2 == 0):
            average(models, [list(range(WORKERS))])
        elif mode == "hfa":
            if dc_flight:
                sent_dc, mean_dc = dc_flight.pop()
                with torch.no_grad():
                    for i, m in enumerate(models):
                        for p, w, g in zip(m.parameters(), sent_dc[i], mean_dc[i // 2], strict=True):
                            p.data.add_(g - w)
            if flights and flights[0][0] == step:        # a late global average lands, oldest first
                _, sent, mean = flights.pop(0)
                with torch.no_grad():
                    for m, was in zip(models, sent, strict=True):
                        for p, w, g in zip(m.parameters(), was, mean, strict=True):
                            if pull:
                                p.data.mul_(1 - share).add_(g, alpha=share)
                            else:
                                p.data.sub_(w).mul_(share).add_(g)
            if step % k2 == 0:
                sent = [[p.detach().clone() for p in m.parameters()] for m in models]
                mean = [sum(ps) / replicas for ps in zip(*sent, strict=True)]
                if outer:       # DiLoCo's outer Nesterov step on the round's mean change
                    for a, v, g in zip(anchor, velocity, mean, strict=True):
                        change = a - g
                        v.mul_(outer_momentum).add_(change)
                        a.sub_(change + outer_momentum * v, alpha=outer_lr)
                    mean = [a.clone() for a in anchor]
                flights.append((step + late, sent, mean))
            elif dc_late:
                sent_dc = [[p.detach().clone() for p in m.parameters()] for m in models]
                pairs = [zip(sent_dc[2 * d], sent_dc[2 * d + 1], strict=True) for d in range(2)]
                dc_flight.append((sent_dc, [[(a + b) / 2 for a, b in pair] for pair in pairs]))
            elif not dc_grad:
                average(models, [[0, 1], [2, 3]])
        if step in (steps // 2, steps):
            loss = sum(lm.evaluate(m, windows)["val_loss"] for m in models) / len(models)
            what = f" K2={k2} D={late} keep={keep}" if mode == "hfa" else ""
            print(f"{mode}{what} seed {seed} step {step}: {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
