"""PyTorch integration: wrap any torch.optim optimizer to train across DCs."""
from geomx.torch.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
