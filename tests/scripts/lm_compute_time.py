"""Forward and backward time of examples/train_lm.py's model on one device, and the batch that makes a step's
compute about as long as its WAN transfer: where P3 (issue 15, item 3) has something to overlap.

    python tests/scripts/lm_compute_time.py --device cuda --sizes small --batches 16,64,256,512 \
        --workers 4 --pick regional,transatlantic

Prints one line per (size, batch): median forward and backward milliseconds of one process, its peak memory,
and the compute of a step when ``--workers`` processes share the device one after another (their kernels
time-slice, so about workers x one). With ``--pick``, one line per (size, profile):
``pick <size> <profile> <batch>``, the batch whose shared compute is closest to ``--compute-share`` of the
dense model's transfer time up and down that profile's link (2 x model bytes / rate), among those whose memory
fits ``--workers`` times in ``--memory-share`` of the device's. The device scripts read those lines.

Why 0.4 of the transfer: on an H200 (2026-11-27, docs/benchmarks.md "P3 on a GPU") P3 gained most where the
shared compute was 0.3-0.45 of the transfer (1.41x over `regional` at batch 96, 1.26x over `transatlantic` at
512), less at equal times (1.00x, 1.06x): P3 hides the next forward pass behind the round's tail, and once
compute fills the transfer there is no tail left.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_lm import SIZES, VOCAB, ByteGPT, next_byte_loss  # noqa: E402

from geomx.profiles import get_profile  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(model: torch.nn.Module, batch: int, context: int, device: torch.device, *,
              repeats: int) -> tuple[float, float, int]:
    """Median forward and backward seconds of one step of ``batch`` windows, and peak bytes allocated."""
    windows = torch.randint(0, VOCAB, (batch, context + 1), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    forward, backward = [], []
    for i in range(repeats + 2):                    # two untimed warm-ups (kernel selection, allocator)
        model.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        loss = next_byte_loss(model, windows)
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        if i >= 2:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return statistics.median(forward), statistics.median(backward), peak


def pick_batch(shared_s: dict[int, float], fits: dict[int, bool], transfer_s: float) -> int:
    """The batch whose shared compute (seconds a step) is closest to ``transfer_s``, among those that fit in
    memory (the smallest batch if none does)."""
    candidates = [b for b in shared_s if fits[b]] or [min(shared_s)]
    return min(candidates, key=lambda b: abs(shared_s[b] - transfer_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", default="small", help="comma-separated model sizes of examples/train_lm.py")
    p.add_argument("--batches", default="16,64,256", help="comma-separated batch sizes (windows per step)")
    p.add_argument("--workers", type=int, default=4, help="processes sharing the device in the benchmark")
    p.add_argument("--pick", default="", help="comma-separated WAN profiles to pick a batch for")
    p.add_argument("--compute-share", type=float, default=0.4,
                   help="pick the batch whose shared compute is nearest this fraction of the transfer (default 0.4)")
    p.add_argument("--memory-share", type=float, default=0.7,
                   help="fraction of the device's memory the workers may take together (default 0.7)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    total_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    profiles = [get_profile(name) for name in args.pick.split(",") if name]
    for size_name in args.sizes.split(","):
        size = SIZES[size_name]
        model = ByteGPT(size).to(device)
        model_bytes = 4 * sum(q.numel() for q in model.parameters())
        shared, fits = {}, {}
        for batch in (int(b) for b in args.batches.split(",")):
            forward, backward, peak = time_step(model, batch, size.context, device, repeats=args.repeats)
            fits[batch] = not total_memory or args.workers * peak <= args.memory_share * total_memory
            shared[batch] = args.workers * (forward + backward)
            print(f"{size_name} batch {batch}: forward {1e3 * forward:.1f} ms, backward {1e3 * backward:.1f} ms, "
                  f"peak {peak / 2**30:.2f} GiB; {args.workers} workers sharing: {1e3 * shared[batch]:.0f} ms "
                  f"a step{'' if fits[batch] else ' (does not fit)'}", flush=True)
        for profile in profiles:
            transfer = 2 * model_bytes * 8 / min(profile.uplink_bps, profile.downlink_bps)
            batch = pick_batch(shared, fits, args.compute_share * transfer)
            print(f"# {size_name} over {profile.name}: {model_bytes / 1e6:.1f} MB up and down take "
                  f"{1e3 * transfer:.0f} ms", flush=True)
            print(f"pick {size_name} {profile.name} {batch}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
