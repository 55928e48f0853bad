"""The paper's MNIST network family (Lee et al. 2020, §4.3 and App. E.3): LeNet with 2
convolutions and 2 fully connected layers, ReLU, max-pooling. Importable as a model factory
for the job: ``--model benchmarks.paper.lenet:lenet``.

The paper's widths (32 and 64 filters of 5x5, 1024 hidden units; 3.2M weights in FC-1) are
cut here (``c1``, ``c2``, ``hidden``) so that 300 MC configurations per method finish on a
2-core CPU; the input has 3 channels because the job decodes every image as RGB.
"""
from __future__ import annotations

from torch import nn

__all__ = ["lenet"]


def lenet(num_classes: int = 10, *, c1: int = 8, c2: int = 16, hidden: int = 64, size: int = 28) -> nn.Module:
    """conv(3 -> c1, 5x5, pad 2) - ReLU - maxpool 2 - conv(c1 -> c2, 5x5, pad 2) - ReLU - maxpool 2
    - Linear(c2 (size/4)² -> hidden) - ReLU - Linear(hidden -> num_classes)."""
    s = size // 4
    return nn.Sequential(
        nn.Conv2d(3, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * s * s, hidden), nn.ReLU(), nn.Linear(hidden, int(num_classes)),
    )
