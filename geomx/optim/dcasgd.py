"""DC-ASGD (Zheng et al., ICML 2017): asynchronous SGD with delay compensation, for MixedSync.

In ``dist_async`` a DC's gradient g was computed at the weights w_bak that DC last read, while the server
has moved on to w. DC-ASGD corrects g by a first-order Taylor term, with the Hessian approximated by g*g:

    d   = g + wd * w + lamda * g * g * (w - w_bak)
    buf = momentum * buf + d ; d = buf          (when momentum > 0; MXNet folds lr into buf, the same for a
    w  -= lr * d                                 constant lr)

The paper keeps w_bak **per sender**: the weights that sender read after its previous update. The global
server says whose gradient it applies through :meth:`DCASGD.set_sender` (geomx.cluster.global_update calls
it on every optimizer that has it), so each DC is compensated for its own delay. Without a sender (an
optimizer used on its own) w_bak is the previous weight, as in GeoMX/MXNet's DCASGD (per-key single backup).
"""
from __future__ import annotations

import torch

from geomx.errors import ConfigError


class DCASGD(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.01, *, momentum: float = 0.0, lamda: float = 0.04,
                 weight_decay: float = 0.0) -> None:
        for name, value, low in (("lr", lr, 0.0), ("momentum", momentum, 0.0), ("lamda", lamda, 0.0),
                                 ("weight_decay", weight_decay, 0.0)):
            if not value >= low:
                raise ConfigError(f"DCASGD {name} must be >= {low}, got {value}")
        if momentum >= 1:
            raise ConfigError(f"DCASGD momentum must be < 1, got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, lamda=lamda, weight_decay=weight_decay))
        self._sender: str | None = None

    def set_sender(self, sender: str | None) -> None:
        """The next :meth:`step` applies ``sender``'s gradient (None: unknown, use the previous weight)."""
        self._sender = sender

    def backup(self, p: torch.Tensor, sender: str | None) -> torch.Tensor | None:
        """The weights ``sender`` read after its previous update of ``p`` (for tests and inspection)."""
        return self.state[p].get("backups", {}).get(sender)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sender = self._sender
        for group in self.param_groups:
            lr, momentum, lamda, wd = group["lr"], group["momentum"], group["lamda"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                backups = state.setdefault("backups", {})
                # a sender not seen yet read the weights every DC starts from (the server's initial value)
                w_bak = backups.get(sender) if sender is not None else state.get("previous")
                if w_bak is None:
                    w_bak = state.setdefault("initial", p.detach().clone())
                # torch.optim.SGD's sequence of operations, so that lamda = 0 is SGD bit for bit
                d = g.add(p, alpha=wd) if wd else g.clone()
                if lamda:
                    d.addcmul_(g * g, p - w_bak, value=lamda)
                if momentum:
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d.clone()
                    else:
                        buf.mul_(momentum).add_(d)
                    d = buf
                if sender is None:
                    state["previous"] = p.detach().clone()
                p.add_(d, alpha=-lr)
                if sender is not None:
                    backups[sender] = p.detach().clone()   # what the sender reads back now
        return loss
