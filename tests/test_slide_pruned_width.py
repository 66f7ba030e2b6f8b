"""slide's row names the width a wide layer it left dense has when the row is made.

Why: the row's text was built when SLIDE saw the layer, before gpu_kernels pruned it, so a
hidden layer cut from 5000 to 2500 outputs was reported as "5000 outputs"."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelopt

pytestmark = pytest.mark.timeout(120)


def _rows(tmp_path: Path, at: int) -> tuple[nn.Module, list]:
    """A 16-600-10 MLP (the 600-wide hidden layer is wide but not the output: SLIDE leaves it
    dense) under slide and gpu_kernels pruning 50% at iteration ``at``; the model and rows."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(10, (32,))
    model = nn.Sequential(nn.Linear(16, 600), nn.ReLU(), nn.Linear(600, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = accelopt.attach(model, ["+plugins=[slide,gpu_kernels]",
                                     "plugins.gpu_kernels.prune_amount=0.5",
                                     "plugins.slide.min_width=256",
                                     f"plugins.gpu_kernels.prune_at_iteration={at}"],
                             example=(x, y), optimizer="adam", lr=1e-2, iterations=2,
                             run_dir=tmp_path / f"at{at}")
        opt = torch.optim.Adam(ao.model.parameters(), lr=1e-2)
        for _ in ao.loop(range(2)):
            loss = F.cross_entropy(ao.model(x), y)
            opt.zero_grad()
            ao.backward(loss)
            ao.step(opt)
        rows = ao.close()
    return ao.model, rows


@pytest.mark.parametrize("at", [0, 1])
def test_left_dense_layer_is_named_at_its_pruned_width(tmp_path: Path, at: int) -> None:
    model, rows = _rows(tmp_path, at)
    assert model[0].out_features == 300  # gpu_kernels cut it after SLIDE's build
    (row,) = [r for r in rows if r.plugin == "slide"]
    assert "wide layers left dense" in row.summary, row.summary
    assert "(300 outputs as trained, 600 when SLIDE saw it, not the output layer" in row.summary


def test_left_dense_without_its_model_falls_back_to_the_width_seen() -> None:
    """The model gone (a finished job's, not kept alive for the row): the width SLIDE saw."""
    from accelopt_plugins.slide.plugin import LeftDense

    layer = nn.Linear(4, 700)
    entry = LeftDense("job:0", "not the output layer", layer, None, "0")
    assert str(entry) == "job:0 (700 outputs, not the output layer)"
    del layer
    assert str(entry) == "job:0 (700 outputs, not the output layer)"
    assert str(LeftDense("job:emb", "sparse input, frozen")) == "job:emb (sparse input, frozen)"
