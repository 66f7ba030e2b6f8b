"""gpu_kernels reports and layouts that were silently wrong: pruning after N iterations left
the layers it sliced in the default layout under ``channels_last=on``, FLOPs did not say on
what batch they were counted (a cluster rank's share read as a different model), and layer
types the pruner has no rule for (Conv1d, Conv3d) were missing from the refused layers."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from accelopt_plugins.gpu_kernels.plugin import _refused_part
from accelopt_plugins.gpu_kernels.pruning import node_prune
from torch import nn

import accelopt

pytestmark = pytest.mark.timeout(120)

CL = torch.channels_last


class SmallCNN(nn.Module):
    """Pruned at 50%: ``down.weight`` becomes (8, 4, 3, 3), whose NCHW and NHWC strides
    differ (unlike a 1x1 kernel or a single channel)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.stem(x)))
        h = F.relu(self.down(h))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _run(tmp_path: Path, name: str, overrides: list[str], rows: int = 16,
         iterations: int = 4) -> dict[str, Any]:
    """One attached run of SmallCNN on a fixed batch: its losses, the gpu_kernels row, and
    the model and optimizer as they end."""
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = torch.randn(rows, 3, 8, 8), torch.randint(4, (rows,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = accelopt.attach(model, ["+plugins=[gpu_kernels]", *overrides], example=(x, y),
                             optimizer="sgd", lr=0.05, iterations=iterations,
                             run_dir=tmp_path / name)
        opt = torch.optim.SGD(ao.model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for _ in ao.loop(range(iterations)):
            loss = F.cross_entropy(ao.model(x), y)
            opt.zero_grad()
            ao.backward(loss)
            ao.step(opt)
            losses.append(float(loss))
        (row,) = [r for r in ao.close() if r.plugin == "gpu_kernels"]
    return {"losses": losses, "row": row, "model": ao.model, "opt": opt}


LATE = ["plugins.gpu_kernels.prune_amount=0.5", "plugins.gpu_kernels.prune_at_iteration=2"]


def test_late_pruning_keeps_channels_last_on_the_sliced_layers(tmp_path: Path) -> None:
    """The sliced layers were rebuilt NCHW and stayed so for the rest of the job, the row
    saying "channels_last on (forced on)"."""
    on = _run(tmp_path, "on", [*LATE, "plugins.gpu_kernels.channels_last=on"])
    model, opt = on["model"], on["opt"]
    assert "node-pruned" in on["row"].summary and "channels_last on" in on["row"].summary
    assert tuple(model.down.weight.shape) == (8, 4, 3, 3)
    for name, p in model.named_parameters():
        if p.dim() == 4:
            assert p.is_contiguous(memory_format=CL) and not p.is_contiguous(), name
    # the optimizer steps the model's live parameters, its sliced momentum in their layout
    live = {id(p) for p in model.parameters()}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == live
    buf = opt.state[model.down.weight]["momentum_buffer"]
    assert buf.shape == model.down.weight.shape and buf.is_contiguous(memory_format=CL)
    # the layout changes no number: the same run without channels_last
    off = _run(tmp_path, "off", LATE)
    torch.testing.assert_close(on["losses"], off["losses"], rtol=1e-4, atol=1e-5)
    assert off["model"].down.weight.is_contiguous()


def test_flops_say_the_batch_they_were_counted_on(tmp_path: Path) -> None:
    """6967296->2041856 single-process and 3483648->1020928 in a two-rank cluster for the
    same job, nothing saying the second was one rank's half batch: per row they agree."""
    build = ["plugins.gpu_kernels.prune_amount=0.5"]
    full, half = _run(tmp_path, "b16", build, 16, 1), _run(tmp_path, "b8", build, 8, 1)
    for rows, run in ((16, full), (8, half)):
        m = run["row"].metrics
        assert f"per batch of {rows} rows" in run["row"].summary, run["row"].summary
        assert m["flops_batch_rows"] == rows
        assert m["flops_dense_per_row"] * rows == m["flops_dense"]
        assert m["flops_pruned_per_row"] * rows == m["flops_pruned"]
    a, b = full["row"].metrics, half["row"].metrics
    assert a["flops_dense"] == 2 * b["flops_dense"]
    assert (a["flops_dense_per_row"], a["flops_pruned_per_row"]) == (
        b["flops_dense_per_row"], b["flops_pruned_per_row"])
    late = _run(tmp_path, "late", LATE, 16, 3)["row"]
    m = late.metrics
    assert "per batch of 16 rows" in late.summary and m["flops_batch_rows"] == 16
    assert m["flops_before_per_row"] * 16 == m["flops_before"]
    assert m["flops_after_per_row"] * 16 == m["flops_after"]


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Conv1d(8, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.a(x)))
        return self.fc(self.act(self.b(h)).mean(2))


class Conv3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(1, 4, 3, padding=1)
        self.t = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x)).mean(2)
        return self.fc(F.relu(self.t(h)).mean((2, 3)))


def test_layer_types_without_a_rule_are_refused_with_the_type() -> None:
    """Two Conv1d read "no prunable layer; refused 1: fc", as if the convs were fine."""
    report = node_prune(Conv1dNet(), 0.5)
    assert report.pruned == {}
    assert report.refused["a"] == report.refused["b"] == "not a prunable layer type: Conv1d"
    assert set(report.refused) == {"a", "b", "fc"}  # no BatchNorm, no parameter-free ReLU
    assert _refused_part(report.refused).startswith(
        "refused 3: a: not a prunable layer type: Conv1d; b: not a prunable layer type: Conv1d")
    report = node_prune(Conv3dNet(), 0.5)
    assert report.refused["a"] == "not a prunable layer type: Conv3d"
    assert report.refused["t"] == "not a prunable layer type: ConvTranspose2d"


def test_a_custom_layer_holding_its_own_weights_is_refused_as_a_whole() -> None:
    """Another plugin's layer (slide's sparse input) holds its own weight: listed once by its
    type, with no entry for anything inside it."""
    from accelopt_plugins.slide.xcmodel import XCNet

    report = node_prune(XCNet(100, 50), 0.5)
    assert report.pruned == {}
    assert report.refused["embed"] == "not a prunable layer type: SparseInput"
    assert set(report.refused) == {"embed", "out"}
