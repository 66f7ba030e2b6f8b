"""A model with lazy layers (``nn.LazyLinear`` before its first forward pass) is refused in
one line naming the parameter and the fix: the parameter table read its size and torch's
several-line ValueError came out of the core as a traceback, with or without plugins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from accelopt.errors import UserError
from accelopt.job.params import param_table

pytestmark = pytest.mark.timeout(120)

LINE = ("the model has uninitialized parameters ('1.weight' of a lazy module, LazyLinear): run "
        "one forward pass on a batch before handing the model over (model(example)), or give "
        "the layer its input size (nn.Linear instead of nn.LazyLinear)")


def make_lazy_net(*, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A model factory for ``workload.jobs.0.model=`` whose first layer is lazy."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, num_classes))


def test_the_parameter_table_refuses_a_lazy_model_and_takes_it_once_materialised() -> None:
    model = make_lazy_net(input_shape=(4,), num_classes=2)
    with pytest.raises(UserError) as info:
        param_table(model)
    assert str(info.value) == LINE
    model(torch.zeros(2, 4))  # one forward pass materialises it
    assert [p.shape for p in param_table(model)] == [(8, 4), (8,), (2, 8), (2,)]


def test_attach_refuses_a_lazy_model_in_one_line(tmp_path: Path) -> None:
    import accelopt

    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    with pytest.raises(UserError) as info:
        accelopt.attach(make_lazy_net(input_shape=(4,), num_classes=2), [], example=(x, y),
                        optimizer="sgd", lr=0.1, run_dir=str(tmp_path / "run"))
    assert str(info.value) == LINE


def test_the_command_refuses_a_lazy_model_in_one_line_with_exit_2(tmp_path: Path) -> None:
    from clirun import accelopt

    result = accelopt("run", "workload=single",
                      "workload.jobs.0.model=test_rows_lazy_model:make_lazy_net",
                      "workload.jobs.0.dataset=synthetic_vectors", "run.compare=none",
                      "run.progress=false", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {LINE}"]
