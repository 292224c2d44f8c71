"""A user's own optimizer class, for the global servers to import when allowed (GEOMX_OPTIMIZER_MODULES)."""
import torch


class HalfStepSGD(torch.optim.Optimizer):
    """Plain SGD that moves half as far: weights -= lr * grad / 2 (easy to tell apart from torch's SGD)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / 2)


class RescaledAscent(torch.optim.Optimizer):
    """MXNet's optimizer ``test`` (mxnet.optimizer.Test, used by its dist_sync_kvstore checks): weights +=
    rescale_grad * grad, so every pushed sum shows in the weights exactly."""

    def __init__(self, params, rescale_grad: float = 1.0) -> None:
        super().__init__(params, {"rescale_grad": rescale_grad})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=group["rescale_grad"])
