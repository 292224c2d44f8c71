"""Optimizers geomx adds to torch.optim (usable on the global servers through ``kv.set_optimizer``), and the
learning-rate schedules the servers run with them (geomx.optim.schedules)."""
from geomx.optim.schedules import StepDecay, WarmupCosine, parse_schedule

__all__ = ["DCASGD", "StepDecay", "WarmupCosine", "parse_schedule"]


def __getattr__(name):
    # DCASGD imports torch: loaded on first use, so that reading a schedule does not
    if name == "DCASGD":
        from geomx.optim.dcasgd import DCASGD

        return DCASGD
    raise AttributeError(f"module 'geomx.optim' has no attribute {name!r}")
