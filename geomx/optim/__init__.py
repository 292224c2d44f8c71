"""Optimizers geomx adds to torch.optim (usable on the global servers through ``kv.set_optimizer``)."""
from geomx.optim.dcasgd import DCASGD

__all__ = ["DCASGD"]
