"""Evaluation of XC models: precision@k on the held-out set with full (dense) scoring."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def precision_at_k(model: nn.Module, dataset, ks: Sequence[int] = (1, 5), *,
                   limit: int | None = None, batch_size: int = 512) -> tuple[float, ...]:
    """P@k = mean over points of |top-k predictions ∩ true labels| / k (the XC convention),
    scoring every label (the model is put in eval mode: SLIDE layers then score densely
    unless configured for LSH inference)."""
    was_training = model.training
    model.eval()
    hits = np.zeros(len(ks))
    n = 0
    kmax = max(ks)
    with torch.no_grad():
        for x, y in dataset.eval_batches(batch_size, limit):
            top = model(x).topk(kmax, dim=1).indices
            match = (top[:, :, None] == y[:, None, :]).any(2).float()  # [B, kmax]
            for i, k in enumerate(ks):
                hits[i] += float(match[:, :k].sum()) / k
            n += len(y)
    model.train(was_training)
    return tuple(float(h / max(n, 1)) for h in hits)
