"""The XC network of the paper: sparse input -> 128 hidden (ReLU) -> very wide softmax output,
and its multi-label loss. Dense PyTorch; the slide plugin swaps in its sparse layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


def first_occurrences(y: torch.Tensor) -> torch.Tensor:
    """Boolean mask of ``y`` [B, M] (label ids padded with -1): true where an entry is a
    label not seen earlier in its row. Why: a point's labels are a set, so a label listed
    twice counts once; otherwise the dense loss and SLIDE's two sampled losses (whose
    kernels mark active neurons, so a repeat collapses there) weighed it differently."""
    earlier = torch.ones(y.shape[1], y.shape[1], dtype=torch.bool, device=y.device).tril(-1)
    repeat = ((y[:, :, None] == y[:, None, :]) & earlier).any(2)
    return (y >= 0) & ~repeat


def xc_softmax_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Full softmax with target 1/|y| on each true label (y: [B, M] ids padded with -1, or
    [B] class ids); a point without labels contributes 0, and a label repeated in a row
    counts once (a point's labels are a set, as in SLIDE's sampled losses)."""
    if y.dim() == 1:
        y = y[:, None]
    mask = first_occurrences(y).to(logits.dtype)
    logp = F.log_softmax(logits, dim=1).gather(1, y.clamp(min=0))
    per_sample = -(logp * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return per_sample.mean()


xc_softmax_loss.same_as_loss_against = True  # type: ignore[attr-defined]
"""The loss SLIDE's sampled output computes (``SlideLogits.loss_against``) estimates: the
core's job may take the sampled one for it (``accelopt.job.job.sampled_loss_allowed``)."""


class SparseInput(nn.Module):
    """EmbeddingBag-like first layer on padded sparse input x [B, 2, P] (row 0: feature ids
    as float, -1 = padding; row 1: values): out = bias + sum_p v_p * W[f_p]."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.1)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x[:, 0, :].to(torch.int64)
        vals = x[:, 1, :] * (ids >= 0)
        out = F.embedding_bag(ids.clamp(min=0), self.weight, per_sample_weights=vals, mode="sum")
        return out + self.bias


class XCNet(nn.Module):
    """sparse input -> ``hidden`` ReLU -> ``n_labels`` logits (no softmax: the loss has it)."""

    def __init__(self, n_features: int, n_labels: int, hidden: int = 128) -> None:
        super().__init__()
        self.embed = SparseInput(n_features, hidden)
        self.act = nn.ReLU()
        self.out = nn.Linear(hidden, n_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.embed(x)))


def xc_model(
    *, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None,
    width: int | None = None,
) -> XCNet:
    """Factory for ``model: "accelopt_plugins.slide.xcmodel:xc_model"`` (the core passes the
    dataset's shape; ``vocab_size`` is the number of features of an XC dataset)."""
    if vocab_size is None or len(input_shape) != 2 or input_shape[0] != 2:
        raise ValueError("xc_model needs an XC dataset (padded sparse input [2, P], vocab_size = "
                         "number of features)")
    return XCNet(int(vocab_size), int(num_classes), int(width or 128))
