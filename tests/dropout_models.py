"""Models with dropout, for the per-job random state tests (the zoo has none on purpose)."""

from __future__ import annotations

import math

from torch import nn


def dropout_mlp(*, input_shape, num_classes, vocab_size, width) -> nn.Module:
    """An MLP with dropout after each hidden layer (p=0.5: every step draws masks)."""
    w = width or 32
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), w), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(w, w), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(w, num_classes))


def dropout_cnn(*, input_shape, num_classes, vocab_size, width) -> nn.Module:
    """A small CNN whose dropout acts on the flattened features (the same number of random
    draws whatever memory layout the convolutions use)."""
    c = width or 4
    return nn.Sequential(nn.Conv2d(input_shape[0], c, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(0.5),
                         nn.Linear(4 * c, num_classes))
