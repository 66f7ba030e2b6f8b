"""Arguments of ``accelopt.run`` and ``accelopt.attach`` of the wrong type, refused in one
line where they are given (they failed far away with a raw AttributeError or TypeError, a
string console only in ``close()``, after the loop had trained, losing its report); an
optimizer over none of the attached model's parameters refused at ``ao.step``; and
``metrics.json``'s ``run.warnings`` present on a clean run."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import accelopt
from accelopt import ConfigError, UserError
from accelopt.report.metrics import to_json_dict

pytestmark = pytest.mark.timeout(120)

WRONG = {"registry": ("x", "registry= takes an accelopt.plugin.Registry"),
         "console": ("x", "console= takes a rich.console.Console"),
         "run_dir": (5, "run_dir= takes a path")}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randint(2, (16,), generator=generator)


def train(ao: Any, optimizer: torch.optim.Optimizer, iterations: int = 3) -> None:
    x, y = batch()
    for _ in ao.loop(range(iterations)):
        optimizer.zero_grad()
        ao.backward(F.cross_entropy(ao.model(x), y))
        ao.step(optimizer)


@pytest.mark.parametrize("argument", sorted(WRONG))
def test_run_refuses_an_argument_of_the_wrong_type_in_one_line(argument, tmp_path,
                                                                monkeypatch) -> None:
    """registry="x" and console="x" gave an AttributeError, run_dir=5 a TypeError from
    pathlib: now one line naming the argument, what it got and what it takes."""
    monkeypatch.chdir(tmp_path)
    value, takes = WRONG[argument]
    with pytest.raises(ConfigError, match=f"^accelopt.run: {takes}") as caught:
        accelopt.run(["workload=tiny", "+plugins=[offload]"], **{argument: value})
    assert "\n" not in str(caught.value) and repr(value) in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("argument", sorted(WRONG))
def test_attach_refuses_an_argument_of_the_wrong_type_before_the_model_is_touched(
        argument, tmp_path) -> None:
    """console="x" was accepted, the loop trained, and close() failed on 'str' object has
    no attribute 'print'."""
    model = mlp()
    value, takes = WRONG[argument]
    kwargs = {"run_dir": tmp_path / "r", argument: value}
    with pytest.raises(ConfigError, match=f"^accelopt.attach: {takes}"):
        accelopt.attach(model, ["+plugins=[offload]"], **kwargs)
    assert not (tmp_path / "r").exists()
    ao = accelopt.attach(model, ["+plugins=[offload]"], run_dir=tmp_path / "r")  # not held
    ao.close()


class _FailingConsole(Console):
    """A console whose printing fails (a closed file, a broken pipe)."""

    def print(self, *args: Any, **kwargs: Any) -> None:
        raise OSError("the console's file is closed")


def test_close_keeps_the_report_when_the_console_fails_to_print(tmp_path) -> None:
    """close() released the run directory and kept the rows, then printed, then wrote
    report.json: a failing print lost the report, and a second close() returned the rows
    as if all had gone well."""
    model = mlp()
    ao = accelopt.attach(model, ["+plugins=[clip]"], run_dir=tmp_path / "r",
                         console=_FailingConsole())
    train(ao, torch.optim.SGD(ao.model.parameters(), lr=0.1))
    with pytest.raises(OSError, match="closed"):
        ao.close()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["iterations"] == 3 and [r["plugin"] for r in report["plugin_rows"]] == ["clip"]
    assert [r.plugin for r in ao.close()] == ["clip"]


def test_step_refuses_an_optimizer_over_none_of_the_models_parameters(tmp_path) -> None:
    """An optimizer over another model's parameters stepped silently: the attached model
    never trained and clip's row said "clipped 0 of 5 optimizer steps"."""
    ao = accelopt.attach(mlp(), ["+plugins=[clip]"], run_dir=tmp_path / "r")
    other = torch.optim.SGD(nn.Linear(8, 2).parameters(), lr=0.1)
    with pytest.raises(UserError, match=r"^ao.step\(opt\): the optimizer holds none of the "
                                        "attached model's parameters") as caught:
        train(ao, other)
    assert "\n" not in str(caught.value) and "ao.model.parameters()" in str(caught.value)
    ao.close()


def test_step_accepts_an_optimizer_over_some_of_the_models_parameters(tmp_path) -> None:
    """A GAN's optimizers each hold part of the model, a frozen part is in none: accepted,
    and the part it holds trains."""
    model = mlp()
    ao = accelopt.attach(model, ["+plugins=[clip]"], run_dir=tmp_path / "r")
    head = ao.model[2]
    before = [p.detach().clone() for p in ao.model[0].parameters()]
    weight = head.weight.detach().clone()
    train(ao, torch.optim.SGD(head.parameters(), lr=0.1))
    assert not torch.equal(head.weight, weight)
    assert all(torch.equal(a, b) for a, b in zip(before, ao.model[0].parameters(), strict=True))
    (row,) = ao.close()
    assert "of 3 optimizer steps" in row.summary


def test_metrics_json_has_run_warnings_on_a_clean_run() -> None:
    """``run.warnings`` was written only when there were some: m["run"]["warnings"] gave a
    KeyError on a clean run, where the docs name the key."""
    from accelopt.records import RunInfo, RunRecord

    record = RunRecord(info=RunInfo("runs/x", "cpu", ("offload",), (), 0))
    assert to_json_dict(record)["run"]["warnings"] == []
    record.warnings = ["plugins.offload.x has no effect"]
    assert to_json_dict(record)["run"]["warnings"] == ["plugins.offload.x has no effect"]
