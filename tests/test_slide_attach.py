"""SLIDE's layers under ``accelopt.attach`` where they cannot do what the loop asks: they
update their own weights inside backward, so a ``GradScaler`` would reach them as the
gradient times its scale (Adam's moments went to inf at a large scale while ``ao.step``
returned True), and accumulation over several ``ao.backward`` per ``ao.step`` took one step
per micro-batch. Both were silent; each is refused in one line. Small model, fixed seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import accelopt
from accelopt.errors import UserError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_numba_thread")]


def _attached(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 4096, (64,))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4096))
    ao = accelopt.attach(model, ["+plugins=[slide]"], example=(x, y), optimizer="adam",
                         lr=1e-3, run_dir=tmp_path / "run")
    opt = torch.optim.Adam(ao.model.parameters(), lr=1e-3)
    return ao, opt, x, y


def _steps(ao) -> int:
    return int(ao.model[2].steps.max())


def test_a_grad_scaler_is_refused_naming_slide_and_the_fix(tmp_path):
    ao, opt, x, y = _attached(tmp_path)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    with ao.iteration(), pytest.raises(UserError) as refused:
        loss = F.cross_entropy(ao.model(x), y)
        opt.zero_grad()
        ao.backward(loss, scaler)
    line = str(refused.value)
    assert "\n" not in line and "plugin 'slide'" in line and "GradScaler" in line
    assert "bf16" in line
    assert _steps(ao) == 0  # refused before backward: the layer never took the scaled step
    ao.close()


def test_accumulation_in_one_iteration_is_refused_at_the_second_backward(tmp_path):
    ao, opt, x, y = _attached(tmp_path)
    with ao.iteration():
        opt.zero_grad()
        ao.backward(F.cross_entropy(ao.model(x[:32]), y[:32]))
        with pytest.raises(UserError) as refused:
            ao.backward(F.cross_entropy(ao.model(x[32:]), y[32:]))
    line = str(refused.value)
    assert "\n" not in line and "plugin 'slide'" in line and "accumulat" in line
    assert _steps(ao) == 1
    ao.close()


def test_accumulation_across_iterations_is_refused_at_the_step(tmp_path):
    ao, opt, x, y = _attached(tmp_path)
    with pytest.raises(UserError, match="several ao.backward calls before one ao.step"):
        for i, (xb, yb) in enumerate(ao.loop(zip(x.split(16), y.split(16), strict=True))):
            ao.backward(F.cross_entropy(ao.model(xb), yb))
            if i % 4 == 3:
                ao.step(opt)
                opt.zero_grad()
    ao.close()


def test_one_backward_per_step_trains_as_before(tmp_path):
    ao, opt, x, y = _attached(tmp_path)
    for xb, yb in ao.loop(zip(x.split(32), y.split(32), strict=True)):
        opt.zero_grad()
        ao.backward(F.cross_entropy(ao.model(xb), yb))
        assert ao.step(opt)
    assert _steps(ao) == 2
    ao.close()
