"""Node pruning through a reduction written as global pooling (``h.mean((2, 3))``).

Such a reduction keeps channel c in channel c, as ``AdaptiveAvgPool2d(1)`` does, so the
channels feeding it must be pruned as through a pool: it was refused as "feeds call_method
mean node 'mean', which cannot be sliced". A reduction over the channels, over every
dimension, or over dims computed in the graph stays refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from accelopt_plugins.gpu_kernels.pruning import node_prune, plan_model, prune_channels
from torch import nn

Pool = Callable[[torch.Tensor], torch.Tensor]


class MeanPoolNet(nn.Module):
    """A resnet-like model: conv+BN stem, a residual block, conv+BN, a reduction, a head."""

    def __init__(self, pool: Pool, classes: int = 5) -> None:
        super().__init__()
        self.pool = pool
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.mid = nn.Conv2d(8, 12, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(12)
        self.head = nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = torch.relu(h + self.bn1(self.conv(h)))
        h = torch.relu(self.bn2(self.mid(h)))
        return self.head(self.pool(h))


POOLS: dict[str, Pool] = {
    "mean((2,3))": lambda h: h.mean((2, 3)),
    "torch.mean(dim=(2,3))": lambda h: torch.mean(h, dim=(2, 3)),
    "mean(dim=[-1,-2])": lambda h: h.mean(dim=[-1, -2]),
    "mean(keepdim).flatten(1)": lambda h: h.mean((2, 3), keepdim=True).flatten(1),
    "mean(2).mean(-1)": lambda h: h.mean(2).mean(-1),
    "amax((2,3))": lambda h: h.amax((2, 3)),
    "torch.amin": lambda h: torch.amin(h, (2, 3)),
    "sum(dim=(-2,-1))": lambda h: h.sum(dim=(-2, -1)),
}


def _model(pool: Pool) -> MeanPoolNet:
    torch.manual_seed(0)
    model = MeanPoolNet(pool)
    gen = torch.Generator().manual_seed(5)
    for m in model.modules():  # non-trivial statistics: a wrong slice shows in the output
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=gen) * 2 - 1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model.eval()


def _bn(x: torch.Tensor, bn: nn.BatchNorm2d, k: torch.Tensor) -> torch.Tensor:
    assert bn.running_mean is not None and bn.running_var is not None
    return F.batch_norm(x, bn.running_mean[k], bn.running_var[k], bn.weight[k], bn.bias[k],
                        False, 0.0, bn.eps)


def _dense_without(model: MeanPoolNet, k1: torch.Tensor, k2: torch.Tensor,
                   x: torch.Tensor) -> torch.Tensor:
    """The dense model's function with the channels not in k1 (the residual stream) and k2
    (mid's) removed, from its own weights sliced by hand (not by the pruner)."""
    with torch.no_grad():
        h = torch.relu(_bn(F.conv2d(x, model.stem.weight[k1], padding=1), model.bn, k1))
        c = F.conv2d(h, model.conv.weight[k1][:, k1], padding=1)
        h = torch.relu(h + _bn(c, model.bn1, k1))
        h = torch.relu(_bn(F.conv2d(h, model.mid.weight[k2][:, k1], padding=1), model.bn2, k2))
        return F.linear(model.pool(h), model.head.weight[:, k2], model.head.bias)


@pytest.mark.parametrize("form", sorted(POOLS))
def test_a_reduction_over_the_spatial_dims_is_pruned_through(form: str) -> None:
    model, x = _model(POOLS[form]), torch.randn(2, 3, 8, 8)
    plans = {p.path: p for p in plan_model(model)}
    assert {p: plans[p].refused for p in ("stem", "conv", "mid")} == dict.fromkeys(
        ("stem", "conv", "mid"))
    assert plans["stem"].group == plans["conv"].group  # the residual couples them
    k1, k2 = torch.tensor([0, 2, 3, 6]), torch.tensor([1, 4, 5, 7, 8, 11])
    reference = _dense_without(model, k1, k2, x)
    report = prune_channels(model, {"stem": k1, "mid": k2})
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert model.head.in_features == 6 and model.mid.in_channels == 4
    expected = (3 * 4 * 9 + 2 * 4) + (4 * 4 * 9 + 2 * 4) + (4 * 6 * 9 + 2 * 6) + (6 * 5 + 5)
    assert report.params_after == sum(p.numel() for p in model.parameters()) == expected
    assert report.params_before == (3 * 8 * 9 + 16) + (8 * 8 * 9 + 16) + (8 * 12 * 9 + 24) + 65


def test_node_prune_at_half_prunes_every_conv_of_the_mean_pooled_model() -> None:
    """The finding's run: ``prune_amount=0.5`` refused mid; now only the head is kept."""
    model = _model(POOLS["mean((2,3))"])
    report = node_prune(model, 0.5)
    assert set(report.refused) == {"head"}
    assert report.pruned == {"stem": (8, 4), "conv": (8, 4), "mid": (12, 6)}
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 5)


@pytest.mark.parametrize(("pool", "why"), [
    (lambda h: h.mean(1, keepdim=True).flatten(1).repeat(1, 12), "over its channel dimension"),
    (lambda h: h.mean((-3, -1)).mean(-1, keepdim=True).repeat(1, 12),
     "over its channel dimension"),
    (lambda h: h.mean().expand(h.shape[0], 12), "over every dimension"),
    (lambda h: h.mean((0, 2, 3)).expand(h.shape[0], 12), "batch dimension"),
    (lambda h: h.mean((2, 4)), "that a 4-D tensor does not have"),
])
def test_a_reduction_that_mixes_or_may_mix_channels_is_refused(pool: Pool, why: str) -> None:
    plans = {p.path: p for p in plan_model(MeanPoolNet(pool))}
    assert plans["mid"].refused is not None and why in plans["mid"].refused
    assert plans["stem"].refused is None  # the refusal stays with the reduced channels


class ComputedDims(MeanPoolNet):
    """The reduced dims come from the input's rank, a value of the trace, not a number."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = torch.relu(self.bn2(self.mid(h + self.bn1(self.conv(h)))))
        return self.head(h.mean((x.dim() - 2, x.dim() - 1)))


def test_a_reduction_over_dims_computed_in_the_graph_is_refused() -> None:
    plans = {p.path: p for p in plan_model(ComputedDims(POOLS["mean((2,3))"]))}
    assert plans["mid"].refused is not None
    assert "dims not known when traced" in plans["mid"].refused


class TokenMean(nn.Module):
    """Linear features over tokens, averaged over the token dim: channels are the last dim
    of a tensor whose rank the trace does not know."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.up = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.up(x)).mean(self.dim))


def test_a_token_mean_counted_from_the_end_is_pruned_and_one_from_the_start_refused() -> None:
    torch.manual_seed(0)
    model, x = TokenMean(-2), torch.randn(2, 5, 4)
    keep = torch.tensor([0, 3, 4, 7])
    with torch.no_grad():
        reference = F.linear(torch.relu(F.linear(x, model.up.weight[keep], model.up.bias[keep]))
                             .mean(-2), model.head.weight[:, keep], model.head.bias)
    prune_channels(model, {"up": keep})
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference, rtol=1e-5, atol=1e-5)
    refused = {p.path: p.refused for p in plan_model(TokenMean(1))}["up"]
    assert refused is not None and "rank is unknown" in refused and "dim=-2" in refused
    assert "over its channel dimension" in str(
        {p.path: p.refused for p in plan_model(TokenMean(-1))}["up"])
